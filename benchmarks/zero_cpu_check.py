"""Estimator vs real DeepSpeed ZeRO runs on CPU, allocated level counted from live tensor storages.

    .venv/bin/python benchmarks/zero_cpu_check.py [--model small-llama] [--methods zero1 zero2 zero3]
        [--worlds 2 4] [--precisions mixed_bf16 fp32] [--buckets default small] [--csv out.csv]
    .venv/bin/python benchmarks/zero_cpu_check.py --model MODEL --rescore docs/error_matrix/zero_cpu_TABLE.csv

DeepSpeed cannot run under FakeTensorMode, so the fake-tensor oracle cannot check ZeRO. But where DeepSpeed puts
its memory (flat partitions, fp32 masters, IPG buckets, stage-3 gathers) is Python code that allocates the same
tensors on the CPU accelerator as on CUDA. Each point is a real harness run (``backend=cpu``, emulated ranks 0 and
N-1 on torch's fake process group, ``memory_source counted-cpu``: every storage rounded to 512 bytes) compared
with ``estimate()``'s allocated peak less the cuBLAS workspace (CPU runs have none). ``--buckets small`` shrinks
every ZeRO bucket to 1e5 elements so a 5 M-parameter model spans several buckets, as real models do with the
defaults. Results: docs/error_matrix/zero_cpu_*.csv (table in docs/error_matrix/README.md); log in docs/LOG.md.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from estimator.api import estimate
from estimator.spec import RunSpec

ROOT = Path(__file__).resolve().parents[1]
MIB = 1024**2
SMALL_BUCKETS = ["parallel.zero.reduce_bucket_size=100000", "parallel.zero.allgather_bucket_size=100000",
                 "parallel.zero.stage3_prefetch_bucket_size=100000",
                 "parallel.zero.stage3_param_persistence_threshold=1000"]


def point_overrides(model: str, method: str, world: int, precision: str, buckets: str, results: Path,
                    batch: int, seq: int, extra: list[str]) -> list[str]:
    """The harness overrides of one point."""
    overrides = [f"model={model}", f"method={method}", f"parallel.world_size={world}",
                 f"emulate.enabled={str(world > 1).lower()}", "backend=cpu", "data=synthetic",
                 f"training.micro_batch_size={batch}", f"training.seq_len={seq}",
                 f"training.precision={precision}", "training.attn=eager", f"paths.results_dir={results}",
                 f"paths.measurements_dir={results / 'measurements'}", "campaign=zero_cpu_check"]
    return overrides + (SMALL_BUCKETS if buckets == "small" else []) + list(extra)


def point_spec(*point) -> RunSpec:
    """The spec the harness runs for a point (``point_overrides``' arguments), composed as the harness composes
    it, without running anything: for re-estimating a committed row."""
    from hydra.core.global_hydra import GlobalHydra

    from harness.campaign import composer, hydra_context
    from harness.config import to_run

    ours = not GlobalHydra.instance().is_initialized()
    try:
        with hydra_context():
            spec, _opts = to_run(composer().compose(point_overrides(*point)))
    finally:
        if ours:  # leave Hydra as found: a caller (a test session) may initialise it itself later
            GlobalHydra.instance().clear()
    return spec


def estimate_ranks(spec: RunSpec, ranks: list[int]) -> dict[int, object]:
    """The estimate's rank report for each measured rank (the estimate reports rank 0 and the last)."""
    est = estimate(spec.replace(gpu="h100-80gb"))
    return {rank: est.ranks[0] if rank == 0 else est.ranks[-1] for rank in ranks}


def run_point(model: str, method: str, world: int, precision: str, buckets: str, results: Path,
              batch: int, seq: int, extra: list[str]) -> Path:
    """One harness run; returns its run directory."""
    overrides = point_overrides(model, method, world, precision, buckets, results, batch, seq, extra)
    out = subprocess.run([sys.executable, "-m", "harness", *overrides], cwd=ROOT, capture_output=True, text=True)
    ok = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("ok ")]
    if out.returncode or not ok:
        raise RuntimeError(f"harness failed for {method} w{world} {precision} {buckets}:\n{out.stdout[-2000:]}"
                           f"{out.stderr[-2000:]}")
    return results / "zero_cpu_check" / "cpu" / ok[-1]


