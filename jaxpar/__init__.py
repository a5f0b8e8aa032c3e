"""jaxpar: one named device mesh for data, ZeRO, tensor, pipeline and expert parallelism.

The public API for training scripts:

    cfg = jaxpar.load_config("configs/quickstart.yaml", ["train.steps=20"])
    trainer = jaxpar.Trainer(cfg, model_factory=lambda rngs: MyModel(rngs))
    state, history = trainer.fit()

Models annotate params with `jaxpar.nn.param(..., axes=(...))` and activations with
`jaxpar.nn.constrain(x, (...))`, in logical axis names only.
"""
from __future__ import annotations

import importlib

# Exported lazily (PEP 562), so that `import jaxpar.config` (or `jaxpar --help`) loads no jax.
_EXPORTS = {
    "Config": "jaxpar.config",
    "ConfigError": "jaxpar.config",
    "load_config": "jaxpar.config",
    "make_config": "jaxpar.config",
    "build_mesh": "jaxpar.mesh",
    "Plan": "jaxpar.sharding",
    "Trainer": "jaxpar.train.trainer",
}

__all__ = ["Config", "ConfigError", "Plan", "Trainer", "build_mesh", "load_config", "make_config"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    try:  # a submodule, as `jaxpar.nn` after `import jaxpar`
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
