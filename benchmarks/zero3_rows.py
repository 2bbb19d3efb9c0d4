"""The estimate against every measured ZeRO-3 rank: the H100 snapshot runs and the H200's emulated rows.

    PYTHONPATH=. .venv/bin/python benchmarks/zero3_rows.py

One line per rank row: world, rank, micro-batch, the measured reserved peak, the estimate's and its error, the
allocated error and where the estimate's reserved level came from (``replayed`` or ``prior``).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    sys.path.insert(0, str(ROOT))
    import pandas as pd

    from calibrate.terms import rank_estimates
    from estimator.hardware.residuals import load_coefficients

    for gpu, table in (("h100-80gb", "gpu_snapshots"), ("h200-141gb", "gpu_emulated")):
        rows = pd.read_csv(ROOT / "data" / "measurements" / gpu / f"{table}.csv")
        rows = rows[(rows["run_status"] == "ok") & (rows["method"] == "zero3")]
        for (_, row), (_, rank) in zip(rows.iterrows(), rank_estimates(rows, load_coefficients(gpu),
                                                                       allow_build=False)):
            measured, allocated = int(row["peak_reserved_bytes"]), int(row["peak_allocated_bytes"])
            print(f"{gpu} {row['run_id']} w{row['world_size']} rank {row['rank']} b{row['micro_batch_size']}: "
                  f"reserved measured {measured} estimate {rank.peak_reserved_bytes} "
                  f"({100 * (rank.peak_reserved_bytes - measured) / measured:+.2f} %), allocated "
                  f"{100 * (rank.peak_allocated_bytes - allocated) / allocated:+.2f} %, {rank.reserved_source}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
