"""Build the profiles shipped as package data for catalogue models (so their estimates need no torch).

    python -m estimator.profiler.ship [--models NAME ...] [--variants KEY ...] [--tp 1 2 4 ...] [--events]
                                      [--out DIR]
    python -m estimator.profiler.ship --rows data/public/measurements.csv [--models NAME ...] [--out DIR]
    python -m estimator.profiler.ship ... --sums-in-place   (autograd's sums as a GPU makes them; into an empty --out
                                                              re-traces everything: docs/allocator.md, helper sums)
    python -m estimator.profiler.ship --resummarise [--out DIR]   (stored profiles' summaries to today's rule, in
                                                                    place, no torch; rerun after merging re-traces)

Variants are TrainingSpec field sets; a profile already present (current schema) is skipped, so the command resumes.
``--rows``: the profiles a measurement table's rows ask for with ``model_code`` equal to the transformers release
installed here, traced with its model code (run it once per release, each from an environment with that release).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
import sys
import time
from importlib import resources
from pathlib import Path

from estimator.columns import spec_from_columns
from estimator.models.arch import catalogue_models, resolve_arch
from estimator.models.profiles import (
    has_events,
    installed_version,
    profile_key,
    run_adapters_in_16bit,
    save_profile,
)
from estimator.models.tp_plans import check_tp
from estimator.profiler.carry import (
    backfill_buffers,
    backfill_tp_grad_order,
    carry_over_file,
    variant_training,
)
from estimator.spec import RunSpec, TrainingSpec, ckpt_every, model_code_release

# The spec's default, the same with checkpointing, the paper's setting, pure bf16, and fp16 for pre-Ampere GPUs.
DEFAULT_VARIANTS = {
    "mixed_bf16-sdpa": TrainingSpec(precision="mixed_bf16", attn="sdpa"),
    "mixed_bf16-sdpa-ckpt": TrainingSpec(precision="mixed_bf16", attn="sdpa", grad_ckpt=True),
    "mixed_fp16-eager-ckpt": TrainingSpec(precision="mixed_fp16", attn="eager", grad_ckpt=True),
    "bf16-sdpa": TrainingSpec(precision="bf16", attn="sdpa"),
    # GPUs without bf16 (V100, T4): the planner's default precision there.
    "mixed_fp16-sdpa": TrainingSpec(precision="mixed_fp16", attn="sdpa"),
    "mixed_fp16-sdpa-ckpt": TrainingSpec(precision="mixed_fp16", attn="sdpa", grad_ckpt=True),
}


def carry_over_shipped(directory: Path, *, events: bool = False, models: list[str] | None = None) -> int:
    """Every shipped profile at the current schema: carried over where exact, else re-traced; ``events``: also
    re-trace those without event lists. ``models``: only these catalogue models' profiles."""
    from estimator.profiler.profile import build_profile

    release = model_code_release(installed_version("transformers") or "")
    for path in sorted(directory.glob("*.json")):
        if models is not None and json.loads(path.read_text()).get("model") not in models:
            continue
        traced_for = path.stem.rpartition("_tf")[2] if "_tf" in path.stem else None
        if traced_for is not None and traced_for != release:
            print(f"{path.stem:<60}kept: transformers {traced_for}'s model code (ship --rows with it installed)")
            continue
        started = time.perf_counter()
        if carry_over_file(path) and not (events and not has_events(json.loads(path.read_text()))):
            how = "grad order from its sibling" if backfill_tp_grad_order(path) else "current or carried over"
        else:
            profile = json.loads(path.read_text())
            rebuilt = build_profile(resolve_arch(profile["model"]).config, variant_training(profile),
                                    tp=profile.get("tp", 1))
            rebuilt["model"] = profile["model"]
            save_profile(path.stem, rebuilt, directory)
            how = "re-traced"
        print(f"{path.stem:<60}{how:<26}{time.perf_counter() - started:6.1f} s", flush=True)
    return 0


