"""What a model needs from jaxpar, in logical axis names only.

- `param(...)`: an `nnx.Param` whose dims carry logical names (metadata `axes`).
- `constrain(x, axes)`: an activation sharding hint by logical names.
- `project(spec, x, w)`: an activation x times a weight w, by an einsum spec (every projection).
- `experts(x, idx, gates, ffn, ragged_ffn, ...)`: mixture-of-experts dispatch -> expert MLPs ->
  combine; a plain local computation, or an all_to_all over the expert devices in a step.
- `attention(q, k, v, segment_ids, implementation=...)`: causal (GQA) attention by one of
  jaxpar/attention's implementations, or by a strategy's `Context.attention` (context parallel).
- `sow(name, value, loss_weight=None)`: report an auxiliary value (router losses, expert
  load); the train step adds `loss_weight * value` to the loss and logs the value.
- `scan_layers(stack, x, fn)`: run a stack of layers (params with a leading `layers` dim) with
  `lax.scan`; the train step hooks in here to gather ZeRO-3 shards per layer, cast to the compute
  dtype and apply the remat policy, so the model itself stays free of parallelism.
Outside a jaxpar step every hook is the identity and the model runs as plain JAX (MoE: the local
dispatch that jaxpar/parallel/expert.py injects with `set_default_experts`).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar import attention as attention_ops
from jaxpar.sharding import varying_axes, vary_together

AxisNames = tuple[str | None, ...]
Q_AXES: AxisNames = ("batch", "seq", "heads", "head_dim")  # attention's q and output
KV_AXES: AxisNames = ("batch", "seq", "kv_heads", "head_dim")  # its k and v


@dataclass(frozen=True)
class Context:
    constrain: Callable[[jax.Array, AxisNames], jax.Array] = lambda x, axes: x
    # How the compiler's mesh axes split an activation of these logical axes, inside the step's
    # shard_map (a PartitionSpec; None: not inside one). Ops that must run with every axis
    # manual there (cuDNN attention: jaxpar/manual.py) lay their operands out by it.
    spec: Callable[[AxisNames], Any] | None = None
    layer_params: Callable[[Any], Any] = lambda state: state  # one layer's nnx.State -> ready params
    remat: str = "none"
    never_save: tuple[str, ...] = ()  # checkpoint names the backward must recompute (ZeRO-3 gathers)
    # Mixture-of-experts dispatch/combine (jaxpar/parallel/expert.py); None: the default one.
    experts: Callable[..., Any] | None = None
    # Attention (q, k, v, segment_ids, **options) -> out; None: jaxpar.attention.attention on this
    # device. A context-parallel strategy puts its ring / all-to-all attention here.
    attention: Callable[..., jax.Array] | None = None
    # A per-sequence sum over this device's tokens -> the sum over the whole sequences: context
    # parallelism puts its sum over the devices sharing each sequence here; None: the identity.
    sequence_sum: Callable[[jax.Array], jax.Array] | None = None
    # The output head (x [b, s, d], w [d, vocab]) -> logits; None: the einsum. With
    # train.loss_chunk the step defers it (train/loss.DeferredLogits): the loss forms the logits a
    # chunk of tokens at a time, so the whole [b, s, vocab] never exists.
    head: Callable[[jax.Array, jax.Array], Any] | None = None
    # When set, scan_layers(stack, carry, fn) returns layers_hook(stack, carry, fn): the pipeline
    # uses it to cut a model into embedding / layer stages / head (see jaxpar/parallel/pipeline).
    layers_hook: Callable[[nnx.Module, Any, Callable], Any] | None = None
    # Per-layer arrays scanned beside the stack's params: an object with `xs` (a pytree whose
    # leaves have the leading layers dim) and `apply(layer_state, xs_slice) -> layer_state`,
    # run on each layer's params as the scan slices them, before `layer_params` (so what a
    # tap's backward sees is the gradient of the slice: after the transpose of a gather). The
    # train step taps each layer's params here so that their gradient is reduced inside the
    # backward scan (jaxpar/train/layer_grads.py).
    layer_taps: Any = None


_CTX: contextvars.ContextVar[Context] = contextvars.ContextVar("jaxpar_nn", default=Context())
# The MoE dispatch when the context names none (all experts on this device): injected by
# jaxpar/parallel/expert.py when it is imported, so that this module knows no strategy.
_default_experts: Callable[..., Any] | None = None


def set_default_experts(fn: Callable[..., Any]) -> None:
    global _default_experts
    _default_experts = fn


@contextlib.contextmanager
def use_context(ctx: Context):
    token = _CTX.set(ctx)
    try:
        yield ctx
    finally:
        _CTX.reset(token)


def current() -> Context:
    return _CTX.get()


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: AxisNames, *, std: float | None = 0.02,
          ones: bool = False, dtype=jnp.float32) -> nnx.Param:
    """A parameter with logical axis names. `ones` for norm scales, else normal(std)."""
    if len(shape) != len(axes):
        raise ValueError(f"shape {shape} and axes {axes} differ in length")
    if ones:
        value = jnp.ones(shape, dtype)
    else:
        value = std * jax.random.normal(rngs.params(), shape, dtype)
    return nnx.Param(value, axes=tuple(axes))


def axes_of(variable: nnx.Variable) -> AxisNames | None:
    return variable.get_metadata().get("axes")


def constrain(x: jax.Array, axes: AxisNames) -> jax.Array:
    return _CTX.get().constrain(x, axes)


def project(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """einsum(spec, x, w): activations x times a weight w, e.g. "bsd,df->bsf". The same math as
    the einsum, forward and backward; only the weight's gradient is formed differently: in w's
    own dim order, einsum(x, g) -> w. JAX's transpose of a dot forms it in the order (output
    dims, input dims) and then transposes it; XLA:CPU folds that transpose into the dot, leaving
    both of its operands transposed, which its library dots (YNNPACK) do not take: every weight
    gradient of the MLP and head then ran in XLA's own dot loops, ~10% of a float32 step
    (docs/benchmarks.md, session 14). A dim of w must appear in x or in the output."""
    return _project(spec, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _project(spec, x, w):
    return jnp.einsum(spec, x, w)


def _project_fwd(spec, x, w):
    return jnp.einsum(spec, x, w), (x, w)


def _project_bwd(spec, res, g):
    x, w = res
    ins, out = spec.split("->")
    xs, ws = ins.split(",")
    dx = jnp.einsum(f"{out},{ws}->{xs}", g, w)
    dw = jnp.einsum(f"{xs},{out}->{ws}", x, g)
    return _like_primal(dx, x), _like_primal(dw, w)


def _like_primal(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """A cotangent typed as its primal: its dtype, and inside a shard_map summed over the manual
    axes it varies over and the primal does not (what JAX's own transpose of the implicit
    broadcast does: a weight replicated over `data` gets the sum of the devices' gradients)."""
    extra = tuple(sorted(varying_axes(ct) - varying_axes(primal)))
    ct = jax.lax.psum(ct, extra) if extra else ct
    return ct.astype(primal.dtype)


_project.defvjp(_project_fwd, _project_bwd)


def experts(x: jax.Array, expert_idx: jax.Array, gates: jax.Array, ffn: Callable, ragged_ffn: Callable,
            **kw) -> tuple[jax.Array, jax.Array]:
    """Mixture-of-experts MLP of tokens x [groups, seq, embed] routed to experts `expert_idx`
    [groups, seq, k] with weights `gates`: returns (y like x, fraction of assignments dropped).
    `ffn(h [experts, tokens, embed])` and `ragged_ffn(rows [m, embed], group_sizes [experts])` run
    the experts whose weights this device holds. See jaxpar.parallel.expert.moe_apply for `kw`
    (token_weights: the tokens to route; weight-0 ones take no capacity and get zeros)."""
    fn = _CTX.get().experts or _default_experts
    if fn is None:
        raise RuntimeError("jaxpar.nn.experts: no MoE dispatch; import jaxpar.parallel.expert (the local "
                           "one) or pass one in nn.Context(experts=...)")
    return fn(x, expert_idx, gates, ffn, ragged_ffn, **kw)


def sequence_sum(x: jax.Array) -> jax.Array:
    """x: a sum over the tokens of each sequence that this device holds (per-sequence statistics,
    e.g. a router's expert fractions) -> the sum over the whole sequences. The identity but under
    context parallelism, where each device holds part of every sequence."""
    fn = _CTX.get().sequence_sum
    return x if fn is None else fn(x)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None, *,
              implementation: str = "auto", block: int = 512, threshold: int = 2048) -> jax.Array:
    """Causal attention, q [batch, seq, heads, head_dim], k and v [batch, seq, kv_heads,
    head_dim]; `segment_ids` [batch, seq]: no attention across a segment boundary. The options are
    model.attention, attention_block and attention_threshold (see jaxpar/attention)."""
    ctx = _CTX.get()
    fn = ctx.attention or attention_ops.attention
    layout = None if ctx.spec is None else (ctx.spec(Q_AXES), ctx.spec(KV_AXES))
    return fn(q, k, v, segment_ids, implementation=implementation, block=block, threshold=threshold,
              layout=layout)


