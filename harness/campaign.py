"""GPU campaigns in chunks: ``python -m harness.campaign`` runs named chunks of harness points against a
wall-clock deadline, cheaply, resumably, and packs what it measured for the trip back from a lent GPU machine.

```
python -m harness.campaign list                                   # chunks, point counts, estimated minutes
python -m harness.campaign points CHUNK...                        # every point of the chunks, with its estimate
python -m harness.campaign run CHUNK|all... --budget-s 450 --out DIR [--work DIR] [--isolation fork]
python -m harness.campaign merge DIR_OR_TAR... [--data data/measurements] [--runs runs]
```

**Chunks** (``campaigns/chunks.yaml``): a chunk names an experiment file (``conf/experiment/``: campaign, protocol)
and one or more grids in Hydra sweep syntax. Points are expanded exactly as a Hydra multirun would
(``BasicSweeper.split_arguments``), composed with ``harness.sweep.JobComposer`` (one per process; a plain
``model=<choice>`` is merged into a cached composition instead of composing again: tested equal) and converted
and planned with ``harness.config.to_run`` / ``harness.launch.plan_point``: a chunk point is the same point as
``python -m harness -m experiment=X <grid>`` (same spec, same run id). ``all`` is every chunk marked ``queue``,
in file order (the priority order).

**Run.** For each point, in order:

* skipped when done: its ``result.json`` in the work dir (a warm machine), or its ``run_id`` already in the
  committed table ``data/measurements/<gpu-key>/<campaign>.csv`` (a fresh machine: the working tree travels with
  the tables), ok / oom always, error / timeout unless ``--rerun-errors``;
* skipped when a smaller micro-batch of the same series (every other override equal) ran out of memory
  (``beyond-oom``: the OOM boundary is already measured; list micro-batches in ascending order);
* skipped when two points of the same method in the chunk already ended in ``error`` / ``timeout`` (a broken
  path must not eat the GPU minutes: ``failing-method``);
* **not started** when ``now + estimate x drift > deadline`` (``left``): the sweep resumes there next time.
  ``drift`` is the running median of measured / estimated seconds of this call's points (1.25 until known);
* otherwise run by ``harness.launch.run_point`` (skip, atomic writes, OOM as data, merge, table upsert are
  the harness's own), with ``launcher.timeout_s = min(--point-timeout-s, deadline + 60 s - now)``. A point
  killed by that budget timeout (not by ``--point-timeout-s``) is ``cut``: its ``result.json`` is removed so it
  runs again, and it is not shipped.

**Cost per point.** ``launcher.isolation=fork`` (default): every rank runs in a fork of this process, which
imported torch, transformers, the chunk's model classes, the harness and (when the chunk needs it and a test
fork shows CUDA still works after it) DeepSpeed *before* any CUDA use, so a rank pays ~1-2 s (fork + its own
CUDA context) instead of ~6-8 s of interpreter + imports. The child is a fresh process for everything that
matters to the numbers (CUDA context, caching allocator, memory cap, process group, DeepSpeed patches), so
records are the ones a subprocess writes. If CUDA was initialised here, or a test fork cannot use the GPU, the
runner falls back to ``subprocess``. ``estimate_point_s`` is the per-point time model (documented there).

**Output** (``--out``, e.g. the device tool's ``$OUT``, which returns at most 8 files, 2 folders deep): the run
directories go to ``<work>/runs`` and are appended to ``<out>/runs.tar`` after every point (a kill loses
nothing that finished); ``<out>/summary.jsonl`` gets one line per point run; at the end ``runs.tar`` also
receives ``measurements/<gpu-key>/<campaign>.csv``, the tidy rows of this call's points. ``merge`` (on the
development machine) re-derives the rows from the run directories with ``harness.table.rank_rows`` (the
function the launcher uses), upserts them into ``data/measurements/<gpu-key>/<campaign>.csv`` (by run id),
updates ``<campaign>.meta.json`` and copies the run directories into ``runs/``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import json
import os
import shutil
import signal
import statistics
import sys
import tarfile
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = REPO_ROOT / "conf"
CHUNKS_FILE = REPO_ROOT / "campaigns" / "chunks.yaml"
DEFAULT_WORK = Path(os.environ.get("TMPDIR", "/tmp")) / "llmem-campaign"
MB_KEY = "training.micro_batch_size"
GRACE_S = 60.0  # a point may overrun the deadline by this much before it is cut
DEFAULT_DRIFT = 1.25
LOG_TAIL_BYTES = 64 * 1024  # worker.log is shipped trimmed to its end
EXIT_USAGE = 2


# --------------------------------------------------------------------------------------------- chunks

@dataclass
class Chunk:
    name: str
    experiment: str
    sweeps: list[dict[str, Any]]
    about: str = ""
    queue: bool = True
    overrides: list[str] = field(default_factory=list)


@dataclass
class Job:
    chunk: str
    overrides: list[str]  # the point's own overrides, experiment first (what a Hydra multirun job gets)

    @property
    def micro_batch(self) -> int | None:
        for item in self.overrides:
            if item.startswith(MB_KEY + "="):
                return int(item.split("=", 1)[1])
        return None

    @property
    def series(self) -> tuple[str, ...]:
        """The point without its micro-batch: points of a series differ only in micro-batch."""
        return (self.chunk, *sorted(o for o in self.overrides if not o.startswith(MB_KEY + "=")))


def load_chunks(path: Path | str = CHUNKS_FILE) -> list[Chunk]:
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    chunks = []
    for entry in data.get("chunks") or []:
        unknown = set(entry) - {"name", "experiment", "sweeps", "about", "queue", "overrides"}
        if unknown:
            raise ValueError(f"{path}: chunk {entry.get('name')!r}: unknown keys {sorted(unknown)}")
        chunks.append(Chunk(name=entry["name"], experiment=entry["experiment"], sweeps=list(entry["sweeps"]),
                            about=entry.get("about", ""), queue=entry.get("queue", True),
                            overrides=list(entry.get("overrides") or [])))
    names = [c.name for c in chunks]
    if len(names) != len(set(names)):
        raise ValueError(f"{path}: duplicate chunk names")
    return chunks


def select_chunks(chunks: list[Chunk], names: list[str]) -> list[Chunk]:
    """Chunks by name, ``all`` = the queued ones in file order; duplicates dropped, order kept."""
    by_name = {c.name: c for c in chunks}
    out: list[Chunk] = []
    for name in names:
        picked = [c for c in chunks if c.queue] if name == "all" else [by_name.get(name)]
        if picked == [None]:
            raise ValueError(f"chunk {name!r}: not in the chunk file (known: {', '.join(by_name)}, all)")
        out += [c for c in picked if c not in out]
    return out


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(_value(v) for v in value) + "]"
    return str(value)


def expand_chunk(chunk: Chunk) -> list[Job]:
    """Every point of the chunk as Hydra's BasicSweeper would launch it; within a series, ascending
    micro-batch (stable otherwise), so the OOM boundary stops the series early."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    jobs: list[Job] = []
    for sweep in chunk.sweeps:
        arguments = [f"experiment={chunk.experiment}", *chunk.overrides,
                     *(f"{key}={_value(value)}" for key, value in sweep.items())]
        overrides = parser.parse_overrides(arguments)
        jobs += [Job(chunk.name, list(job)) for batch in BasicSweeper.split_arguments(overrides, None)
                 for job in batch]
    first_seen: dict[tuple[str, ...], int] = {}
    for index, job in enumerate(jobs):
        first_seen.setdefault(job.series, index)
    order = sorted(range(len(jobs)), key=lambda i: (first_seen[jobs[i].series], jobs[i].micro_batch or 0, i))
    return [jobs[i] for i in order]