def resummarise_stored(directory: Path) -> int:
    """Every profile in ``directory`` summarised by today's rule and marked so (``vocab.resummarised``), in place:
    the loader then takes it as stored instead of summarising it again at every load. Pure Python; a profile
    already marked is left as it is, so the command can be rerun after profiles are re-traced or merged."""
    from estimator.models.profiles import summaries_current
    from estimator.profiler.vocab import resummarised

    changed = 0
    for path in sorted(directory.glob("*.json")):
        profile = json.loads(path.read_text())
        if summaries_current(profile):
            continue
        save_profile(path.stem, resummarised(profile), directory)
        changed += 1
    print(f"{changed} of {len(list(directory.glob('*.json')))} profiles in {directory} re-summarised "
          "(the others were current)")
    return 0


def specs_of_release(rows_csv: Path, release: str, models: list[str] | None = None) -> list[RunSpec]:
    """The rows' specs whose model code is ``release`` (major.minor), one per profile: a published table's
    complete, in-scope rows by their ``model_code``; a harness table's (no ``complete`` column) by the
    ``transformers_version`` that ran, which becomes the spec's ``model_code``. ``models``: only these."""
    with rows_csv.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    specs: dict[str, RunSpec] = {}
    for row in rows:
        published = "complete" in row
        code = row.get("model_code") or "" if published else row.get("transformers_version") or ""
        if model_code_release(code) != release or (published and not (
                row.get("complete") == "True" and row.get("in_scope") == "True")):
            continue
        try:
            spec = spec_from_columns(row)
        except ValueError:
            continue  # not a spec the estimator takes: the table's own check reports it
        if not published:
            spec = dataclasses.replace(spec, training=dataclasses.replace(spec.training, model_code=release))
        arch = resolve_arch(spec.model)
        if models is not None and arch.name not in models:
            continue
        for traced in _traced_specs(spec):
            specs.setdefault(_row_profile_key(traced, arch.config_sha), traced)
    return list(specs.values())


def _traced_specs(spec: RunSpec) -> list[RunSpec]:
    """The specs whose profiles ``spec``'s estimate loads: every-k checkpointing has no profile of its own, it
    mixes the plain and the checkpointed one (``api.every_k_profile``)."""
    if ckpt_every(spec.training.ckpt_policy) is None:
        return [spec]
    full = dataclasses.replace(spec.training, ckpt_policy="")
    return [dataclasses.replace(spec, training=dataclasses.replace(full, grad_ckpt=ckpt)) for ckpt in (False, True)]


def _row_profile_key(spec: RunSpec, config_sha: str) -> str:
    return profile_key(config_sha, spec.training, spec.parallel.tp,
                       run_adapters_in_16bit(spec))


def catalogue_name(arch) -> str:
    """The catalogue model whose config has ``arch``'s fingerprint (a harness asset config, a few layers of a
    catalogue model, labels itself with its ``_name_or_path``; its profile serves the catalogue model), else the
    arch's own name."""
    from estimator.models.arch import catalogue_models

    for name in catalogue_models():
        if resolve_arch(name).config_sha == arch.config_sha:
            return name
    return arch.name


