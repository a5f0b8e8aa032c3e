"""1-bit Adam (Tang et al., 2021): exact Adam for a warm-up, then frozen variance and momentum
reduced with 1-bit compression and error feedback.

  warm-up (optimizer.onebit_warmup_steps steps): the gradients are all-reduced in float32 and
      Adam runs as usual (with global-norm clipping), building the variance nu;
  then:   nu is frozen (a fixed per-parameter preconditioner). Each device forms its own
      momentum b1 * m + (1 - b1) * g_local from the shared m and its local gradient, and the
      devices sum those with the onebit compressor (signs packed 8 per byte + a float32 scale per
      block, error feedback on both stages: base.two_stage_reduce). The sum is the new shared m;
      the update is lr * (m_hat / (sqrt(nu_hat) + eps) + wd * p). The gradient clipping
      factor is frozen too: the optimizer recovers the jointly sent gradient
      g~ = (m_new - b1 m) / (1 - b1) from the reduced momentum and scales it by the last warm-up
      step's factor before forming m (the global norm of the true gradient is never known).

Two pieces: `onebit_adam(...)`, the optax transformation (its state: count, mu, nu), and
`OneBitAdamReducer`, the step's data-parallel reduction, which looks at the optimizer state
(count, mu) to pick the phase (a lax.cond inside the shard_map) and returns the reduced
gradient during the warm-up and the new momentum after it. Under ZeRO the momentum is laid out
like what the optimizer receives (at ZeRO-1 each device's fsdp shard of the reduced momentum).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxpar.collectives.onebit import OneBit
from jaxpar.collectives.reducer import GradientReducer
from jaxpar.config import ConfigError
from jaxpar.sharding import ZERO_AXIS
from jaxpar.train.decay import decay_mask, schedule


class OneBitAdamState(NamedTuple):
    count: jax.Array
    mu: Any
    nu: Any
    clip: jax.Array  # the last warm-up step's clipping factor, frozen with nu


def onebit_adam(cfg, total_steps: int, axes_tree) -> optax.GradientTransformation:
    """The optimizer half: Adam until count == warm-up, then mu comes in reduced and nu is frozen."""
    lr = schedule(cfg, total_steps)
    mask = decay_mask(axes_tree)
    warmup, b1, b2, eps, wd = cfg.onebit_warmup_steps, cfg.b1, cfg.b2, cfg.eps, cfg.weight_decay

    def init(params):
        zeros = lambda: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        return OneBitAdamState(jnp.zeros([], jnp.int32), zeros(), zeros(), jnp.ones([], jnp.float32))

    def update(x, state, params=None):
        count = state.count
        warm = count < warmup
        x = jax.tree.map(lambda a: a.astype(jnp.float32), x)
        # warm-up: x is the gradient; after it, x = b1 m + (1 - b1) g~ (the reduced momentum), so
        # g~, the gradient the devices jointly sent, is recovered; it is scaled by the clipping
        # factor of the last warm-up step (frozen with nu, which was built from clipped gradients)
        g = jax.tree.map(lambda a, m: jnp.where(warm, a, (a - b1 * m) / (1 - b1)), x, state.mu)
        clip = state.clip
        if cfg.clip_norm is not None:
            norm = optax.tree.norm(g) if hasattr(optax, "tree") else optax.global_norm(g)
            clip = jnp.where(warm, jnp.minimum(1.0, cfg.clip_norm / jnp.maximum(norm, 1e-12)), clip)
            g = jax.tree.map(lambda a: a * clip, g)
        mu = jax.tree.map(lambda m, a: b1 * m + (1 - b1) * a, state.mu, g)
        nu = jax.tree.map(lambda v, a: jnp.where(warm, b2 * v + (1 - b2) * a * a, v), state.nu, g)
        t = count + 1
        bc1 = 1 - b1 ** t.astype(jnp.float32)
        bc2 = 1 - b2 ** jnp.minimum(t, warmup).astype(jnp.float32)  # warmup >= 1 (config)
        step = lr(count)

        def upd(m, v, p, decay):
            u = (m / bc1) / (jnp.sqrt(v / bc2) + eps)
            if decay:
                u = u + wd * p.astype(jnp.float32)
            return (-step * u).astype(p.dtype)

        updates = jax.tree.map(upd, mu, nu, params, mask)
        return updates, OneBitAdamState(t, mu, nu, clip)

    return optax.GradientTransformation(init, update)


class OneBitAdamReducer(GradientReducer):
    """The gradient reduction of 1-bit Adam (see module doc); residuals in state["comm"]. It
    reduces after the backward scan: what it exchanges is the momentum the whole step's
    gradient updates, with error feedback."""

    def __init__(self, opt_cfg, compression, plan, model, grad_specs, wire_dtype=None):
        if compression.method not in ("none", "onebit"):
            raise ConfigError(
                f"optimizer.name=onebit_adam compresses the momentum itself (1-bit); drop "
                f"gradient_compression.method={compression.method!r}")
        # the phase is the optimizer's (reduce() below): these two fields would be read by nothing
        if compression.warmup_steps:
            raise ConfigError(
                f"optimizer.name=onebit_adam runs float32 Adam for optimizer.onebit_warmup_steps="
                f"{opt_cfg.onebit_warmup_steps} before compressing; gradient_compression.warmup_steps="
                f"{compression.warmup_steps} does not apply: drop it (set onebit_warmup_steps instead)")
        if not compression.error_feedback:
            raise ConfigError(
                "optimizer.name=onebit_adam always compresses the momentum with error feedback (1-bit "
                "Adam, Tang et al.); gradient_compression.error_feedback=false does not apply: drop it")
        comp = OneBit(block_size=compression.block_size)
        super().__init__(compression, plan, model, grad_specs, compressor=comp, wire_dtype=wire_dtype)
        self.warmup, self.b1 = opt_cfg.onebit_warmup_steps, opt_cfg.b1

    def extra_inputs(self, state) -> dict:
        opt = state["opt_state"]
        opt = getattr(opt, "inner", opt)  # 1-bit Adam on float32 masters (train/precision.with_masters)
        return {"mu": opt.mu, "count": opt.count}

    def extra_specs(self) -> dict:
        return {"mu": self.final_out, "count": P()}  # laid out like what the optimizer receives

    def reduce(self, grads, comm, extra=None):
        leaves = self.treedef.flatten_up_to(grads)
        mus = self.treedef.flatten_up_to(extra["mu"])
        sizes = self.plan.mesh.shape
        n_of = {}
        for b in self.buckets:
            for i in b.leaves:
                n_of[i] = 1
                for a in b.rest:
                    n_of[i] *= sizes[a]

        def compressed(comm):
            # sum over devices of (b1 m / n + (1 - b1) g_local) = b1 m + (1 - b1) g; a gradient
            # with no axis to reduce over (n = 1: one device, or expert weights when the other
            # batch axes are 1) is not in a bucket, so _compressed hands this momentum back as it is
            local = [self.b1 * self._spread(m, i, n_of.get(i, 1)) + (1 - self.b1) * g.astype(jnp.float32)
                     for i, (g, m) in enumerate(zip(leaves, mus))]
            return self._compressed(jax.tree.unflatten(self.treedef, local), comm)

        def warm(comm):
            out = list(leaves)
            for b in self.buckets:
                for i in b.leaves:
                    out[i] = self._psum(leaves[i], self.zero1[i], b.rest)
            out = [o.astype(jnp.float32) for o in out]
            return jax.tree.unflatten(self.treedef, out), comm

        return jax.lax.cond(extra["count"] >= self.warmup, compressed, warm, comm)

    def _spread(self, m, i: int, n: int):
        """Leaf i's momentum as this device's share of the sum over its `n` reducing devices.
        At ZeRO-1 (the optimizer state sharded over fsdp, the gradient whole) the device holds
        only its fsdp shard f of m: it puts m_f / (n / fsdp) at shard f's place and zeros
        elsewhere, so the sum over the devices, of which n / fsdp hold shard f, is m there."""
        d = self.zero1[i]
        if d is None:
            return m / n
        f = self.plan.mesh.shape[ZERO_AXIS]
        whole = list(m.shape)
        whole[d] *= f
        at = jax.lax.axis_index(ZERO_AXIS) * m.shape[d]
        placed = jax.lax.dynamic_update_slice_in_dim(jnp.zeros(whole, m.dtype), m, at, axis=d)
        return placed / (n // f)
