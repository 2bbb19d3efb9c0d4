"""Add ``blas_first`` (where each thread's cuBLAS workspace is made) to the shipped profiles some measured rows use.

    PYTHONPATH=. .venv/bin/python benchmarks/backfill_blas_first.py TABLE.csv RUN_ID [RUN_ID ...]

For each row (a harness table: ``data/measurements/<gpu>/gpu_*.csv``) the profile the estimator takes for its spec
is traced again (``build_profile``, as ``estimator.profiler.ship --rows`` does, into a scratch directory); when its
regimes' event lists equal the shipped ones but for the new key, only ``blas_first`` is written into the shipped
profile (its segment summaries stay as they were traced, so the allocated estimate cannot move). A profile whose
events differ is reported and left alone: it needs a full re-trace (``ship``), which may move other numbers."""

from __future__ import annotations

import csv
import dataclasses
import sys
import tempfile
import time
from pathlib import Path


def _profile_of(row: dict) -> tuple[str, dict, float]:
    from estimator.columns import spec_from_columns
    from estimator.models.arch import resolve_arch
    from estimator.models.profiles import adapters_in_16bit
    from estimator.profiler.build import lora_adapters_16bit
    from estimator.profiler.profile import build_profile
    from estimator.profiler.ship import _row_profile_key

    spec = spec_from_columns(row)
    arch = resolve_arch(spec.model)
    started = time.perf_counter()
    training = dataclasses.replace(spec.training, micro_batch_size=1, seq_len=512, grad_accum_steps=1)
    with lora_adapters_16bit(adapters_in_16bit(spec.training, spec.parallel.method)):
        profile = build_profile(arch.config, training, tp=spec.parallel.tp)
    return _row_profile_key(spec, arch.config_sha), profile, time.perf_counter() - started


def backfill(row: dict) -> str:
    import json

    from estimator.models.profiles import _shipped_path, save_profile

    key, traced, seconds = _profile_of(row)
    path = _shipped_path(key)
    if not path.is_file():
        return f"{key}: not shipped"
    shipped = json.loads(path.read_text())
    if len(shipped["regimes"]) != len(traced["regimes"]):
        return f"{key}: another number of regimes; re-trace it (ship)"
    for old, new in zip(shipped["regimes"], traced["regimes"]):
        events = dict(new.get("events", {}))
        blas = events.pop("blas_first", None)
        if "events" not in old or {k: v for k, v in old["events"].items() if k != "blas_first"} != events:
            return f"{key}: its event list changed; re-trace it (ship)"
        old["events"]["blas_first"] = blas
    with tempfile.TemporaryDirectory() as scratch:  # save_profile's atomic write, then into place
        written = save_profile(key, shipped, Path(scratch))
        path.write_text(written.read_text())
    return f"{key}: blas_first {[r['events']['blas_first'] for r in shipped['regimes']]} ({seconds:.1f} s trace)"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    table, runs = Path(args[0]), args[1:]
    with table.open(newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if any(r["run_id"].startswith(run) for run in runs)]
    for row in rows:
        if row.get("rank", "0") not in ("0", ""):
            continue
        print(f"{row['run_id']}: {backfill(row)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
