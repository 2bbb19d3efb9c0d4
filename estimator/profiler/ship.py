"""Build the profiles shipped as package data for catalogue models (so their estimates need no torch).

    python -m estimator.profiler.ship [--models NAME ...] [--variants KEY ...] [--tp 1 2 4 ...]

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
    """True when the shipped profile is current or could be carried over. Schema 2 changed only SDPA traces (no
    4-D mask for a full-length batch): a schema-1 profile traced with eager attention is carried over unchanged
    (rebuilding OPT-125m and Qwen2.5-0.5B eager profiles gave identical segments, 2026-11-22). Schema 3 added two
    facts about the parameters, not the trace (``layers_at``, ``grad_order``): a schema-2 profile gets them from
    the same shrunken model built on fake tensors (``backfill_order``)."""
    profile = json.loads(path.read_text())
    version = profile.get("schema_version")
    if version == PROFILE_SCHEMA_VERSION:
        return True
    if version == 2 or (version == 1 and profile.get("attn_effective") == "eager"):
        if version == 1:
            profile.setdefault("provenance", {})["carried_over"] = "schema 1 -> 2: eager trace unaffected"
        backfill_order(profile)
        profile["schema_version"] = PROFILE_SCHEMA_VERSION
        profile.setdefault("provenance", {})["carried_over_3"] = "schema 2 -> 3: layers_at, grad_order backfilled"
        save_profile(path.stem, profile, path.parent)
        return True
    return False


def _variant_training(profile: dict) -> TrainingSpec:
    variant = profile["variant"]
    return TrainingSpec(precision=variant["precision"], attn=variant["attn"], grad_ckpt=variant["grad_ckpt"],
                        lora_rank=variant["lora_rank"], lora_targets=variant["lora_targets"])


def backfill_order(profile: dict) -> None:
    """Add ``params.layers_at`` and (single-rank profiles) ``params.grad_order`` to a profile that lacks them,
    from the shrunken model on fake tensors and one untraced training step (seconds)."""
    from estimator.profiler.profile import PROFILE_LAYERS, _Model, grad_hook_order, param_table

    training = _variant_training(profile)
    model = _Model(resolve_arch(profile["model"]).config, training, PROFILE_LAYERS)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=None)
    parser.add_argument("--variants", nargs="*", default=list(DEFAULT_VARIANTS))
    parser.add_argument("--tp", type=int, nargs="*", default=[1],
                        help="tensor-parallel degrees (1: the single-rank profile; N > 1: one rank of an N-way "
                             "TP model, for models whose heads / MLP split N ways)")
    args = parser.parse_args(argv)
    from estimator.profiler.profile import build_profile

    out = Path(str(resources.files("estimator") / "profiles"))
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
            if path.exists() and _current_or_carried(path):
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