@contextlib.contextmanager
def hydra_context():
    """Hydra initialised on conf/ for the rest of the process (reused when a caller, e.g. the tests, did it)."""
    from hydra.core.global_hydra import GlobalHydra

    import harness.config  # noqa: F401 - registers the schema and the resolver

    if not GlobalHydra.instance().is_initialized():
        from hydra import initialize_config_dir

        initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3")  # for the process (composer())
    yield


# --------------------------------------------------------------------------------------------- planning

@dataclass
class Planned:
    job: Job
    spec: Any  # RunSpec
    opts: Any  # HarnessOptions (as composed; plan_point resolves a copy)
    point: Any  # harness.launch.Point
    estimate_s: float
    fits: bool | None = None  # the estimator's prediction (list/points with --gpu), None when unknown

    @property
    def label(self) -> str:
        s, t = self.spec, self.spec.training
        ws = f"ws{s.parallel.world_size}" + (f"/tp{s.parallel.tp}" if s.parallel.tp > 1 else "")
        extras = [t.precision, t.attn, "ckpt" if t.grad_ckpt else "nockpt"]
        if t.lora_rank:
            extras.append(f"lora{t.lora_rank}" + (f"-dropout{t.lora_dropout:g}" if t.lora_dropout else ""))
        if t.ce != "standard":
            extras.append(f"ce-{t.ce}" + (str(t.ce_chunks) if t.ce == "chunked" else ""))
        if t.activation_offload:
            extras.append("offload")
        if t.ckpt_policy:
            extras.append(t.ckpt_policy)
        if self.opts.memory.cap_gib:
            extras.append(f"cap{self.opts.memory.cap_gib:g}G")
        return (f"{short_model(s.model)} {s.parallel.method} {ws} mb{t.micro_batch_size} seq{t.seq_len} "
                + " ".join(extras))


def short_model(model: str) -> str:
    return model.rsplit("/", 1)[-1]


_COMPOSER: Any = None


def composer() -> Any:
    """One ``harness.sweep.JobComposer`` per process (compositions are cached across chunks), whose cached
    compositions drop the ``hydra`` node: ``to_run`` ignores it, and copying it per point cost 3x the rest."""
    global _COMPOSER
    from harness.sweep import JobComposer

    class LeanComposer(JobComposer):
        def compose(self, job: list[str]) -> Any:
            from hydra.types import RunMode
            from omegaconf import OmegaConf, open_dict

            from harness.config import ModelConf

            overrides = self.parser.parse_overrides(job)
            model_file = _plain_model_choice(overrides)
            if model_file is not None:  # compose with the default model, then put the chosen one in its place
                job = [o.input_line for o in overrides if o.key_or_group != "model"]
                overrides = [o for o in overrides if o.key_or_group != "model"]
            structural = tuple(o.input_line for o in overrides if not self._is_plain(o))
            if structural not in self._cache:
                cfg = self.loader.load_configuration(config_name=self.config_name, overrides=list(structural),
                                                     run_mode=RunMode.MULTIRUN)
                with open_dict(cfg):
                    del cfg["hydra"]
                self._cache[structural] = cfg
            cfg = super().compose(job)
            if model_file is not None:
                cfg.model = OmegaConf.merge(OmegaConf.structured(ModelConf), OmegaConf.load(model_file))
            return cfg

    if _COMPOSER is None:
        _COMPOSER = LeanComposer("measure")
    return _COMPOSER


