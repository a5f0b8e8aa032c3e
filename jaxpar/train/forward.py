"""The model's forward inside the train step: the nn.Context through which the strategies reach
into the model (activation constraints, expert dispatch, per-layer param gathers, remat), the
casts and ZeRO-3 gathers of the params outside the layer scan, and ZeRO-3's forward that gathers
the embedding and head again in the backward."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import jax
from flax import nnx

from jaxpar import nn
from jaxpar.parallel.context import ContextParallel, make_context
from jaxpar.parallel.data import GATHERED, param_preparer
from jaxpar.parallel.expert import expert_hook
from jaxpar.parallel.tensor import activation_constrainer, activation_spec
from jaxpar.sharding import Plan
from jaxpar.train.loss import DeferredLogits
from jaxpar.train.model import ModelDef


@dataclass(frozen=True)
class Forward:
    """forward(params, rows) -> (logits, sown) of a train.batch.Rows (this device's inputs, and
    their segment ids / positions when given); `ctx` and `prepare_top` are what the pipeline
    needs to cut the same forward into stages; `context.split(batch)` gives this device's Rows of
    a train.batch.Batch microbatch (its part of each sequence under context parallelism)."""

    ctx: nn.Context
    prepare_top: Callable
    run: Callable
    context: ContextParallel = ContextParallel()
    cast_layers: Callable = lambda state: state  # prepare_top's casts of the layer stacks alone

    def __call__(self, params, rows, taps=None):
        """`taps`: the nn.Context.layer_taps of this call (train/layer_grads.py), or None."""
        return self.run(params, rows, taps)


def make_forward(model: ModelDef, plan: Plan, manual: frozenset[str], compute_dtype, remat: str,
                 grad_dtype=None, loss_chunk: int | None = None, context: Any = None) -> Forward:
    """The forward of `model` inside a shard_map manual over `manual`, computing in
    `compute_dtype`; ZeRO-3's gradient reduce-scatters run in `grad_dtype`. With `loss_chunk`
    (train.loss_chunk) the "logits" are a train.loss.DeferredLogits for the chunked loss.
    `context` (config.ContextConfig): how sequences split over a manual `context` axis."""
    prepare = param_preparer(plan, manual, compute_dtype, grad_dtype)
    head = (lambda x, w: DeferredLogits(x, w, loss_chunk)) if loss_chunk else None
    cp = make_context(plan, context, manual)
    ctx = nn.Context(constrain=activation_constrainer(plan, manual), spec=activation_spec(plan, manual),
                     experts=expert_hook(plan, manual, cp),
                     layer_params=lambda st: prepare(st, stacked=True), remat=remat,
                     never_save=(GATHERED,) if plan.zero_stage >= 3 else (), head=head,
                     attention=cp.attention(), sequence_sum=cp.sequence_sum())
    stacked = {k for k, ax in model.leaves_with_paths(model.axes).items() if ax[:1] == ("layers",)}
    prepare_top = lambda st: _prepare_top(st, prepare, stacked)
    cast_layers = lambda st: _prepare_top(st, prepare, stacked, stacks_only=True)

    def forward(params, rows, taps=None):
        state = prepare_top(model.state(params))
        here = ctx if taps is None else dataclasses.replace(ctx, layer_taps=taps)
        with nn.use_context(here), nn.collect_aux() as sown:
            logits = rows.apply(model.merge(state))
        return logits, dict(sown)

    # ZeRO-3: embeddings and head are gathered again for the backward too
    run = never_save_ends(model, ctx, prepare_top) if ctx.never_save else forward
    return Forward(ctx, prepare_top, run, cp, cast_layers)


class _Stop(Exception):
    def __init__(self, value):
        super().__init__("stopped at the layer scan")
        self.value = value


def never_save_ends(model: ModelDef, ctx: nn.Context, prepare_top: Callable) -> Callable:
    """forward(params, rows, taps=None) -> (logits, sown) for ZeRO-3. What the model runs before its
    scan_layers call (the embedding) and after it (final norm, head) each run under a checkpoint
    that saves everything but the gathered weights (ctx.never_save), so the backward gathers them
    again; the layer scan runs between the two, outside any checkpoint, so that its per-layer
    policy (train.remat, which never saves the gathers either) is the one that acts. A checkpoint
    around the whole forward would not do: JAX partial-evaluates a checkpoint nested in another
    with the outer one's policy, which silently replaced every train.remat by "save all but the
    gathers". A model that never calls scan_layers runs whole under the checkpoint. The layer
    `taps` (train/layer_grads.py) act in the layer scan, on each layer's shards before their gather."""
    policy = nn.remat_policy("none", ctx.never_save)
    weights: dict = {}  # sown name -> loss weight (static, so kept out of the checkpoints)
    fired: list = []

    def call(params, rows, hook, prep: bool, taps=None):
        state = model.state(params)
        if prep:
            state = prepare_top(state)
        try:
            here = dataclasses.replace(ctx, layers_hook=hook, layer_taps=taps)
            with nn.use_context(here), nn.collect_aux() as sown:
                out = rows.apply(model.merge(state))
        except _Stop as stop:
            out = stop.value
        weights.update((k, w) for k, (_, w) in sown.items())
        return out, {k: v for k, (v, _) in sown.items()}

    def stop(stack, carry, fn):
        fired.append(True)
        raise _Stop(carry)

    def pre(params, rows):
        return call(params, rows, stop, True)

    def layers(params, x, rows, taps):
        def scan(stack, carry, fn):
            raise _Stop(nn.scan_stack(stack, x, fn))
        return call(params, rows, scan, False, taps)[0]

    def post(params, y, rows):
        return call(params, rows, lambda stack, carry, fn: y, True)

    def forward(params, rows, taps=None):
        fired.clear()
        x, sown_pre = jax.checkpoint(pre, policy=policy)(params, rows)
        if not fired:  # no layer scan: `pre` ran the whole model
            return x, {k: (v, weights[k]) for k, v in sown_pre.items()}
        y = layers(params, x, rows, taps)
        logits, sown_post = jax.checkpoint(post, policy=policy)(params, y, rows)
        # `post` runs the prologue again (dead code but for the gathers the head shares): what
        # the prologue sowed is taken from `pre`
        return logits, {k: (v, weights[k]) for k, v in {**sown_post, **sown_pre}.items()}

    return forward


def _prepare_top(state, prepare, stacked_paths: set[str], stacks_only: bool = False):
    """Cast/gather the params used outside the layer scan (embeddings, final norm, head) and cast
    the layer stacks that need no per-layer gather (see jaxpar.parallel.data.param_preparer);
    `stacks_only`: the layer stacks' casts alone (the others left as they are)."""
    flat = nnx.to_flat_state(state)
    items = []
    for path, var in flat:
        stacked = "/".join(map(str, path)) in stacked_paths
        if stacks_only and not stacked:
            items.append((path, var))
            continue
        items.append((path, prepare({"v": var}, stacked=stacked, cast_only=stacked)["v"]))
    return nnx.from_flat_state(items)
