"""Memory probe: allocator peaks per phase, driver-level used memory, CUDA context size.

What is read (CUDA): ``torch.cuda.memory_stats()`` peaks of allocated / reserved / active / requested bytes
(reset at the start of every phase, so each phase's peak is its own), ``inactive_split_bytes`` (fragmentation),
``num_alloc_retries`` / ``num_ooms`` (cumulative), and the driver's used memory for this process (NVML
per-process figure when NVML can see our pid, else ``mem_get_info`` total - free, which also counts other
processes on the GPU). Driver memory is sampled at phase boundaries, plus by a background thread when
``sample_interval_s > 0``: it is a high-water of samples, not a true peak. The CUDA context is
driver used - allocator reserved, right after CUDA init (context + nothing) and after the first step (context +
cuBLAS/cuDNN workspaces outside the allocator + NCCL buffers on real multi-rank runs).

On CPU there are no allocator statistics. With ``count_cpu`` (the default) the allocated level is counted from
live tensor storages instead (``harness.fake.counter``, 512-byte blocks as the CUDA allocator rounds; source
"counted-cpu"): what a CUDA run of the same program would allocate, up to CPU-only kernel differences; reserved
and device levels stay None. Without it every memory field is None and ``source`` is "none-cpu".
The conversion functions at the top are pure (unit-tested without a GPU).
"""

from __future__ import annotations

import os
import re
import resource
import threading
from typing import Any

from harness.records import PhaseRecord

GIB = 1024**3


# --------------------------------------------------------------------------------------------- pure

def phase_from_stats(phase: str, stats: dict[str, Any], *, device_used_peak_bytes: int | None,
                     time_s: float | None) -> PhaseRecord:
    """A PhaseRecord from a ``torch.cuda.memory_stats()`` dict read at the end of the phase."""
    def get(key: str) -> int | None:
        value = stats.get(key)
        return int(value) if value is not None else None
    return PhaseRecord(phase=phase,
                       peak_allocated_bytes=get("allocated_bytes.all.peak"),
                       peak_reserved_bytes=get("reserved_bytes.all.peak"),
                       peak_active_bytes=get("active_bytes.all.peak"),
                       peak_requested_bytes=get("requested_bytes.all.peak"),
                       peak_device_bytes=device_used_peak_bytes,
                       allocated_bytes=get("allocated_bytes.all.current"),
                       reserved_bytes=get("reserved_bytes.all.current"),
                       inactive_split_bytes=get("inactive_split_bytes.all.peak"),
                       time_s=time_s)


def merge_phase(old: PhaseRecord | None, new: PhaseRecord) -> PhaseRecord:
    """One record per phase per step: with gradient accumulation the micro-batches' phases merge, peaks by max,
    current values from the latest, times summed."""
    if old is None:
        return new
    def peak(name: str) -> int | None:
        values = [v for v in (getattr(old, name), getattr(new, name)) if v is not None]
        return max(values) if values else None
    times = [t for t in (old.time_s, new.time_s) if t is not None]
    return PhaseRecord(phase=new.phase, peak_allocated_bytes=peak("peak_allocated_bytes"),
                       peak_reserved_bytes=peak("peak_reserved_bytes"), peak_active_bytes=peak("peak_active_bytes"),
                       peak_requested_bytes=peak("peak_requested_bytes"), peak_device_bytes=peak("peak_device_bytes"),
                       allocated_bytes=new.allocated_bytes, reserved_bytes=new.reserved_bytes,
                       inactive_split_bytes=peak("inactive_split_bytes"), time_s=sum(times) if times else None)


def step_peaks(phases: list[PhaseRecord]) -> dict[str, int | None]:
    """A step's peaks: the max of its phases' peaks (each phase's peak counts from that phase's start)."""
    out: dict[str, int | None] = {}
    for name in ("peak_allocated_bytes", "peak_reserved_bytes", "peak_active_bytes", "peak_requested_bytes",
                 "peak_device_bytes"):
        values = [getattr(p, name) for p in phases if getattr(p, name) is not None]
        out[name] = max(values) if values else None
    return out


_REQUEST = re.compile(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)")
_UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}


def oom_request_bytes(message: str) -> int | None:
    """Size of the failed allocation from a CUDA OOM message ("Tried to allocate 2.00 GiB"), else None."""
    match = _REQUEST.search(message)
    return int(float(match.group(1)) * _UNITS[match.group(2)]) if match else None


