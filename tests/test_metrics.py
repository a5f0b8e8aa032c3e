import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import glob
import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.metrics import (
    CompositeWriter,
    JsonlWriter,
    Progress,
    TensorBoardWriter,
    collective_bytes,
    collective_ops,
    compiled_memory,
    device_memory_stats,
    format_banner,
    generic_flops_per_token,
    llama_flops_per_token,
    mfu,
    peak_flops,
)

F32 = 4


# ---------------------------------------------------------------- flops


def test_llama_flops_per_token_matches_hand_computation():
    # 6N + 12 * L * T * d with N=1000, L=2, T=16, d=8: 6000 + 3072
    assert llama_flops_per_token(1000, n_layers=2, seq_len=16, dim=8) == 9072.0
    assert generic_flops_per_token(1000) == 6000.0


@pytest.mark.parametrize(
    "kind, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A10G", 70e12),
        ("NVIDIA L4", 121e12),
        ("TPU v4", 275e12),
        ("TPU v5 lite", 197e12),
        ("TPU v5p", 459e12),
        ("TPU v6 lite", 918e12),
        ("Some Future Chip", None),
    ],
)
def test_peak_flops_table(kind, peak):
    assert peak_flops(SimpleNamespace(platform="gpu", device_kind=kind)) == peak
    assert peak_flops(kind) == peak


def test_peak_flops_cpu_and_override():
    cpu = jax.devices()[0]
    assert peak_flops(cpu) is None
    assert peak_flops(cpu, override=1e12) == 1e12


def test_mfu():
    assert mfu(1000.0, 6e9, 12e12) == pytest.approx(0.5)
    assert mfu(1000.0, 6e9, None) is None


# ---------------------------------------------------------------- hlo on real compiled programs


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices: XLA_FLAGS was set before this module imported jax")
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(8), ("x",))


def _hlo(mesh, f, in_specs, out_specs, *args) -> str:
    sm = jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return jax.jit(sm).lower(*args).compile().as_text()


def _only(totals: dict[str, int], kind: str) -> int:
    assert all(v == 0 for k, v in totals.items() if k != kind), totals
    return totals[kind]


def test_psum_is_all_reduce_of_local_shard(mesh):
    x = jnp.ones((32, 16), jnp.float32)  # (4, 16) per device
    text = _hlo(mesh, lambda a: jax.lax.psum(a, "x"), P("x"), P("x"), x)
    assert _only(collective_bytes(text), "all-reduce") == 4 * 16 * F32
    (op,) = collective_ops(text)
    assert (op.kind, op.dtype, op.shape, op.bytes) == ("all-reduce", "f32", (4, 16), 256)
    assert op.replica_groups


def test_psum_of_tuple_counts_every_leaf(mesh):
    a, b = jnp.ones((32, 16), jnp.float32), jnp.ones((16, 16), jnp.int32)
    text = _hlo(mesh, lambda a, b: jax.lax.psum((a, b), "x"), (P("x"), P("x")), (P("x"), P("x")), a, b)
    assert _only(collective_bytes(text), "all-reduce") == (4 * 16 + 2 * 16) * 4


def test_all_gather_counts_gathered_result(mesh):
    x = jnp.ones((32, 16), jnp.float32)
    text = _hlo(mesh, lambda a: jax.lax.all_gather(a, "x", tiled=True), P("x"), P(), x)
    assert _only(collective_bytes(text), "all-gather") == 32 * 16 * F32


def test_psum_scatter_counts_local_shard(mesh):
    x = jnp.ones((32, 16), jnp.float32)  # replicated in, (4, 16) shard out
    text = _hlo(mesh, lambda a: jax.lax.psum_scatter(a, "x", tiled=True), P(), P("x"), x)
    assert _only(collective_bytes(text), "reduce-scatter") == 4 * 16 * F32


