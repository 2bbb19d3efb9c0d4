"""Add the module trace (``estimator.profiler.modules``) to shipped profiles traced before it was kept, the rest
of each profile left as it is:

    PYTHONPATH=. .venv/bin/python -m estimator.profiler.add_module_trace MODEL ... [--precision P] [--attn A]
"""

from __future__ import annotations

from estimator.profiler.modules import record_module_trace


def trace_for(config: dict, training) -> dict:
    """The module trace of ``config``'s model as the profiler builds it (``PROFILE_LAYERS`` layers, fake
    tensors): for a profile traced before the trace was kept."""
    from estimator.profiler.profile import PROFILE_LAYERS, _Model

    model = _Model(config, training, PROFILE_LAYERS)
    table_model = model.base if not training.lora else model.model
    return record_module_trace(model.model, table_model, model.layers, model.warm_step)


def main(argv: list[str] | None = None) -> int:
    """Add the module trace to the shipped profiles of ``MODEL`` (catalogue names or config paths) for a
    training variant; the rest of each profile is left as it is."""
    import argparse
    import json
    from importlib import resources

    from estimator.models.arch import cached_arch
    from estimator.models.profiles import profile_key
    from estimator.spec import TrainingSpec

    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="+")
    parser.add_argument("--precision", default="mixed_bf16")
    parser.add_argument("--attn", default="sdpa")
    args = parser.parse_args(argv)
    training = TrainingSpec(precision=args.precision, attn=args.attn)
    for model in args.models:
        arch = cached_arch(model)
        key = profile_key(arch.config_sha, training)
        path = resources.files("estimator") / "profiles" / f"{key}.json"
        profile = json.loads(path.read_text())
        profile["params"]["module_trace"] = trace_for(arch.config, training)
        path.write_text(json.dumps(profile, separators=(",", ":")))
        print(f"{model} {key}: {len(profile['params']['module_trace']['forward'])} pre-forward hooks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