def is_oom(err: BaseException) -> bool:
    """CUDA OOM (torch.OutOfMemoryError) or a host allocation failure (CPU runs, offloaded states)."""
    if type(err).__name__ == "OutOfMemoryError":
        return True
    text = str(err)
    return isinstance(err, (RuntimeError, MemoryError)) and (
        "out of memory" in text.lower() or "can't allocate memory" in text or isinstance(err, MemoryError))


def context_bytes(device_used_bytes: int | None, reserved_bytes: int | None) -> int | None:
    """Driver-level memory the caching allocator does not own (CUDA context, workspaces, NCCL buffers)."""
    if device_used_bytes is None or reserved_bytes is None:
        return None
    return max(0, device_used_bytes - reserved_bytes)


def cap_bytes_to_apply(spec_cap_bytes: int, cap_gib: float | None, cap_fraction: float | None,
                       total_bytes: int | None) -> int | None:
    """The allocator cap a rank applies (None: none): the spec's ``training.memory_cap_bytes`` (what the estimate
    replays under), else ``memory.cap_gib`` / ``memory.cap_fraction``. Both, and different: ValueError (the run
    would not be the spec's)."""
    option = (cap_gib * GIB if cap_gib else cap_fraction * total_bytes if cap_fraction and total_bytes else None)
    option = None if option is None else int(option)
    if spec_cap_bytes and option is not None and option != spec_cap_bytes:
        raise ValueError(f"memory.cap_gib: the spec caps the allocator at {spec_cap_bytes:,} B "
                         f"(training.memory_cap_bytes) and the options at {option:,} B; set one")
    return spec_cap_bytes or option


def cap_fraction(cap_bytes: int | None, total_bytes: int | None) -> float | None:
    """Fraction for ``torch.cuda.set_per_process_memory_fraction`` that caps the allocator at ``cap_bytes``."""
    if cap_bytes is None or not total_bytes:
        return None
    if cap_bytes <= 0:
        raise ValueError(f"memory.cap_gib: must be positive, got {cap_bytes / GIB:g} GiB")
    return min(1.0, cap_bytes / total_bytes)


def to_gib(num_bytes: int | None) -> float | None:
    return None if num_bytes is None else num_bytes / GIB


def host_peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# --------------------------------------------------------------------------------------------- history

SNAPSHOT_SUFFIX = ".snapshot.pickle.gz"
# Events kept by the allocator's ring buffer: a 1B model's step is ~10k events, so several steps fit whole
# (a cold-start trace: the replay needs no reconstruction of earlier state).
HISTORY_MAX_ENTRIES = 2_000_000


def start_allocator_history(torch: Any) -> None:
    """Record every allocator event from now on, without stack frames (the replay needs none; frames would
    make the file 10x larger and the step slower)."""
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                             max_entries=HISTORY_MAX_ENTRIES)


def dump_allocator_history(torch: Any, path: Any) -> int:
    """Write the snapshot (segments + device traces) gzipped, stop recording; returns the file's bytes."""
    import gzip
    import pickle

    data = gzip.compress(pickle.dumps(torch.cuda.memory._snapshot()), compresslevel=6)
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(path, "wb") as handle:
        handle.write(data)
    return len(data)


# --------------------------------------------------------------------------------------------- probe