def _plain_model_choice(overrides: list[Any]) -> Path | None:
    """``conf/model/<choice>.yaml`` when the job picks a model with a plain ``model=<choice>`` and both that file
    and the job's experiment make the shortcut exact (the model file: no defaults list, no package header; the
    experiment: no ``model`` node of its own; the job: no ``model.<key>`` override). Hydra merges such a group file into ``model`` and nothing else, so
    merging it over the schema defaults gives the same config, and the chunk needs one composition per
    (experiment, method, ...) instead of one per model too (each Hydra composition costs ~0.2-0.7 s)."""
    choice = experiment = None
    for o in overrides:
        if o.key_or_group.startswith("model."):  # merged after them, the group file would undo them
            return None
        if o.package is not None or o.is_add() or o.is_delete() or o.is_force_add():
            continue
        if o.key_or_group == "model":
            choice = o.value()
        elif o.key_or_group == "experiment":
            experiment = o.value()
    if not isinstance(choice, str):
        return None
    path = CONF_DIR / "model" / f"{choice}.yaml"
    if not path.is_file() or not _plain_group_file(path):
        return None
    if experiment is not None:
        import yaml

        exp_path = CONF_DIR / "experiment" / f"{experiment}.yaml"
        if not exp_path.is_file() or "model" in (yaml.safe_load(exp_path.read_text()) or {}):
            return None
    return path


def _plain_group_file(path: Path) -> bool:
    import yaml

    text = path.read_text()
    return "@package" not in text and "defaults" not in (yaml.safe_load(text) or {})


def plan_jobs(jobs: list[Job], runner_overrides: list[str], *, device: Any, check_device: bool = True,
              isolation: str = "fork") -> tuple[list[Planned], list[tuple[Job, str]]]:
    """Compose, convert and plan every job (no torch). Returns (planned points, [(job, one-line error)])."""
    from harness.config import to_run
    from harness.launch import plan_point

    planned, invalid = [], []
    with hydra_context():
        composer_ = composer()
        for job in jobs:
            try:
                spec, opts = to_run(composer_.compose([*job.overrides, *runner_overrides]))
                point = plan_point(spec, opts, device, check_data=False, check_device=check_device)
                planned.append(Planned(job, spec, opts, point, estimate_point_s(point, isolation)))
            except ValueError as err:
                invalid.append((job, str(err)))
    return planned, invalid


def predict_fits(planned: list[Planned]) -> None:
    """Fill ``fits`` from the estimator (shipped/cached profiles only; a memory cap is compared with the
    predicted reserved peak, as the allocator enforces it). Needs a known ``spec.gpu`` (``--gpu``)."""
    from estimator import estimate

    for p in planned:
        try:
            est = estimate(p.spec, allow_build=False)
        except Exception:  # noqa: BLE001 - no profile, unknown GPU: no prediction
            continue
        cap = p.point.opts.memory.cap_gib
        p.fits = est.peak_reserved_bytes <= cap * 1024**3 if cap else bool(est.fits)


def expected_points(planned: list[Planned]) -> list[Planned]:
    """The points a run would start when the OOM boundary falls where the estimator predicts it."""
    stopped: set[tuple[str, ...]] = set()
    out = []
    for p in planned:
        if p.job.series in stopped and p.job.micro_batch is not None:
            continue
        out.append(p)
        if p.fits is False:
            stopped.add(p.job.series)
    return out


# --------------------------------------------------------------------------------------------- time model

# Per-point time model (seconds), for the budget and for sizing chunks. Constants are first guesses for an
# H100/H200 host (16 cores) from what was measured on the 2-core CPU machine, scaled; the runner prints
# measured / estimated per point and corrects with the running median (drift), and campaigns/gpu_session.md
# says how to refit them after the first GPU call.
POINT_OVERHEAD_S = 0.5  # plan, env.json, merge, table upsert, tar append (launcher side)
RANK_START_S = {"fork": 1.5, "subprocess": 7.0, "inprocess": 0.3}  # fork/interpreter+imports, CUDA context
DEEPSPEED_IMPORT_S = {"fork": 0.0, "subprocess": 3.0, "inprocess": 0.0}  # preloaded unless subprocess
DATA_S_PER_TOKEN = 5e-6  # synthetic records + BPE + tokenization, per token generated (all dp ranks' rows)
BUILD_S = (0.5, 0.8)  # model build on the device: a + b x billions of parameters
FLOPS_PER_S = {"fp32": 40e12, "amp_bf16": 150e12, "amp_fp16": 150e12, "bf16": 220e12, "mixed_bf16": 200e12,
               "mixed_fp16": 200e12}
STEP_FLOOR_S = (0.05, 0.004)  # per step: a + b x layers (launch-bound small models, optimizer, probe syncs)
OFFLOAD_S_PER_PARAM = 6e-9  # torch AdamW on the CPU partition, per step
GATED_MLP = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo", "olmo2")


def approx_params(arch: Any) -> float:
    """Parameter count from the config (attention with GQA, gated or plain MLP, embeddings): +-5%, for time."""
    h, layers = arch.hidden_size, arch.num_layers
    q = arch.num_heads * arch.head_dim
    attention = 2 * h * q + 2 * h * arch.num_kv_heads * arch.head_dim
    mlp = (3 if arch.model_type in GATED_MLP else 2) * h * arch.ffn_size
    embeddings = arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2)
    return layers * (attention + mlp) + embeddings


def _wrap_s(method: str, billions: float, layers: int) -> float:
    # fsdp1: measured on an H100 (session 19), 30-45 s per 4-8-rank Llama-3.2-1B point where 8 s was estimated:
    # FlatParameter construction over the whole model on each rank
    return {"single": 0.0, "ddp": 0.3, "fsdp": 0.3 + 0.02 * layers,
            "fsdp1": 1.5 + 4.5 * billions, "tp": 0.5 + 0.03 * layers,
            "dp_tp": 0.8 + 0.04 * layers, "zero1": 1.5 + 0.5 * billions, "zero2": 1.5 + 0.5 * billions,
            "zero3": 2.0 + 1.0 * billions, "zero_offload": 2.0 + 3.0 * billions}.get(method, 1.0)


