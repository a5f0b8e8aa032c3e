"""Tests start a layout's train state from one init per model and optimizer, not one per layout.

`Trainer.init_state` compiles the init for its layout (each device builds only its shards: what a
large model needs). Its values do not depend on the layout, so the test process replaces it
(tests/conftest.py) with `shared_init_state`: the same function run without shardings, on one
device, then placed by `device_put`. Its values are kept on the host, keyed by the function's
jaxpr (and constants): a layout with the same model, optimizer and sync as an earlier test's only
traces it (milliseconds; lowering the init's random draws alone takes about half a second, its
compile 1-3 s, and a run builds about 200). tests/test_shared_init.py checks, layout family by
family, that it equals the real init in values, dtypes and shardings; a test marked `real_init`
(and every `jaxpar` process a test starts) runs the real one.
"""
from __future__ import annotations

import collections
import hashlib

import jax
import numpy as np

from jaxpar.train.trainer import Trainer

REAL_INIT = Trainer.init_state
_KEEP = 16  # host states kept (a tiny model's is a few MB)
_states: collections.OrderedDict = collections.OrderedDict()


def _key(closed) -> str:
    """A digest of a closed jaxpr: its equations and its constants' values."""
    h = hashlib.sha256(str(closed.jaxpr).encode())
    for c in closed.consts:
        c = np.asarray(c)
        h.update(f"{c.dtype}{c.shape}".encode())
        h.update(np.ascontiguousarray(c).tobytes())
    return h.hexdigest()


def shared_init_state(self: Trainer) -> dict:
    if self.cfg.train.init_from:  # params from files, placed on the shardings: the real path
        return REAL_INIT(self)
    traced = jax.jit(self.init_fn.__wrapped__, static_argnums=0).trace(self.cfg.train.seed)
    key = _key(traced.jaxpr)
    if key not in _states:  # compiled from the same trace (the persistent cache answers repeats)
        _states[key] = jax.device_get(traced.lower().compile()())
        if len(_states) > _KEEP:
            _states.popitem(last=False)
    _states.move_to_end(key)
    return jax.device_put(_states[key], self.spec.state_shardings)
