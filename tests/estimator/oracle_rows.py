"""Committed oracle rows (docs/error_matrix/*.csv) read back and re-estimated: shared by the pipeline tests
(torch's pipelining, test_pipeline.py; DeepSpeed's engine, test_ds_pipeline.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from benchmarks.table_csv import read_rows
from estimator.spec import RunSpec


def assert_rows_reproduced(table: Path, row_spec: Callable[[dict], RunSpec], bar_pct: float = 1.0) -> int:
    """Each row's estimate (the shipped profile, no torch) equals its committed ``estimate_bytes`` and is within
    ``bar_pct`` of its ``measured_bytes``; one estimate per spec. Returns the number of rows checked."""
    from estimator.api import estimate

    rows = read_rows(table)
    estimates: dict[str, dict[int, int]] = {}
    for row in rows:
        spec = row_spec(row)
        if spec.spec_id not in estimates:
            est = estimate(spec, replay_reserved=False, allow_build=False)
            estimates[spec.spec_id] = {r.rank: r.traced_allocated_bytes for r in est.ranks}
        got = estimates[spec.spec_id][int(row["rank"])]
        assert got == int(row["estimate_bytes"]), row
        assert abs(got - int(row["measured_bytes"])) <= bar_pct / 100 * int(row["measured_bytes"]), row
    return len(rows)