def estimate_point_s(point: Any, isolation: str = "fork") -> float:
    """Seconds one point takes, launcher included:

    ``overhead + ranks x (start + [deepspeed import] + data + build + wrap + steps x step)`` with
    ``data = DATA_S_PER_TOKEN x mb x seq x steps x dp``, ``build = a + b x P`` (P in billions),
    ``step = floor(layers) + flops / FLOPS_PER_S[precision] (+ CPU AdamW for offload)``,
    ``flops = 6 x P_rank x tokens x (4/3 with checkpointing; 2/3 for LoRA) + 12 x layers x seq^2 x hidden x mb
    / tp (x1.5 for eager attention)``, P_rank = P / tp (FSDP and ZeRO compute every layer on every rank).
    """
    from estimator.models.arch import arch_from_config
    from harness.models import load_model_config

    spec, opts = point.spec, point.opts
    t, parallel = spec.training, spec.parallel
    try:
        arch = arch_from_config(load_model_config(spec.model), spec.model)
        params = approx_params(arch)
        layers, hidden = arch.num_layers, arch.hidden_size
    except (ValueError, OSError):
        params, layers, hidden = 1e9, 24, 2048
    billions = params / 1e9
    steps = opts.steps.warmup + opts.steps.measured
    ranks = max(1, len(point.expected_ranks))
    tokens = t.micro_batch_size * t.seq_len * t.grad_accum_steps
    start = RANK_START_S.get(isolation, 7.0)
    if parallel.zero_stage:
        start += DEEPSPEED_IMPORT_S.get(isolation, 3.0)
    if opts.backend == "fake":  # CPU trace: no device, slow fake kernels; a rough guess
        return POINT_OVERHEAD_S + ranks * (start + 5.0 + 4.0 * billions)
    data = DATA_S_PER_TOKEN * tokens * steps * parallel.dp
    build = BUILD_S[0] + BUILD_S[1] * billions
    flops = 6 * params / parallel.tp * tokens * (4 / 3 if t.grad_ckpt else 1) * (2 / 3 if t.lora_rank else 1)
    flops += (12 * layers * t.seq_len**2 * hidden * t.micro_batch_size / parallel.tp
              * (1.5 if t.attn == "eager" else 1))
    step = STEP_FLOOR_S[0] + STEP_FLOOR_S[1] * layers + flops / FLOPS_PER_S.get(t.precision, 150e12)
    if parallel.method == "zero_offload" or parallel.zero.offload_optimizer:
        step += OFFLOAD_S_PER_PARAM * params / parallel.dp
    per_rank = start + data + build + _wrap_s(parallel.method, billions, layers) + steps * step
    return POINT_OVERHEAD_S + ranks * per_rank


# --------------------------------------------------------------------------------------------- preload

def _in_child(fn: Callable[[], Any], timeout_s: float = 120.0) -> bool:
    """Run ``fn`` in a forked child; True when it returned normally (child output goes to stderr)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn()
            code = 0
        except BaseException:  # noqa: BLE001 - reported, the parent only needs the verdict
            traceback.print_exc()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return False
        time.sleep(0.05)


def _cuda_probe() -> None:
    import torch

    x = torch.ones(256, 256, device="cuda")
    assert float((x @ x).sum()) == 256.0**3


def _deepspeed_probe() -> None:
    importlib.import_module("deepspeed")
    if not _in_child(_cuda_probe):
        raise RuntimeError("CUDA fails in a fork after `import deepspeed`")


class Preloader:
    """Imports the worker's modules in this (launcher) process before any fork, without touching CUDA."""

    def __init__(self, cuda: bool, log: Callable[[str], None] = print) -> None:
        self.cuda = cuda
        self.log = log
        self.models: set[str] = set()
        self.deepspeed: bool | None = None  # None: not tried
        self.fork_ok: bool | None = None

    def base(self) -> None:
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # is_available() through NVML: fork-safe
        t0 = time.perf_counter()
        for name in ("torch", "transformers", "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
                     "torch.testing._internal.distributed.fake_pg", "harness.worker", "harness.data",
                     "harness.memory", "harness.distributed", "harness.methods.single", "harness.methods.ddp",
                     "harness.methods.fsdp", "harness.methods.fsdp1", "harness.methods.tp"):
            try:
                importlib.import_module(name)
            except Exception as err:  # noqa: BLE001 - a missing optional module is imported by the child
                self.log(f"preload: {name}: {type(err).__name__}: {err}")
        self.log(f"preload: torch, transformers, harness in {time.perf_counter() - t0:.1f} s")

    def for_points(self, planned: list[Planned]) -> None:
        from estimator.profiler.build import build_model
        from estimator.spec import TrainingSpec
        from harness.models import load_model_config

        for model in sorted({p.spec.model for p in planned} - self.models):
            self.models.add(model)
            try:  # a 1-layer build on the meta device imports the model's modeling module (no memory, no CUDA)
                build_model(load_model_config(model), TrainingSpec(precision="fp32"), "cpu", num_layers=1,
                            meta=True)
            except Exception as err:  # noqa: BLE001 - the child will import (and report) it
                self.log(f"preload: {model}: {type(err).__name__}: {str(err)[:200]}")
        if any(p.spec.training.lora_rank for p in planned) and "peft" not in sys.modules:
            with contextlib.suppress(Exception):
                importlib.import_module("peft")
                self.fork_ok = None  # peft imports accelerate: test the fork again before relying on it
        if self.deepspeed is None and any(p.spec.parallel.zero_stage for p in planned):
            self.deepspeed = not self.cuda or _in_child(_deepspeed_probe)
            if self.deepspeed:
                importlib.import_module("deepspeed")
                self.log("preload: deepspeed")
            else:
                self.log("preload: deepspeed breaks CUDA in forks here: each DeepSpeed rank imports it itself")

    def check_fork(self) -> bool:
        """CUDA still usable in a fork of this process (tested once)."""
        from harness.launch import fork_unsafe_reason

        if self.fork_ok is None:
            reason = fork_unsafe_reason()
            self.fork_ok = reason is None and (not self.cuda or _in_child(_cuda_probe))
            if not self.fork_ok:
                self.log(f"fork isolation unusable ({reason or 'CUDA fails in a forked child'}): "
                         f"falling back to subprocess")
        return self.fork_ok


