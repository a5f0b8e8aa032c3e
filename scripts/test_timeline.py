"""How busy the test workers were over a run: `JAXPAR_TEST_TIMELINE=/tmp/tl make test`, then
`python scripts/test_timeline.py /tmp/tl [--write tests/durations.json]`. Prints the busy workers
per minute, when each worker's last test ended and the heaviest modules; --write records each
test's seconds, which tests/conftest.py uses to hand out the heaviest work first."""
import json
import sys
from collections import defaultdict


def main(path: str, write: str | None = None) -> None:
    rows = []
    for line in open(path):
        worker, start, end, nodeid = line.rstrip("\n").split("\t", 3)
        rows.append((worker, float(start), float(end), nodeid))
    t0, t1 = min(r[1] for r in rows), max(r[2] for r in rows)
    workers = sorted({r[0] for r in rows})
    print(f"{len(rows)} tests, {len(workers)} workers, {t1 - t0:.0f} s")
    for m in range(int((t1 - t0) // 60) + 1):
        a, b = t0 + 60 * m, t0 + 60 * (m + 1)
        busy = sum(max(0.0, min(b, e) - max(a, s)) for _, s, e, _ in rows) / 60
        print(f"  minute {m:3d}: {busy:4.2f} workers busy")
    last = {w: max(e for x, _, e, _ in rows if x == w) for w in workers}
    print("each worker's last test ended at: " + ", ".join(f"{w} {last[w] - t0:.0f} s" for w in workers))
    per_module = defaultdict(float)
    for _, s, e, nodeid in rows:
        per_module[nodeid.split("::")[0]] += e - s
    for mod, sec in sorted(per_module.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {sec:7.1f} s  {mod}")
    if write:
        seconds = {nodeid.partition("@")[0]: round(e - s, 1) for _, s, e, nodeid in rows}
        with open(write, "w") as f:
            json.dump(dict(sorted(seconds.items())), f, indent=0)
            f.write("\n")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], args[args.index("--write") + 1] if "--write" in args else None)
