"""Count collective-communication bytes in an optimized HLO module's text.

Reads ``jax.jit(f).lower(...).compile().as_text()``: the post-SPMD-partitioning,
per-device program, so the numbers are what *one device* moves, after XLA's
combiners and async conversion. This is a text scan, not an HLO parser; it relies
only on the stable instruction syntax ``%name = SHAPE opcode(operands), attr=...``.

Bytes are the per-device *result* size of each op (all-gather: the gathered
buffer; reduce-scatter: the local shard; all-reduce: the reduced buffer), which is
a fixed, algorithm-independent proxy for traffic, not the bytes on the wire (a ring
all-reduce sends about ``2 * (n-1)/n`` times that).
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

COLLECTIVE_KINDS: tuple[str, ...] = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)

# Bits per element. Types not listed fall back to the number in their name (f8e4m3fn -> 8).
_DTYPE_BITS: dict[str, int] = {
    "pred": 8, "token": 0,
    "s2": 2, "s4": 4, "s8": 8, "s16": 16, "s32": 32, "s64": 64,
    "u2": 2, "u4": 4, "u8": 8, "u16": 16, "u32": 32, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64,
    "c64": 64, "c128": 128,
}

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*->.*\{\s*$")
_INSTR = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_TRIP = re.compile(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"?(\d+)')
# Attributes naming called computations: `body=%b`, `calls=%f`, `branch_computations={%x, %y}`.
_CALL = re.compile(
    r"\b(calls|to_apply|body|condition|branch_computations|true_computation|false_computation)"
    r"=(\{[^}]*\}|%?[\w.\-]+)"
)


class CollectiveOp(NamedTuple):
    """One array of one collective's result. A tuple-shaped result yields one entry per element."""

    kind: str  # one of COLLECTIVE_KINDS
    dtype: str  # HLO element type, e.g. "f32", "bf16"
    shape: tuple[int, ...]
    bytes: int  # per-device result bytes, times the loop trip count when count_loops=True
    replica_groups: str  # raw HLO text; source_target_pairs for collective-permute


class _Instr(NamedTuple):
    name: str
    shape: str
    opcode: str
    rest: str  # "(operands), attr=..., ..." unparsed: most instructions are never looked at again


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]`` (quote-aware)."""
    depth, quote, i = 0, False, start
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == '"':
                quote = False
        elif c == '"':
            quote = True
        elif c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return len(text)


def _split_attrs(text: str) -> dict[str, str]:
    """``a=1, b={x, y}, c="s,t"`` -> {"a": "1", "b": "{x, y}", "c": '"s,t"'} (top-level commas only)."""
    parts, depth, quote, cur, i = [], 0, False, [], 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\" and i + 1 < len(text):
                cur.append(c)
                i += 1
                c = text[i]
            elif c == '"':
                quote = False
        elif c == '"':
            quote = True
        elif c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
            i += 1
            continue
        cur.append(c)
        i += 1
    parts.append("".join(cur))
    out: dict[str, str] = {}
    for p in parts:
        key, eq, val = p.strip().partition("=")
        if eq:
            out[key.strip()] = val.strip()
    return out


def _operands_attrs(ins: _Instr) -> tuple[str, dict[str, str]]:
    """Full parse of one instruction's operand list and attributes (slow; collectives only)."""
    close = _balanced(ins.rest, 0)
    return ins.rest[1 : close - 1], _split_attrs(ins.rest[close:].lstrip(", "))


def _parse_instr(rhs: str, name: str) -> _Instr | None:
    if rhs.startswith("("):
        end = _balanced(rhs, 0)
    else:
        end = rhs.find(" ")
        end = len(rhs) if end < 0 else end
    shape, rest = rhs[:end], rhs[end:]
    m = _OPCODE.match(rest)
    if not m:
        return None
    return _Instr(name, shape, m.group(1), rest[m.end() - 1 :])


