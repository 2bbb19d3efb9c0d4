"""What an allocator cap (``training.memory_cap_bytes``, as ``torch.cuda.set_per_process_memory_fraction`` sets it)
does to a run's verdict: the device level a rank may reach under it, and the notes that say whether the replayed
steps fit, fit only through release-and-retry, or run out of memory under the cap. ``worst``: the worst rank's
estimate (``estimator.api.RankEstimate``: its device, reserved and replay fields)."""

from __future__ import annotations

GIB = 1024**3


def capacity_under_cap_bytes(spec, gpu_capacity_bytes: int, worst) -> int:
    """The device level a rank may reach: the GPU's memory, or with an allocator cap (``training.memory_cap_bytes``)
    the cap plus what the allocator does not own (the worst rank's device less reserved level: CUDA context, NCCL
    buffers), where smaller. The fit verdict and the headroom are against it."""
    cap = spec.training.memory_cap_bytes
    if not cap:
        return gpu_capacity_bytes
    return min(gpu_capacity_bytes, cap + worst.peak_device_bytes - worst.peak_reserved_bytes)


def cap_notes(spec, gpu_capacity_bytes: int, worst) -> list[str]:
    """What the allocator cap does to the run: nothing (above what the allocator can get), a fit only through
    release-and-retry, or an out-of-memory the GPU alone would not cause."""
    cap = spec.training.memory_cap_bytes
    if not cap:
        return []
    head = f"memory cap: the caching allocator is capped at {cap / GIB:.2f} GiB ({cap:,} B; set_per_process_memory_fraction)"
    if cap + worst.peak_device_bytes - worst.peak_reserved_bytes >= gpu_capacity_bytes and not worst.gc_released_bytes:
        return [f"{head}, at or above what the GPU leaves it: no effect"]
    if worst.reserved_source != "replayed":
        verdict = "fits under it" if worst.peak_reserved_bytes <= cap else "does NOT fit under it"
        return [f"{head}; the reserved level is the prior (no replay), {worst.peak_reserved_bytes / GIB:.2f} GiB: "
                f"the run {verdict} (release-and-retry is not modelled without the replay)"]
    if worst.allocator_oom:
        return [f"{head}; the allocator runs OUT OF MEMORY under the cap after {worst.num_alloc_retries} "
                f"release-and-retries (reserved levels above are what the run needs uncapped: "
                f"{worst.peak_reserved_bytes / GIB:.2f} GiB)"]
    if worst.num_alloc_retries:
        return [f"{head}; the replayed steps fit only through release-and-retry: the allocator reaches the cap, releases its "
                f"cached blocks and retries {worst.num_alloc_retries} time(s) (torch.cuda.memory_stats "
                f"num_alloc_retries; slower steps), reserved peak {worst.peak_reserved_bytes / GIB:.2f} GiB"]
    if worst.gc_released_bytes:
        return [f"{head}; its garbage collection (garbage_collection_threshold) returned "
                f"{worst.gc_released_bytes / GIB:.2f} GiB of cached blocks and kept the replayed steps under it "
                f"without a release-and-retry, reserved peak {worst.peak_reserved_bytes / GIB:.2f} GiB"]
    return [f"{head}; the replay never reaches it (no retry)"]
