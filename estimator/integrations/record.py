"""Writing what a rank measured in the harness's table format (``estimator.columns``; ``data/README.md``), so
``python -m calibrate fit --data DIR`` and ``python -m calibrate report --data DIR`` read it, plus a JSON file
per rank with everything (spec, prediction, every step's peaks, versions, allocator settings).

Layout under the user's directory: ``<gpu-key>/<campaign>.rank<r>.csv`` (one file per rank, so ranks never
write the same file; a re-run of the same run id replaces its row) and ``runs/<run_id>/rank<r>.json``.
Local files only; nothing is sent anywhere.
"""

from __future__ import annotations

import csv
import io
import json
import os
import platform
import tempfile
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from estimator.columns import COLUMNS, ENV_COLUMNS, spec_columns
from estimator.spec import RunSpec


def environment() -> dict[str, Any]:
    """The ENV_COLUMNS this process can answer without importing anything heavy beyond torch."""
    env: dict[str, Any] = {"hostname": platform.node(),
                           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get(
                               "PYTORCH_ALLOC_CONF")}
    for column, package in (("torch_version", "torch"), ("transformers_version", "transformers"),
                            ("deepspeed_version", "deepspeed")):
        try:
            env[column] = metadata.version(package)
        except metadata.PackageNotFoundError:
            env[column] = None
    try:
        import torch

        env["cuda_version"] = torch.version.cuda
        if torch.cuda.is_available():
            device = torch.cuda.current_device()
            env["gpu_name"] = torch.cuda.get_device_name(device)
            major, minor = torch.cuda.get_device_capability(device)
            env["compute_capability"] = f"{major}.{minor}"
    except Exception:  # noqa: BLE001 - versions are best effort
        pass
    try:
        import pynvml

        pynvml.nvmlInit()
        env["driver_version"] = str(pynvml.nvmlSystemGetDriverVersion())
    except Exception:  # noqa: BLE001 - NVML is optional
        pass
    return env


def table_row(spec: RunSpec, *, run_id: str, campaign: str, gpu_key: str, rank: int, memory_source: str,
              peaks: dict[str, int | None], steps: int, warmup_steps: int, step_time_s: float | None,
              env: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"run_id": run_id, "spec_id": spec.spec_id, "campaign": campaign, "gpu_key": gpu_key,
                           "rank": rank, "world_size": spec.parallel.world_size, "run_status": "ok",
                           "rank_status": "ok", "emulated": False, "measured_by": "real_run",
                           "memory_source": memory_source, **spec_columns(spec), "num_steps": steps,
                           "warmup_steps": warmup_steps, "measured_steps": steps - warmup_steps,
                           "step_time_s": step_time_s, "data_source": "user",
                           "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                           "node": env.get("hostname")}
    row.update(peaks)
    row.update({k: env.get(k) for k in ENV_COLUMNS})
    return row


def write_row(folder: Path, campaign: str, row: dict[str, Any]) -> Path:
    """Upsert ``row`` (by run id) into ``folder/<gpu_key>/<campaign>.rank<r>.csv``, atomically."""
    path = Path(folder) / str(row["gpu_key"]) / f"{campaign}.rank{row['rank']}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    kept: list[dict[str, str]] = []
    columns = list(COLUMNS)
    if path.exists():
        with open(path, newline="") as handle:
            reader = csv.DictReader(handle)
            columns += [c for c in (reader.fieldnames or []) if c not in columns]
            kept = [r for r in reader if r.get("run_id") != row["run_id"]]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for item in kept + [row]:
        writer.writerow({k: ("" if item.get(k) is None else item.get(k)) for k in columns})
    _atomic_write(path, buffer.getvalue())
    return path


def write_json(folder: Path, run_id: str, rank: int, record: dict[str, Any]) -> Path:
    path = Path(folder) / "runs" / run_id / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, json.dumps(record, indent=1, sort_keys=True, default=str))
    return path


def _atomic_write(path: Path, text: str) -> None:
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "w") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
