"""CPU oracle: per-rank GPU memory of a training run, traced on fake tensors with a fake process group.

``trace_run(spec, ranks=None) -> dict`` builds the real transformers model of ``spec.model`` (full size and
layer count, with ``estimator.profiler.build`` so it trains exactly like the harness), wraps it for
``spec.parallel.method`` (``single``, ``ddp``, ``fsdp``, ``tp``, ``dp_tp``; see ``harness.fake.wrap`` for the
exact semantics, shared with the real harness) and runs two training steps under ``FakeTensorMode`` on the cpu
device, one rank at a time (``dist.init_process_group("fake", ...)`` with that rank, destroyed afterwards, so
``trace_run`` can be called repeatedly in one process). A ``TorchDispatchMode`` (``harness.fake.counter``)
counts live storages (rounded to 512 B like the CUDA caching allocator) by category and phase.

Result::

    {"per_rank": {rank: {
        "peak_allocated_bytes": int,        # fsdp/dp_tp: max over steps >= 2 (steady state); else max over steps
        "step_peaks": [{"forward": int, "backward": int, "optimizer": int, "peak": int}, ...],  # one per step
        "breakdown_at_peak": {category: bytes},     # category totals at that peak (they sum to it)
        "step_breakdowns": [...], "step_peak_phases": [...],  # the same for every step
        "peak_step": int (1-based), "peak_phase": str,
        "setup_bytes", "setup_peak_bytes", "setup_breakdown",  # after / during build + wrap + optimizer init
        "local_param_numel": int,            # parameters this rank holds (local shards)
        "setup_s", "trace_s"}},
     "trace_s": float, "measured_by": "fake_tensor_trace", "notes": [...], "spec_id", "round_to", "steps"}

Bytes are live tensor storages, each rounded up to 512 B (``round_to``) like the CUDA caching allocator's
``memory_allocated``; phase peaks are the highest total while that phase ran (optimizer = ``step()`` +
``zero_grad``). Categories (``harness.fake.counter.CATEGORIES``): Parameter, Buffer, Gradient, Optstate,
Master Param, Activation, Temp, Optimizer Temp, Unsharded Param, All Gather, Reduce Scatter, DDP Bucket, Inputs,
Other. Not counted: kernel workspaces (cuBLAS, cuDNN, NCCL), the CUDA context, allocator slack/fragmentation.

Validated: step-2 peaks equal torch's ``MemTracker`` / ``FSDPMemTracker`` byte for byte (``round_to=1``,
tests/oracle); torch's trackers over-count DTensor sharding-propagation temporaries the first time an op is seen
in a process (the "first-step inflation" of FSDP2 on fake tensors), which this counter excludes.

Fake-tensor artefacts neutralised (each checked by tests/oracle: fake == real CPU tensors, byte for byte):
transformers materialises a 4-D SDPA mask (and ``repeat_kv`` for GQA) when it cannot read the padding mask of a
fake batch — the oracle tells it the synthetic batch has no padding, as the data would on a GPU; DTensor's
global-shape metadata propagation runs under our fake mode and is not counted; DeviceMesh's host-side rank
tensors are built outside fake mode; DTensor's process-wide sharding caches are cleared when the traced
(rank, world) changes.

Extra keyword arguments: ``config=`` (an HF config dict instead of looking up ``spec.model``, e.g. a copy with
fewer layers), ``round_to=512``, ``steps=2``, ``fake_tensors=True`` (False: the same program on real CPU
tensors, a validation mode for small configs).

Ranks default to ``(0, world_size - 1)``. Importing this package has no side effects (torch is imported on
the first ``trace_run`` call).
"""

from __future__ import annotations

from typing import Any

__all__ = ["trace_run"]


def trace_run(spec, ranks=None, **kwargs: Any) -> dict[str, Any]:
    from harness.fake.trace import trace_run as _trace_run

    return _trace_run(spec, ranks, **kwargs)
