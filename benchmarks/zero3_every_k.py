"""every-k checkpointing under DeepSpeed ZeRO-3 against real CPU runs on emulated ranks; writes an error table.

    LLMEM_CACHE_DIR=$(mktemp -d) PYTHONPATH=. .venv/bin/python benchmarks/zero3_every_k.py \
        --csv docs/error_matrix/zero3_every_k.csv

DeepSpeed cannot run under FakeTensorMode: each point is a real harness run on the CPU (``backend=cpu``, ranks 0 and
N-1 emulated on torch's fake process group, every live storage counted: ``benchmarks/zero_cpu_check.py``), with
``training.grad_ckpt=true training.ckpt_policy=every-k:K`` (HF's per-layer flag, as the profiler sets it), compared
with ``estimate()``'s allocated peak less the cuBLAS workspace. small-llama (4 layers), k 2 and 3, (b, s) (2, 512)
and (4, 1024), 2 and 4 ranks, bf16 and mixed_bf16, DeepSpeed's default buckets. Exit 1 when a point is off by more
than 1 %.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.zero_cpu_check import compare, run_point  # noqa: E402

MODEL = "small-llama"
EVERY = (2, 3)
POINTS = ((2, 512), (4, 1024))
WORLDS = (2, 4)
PRECISIONS = ("bf16", "mixed_bf16")


def overrides(every: int) -> list[str]:
    return ["training.grad_ckpt=true", f"training.ckpt_policy=every-k:{every}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="k 2, the first point, 2 ranks, mixed_bf16")
    parser.add_argument("--csv")
    args = parser.parse_args(argv)
    combos = itertools.product(EVERY[:1] if args.quick else EVERY, POINTS[:1] if args.quick else POINTS,
                               WORLDS[:1] if args.quick else WORLDS, PRECISIONS[1:] if args.quick else PRECISIONS)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="zero3_every_k-") as tmp:
        for every, (b, s), world, precision in combos:
            run_dir = run_point(MODEL, "zero3", world, precision, "default", Path(tmp), b, s, overrides(every))
            for row in compare(run_dir):
                # the run's spec as the harness wrote it: the test estimates it again
                row.update(model=MODEL, ckpt_policy=f"every-k:{every}", batch=b, seq=s,
                           spec=(run_dir / "spec.json").read_text().strip())
                rows.append(row)
                print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    worst = max(abs(r["error_pct"]) for r in rows)
    print(f"{len(rows)} rank-points, max |error| {worst:.2f} %")
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0 if worst <= 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
