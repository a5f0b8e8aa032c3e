"""Layer gradients are reduced inside the backward layer scan (train/layer_grads.py), where XLA
can overlap them with the next layer's backward: counted in the compiled HLO's while-loop bodies
(jaxpar.metrics.loop_collectives). Gradient equality with one device: tests/test_layout_grads.py."""
import math
import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.bench.comm import measured
from jaxpar.metrics import collective_ops, loop_collectives
from jaxpar.planner.comm import step_collectives
from jaxpar.planner.layout import Layout, abstract_plan
from jaxpar.parallel.sync import flat_paths
from jaxpar.sharding import ZERO_AXIS, entry_axes
from jaxpar.train.trainer import Trainer
from tests.conftest import tiny_config

LAYOUTS = {
    "zero0-dp8": ["mesh.data=8", "sharding.zero_stage=0"],
    "zero1-fsdp8": ["mesh.data=1", "mesh.fsdp=8", "sharding.zero_stage=1"],
    "zero2-fsdp8": ["mesh.data=1", "mesh.fsdp=8", "sharding.zero_stage=2"],
    "zero2-dp2-fsdp4": ["mesh.data=2", "mesh.fsdp=4", "sharding.zero_stage=2"],
    "zero3-fsdp8": ["mesh.data=1", "mesh.fsdp=8", "sharding.zero_stage=3"],
    "zero3-dp2-fsdp4": ["mesh.data=2", "mesh.fsdp=4", "sharding.zero_stage=3"],
}
# With accumulation ZeRO-2 scatters each microbatch's layer gradients in the backward and the last
# microbatch's backward finishes each layer's reduction (a lax.cond in the tap: train/layer_grads.py);
# ZeRO-0/1 reduce once per step after the microbatch loop, and so does ZeRO-3 over `data` (its
# gathers' transpose reduce-scatters over fsdp in the loop): train/gradient_sync.make_sync says why
ACCUM = {
    "zero2-fsdp8-accum2": ["mesh.data=1", "mesh.fsdp=8", "sharding.zero_stage=2", "train.grad_accum=2"],
    "zero2-dp2-fsdp4-accum2": ["mesh.data=2", "mesh.fsdp=4", "sharding.zero_stage=2", "train.grad_accum=2"],
}
AFTER_THE_LOOP = {
    "zero0-dp8-accum2": ["mesh.data=8", "sharding.zero_stage=0", "train.grad_accum=2"],
    "zero1-fsdp8-accum2": ["mesh.data=1", "mesh.fsdp=8", "sharding.zero_stage=1", "train.grad_accum=2"],
    "zero3-dp2-fsdp4-accum2": ["mesh.data=2", "mesh.fsdp=4", "sharding.zero_stage=3", "train.grad_accum=2"],
}
# tensor parallelism beside fsdp (issue 11's worst overhead cell): the compiler partitions `tensor`
# inside the step's shard_map, so its own all-reduces run in the layer loop too
TENSOR = {
    "zero1-dp2-fsdp2-tp2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "sharding.zero_stage=1"],
    "zero2-dp2-fsdp2-tp2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "sharding.zero_stage=2"],
}
# ZeRO-3 beside tensor: each device gathers (and in the backward scatters) its own tensor block of
# each layer's weights (parallel/data.gather_in), and the backward gathers again under every remat
# policy, "none" too: there the gathered blocks (made in a nested shard_map) were saved for the
# backward, every layer's whole, until the remat policy looked inside it (nn._gathers; found on
# the 1B preset compiled for 8 H200s, docs/benchmarks.md "session 12")
ZERO3_TENSOR = {
    "zero3-dp2-fsdp2-tp2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "sharding.zero_stage=3",
                            "train.remat=full"],
    "zero3-dp2-fsdp2-tp2-none": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "sharding.zero_stage=3",
                                 "train.remat=none"],
}
REDUCTIONS = ("all-reduce", "reduce-scatter")
# the module's compiles are shared by its tests (a layout is read by up to three): on one worker
pytestmark = pytest.mark.xdist_group("overlap")


@pytest.fixture(scope="module")
def compiled(devices):
    cache = {}

    def get(name):
        if name not in cache:
            t = Trainer(tiny_config(*{**LAYOUTS, **ACCUM, **AFTER_THE_LOOP, **TENSOR, **ZERO3_TENSOR}[name], "train.seq_len=16"),
                        devices=devices,
                        log=lambda s: None)
            cache[name] = (t, t.compile())
        return cache[name]
    return get


