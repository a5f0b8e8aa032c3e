"""Pipeline timetables (pure Python): idle fraction = the formula, stash bounds, clear errors."""
import pytest

from jaxpar.config import ConfigError
from jaxpar.parallel.pipeline.schedule import (B_FIRST, B_LAST, B_MID, BX_FIRST, BX_LAST, BX_MID,
                                               F_FIRST, F_LAST, F_MID, IDLE, SCHEDULES, SPLIT, W,
                                               build_timetable, check_schedule, idle_formula)

CASES = [(s, p, m, v) for s in SCHEDULES for p in (2, 4) for m in (p, 2 * p, 4 * p)
         for v in ((2, 3) if s == "interleaved_1f1b" else (1,))]


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_idle_fraction_equals_formula(schedule, p, m, v):
    tt = build_timetable(schedule, p, m, v)
    assert tt.idle_fraction() == pytest.approx(idle_formula(schedule, p, m, v), abs=1e-12)
    # Every microbatch runs forward and backward once per global stage.
    ops = sorted((op.kind, op.mb, op.chunk * p + d) for row in tt.grid for d, op in enumerate(row) if op)
    kinds = "BFW" if schedule in SPLIT else "BF"
    assert ops == sorted((k, i, g) for k in kinds for i in range(m) for g in range(p * v))


