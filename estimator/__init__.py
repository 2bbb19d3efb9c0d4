"""Per-rank peak GPU memory of LLM fine-tuning. Public API: RunSpec and friends, estimate, Estimate."""

from estimator.spec import ParallelSpec, RunSpec, TrainingSpec, ZeroSpec

__all__ = ["RunSpec", "ParallelSpec", "TrainingSpec", "ZeroSpec", "estimate", "Estimate"]


def __getattr__(name: str):
    # Lazy: `import estimator` stays cheap; the api module is loaded on first use.
    if name in ("estimate", "Estimate"):
        from estimator import api

        return getattr(api, name)
    raise AttributeError(name)
