"""Loss scaling for float16 compute (train.loss_scale).

float16 keeps 5 exponent bits: a gradient below 6e-8 is zero and one below 6e-5 loses bits. The
backward of a mean token loss runs through activations whose gradients are that small (1/tokens of
a probability), so float16 steps lose them. The step differentiates `scale x loss` instead (the
backward's float16 values `scale` times larger) and divides the float32 gradients by `scale`
before the gradient sync reads them (the layer stacks reduced inside the backward scan in their
taps, train/layer_grads.py; the rest after accumulation): with a power of two both are exact, the
division fuses into the convert that is there anyway, and what the syncs keep across steps
(error feedback, 1-bit Adam's momentum, local SGD's replicas) never holds scaled values.

`dynamic` (the default with float16): the scale starts at DYNAMIC_INIT; a step whose gradients are not
finite (an overflow) is skipped (no update, like train.skip_nonfinite) and halves the scale; after
`window` finite steps in a row it doubles. The state ({"scale", "good", "overflows"}: the scale,
the finite steps since it last changed, the overflow steps so far) lives in the train state, so
checkpoints keep it; the scale and the overflow count are logged (`loss_scale`,
`overflow_steps`). An overflow is the scaler's business, not a bad step: the non-finite watch
(train.max_nonfinite) counts only a loss that is not finite, or gradients that overflow at the
smallest scale (`minimum`).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.config import TrainConfig

# the dynamic scale's start: the largest power of two below float16's max (65504); the first
# steps halve it as far as the model needs
DYNAMIC_INIT = 2.0 ** 15
MINIMUM = 1.0


@dataclass(frozen=True)
class LossScale:
    """How the step scales its loss: `static` (a constant) or `dynamic` (state in the train
    state under STATE_KEY); `value` is the constant or the dynamic scale's start."""

    mode: str = "none"  # none | static | dynamic
    value: float = 1.0
    window: int = 1000
    minimum: float = MINIMUM

    STATE_KEY = "loss_scale"

    @property
    def dynamic(self) -> bool:
        return self.mode == "dynamic"

    def init_state(self) -> dict:
        """The train state's entries of this scaler ({} unless dynamic)."""
        if not self.dynamic:
            return {}
        return {self.STATE_KEY: {"scale": jnp.float32(self.value), "good": jnp.int32(0),
                                 "overflows": jnp.int32(0)}}

    def state_specs(self) -> dict:
        return {self.STATE_KEY: {"scale": P(), "good": P(), "overflows": P()}} if self.dynamic else {}

    def current(self, state: dict) -> jax.Array | None:
        """The scale of this step (None: the loss is not scaled)."""
        if self.dynamic:
            return state[self.STATE_KEY]["scale"]
        return None if self.mode == "none" else jnp.float32(self.value)

    def next_state(self, state: dict, finite: jax.Array) -> dict:
        """The scaler's state after a step whose gradients were `finite` or not."""
        s = state[self.STATE_KEY]
        good = jnp.where(finite, s["good"] + 1, 0)
        grow = good >= self.window
        scale = jnp.where(finite, jnp.where(grow, s["scale"] * 2, s["scale"]),
                          jnp.maximum(s["scale"] / 2, self.minimum))
        return {"scale": scale, "good": jnp.where(grow, 0, good),
                "overflows": s["overflows"] + jnp.where(finite, 0, 1)}


def loss_scale_of(train: TrainConfig) -> LossScale:
    """The scaler train.loss_scale asks for (`auto`: dynamic with float16 compute, else none)."""
    v = train.loss_scale
    if v == "auto":
        v = "dynamic" if train.compute_dtype == "float16" else "none"
    if v == "dynamic":
        return LossScale("dynamic", DYNAMIC_INIT, train.loss_scale_window)
    if v == "none":
        return LossScale()
    return LossScale("static", float(v))

