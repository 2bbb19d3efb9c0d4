"""Bring the event lists of the shipped profiles some measured rows use up to today's tracer, where that is exact.

    PYTHONPATH=. .venv/bin/python benchmarks/backfill_events.py TABLE.csv [RUN_ID ...] [--estimator-transformers R]

Today's tracer adds two things to a profile's event lists (docs/allocator.md, session 25): ``blas_first`` (where
each thread's cuBLAS workspace is made) and autograd's gradient sums in place (``sums_in_place``). For each row (a
harness table, ``data/measurements/<gpu>/gpu_*.csv``; no RUN_ID: every row with status ok) the profile the
estimator takes for its spec is traced with the sums as fake tensors make them; when those event lists equal the
shipped ones (but for ``blas_first``), they replace the shipped ones (``--sums-in-place``: a trace with the sums in
place where torch's rule makes them so does: never into an autograd view, docs/allocator.md, helper sums). The segment
summaries stay as they were traced, so the allocated estimate cannot move. A profile whose event lists differ is
reported and left alone: it needs a full re-trace (``estimator.profiler.ship``), which may move other numbers."""

from __future__ import annotations

import csv
import dataclasses
import sys
import tempfile
import time
from pathlib import Path


def _spec_of(row: dict, estimator_release: str):
    """The row's spec as the estimator takes it (``estimator.columns.measured_spec_from_columns`` under
    transformers ``estimator_release``): a row run with another release names that release's model code."""
    from estimator.columns import spec_from_columns
    from estimator.spec import model_code_release

    spec = spec_from_columns(row)
    ran = row.get("transformers_version") or ""
    if spec.training.model_code or not ran or model_code_release(ran) == estimator_release:
        return spec
    return dataclasses.replace(spec, training=dataclasses.replace(spec.training, model_code=ran))


def _key_of(spec) -> str:
    from estimator.models.arch import resolve_arch
    from estimator.profiler.ship import _row_profile_key

    return _row_profile_key(spec, resolve_arch(spec.model).config_sha)


def _trace(spec) -> tuple[dict, float]:
    from estimator.models.arch import resolve_arch
    from estimator.models.profiles import run_adapters_in_16bit
    from estimator.profiler.build import lora_adapters_16bit
    from estimator.profiler.profile import build_profile

    arch = resolve_arch(spec.model)
    started = time.perf_counter()
    training = dataclasses.replace(spec.training, micro_batch_size=1, seq_len=512, grad_accum_steps=1)
    with lora_adapters_16bit(run_adapters_in_16bit(spec)):
        profile = build_profile(arch.config, training, tp=spec.parallel.tp)
    return profile, time.perf_counter() - started


def _same_events(shipped: dict, traced: dict) -> bool:
    if len(shipped["regimes"]) != len(traced["regimes"]):
        return False
    for old, new in zip(shipped["regimes"], traced["regimes"]):
        kept = {k: v for k, v in new.get("events", {}).items() if k not in NEW_KEYS}
        if "events" not in old or {k: v for k, v in old["events"].items() if k not in NEW_KEYS} != kept:
            return False
    return True


NEW_KEYS = ("blas_first", "sums_in_place")


def backfill(spec, key: str, sums_in_place: bool = False) -> str:
    import json

    from estimator.models.profiles import _shipped_path, save_profile
    from estimator.profiler.trace import StorageRecorder

    path = _shipped_path(key)
    if not path.is_file():
        return f"{key}: not shipped"
    shipped = json.loads(path.read_text())
    if all("blas_first" in r.get("events", {}) and r["events"].get("sums_in_place", False) == sums_in_place
           for r in shipped["regimes"]):
        return f"{key}: up to date"
    try:
        StorageRecorder.fold_engine_sums_default = False
        as_shipped, seconds = _trace(spec)
        if not _same_events(shipped, as_shipped):
            return f"{key}: its event list changed; re-trace it (ship)"
        traced, more = as_shipped, 0.0
        if sums_in_place:
            StorageRecorder.fold_engine_sums_default = True
            traced, more = _trace(spec)
    except Exception as err:  # noqa: BLE001 - one profile this install cannot trace must not stop the others
        return f"{key}: trace failed: {type(err).__name__}: {err}".splitlines()[0]
    finally:
        StorageRecorder.fold_engine_sums_default = False
    events_before = [sum(map(len, r["events"]["segments"].values())) for r in shipped["regimes"]]
    for old, new in zip(shipped["regimes"], traced["regimes"]):
        old["events"] = new["events"]
    with tempfile.TemporaryDirectory() as scratch:  # save_profile's atomic write, then into place
        written = save_profile(key, shipped, Path(scratch))
        path.write_text(written.read_text())
    events_after = [sum(map(len, r["events"]["segments"].values())) for r in shipped["regimes"]]
    return (f"{key}: events {events_before} -> {events_after}, blas_first "
            f"{[r['events']['blas_first'] for r in shipped['regimes']]} ({seconds + more:.1f} s trace)")


def main(argv: list[str] | None = None) -> int:
    import argparse

    from estimator.models.profiles import installed_version
    from estimator.spec import model_code_release

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("runs", nargs="*", help="run id prefixes (none: every row with status ok)")
    parser.add_argument("--estimator-transformers", default=None,
                        help="the release the estimator runs with (default: the installed one); rows run with "
                             "another use that release's profiles (``_tf<release>``), traced only when it is the "
                             "installed one (PYTHONPATH to an unpacked wheel)")
    parser.add_argument("--sums-in-place", action="store_true",
                        help="trace autograd's gradient sums in place where torch's rule makes them so "
                             "(docs/allocator.md, helper sums)")
    args = parser.parse_args(argv)
    installed = model_code_release(installed_version("transformers") or "")
    estimator_release = model_code_release(args.estimator_transformers or "") or installed
    with args.table.open(newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("run_status", "ok") == "ok"
                and (not args.runs or any(r["run_id"].startswith(run) for run in args.runs))]
    done = set()
    for row in rows:
        if row.get("rank", "0") not in ("0", ""):
            continue
        try:
            spec = _spec_of(row, estimator_release)
            key = _key_of(spec)
        except ValueError as err:
            print(f"{row['run_id']}: no spec: {err}")
            continue
        release = model_code_release(spec.training.model_code) if spec.training.model_code else estimator_release
        if key in done:
            continue
        done.add(key)
        if release != installed:
            print(f"{row['run_id']}: {key}: needs transformers {release} installed")
            continue
        print(f"{row['run_id']}: {backfill(spec, key, args.sums_in_place)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
