"""`jaxpar bench`: each benchmark at a tiny size through its Python entry point."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402

import pytest  # noqa: E402

from jaxpar.bench import load, run_bench, split_args  # noqa: E402
from jaxpar.bench.comm import wire_bytes  # noqa: E402
from jaxpar.metrics.hlo import group_size  # noqa: E402
from jaxpar.cli import main  # noqa: E402
from jaxpar.config import ConfigError  # noqa: E402

TINY = ["model.n_layers=2", "train.global_batch=8", "train.seq_len=32", "data.source=synthetic"]
N = 8


def test_unknown_benchmark_lists_the_valid_names(capsys):
    with pytest.raises(ConfigError, match="unknown benchmark 'speed'; valid benchmarks: ") as e:
        run_bench("speed", None, [])
    valid = str(e.value).split("valid benchmarks: ")[1].split(", ")
    assert {"comm", "memory", "overhead"} <= set(valid) and valid == sorted(valid)
    assert main(["bench", "speed"]) == 2
    assert "valid benchmarks: " in capsys.readouterr().err


def test_first_override_is_not_taken_for_a_config_path():
    assert split_args("model.n_layers=2", ["train.seq_len=8"]) == (None, ["model.n_layers=2", "train.seq_len=8"])
    assert split_args("configs/quickstart.yaml", ["a.b=1"]) == ("configs/quickstart.yaml", ["a.b=1"])


def test_layouts_default_to_quickstart_and_give_way_to_overrides():
    _, cfg = load("overhead-point", None, TINY)
    assert cfg.name == "quickstart" and cfg.train.steps == 20 and cfg.sharding.zero_stage == 0
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (-1, 1, 1)
    _, cfg = load("memory", None, [*TINY, "mesh.data=2", "mesh.fsdp=-1"])
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.model.n_layers) == (2, -1, 2)


def test_ring_wire_bytes_and_replica_groups():
    assert group_size("mesh['data'=1,'fsdp'=8,'tensor'=1] {'fsdp'}", 8) == 8
    assert group_size("mesh['data'=2,'fsdp'=4] {'data','fsdp'}", 8) == 8
    assert group_size("mesh['data'=1,'fsdp'=8,'expert'=1] {'data','expert'}", 8) == 1
    assert group_size("[2,4]<=[8]", 8) == 4
    assert group_size("{{0,1},{2,3},{4,5},{6,7}}", 8) == 2
    assert group_size("{}", 8) == 8
    assert wire_bytes("all-reduce", 800, 8) == 1400
    assert wire_bytes("all-gather", 800, 8) == 700
    assert wire_bytes("reduce-scatter", 100, 8) == 700  # input 800
    assert wire_bytes("all-reduce", 800, 1) == 0


def test_memory_shrinks_per_zero_stage_like_the_paper():
    out = []
    assert run_bench("memory", None, TINY, as_json=True, out=out.append) == 0
    res = json.loads(out[0])  # one JSON document
    assert res["benchmark"] == "memory" and res["n_d"] == N
    psi, u = res["n_params"], res["unsharded_params"]
    assert 0 < u < 0.01 * psi  # the norm scales
    stages = {r["zero_stage"]: r for r in res["stages"]}
    assert sorted(stages) == [0, 1, 2, 3]
    for s, r in stages.items():
        # sharded over fsdp from the stage the paper says; the replicated norms are the slack
        for q, per_param, from_stage in (("params", 4, 3), ("grads", 4, 2), ("opt_state", 8, 1)):
            got, formula = r[q]["measured"], r[q]["formula"]
            if s < from_stage:
                assert formula == per_param * psi
                assert formula <= got <= formula + 64, (s, q, got)  # + optimizer step counters
            else:
                assert formula == per_param * psi / N
                assert formula <= got <= formula + per_param * u + 64, (s, q, got, formula)
        assert r["compiled"]["temp_bytes"] > 0
    totals = [stages[s]["state_total"]["measured"] for s in range(4)]
    assert totals == sorted(totals, reverse=True) and totals[3] < totals[0] / (N - 1)


def test_comm_collectives_match_the_analytic_bytes():
    mod, cfg = load("comm", None, TINY)
    res = mod.run(cfg, stages=(2, 3))
    lay = {r["label"]: r for r in res["layouts"]}
    psi4 = 4 * res["n_params"]

    dp = lay["dp"]["kinds"]
    assert set(dp) == {"all-reduce"}, dp
    assert dp["all-reduce"]["result_bytes"] == pytest.approx(psi4, rel=0.02)
    assert dp["all-reduce"]["wire_ratio"] == pytest.approx(1, rel=0.02)

    for stage in (2, 3):
        k = lay[f"zero{stage}"]["kinds"]
        rs = k["reduce-scatter"]
        assert rs["ops"] > 0 and rs["result_bytes"] == pytest.approx(psi4 / N, rel=0.02)
        assert rs["wire_ratio"] == pytest.approx(1, rel=0.02)
        assert k["all-reduce"]["result_bytes"] < 0.02 * psi4  # norms and scalars only
    ag = lay["zero3"]["kinds"]["all-gather"]
    assert ag["ops"] > 0
    # forward + backward gathers of the layer weights (2 * Psi); embed/head may be gathered once
    assert 0.75 * ag["analytic_result_bytes"] <= ag["result_bytes"] <= 1.01 * ag["analytic_result_bytes"]
    assert ag["analytic_result_bytes"] == pytest.approx(2 * psi4, rel=0.01)
    assert "zero3" in mod.format_result(res)


def test_overhead_times_both_steps():
    mod, cfg = load("overhead-point", None, [*TINY, "train.steps=2"])
    res = mod.run(cfg, warmup=1)
    for k in ("jaxpar", "baseline"):
        assert res[k]["n"] == 2 and res[k]["median_s"] > 0 and res[k]["compile_s"] > 0
    # same model, same seed, same batch: the same loss before any update
    assert res["jaxpar"]["first_loss"] == pytest.approx(res["baseline"]["first_loss"], rel=1e-4)
    assert res["ratio"] > 0 and "ratio jaxpar/baseline" in mod.format_result(res)


def test_planner_bench_ranks_and_times_planning():
    mod, cfg = load("planner", None, TINY)
    # data parallel, tensor parallel and ZeRO-3: the first and the last the steps the memory
    # benchmark above compiles too (a persistent-cache load here when it ran first)
    layouts = [mod.LAYOUTS[0], mod.LAYOUTS[2], "mesh.data=1 mesh.fsdp=8 sharding.zero_stage=3"]
    assert set(layouts) <= set(mod.LAYOUTS)
    res = mod.run(cfg, steps=1, layouts=layouts)
    assert len(res["layouts"]) == 3 and all(r["predicted_s"] > 0 and r["measured_s"] > 0 for r in res["layouts"])
    # the printed rank correlation is that of these rows (its value on a busy CPU is a figure, not
    # a property: the planner's accuracy is tests/test_planner.py's)
    rows = res["layouts"]
    assert res["spearman"] == pytest.approx(mod.spearman([r["predicted_s"] for r in rows],
                                                         [r["measured_s"] for r in rows]))
    assert res["plan_70b_1024_s"] > 0 and res["plan_70b_best"]
    assert "Spearman" in mod.format_result(res)
    assert mod.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1) and mod.spearman([1, 2, 3], [3, 2, 1]) < 0


def test_step_bench_flops_collectives_memory_and_host_time():
    mod, cfg = load("step", None, [*TINY, "train.steps=2"])
    res = mod.run(cfg, layouts=["dp", "zero3"], shapes=("config",))
    dp, z3 = res["rows"]
    L, leaves = cfg.model.n_layers, 9  # a tiny Llama layer: wq wk wv wo w_gate w_up w_down + 2 norms
    # every layer gradient all-reduced inside the backward loop, once per layer per step
    assert dp["collectives"]["inside"]["all-reduce"]["count"] == leaves * L, dp["collectives"]
    # ZeRO-3: the 7 matrices gathered (forward and backward) and reduce-scattered in the loops
    assert z3["collectives"]["inside"]["reduce-scatter"]["count"] == 7 * L, z3["collectives"]
    assert z3["collectives"]["inside"]["all-gather"]["count"] >= 2 * 7 * L, z3["collectives"]
    for r in (dp, z3):
        # no remat: the compiled dots are the model's matmuls (6N + attention), within the
        # analytic formula's slack (it counts the 2 norms and no causal saving)
        assert 0.9 < r["compiled_flops"] / r["model_flops"] < 1.1, r
        assert r["cost_analysis_flops"] < r["compiled_flops"]  # XLA counts a loop body once
        assert r["temp_bytes"] > 0 and r["step_s"] > 0 and r["host_batch_s"] >= 0 and r["host_call_s"] > 0
    text = mod.format_result(res)
    assert "config dp" in text and "config zero3" in text
    with pytest.raises(ConfigError, match="unknown layouts"):
        mod.run(cfg, layouts=["nope"])


def test_step_bench_model_flops_count_active_experts_and_the_heads_width():
    """bench step's model FLOPs counted every expert of a MoE (3.0x the active count here) and
    attention at model.dim wide where head_dim x n_heads is not dim; an analytic Llama count."""
    from jaxpar.train.trainer import Trainer
    mod, cfg = load("step", None, [*TINY, "model.head_dim=64", "model.moe.num_experts=4",
                                   "model.moe.top_k=1"])
    m, S = cfg.model, cfg.train.seq_len
    D, H, K, F, V, L, hd = m.dim, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size, m.n_layers, m.head_dim
    Fe = m.moe.expert_ffn_dim or F
    # per layer: q and o (H hd x D), k and v (K hd x D), router (D x E), top_k SwiGLU experts (3
    # matrices), 2 norms; the final norm and the head (V x D), no input embedding (a gather)
    n = L * (D * hd * (2 * H + 2 * K) + D * m.moe.num_experts + m.moe.top_k * 3 * D * Fe + 2 * D) + D + V * D
    per_token = 6 * n + 12 * L * S * H * hd
    trainer = Trainer(cfg, log=lambda s: None)
    want = per_token * cfg.train.global_batch * S / N
    assert mod.model_flops(trainer) == pytest.approx(want, rel=1e-9)


def test_pipeline_layers_that_do_not_split_and_a_bad_plot_path_fail_before_compiling(tmp_path, capsys):
    """model.n_layers=2 against the benchmark's mesh.pipeline=4 printed a table that claimed a
    compiled column at pipeline=4 with only p=2 rows and '-' cells; --plot into a missing dir failed
    at savefig after every compile. Both are one error up front (nothing compiled)."""
    assert main(["bench", "pipeline", "model.n_layers=2"]) == 2
    captured = capsys.readouterr()
    assert ("model.n_layers=2 cannot be split into the benchmark's mesh.pipeline=4 stages" in captured.err
            and "model.n_layers=8" in captured.err and "mesh.pipeline=2" in captured.err), captured.err
    assert "compiling" not in captured.err
    for plot, msg in ((tmp_path / "nope" / "x.png", f"the directory '{tmp_path / 'nope'}' does not exist"),
                      (tmp_path, "a directory; give a file name")):
        assert main(["bench", "pipeline", "--plot", str(plot)]) == 2
        captured = capsys.readouterr()
        assert f"jaxpar bench pipeline --plot {plot}: {msg}" in captured.err and "compiling" not in captured.err


def test_pipeline_table_names_the_rows_it_leaves_out():
    """Without the compiled column a layer count that only some (schedule, p, v) split into shows
    the others as left out, with the reason, not silently missing."""
    from jaxpar.bench.pipeline import format_result, run
    _, cfg = load("pipeline", None, ["model.n_layers=4"])
    res = run(cfg, memory=False)
    assert {(r["schedule"], r["p"]) for r in res["skipped"]} >= {("interleaved_1f1b", 4), ("gpipe", 8)}
    text = format_result({"benchmark": "pipeline", **res})
    assert "not shown: " in text and "interleaved_1f1b p=4 v=2 (8 stages)" in text
    assert "model.n_layers=4 does not split into that many stages" in text


def test_convert_names_the_heads_its_layout_sets(capsys):
    """`bench convert model.dim=64` said "dim=64 is not divisible by n_heads=12", a value the user
    never gave: the error says the benchmark's layout sets it and which dims fit."""
    assert main(["bench", "convert", "model.dim=64"]) == 2
    err = capsys.readouterr().err
    assert "dim=64 is not divisible by n_heads=12" in err
    assert "jaxpar bench convert sets model.n_heads=12 in its own layout" in err
    assert "model.dim a multiple of 12" in err and "Traceback" not in err
    assert main(["bench", "convert", "model.dim=64", "model.n_heads=5", "model.n_kv_heads=3"]) == 2
    assert "own layout" not in capsys.readouterr().err  # the user's own values: no hint