def _parse_module(hlo_text: str) -> tuple[dict[str, list[_Instr]], str | None]:
    """Computation name -> its instructions, plus the ENTRY computation's name."""
    comps: dict[str, list[_Instr]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if current is None:
            h = _HEADER.match(line)
            if h:
                current = h.group(2)
                comps[current] = []
                if h.group(1):
                    entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            ins = _parse_instr(m.group(2), m.group(1))
            if ins is not None:
                comps[current].append(ins)
    return comps, entry


def _dtype_bits(dtype: str) -> int:
    if dtype in _DTYPE_BITS:
        return _DTYPE_BITS[dtype]
    m = re.match(r"[a-z]+?(\d+)", dtype)
    if not m:
        raise ValueError(f"unknown HLO element type {dtype!r}")
    return int(m.group(1))


def _arrays(shape_text: str) -> list[tuple[str, tuple[int, ...], int]]:
    """(dtype, dims, bytes) for each array in an HLO shape; tuples are flattened."""
    out = []
    for dtype, dims_text in _ARRAY.findall(shape_text):
        dims = tuple(int(d) for d in re.findall(r"\d+", dims_text))
        out.append((dtype, dims, math.ceil(math.prod(dims) * _dtype_bits(dtype) / 8)))
    return out


def _names(value: str) -> list[str]:
    return [n.lstrip("%") for n in re.findall(r"%?[\w.\-]+", value)]


def _multipliers(comps: dict[str, list[_Instr]], entry: str | None) -> dict[str, int]:
    """How many times each computation runs per module execution, via known while trip counts."""
    callers: dict[str, list[tuple[str, int]]] = {c: [] for c in comps}
    for comp, instrs in comps.items():
        for ins in instrs:
            trip = 1
            if ins.opcode == "while":
                m = _TRIP.search(ins.rest)
                trip = int(m.group(1)) if m else 1  # unknown trip count: counted once
            for attr, value in _CALL.findall(ins.rest):
                factor = trip if attr in ("body", "condition") else 1
                for callee in _names(value):
                    if callee in callers:
                        callers[callee].append((comp, factor))
    memo: dict[str, int] = {}

    def mult(c: str, seen: frozenset[str] = frozenset()) -> int:
        if c in memo:
            return memo[c]
        if c == entry or not callers[c] or c in seen:
            return 1
        memo[c] = sum(mult(p, seen | {c}) * f for p, f in callers[c])
        return memo[c]

    return {c: mult(c) for c in comps}


def _kind(opcode: str) -> str | None:
    """Collective kind counted for this opcode; async ``-start`` halves are skipped (the ``-done`` counts)."""
    base = opcode[: -len("-done")] if opcode.endswith("-done") else opcode
    return base if base in COLLECTIVE_KINDS else None


def collective_ops(hlo_text: str, count_loops: bool = False) -> list[CollectiveOp]:
    """Every collective in the module, one entry per result array.

    Async pairs (``all-gather-start``/``all-gather-done`` ...) count once, with the
    ``-done`` result shape (the ``-start`` tuple also holds the operand) and the
    ``-start``'s groups. ``count_loops=True`` multiplies ops inside while-loop bodies
    (``lax.scan``/``fori_loop``) by the trip count XLA recorded as ``known_trip_count``;
    loops without it count once, and every branch of a conditional counts.
    """
    comps, entry = _parse_module(hlo_text)
    mults = _multipliers(comps, entry) if count_loops else {}
    ops: list[CollectiveOp] = []
    for comp, instrs in comps.items():
        by_name = {i.name: i for i in instrs}
        for ins in instrs:
            kind = _kind(ins.opcode)
            if kind is None:
                continue
            operands, attrs = _operands_attrs(ins)
            if ins.opcode.endswith("-done"):  # groups live on the matching -start
                start = next((n for n in _names(operands) if n in by_name), None)
                if start is not None:
                    attrs = _operands_attrs(by_name[start])[1]
            groups = attrs.get("replica_groups") or attrs.get("source_target_pairs", "")
            k = mults.get(comp, 1)
            for dtype, dims, nbytes in _arrays(ins.shape):
                ops.append(CollectiveOp(kind, dtype, dims, nbytes * k, groups))
    return ops


def collective_bytes(hlo_text: str, count_loops: bool = False) -> dict[str, int]:
    """Per-device result bytes summed per collective kind (every kind present, 0 if unused).

    See :func:`collective_ops` for what is counted and for ``count_loops``.
    """
    totals = dict.fromkeys(COLLECTIVE_KINDS, 0)
    for op in collective_ops(hlo_text, count_loops=count_loops):
        totals[op.kind] += op.bytes
    return totals


def group_size(replica_groups: str, n_devices: int) -> int:
    """Devices per replica group, from the HLO attribute text.

    Formats: `mesh['data'=1,'fsdp'=8] {'fsdp'}` (named axes), `[2,4]<=[8]` (iota: groups x
    size), `{{0,1},{2,3}}` (explicit), `{}` / empty (all devices)."""
    text = replica_groups.strip()
    m = re.match(r"mesh\[(.*?)\]\s*\{(.*?)\}", text)
    if m:
        sizes = {k: int(v) for k, v in re.findall(r"'?([\w\-]+)'?\s*=\s*(\d+)", m.group(1))}
        names = re.findall(r"'([\w\-]+)'", m.group(2)) or re.findall(r"[\w\-]+", m.group(2))
        return math.prod(sizes[n] for n in names) if names else n_devices
    m = re.match(r"\[([\d,\s]+)\]<=", text)
    if m:
        dims = [int(d) for d in m.group(1).split(",")]
        return dims[-1] if len(dims) > 1 else dims[0]
    m = re.match(r"\{\s*\{([^}]*)\}", text)
    if m:
        return len([d for d in m.group(1).split(",") if d.strip()])
    return n_devices


_DOT = re.compile(r"^\s*(ROOT )?%\S+ = (\w+)\[[^\]]*\]\S* dot\(")
_FUSION_HEAD = re.compile(r"^%(\S+) ")


def naive_dots(hlo_text: str, dtype: str = "bf16") -> int:
    """How many `dtype` dots of a compiled XLA:CPU module run outside a library fusion (YNNPACK,
    oneDNN, XNNPACK): those fall back to XLA's naive loop emitter, many times slower in bf16.
    A library dot is the root of its own fusion computation; a naive one stands in a loop body
    or the entry computation (or in a loop fusion)."""
    library = set(re.findall(r"calls=%([\w.-]+), [^\n]*(?:__ynn_fusion|__xnn_fusion|onednn)", hlo_text,
                             flags=re.IGNORECASE))
    n, comp = 0, None
    for line in hlo_text.splitlines():
        head = _FUSION_HEAD.match(line) or (re.match(r"^ENTRY %(\S+) ", line))
        if head:
            comp = head.group(1)
        m = _DOT.match(line)
        if m and m.group(2) == dtype and not (m.group(1) and comp in library):
            n += 1
    return n


def _in_loops(comps: dict[str, list[_Instr]]) -> set[str]:
    """The computations that run inside a while loop (a body or condition, or called from one)."""
    callees: dict[str, list[tuple[str, bool]]] = {c: [] for c in comps}
    for comp, instrs in comps.items():
        for ins in instrs:
            for attr, value in _CALL.findall(ins.rest):
                for callee in _names(value):
                    if callee in comps:
                        callees[comp].append((callee, attr in ("body", "condition")))
    inside: set[str] = set()
    todo = [c for cs in callees.values() for c, looped in cs if looped]
    while todo:
        c = todo.pop()
        if c not in inside:
            inside.add(c)
            todo.extend(callee for callee, _ in callees[c])
    return inside


def loop_collectives(hlo_text: str, measure: str = "count") -> dict[str, dict[str, int]]:
    """{"inside": {kind: n}, "outside": {kind: n}}: how many collective result arrays one run of
    the module executes inside while loops (lax.scan: the layer loops, the microbatch loop) and
    outside them, loop trip counts multiplied in; `measure="bytes"`: their per-device result
    bytes instead (as collective_bytes). A gradient reduced layer by layer in the backward scan
    counts `layers` times inside; one reduced after the scan counts once outside."""
    if measure not in ("count", "bytes"):
        raise ValueError(f"loop_collectives: measure={measure!r}; valid: count, bytes")
    comps, entry = _parse_module(hlo_text)
    mults, inside = _multipliers(comps, entry), _in_loops(comps)
    out = {"inside": dict.fromkeys(COLLECTIVE_KINDS, 0), "outside": dict.fromkeys(COLLECTIVE_KINDS, 0)}
    for comp, instrs in comps.items():
        where = out["inside" if comp in inside else "outside"]
        for ins in instrs:
            kind = _kind(ins.opcode)
            if kind is not None:
                arrays = _arrays(ins.shape)
                n = len(arrays) if measure == "count" else sum(b for _, _, b in arrays)
                where[kind] += n * mults.get(comp, 1)
    return out


def dot_flops(hlo_text: str) -> int:
    """Matmul FLOPs one run of the module executes: 2 x output elements x contracted size of each
    `dot`, a while body's times its known trip count, a conditional's heaviest branch (one
    branch runs: a pipeline tick's forward or backward). XLA's cost_analysis() counts a while
    body once (a layer scan's dots as one layer's), so it cannot show a scanned model's FLOPs,
    nor their recompute; this can. Convolutions and custom calls are not counted."""
    comps, entry = _parse_module(hlo_text)
    memo: dict[str, int] = {}

    def flops(comp: str, seen: frozenset[str] = frozenset()) -> int:
        if comp in memo:
            return memo[comp]
        instrs = comps.get(comp, [])
        shapes = {i.name: i.shape for i in instrs}
        total = 0
        for ins in instrs:
            if ins.opcode == "dot":
                operands, attrs = _operands_attrs(ins)
                inline = _arrays(operands)  # operand shapes, where the text prints them
                lhs = inline[0][1] if inline else _arrays(shapes[_names(operands)[0]])[0][1]
                contract = [int(d) for d in re.findall(r"\d+", attrs.get("lhs_contracting_dims", ""))]
                total += 2 * math.prod(_arrays(ins.shape)[0][1]) * math.prod(lhs[d] for d in contract)
            trip = 1
            if ins.opcode == "while":
                m = _TRIP.search(ins.rest)
                trip = int(m.group(1)) if m else 1
            branches = []
            for attr, value in _CALL.findall(ins.rest):
                for callee in _names(value):
                    if callee not in comps or callee in seen:
                        continue
                    f = flops(callee, seen | {comp})
                    if attr in ("branch_computations", "true_computation", "false_computation"):
                        branches.append(f)
                    else:
                        total += f * (trip if attr == "body" else 1)
            total += max(branches, default=0)
        memo[comp] = total
        return total

    return flops(entry) if entry else 0


_BRANCHES = ("branch_computations", "true_computation", "false_computation")


def _empty() -> dict[str, dict[str, int]]:
    return {k: {"bytes": 0, "ops": 0} for k in COLLECTIVE_KINDS}


def _add(into: dict, other: dict, times: int = 1) -> None:
    for k, row in other.items():
        into[k]["bytes"] += row["bytes"] * times
        into[k]["ops"] += row["ops"] * times


def _own(instrs: list[_Instr]) -> dict[str, dict[str, int]]:
    """One computation's own collectives (not its callees'): bytes and result arrays per kind."""
    out = _empty()
    for ins in instrs:
        kind = _kind(ins.opcode)
        if kind is not None:
            arrays = _arrays(ins.shape)
            out[kind]["bytes"] += sum(b for _, _, b in arrays)
            out[kind]["ops"] += len(arrays)
    return out


def _calls(ins: _Instr) -> list[tuple[str, str]]:
    """(attribute, callee) for each computation an instruction calls."""
    return [(attr, c) for attr, value in _CALL.findall(ins.rest) for c in _names(value)]


def _trip(ins: _Instr) -> int:
    m = _TRIP.search(ins.rest) if ins.opcode == "while" else None
    return int(m.group(1)) if m else 1  # unknown trip count: counted once


def _once(comps: dict[str, list[_Instr]], comp: str, memo: dict, seen: frozenset = frozenset()) -> dict:
    """Collectives of one run of `comp`, its callees' included: loops times their trip counts,
    and every branch of a nested conditional (which one runs is not known here)."""
    if comp in memo:
        return memo[comp]
    out = _own(comps.get(comp, []))
    for ins in comps.get(comp, []):
        for attr, callee in _calls(ins):
            if callee in comps and callee not in seen:
                _add(out, _once(comps, callee, memo, seen | {comp}), _trip(ins) if attr == "body" else 1)
    memo[comp] = out
    return out


def _permute_pairs(comps: dict[str, list[_Instr]], comp: str, seen: frozenset = frozenset()) -> list[str]:
    """The source_target_pairs of every collective-permute `comp` runs (callees included)."""
    out = []
    for ins in comps.get(comp, []):
        if ins.opcode in ("collective-permute", "collective-permute-start"):
            out.append(_operands_attrs(ins)[1].get("source_target_pairs", ""))
        for _, callee in _calls(ins):
            if callee in comps and callee not in seen:
                out += _permute_pairs(comps, callee, seen | {comp})
    return out


def conditional_collectives(hlo_text: str) -> dict:
    """Collectives attributed to the conditionals (lax.switch / lax.cond) they run in, for a
    module whose loops run a different branch on each trip (a pipeline tick: one op per device),
    where collective_ops(count_loops=True) counts every branch on every trip.

    {"outside": {kind: {"bytes", "ops"}}: everything outside any conditional, loop trip counts
    multiplied in; "conditionals": [{"name", "runs", "branches": [{kind: {"bytes", "ops"}}]}]:
    each outermost conditional, how often it runs (its loops' trip counts) and what ONE run of
    each branch moves, in branch index order (nested loops multiplied in, a nested
    conditional's branches all counted), and "pairs": per branch, the source_target_pairs
    text of its collective-permutes (which tell a switch's sends apart)}. A caller who knows
    which branch runs how often weights the branches: outside + sum of branch x its runs."""
    comps, entry = _parse_module(hlo_text)
    memo: dict = {}
    outside, conds = _empty(), []

    def walk(comp: str, times: int, seen: frozenset) -> None:
        _add(outside, _own(comps.get(comp, [])), times)
        for ins in comps.get(comp, []):
            called = [(a, c) for a, c in _calls(ins) if c in comps and c not in seen]
            if ins.opcode == "conditional":
                branches = [_once(comps, c, memo, seen | {comp}) for a, c in called if a in _BRANCHES]
                pairs = [_permute_pairs(comps, c) for a, c in called if a in _BRANCHES]
                conds.append({"name": ins.name, "runs": times, "branches": branches, "pairs": pairs})
                continue
            for attr, callee in called:
                walk(callee, times * (_trip(ins) if attr == "body" else 1), seen | {comp})

    if entry is not None:
        walk(entry, 1, frozenset())
    return {"outside": outside, "conditionals": conds}