# --------------------------------------------------------------------------------------------- running

@dataclass
class Outcome:
    planned: Planned
    status: str  # ok oom error timeout | done beyond-oom failing-method left cut invalid
    seconds: float = 0.0
    record: Any = None
    note: str = ""


@dataclass
class ChunkReport:
    name: str
    total: int
    counts: Counter = field(default_factory=Counter)
    seconds: float = 0.0

    @property
    def finished(self) -> bool:
        return not (self.counts["left"] or self.counts["cut"])

    def line(self) -> str:
        order = ("ok", "oom", "error", "timeout", "done", "beyond-oom", "failing-method", "invalid", "cut", "left")
        parts = ", ".join(f"{self.counts[k]} {k}" for k in order if self.counts[k])
        return f"chunk {self.name}: {self.total} points: {parts or 'none'} in {self.seconds:.0f} s"


class Packer:
    """Appends finished run directories to ``<out>/runs.tar`` and lines to ``<out>/summary.jsonl``."""

    def __init__(self, out: Path | None) -> None:
        self.out = out
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)

    def add_run(self, run_dir: Path, arc_prefix: str) -> None:
        if self.out is None:
            return
        with tarfile.open(self.out / "runs.tar", "a") as tar:
            for path in sorted(run_dir.iterdir()):
                if not path.is_file() or path.name.startswith("."):
                    continue
                data = path.read_bytes()
                if path.name.endswith(".log") and len(data) > LOG_TAIL_BYTES:
                    data = b"[... trimmed ...]\n" + data[-LOG_TAIL_BYTES:]
                self._add_bytes(tar, f"{arc_prefix}/{path.name}", data)

    def add_file(self, arcname: str, data: bytes) -> None:
        if self.out is None:
            return
        with tarfile.open(self.out / "runs.tar", "a") as tar:
            self._add_bytes(tar, arcname, data)

    @staticmethod
    def _add_bytes(tar: tarfile.TarFile, arcname: str, data: bytes) -> None:
        info = tarfile.TarInfo(arcname)
        info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
        tar.addfile(info, io.BytesIO(data))

    def summary(self, entry: dict[str, Any]) -> None:
        if self.out is None:
            return
        with open(self.out / "summary.jsonl", "a") as handle:
            handle.write(json.dumps(entry, sort_keys=True, default=str) + "\n")
            handle.flush()


def done_statuses(tables_dir: Path | None, planned: list[Planned]) -> dict[str, str]:
    """run_id -> run_status for the planned points already in the committed tables."""
    from harness.table import read_rows, table_path

    if tables_dir is None:
        return {}
    out: dict[str, str] = {}
    for gpu_key, campaign in {(p.point.gpu_key, p.point.opts.campaign) for p in planned}:
        path = table_path(tables_dir, gpu_key, campaign)
        if path.exists():
            for row in read_rows(path):
                out[row["run_id"]] = row.get("run_status") or ""
    return out


