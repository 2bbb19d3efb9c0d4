"""Harness-only options: everything about *how* a point is measured that is not part of the RunSpec.

Plain dataclasses (standard library only). They double as the Hydra structured-config schema of the
non-spec nodes (``conf/``), and travel to the worker as ``harness.json`` next to ``spec.json``.
``validate_options`` raises ``ValueError("<dotted key>: message")`` like ``RunSpec.__post_init__``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

BACKENDS = ("auto", "cuda", "cpu", "fake")
DATA_SOURCES = ("auto", "hub", "file", "synthetic")
ONLINE = ("auto", "true", "false")
PADDINGS = ("max_length", "longest")
# full_rows: only examples that reach seq_len (truncated; no padding inside a row, every token attended);
# full_batches: the paper's protocol, batches whose longest example reaches seq_len; all: every batch;
# packed: consecutive examples concatenated into seq_len rows.
KEEPS = ("full_rows", "full_batches", "all", "packed")
LAUNCH_COMMANDS = ("torchrun", "srun")
ISOLATIONS = ("subprocess", "inprocess", "fork")
INJECT_PHASES = ("forward", "backward", "optimizer")


@dataclass
class ModelOptions:
    # RunSpec.model: a catalogue name, a config.json path (relative to the repo root or cwd) or a hub id.
    name: str = "facebook/opt-125m"
    # Tokenizer to try first (hub id or local dir); None = the model name. Offline, a BPE is trained instead.
    tokenizer: str | None = None
    # Load pretrained weights when reachable (memory depends on shapes, not values; off by default).
    pretrained: bool = False


@dataclass
class DataOptions:
    source: str = "auto"  # auto = hub when online, else `path` when set, else synthetic (recorded as such)
    hub_id: str = "tatsu-lab/alpaca"
    path: str | None = None  # local alpaca_data.json (JSON list) or .jsonl
    online: str = "auto"  # auto = probe the hub once with a short timeout
    tokenizer: str = "auto"  # auto = the model's own when available, else a byte-level BPE; bpe = always BPE
    bpe_vocab_size: int = 8000  # clamped to the model's vocab_size
    padding: str = "max_length"
    keep: str = "full_rows"
    max_records: int = 20000  # records read from the hub/file at most (tokenized lazily, fewer in practice)
    seed: int = 0


@dataclass
class StepsOptions:
    # Adam states appear at the first optimizer step, so the peak is reached at step >= 2: two steps total,
    # peaks recorded per step. Warm-up steps run first and are excluded from the rank summary.
    warmup: int = 0
    measured: int = 2


@dataclass
class MemoryOptions:
    cap_gib: float | None = None  # cap the allocator (set_per_process_memory_fraction), e.g. 16 for the paper
    cap_fraction: float | None = None  # same, as a fraction of the device's memory
    sample_interval_s: float = 0.0  # > 0: also sample driver memory in a background thread
    # CPU runs: count live tensor storages (512-byte blocks, as the CUDA caching allocator rounds) through a
    # dispatch mode, for allocated-level peaks without a GPU (memory_source counted-cpu); slows CPU steps.
    count_cpu: bool = True
    # CUDA runs: record the caching allocator's history (torch.cuda.memory._record_memory_history, no stack
    # frames) from before the rank's first allocation to the end of its last step, and write the snapshot as
    # rank<r>.snapshot.pickle.gz in the run dir: a real trace for `python -m estimator.allocator replay`.
    snapshot: bool = False


@dataclass
class EmulateOptions:
    # N > 1: run ranks of an N-rank job one at a time in one process on a fake process group (one GPU).
    world_size: int | None = None
    enabled: bool = False  # emulate parallel.world_size without setting emulate.world_size
    ranks: list[int] = field(default_factory=lambda: [0, -1])  # negative = from the end (-1 = last rank)


@dataclass
class LauncherOptions:
    name: str = "local"
    command: str = "torchrun"  # torchrun --standalone (one node) | srun torchrun (multi-node, in an allocation)
    nnodes: int = 1
    nproc_per_node: int | None = None  # None = world_size / nnodes
    rdzv_endpoint: str | None = None  # srun: head:port; None = first node of SLURM_JOB_NODELIST
    rdzv_port: int = 29500
    timeout_s: int = 3600
    # subprocess: a fresh `python -m harness.worker` per single-process rank; inprocess: in the launcher (reuses
    # the process: allocator, CUDA context and process state carry over); fork: a fork of the launcher per rank
    # (fresh process state, the launcher's imports inherited: the cheap fresh process; harness/campaign.py)
    isolation: str = "subprocess"
    extra_args: list[str] = field(default_factory=list)


@dataclass
class PathsOptions:
    root_dir: str = "."
    results_dir: str = "runs"
    measurements_dir: str = "data/measurements"
    log_dir: str = "runs/logs"
    cache_dir: str = "~/.cache/llm-memory-estimator"


@dataclass
class HarnessOptions:
    campaign: str = "default"
    backend: str = "auto"
    dry_run: bool = False  # write spec.json / harness.json, run nothing
    rerun_errors: bool = False  # re-run points whose result.json says error/timeout (ok/oom are always kept)
    force: bool = False  # re-run every point
    allow_dirty: bool = True  # false: refuse to measure from a git tree with uncommitted changes
    deepspeed_config: str | None = None  # a user DeepSpeed JSON; replaces the generated one (batch keys set)
    seed: int = 0
    inject_oom: str | None = None  # tests: raise torch.OutOfMemoryError at this phase of the last step
    model: ModelOptions = field(default_factory=ModelOptions)
    data: DataOptions = field(default_factory=DataOptions)
    steps: StepsOptions = field(default_factory=StepsOptions)
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    emulate: EmulateOptions = field(default_factory=EmulateOptions)
    launcher: LauncherOptions = field(default_factory=LauncherOptions)
    paths: PathsOptions = field(default_factory=PathsOptions)

    @property
    def emulated(self) -> bool:
        return self.emulate.enabled or (self.emulate.world_size or 0) > 1


def _fail(key: str, message: str) -> None:
    raise ValueError(f"{key}: {message}")


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(key, f"{value!r} is not one of {', '.join(choices)}")


def validate_options(opts: HarnessOptions) -> HarnessOptions:
    _choice("backend", opts.backend, BACKENDS)
    _choice("data.source", opts.data.source, DATA_SOURCES)
    _choice("data.online", str(opts.data.online).lower(), ONLINE)
    _choice("data.padding", opts.data.padding, PADDINGS)
    _choice("data.keep", opts.data.keep, KEEPS)
    _choice("launcher.command", opts.launcher.command, LAUNCH_COMMANDS)
    _choice("launcher.isolation", opts.launcher.isolation, ISOLATIONS)
    if opts.inject_oom is not None:
        _choice("inject_oom", opts.inject_oom, INJECT_PHASES)
    if opts.data.source == "file" and not opts.data.path:
        _fail("data.path", "data.source=file needs a path to an Alpaca JSON/JSONL file")
    if opts.data.bpe_vocab_size < 300:
        _fail("data.bpe_vocab_size", f"must be at least 300 (256 bytes + merges), got {opts.data.bpe_vocab_size}")
    if opts.steps.warmup < 0:
        _fail("steps.warmup", f"must be >= 0, got {opts.steps.warmup}")
    if opts.steps.measured < 1:
        _fail("steps.measured", f"must be >= 1, got {opts.steps.measured}")
    if opts.steps.warmup + opts.steps.measured < 2:
        _fail("steps.measured", "at least two optimizer steps are needed (Adam states appear at the first)")
    if opts.memory.cap_gib is not None and opts.memory.cap_fraction is not None:
        _fail("memory.cap_fraction", "set memory.cap_gib or memory.cap_fraction, not both")
    if opts.memory.cap_gib is not None and opts.memory.cap_gib <= 0:
        _fail("memory.cap_gib", f"must be positive, got {opts.memory.cap_gib}")
    if opts.memory.cap_fraction is not None and not 0 < opts.memory.cap_fraction <= 1:
        _fail("memory.cap_fraction", f"must be in (0, 1], got {opts.memory.cap_fraction}")
    if opts.emulate.world_size is not None and opts.emulate.world_size < 1:
        _fail("emulate.world_size", f"must be a positive integer, got {opts.emulate.world_size}")
    if not opts.emulate.ranks:
        _fail("emulate.ranks", "name at least one rank (e.g. [0,-1])")
    if opts.launcher.nnodes < 1:
        _fail("launcher.nnodes", f"must be >= 1, got {opts.launcher.nnodes}")
    if opts.launcher.timeout_s <= 0:
        _fail("launcher.timeout_s", f"must be positive, got {opts.launcher.timeout_s}")
    if not opts.campaign or "/" in opts.campaign:
        _fail("campaign", f"must be a non-empty name without '/', got {opts.campaign!r}")
    return opts


def resolve_ranks(ranks: list[int], world_size: int) -> list[int]:
    """Negative ranks count from the end; duplicates dropped. Raises ValueError naming emulate.ranks."""
    out = sorted({r + world_size if r < 0 else r for r in ranks})
    bad = [r for r in out if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"emulate.ranks: {bad} not in 0..{world_size - 1} (world size {world_size})")
    return out


def options_to_dict(opts: HarnessOptions) -> dict[str, Any]:
    return dataclasses.asdict(opts)


def options_from_dict(data: dict[str, Any]) -> HarnessOptions:
    """Rebuild from harness.json; unknown keys are ignored so older workers read newer files."""
    def build(cls: type, values: dict[str, Any]) -> Any:
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in values:
                continue
            value = values[f.name]
            nested = f.default_factory if f.default_factory is not dataclasses.MISSING else None
            if nested is not None and dataclasses.is_dataclass(nested):
                value = build(nested, value or {})
            kwargs[f.name] = value
        return cls(**kwargs)
    return build(HarnessOptions, data)