def _layered(t: Trainer) -> dict:
    """{path: axes} of the stacked layer params."""
    axes = flat_paths(t.model.axes, is_leaf=lambda x: isinstance(x, tuple))
    return {p: ax for p, ax in axes.items() if ax[:1] == ("layers",)}


def _fsdp_sharded(t: Trainer, path) -> bool:
    spec = flat_paths(t.spec.grad_specs)[path]
    return any(ZERO_AXIS in entry_axes(e) for e in spec)


@pytest.mark.parametrize("name", [*LAYOUTS, *ACCUM])
def test_layer_gradients_reduced_inside_the_backward_loop(name, compiled):
    t, c = compiled(name)
    cfg, text = t.cfg, c.as_text()
    count, nbytes = loop_collectives(text), loop_collectives(text, "bytes")
    L, m, stage = cfg.model.n_layers, cfg.train.grad_accum, cfg.sharding.zero_stage
    layered = _layered(t)
    sharded = [p for p in layered if _fsdp_sharded(t, p)]
    inside = count["inside"]
    if m > 1:  # the per-microbatch and last-microbatch reductions are the two branches of a cond
        # run every trip of the microbatch loop, which a static count takes as if both ran each
        # trip: check that they are inside the loops, not how often one step runs them
        assert inside["all-reduce"] + inside["reduce-scatter"] >= len(layered) * L, count
    elif stage == 0:  # one all-reduce per leaf per layer per step, whatever the microbatch count
        assert inside["all-reduce"] == len(layered) * L, count
        assert inside["reduce-scatter"] == 0, count
    elif stage == 1:  # reduce-scattered to the optimizer shard (norm scales: all-reduced), once
        assert inside["all-reduce"] + inside["reduce-scatter"] == len(layered) * L, count
        assert inside["reduce-scatter"] >= len(sharded) * L if sharded else True, count
    else:  # reduce-scattered over fsdp (ZeRO-2: by the sync, ZeRO-3: by the transpose of the
        # layer's gathers), then all-reduced over `data` (and the whole norm scales over fsdp too)
        data = t.plan.mesh.shape["data"] > 1
        assert inside["reduce-scatter"] == len(sharded) * L, count
        assert inside["all-reduce"] == ((len(layered) if data else len(layered) - len(sharded)) * L), count
    # what is reduced after the loops is no bigger than the params outside the stack (embeddings,
    # head, final norm): never the layer gradients
    shapes = flat_paths(t.model.shapes, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    top = sum(4 * math.prod(s.shape) for p, s in shapes.items() if p not in layered)
    outside = sum(nbytes["outside"][k] for k in REDUCTIONS)
    assert outside <= top + 4096, (outside, top, nbytes)
    stacked = sum(4 * math.prod(shapes[p].shape) for p in layered)
    assert sum(nbytes["inside"][k] for k in REDUCTIONS) >= stacked / 8, nbytes


@pytest.mark.parametrize("name", ["zero1-fsdp8", "zero2-fsdp8", *TENSOR])
def test_zero1_2_reduce_scatter_whole_blocks(name, compiled):
    """Below ZeRO-3 the gradient and optimizer shards sit on the outermost dim of each device's
    block that fsdp divides (sharding.Plan._zero_outermost): every reduce-scatter scatters the
    outermost dim of its operand that fsdp divides, a contiguous block per device (with no
    transpose around it where that dim is the outermost). On the rules' `embed` dim (the last of w_down and wo) XLA
    transposes around a strided scatter, which made fsdp=8 ZeRO-1 14% slower than a plain jit on
    XLA:CPU (issue 11). Beside tensor parallelism, a dim `tensor` splits takes fsdp as its minor
    factor (w_down: P(('tensor', 'fsdp'))), and each device scatters its own tensor block: no
    all-gather over `tensor` of the gradients in the layer loop (XLA's partitioner gathered
    every one of them before a reduce-scatter over the manual fsdp: 1.4x the plain jit's step
    in bf16 at data=2 x fsdp=2 x tensor=2, docs/benchmarks.md)."""
    t, c = compiled(name)
    sizes = t.plan.mesh.shape
    n = sizes[ZERO_AXIS]
    text = c.as_text()
    found = re.findall(r"= \w+\[([\d,]*)\](\{[\d,]*\})? reduce-scatter\(.*?dimensions=\{(\d+)\}", text)
    assert found
    for shape, layout, dim in found:
        shape = [int(d) for d in shape.split(",")]
        assert all(d % n for d in shape[:int(dim)]), (shape, dim)  # before the scattered dim: none fsdp divides
        if all(d == 1 for d in shape[:int(dim)]):  # the outermost dim: row-major, no transpose around it
            order = [int(d) for d in layout.strip("{}").split(",") if shape[int(d)] > 1] if layout else []
            assert order == sorted(order, reverse=True), (shape, layout)
    assert loop_collectives(text)["inside"]["all-gather"] == 0, loop_collectives(text)
    axes = flat_paths(t.model.axes, is_leaf=lambda x: isinstance(x, tuple))
    shapes = flat_paths(t.model.shapes, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    specs = flat_paths(t.plan.tree_specs(t.model.axes, t.model.shapes, "opt"))
    for path, spec in specs.items():
        entries = (*spec, *(None,) * (len(shapes[path].shape) - len(spec)))
        at = [i for i, e in enumerate(entries) if ZERO_AXIS in entry_axes(e)]
        local = [size // math.prod(sizes[a] for a in entry_axes(e) if a != ZERO_AXIS)
                 for size, e in zip(shapes[path].shape, entries)]
        outer = [i for i, size in enumerate(local) if axes[path][i] != "layers" and size % n == 0][:1]
        assert not at or at == outer, (path, spec, shapes[path].shape)  # every optimizer shard too
        assert not at or entry_axes(entries[at[0]])[-1] == ZERO_AXIS, (path, spec)  # the minor factor
    assert any(ZERO_AXIS in str(s) for s in specs.values())
    if name in TENSOR:  # the case the rule is for: w_down's shard shares `mlp` with tensor
        assert specs[("layers", "w_down")] == P(None, ("tensor", ZERO_AXIS)), specs[("layers", "w_down")]


def _group_axes(groups: str, mesh_shape: dict[str, int]) -> set[str]:
    """The mesh axes a collective's replica groups run over (named or iota HLO groups)."""
    m = re.match(r"mesh\[.*?\]\s*\{(.*?)\}", groups)
    if m:
        return set(re.findall(r"'([\w\-]+)'", m.group(1)))
    m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", groups)
    if m:  # iota groups
        shape, dims = [[int(d) for d in g.split(",")] for g in m.groups()[:2]]
        ids = np.arange(math.prod(dims)).reshape(dims)
        ids = ids.transpose([int(d) for d in m.group(3).split(",")]) if m.group(3) else ids
        got = {frozenset(g) for g in ids.reshape(shape).tolist()}
    else:  # explicit groups, {{0,2},{1,3},...} (jax 0.10)
        got = {frozenset(int(d) for d in g.split(",")) for g in re.findall(r"\{([\d,]+)\}", groups)}
        assert got, groups
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    for k in range(1, 1 << len(names)):  # the set of axes whose groups these are
        axes = [i for i in range(len(names)) if k >> i & 1]
        grid = np.moveaxis(np.arange(math.prod(sizes)).reshape(sizes), axes, range(-len(axes), 0))
        if {frozenset(g) for g in grid.reshape(-1, math.prod(sizes[i] for i in axes)).tolist()} == got:
            return {names[i] for i in axes if sizes[i] > 1}
    raise AssertionError(groups)


@pytest.mark.parametrize("name", list(ZERO3_TENSOR))
def test_zero3_gathers_each_tensor_block(name, compiled):
    """ZeRO-3 beside tensor parallelism: each device all-gathers over fsdp its own tensor block of
    a layer's weights, and its gradient's reduce-scatter (the gather's transpose) scatters that
    block (parallel/data.gather_in, in a shard_map manual over `tensor` too). XLA's partitioner
    all-gathered every shard over `tensor` before the gather over the manual fsdp and every
    gradient before its scatter: at data=2 x fsdp=2 x tensor=2, 4x the planner's all-gather bytes
    and 2x its reduce-scatter bytes, 70 all-gathers in the layer loops for 14 (issue 11)."""
    t, c = compiled(name)
    text, cfg = c.as_text(), t.cfg
    sizes = dict(t.plan.mesh.shape)
    for op in collective_ops(text):
        if op.kind in ("all-gather", "reduce-scatter"):  # over fsdp only: none over `tensor`
            assert _group_axes(op.replica_groups, sizes) == {ZERO_AXIS}, op
    L, layered = cfg.model.n_layers, _layered(t)
    sharded = [p for p in layered if _fsdp_sharded(t, p)]
    inside = loop_collectives(text)["inside"]
    assert inside["all-gather"] == 2 * len(sharded) * L, inside  # forward, and again in the backward
    assert inside["reduce-scatter"] == len(sharded) * L, inside
    # in the loops, each gather's result is the device's tensor block of one layer's weight
    shapes = flat_paths(t.model.shapes, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    specs = flat_paths(t.plan.tree_specs(t.model.axes, t.model.shapes, "param"))
    itemsize = np.dtype(cfg.train.compute_dtype).itemsize
    block = sum(itemsize * math.prod(shapes[p].shape[1:]) // math.prod(
        sizes[a] for e in specs[p] for a in entry_axes(e) if a != ZERO_AXIS) for p in sharded)
    assert loop_collectives(text, "bytes")["inside"]["all-gather"] == 2 * L * block
    layout = Layout.of_config(cfg, 8)
    pred = step_collectives(cfg, layout, t.model, abstract_plan(cfg, layout))["kinds"]
    hlo = measured(text, 8)
    # the bytes the planner predicts; its gathers of the embeddings and head, twice a step, run
    # once (no remat outside the layer scan): 7% of the all-gather bytes here
    for kind, rel in (("all-gather", 0.1), ("reduce-scatter", 0.05)):
        assert hlo[kind]["result_bytes"] == pytest.approx(pred[kind]["result_bytes"], rel=rel), (kind, hlo, pred)


@pytest.mark.parametrize("name", list(AFTER_THE_LOOP))
def test_zero0_1_3_with_accumulation_reduce_once_after_the_loop(name, compiled):
    t, c = compiled(name)
    assert not t.spec.sync.in_scan
    count = loop_collectives(c.as_text())
    L, m, layered = t.cfg.model.n_layers, t.cfg.train.grad_accum, _layered(t)
    assert count["inside"]["all-reduce"] == 0, count
    if t.cfg.sharding.zero_stage == 3:  # each microbatch's layers reduce-scattered by their gathers' transpose
        assert count["inside"]["reduce-scatter"] >= len([p for p in layered if _fsdp_sharded(t, p)]) * L * m, count
    else:
        assert count["inside"]["reduce-scatter"] == 0, count
    assert count["outside"]["all-reduce"] + count["outside"]["reduce-scatter"] >= len(layered), count


def test_zero2_temp_memory_below_zero1_by_half_the_gradient(compiled):
    """With accumulation ZeRO-1 holds the whole local gradient between microbatches, ZeRO-2 only
    its fsdp shard of it (each microbatch's reduce-scattered). (With one microbatch both
    reduce-scatter every layer in the backward and neither holds the whole gradient.)"""
    t1, c1 = compiled("zero1-fsdp8-accum2")
    _, c2 = compiled("zero2-fsdp8-accum2")
    full = 4 * t1.model.n_params  # float32 accumulator
    temp1, temp2 = c1.memory_analysis().temp_size_in_bytes, c2.memory_analysis().temp_size_in_bytes
    assert temp2 <= temp1 - full / 2, (temp1, temp2, full)


def test_powersgd_and_compression_warmup_keep_their_post_scan_reduction(devices):
    """PowerSGD (Q per stacked matrix across steps) and a float32 warm-up (it reads the step)
    reduce after the scan: the sync hands no leaf to the layer scan. (The other methods reduce in
    the scan: tests/test_compression.py.)"""
    for overrides in (["gradient_compression.method=powersgd"],
                      ["gradient_compression.method=bf16", "gradient_compression.warmup_steps=1"]):
        t = Trainer(tiny_config("mesh.data=8", *overrides, "train.seq_len=16"), devices=devices,
                    log=lambda s: None)
        assert not t.spec.sync.in_scan, overrides


def test_loop_collectives_rejects_a_bad_measure():
    with pytest.raises(ValueError, match="measure='time'"):
        loop_collectives("", "time")


def test_loop_collectives_counts_loop_bodies_times_their_trips(devices):
    mesh = jax.make_mesh((8,), ("data",), devices=devices)

    def f(x):
        def body(c, _):
            return jax.lax.psum(c, "data") * 0.5, None
        y, _ = jax.lax.scan(body, x, None, length=3)
        return jax.lax.psum(y, "data")

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=False))
    x = jax.ShapeDtypeStruct((8, 4), jax.numpy.float32, sharding=jax.sharding.NamedSharding(mesh, P("data")))
    text = g.lower(x).compile().as_text()
    got = loop_collectives(text)
    assert got["inside"]["all-reduce"] == 3 and got["outside"]["all-reduce"] == 1, got
    assert loop_collectives(text, "bytes")["inside"]["all-reduce"] == 3 * 4 * 4
