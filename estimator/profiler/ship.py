"""Build the profiles shipped as package data for catalogue models (so their estimates need no torch).

    python -m estimator.profiler.ship [--models NAME ...] [--variants KEY ...]

Variants are TrainingSpec field sets; a profile already present is skipped, so the command resumes.
"""

from __future__ import annotations

import argparse
import sys
import time
from importlib import resources
from pathlib import Path

from estimator.arch import catalogue_models, resolve_arch
from estimator.profiles import profile_key, save_profile
from estimator.spec import TrainingSpec

# The spec's default, the same with checkpointing, the paper's setting, and pure bf16.
DEFAULT_VARIANTS = {
    "mixed_bf16-sdpa": TrainingSpec(precision="mixed_bf16", attn="sdpa"),
    "mixed_bf16-sdpa-ckpt": TrainingSpec(precision="mixed_bf16", attn="sdpa", grad_ckpt=True),
    "mixed_fp16-eager-ckpt": TrainingSpec(precision="mixed_fp16", attn="eager", grad_ckpt=True),
    "bf16-sdpa": TrainingSpec(precision="bf16", attn="sdpa"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=None)
    parser.add_argument("--variants", nargs="*", default=list(DEFAULT_VARIANTS))
    args = parser.parse_args(argv)
    from estimator.profiler.profile import build_profile

    out = Path(str(resources.files("estimator") / "profiles"))
    for name in args.variants:  # variant-major: the most used variant covers every model first
        training = DEFAULT_VARIANTS[name]
        for model in args.models or catalogue_models():
            arch = resolve_arch(model)
            key = profile_key(arch.config_sha, training)
            if (out / f"{key}.json").exists():
                continue
            started = time.perf_counter()
            profile = build_profile(arch.config, training)
            profile["model"] = arch.name
            save_profile(key, profile, out)
            print(f"{model:<55}{name:<24}{time.perf_counter() - started:6.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