def test_formulas():
    assert idle_formula("zb_h1", 4, 8) == pytest.approx(3 / 27)
    assert idle_formula("1f1b_split", 4, 8) == pytest.approx(6 / 30)
    assert idle_formula("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert idle_formula("1f1b", 4, 8) == pytest.approx(6 / 14)  # rows: half of each tick idles
    # rows alternate like 1f1b's (whose formula it is at v = 1): ((v+1)p - 2) / (vm + (v+1)p - 2)
    assert idle_formula("interleaved_1f1b", 4, 8, 2) == pytest.approx(10 / 26)
    assert idle_formula("interleaved_1f1b", 4, 8, 1) == idle_formula("1f1b", 4, 8)
    # in time: bubble / compute = (p-1)/m for 1f1b, divided by v interleaved (dataflow's, in
    # lockstep without recompute)
    t = build_timetable("interleaved_1f1b", 4, 8, 2).lockstep_time()
    assert t / (3 * 8) - 1 == pytest.approx((3 / 8) / 2)


@pytest.mark.parametrize("m", [4, 8, 16])
def test_1f1b_stash_bounded_by_stages_gpipe_by_microbatches(m):
    """1f1b holds a microbatch for its round trip, 2(p-1-d)+1 rows pairs on device d, whatever m."""
    p = 4
    one = build_timetable("1f1b", p, m, recompute=True)
    assert one.in_flight() == [min(2 * (p - 1 - d) + 1, m) for d in range(p)]
    assert one.n_x_slots <= 2 * p - 1
    # without recompute: at most p sets of residuals (device 0); inputs wait only for their
    # forward (the last stage: for its backward, one tick later)
    stash = build_timetable("1f1b", p, m)
    assert stash.n_r_slots == min(2 * p - 1, m) and stash.n_x_slots <= 2
    gp = build_timetable("gpipe", p, m, recompute=True)
    assert max(gp.in_flight()) == m and gp.n_x_slots == m


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_codes_and_slots_consistent(schedule, p, m, v, recompute):
    """Replay the table like the runner does: each read finds the value written for it (without
    recompute a backward reads its forward's residuals instead of the stage input; split, the
    last stage keeps its output for Bx, and Bx keeps for W what W reads besides the residuals)."""
    split = schedule in SPLIT
    if split and recompute:
        with pytest.raises(ConfigError, match="pipeline.recompute=false"):
            build_timetable(schedule, p, m, v, recompute=True)
        return
    tt = build_timetable(schedule, p, m, v, recompute=recompute)
    G = p * v
    xbuf, gbuf, rbuf, wbuf = ([dict() for _ in range(p)] for _ in range(4))
    assert (tt.n_r_slots == 0) == recompute
    for t, row in enumerate(tt.grid):
        sent_x, sent_g = {}, {}
        for d, op in enumerate(row):
            code = tt.code[t, d]
            if op is None:
                assert code == IDLE
                continue
            g = op.chunk * p + d
            last = g == G - 1
            kept = not recompute  # the last stage's forward too: it runs on its own tick
            if op.kind == "F":
                assert code == (F_FIRST if g == 0 else (IDLE if recompute else F_LAST) if last else F_MID)
                if g > 0:
                    assert xbuf[d][tt.x_slot[t, d]] == (op.mb, g)
                if not last:
                    sent_x[(d + 1) % p] = (op.mb, g + 1)
                assert (tt.r_put[t, d] >= 0) == kept
                if kept:
                    rbuf[d][tt.r_put[t, d]] = (op.mb, g)
                assert (tt.y_put[t, d] >= 0) == (kept and last)
                if kept and last:
                    xbuf[d][tt.y_put[t, d]] = ("y", op.mb)
                continue
            if kept:
                assert rbuf[d][tt.r_slot[t, d]] == (op.mb, g)
            if op.kind == "W":
                assert code == W
                assert wbuf[d][tt.w_slot[t, d]] == (op.mb, g)
                continue
            if split:
                assert code == (BX_FIRST if g == 0 else BX_LAST if last else BX_MID)
            else:
                assert code == (B_FIRST if g == 0 else B_LAST if last else B_MID)
            if g > 0:
                if kept and last:
                    assert xbuf[d][tt.x_slot[t, d]] == ("y", op.mb)
                elif recompute:
                    assert xbuf[d][tt.x_slot[t, d]] == (op.mb, g)
                sent_g[(d - 1) % p] = (op.mb, g - 1)
            if not last:
                assert gbuf[d][tt.g_slot[t, d]] == (op.mb, g)
            assert (tt.w_put[t, d] >= 0) == split
            if split:
                wbuf[d][tt.w_put[t, d]] = (op.mb, g)
        for d in range(p):
            assert (tt.recv_x[t, d] >= 0) == (d in sent_x)
            assert (tt.recv_g[t, d] >= 0) == (d in sent_g)
            if d in sent_x:
                xbuf[d][tt.recv_x[t, d]] = sent_x[d]
            if d in sent_g:
                gbuf[d][tt.recv_g[t, d]] = sent_g[d]


def test_zb_h1_bubble_a_third_of_1f1b_at_the_same_memory():
    """In units of one op (F, B and W one tick each; a 1F1B backward is B + W): a zb_h1 device
    idles p - 1 ticks per step, one third of the standard 1F1B's 3 (p - 1) (bubble / work
    (p-1)/m), with 1F1B's peak of p microbatches in flight, on every device. (This repo's 1f1b
    alternates forward and backward rows for its lockstep time and holds 2p - 1: test_lockstep_time.)"""
    for p in (2, 4, 8):
        for m in (p, 2 * p, 4 * p):
            zb = build_timetable("zb_h1", p, m)
            idle = [sum(row[d] is None for row in zb.grid) for d in range(p)]
            assert idle == [p - 1] * p and zb.ticks == 3 * m + p - 1
            f = zb.idle_fraction()
            assert f / (1 - f) == pytest.approx((p - 1) / m / 3)
            assert zb.in_flight() == [p] * p and zb.n_r_slots <= p
            # what Bx keeps for W: device d holds back d W's, so d + 1 microbatches' worth
            w_slots = [len(set(zb.w_put[:, d][zb.w_put[:, d] >= 0])) for d in range(p)]
            assert w_slots == [d + 1 for d in range(p)] and zb.n_w_slots == p
            assert max(build_timetable("1f1b", p, m).in_flight()) == min(2 * p - 1, m)


def test_1f1b_split_holds_megatrons_p_microbatches():
    """1f1b_split: Megatron's 1F1B order (p - d warm-up forwards) with the backward split like
    zb_h1's but no W held back: p - d microbatches' residuals on device d (1f1b: 2(p-1-d) + 1),
    one microbatch's W inputs (zb_h1: d + 1), 2(p - 1) idle ticks a device (zb_h1: p - 1; 1f1b's
    3(p - 1) in these units). In lockstep at an even split (B and W one forward each) it takes
    3m + 2(p - 1), below gpipe and 1f1b's 3(m + p - 1); with W below half the backward the
    mixed ticks last a B half each, and 1f1b's alternating rows win beyond m = 2p (from 3p
    on, at p = 2, 4 and 8)."""
    for p in (2, 4, 8):
        for m in (p, 2 * p, 3 * p, 4 * p):
            sp = build_timetable("1f1b_split", p, m)
            idle = [sum(row[d] is None for row in sp.grid) for d in range(p)]
            assert idle == [2 * (p - 1)] * p and sp.ticks == 3 * m + 2 * (p - 1)
            assert sp.in_flight() == [p - d for d in range(p)] and sp.n_r_slots == p
            assert sp.n_w_slots == 1
            assert build_timetable("1f1b", p, m).in_flight() == [min(2 * (p - 1 - d) + 1, m) for d in range(p)]
            one = build_timetable("1f1b", p, m).lockstep_time()
            assert sp.lockstep_time() == 3 * m + 2 * (p - 1) < one  # W = B = a forward
            # the 1B preset's W share (0.44 of a backward): every mixed tick costs 1.12
            uneven = sp.lockstep_time(1, 2, 0.88)
            assert uneven > sp.lockstep_time()
            assert (uneven < one) == (m <= 2 * p), (p, m, uneven, one)


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_sends_only_what_is_received(schedule, p, m, v):
    """Each tick's ppermute pairs are exactly the stages that pass a value on: m (G - 1) sends per
    direction per step, none of zeros (two full ppermutes every tick used to send p - 1 each)."""
    from jaxpar.parallel.pipeline.runner import send_patterns
    tt = build_timetable(schedule, p, m, v)
    ring = v > 1
    fwd = [(d, (d + 1) % p) for d in range(p if ring else p - 1)]
    bwd = [(b, a) for a, b in fwd]
    G = p * v
    for recv, perm in ((tt.recv_x, fwd), (tt.recv_g, bwd)):
        patterns, index = send_patterns(recv, perm)
        sent = [pair for i in index if i for pair in patterns[i - 1]]
        assert len(sent) == m * (G - 1)
        for t, i in enumerate(index):
            got = {b for _, b in patterns[i - 1]} if i else set()
            assert got == {d for d in range(p) if recv[t, d] >= 0}


def test_render_and_plot(tmp_path):
    tt = build_timetable("1f1b", 2, 4)
    text = tt.render()
    assert "dev0 F0" in text and "idle 0.333 (formula 0.333)" in text
    from jaxpar.parallel.pipeline.schedule import plot_timetable
    out = plot_timetable(tt, str(tmp_path / "tt.png"))
    assert (tmp_path / "tt.png").stat().st_size > 1000 and out.endswith("tt.png")


@pytest.mark.parametrize("args,match", [
    (("1f1b", 4, 2), "at least as many microbatches as stages"),
    (("interleaved_1f1b", 4, 4, 2, None), None),
    (("interleaved_1f1b", 4, 6, 2), "divisible by mesh.pipeline"),
    (("gpipe", 2, 4, 2), "virtual_stages=2 needs pipeline.schedule=interleaved_1f1b"),
    (("gpipe", 4, 4, 1, 6), "model.n_layers=6 does not split evenly into mesh.pipeline=4"),
    (("interleaved_1f1b", 2, 4, 2, 6), r"pipeline.virtual_stages=2 = 4 stages"),
    (("zero_bubble", 2, 4), "is not one of"),
    (("zb_h1", 4, 2), "at least as many microbatches as stages"),
    (("zb_h1", 4, 4, 2), "virtual_stages=2 needs pipeline.schedule=interleaved_1f1b"),
    (("zb_h1", 4, 4, 1, None, True), "needs pipeline.recompute=false"),
    (("1f1b_split", 4, 4, 1, None, True), "needs pipeline.recompute=false"),
    (("1f1b_split", 4, 3), "at least as many microbatches as stages"),
])
def test_clear_errors(args, match):
    if match is None:
        check_schedule(*args)
        return
    with pytest.raises(ConfigError, match=match):
        check_schedule(*args)


def test_config_section():
    from jaxpar.config import make_config
    cfg = make_config({}, ["pipeline.schedule=gpipe", "pipeline.microbatches=8"])
    assert cfg.pipeline.resolved_microbatches(1) == 8
    assert make_config({}, ["train.grad_accum=4"]).pipeline.resolved_microbatches(4) == 4
    with pytest.raises(ConfigError, match="differ"):
        cfg.pipeline.resolved_microbatches(2)
    with pytest.raises(ConfigError, match="schedule"):
        make_config({}, ["pipeline.schedule=zb"])


def test_bench_pipeline_timetable_columns(tmp_path):
    from jaxpar.bench import BENCHMARKS, load
    from jaxpar.bench.pipeline import format_result, run
    assert "pipeline" in BENCHMARKS
    _, cfg = load("pipeline", None, [])
    res = run(cfg, memory=False, plot=str(tmp_path / "tt.png"))
    for r in res["rows"]:
        assert r["idle"] == pytest.approx(r["formula"])
        if r["schedule"] == "1f1b":
            assert r["stash"] == min(2 * r["p"] - 1, r["m"])
    assert (tmp_path / "tt.png").exists()
    text = format_result({"benchmark": "pipeline", **res})
    assert "interleaved_1f1b" in text and "formula" in text


@pytest.mark.parametrize("recompute", [True, False])
def test_lockstep_time(recompute):
    """GPipe's ticks are all-forward or all-backward; 1f1b's rows alternate the two, so neither
    pays a backward on a tick that another device spends on a forward: 1f1b <= gpipe for every
    p and m (equal: the same rows of work, in another order); zb_h1 (its ideal split, B and W
    one forward each) better; interleaved_1f1b's rows alternate too: 3m + 3(p-1)/v without
    recompute, below 1f1b's 3(m + p - 1)."""
    for p in (2, 4, 8):
        for m in range(p, 4 * p + 1):
            gp = build_timetable("gpipe", p, m, recompute=recompute).lockstep_time()
            one = build_timetable("1f1b", p, m, recompute=recompute).lockstep_time()
            assert one <= gp, (p, m)
            if not recompute:
                zb = build_timetable("zb_h1", p, m).lockstep_time()
                assert zb == 3 * m + p - 1 and zb < one
                if m % p == 0:
                    il = build_timetable("interleaved_1f1b", p, m, 2).lockstep_time()
                    assert il == pytest.approx(3 * m + 3 * (p - 1) / 2) and il < one
    p, m = 4, 8
    gp = build_timetable("gpipe", p, m, recompute=True)
    assert gp.lockstep_time() == pytest.approx((m + p - 1) * 1 + (m + p - 1) * 3 - 1)  # last F folded
    # without recompute the last stage's forward has its own tick (F last) and every backward
    # costs 2: no tick pays a forward and a backward, 3 (m + p - 1) (folded, it was 4m + 3p - 4)
    stash = build_timetable("gpipe", p, m)
    assert stash.lockstep_time() == pytest.approx(3 * (m + p - 1))
