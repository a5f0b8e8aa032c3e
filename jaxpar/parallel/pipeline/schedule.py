"""Pipeline timetables: per tick and device, which op (forward / backward / idle) runs on which
microbatch and chunk, and where its input and cotangent wait. The runner executes exactly this
table, and the table can be printed (`Timetable.render`) and drawn (`plot_timetable`).

Model: `p` devices on the `pipeline` axis, each holding `v` chunks (virtual stages) of the layer
stack; global stage g = k * p + d lives on device d as its chunk k (so with v > 1 a microbatch
loops around the devices v times). Ticks are lockstep units: every op takes one tick, and a value
sent at the end of tick t (by ppermute) can be used from tick t + 1.

Each device runs its ops in a fixed order (the schedule); an op waits (idle ticks) until its
inputs exist. Orders:
  gpipe            all forwards, then all backwards;
  1f1b             ticks of two rows, a forward row and a backward row (ALTERNATE), so that every
                   device runs one forward and one backward per tick in the steady state and no
                   tick mixes a forward on one device with a backward on another (lockstep time
                   = gpipe's): 2(p-1-d)+1 warm-up forwards (the round trip of a microbatch from
                   device d down the pipeline and back), then one backward one forward, then
                   the cool-down backwards: at most 2(p-1-d)+1 microbatches in flight on
                   device d (2p-1 on device 0, flat in m; gpipe: m);
  1f1b_split       Megatron's 1F1B order: p-d warm-up forwards, then per microbatch a backward
                   and a forward, so at most p-d microbatches in flight on device d (p on device
                   0, 1f1b's 2p-1 less p-1 stage stashes), with the backward split like zb_h1's
                   (B, then W on the next tick, no W held back: one microbatch's W inputs kept).
                   Every op costs about a forward, so a tick that mixes a forward on one device
                   with a backward half on another costs the larger half (lockstep time 3m +
                   2(p-1) at an even split, below gpipe's 3(m+p-1); a backward half above a
                   forward (W less than half the backward) stretches every mixed tick, so at
                   large m 1f1b's alternating rows are faster: the price of its memory);
  interleaved_1f1b Megatron's interleaved order (microbatches in groups of p, chunk by chunk),
                   warm-up (p-d-1)*2 + (v-1)*p forwards, its rows alternating like 1f1b's
                   (lockstep time = Megatron's dataflow 3m + 3(p-1)/v without recompute; one op
                   per tick, it mixed forwards and backwards: 34 against 28.5 at p=4 m=8 v=2);
  zb_h1            zero bubble H1 (Qi et al. 2023): the backward split into B (input gradient,
                   what the previous stage waits for) and W (weight gradient, which nobody
                   waits for); p-d warm-up forwards, then B, W, F with device d holding back
                   its first d W's, which fill the cool-down. At most p microbatches between F
                   and W on every device (1f1b's peak, device 0's p).
Idle fraction read off the table: (p-1)/(m+p-1) for gpipe, 2(p-1)/(m+2(p-1)) for 1f1b (rows,
not ticks: its forward rows idle the backward half and vice versa), ((v+1)p-2)/(vm+(v+1)p-2)
for the interleaved one (rows too; 1f1b's at v = 1); in time its bubble/compute ratio is
(p-1)/m divided by v (lockstep_time); the split schedules' ticks are a third of a 1f1b op (F,
B, W one tick each): (p-1)/(3m+p-1) for zb_h1, 2(p-1)/(3m+2(p-1)) for 1f1b_split, bubbles of
p-1 and 2(p-1) ticks against 1f1b's 3(p-1) in the same units.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from jaxpar.config import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "1f1b_split")
SPLIT = ("zb_h1", "1f1b_split")  # schedules whose backward is split into B (input grad) and W (weight grad)
ALTERNATE = ("1f1b", "interleaved_1f1b")  # rows alternate: forwards only, then backwards only

# Op codes of the runner's branches: what a tick does on a device. The split schedules use
# F_LAST (the last stage's forward, kept), BX_* (input gradient only) and W (weight gradient).
IDLE, F_FIRST, F_MID, B_FIRST, B_MID, B_LAST, F_LAST, BX_FIRST, BX_MID, BX_LAST, W = range(11)
CODE_NAMES = {IDLE: "idle", F_FIRST: "F first", F_MID: "F", B_FIRST: "B first", B_MID: "B",
              B_LAST: "B last", F_LAST: "F last", BX_FIRST: "Bx first", BX_MID: "Bx",
              BX_LAST: "Bx last", W: "W"}


@dataclass(frozen=True)
class Op:
    kind: str  # "F" | "B" | "W"
    mb: int
    chunk: int  # k: the device's chunk; global stage = chunk * p + device


def check_schedule(schedule: str, p: int, m: int, v: int = 1, n_layers: int | None = None,
                   recompute: bool = False) -> None:
    """Clear errors for layouts a schedule cannot run."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"pipeline.schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    if schedule in SPLIT and recompute:
        raise ConfigError(f"pipeline.schedule={schedule} splits the backward at the residuals its "
                          f"forward kept: it needs pipeline.recompute=false (got true)")
    if p < 1 or m < 1 or v < 1:
        raise ConfigError(f"pipeline sizes must be positive: pipeline={p}, microbatches={m}, "
                          f"virtual_stages={v}")
    if schedule != "interleaved_1f1b" and v != 1:
        raise ConfigError(f"pipeline.virtual_stages={v} needs pipeline.schedule=interleaved_1f1b "
                          f"(got {schedule!r}); set virtual_stages=1 or change the schedule")
    if schedule in ("1f1b", "interleaved_1f1b") + SPLIT and m < p:
        raise ConfigError(
            f"pipeline.schedule={schedule} needs at least as many microbatches as stages: "
            f"microbatches={m} < mesh.pipeline={p}; raise pipeline.microbatches (or "
            f"train.grad_accum) to >= {p}, or use pipeline.schedule=gpipe")
    if schedule == "interleaved_1f1b" and m % p:
        raise ConfigError(
            f"pipeline.schedule=interleaved_1f1b needs microbatches divisible by mesh.pipeline: "
            f"microbatches={m}, pipeline={p}; use a multiple of {p}")
    if n_layers is not None and n_layers % (p * v):
        what = f"mesh.pipeline={p}" + (f" x pipeline.virtual_stages={v} = {p * v}" if v > 1 else "")
        divisors = [s for s in range(1, n_layers + 1) if n_layers % s == 0]
        raise ConfigError(
            f"model.n_layers={n_layers} does not split evenly into {what} stages; use a layer "
            f"count divisible by {p * v}, or stages (pipeline x virtual_stages) among {divisors}")