class MemoryProbe:
    """Reads the allocator and the driver for one device. Usage per phase: ``begin()`` ... ``end(phase)``."""

    def __init__(self, device: Any, *, sample_interval_s: float = 0.0, count_cpu: bool = False) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.enabled = self.device.type == "cuda"
        self.source = "cuda" if self.enabled else "none-cpu"
        self._counter = None
        if not self.enabled and count_cpu:
            from harness.fake.counter import StorageCounter

            self._counter = StorageCounter(round_to=512)
            self.source = "counted-cpu"
        self.device_source: str | None = None
        self._nvml_handle = None
        self._sampler: _Sampler | None = None
        if self.enabled:
            self._nvml_handle = _nvml_handle(self.device)
            if sample_interval_s > 0:
                self._sampler = _Sampler(self.device_used_bytes, sample_interval_s)

    # -- driver level
    def device_used_bytes(self) -> int | None:
        if not self.enabled:
            return None
        used = self._process_used_nvml()  # None before this process has a context, or when NVML cannot see it
        if used is not None:
            self.device_source = "nvml_process"
            return used
        free, total = self.torch.cuda.mem_get_info(self.device)
        self.device_source = self.device_source or "mem_get_info"
        return int(total - free)

    def _process_used_nvml(self) -> int | None:
        if self._nvml_handle is None:
            return None
        try:
            import pynvml

            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(self._nvml_handle):
                if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                    return int(proc.usedGpuMemory)
        except Exception:  # noqa: BLE001 - NVML is optional; any failure falls back to mem_get_info
            return None
        return None

    def total_bytes(self) -> int | None:
        if not self.enabled:
            return None
        return int(self.torch.cuda.get_device_properties(self.device).total_memory)

    # -- allocator
    def stats(self) -> dict[str, Any]:
        return dict(self.torch.cuda.memory_stats(self.device)) if self.enabled else {}

    def synchronize(self) -> None:
        if self.enabled:
            self.torch.cuda.synchronize(self.device)

    @property
    def counting(self) -> bool:
        return self._counter is not None

    def start(self) -> None:
        """Begin counting CPU storages (before the model is built, so its weights count)."""
        if self._counter is not None:
            self._counter.__enter__()

    def begin(self) -> None:
        """Start a phase: peaks now count from the current values."""
        if self._counter is not None:
            self._counter.max_total = self._counter.current
        if not self.enabled:
            return
        self.synchronize()
        self.torch.cuda.reset_peak_memory_stats(self.device)
        if self._sampler:
            self._sampler.reset()

    def end(self, phase: str, time_s: float | None = None) -> PhaseRecord:
        if self._counter is not None:
            return PhaseRecord(phase=phase, peak_allocated_bytes=int(self._counter.max_total),
                               allocated_bytes=int(self._counter.current), time_s=time_s)
        if not self.enabled:
            return PhaseRecord(phase=phase, time_s=time_s)
        self.synchronize()
        used = self.device_used_bytes()
        sampled = self._sampler.peak() if self._sampler else None
        high_water = max(v for v in (used, sampled) if v is not None) if used is not None else sampled
        return phase_from_stats(phase, self.stats(), device_used_peak_bytes=high_water, time_s=time_s)

    def counters(self) -> tuple[int | None, int | None]:
        stats = self.stats()
        if not stats:
            return None, None
        return int(stats.get("num_alloc_retries", 0)), int(stats.get("num_ooms", 0))

    def context_bytes(self) -> int | None:
        if not self.enabled:
            return None
        self.synchronize()
        return context_bytes(self.device_used_bytes(), int(self.torch.cuda.memory_reserved(self.device)))

    def allocated_bytes(self) -> int | None:
        if self._counter is not None:
            return int(self._counter.current)
        return int(self.torch.cuda.memory_allocated(self.device)) if self.enabled else None

    def set_cap(self, cap_bytes: int | None) -> int | None:
        """Cap the caching allocator (the paper's 16 GB V100 on a bigger GPU). Returns the cap applied."""
        fraction = cap_fraction(cap_bytes, self.total_bytes())
        if fraction is None:
            return None
        self.torch.cuda.set_per_process_memory_fraction(fraction, self.device)
        self._capped = True
        return cap_bytes

    def release(self) -> None:
        """After a rank: hand cached blocks back so the next rank's reserved peak is its own, and lift this
        rank's cap (a process reused for the next point, ``launcher.isolation=inprocess``, must not inherit it)."""
        if self.enabled:
            self.torch.cuda.empty_cache()
            self.torch.cuda.reset_peak_memory_stats(self.device)
            if getattr(self, "_capped", False):
                self.torch.cuda.set_per_process_memory_fraction(1.0, self.device)
                self._capped = False

    def reset_counters(self) -> None:
        """Zero the cumulative allocator counters (retries, OOMs) at a rank's start: per point, even when the
        process is reused (a fresh process starts at zero anyway)."""
        if self.enabled:
            self.torch.cuda.reset_accumulated_memory_stats(self.device)

    def close(self) -> None:
        if self._sampler:
            self._sampler.stop()
        if self._counter is not None and self._counter._depth:
            self._counter.__exit__(None, None, None)


def _nvml_handle(device: Any) -> Any | None:
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        index = torch.cuda._get_nvml_device_index(device)  # respects CUDA_VISIBLE_DEVICES
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # noqa: BLE001 - no NVML: mem_get_info is the fallback
        return None


class _Sampler:
    """Background high-water of the driver's used memory between phase boundaries."""

    def __init__(self, read, interval_s: float) -> None:
        self._read = read
        self._interval_s = interval_s
        self._peak: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                value = self._read()
            except Exception:  # noqa: BLE001 - a failed sample is skipped, never fatal
                continue
            with self._lock:
                if value is not None and (self._peak is None or value > self._peak):
                    self._peak = value

    def reset(self) -> None:
        with self._lock:
            self._peak = None

    def peak(self) -> int | None:
        with self._lock:
            return self._peak

    def stop(self) -> None:
        self._stop.set()