def test_ppermute_and_all_to_all(mesh):
    x = jnp.ones((64, 16), jnp.float32)  # (8, 16) per device
    perm = [(i, (i + 1) % 8) for i in range(8)]
    text = _hlo(mesh, lambda a: jax.lax.ppermute(a, "x", perm), P("x"), P("x"), x)
    assert _only(collective_bytes(text), "collective-permute") == 8 * 16 * F32
    assert "{0,1}" in collective_ops(text)[0].replica_groups  # source_target_pairs
    text = _hlo(mesh, lambda a: jax.lax.all_to_all(a, "x", 0, 0, tiled=True), P("x"), P("x"), x)
    assert _only(collective_bytes(text), "all-to-all") == 8 * 16 * F32


def test_scan_psum_multiplied_by_trip_count(mesh):
    def inner(c, _):
        return c + jax.lax.psum(c, "x"), None

    def outer(c, _):
        return jax.lax.scan(inner, c, None, length=3)[0], None

    x = jnp.ones((32, 16), jnp.float32)
    one = 4 * 16 * F32
    text = _hlo(mesh, lambda a: jax.lax.scan(inner, a, None, length=5)[0], P("x"), P("x"), x)
    assert collective_bytes(text)["all-reduce"] == one
    assert collective_bytes(text, count_loops=True)["all-reduce"] == 5 * one
    text = _hlo(mesh, lambda a: jax.lax.scan(outer, a, None, length=4)[0], P("x"), P("x"), x)
    assert collective_bytes(text, count_loops=True)["all-reduce"] == 12 * one


# ---------------------------------------------------------------- hlo on hand-written GPU-style text

ASYNC_HLO = """\
HloModule m, entry_computation_layout={(bf16[4,16]{1,0})->bf16[32,16]{1,0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %r = f32[] add(%a, %b)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ars = f32[8]{0} all-reduce-start(f32[8]{0} %x), replica_groups=[1,8]<=[8], to_apply=%add
  %ard = f32[8]{0} all-reduce-done(f32[8]{0} %ars)
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %ard)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (p0: bf16[4,16]) -> bf16[32,16] {
  %p0 = bf16[4,16]{1,0} parameter(0), metadata={op_name="a, b"}
  %ags = (bf16[4,16]{1,0}, bf16[32,16]{1,0}) all-gather-start(bf16[4,16]{1,0} %p0), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %agd = bf16[32,16]{1,0} all-gather-done((bf16[4,16]{1,0}, bf16[32,16]{1,0}) %ags)
  %cps = (u4[64]{0}, u4[64]{0}, u32[], u32[]) collective-permute-start(u4[64]{0} %q), source_target_pairs={{0,1},{1,0}}
  %cpd = u4[64]{0} collective-permute-done((u4[64]{0}, u4[64]{0}, u32[], u32[]) %cps)
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, backend_config="{\\"known_trip_count\\":{\\"n\\":\\"7\\"}}"
  ROOT %out = bf16[32,16]{1,0} copy(%agd)
}
"""


def test_async_pairs_count_once_with_done_shape():
    assert collective_bytes(ASYNC_HLO) == {
        "all-reduce": 8 * 4,
        "all-gather": 32 * 16 * 2,
        "reduce-scatter": 0,
        "all-to-all": 0,
        "collective-permute": 64 // 2,
    }
    groups = {op.kind: op.replica_groups for op in collective_ops(ASYNC_HLO)}
    assert groups == {
        "all-reduce": "[1,8]<=[8]",
        "all-gather": "{{0,1,2,3,4,5,6,7}}",
        "collective-permute": "{{0,1},{1,0}}",
    }
    assert collective_bytes(ASYNC_HLO, count_loops=True)["all-reduce"] == 7 * 8 * 4


# ---------------------------------------------------------------- memory


