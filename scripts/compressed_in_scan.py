"""Where a compressed gradient reduction runs: `python scripts/compressed_in_scan.py [overrides...]`.

Compiles the quickstart model on data 8 (ZeRO-0) with gradient_compression.method=bf16 (override
it, e.g. `gradient_compression.method=int8`) and prints the collectives of the compiled step
inside and outside its while loops (jaxpar.metrics.loop_collectives: result arrays executed per
step, loop trips multiplied in; an all-to-all of n peers is n arrays) and XLA's temp bytes per
device. Works on older trees too, for the before/after figures of docs/benchmarks.md.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxpar.config import load_config  # noqa: E402
from jaxpar.metrics import loop_collectives  # noqa: E402
from jaxpar.train.trainer import Trainer  # noqa: E402

LAYOUT = ["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1", "sharding.zero_stage=0",
          "gradient_compression.method=bf16"]


def main(overrides: list[str]) -> None:
    t = Trainer(load_config(ROOT / "configs/quickstart.yaml", LAYOUT + overrides), log=lambda s: None)
    compiled = t.compile()
    text = compiled.as_text()
    count, nbytes = loop_collectives(text), loop_collectives(text, "bytes")
    print(t.spec.sync.describe())
    for where in ("inside", "outside"):
        ops = ", ".join(f"{k} {count[where][k]} ({nbytes[where][k]:,} B)" for k in count[where] if count[where][k])
        print(f"{where} loops: {ops or 'none'}")
    print(f"temp bytes: {compiled.memory_analysis().temp_size_in_bytes:,}")


if __name__ == "__main__":
    main(sys.argv[1:])
