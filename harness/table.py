"""The tidy measurement table: one row per run x rank, units in column names, one CSV per campaign under
``data/measurements/<gpu-key>/<campaign>.csv``. The column meanings are in ``data/README.md``.

Spec columns are the RunSpec fields flattened: ``training.*`` and ``parallel.*`` fields keep their names,
``parallel.zero.X`` becomes ``zero_X``, ``schema_version`` becomes ``spec_schema_version``.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

# The schema and the spec <-> columns mapping live in the estimator: calibrate reads these tables and may not
# import the harness. Re-exported here under their historical names.
from estimator.columns import (
    COLUMNS,
    ENV_COLUMNS,
    ID_COLUMNS,
    MEASURE_COLUMNS,
    RUN_COLUMNS,
    SPEC_COLUMNS,
    spec_columns,
    spec_from_columns,
)
from estimator.spec import RunSpec
from harness.files import atomic_write_text, locked
from harness.records import RankRecord, RunRecord

__all__ = ["COLUMNS", "ENV_COLUMNS", "ID_COLUMNS", "MEASURE_COLUMNS", "RUN_COLUMNS", "SPEC_COLUMNS", "rank_rows",
           "read_rows", "spec_columns", "spec_from_columns", "table_path", "upsert_rows"]


def rank_rows(spec: RunSpec, run: RunRecord, ranks: list[RankRecord], env: dict[str, Any],
              options: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of one run. A run with no rank file (crash before any rank wrote) still gets one row (rank -1)
    so a failed point is visible in the table."""
    data_opts = options.get("data", {})
    steps_opts = options.get("steps", {})
    base = {"run_id": run.run_id, "spec_id": run.spec_id, "campaign": run.campaign, "gpu_key": run.gpu_key,
            "world_size": spec.parallel.world_size, "run_status": run.status, **spec_columns(spec),
            "padding": data_opts.get("padding"), "data_keep": data_opts.get("keep"),
            "warmup_steps": steps_opts.get("warmup"), "measured_steps": steps_opts.get("measured"),
            "finished_at": run.finished_at, **{k: env.get(k) for k in ENV_COLUMNS}}
    if not ranks:
        return [{**base, "rank": -1, "rank_status": run.status, "emulated": run.emulated,
                 "measured_by": run.measured_by, "memory_source": run.memory_source, "error": run.error}]
    rows = []
    for record in sorted(ranks, key=lambda r: r.rank):
        row = dict(base)
        row.update({"rank": record.rank, "rank_status": record.status, "emulated": record.emulated,
                    "measured_by": record.measured_by, "memory_source": record.memory_source,
                    "num_steps": len(record.steps),
                    "seq_len_max": max((s.seq_len_max for s in record.steps), default=None),
                    "data_source": record.data.get("source"), "tokenizer": record.data.get("tokenizer"),
                    "error": record.error, "node": record.node})
        row.update({k: getattr(record, k) for k in MEASURE_COLUMNS if hasattr(record, k)})
        row["memory_cap_bytes"] = record.memory_cap_bytes  # the cap the worker applied (the spec's, or memory.cap_gib)
        rows.append(row)
    return rows


def table_path(measurements_dir: Path | str, gpu_key: str, campaign: str) -> Path:
    return Path(measurements_dir) / gpu_key / f"{campaign}.csv"


def upsert_rows(path: Path | str, rows: list[dict[str, Any]]) -> None:
    """Replace this run's rows (by run_id) and rewrite the file atomically under a lock: re-running a point
    never duplicates it, and a kill mid-write leaves the previous file intact."""
    path = Path(path)
    run_ids = {row["run_id"] for row in rows}
    with locked(path):
        existing, columns = _read(path)
        kept = [row for row in existing if row.get("run_id") not in run_ids]
        columns = columns + [c for c in COLUMNS if c not in columns]  # older files gain new columns at the end
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        for row in kept + rows:
            writer.writerow({k: _cell(row.get(k)) for k in columns})
        atomic_write_text(path, buffer.getvalue())


def read_rows(path: Path | str) -> list[dict[str, str]]:
    return _read(Path(path))[0]


def _read(path: Path) -> tuple[list[dict[str, str]], list[str]]:
    if not path.exists():
        return [], []
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        return list(reader), list(reader.fieldnames or [])


def _cell(value: Any) -> Any:
    return "" if value is None else value
