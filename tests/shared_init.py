"""Tests start a layout's train state from one program per model and optimizer, not one per layout.

`Trainer.init_state` compiles the init for its layout (each device builds only its shards: what a
large model needs). Its values do not depend on the layout, so the test process replaces it
(tests/conftest.py) with `shared_init_state`: the same function jitted without shardings, on one
device, then placed by `device_put`. Layouts with the same model, optimizer and sync build the same
unsharded program, which the run's compilation cache answers after its first compile (about 200
init compiles a run, 1-3 CPU s each). tests/test_shared_init.py checks, layout family by family,
that it equals the real init in values, dtypes and shardings; a test marked `real_init` (and every
`jaxpar` process a test starts) runs the real one.
"""
from __future__ import annotations

import jax

from jaxpar.train.trainer import Trainer

REAL_INIT = Trainer.init_state


def shared_init_state(self: Trainer) -> dict:
    if self.cfg.train.init_from:  # params from files, placed on the shardings: the real path
        return REAL_INIT(self)
    state = jax.jit(self.init_fn.__wrapped__, static_argnums=0)(self.cfg.train.seed)
    return jax.device_put(state, self.spec.state_shardings)
