"""`jaxpar bench moe`: the all-to-all bytes counted in the compiled step equal the analytic figure."""
import pytest

from jaxpar.bench import get, run_bench
from jaxpar.bench.common import build_config

OVERRIDES = ["model.preset=moe_tiny", "model.n_layers=1", "model.dim=32", "mesh.data=2", "mesh.expert=4", "train.steps=1",
             "train.global_batch=8", "train.seq_len=16", "model.moe.capacity_factor=1.0"]


def test_bench_moe_bytes_match_analytic():
    mod = get("moe")
    cfg = build_config(None, mod.LAYOUT, OVERRIDES)
    result = mod.run(cfg)
    cap, dropless = result["modes"]["capacity"], result["modes"]["dropless"]
    # 1 MoE layer: dispatch + combine, forward and backward; dropless also sends the expert ids.
    for r in (cap, dropless):
        assert r["all_to_all_result_bytes"] == r["analytic_result_bytes"] > 0
        assert r["step_time_s"] > 0
    # G=1 sequence per device, S=16, k=2, E=8, C=4, D=32, fp32: capacity 4*1*8*4*32*4 bytes.
    assert cap["analytic_result_bytes"] == 4 * 8 * 4 * 32 * 4
    assert dropless["analytic_result_bytes"] == 4 * 4 * 32 * 32 * 4 + 4 * 32 * 4
    assert cap["payload_bytes"] == 4 * 16 * 2 * 32 * 4
    assert "dispatch" in mod.format_result({"benchmark": "moe", **result})


def test_bench_moe_needs_a_moe_model():
    from jaxpar.config import ConfigError
    with pytest.raises(ConfigError, match="needs a MoE model"):
        get("moe").run(build_config(None, [], ["model.preset=tiny"]))
