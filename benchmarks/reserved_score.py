"""Reserved-level error of the estimator over the rows of one method measured on the H100 and the H200.

    PYTHONPATH=. .venv/bin/python benchmarks/reserved_score.py [--method single] [--tables ...] [--out rows.csv]

Rows: ``data/measurements/{h100-80gb,h200-141gb}/{gpu_single,gpu_snapshots,gpu_emulated}.csv`` (``--tables``) with the method
(``single`` by default; ``fsdp1``, ``zero3``...: every measured rank) and status ok; estimate via ``calibrate.terms.rank_estimates`` with the GPU's shipped coefficients (no profile
builds). Prints median / p95 / max |error| of ``peak_reserved_bytes`` per GPU and the rows beyond 1 %."""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]


TABLES = ("gpu_single", "gpu_snapshots", "gpu_emulated")


def _rows(gpu: str, method: str, tables: tuple[str, ...] = TABLES) -> pd.DataFrame:
    frames = []
    for name in (f"{table}.csv" for table in tables):
        path = ROOT / "data" / "measurements" / gpu / name
        if path.exists():
            frame = pd.read_csv(path, dtype=str, keep_default_na=False, na_values=[""])
            frame["source"] = name
            frames.append(frame)
    rows = pd.concat(frames, ignore_index=True)
    ok = (rows["method"] == method) & (rows["run_status"] == "ok") & (rows["rank_status"] == "ok")
    return rows[ok].reset_index(drop=True)


def _stats(errors: list[float]) -> str:
    if not errors:
        return "no rows"
    a = sorted(abs(e) for e in errors)
    p95 = a[min(len(a) - 1, int(round(0.95 * (len(a) - 1))))]
    return (f"n={len(a)} median={a[len(a) // 2]:.3f}% p95={p95:.3f}% max={a[-1]:.3f}% "
            f"mean={sum(a) / len(a):.3f}% beyond1%={sum(x > 1 for x in a)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="per-row CSV")
    parser.add_argument("--gpus", nargs="*", default=["h100-80gb", "h200-141gb"])
    parser.add_argument("--method", default="single")
    parser.add_argument("--tables", nargs="*", default=list(TABLES),
                        help="measurement tables of each GPU (gpu_moe: the MoE rows, not in the default)")
    args = parser.parse_args(argv)
    from calibrate.terms import rank_estimates
    from estimator.hardware.residuals import load_coefficients

    table = []
    for gpu in args.gpus:
        rows = _rows(gpu, args.method, tuple(args.tables))
        results = rank_estimates(rows, load_coefficients(gpu), allow_build=False)
        errors = []
        for (_, row), result in zip(rows.iterrows(), results):
            if isinstance(result, str):
                table.append({"gpu": gpu, "run_id": row["run_id"], "error": result})
                continue
            _, rank = result
            measured = int(row["peak_reserved_bytes"])
            err = 100.0 * (rank.peak_reserved_bytes - measured) / measured
            source = getattr(rank, "reserved_source", None)
            table.append({"gpu": gpu, "run_id": row["run_id"], "rank": row["rank"], "model": row["model"],
                          "precision": row["precision"], "extra": row["fsdp1_sharding_strategy"] if args.method == "fsdp1" else "",
                          "b": row["micro_batch_size"], "s": row["seq_len"], "source": source,
                          "measured": measured, "estimated": rank.peak_reserved_bytes, "err_pct": round(err, 4)})
            errors.append(err)
        print(f"{gpu}: {_stats(errors)}")
        for r in table:
            if r["gpu"] == gpu and "err_pct" in r and abs(r["err_pct"]) > 1:
                print(f"  {r['err_pct']:+7.2f}% {r['run_id']} r{r['rank']} {r['model']} {r['precision']} {r['extra']} "
                      f"b{r['b']} s{r['s']} ({r['source']})")
    if args.out:
        keys = sorted({k for r in table for k in r})
        with open(args.out, "w", newline="") as handle:
            writer = csv.DictWriter(handle, keys)
            writer.writeheader()
            writer.writerows(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
