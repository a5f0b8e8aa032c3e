"""How busy the test workers were over a run and what cost CPU: `JAXPAR_TEST_TIMELINE=/tmp/tl make
test`, then `python scripts/test_timeline.py /tmp/tl`. Prints the busy workers per minute, when
each worker's last test ended, and the modules and tests that took the most CPU seconds (the
worker's threads plus the child processes it waited for: on 2 cores the run's length follows the
total CPU, not any one test's wall time)."""
import sys
from collections import defaultdict


def main(path: str) -> None:
    rows = []
    phases: dict[str, float] = defaultdict(float)
    by_module: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for line in open(path):
        worker, start, end, cpu, *spent, nodeid = line.rstrip("\n").split("\t")
        rows.append((worker, float(start), float(end), float(cpu), nodeid.partition("@")[0]))
        for k, v in zip(("trace", "lower", "compile"), spent):
            phases[k] += float(v)
            by_module[nodeid.split("::")[0]][k] += float(v)
    t0, t1 = min(r[1] for r in rows), max(r[2] for r in rows)
    workers = sorted({r[0] for r in rows})
    total_cpu = sum(r[3] for r in rows)
    print(f"{len(rows)} tests, {len(workers)} workers, {t1 - t0:.0f} s wall, {total_cpu:.0f} CPU s "
          f"recorded (daemons a test leaves running, e.g. a Ray cluster's, are not)")
    if phases:
        print("  of which (wall seconds in the tests' own process): " + ", ".join(
            f"{k} {v:.0f} s" for k, v in phases.items()) + " (jax's trace / lower / XLA compile events)")
    for m in range(int((t1 - t0) // 60) + 1):
        a, b = t0 + 60 * m, t0 + 60 * (m + 1)
        busy = sum(max(0.0, min(b, e) - max(a, s)) for _, s, e, _, _ in rows) / 60
        print(f"  minute {m:3d}: {busy:4.2f} workers busy")
    last = {w: max(r[2] for r in rows if r[0] == w) for w in workers}
    print("each worker's last test ended at: " + ", ".join(f"{w} {last[w] - t0:.0f} s" for w in workers))
    per_module: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for _, s, e, cpu, nodeid in rows:
        per_module[nodeid.split("::")[0]][0] += cpu
        per_module[nodeid.split("::")[0]][1] += e - s
    print("modules by CPU seconds (wall seconds beside):")
    for mod, (cpu, wall) in sorted(per_module.items(), key=lambda kv: -kv[1][0])[:20]:
        ph = " ".join(f"{k} {v:5.1f}" for k, v in by_module[mod].items())
        print(f"  {cpu:7.1f} CPU s {wall:7.1f} s  {mod}  {ph}")
    print("tests by CPU seconds:")
    for _, s, e, cpu, nodeid in sorted(rows, key=lambda r: -r[3])[:25]:
        print(f"  {cpu:7.1f} CPU s {e - s:7.1f} s  {nodeid}")


if __name__ == "__main__":
    main(sys.argv[1])
