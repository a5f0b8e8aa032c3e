"""Train your own flax NNX model with jaxpar: logical axis names in, any mesh out.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/custom_model.py [train.steps=50]
"""
import sys

import jax
import jax.numpy as jnp
from flax import nnx

import jaxpar
from jaxpar.nn import constrain, param


class BigramMLP(nnx.Module):
    """Embed each byte, mix it with its predecessor, an MLP, a vocab head. No mesh names here."""

    def __init__(self, vocab: int, dim: int, hidden: int, rngs: nnx.Rngs):
        self.embed = param(rngs, (vocab, dim), ("vocab", "embed"))
        self.w_in = param(rngs, (2 * dim, hidden), ("embed", "mlp"))
        self.w_out = param(rngs, (hidden, dim), ("mlp", "embed"))
        self.scale = param(rngs, (dim,), ("norm",), ones=True)
        self.head = param(rngs, (dim, vocab), ("embed", "vocab"))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = jnp.take(self.embed[...], tokens, axis=0)
        prev = jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1]
        h = jax.nn.gelu(jnp.concatenate([x, prev], -1) @ self.w_in[...])
        h = constrain(h, ("batch", "seq", "mlp"))
        x = (x + h @ self.w_out[...]) * self.scale[...]
        return constrain(x @ self.head[...], ("batch", "seq", "vocab"))


def main(overrides: list[str]) -> list[dict]:
    cfg = jaxpar.make_config(
        {"name": "custom", "mesh": {"data": 2, "fsdp": 2, "tensor": 2},
         "sharding": {"zero_stage": 3},
         "train": {"steps": 40, "global_batch": 16, "seq_len": 64, "compute_dtype": "float32",
                   "log_every": 10},
         "optimizer": {"lr": 1e-2, "warmup_steps": 5}},
        overrides,
    )
    trainer = jaxpar.Trainer(cfg, model_factory=lambda rngs: BigramMLP(256, 64, 256, rngs))
    print(trainer.banner())
    _, history = trainer.fit(out_dir=cfg.out_dir)
    for rec in history:
        print(f"step {rec['step']:4d}  loss {rec['loss']:.4f}  {rec['tokens_per_s']:.0f} tokens/s")
    return history


if __name__ == "__main__":
    main(sys.argv[1:])