def test_compiled_memory():
    compiled = jax.jit(lambda a: a @ a).lower(jnp.ones((64, 64), jnp.float32)).compile()
    mem = compiled_memory(compiled)
    assert mem["argument_bytes"] == 64 * 64 * F32
    assert mem["output_bytes"] == 64 * 64 * F32
    assert mem["total_bytes"] >= mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"]
    assert compiled_memory(SimpleNamespace(memory_analysis=lambda: None)) == {}

    def boom():
        raise NotImplementedError

    assert compiled_memory(SimpleNamespace(memory_analysis=boom)) == {}
    stats = device_memory_stats(jax.devices()[0])
    assert stats is None or isinstance(stats, dict)
    assert device_memory_stats(SimpleNamespace(memory_stats=boom)) is None


# ---------------------------------------------------------------- writers


def _reject_constant(name):
    raise ValueError(f"non-standard JSON constant {name}")


def test_jsonl_writer(tmp_path):
    path = tmp_path / "sub" / "metrics.jsonl"
    w = JsonlWriter(path)
    w.write(1, {"loss": np.float32(2.5), "lr": jnp.asarray(1e-3), "tokens": np.int64(7), "eval": {"acc": 0.5}})
    w.write(2, {"loss": float("nan"), "gnorm": jnp.asarray(jnp.inf), "neg": -np.inf})
    lines = path.read_text().splitlines()  # readable before close: flushed per write
    w.close()
    recs = [json.loads(line, parse_constant=_reject_constant) for line in lines]
    assert recs[0] == {"step": 1, "loss": 2.5, "lr": pytest.approx(1e-3), "tokens": 7, "eval/acc": 0.5}
    assert recs[1] == {"step": 2, "loss": "nan", "gnorm": "inf", "neg": "-inf"}
    assert np.isnan(float(recs[1]["loss"]))
    JsonlWriter(path).close()  # reopening appends, never truncates
    assert len(path.read_text().splitlines()) == 2


def test_tensorboard_and_composite_writer(tmp_path):
    with CompositeWriter([JsonlWriter(tmp_path / "m.jsonl"), TensorBoardWriter(tmp_path / "tb")]) as w:
        w.write(1, {"loss": jnp.float32(1.0), "name": "run", "mfu": None})
        w.write(2, {"loss": np.float64(0.5)})
    events = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    assert events and os.path.getsize(events[0]) > 0
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 2


# ---------------------------------------------------------------- progress


def test_progress_disabled_writes_nothing(capsys):
    p = Progress(10, enabled=False)
    p.update(3, loss=1.0, tokens_per_s=1e4)
    p.close()
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def test_progress_enabled_shows_loss_and_tokens(capsys):
    p = Progress(10, start_step=2)
    p.update(5, loss=1.2345, tokens_per_s=12345.0)
    p.close()
    err = capsys.readouterr().err
    assert "loss=1.2345" in err and "12.3k" in err and "5/10" in err


def test_format_banner_aligns_values():
    text = format_banner({"model": "llama", "mesh shape": "data=8"})
    rows = [line for line in text.splitlines() if " : " in line]
    assert len(rows) == 2 and len({r.index(" : ") for r in rows}) == 1


def test_dot_flops_multiplies_loop_trips_and_takes_the_heaviest_branch():
    from jaxpar.metrics.hlo import dot_flops

    def scanned(w, x):
        return jax.lax.scan(lambda c, wl: (c @ wl, None), x, w)[0].sum()

    w, x = jnp.ones((10, 64, 64)), jnp.ones((8, 64))
    fwd = 10 * 2 * 8 * 64 * 64  # one [8,64] x [64,64] matmul per layer
    text = jax.jit(jax.grad(scanned)).lower(w, x).compile().as_text()
    assert dot_flops(text) == 3 * fwd  # forward, and the backward's input and weight gradients
    assert jax.jit(jax.grad(scanned)).lower(w, x).compile().cost_analysis()["flops"] < fwd  # one body

    def branchy(i, x, a, b):  # one [8,64]x[64,64] matmul, or two
        return jax.lax.switch(i, [lambda: x @ a, lambda: (x @ a) @ b])

    text = jax.jit(branchy).lower(0, x, w[0], w[1]).compile().as_text()
    assert dot_flops(text) == 2 * (2 * 8 * 64 * 64)