def device_orders(schedule: str, p: int, m: int, v: int = 1) -> list[list[Op]]:
    """The op order each device runs (the schedule proper)."""
    orders = []
    for d in range(p):
        if schedule == "gpipe":
            ops = [Op("F", i, 0) for i in range(m)] + [Op("B", i, 0) for i in range(m)]
        elif schedule == "1f1b":
            w = min(2 * (p - 1 - d) + 1, m)
            ops = [Op("F", i, 0) for i in range(w)]
            for i in range(m - w):
                ops += [Op("B", i, 0), Op("F", w + i, 0)]
            ops += [Op("B", i, 0) for i in range(m - w, m)]
        elif schedule == "interleaved_1f1b":
            fwd = [Op("F", g * p + j, k) for g in range(m // p) for k in range(v) for j in range(p)]
            bwd = [Op("B", g * p + j, k) for g in range(m // p) for k in reversed(range(v))
                   for j in range(p)]
            n = m * v
            w = min((p - d - 1) * 2 + (v - 1) * p, n)
            ops = fwd[:w]
            for i in range(n - w):
                ops += [fwd[w + i], bwd[i]]
            ops += bwd[n - w:]
        elif schedule in SPLIT:  # zb_h1: device d holds back d weight gradients for the cool-down
            ops = _split_order(p, m, d, hold=d if schedule == "zb_h1" else 0)
        else:
            raise ConfigError(f"unknown pipeline schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
        orders.append(ops)
    return orders


def _split_order(p: int, m: int, d: int, hold: int) -> list[Op]:
    """Device d's order with a split backward: p-d warm-up forwards, then per microbatch B, W
    and the next F, the first `hold` W's held back to fill the cool-down."""
    w = min(p - d, m)
    ops, held = [Op("F", i, 0) for i in range(w)], 0
    for j in range(m):
        ops.append(Op("B", j, 0))
        if j >= hold:
            ops.append(Op("W", held, 0))
            held += 1
        if j + w < m:
            ops.append(Op("F", j + w, 0))
    return ops + [Op("W", i, 0) for i in range(held, m)]


@dataclass
class Timetable:
    schedule: str
    p: int
    m: int
    v: int
    grid: list[list[Op | None]]  # [tick][device]
    # Per [tick, device] int32 arrays the runner indexes with (tick, axis_index):
    code: np.ndarray = field(repr=False, default=None)
    mb: np.ndarray = field(repr=False, default=None)
    chunk: np.ndarray = field(repr=False, default=None)
    x_slot: np.ndarray = field(repr=False, default=None)     # stashed input an op reads
    g_slot: np.ndarray = field(repr=False, default=None)     # cotangent a backward reads
    recv_x: np.ndarray = field(repr=False, default=None)     # where the activation received at
    recv_g: np.ndarray = field(repr=False, default=None)     # the end of the tick goes (-1: none)
    r_slot: np.ndarray = field(repr=False, default=None)     # residuals a backward reads
    r_put: np.ndarray = field(repr=False, default=None)      # where a forward stashes them (-1: none)
    y_put: np.ndarray = field(repr=False, default=None)      # split: the last stage's output kept
    w_slot: np.ndarray = field(repr=False, default=None)     # split: what W reads (Bx kept it)
    w_put: np.ndarray = field(repr=False, default=None)      # split: where Bx keeps it (-1: none)
    n_x_slots: int = 0
    n_g_slots: int = 0
    n_r_slots: int = 0
    n_w_slots: int = 0
    recompute: bool = False  # backward recomputes its forward (no residual slots) or reads them

    @property
    def ticks(self) -> int:
        return len(self.grid)

    @property
    def stages(self) -> int:
        return self.p * self.v

    def idle_fraction(self) -> float:
        idle = sum(op is None for row in self.grid for op in row)
        return idle / (self.ticks * self.p)

    def formula(self) -> float:
        return idle_formula(self.schedule, self.p, self.m, self.v)

    def in_flight(self) -> list[int]:
        """Peak microbatch-chunks per device whose forward ran and backward (split: weight
        gradient) has not (what a stage stashes)."""
        peaks = []
        done = "W" if self.schedule in SPLIT else "B"
        for d in range(self.p):
            live = peak = 0
            for row in self.grid:
                op = row[d]
                if op is not None and op.kind in ("F", done):
                    live += 1 if op.kind == "F" else -1
                    peak = max(peak, live)
            peaks.append(peak)
        return peaks

    def lockstep_time(self, forward: float = 1.0, backward: float = 2.0,
                      weight: float | None = None) -> float:
        """Wall time of the runner's ticks in units of one device's whole forward (all its layers)
        of one microbatch, with a backward costing `backward` forwards. Ticks are lockstep (the
        ppermutes at their end), so each lasts as long as its slowest device; with `recompute`
        a backward runs its forward again (+1), and the last stage's forward is folded into its
        backward (which then costs forward + backward); without, the last stage's forward runs
        on its own tick (F last, on the forward row) like the others'. A split backward's W costs
        `weight` (None: `backward` / 2) and its Bx the rest, the last stage's Bx its head and
        loss too (not counted): uneven halves make every tick that mixes them last the longer."""
        f, b = forward / self.v, backward / self.v
        w = b / 2 if weight is None else weight / self.v
        rb = b + (f if self.recompute else 0.0)
        #                IDLE F_FIRST F_MID B_FIRST B_MID B_LAST F_LAST BX_FIRST BX_MID BX_LAST W
        cost = np.array([0.0, f, f, rb, rb, rb, f, b - w, b - w, b - w, w])
        return float(cost[self.code].max(axis=1).sum())

    def render(self, width: int = 4) -> str:
        """Text drawing: one line per device, one column per tick (F3 = forward of
        microbatch 3, B3 = its backward; with chunks, F3.1 = chunk 1)."""
        def cell(op):
            if op is None:
                return ".".ljust(width)
            s = f"{op.kind}{op.mb}" + (f".{op.chunk}" if self.v > 1 else "")
            return s.ljust(width)
        w = max(width, *(len(cell(op).rstrip()) + 1 for row in self.grid for op in row))
        lines = [f"{self.schedule} p={self.p} m={self.m} v={self.v}: {self.ticks} ticks, idle "
                 f"{self.idle_fraction():.3f} (formula {self.formula():.3f})"]
        for d in range(self.p):
            lines.append(f"dev{d} " + "".join(
                (cell(row[d]).strip() or ".").ljust(w) for row in self.grid).rstrip())
        return "\n".join(lines)


def idle_formula(schedule: str, p: int, m: int, v: int = 1) -> float:
    if schedule == "interleaved_1f1b":  # alternating rows: 1f1b's at v = 1
        return float(Fraction((v + 1) * p - 2, v * m + (v + 1) * p - 2))
    if schedule in SPLIT:  # a bubble of p-1 ticks (zb_h1) or 2(p-1) (1f1b_split) in 3m
        bubble = (p - 1) * (1 if schedule == "zb_h1" else 2)
        return float(Fraction(bubble, 3 * m + bubble))
    if schedule in ALTERNATE:
        return float(Fraction(2 * (p - 1), m + 2 * (p - 1)))
    return float(Fraction(p - 1, m + p - 1))


def op_key(op: Op, d: int, p: int) -> tuple[str, int, int]:
    """(kind, microbatch, global stage) of device d's op: how ops name what they wait for."""
    return op.kind, op.mb, op.chunk * p + d


def op_inputs(op: Op, d: int, p: int, v: int) -> list[tuple[str, int, int]]:
    """The op_keys device d's op waits for: a forward, the previous stage's forward; a backward,
    its own forward and the next stage's backward; a split backward's W, its own B."""
    g, last = op.chunk * p + d, p * v - 1
    if op.kind == "F":
        return [("F", op.mb, g - 1)] if g > 0 else []
    if op.kind == "W":
        return [("B", op.mb, g)]
    return [("F", op.mb, g)] + ([("B", op.mb, g + 1)] if g < last else [])


def simulate(orders: list[list[Op]], p: int, v: int, alternate: bool = False) -> list[list[Op | None]]:
    """Run each device's order in lockstep ticks; an op runs once its inputs were sent on an
    earlier tick (forward: the previous stage's forward; backward: the next stage's backward and
    its own forward). `alternate`: even rows run forwards only, odd rows backwards only."""
    done: dict[tuple[str, int, int], int] = {}  # op_key -> tick
    pos = [0] * p
    grid: list[list[Op | None]] = []
    total = sum(len(o) for o in orders)
    t = 0
    while sum(pos) < total:
        row: list[Op | None] = [None] * p
        for d in range(p):
            if pos[d] == len(orders[d]):
                continue
            op = orders[d][pos[d]]
            if alternate and (op.kind == "F") != (t % 2 == 0):
                continue
            if all(done.get(k, t) < t for k in op_inputs(op, d, p, v)):
                row[d] = op
        for d, op in enumerate(row):
            if op is not None:
                done[op_key(op, d, p)] = t
                pos[d] += 1
        grid.append(row)
        t += 1
        if t > 4 * total + 8:
            raise RuntimeError("pipeline schedule deadlocked (an op order waits on itself)")
    return grid


def _allocate(intervals: list[tuple[int, int, object]]) -> tuple[dict, int]:
    """Slots for values alive from the end of tick a to tick b (reads at b happen before a
    write at the end of b, so a slot freed at b can take a value arriving at b)."""
    slots: dict = {}
    free_at: list[int] = []  # per slot: the tick after which it is free
    for a, b, key in sorted(intervals, key=lambda x: (x[0], x[1])):
        for s, f in enumerate(free_at):
            if f <= a:
                free_at[s] = b
                slots[key] = s
                break
        else:
            slots[key] = len(free_at)
            free_at.append(b)
    return slots, len(free_at)


def build_timetable(schedule: str, p: int, m: int, v: int = 1, recompute: bool = False) -> Timetable:
    """The table the runner executes. recompute=False: every forward stashes its vjp residuals
    (r slots, from its forward to its backward), a stage input is kept only until its forward,
    and the last stage's forward runs on its own tick (F last), its output waiting in an x slot
    (y_put) for the backward, which starts at the head and loss: in lockstep a backward row
    then costs a backward, not a forward and a backward. recompute=True: the input is kept until
    the backward, which recomputes the forward (the last stage's included: no F last). A split
    schedule keeps residuals until W (which reads the weight matmuls' inputs among them), and its
    B (Bx) keeps what W reads of what it computed (per layer: the weight matmuls' output
    cotangents) in a w slot (w_put) until W."""
    check_schedule(schedule, p, m, v, recompute=recompute)
    split = schedule in SPLIT
    grid = simulate(device_orders(schedule, p, m, v), p, v, schedule in ALTERNATE)
    G, T = p * v, len(grid)
    at: dict[tuple[str, int, int], int] = {}
    for t, row in enumerate(grid):
        for d, op in enumerate(row):
            if op is not None:
                at[(op.kind, op.mb, op.chunk * p + d)] = t
    shape = (T, p)
    tt = Timetable(schedule, p, m, v, grid,
                   code=np.zeros(shape, np.int32), mb=np.zeros(shape, np.int32),
                   chunk=np.zeros(shape, np.int32), x_slot=np.zeros(shape, np.int32),
                   g_slot=np.zeros(shape, np.int32), recv_x=np.full(shape, -1, np.int32),
                   recv_g=np.full(shape, -1, np.int32), r_slot=np.zeros(shape, np.int32),
                   r_put=np.full(shape, -1, np.int32), y_put=np.full(shape, -1, np.int32),
                   w_slot=np.zeros(shape, np.int32), w_put=np.full(shape, -1, np.int32),
                   recompute=recompute)
    # Values each device keeps: stage inputs (arrive with the previous stage's forward, read by
    # this stage's forward, and its backward when that recomputes), cotangents (arrive with the
    # next stage's backward, read by this stage's backward), residuals (a forward's, for the
    # backward, split: and W) and, split, what B keeps for W.
    last_kept = not recompute  # the last stage's forward has its own tick (zb_h1: always)
    grad_op = "W" if split else "B"
    xs: list[list] = [[] for _ in range(p)]
    gs: list[list] = [[] for _ in range(p)]
    rs: list[list] = [[] for _ in range(p)]
    ws: list[list] = [[] for _ in range(p)]
    for i in range(m):
        for g in range(G):
            d, last = g % p, g == G - 1
            x_until = "F" if not recompute and (not last or last_kept) else "B"
            if g > 0:
                xs[d].append((at[("F", i, g - 1)], at[(x_until, i, g)], (i, g)))
            if not last:
                gs[d].append((at[("B", i, g + 1)], at[("B", i, g)], (i, g)))
            if not recompute and (not last or last_kept):
                rs[d].append((at[("F", i, g)], at[(grad_op, i, g)], (i, g)))
            if last and last_kept:
                xs[d].append((at[("F", i, g)], at[("B", i, g)], ("y", i)))
            if split:
                ws[d].append((at[("B", i, g)], at[("W", i, g)], (i, g)))
    x_alloc = [_allocate(x)[0] for x in xs]
    g_alloc = [_allocate(x)[0] for x in gs]
    r_alloc = [_allocate(x)[0] for x in rs]
    w_alloc = [_allocate(x)[0] for x in ws]
    tt.n_x_slots, tt.n_g_slots, tt.n_r_slots, tt.n_w_slots = (
        max((len(set(a.values())) for a in alloc), default=0)
        for alloc in (x_alloc, g_alloc, r_alloc, w_alloc))
    for i in range(m):
        for g in range(G):
            d = g % p
            if g > 0:
                tt.recv_x[at[("F", i, g - 1)], d] = x_alloc[d][(i, g)]
            if g < G - 1:
                tt.recv_g[at[("B", i, g + 1)], d] = g_alloc[d][(i, g)]
    for t, row in enumerate(grid):
        for d, op in enumerate(row):
            if op is None:
                continue
            g = op.chunk * p + d
            last = g == G - 1
            tt.mb[t, d], tt.chunk[t, d] = op.mb, op.chunk
            kept = not recompute and (not last or last_kept)
            if op.kind == "F":
                if g > 0:
                    tt.x_slot[t, d] = x_alloc[d][(op.mb, g)]
                if kept:
                    tt.r_put[t, d] = r_alloc[d][(op.mb, g)]
                if last and last_kept:
                    tt.y_put[t, d] = x_alloc[d][("y", op.mb)]
                # With recompute the last stage's forward is folded into its backward.
                tt.code[t, d] = (F_FIRST if g == 0 else (F_LAST if last_kept else IDLE) if last
                                 else F_MID)
                continue
            if kept:
                tt.r_slot[t, d] = r_alloc[d][(op.mb, g)]
            if op.kind == "W":
                tt.code[t, d] = W
                tt.w_slot[t, d] = w_alloc[d][(op.mb, g)]
                continue
            if not last:
                tt.g_slot[t, d] = g_alloc[d][(op.mb, g)]
            if split:
                tt.w_put[t, d] = w_alloc[d][(op.mb, g)]
            if last and last_kept:
                tt.x_slot[t, d] = x_alloc[d][("y", op.mb)]
            elif g > 0 and (recompute or last):
                tt.x_slot[t, d] = x_alloc[d][(op.mb, g)]
            if split:
                tt.code[t, d] = BX_FIRST if g == 0 else BX_LAST if last else BX_MID
            else:
                tt.code[t, d] = B_FIRST if g == 0 else B_LAST if last else B_MID
    return tt


def plot_timetable(tt: Timetable, path: str) -> str:
    """Draw the timetable (devices x ticks; forwards light, backwards dark, one hue per
    microbatch) into a PNG."""
    import matplotlib  # heavy: only `jaxpar bench pipeline --plot` draws
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    fig, ax = plt.subplots(figsize=(max(6, 0.28 * tt.ticks + 1.5), 0.5 * tt.p + 1.2))
    cmap = plt.get_cmap("tab20")
    for t, row in enumerate(tt.grid):
        for d, op in enumerate(row):
            if op is None:
                continue
            color = cmap((2 * op.mb) % 20 + (1 if op.kind == "F" else 0))
            if op.kind == "W":
                color = tuple(0.55 * c for c in color[:3])
            ax.add_patch(Rectangle((t, tt.p - 1 - d), 1, 1, facecolor=color, edgecolor="white"))
            label = f"{op.kind}{op.mb}" + (f".{op.chunk}" if tt.v > 1 else "")
            ax.text(t + 0.5, tt.p - 0.5 - d, label, ha="center", va="center", fontsize=6)
    ax.set_xlim(0, tt.ticks)
    ax.set_ylim(0, tt.p)
    ax.set_yticks([tt.p - 0.5 - d for d in range(tt.p)], [f"dev {d}" for d in range(tt.p)])
    ax.set_xlabel("tick")
    ax.set_title(f"{tt.schedule}  p={tt.p} m={tt.m} v={tt.v}: idle {tt.idle_fraction():.3f} "
                 f"(formula {tt.formula():.3f})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