def ship_rows(rows_csv: Path, out: Path, models: list[str] | None = None) -> int:
    """Trace the profiles of ``rows_csv``'s rows that run the installed transformers' model code."""
    from estimator.profiler.build import lora_adapters_16bit
    from estimator.profiler.profile import build_profile

    release = model_code_release(installed_version("transformers") or "")
    for spec in specs_of_release(rows_csv, release, models):
        arch = resolve_arch(spec.model)
        key = _row_profile_key(spec, arch.config_sha)
        if (out / f"{key}.json").exists():
            continue  # resume
        started = time.perf_counter()
        training = dataclasses.replace(spec.training, micro_batch_size=1, seq_len=512, grad_accum_steps=1)
        try:
            with lora_adapters_16bit(run_adapters_in_16bit(spec)):
                profile = build_profile(arch.config, training, tp=spec.parallel.tp)
        except Exception as err:  # noqa: BLE001 - one variant this release cannot trace must not stop the others
            print(f"{arch.name:<55}{key.split('_', 1)[1]:<48}failed: {type(err).__name__}: {err}".splitlines()[0])
            continue
        profile["model"] = catalogue_name(arch)
        save_profile(key, profile, out)
        print(f"{arch.name:<55}{key.split('_', 1)[1]:<48}{time.perf_counter() - started:6.1f} s", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=None)
    parser.add_argument("--variants", nargs="*", default=list(DEFAULT_VARIANTS))
    parser.add_argument("--tp", type=int, nargs="*", default=[1],
                        help="tensor-parallel degrees (1: the single-rank profile; N > 1: one rank of an N-way "
                             "TP model, for models whose heads / MLP split N ways)")
    parser.add_argument("--events", action="store_true",
                        help="re-trace profiles whose regimes have no event list (the reserved replay needs one; "
                             "event lists cannot be carried over without a trace)")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the profiles here (default: the package's profiles; e.g. the user cache, "
                             "$LLMEM_CACHE_DIR/profiles, whose profiles with event lists take precedence)")
    parser.add_argument("--carry-over", action="store_true",
                        help="bring every shipped profile to the current schema (re-trace those that cannot be; with "
                             "--events also those without event lists; with --models only theirs)")
    parser.add_argument("--rows", type=Path, default=None,
                        help="a measurement table (data/public/measurements.csv, or a harness table such as "
                             "data/measurements/h200-141gb/gpu_single.csv): trace the profiles its rows ask for "
                             "with the model code of the installed transformers release (with --models: only theirs)")
    parser.add_argument("--sums-in-place", action="store_true",
                        help="trace autograd's gradient sums in place where torch's rule makes them so "
                             "(StorageRecorder.fold_engine_sums; docs/allocator.md, helper sums)")
    parser.add_argument("--resummarise", action="store_true",
                        help="summarise every profile in --out (default: the package's) again from its events by "
                             "today's rule and mark it so (summary_rule), in place; no torch, idempotent")
    args = parser.parse_args(argv)
    out = args.out or Path(str(resources.files("estimator") / "profiles"))
    if args.resummarise:
        return resummarise_stored(out)
    from estimator.profiler.profile import build_profile
    from estimator.profiler.trace import StorageRecorder

    if args.sums_in_place:
        StorageRecorder.fold_engine_sums_default = True

    if args.rows is not None:
        return ship_rows(args.rows, out, [resolve_arch(m).name for m in args.models] if args.models else None)
    if args.carry_over:
        models = [resolve_arch(m).name for m in args.models] if args.models else None
        return carry_over_shipped(out, events=args.events, models=models)
    for name in args.variants:  # variant-major: the most used variant covers every model first
        training = DEFAULT_VARIANTS[name]
        for model, tp in itertools.product(args.models or catalogue_models(), args.tp):
            arch = resolve_arch(model)
            if tp > 1:
                try:
                    check_tp(arch, tp)
                except ValueError:
                    continue  # no plan for this family, or it does not split tp ways
            key = profile_key(arch.config_sha, training, tp)
            path = out / f"{key}.json"
            stale = args.events and path.exists() and not has_events(json.loads(path.read_text()))
            if path.exists() and carry_over_file(path) and not stale:
                backfill_buffers(path)
                backfill_tp_grad_order(path)
                continue  # resume; an older schema is rebuilt
            started = time.perf_counter()
            profile = build_profile(arch.config, training, tp=tp)
            profile["model"] = arch.name
            save_profile(key, profile, out)
            label = f"{name} tp{tp}" if tp > 1 else name
            print(f"{model:<55}{label:<24}{time.perf_counter() - started:6.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
