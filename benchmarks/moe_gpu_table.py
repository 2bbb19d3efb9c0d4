"""Mixture-of-experts on a real GPU: the estimate against the H100's measured peaks (issue 17).

    PYTHONPATH=. .venv/bin/python benchmarks/moe_gpu_table.py [--table data/measurements/h100-80gb/gpu_moe.csv]
        [--csv docs/error_matrix/moe_h100.csv]

The rows are chunk ``m1_moe`` of campaigns/chunks.yaml: five MoE families at full width, first layers only
(harness/assets/models), measured by the harness with CUDA's experts kernels (transformers 5.24, torch 2.11).
Shipped profiles only (no torch): the estimate is what ``python -m estimator`` says for the same spec.
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import statistics

import pandas as pd

from calibrate.terms import rank_estimates
from estimator.hardware.residuals import load_coefficients

FIELDS = ["model", "method", "world_size", "rank", "precision", "micro_batch_size", "seq_len",
          "measured_allocated_bytes", "estimated_allocated_bytes", "allocated_error_pct",
          "measured_reserved_bytes", "estimated_reserved_bytes", "reserved_error_pct", "reserved_source"]


def pct(estimated: float, measured: float) -> float:
    return 100.0 * (estimated - measured) / measured


def table_rows(table: pathlib.Path) -> list[dict]:
    rows = pd.read_csv(table)
    rows = rows[rows["run_status"] == "ok"]
    out = []
    for (_, row), result in zip(rows.iterrows(), rank_estimates(rows, load_coefficients(rows["gpu_key"].iloc[0]),
                                                                allow_build=False)):
        if isinstance(result, str):
            raise SystemExit(f"{row['run_id']}: {result}")
        _, rank = result
        out.append({"model": pathlib.Path(row["model"]).stem, "method": row["method"],
                    "world_size": row["world_size"], "rank": row["rank"], "precision": row["precision"],
                    "micro_batch_size": row["micro_batch_size"], "seq_len": row["seq_len"],
                    "measured_allocated_bytes": row["peak_allocated_bytes"],
                    "estimated_allocated_bytes": rank.peak_allocated_bytes,
                    "allocated_error_pct": round(pct(rank.peak_allocated_bytes, row["peak_allocated_bytes"]), 4),
                    "measured_reserved_bytes": row["peak_reserved_bytes"],
                    "estimated_reserved_bytes": rank.peak_reserved_bytes,
                    "reserved_error_pct": round(pct(rank.peak_reserved_bytes, row["peak_reserved_bytes"]), 4),
                    "reserved_source": rank.reserved_source})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=pathlib.Path, default=pathlib.Path("data/measurements/h100-80gb/gpu_moe.csv"))
    parser.add_argument("--csv", type=pathlib.Path, default=pathlib.Path("docs/error_matrix/moe_h100.csv"))
    args = parser.parse_args()
    rows = table_rows(args.table)
    with args.csv.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    for level in ("allocated", "reserved"):
        errors = [abs(r[f"{level}_error_pct"]) for r in rows]
        print(f"{level:9s} rows {len(errors)}  median {statistics.median(errors):.3f} %  max {max(errors):.3f} %")
    print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
