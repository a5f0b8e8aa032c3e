"""jaxpar: one named device mesh for data, ZeRO, tensor, pipeline and expert parallelism.

The public API for training scripts:

    cfg = jaxpar.load_config("configs/quickstart.yaml", ["train.steps=20"])
    trainer = jaxpar.Trainer(cfg, model_factory=lambda rngs: MyModel(rngs))
    state, history = trainer.fit()

Models annotate params with `jaxpar.nn.param(..., axes=(...))` and activations with
`jaxpar.nn.constrain(x, (...))`, in logical axis names only.
"""
from jaxpar.config import Config, ConfigError, load_config, make_config
from jaxpar.mesh import build_mesh
from jaxpar.sharding import Plan
from jaxpar.train.trainer import Trainer

__all__ = ["Config", "ConfigError", "Plan", "Trainer", "build_mesh", "load_config", "make_config"]
__version__ = "0.1.0"
