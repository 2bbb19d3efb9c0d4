"""CPU oracle: per-rank GPU memory of a training run, traced on fake tensors with a fake process group.

``trace_run(spec, ranks=None) -> dict`` builds the real transformers model of ``spec.model`` (full size and
layer count, with ``estimator.profiler.build`` so it trains exactly like the harness), wraps it for
``spec.parallel.method`` (``single``, ``ddp``, ``fsdp``, ``tp``, ``dp_tp``; see ``harness.fake.wrap`` for the
exact semantics, shared with the real harness) and runs two training steps under ``FakeTensorMode`` on the cpu
device, one rank at a time (``dist.init_process_group("fake", ...)`` with that rank, destroyed afterwards, so
``trace_run`` can be called repeatedly in one process). A ``TorchDispatchMode`` (``harness.fake.counter``)
counts live storages (rounded to 512 B like the CUDA caching allocator) by category and phase.

Result::

    {"per_rank": {rank: {"peak_allocated_bytes": int,          # steady state (fsdp/dp_tp: steps >= 2)
                         "step_peaks": [{"forward", "backward", "optimizer", "peak"}, ...],   # one per step
                         "breakdown_at_peak": {category: bytes},   # at the reported peak
                         "peak_step", "peak_phase", "setup_bytes", "setup_peak_bytes", "setup_breakdown",
                         "local_param_numel", "setup_s", "trace_s"}},
     "trace_s": float, "measured_by": "fake_tensor_trace", "notes": [...], "spec_id", "round_to", "steps"}

Ranks default to ``(0, world_size - 1)``. Importing this package has no side effects (torch is imported on
the first ``trace_run`` call).
"""

from __future__ import annotations

from typing import Any

__all__ = ["trace_run"]


def trace_run(spec, ranks=None, **kwargs: Any) -> dict[str, Any]:
    from harness.fake.trace import trace_run as _trace_run

    return _trace_run(spec, ranks, **kwargs)
