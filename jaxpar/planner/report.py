"""`jaxpar plan` output: the best layouts with their predicted figures, why each runner-up lost,
why the rejected families were rejected; `--explain` breaks one plan into its terms."""
from __future__ import annotations

from jaxpar.planner.search import Result, Scored, why_slower

GIB = 2**30


def _row(s: Scored) -> dict:
    t = s.time
    return {"layout": s.layout.label(), "overrides": s.layout.overrides(), "step_s": t.step_s,
            "tokens_per_s": t.tokens_per_s, "mfu": t.mfu, "memory_gib": s.memory["total"] / GIB}


def to_json(result: Result, top: int, explain: bool = False) -> dict:
    best = result.ranked[:top]
    out = {"considered": result.considered, "valid": len(result.ranked), "note": result.note,
           "best": [{**_row(s), **({"lost": why_slower(best[0], s)} if i else {})}
                    for i, s in enumerate(best)],
           "rejected": {reason: {"count": len(v), "examples": [x.label() for x in v[:3]]}
                        for reason, v in result.rejected.items()}}
    if explain and best:
        out["explain"] = explain_terms(best[0])
    return out


def explain_terms(s: Scored) -> dict:
    return {"time_s": s.terms(), "step_parts_s": s.time.parts, "shared_units": s.time.shared,
            "memory_bytes": {k: v for k, v in s.memory.items()}, "sync": s.comm.get("sync", "psum"),
            "collectives": {k: {"result_bytes": r["result_bytes"], "wire_bytes": r["wire_bytes"],
                                "links": r["links"]} for k, r in s.comm["kinds"].items()}}


def format_result(result: Result, top: int, cluster_name: str, explain: bool = False) -> str:
    lines = [f"jaxpar plan on {cluster_name}: {result.considered} layouts considered, "
             f"{len(result.ranked)} valid"]
    if result.note:
        lines.append(f"no layout to consider: {result.note}")
    elif not result.ranked:
        lines.append("no valid layout: see the reasons below")
    best = result.ranked[:top]
    for i, s in enumerate(best):
        t = s.time
        lines.append(f"{i + 1}. {s.layout.label()}")
        lines.append(f"   step {t.step_s:.3f} s, {t.tokens_per_s:,.0f} tokens/s, MFU {t.mfu:.1%}, "
                     f"memory {s.memory['total'] / GIB:.2f} GiB per device")
        if i:
            lines.append(f"   lost: {why_slower(best[0], s)}")
        else:
            lines.append("   overrides: " + " ".join(s.layout.overrides()))
    if result.rejected:
        lines.append("rejected:")
        for reason, labels in sorted(result.rejected.items(), key=lambda kv: -len(kv[1])):
            first = reason.splitlines()[0]
            lines.append(f"  {len(labels):5d} x {first}  (e.g. {labels[0].label()})")
    if explain and best:
        lines.append(format_explain(best[0]))
    return "\n".join(lines)


def format_explain(s: Scored) -> str:
    lines = [f"explain: {s.layout.label()}", "  time per step:"]
    for k, v in s.terms().items():
        lines.append(f"    {k:22s} {v * 1e3:12.3f} ms")
    lines.append(f"    {'step':22s} {s.time.step_s * 1e3:12.3f} ms")
    if s.time.shared:  # the terms above are one device's; the step is every device's work
        lines.append("  bound by all devices' work on the shared compute units: " + ", ".join(
            f"{k} {v * 1e3:.3f} ms" for k, v in s.time.parts.items()))
    lines.append("  memory per device:")
    for k, v in s.memory.items():
        lines.append(f"    {k:22s} {v / GIB:12.4f} GiB")
    lines.append(f"  gradient sync: {s.comm.get('sync', 'psum')}")
    lines.append("  collectives per device per step (wire bytes, by link):")
    for k, r in s.comm["kinds"].items():
        links = ", ".join(f"{lk} {b / GIB:.4f} GiB" for lk, b in r["links"].items())
        lines.append(f"    {k:22s} {r['wire_bytes'] / GIB:12.4f} GiB  ({links})")
    return "\n".join(lines)
