"""Every layout hands the optimizer the gradient that one unsharded device computes (float32):
on step 1, and on step 2, after a real AdamW update (the learning rate is non-zero from step 1).
Losses or parameters after an Adam step would hide a gradient off by a constant factor (Adam
divides it out); the gradient itself cannot.

`python -m tests.test_layout_grads` prints the agreement table of docs/benchmarks.md."""
import jax
import numpy as np
import pytest

from tests.conftest import tiny_config
from tests.grad_util import global_norm, run_steps

STEPS = 2
DENSE = ["mesh.data=1"]
MOE = ["model.preset=moe_tiny", "model.n_layers=2", "mesh.data=1"]
# dropless, with router losses weighty enough that their gradients show beside the LM loss's
MOE_DROPLESS = [*MOE, "model.moe.dispatch=dropless", "model.moe.load_balance_coef=1.0", "model.moe.z_loss_coef=0.1"]
WARM = "gradient_compression.warmup_steps=2"  # compressed methods reduce in float32 for 2 steps

LAYOUTS = {  # name: (reference, overrides)
    "data8": (DENSE, ["mesh.data=8", "sharding.zero_stage=0"]),
    "data8-accum2": (DENSE, ["mesh.data=8", "sharding.zero_stage=0", "train.grad_accum=2"]),
    "fsdp8-zero1": (DENSE, ["mesh.fsdp=8", "sharding.zero_stage=1"]),
    "fsdp8-zero2": (DENSE, ["mesh.fsdp=8", "sharding.zero_stage=2"]),
    # ZeRO-1 with accumulation: one reduction per step after the microbatch loop
    "dp2-fsdp4-zero1-accum2": (DENSE, ["mesh.data=2", "mesh.fsdp=4", "sharding.zero_stage=1",
                                       "train.grad_accum=2"]),
    "fsdp8-zero3": (DENSE, ["mesh.fsdp=8", "sharding.zero_stage=3"]),
    # ZeRO-3: each layer's gradient reduce-scattered by its gather's transpose and all-reduced over
    # `data` in the backward layer scan; with accumulation, over `data` after the microbatch loop
    "dp2-fsdp2-tp2-zero3": (DENSE, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "sharding.zero_stage=3"]),
    # ZeRO-1 beside tensor: w_down's, wo's and the embedding's shards share their tensor dim,
    # P(('tensor', 'fsdp')), each device's block scattered in place (parallel/data.AllReduce)
    "dp2-fsdp2-tp2-zero1": (DENSE, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "sharding.zero_stage=1"]),
    # in-scan with accumulation: each microbatch's layer gradients reduce-scattered in its backward,
    # the last one's (a cond in the tap) adding the others' sum and reducing over `data`
    "dp2-fsdp2-tp2-zero2-accum2": (DENSE, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                                           "train.grad_accum=2", "sharding.zero_stage=2"]),
    "dp2-fsdp4-zero3-accum2-remat": (DENSE, ["mesh.data=2", "mesh.fsdp=4", "train.grad_accum=2",
                                             "sharding.zero_stage=3", "train.remat=full"]),
    "dp4-tp2-seqpar-remat": (DENSE, ["mesh.data=4", "mesh.tensor=2", "sharding.sequence_parallel=true",
                                     "train.remat=dots_saveable"]),
    "onebit-adam-warmup": (DENSE, ["mesh.data=8", "optimizer.name=onebit_adam", "optimizer.onebit_warmup_steps=2"]),
    **{f"data8-{m}-warmup": (DENSE, ["mesh.data=8", f"gradient_compression.method={m}", WARM])
       for m in ("int8", "powersgd")},  # the warm-up branch is shared; int8: residuals, powersgd: Q
    "dp2-fsdp4-zero1-int8-warmup": (DENSE, ["mesh.data=2", "mesh.fsdp=4", "sharding.zero_stage=1",
                                            "gradient_compression.method=int8", WARM]),  # reduce-scattered
    "moe-dp2-ep4": (MOE, ["mesh.data=2", "mesh.expert=4"]),
    "moe-fsdp2-ep2-tp2-zero3": (MOE, ["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2", "sharding.zero_stage=3"]),
    # each device holds half of every sequence: the router's per-sequence statistics (load
    # balance, z loss, load) are summed over context (nn.sequence_sum) before they are divided
    "moe-dropless-dp2-cp2-ep2": (MOE_DROPLESS, ["mesh.data=2", "mesh.context=2", "mesh.expert=2"]),
    # context beside a pipeline (all_to_all: its collectives run within each stage's context
    # group; each microbatch's rows split like the step's, parallel/context.split), with tensor,
    # recompute and remat full; capacity MoE in stages
    "dp2-pp2-cp2-a2a-zb": (DENSE, ["mesh.data=2", "mesh.pipeline=2", "mesh.context=2",
                                   "context.strategy=all_to_all", "train.grad_accum=2",
                                   "pipeline.schedule=zb_h1", "sharding.replicated_tolerance=0.3"]),
    "dp2-pp2-cp2-allgather": (DENSE, ["mesh.data=2", "mesh.pipeline=2", "mesh.context=2",
                                      "context.strategy=all_gather", "train.grad_accum=2",
                                      "sharding.replicated_tolerance=0.3"]),
    # zb_h1's W half replays the stage vjp on stashed residuals that come back more varying than
    # the forward typed them (pipeline/residuals.bind_lenient): under a remat policy the
    # all_gather strategy's backward adds one to a constant
    "dp2-pp2-cp2-allgather-zb-remat": (DENSE, ["mesh.data=2", "mesh.pipeline=2", "mesh.context=2",
                                               "context.strategy=all_gather", "train.grad_accum=2",
                                               "pipeline.schedule=zb_h1", "train.remat=full",
                                               "sharding.replicated_tolerance=0.3"]),
    "moe-dp2-pp2-cp2-a2a": (MOE, ["mesh.data=2", "mesh.pipeline=2", "mesh.context=2",
                                  "context.strategy=all_to_all", "train.grad_accum=2",
                                  "sharding.replicated_tolerance=0.3"]),
    # capacity beside context: which assignments drop is decided in the whole sequence's order
    # (each device's runs counted after every earlier run's, all devices': parallel/expert.py)
    "moe-capacity-dp2-cp2-ep2": (MOE, ["mesh.data=2", "mesh.context=2", "mesh.expert=2"]),
}
# Pipelines: tests/test_pipeline.py compares every schedule's gradients the same way; local SGD
# with sync_every 1 equals plain data parallelism bit for bit (tests/test_numerics.py).


