"""Build the profiles shipped as package data for catalogue models (so their estimates need no torch).

    python -m estimator.profiler.ship [--models NAME ...] [--variants KEY ...] [--tp 1 2 4 ...] [--events]
                                      [--out DIR]

Variants are TrainingSpec field sets; a profile already present (current schema) is skipped, so the command resumes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from importlib import resources
from pathlib import Path

from estimator.arch import catalogue_models, resolve_arch
from estimator.profiles import PROFILE_SCHEMA_VERSION, profile_key, save_profile
from estimator.spec import TrainingSpec
from estimator.tp_plans import check_tp

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


def _current_or_carried(path: Path) -> bool:
    """True when the shipped profile is current or could be carried over (``carry_over``, saved in place). Schema 2
    changed only SDPA traces (no 4-D mask for a full-length batch): a schema-1 profile traced with eager attention
    is carried over unchanged (rebuilding OPT-125m and Qwen2.5-0.5B eager profiles gave identical segments,
    2026-11-22). Schema 3 added two facts about the parameters, not the trace (``layers_at``, ``grad_order``): a
    schema-2 profile gets them from the same shrunken model built on fake tensors (``backfill_order``). Schema 4
    added the manual training loop (``backfill_manual_loop``)."""
    profile = json.loads(path.read_text())
    if profile.get("schema_version") == PROFILE_SCHEMA_VERSION:
        return True
    if not carry_over(profile):
        return False
    save_profile(path.stem, profile, path.parent)
    return True


def carry_over(profile: dict, config: dict | None = None) -> bool:
    """Bring an older profile to the current schema in place without re-tracing it, where that is exact; False
    when it must be rebuilt. ``config``: the model's config (default: the shipped profile's catalogue model's)."""
    config = config if config is not None else resolve_arch(profile["model"]).config
    version = profile.get("schema_version")
    provenance = profile.setdefault("provenance", {})
    if version == 1 and profile.get("attn_effective") == "eager":
        provenance["carried_over"] = "schema 1 -> 2: eager trace unaffected"
        version = 2
    if version == 2:
        backfill_order(profile, config)
        provenance["carried_over_3"] = "schema 2 -> 3: layers_at, grad_order backfilled"
        version = 3
    if version == 3:
        if not backfill_manual_loop(profile, config):
            return False
        provenance["carried_over_4"] = "schema 3 -> 4: outputs_held, segments_manual backfilled"
        version = 4
    profile["schema_version"] = version
    return version == PROFILE_SCHEMA_VERSION


def backfill_manual_loop(profile: dict, config: dict) -> bool:
    """Add ``outputs_held`` and ``segments_manual`` (schema 4) to a schema-3 profile, from forward passes of the
    same shrunken model at the regime's fitting points: the output object's storages besides the loss, and
    whether the autograd graph keeps them. When the graph keeps none, the manual loop's step is the traced step
    with the previous step's outputs alive from its start, so ``segments_manual`` is ``segments`` with the prefix
    raised by them (``manual_loop_events`` gives the same for such a trace). False (nothing changed) when the
    graph keeps one: that profile must be re-traced."""
    from estimator.profiler.profile import PROFILE_LAYERS, _Model, _points, _process_group, _solve

    training = _variant_training(profile)
    tp = profile.get("tp", 1)
    updated = []
    with _process_group(tp):
        model = _Model(config, training, PROFILE_LAYERS, tp)
        for regime in profile["regimes"]:
            points = _points(regime)[0]
            held = {point: model.output_bytes(*point) for point in points}
            polys = {kind: [float(c) for c in _solve(points, [sum(n for n, saved in held[p] if saved == want)
                                                              for p in points])]
                     for kind, want in (("dropped", False), ("saved", True))}
            if any(polys["saved"]):
                return False
            updated.append((regime, polys))
    for regime, polys in updated:
        regime["outputs_held"] = polys
        regime["segments_manual"] = _raised_prefix(regime["segments"], polys["dropped"])
    return True


def _raised_prefix(segments: dict, held: list[float]) -> dict:
    prefix = segments["prefix"]
    raised = {"net_act": [a + h for a, h in zip(prefix["net_act"], held)], "net_grad": prefix["net_grad"],
              "candidates": [(list(held), 0.0)]  # the step's start: the previous outputs alone
              + [([a + h for a, h in zip(act, held)], grad) for act, grad in prefix["candidates"]]}
    return {**segments, "prefix": raised}


def _variant_training(profile: dict) -> TrainingSpec:
    variant = profile["variant"]
    return TrainingSpec(precision=variant["precision"], attn=variant["attn"], grad_ckpt=variant["grad_ckpt"],
                        lora_rank=variant["lora_rank"], lora_targets=variant["lora_targets"])


def backfill_order(profile: dict, config: dict) -> None:
    """Add ``params.layers_at`` and (single-rank profiles) ``params.grad_order`` to a profile that lacks them,
    from the shrunken model on fake tensors and one untraced training step (seconds)."""
    from estimator.profiler.profile import PROFILE_LAYERS, _Model, grad_hook_order, param_table

    training = _variant_training(profile)
    model = _Model(config, training, PROFILE_LAYERS)
    table_model = model.base if not training.lora else model.model
    profile["params"]["layers_at"] = param_table(table_model, model.layers, PROFILE_LAYERS)["layers_at"]
    if not profile.get("tp"):
        profile["params"]["grad_order"] = grad_hook_order(model.model, table_model, model.layers, model.warm_step)


def backfill_buffers(path: Path) -> bool:
    """Profiles shipped before module buffers were recorded lack ``params.buffers``: add them from a meta-device
    build of the same shrunken model (buffers are created at construction; no trace needed). True if changed."""
    from estimator.profiler import build
    from estimator.profiler.profile import PROFILE_LAYERS, param_table
    from estimator.profiler.trace import decoder_layers

    profile = json.loads(path.read_text())
    if "buffers" in profile["params"]:
        return False
    training = _variant_training(profile)
    model = build.build_model(resolve_arch(profile["model"]).config, training, num_layers=PROFILE_LAYERS, meta=True)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    table = param_table(base, decoder_layers(base, PROFILE_LAYERS), PROFILE_LAYERS)
    profile["params"]["buffers"] = table["buffers"]
    save_profile(path.stem, profile, path.parent)
    return True


def carry_over_shipped(directory: Path) -> int:
    """Every shipped profile at the current schema: carried over where exact, else re-traced."""
    from estimator.profiler.profile import build_profile

    for path in sorted(directory.glob("*.json")):
        started = time.perf_counter()
        if _current_or_carried(path):
            how = "current or carried over"
        else:
            profile = json.loads(path.read_text())
            rebuilt = build_profile(resolve_arch(profile["model"]).config, _variant_training(profile),
                                    tp=profile.get("tp", 1))
            rebuilt["model"] = profile["model"]
            save_profile(path.stem, rebuilt, directory)
            how = "re-traced"
        print(f"{path.stem:<60}{how:<26}{time.perf_counter() - started:6.1f} s", flush=True)
    return 0


def _has_events(path: Path) -> bool:
    return all("events" in regime for regime in json.loads(path.read_text())["regimes"])


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
                        help="bring every shipped profile to the current schema (re-trace those that cannot be)")
    args = parser.parse_args(argv)
    from estimator.profiler.profile import build_profile

    out = args.out or Path(str(resources.files("estimator") / "profiles"))
    if args.carry_over:
        return carry_over_shipped(out)
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
            if path.exists() and _current_or_carried(path) and not (args.events and not _has_events(path)):
                backfill_buffers(path)
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
