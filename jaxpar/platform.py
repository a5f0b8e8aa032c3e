"""The platform a program is built for: its mesh's devices, not `jax.default_backend()`.

The two differ when a step is compiled for devices the host process does not run on (a
deviceless compile for 8 GPUs on a CPU machine: scripts/gpu_aot.py) or when a CPU mesh is
chosen on a GPU machine. What is traced for the program (the attention implementation, bf16 on
the wire) must follow the devices it will run on."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import jax

_building_for: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxpar_platform", default=None)


def current() -> str:
    """The platform of the program being traced ("cpu", "gpu", "tpu"): the one set by
    building_for around its lowering, else the default backend's."""
    return _building_for.get() or jax.default_backend()


@contextlib.contextmanager
def building_for(platform: str) -> Iterator[None]:
    """Trace inside this block for `platform` (a device's `.platform`)."""
    token = _building_for.set(platform)
    try:
        yield
    finally:
        _building_for.reset(token)