def relative_errors(got: dict, ref: dict) -> tuple[float, float]:
    """(worst leaf's max |g - r| / max |r|, relative error of the global norm)."""
    worst = 0.0
    for g, r in zip(jax.tree.leaves(got["grads"]), jax.tree.leaves(ref["grads"]), strict=True):
        worst = max(worst, float(np.max(np.abs(g - r)) / np.max(np.abs(r))))
    norm_err = abs(float(got["grad_norm"]) - float(ref["grad_norm"])) / float(ref["grad_norm"])
    return worst, norm_err


# step 2 follows an Adam step, which turns float32 noise in near-zero gradients into whole
# learning-rate-sized updates: a looser bound
TOL = {1: 1e-5, 2: 1e-4}
_references: dict = {}


def reference(base: list, devices) -> list[dict]:
    key = tuple(base)
    if key not in _references:
        _references[key] = run_steps(tiny_config(*base), STEPS, devices[:1])
    return _references[key]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_gradients_match_one_device(name, devices):
    base, overrides = LAYOUTS[name]
    ref = reference(base, devices)
    got = run_steps(tiny_config(*base, *overrides), STEPS, devices)
    for step, (g, r) in enumerate(zip(got, ref), start=1):
        leaf_err, norm_err = relative_errors(g, r)
        assert leaf_err < TOL[step] and norm_err < TOL[step], (step, leaf_err, norm_err)
        np.testing.assert_allclose(global_norm(g["grads"]), float(g["grad_norm"]), rtol=1e-5)
        np.testing.assert_allclose(g["loss"], r["loss"], rtol=1e-5)


def test_one_device_accumulation_keeps_the_global_batch(devices):
    got = run_steps(tiny_config(*DENSE, "train.grad_accum=4"), STEPS, devices[:1])
    for step, (g, r) in enumerate(zip(got, reference(DENSE, devices)), start=1):
        assert max(relative_errors(g, r)) < TOL[step], step


def test_bf16_compute_gradient_close_to_float32(devices):
    (got,) = run_steps(tiny_config("mesh.data=4", "mesh.tensor=2", "train.compute_dtype=bfloat16"), 1, devices)
    ref = reference(DENSE, devices)[0]
    flat = lambda m: np.concatenate([np.ravel(x) for x in jax.tree.leaves(m["grads"])])
    a, b = flat(got), flat(ref)
    assert np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.999
    np.testing.assert_allclose(got["grad_norm"], ref["grad_norm"], rtol=2e-2)


if __name__ == "__main__":  # the table of docs/benchmarks.md
    print("| layout | step 1 leaf | step 1 norm | step 2 leaf | step 2 norm |\n|---|---|---|---|---|")
    for name, (base, overrides) in LAYOUTS.items():
        errs = [relative_errors(g, r) for g, r in zip(
            run_steps(tiny_config(*base, *overrides), STEPS, jax.devices()), reference(base, jax.devices()))]
        print(f"| {name} | " + " | ".join(f"{e:.1e}" for pair in errs for e in pair) + " |")