class Runner:
    """The budgeted loop over planned points (see the module docstring). ``execute(spec, opts, extra_files)``
    is ``harness.launch.run_point`` by default; ``clock`` is ``time.time`` (tests pass their own)."""

    def __init__(self, *, until: float, out: Path | None, point_timeout_s: float = 150.0,
                 rerun_errors: bool = False, done: dict[str, str] | None = None,
                 execute: Callable[..., Any] | None = None, clock: Callable[[], float] = time.time,
                 log: Callable[[str], None] = print, estimate_scale: float = 1.0) -> None:
        self.until = until
        self.packer = Packer(out)
        self.point_timeout_s = point_timeout_s
        self.rerun_errors = rerun_errors
        self.done = done or {}
        self.execute = execute or self._run_point
        self.clock = clock
        self.log = log
        self.estimate_scale = estimate_scale
        self.ratios: list[float] = []
        self.oom_at: dict[tuple[str, ...], int] = {}
        self.failures: Counter = Counter()
        self.finished: list[Planned] = []

    @staticmethod
    def _run_point(spec: Any, opts: Any, extra_files: dict[str, str]) -> Any:
        from harness.launch import run_point

        with contextlib.redirect_stdout(io.StringIO()):  # our own line per point replaces the launcher's
            return run_point(spec, opts, extra_files=extra_files)

    @property
    def drift(self) -> float:
        return min(3.0, max(0.3, statistics.median(self.ratios))) if self.ratios else DEFAULT_DRIFT

    def _previous_status(self, planned: Planned) -> str | None:
        from harness.launch import DONE, RETRYABLE, should_skip

        opts = dataclasses.replace(planned.point.opts, rerun_errors=self.rerun_errors)
        record = should_skip(planned.point.run_dir, opts)
        if record is not None:
            return record.status
        status = self.done.get(planned.point.run_id)
        if status in DONE or (status in RETRYABLE and not self.rerun_errors):
            return status
        return None

    def run_chunk(self, name: str, planned: list[Planned], invalid: list[tuple[Job, str]] = ()) -> ChunkReport:
        report = ChunkReport(name, len(planned) + len(invalid))
        started = self.clock()
        for job, error in invalid:
            report.counts["invalid"] += 1
            self.log(f"[{name}] invalid: {error}  [point: {' '.join(job.overrides)}]")
        for index, planned_point in enumerate(planned, 1):
            outcome = self.run_one(planned_point)
            report.counts[outcome.status] += 1
            if outcome.status not in ("done", "beyond-oom", "left") or outcome.note:
                self.log(self.line(name, index, len(planned), outcome))
        report.seconds = self.clock() - started
        self.log(report.line())
        return report

    def line(self, chunk: str, index: int, total: int, outcome: Outcome) -> str:
        record, planned = outcome.record, outcome.planned
        peak = getattr(record, "peak_allocated_bytes", None)
        peak_text = f" peak {peak / 1024**3:.2f} GiB" if peak else ""
        timing = (f" {outcome.seconds:.1f} s (est {planned.estimate_s:.1f})" if outcome.seconds else
                  f" (est {planned.estimate_s:.1f} s)")
        note = f" - {outcome.note}" if outcome.note else ""
        error = getattr(record, "error", None)
        error_text = f" [{error[:140]}]" if error and outcome.status not in ("ok", "done") else ""
        return (f"[{chunk} {index}/{total}] {outcome.status:7s} {planned.label}:{peak_text}{timing} "
                f"{planned.point.run_id}{note}{error_text}")

    def run_one(self, planned: Planned) -> Outcome:
        job, point = planned.job, planned.point
        method_key = (job.chunk, planned.spec.parallel.method)
        previous = self._previous_status(planned)
        if previous is not None:
            if previous == "oom" and job.micro_batch is not None:
                self.oom_at[job.series] = min(self.oom_at.get(job.series, job.micro_batch), job.micro_batch)
            return Outcome(planned, "done", note="" if previous in ("ok", "oom") else f"earlier {previous}")
        limit = self.oom_at.get(job.series)
        if limit is not None and job.micro_batch is not None and job.micro_batch >= limit:
            return Outcome(planned, "beyond-oom")
        if self.failures[method_key] >= 2:
            return Outcome(planned, "failing-method")
        now = self.clock()
        if now + planned.estimate_s * self.estimate_scale * self.drift > self.until:
            return Outcome(planned, "left")
        budget_timeout = self.until + GRACE_S - now
        timeout = min(self.point_timeout_s, max(30.0, budget_timeout))
        opts = dataclasses.replace(planned.opts, launcher=dataclasses.replace(planned.opts.launcher,
                                                                              timeout_s=int(timeout)))
        from omegaconf import OmegaConf

        extra = {"overrides.yaml": OmegaConf.to_yaml(OmegaConf.create(list(job.overrides)))}
        t0 = self.clock()
        try:
            record = self.execute(planned.spec, opts, extra)
        except ValueError as err:  # e.g. allow_dirty=false on a dirty tree: nothing ran
            return Outcome(planned, "invalid", note=str(err)[:300])
        except Exception as err:  # noqa: BLE001 - a launcher bug on one point must not end the call
            self.failures[method_key] += 1
            return Outcome(planned, "error", self.clock() - t0,
                           note=f"launcher: {type(err).__name__}: {str(err)[:300]}")
        seconds = self.clock() - t0
        status = record.status
        if status == "timeout" and timeout < self.point_timeout_s:  # the budget's doing, not the point's
            with contextlib.suppress(FileNotFoundError):
                (point.run_dir / "result.json").unlink()
            return Outcome(planned, "cut", seconds, record, note="killed at the deadline; runs again next time")
        if status in ("ok", "oom") and planned.estimate_s > 0:
            self.ratios.append(seconds / (planned.estimate_s * self.estimate_scale))
        if status == "oom" and job.micro_batch is not None:
            self.oom_at[job.series] = min(self.oom_at.get(job.series, job.micro_batch), job.micro_batch)
        if status in ("error", "timeout"):
            self.failures[method_key] += 1
        self.finished.append(planned)
        self.packer.add_run(point.run_dir, f"runs/{point.opts.campaign}/{point.gpu_key}/{point.run_id}")
        self.packer.summary({
            "chunk": job.chunk, "run_id": point.run_id, "campaign": point.opts.campaign, "gpu_key": point.gpu_key,
            "status": status, "seconds": round(seconds, 2), "estimate_s": round(planned.estimate_s, 2),
            "label": planned.label, "peak_allocated_bytes": getattr(record, "peak_allocated_bytes", None),
            "error": getattr(record, "error", None), "overrides": job.overrides})
        return Outcome(planned, status, seconds, record)

    def pack_tables(self) -> None:
        """This call's tidy rows (re-derived from the run dirs) into runs.tar as measurements/<gpu>/<campaign>.csv."""
        groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for planned in self.finished:
            rows = rows_from_run_dir(planned.point.run_dir)
            if rows:
                groups.setdefault((planned.point.gpu_key, planned.point.opts.campaign), []).extend(rows)
        from harness.table import upsert_rows

        with tempfile.TemporaryDirectory() as tmp:
            for (gpu_key, campaign), rows in sorted(groups.items()):
                path = Path(tmp) / f"{campaign}.csv"
                upsert_rows(path, rows)
                self.packer.add_file(f"measurements/{gpu_key}/{campaign}.csv", path.read_bytes())


# --------------------------------------------------------------------------------------------- merge