_AUX: contextvars.ContextVar[dict | None] = contextvars.ContextVar("jaxpar_aux", default=None)


def head(x: jax.Array, w: jax.Array):
    """The logits x [batch, seq, embed] @ w [embed, vocab], or what the context's head makes of
    them (the step's loss may compute them chunk by chunk)."""
    fn = _CTX.get().head
    if fn is not None:
        return fn(x, w)
    return constrain(project("bsd,dv->bsv", x, w), ("batch", "seq", "vocab"))


@contextlib.contextmanager
def collect_aux():
    """Collects what `sow` reports while active: {name: (value, loss_weight or None)}."""
    out: dict = {}
    token = _AUX.set(out)
    try:
        yield out
    finally:
        _AUX.reset(token)


def sow(name: str, value: jax.Array, loss_weight: float | None = None) -> None:
    """Report an auxiliary value: a mean over this call's tokens (or sequences), so that the step
    can average it over devices and microbatches. With `loss_weight`, `loss_weight * value` is
    added to the training loss. Outside `collect_aux` it is dropped. Call it outside layer scans."""
    out = _AUX.get()
    if out is not None:
        if name in out:
            raise ValueError(f"sow: {name!r} reported twice")
        out[name] = (value, loss_weight)


REMAT_POLICIES: dict[str, Any] = {
    "none": jax.checkpoint_policies.everything_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def scan_layers(stack: nnx.Module, carry: Any, fn: Callable[[nnx.Module, Any], Any]) -> Any:
    """carry = fn(layer, carry) for each layer of `stack` (params stacked on a leading dim).
    A model calls it once, for its stack of layers; a pipeline runs the layers in stages."""
    ctx = _CTX.get()
    if ctx.layers_hook is not None:
        return ctx.layers_hook(stack, carry, fn)
    return scan_stack(stack, carry, fn)


def scan_stack(stack: nnx.Module, carry: Any, fn: Callable[[nnx.Module, Any], Any]) -> Any:
    """scan_layers without the hook: the layer scan itself (per-layer params hook and remat)."""
    ctx = _CTX.get()
    graphdef, state = nnx.split(stack)

    taps = ctx.layer_taps

    def body(c, xs):
        layer_state, tap_xs = xs
        if taps is not None:  # on the params as they arrive, before layer_params (a gather)
            layer_state = taps.apply(layer_state, tap_xs)
        return fn(nnx.merge(graphdef, ctx.layer_params(layer_state)), c), None

    if ctx.remat != "none" or ctx.never_save:
        body = jax.checkpoint(body, policy=remat_policy(ctx.remat, ctx.never_save), prevent_cse=False)
    xs = (state, None if taps is None else taps.xs)
    # A carry part that starts replicated (the MoE router-loss sums' zeros) varies once a layer
    # has added to it; typed so from the start, as scan needs (shard_map's check_vma).
    carry, _ = jax.lax.scan(body, vary_together(carry, xs), xs)
    return carry


def remat_policy(remat: str, never_save: tuple[str, ...] = ()):
    base = REMAT_POLICIES[remat]
    if not never_save:
        return base

    def policy(prim, *args, **params):
        # A named value must be recomputed, and so must the gather that produced it.
        if prim.name == "all_gather" or (prim.name == "name" and params.get("name") in never_save):
            return False
        if prim.name == "custom_vjp_call" and _gathers(params.get("call_jaxpr")):
            return False
        return base(prim, *args, **params)

    return policy


def _gathers(closed_jaxpr) -> bool:
    """Whether a custom-vjp body all-gathers (a ZeRO-3 weight gather: never saved), also inside
    the jaxprs it calls: beside tensor each device gathers its own block in a nested shard_map
    (parallel/data.on_own_block), and under remat "none" the gathered weights were then saved
    for the backward (every layer's, whole) instead of gathered again."""
    jaxpr = getattr(closed_jaxpr, "jaxpr", closed_jaxpr)
    return any(e.primitive.name == "all_gather" or any(map(_gathers, _called(e)))
               for e in getattr(jaxpr, "eqns", ()))


def _called(eqn):
    """The jaxprs an equation calls (a shard_map's, a pjit's, a custom vjp's...)."""
    for p in eqn.params.values():
        for v in p if isinstance(p, (tuple, list)) else (p,):
            if hasattr(getattr(v, "jaxpr", v), "eqns"):
                yield v
