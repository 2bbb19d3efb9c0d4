"""Pure memory conversions and the CPU probe (GPU reads are in test_gpu.py)."""

import pytest
import torch

from harness.memory import (
    GIB,
    MemoryProbe,
    cap_bytes_to_apply,
    cap_fraction,
    context_bytes,
    is_oom,
    merge_phase,
    oom_request_bytes,
    phase_from_stats,
    step_peaks,
)
from harness.records import PhaseRecord

STATS = {"allocated_bytes.all.peak": 300, "reserved_bytes.all.peak": 512, "active_bytes.all.peak": 310,
         "requested_bytes.all.peak": 290, "allocated_bytes.all.current": 100, "reserved_bytes.all.current": 512,
         "inactive_split_bytes.all.peak": 7, "num_alloc_retries": 0, "num_ooms": 0}


def test_phase_from_stats_reads_every_peak():
    phase = phase_from_stats("backward", STATS, device_used_peak_bytes=1000, time_s=0.5)
    assert (phase.peak_allocated_bytes, phase.peak_reserved_bytes, phase.peak_active_bytes,
            phase.peak_requested_bytes, phase.peak_device_bytes) == (300, 512, 310, 290, 1000)
    assert (phase.allocated_bytes, phase.reserved_bytes, phase.inactive_split_bytes) == (100, 512, 7)


def test_phase_from_empty_stats_is_none_not_zero():
    assert phase_from_stats("forward", {}, device_used_peak_bytes=None, time_s=None).peak_allocated_bytes is None


def test_merge_phase_takes_max_peaks_latest_current_and_summed_time():
    a = PhaseRecord("forward", peak_allocated_bytes=10, allocated_bytes=5, time_s=1.0)
    b = PhaseRecord("forward", peak_allocated_bytes=8, allocated_bytes=6, time_s=2.0)
    merged = merge_phase(a, b)
    assert (merged.peak_allocated_bytes, merged.allocated_bytes, merged.time_s) == (10, 6, 3.0)
    assert merge_phase(None, b) is b


def test_step_peaks_is_max_over_phases():
    peaks = step_peaks([PhaseRecord("forward", peak_allocated_bytes=3), PhaseRecord("backward", peak_allocated_bytes=9)])
    assert peaks["peak_allocated_bytes"] == 9 and peaks["peak_reserved_bytes"] is None


def test_context_and_cap():
    assert context_bytes(1000, 400) == 600
    assert context_bytes(None, 400) is None
    assert context_bytes(100, 400) == 0
    assert cap_fraction(16 * GIB, 80 * GIB) == pytest.approx(0.2)
    assert cap_fraction(None, 80 * GIB) is None
    assert cap_fraction(200 * GIB, 80 * GIB) == 1.0


def test_the_cap_a_rank_applies_is_the_specs_else_the_options():
    assert cap_bytes_to_apply(0, None, None, 80 * GIB) is None
    assert cap_bytes_to_apply(0, 16, None, 80 * GIB) == 16 * GIB
    assert cap_bytes_to_apply(0, None, 0.25, 80 * GIB) == 20 * GIB
    assert cap_bytes_to_apply(3 * GIB, None, None, 80 * GIB) == 3 * GIB
    assert cap_bytes_to_apply(16 * GIB, 16, None, 80 * GIB) == 16 * GIB  # the same cap twice
    with pytest.raises(ValueError, match="^memory.cap_gib: the spec caps"):
        cap_bytes_to_apply(3 * GIB, 16, None, 80 * GIB)


def test_oom_classification_and_request_size():
    message = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.1 GiB"
    assert oom_request_bytes(message) == 2 * GIB
    assert oom_request_bytes("no size here") is None
    assert is_oom(torch.OutOfMemoryError(message))
    assert is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))
    assert not is_oom(RuntimeError("shape mismatch"))


def test_cpu_probe_counts_live_storages_in_allocator_blocks():
    import torch

    probe = MemoryProbe("cpu", count_cpu=True)
    probe.start()
    try:
        kept = torch.empty(1000, dtype=torch.float32)  # 4000 B -> one 4096 B block
        probe.begin()
        temp = torch.empty(100, dtype=torch.float32)  # 400 B -> 512 B, freed within the phase
        del temp
        meta = torch.empty(10**9, device="meta")  # no memory
        phase = probe.end("forward", 0.1)
    finally:
        probe.close()
    assert probe.source == "counted-cpu" and probe.counting and not probe.enabled
    assert (phase.allocated_bytes, phase.peak_allocated_bytes) == (4096, 4096 + 512)
    assert phase.peak_reserved_bytes is None and phase.peak_device_bytes is None
    assert kept.numel() and meta.numel()


def test_cpu_probe_without_counting_reports_nothing_and_says_so():
    probe = MemoryProbe("cpu")
    probe.begin()
    phase = probe.end("forward", 0.1)
    assert probe.source == "none-cpu" and not probe.enabled
    assert phase.peak_allocated_bytes is None and phase.time_s == 0.1
    assert probe.context_bytes() is None and probe.counters() == (None, None)
    assert probe.set_cap(16 * GIB) is None


def test_gpu_keys_come_from_the_catalogue_and_unknown_boards_get_their_own():
    from harness.environment import normalize_gpu_name

    assert normalize_gpu_name("NVIDIA H100 80GB HBM3", 85_045_149_696) == "h100-80gb"
    assert normalize_gpu_name("Tesla V100-SXM2-16GB", 16_945_512_448) == "v100-16gb"
    assert normalize_gpu_name("NVIDIA RTX A6000", 51_041_271_808) == "rtxa6000-48gb"
    assert normalize_gpu_name("cpu", 0) == "cpu"


def test_allocator_history_is_recorded_without_frames_and_written_as_a_loadable_gzip(tmp_path):
    """memory.snapshot: what the worker asks of torch's recorder, and a file `estimator.allocator replay` reads."""
    from types import SimpleNamespace

    from estimator.allocator.snapshot import check_snapshot, load_snapshot
    from harness.memory import dump_allocator_history, start_allocator_history

    calls = []
    snapshot = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 0, "size": 512, "stream": 0}]]}
    memory = SimpleNamespace(_record_memory_history=lambda **kw: calls.append(kw), _snapshot=lambda: snapshot)
    fake_torch = SimpleNamespace(cuda=SimpleNamespace(memory=memory))
    start_allocator_history(fake_torch)
    assert calls[0]["enabled"] == "all" and calls[0]["context"] is None and calls[0]["max_entries"] > 100_000
    path = tmp_path / "rank0.snapshot.pickle.gz"
    assert dump_allocator_history(fake_torch, path) == path.stat().st_size
    assert calls[1] == {"enabled": None}  # recording stops once the file is written
    assert check_snapshot(load_snapshot(str(path)))["device_traces"] == snapshot["device_traces"]


def test_a_cpu_run_asked_for_a_snapshot_writes_none(tmp_path):
    from types import SimpleNamespace

    from harness.worker import _start_history

    probe = SimpleNamespace(enabled=False)
    opts = SimpleNamespace(memory=SimpleNamespace(snapshot=True))
    assert _start_history(probe, opts, tmp_path, 0) is None