def rows_from_run_dir(run_dir: Path) -> list[dict[str, Any]]:
    """The tidy rows of a finished run directory, exactly as ``harness.launch.finish`` wrote them."""
    from estimator.spec import RunSpec
    from harness.files import read_json
    from harness.records import rank_from_dict, run_from_dict
    from harness.table import rank_rows

    result = read_json(run_dir / "result.json")
    spec_path = run_dir / "spec.json"
    if result is None or not spec_path.exists():
        return []
    spec = RunSpec.from_json(spec_path.read_text())
    record = run_from_dict(result)
    ranks = [rank_from_dict(data) for path in sorted(run_dir.glob("rank*.json"))
             if (data := read_json(path)) is not None]
    return rank_rows(spec, record, ranks, read_json(run_dir / "env.json") or {},
                     read_json(run_dir / "harness.json") or {})


def _tar_members(path: Path) -> list[tuple[str, bytes]]:
    """Regular files of a tar, tolerating a tail cut off by a kill; unsafe names are refused."""
    members: list[tuple[str, bytes]] = []
    try:
        with tarfile.open(path) as tar:
            for member in tar:
                name = member.name
                if not member.isfile() or name.startswith("/") or ".." in Path(name).parts:
                    continue
                handle = tar.extractfile(member)
                if handle is not None:
                    members.append((name, handle.read()))
    except (tarfile.ReadError, EOFError, OSError) as err:
        print(f"merge: {path}: stopped at a damaged member ({type(err).__name__}); kept {len(members)} files",
              file=sys.stderr)
    return members


def merge(paths: list[Path], *, data_dir: Path, runs_dir: Path | None) -> Counter:
    """Unpack runs.tar files (or directories holding them) into ``runs_dir`` and upsert their rows."""
    from harness.files import read_json
    from harness.launch import update_meta
    from harness.table import read_rows, table_path, upsert_rows

    tars: list[Path] = []
    for path in paths:
        tars += sorted(path.glob("*.tar")) if path.is_dir() else [path]
    counts: Counter = Counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for tar in tars:
            for name, data in _tar_members(tar):
                target = root / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
        for result in sorted(root.glob("runs/*/*/*/result.json")):
            run_dir = result.parent
            campaign, gpu_key, run_id = run_dir.parts[-3:]
            rows = rows_from_run_dir(run_dir)
            if not rows:
                counts["unreadable"] += 1
                continue
            table = table_path(data_dir, gpu_key, campaign)
            known = {row["run_id"] for row in read_rows(table)} if table.exists() else set()
            upsert_rows(table, rows)
            if run_id not in known:
                update_meta(table.with_suffix(".meta.json"), read_json(run_dir / "env.json") or {}, campaign)
            counts[rows[0]["run_status"]] += 1
            if runs_dir is not None:
                destination = runs_dir / campaign / gpu_key / run_id
                if destination.exists():
                    shutil.rmtree(destination)
                shutil.copytree(run_dir, destination)
    return counts


# --------------------------------------------------------------------------------------------- CLI

def _runner_overrides(work: Path, isolation: str, point_timeout_s: float) -> list[str]:
    return [f"paths.results_dir={work / 'runs'}", f"paths.measurements_dir={work / 'measurements'}",
            f"paths.cache_dir={work / 'cache'}", f"launcher.isolation={isolation}",
            f"launcher.timeout_s={int(point_timeout_s)}"]


def _plan_for_listing(chunk: Chunk, args: argparse.Namespace) -> tuple[list[Planned], list[tuple[Job, str]]]:
    from harness.environment import detect_device

    extra = _runner_overrides(args.work, "fork", 150) + ([f"gpu={args.gpu}"] if args.gpu else [])
    planned, invalid = plan_jobs(expand_chunk(chunk), extra, device=detect_device(), check_device=False)
    if args.gpu:
        predict_fits(planned)
    return planned, invalid


def cmd_list(args: argparse.Namespace) -> int:
    chunks = load_chunks(args.chunks)
    totals = Counter()
    print(f"{'chunk':30s} {'queue':5s} {'points':>6s} {'all min':>7s} {'expected':>8s} {'exp min':>7s}  about")
    for chunk in chunks:
        planned, invalid = _plan_for_listing(chunk, args)
        expected = expected_points(planned)
        all_s, exp_s = sum(p.estimate_s for p in planned), sum(p.estimate_s for p in expected)
        if chunk.queue:
            totals.update(points=len(planned), all_s=all_s, expected=len(expected), exp_s=exp_s)
        bad = f" ({len(invalid)} INVALID)" if invalid else ""
        print(f"{chunk.name:30s} {'yes' if chunk.queue else 'no':5s} {len(planned):6d} {all_s / 60:7.1f} "
              f"{len(expected):8d} {exp_s / 60:7.1f}  {chunk.about}{bad}")
        for job, error in invalid:
            print(f"    invalid: {error}  [point: {' '.join(job.overrides)}]")
    print(f"{'queued total':30s} {'':5s} {totals['points']:6d} {totals['all_s'] / 60:7.1f} "
          f"{totals['expected']:8d} {totals['exp_s'] / 60:7.1f}")
    if not args.gpu:
        print("(expected = all points: pass --gpu KEY for the estimator's OOM-boundary prediction)")
    return 0