def measured_phase(record: dict) -> str:
    """The phase of a rank record's last steady step that reached its peak."""
    steady = [s for s in record["steps"] if not s["warmup"]][-1]
    return max(steady["phases"], key=lambda p: p["peak_allocated_bytes"] or 0)["phase"]


def compare(run_dir: Path) -> list[dict]:
    spec = RunSpec.from_json((run_dir / "spec.json").read_text()).replace(gpu="h100-80gb")
    records = [json.loads(path.read_text()) for path in sorted(run_dir.glob("rank*.json"))]
    reports = estimate_ranks(spec, [rec["rank"] for rec in records])
    rows = []
    for rec in records:
        mine = reports[rec["rank"]]
        predicted = mine.traced_allocated_bytes
        measured = rec["peak_allocated_bytes"]
        phase = measured_phase(rec)
        rows.append({"method": spec.parallel.method, "world": spec.parallel.world_size, "rank": rec["rank"],
                     "precision": spec.training.precision,
                     "buckets": "small" if spec.parallel.zero.reduce_bucket_size < 500_000_000 else "default",
                     "measured_mib": round(measured / MIB, 3), "estimated_mib": round(predicted / MIB, 3),
                     "error_pct": round(100 * (predicted - measured) / measured, 2), "measured_phase": phase,
                     "estimated_phase": mine.phase,
                     "setup_mib": round((rec.get("setup_allocated_bytes") or 0) / MIB, 3)})
    return rows


def rescored(model: str, row: dict) -> dict:
    """A committed row estimated again by today's estimator (its measurement kept): the point's spec composed as
    the harness composes it (``point_spec``), nothing run."""
    spec = point_spec(model, row["method"], int(row["world"]), row["precision"], row["buckets"],
                      Path(tempfile.gettempdir()) / "zero_cpu_check", int(row["batch"]), int(row["seq"]),
                      row["overrides"].split())
    mine = estimate_ranks(spec, [int(row["rank"])])[int(row["rank"])]
    measured = float(row["measured_mib"])
    estimated = round(mine.traced_allocated_bytes / MIB, 3)
    if estimated == float(row["estimated_mib"]):
        return row  # its error was computed from the unrounded measurement: kept
    return {**row, "estimated_mib": estimated, "error_pct": round(100 * (estimated - measured) / measured, 2),
            "estimated_phase": mine.phase}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small-llama", help="a conf/model name")
    # ZeRO-Offload is left out: on CPU the offloaded states are counted with the rest, so the GPU/host split that
    # the estimator predicts cannot be seen.
    p.add_argument("--methods", nargs="+", default=["zero1", "zero2", "zero3"])
    p.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    p.add_argument("--precisions", nargs="+", default=["mixed_bf16", "fp32"])
    p.add_argument("--buckets", nargs="+", default=["default", "small"], choices=["default", "small"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                   help="more harness overrides for every point (e.g. parallel.zero.stage3_max_reuse_distance=1e6)")
    p.add_argument("--csv", help="write the rows here")
    p.add_argument("--rescore", type=Path, metavar="CSV",
                   help="estimate a committed table's rows of --model again (measurements kept, nothing run) and "
                        "rewrite it")
    args = p.parse_args(argv)
    rows: list[dict] = []
    if args.rescore:
        with args.rescore.open(newline="") as f:
            rows = [rescored(args.model, row) for row in csv.DictReader(f)]
        for row in rows:
            print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        args.csv = str(args.rescore)
    with tempfile.TemporaryDirectory(prefix="zero_cpu_check-") as tmp:
        for method, world, precision, buckets in [] if args.rescore else itertools.product(
                args.methods, args.worlds, args.precisions, args.buckets):
            if (method == "single") != (world == 1):
                continue  # single runs on one rank only; every other method on two or more
            run_dir = run_point(args.model, method, world, precision, buckets, Path(tmp), args.batch, args.seq,
                                args.override)
            for row in compare(run_dir):
                row.update(batch=args.batch, seq=args.seq, overrides=" ".join(args.override))
                rows.append(row)
                print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    worst = max(rows, key=lambda r: abs(float(r["error_pct"])))
    print(f"\n{len(rows)} rank-points, max |error| {abs(float(worst['error_pct'])):.2f} % "
          f"({worst['method']} w{worst['world']} {worst['precision']} {worst['buckets']} rank {worst['rank']})")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
