"""Record schema: what a rank writes (``rank<r>.json``), what a run merges to (``result.json``), and the tidy
table row (one per run x rank) that ``calibrate`` reads with pandas.

Plain dataclasses, JSON in and out, no torch. All memory is in bytes (ints) and times in seconds; ``None`` means
"not measured" (CPU runs, emulated throughput), never zero-by-default.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1
PHASES = ("forward", "backward", "optimizer")
# A run's status. ok and oom are data; error and timeout are harness/infrastructure failures.
STATUSES = ("ok", "oom", "error", "timeout")
FINISHED_STATUSES = ("ok", "oom", "error", "timeout")
# Peak fields kept per phase, per step and per rank (max over the finer level).
PEAK_FIELDS = ("peak_allocated_bytes", "peak_reserved_bytes", "peak_active_bytes", "peak_requested_bytes",
               "peak_device_bytes")


@dataclass
class PhaseRecord:
    """Memory over one phase of one step: peaks since the phase began, current values when it ended."""

    phase: str
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    peak_active_bytes: int | None = None
    peak_requested_bytes: int | None = None
    # Driver-level used memory (NVML per-process or mem_get_info), sampled: the high-water of the samples.
    peak_device_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    inactive_split_bytes: int | None = None
    time_s: float | None = None


@dataclass
class StepRecord:
    step: int
    warmup: bool
    phases: list[PhaseRecord] = field(default_factory=list)
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    peak_active_bytes: int | None = None
    peak_requested_bytes: int | None = None
    peak_device_bytes: int | None = None
    num_alloc_retries: int | None = None
    num_ooms: int | None = None
    step_time_s: float | None = None
    tokens: int = 0
    tokens_per_s: float | None = None
    seq_len_max: int = 0
    loss: float | None = None

    def phase(self, name: str) -> PhaseRecord | None:
        return next((p for p in self.phases if p.phase == name), None)


@dataclass
class RankRecord:
    """Everything one rank measured. ``emulated``: a rank of an N-rank job run alone on a fake process group
    (allocations real, collectives no-ops: no throughput, no NCCL buffers)."""

    rank: int
    world_size: int
    status: str
    spec_id: str = ""
    run_id: str = ""
    emulated: bool = False
    # real_run | emulated_fake_pg | fake_tensor_trace
    measured_by: str = "real_run"
    # cuda | counted-cpu | none-cpu | fake_tensor_trace
    memory_source: str = "cuda"
    # Where the rank ran: Slurm's node name under srun/sbatch, else the host name (multi-node runs).
    node: str | None = None
    error: str | None = None
    traceback: str | None = None
    oom_step: int | None = None  # -1: during setup (model build / wrap)
    oom_phase: str | None = None
    oom_request_bytes: int | None = None  # the allocation that failed ("Tried to allocate ..."), when known
    steps: list[StepRecord] = field(default_factory=list)
    # Max over measured (non-warm-up) steps; None when nothing was measured.
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    peak_active_bytes: int | None = None
    peak_requested_bytes: int | None = None
    peak_device_bytes: int | None = None
    peak_forward_allocated_bytes: int | None = None
    peak_backward_allocated_bytes: int | None = None
    peak_optimizer_allocated_bytes: int | None = None
    # Allocated after model build + method wrap, before the first step (model states minus optimizer states).
    setup_allocated_bytes: int | None = None
    # Driver used minus allocator reserved: right after CUDA init, and after the first (warm-up) step.
    cuda_context_bytes: int | None = None
    cuda_context_after_warmup_bytes: int | None = None
    num_alloc_retries: int | None = None
    num_ooms: int | None = None
    device_total_bytes: int | None = None
    memory_cap_bytes: int | None = None
    host_peak_rss_bytes: int | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    effective_attn: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # Backend-specific detail kept verbatim (e.g. the fake-tensor trace's breakdown at the peak).
    extra: dict[str, Any] = field(default_factory=dict)
    setup_time_s: float | None = None
    schema_version: int = SCHEMA_VERSION

    def finalize(self) -> RankRecord:
        """Fill the rank-level summary from the steps (pure; idempotent)."""
        summary = summarize_steps(self.steps)
        for key, value in summary.items():
            setattr(self, key, value)
        return self


@dataclass
class RunRecord:
    """The merged result of one point: max over the measured ranks. Written last (it marks the point done)."""

    spec_id: str
    run_id: str
    campaign: str
    gpu_key: str
    status: str
    world_size: int
    ranks: list[int] = field(default_factory=list)
    rank_status: dict[str, str] = field(default_factory=dict)
    emulated: bool = False
    measured_by: str = "real_run"
    memory_source: str = "cuda"
    worst_rank: int | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    peak_active_bytes: int | None = None
    peak_requested_bytes: int | None = None
    peak_device_bytes: int | None = None
    cuda_context_bytes: int | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    error: str | None = None
    stderr_tail: str | None = None
    returncode: int | None = None
    variant: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    started_at: str | None = None
    finished_at: str | None = None
    duration_s: float | None = None
    schema_version: int = SCHEMA_VERSION


# --------------------------------------------------------------------------------------------- pure helpers

def max_or_none(values) -> int | float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def summarize_steps(steps: list[StepRecord]) -> dict[str, Any]:
    """Rank summary over measured steps (warm-up steps excluded, unless only warm-up steps exist)."""
    measured = [s for s in steps if not s.warmup] or list(steps)
    summary: dict[str, Any] = {name: max_or_none(getattr(s, name) for s in measured) for name in PEAK_FIELDS}
    for phase in PHASES:
        summary[f"peak_{phase}_allocated_bytes"] = max_or_none(
            (s.phase(phase).peak_allocated_bytes if s.phase(phase) else None) for s in measured)
    summary["num_alloc_retries"] = max_or_none(s.num_alloc_retries for s in steps)
    summary["num_ooms"] = max_or_none(s.num_ooms for s in steps)
    timed = [s for s in measured if s.step_time_s]
    summary["step_time_s"] = (sum(s.step_time_s for s in timed) / len(timed)) if timed else None
    rates = [s.tokens_per_s for s in measured if s.tokens_per_s is not None]
    summary["tokens_per_s"] = (sum(rates) / len(rates)) if rates else None
    return summary


def merge_status(rank_statuses: list[str]) -> str:
    """One OOM rank makes the run an OOM (data); otherwise any failure is an error; all ok is ok."""
    if not rank_statuses:
        return "error"
    if "oom" in rank_statuses:
        return "oom"
    if all(s == "ok" for s in rank_statuses):
        return "ok"
    return "timeout" if "timeout" in rank_statuses else "error"


def merge_ranks(records: list[RankRecord], *, spec_id: str, run_id: str, campaign: str, gpu_key: str,
                world_size: int, expected_ranks: list[int]) -> RunRecord:
    """Merge per-rank records: peaks are max over ranks; missing expected ranks count as errors."""
    by_rank = {r.rank: r for r in records}
    statuses = {str(r): (by_rank[r].status if r in by_rank else "missing") for r in expected_ranks}
    # A rank killed by torchrun after another rank's OOM is missing, not an error of its own: oom wins.
    status = merge_status([s if s != "missing" else "error" for s in statuses.values()])
    first = records[0] if records else None
    run = RunRecord(spec_id=spec_id, run_id=run_id, campaign=campaign, gpu_key=gpu_key, status=status,
                    world_size=world_size, ranks=sorted(by_rank), rank_status=statuses,
                    emulated=bool(first and first.emulated),
                    measured_by=first.measured_by if first else "real_run",
                    memory_source=first.memory_source if first else "none")
    for name in PEAK_FIELDS + ("cuda_context_bytes", "step_time_s"):
        setattr(run, name, max_or_none(getattr(r, name) for r in records))
    # Job throughput is limited by the slowest rank; report that rank's tokens/s times the data-parallel ranks
    # elsewhere (calibrate knows dp); here the minimum over ranks is the honest per-rank figure.
    rates = [r.tokens_per_s for r in records if r.tokens_per_s is not None]
    run.tokens_per_s = min(rates) if rates else None
    if run.peak_allocated_bytes is not None:
        run.worst_rank = max(records, key=lambda r: r.peak_allocated_bytes or -1).rank
    errors = [f"rank {r.rank}: {r.error}" for r in records if r.error]
    run.error = "; ".join(errors)[:2000] or None
    run.notes = sorted({note for r in records for note in r.notes})
    return run


# --------------------------------------------------------------------------------------------- JSON

def to_dict(record: Any) -> dict[str, Any]:
    return dataclasses.asdict(record)


def to_json(record: Any) -> str:
    return json.dumps(to_dict(record), indent=2, sort_keys=True)


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def rank_from_dict(data: dict[str, Any]) -> RankRecord:
    _check_version(data)
    steps = [StepRecord(**{**_known(StepRecord, s), "phases": [PhaseRecord(**_known(PhaseRecord, p))
                                                              for p in s.get("phases", [])]})
             for s in data.get("steps", [])]
    return RankRecord(**{**_known(RankRecord, data), "steps": steps})


def run_from_dict(data: dict[str, Any]) -> RunRecord:
    _check_version(data)
    return RunRecord(**_known(RunRecord, data))


def _check_version(data: dict[str, Any]) -> None:
    version = data.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise ValueError(f"schema_version: record schema {version} is not supported (this build reads "
                         f"{SCHEMA_VERSION})")