def cmd_points(args: argparse.Namespace) -> int:
    for chunk in select_chunks(load_chunks(args.chunks), args.chunk):
        planned, invalid = _plan_for_listing(chunk, args)
        for index, p in enumerate(planned, 1):
            fits = {None: "", True: " fits", False: " OOM?"}[p.fits]
            print(f"[{chunk.name} {index}/{len(planned)}] {p.estimate_s:6.1f} s{fits}  {p.label}  {p.point.run_id}")
        for job, error in invalid:
            print(f"[{chunk.name}] invalid: {error}  [point: {' '.join(job.overrides)}]")
        print(f"chunk {chunk.name}: {len(planned)} points, {sum(p.estimate_s for p in planned) / 60:.1f} min "
              f"estimated, {len(invalid)} invalid")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # before torch: keeps this process fork-safe
    previous_handler = signal.signal(signal.SIGTERM, _terminate)  # a kill from outside still packs (finally)
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous_handler)


def _run(args: argparse.Namespace) -> int:
    from harness.environment import detect_device

    started = time.time()
    until = args.until if args.until is not None else started + args.budget_s
    def log(line: str) -> None:
        print(line, flush=True)

    chunks = select_chunks(load_chunks(args.chunks), args.chunk)
    device = detect_device()
    log(f"campaign: {len(chunks)} chunk(s) {', '.join(c.name for c in chunks)}; device {device.name} "
        f"({device.gpu_key}); {until - started:.0f} s to the deadline; isolation {args.isolation}")
    isolation = args.isolation
    preloader = Preloader(cuda=device.kind == "cuda", log=log)
    if isolation == "fork":
        preloader.base()
    done_dir = None if args.no_done_tables else args.done_tables
    runner = Runner(until=until, out=args.out, point_timeout_s=args.point_timeout_s,
                    rerun_errors=args.rerun_errors, log=log)
    reports: list[ChunkReport] = []
    try:
        for chunk in chunks:
            if time.time() >= until:
                reports.append(ChunkReport(chunk.name, 0, Counter(left=1)))
                continue
            planned, invalid = plan_jobs(expand_chunk(chunk),
                                         _runner_overrides(args.work, isolation, args.point_timeout_s),
                                         device=device, isolation=isolation)
            if isolation == "fork":
                preloader.for_points(planned)
                if not preloader.check_fork():
                    isolation = "subprocess"
                    planned, invalid = plan_jobs(expand_chunk(chunk),
                                                 _runner_overrides(args.work, isolation, args.point_timeout_s),
                                                 device=device, isolation=isolation)
            runner.done = done_statuses(done_dir, planned)
            reports.append(runner.run_chunk(chunk.name, planned, invalid))
    finally:
        runner.pack_tables()
        finished = [r.name for r in reports if r.finished]
        unfinished = [c.name for c in chunks if c.name not in finished]
        elapsed = time.time() - started
        rate = f" ({len(runner.finished) / elapsed * 600:.0f} per 10 min)" if elapsed > 0 else ""
        log(f"campaign: {len(runner.finished)} points run in {elapsed:.0f} s{rate}, drift {runner.drift:.2f}; "
            f"finished chunks: {', '.join(finished) or 'none'}; to run next: {', '.join(unfinished) or 'nothing'}")
        runner.packer.summary({"event": "end", "seconds": round(time.time() - started, 1),
                               "chunks": {r.name: dict(r.counts) for r in reports},
                               "finished": finished, "unfinished": unfinished, "drift": runner.drift})
    return 0


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def cmd_merge(args: argparse.Namespace) -> int:
    counts = merge(args.path, data_dir=args.data, runs_dir=None if args.no_runs else args.runs)
    total = sum(counts.values())
    parts = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    print(f"merge: {total} runs into {args.data}: {parts or 'nothing found'}")
    return 0 if total else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harness.campaign", description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=Path, default=CHUNKS_FILE, help="chunk file (campaigns/chunks.yaml)")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK,
                        help="work dir: runs/, measurements/, cache/ (default $TMPDIR/llmem-campaign)")
    sub = parser.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help="chunks with point counts and estimated minutes")
    points = sub.add_parser("points", help="every point of the chunks with its estimate")
    points.add_argument("chunk", nargs="+")
    for sub_parser in (listing, points):
        sub_parser.add_argument("--gpu", default=None, metavar="KEY",
                                help="plan for this GPU key and predict each point's fit (h100-80gb, h200-141gb)")
    run = sub.add_parser("run", help="run chunks (in order) until the deadline")
    run.add_argument("chunk", nargs="+", help="chunk names, or all (the queued chunks in priority order)")
    when = run.add_mutually_exclusive_group()
    when.add_argument("--budget-s", type=float, default=450.0, help="seconds from now to the deadline")
    when.add_argument("--until", type=float, default=None, help="the deadline as a Unix time")
    run.add_argument("--out", type=Path, default=None, help="where runs.tar and summary.jsonl go ($OUT)")
    run.add_argument("--isolation", choices=("fork", "subprocess", "inprocess"), default="fork")
    run.add_argument("--point-timeout-s", type=float, default=150.0,
                     help="a point running longer is a timeout (data: it is recorded)")
    run.add_argument("--done-tables", type=Path, default=REPO_ROOT / "data" / "measurements",
                     help="skip points already in these committed tables")
    run.add_argument("--no-done-tables", action="store_true")
    run.add_argument("--rerun-errors", action="store_true", help="re-run points recorded as error / timeout")
    merge_p = sub.add_parser("merge", help="unpack runs.tar from a GPU call into data/measurements and runs/")
    merge_p.add_argument("path", nargs="+", type=Path, help="runs.tar files or directories holding them")
    merge_p.add_argument("--data", type=Path, default=REPO_ROOT / "data" / "measurements")
    merge_p.add_argument("--runs", type=Path, default=REPO_ROOT / "runs")
    merge_p.add_argument("--no-runs", action="store_true", help="do not copy the run directories")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"list": cmd_list, "points": cmd_points, "run": cmd_run, "merge": cmd_merge}[args.command](args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
