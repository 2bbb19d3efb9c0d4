"""Add ``blas_first`` (where each thread's cuBLAS workspace is made) to the shipped profiles some measured rows use.

    PYTHONPATH=. .venv/bin/python benchmarks/backfill_blas_first.py TABLE.csv [RUN_ID ...] [--estimator-transformers R]

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
    from estimator.models.profiles import adapters_in_16bit
    from estimator.profiler.build import lora_adapters_16bit
    from estimator.profiler.profile import build_profile

    arch = resolve_arch(spec.model)
    started = time.perf_counter()
    training = dataclasses.replace(spec.training, micro_batch_size=1, seq_len=512, grad_accum_steps=1)
    with lora_adapters_16bit(adapters_in_16bit(spec.training, spec.parallel.method)):
        profile = build_profile(arch.config, training, tp=spec.parallel.tp)
    return profile, time.perf_counter() - started


def backfill(spec, key: str) -> str:
    import json

    from estimator.models.profiles import _shipped_path, save_profile

    path = _shipped_path(key)
    if not path.is_file():
        return f"{key}: not shipped"
    shipped = json.loads(path.read_text())
    if all("blas_first" in r.get("events", {}) for r in shipped["regimes"]):
        return f"{key}: has blas_first"
    try:
        traced, seconds = _trace(spec)
    except Exception as err:  # noqa: BLE001 - one profile this install cannot trace must not stop the others
        return f"{key}: trace failed: {type(err).__name__}: {err}".splitlines()[0]
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
        print(f"{row['run_id']}: {backfill(spec, key)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
