"""One point, from a (RunSpec, HarnessOptions) to a finished run directory. No Hydra and no torch here.

``plan_point`` resolves everything a run depends on (backend, GPU key, run id, run dir) and checks the point
before any work (one-line ``ValueError`` naming the key). ``run_point`` then:

1. skips the point when ``result.json`` already says ok / oom (and error / timeout unless ``rerun_errors``);
2. writes ``spec.json``, ``harness.json`` and ``env.json``;
3. runs the ranks: ``torchrun --standalone`` (or ``srun torchrun`` across nodes) for real multi-rank runs, one
   ``python -m harness.worker`` subprocess (or this process, ``launcher.isolation=inprocess``; or a fork of this
   process, ``launcher.isolation=fork``) for single-rank, emulated and fake-backend points; a timeout or crash
   becomes ``status: timeout|error`` with the stderr tail;
4. merges ``rank*.json`` into ``result.json`` and upserts the tidy rows into
   ``<measurements_dir>/<gpu-key>/<campaign>.csv``. ``result.json`` is written last: a point killed before
   it is simply re-run on resume.

Run directory: ``<results_dir>/<campaign>/<gpu-key>/<run_id>/`` where run_id is the spec id, suffixed with a
hash of the measurement variant (emulation, memory cap, padding, steps, ...) when it is not the default one,
so an emulated or capped measurement never overwrites (or is mistaken for) a plain one.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from estimator.spec import RunSpec
from harness.environment import DeviceInfo, capture_env, detect_device, git_state, utc_now
from harness.files import locked, read_json, write_json
from harness.options import DataOptions, HarnessOptions, StepsOptions, options_to_dict, resolve_ranks
from harness.records import RunRecord, merge_ranks, rank_from_dict, run_from_dict, to_dict

DONE = ("ok", "oom")
RETRYABLE = ("error", "timeout")
STDERR_TAIL_CHARS = 4000


@dataclass
class Point:
    spec: RunSpec
    opts: HarnessOptions  # backend and data.online resolved
    gpu_key: str
    run_id: str
    run_dir: Path
    variant: dict[str, Any]
    expected_ranks: list[int]

    @property
    def needs_torchrun(self) -> bool:
        return self.opts.backend in ("cuda", "cpu") and self.spec.parallel.world_size > 1 and not self.opts.emulated


# --------------------------------------------------------------------------------------------- planning

def resolve_backend(backend: str, device: DeviceInfo) -> str:
    if backend == "auto":
        return "cuda" if device.kind == "cuda" else "cpu"
    if backend == "cuda" and device.kind != "cuda":
        raise ValueError("backend: cuda requested but no GPU is visible (use backend=cpu or backend=fake)")
    return backend


def variant_of(opts: HarnessOptions, ranks: list[int]) -> dict[str, Any]:
    """The measurement options that change the numbers, when not the defaults (they key the run dir)."""
    variant: dict[str, Any] = {}
    if opts.backend == "fake":
        variant["backend"] = "fake"
    if opts.emulated:
        variant["emulate_ranks"] = ranks
    if opts.memory.cap_gib is not None:
        variant["cap_gib"] = opts.memory.cap_gib
    if opts.memory.cap_fraction is not None:
        variant["cap_fraction"] = opts.memory.cap_fraction
    defaults = DataOptions()
    for key in ("padding", "keep"):
        if getattr(opts.data, key) != getattr(defaults, key):
            variant[key] = getattr(opts.data, key)
    if dataclasses.asdict(opts.steps) != dataclasses.asdict(StepsOptions()):
        variant["steps"] = [opts.steps.warmup, opts.steps.measured]
    if opts.deepspeed_config:
        variant["deepspeed_config_sha256"] = hashlib.sha256(Path(opts.deepspeed_config).read_bytes()).hexdigest()
    if opts.model.pretrained:
        variant["pretrained"] = True
    if opts.inject_oom:
        variant["inject_oom"] = opts.inject_oom
    return variant


def run_id_of(spec_id: str, variant: dict[str, Any]) -> str:
    if not variant:
        return spec_id
    digest = hashlib.sha256(json.dumps(variant, sort_keys=True).encode()).hexdigest()[:8]
    return f"{spec_id}-{digest}"


def plan_point(spec: RunSpec, opts: HarnessOptions, device: DeviceInfo | None = None, *,
               check_data: bool = True, check_device: bool = True) -> Point:
    """Resolve and check a point (cheap: standard library, no torch). Raises ValueError naming the key.

    ``check_device=False`` (dry runs): the local device does not have to be able to run the point. With a
    Slurm launcher the point runs elsewhere: ``backend=auto`` means the GPU the job will land on."""
    device = device or detect_device()
    opts = copy.deepcopy(opts)  # resolved fields are written into it; the caller's stays as composed
    remote = opts.launcher.name.startswith("slurm")  # submitit jobs land on other (GPU) nodes
    if opts.backend == "auto":
        opts.backend = "cuda" if device.kind == "cuda" or remote else "cpu"
    elif check_device and not remote:
        opts.backend = resolve_backend(opts.backend, device)
    gpu_key = gpu_key_of(opts.backend, device, spec.gpu)
    if spec.gpu == "auto":
        # The estimator's key of the device (what --from-run predicts for); cpu for CPU runs and CPU traces.
        spec = spec.replace(gpu=device.spec_gpu if device.kind == "cuda" and opts.backend != "cpu" else
                            gpu_key if opts.backend == "cuda" else "cpu")
    spec = _apply_deepspeed_config(spec, opts)
    _check_model(spec)
    world_size = spec.parallel.world_size
    if opts.emulated or (opts.backend == "fake" and world_size > 1):
        ranks = resolve_ranks(opts.emulate.ranks, world_size)
    else:
        ranks = [0] if opts.backend == "fake" else list(range(world_size))
    _check_launch(spec, opts, device if check_device and not remote else None)
    if check_data and opts.data.source == "file":
        from harness.data import read_records_file

        read_records_file(opts.data.path)  # fail now, not in every rank
    variant = variant_of(opts, ranks)
    run_id = run_id_of(spec.spec_id, variant)
    run_dir = Path(opts.paths.results_dir).expanduser() / opts.campaign / gpu_key / run_id
    return Point(spec=spec, opts=opts, gpu_key=gpu_key, run_id=run_id, run_dir=run_dir, variant=variant,
                 expected_ranks=ranks)


def gpu_key_of(backend: str, device: DeviceInfo, configured: str) -> str:
    """The directory / table key: the device's GPU key, ``cpu``, ``fake`` (fake-tensor traces), or for a GPU
    point planned where no GPU is (a dry run on a login node) the configured ``gpu`` else ``unknown-gpu``."""
    if backend == "fake":
        return "fake"
    if backend == "cpu":
        return "cpu"
    if device.kind == "cuda":
        return device.gpu_key
    return configured if configured != "auto" else "unknown-gpu"


def _apply_deepspeed_config(spec: RunSpec, opts: HarnessOptions) -> RunSpec:
    """A user DeepSpeed JSON defines the ZeRO part of the spec (so --from-run predicts what really ran)."""
    if not opts.deepspeed_config:
        return spec
    if spec.parallel.zero_stage == 0:
        raise ValueError(f"deepspeed_config: only used by zero1/zero2/zero3/zero_offload, not method "
                         f"{spec.parallel.method!r}")
    from estimator.configs.deepspeed_json import spec_from_deepspeed
    from harness.models import load_model_config

    hidden = load_model_config(spec.model).get("hidden_size")
    try:
        derived = spec_from_deepspeed(opts.deepspeed_config, spec, hidden)
    except ValueError as err:
        raise ValueError(f"deepspeed_config: {err}") from None
    if derived.parallel.method != spec.parallel.method:
        raise ValueError(f"deepspeed_config: the file runs {derived.parallel.method}, but method is "
                         f"{spec.parallel.method!r} (pick method={derived.parallel.method})")
    return derived


def _check_model(spec: RunSpec) -> None:
    from harness.models import load_model_config, max_positions

    if spec.training.qlora and importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError("training.qlora: needs bitsandbytes (pip install 'bitsandbytes>=0.50')")
    config = load_model_config(spec.model)
    limit = max_positions(config)
    if limit is not None and spec.training.seq_len > limit:
        raise ValueError(f"training.seq_len: {spec.training.seq_len} exceeds {spec.model}'s "
                         f"{limit} positions")
    if spec.parallel.method in ("tp", "dp_tp"):
        from estimator.models.tp_plans import check_tp

        check_tp(config, spec.parallel.tp)
    if spec.parallel.method == "fsdp1":
        from estimator.methods.fsdp1 import check_fsdp1

        check_fsdp1(spec, config)


def _check_launch(spec: RunSpec, opts: HarnessOptions, device: DeviceInfo | None) -> None:
    world_size = spec.parallel.world_size
    if opts.backend == "fake" and spec.parallel.zero_stage:
        raise ValueError(f"backend: the fake-tensor trace runs torch-native methods only, not "
                         f"{spec.parallel.method!r} (DeepSpeed needs real tensors: use a GPU)")
    if spec.parallel.method == "fsdp1" and spec.training.lora and spec.training.precision.startswith("mixed_"):
        # FSDP1's MixedPrecision casts the fp32 adapter units to 16 bits while the worker runs no autocast: the
        # first adapter matmul fails (H100, 2026-11-26, docs/LOG.md session 20)
        raise ValueError(f"training.precision: fsdp1 with LoRA under {spec.training.precision} fails in the worker "
                         "(fp32 activations meet 16-bit adapters); use bf16, fp32, amp_* or method fsdp")
    if spec.parallel.cp > 1 and (opts.backend != "cuda" or opts.emulated):
        # torch's ring attention dispatches the CUDA SDPA kernels only (harness.cp); the CPU oracle is
        # harness.fake.context_parallel
        raise ValueError("parallel.cp: torch's context parallelism runs on GPUs only (on CPU, SDPA's "
                         "_scaled_dot_product_flash_attention_for_cpu has no ring-attention handler nor sharding "
                         "rule); use backend cuda with real ranks")
    if spec.parallel.cp > 1 and spec.parallel.method != "fsdp":
        # harness.cp wraps FSDP2 over a (dp, cp) mesh only; the dp_tp worker would run TP and ignore cp
        raise ValueError("parallel.cp: the harness runs context parallelism with method fsdp only; cp x tp (dp_tp) "
                         "is checked against fake tensors (benchmarks/context_parallel_table.py --tp)")
    offload = spec.parallel.method == "zero_offload" or spec.parallel.zero.offload_optimizer
    if offload and spec.training.precision == "bf16" and not opts.deepspeed_config:
        # DeepSpeed asserts on bf16 master weights + offload unless the optimizer is its JIT-compiled
        # DeepSpeedCPUAdam (runtime/base_optimizer.py); the generated config steps with torch's AdamW.
        raise ValueError("training.precision: bf16 with optimizer offload needs DeepSpeed's compiled "
                         "DeepSpeedCPUAdam, which the generated config does not use (use mixed_bf16, or "
                         "deepspeed_config=<your JSON>)")
    if opts.backend in ("cuda", "cpu") and world_size > 1 and not opts.emulated:
        nproc = opts.launcher.nproc_per_node or world_size // opts.launcher.nnodes
        if nproc * opts.launcher.nnodes != world_size:
            raise ValueError(f"launcher.nproc_per_node: {opts.launcher.nnodes} node(s) x {nproc} != world size "
                             f"{world_size}")
        if device is not None and opts.backend == "cuda" and nproc > device.count:
            raise ValueError(f"parallel.world_size: {nproc} ranks per node need {nproc} GPUs, {device.count} "
                             f"visible (emulate.enabled=true measures ranks on one GPU)")


# --------------------------------------------------------------------------------------------- running

def should_skip(run_dir: Path, opts: HarnessOptions) -> RunRecord | None:
    """The finished record when this point must not run again, else None."""
    data = read_json(run_dir / "result.json")
    if data is None or opts.force:
        return None
    try:
        record = run_from_dict(data)
    except (ValueError, TypeError):
        return None  # unreadable or another schema: measure again
    if record.status in DONE or (record.status in RETRYABLE and not opts.rerun_errors):
        return record
    return None


def prepare(point: Point) -> None:
    """Write the inputs of a run and clear any rank files of an interrupted earlier attempt."""
    point.run_dir.mkdir(parents=True, exist_ok=True)
    for stale in point.run_dir.glob("rank*.json"):
        stale.unlink()
    write_json(point.run_dir / "spec.json", json.loads(point.spec.to_json()))
    write_json(point.run_dir / "harness.json", options_to_dict(point.opts))
    write_json(point.run_dir / "env.json", capture_env())


def run_point(spec: RunSpec, opts: HarnessOptions, *, device: DeviceInfo | None = None,
              extra_files: dict[str, str] | None = None) -> RunRecord:
    """Measure one point (or skip it, or only prepare it for a dry run); returns its RunRecord."""
    point = plan_point(spec, opts, device, check_device=not opts.dry_run)
    if not point.opts.allow_dirty and not point.opts.dry_run and git_state()[1]:
        raise ValueError("allow_dirty: the git tree has uncommitted changes; commit them (measurements record "
                         "the sha) or pass allow_dirty=true")
    skipped = should_skip(point.run_dir, point.opts)
    if skipped is not None:
        print(f"skip {point.run_id} ({skipped.status}) {point.run_dir}", flush=True)
        return skipped
    if point.opts.backend != "fake" and not point.opts.dry_run and str(point.opts.data.online).lower() == "auto":
        from harness.data import hub_reachable

        point.opts.data.online = "true" if hub_reachable() else "false"  # probed once per process
    prepare(point)
    for name, text in (extra_files or {}).items():
        (point.run_dir / name).write_text(text)
    if point.opts.dry_run:
        print(f"dry run {point.run_id} {point.run_dir}", flush=True)
        return RunRecord(spec_id=point.spec.spec_id, run_id=point.run_id, campaign=point.opts.campaign,
                         gpu_key=point.gpu_key, status="dry_run", world_size=point.spec.parallel.world_size,
                         variant=point.variant)
    started, t0 = utc_now(), time.perf_counter()
    outcome = execute(point)
    record = finish(point, outcome, started=started, duration_s=time.perf_counter() - t0)
    print(summary_line(record, point.run_dir), flush=True)
    return record


@dataclass
class Outcome:
    returncode: int | None
    timed_out: bool
    stderr_tail: str | None


def worker_command(point: Point, rank: int | None = None) -> list[str]:
    worker = ["-m", "harness.worker", "--run-dir", str(point.run_dir)]
    if rank is not None:
        worker += ["--rank", str(rank)]
    launcher = point.opts.launcher
    if not point.needs_torchrun:
        return [sys.executable, *worker]
    nproc = launcher.nproc_per_node or point.spec.parallel.world_size // launcher.nnodes
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if launcher.command == "torchrun":
        return [*torchrun, "--standalone", "--nnodes=1", f"--nproc_per_node={nproc}", *launcher.extra_args, *worker]
    endpoint = launcher.rdzv_endpoint or f"{head_node()}:{launcher.rdzv_port}"
    return ["srun", f"--nodes={launcher.nnodes}", f"--ntasks={launcher.nnodes}", "--ntasks-per-node=1",
            "--kill-on-bad-exit=1", *torchrun, f"--nnodes={launcher.nnodes}", f"--nproc_per_node={nproc}",
            "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", f"--rdzv_id={point.run_id}",
            *launcher.extra_args, *worker]


def head_node() -> str:
    """First host of the Slurm allocation (torchtitan's multinode_trainer.slurm does the same)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise ValueError("launcher.rdzv_endpoint: not inside a Slurm allocation; set launcher.rdzv_endpoint")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()[0]


def execute(point: Point) -> Outcome:
    log_path, timeout_s = point.run_dir / "worker.log", point.opts.launcher.timeout_s
    fork = point.opts.launcher.isolation == "fork" and hasattr(os, "fork")
    if point.opts.emulated and point.opts.backend != "fake":
        # One process per emulated rank, in turn (see harness.worker: fake groups do not survive re-creation).
        outcomes = [_execute_fork(point, rank, log_path, timeout_s, append=index > 0) if fork else
                    _execute_subprocess(worker_command(point, rank), log_path, timeout_s, append=index > 0)
                    for index, rank in enumerate(point.expected_ranks)]
        codes = [o.returncode for o in outcomes if o.returncode]
        return Outcome(codes[0] if codes else 0, any(o.timed_out for o in outcomes), outcomes[-1].stderr_tail)
    if point.opts.launcher.isolation == "inprocess" and not point.needs_torchrun:
        return _execute_inprocess(point)
    if fork and not point.needs_torchrun:
        return _execute_fork(point, None, log_path, timeout_s)
    return _execute_subprocess(worker_command(point), log_path, timeout_s)


def fork_unsafe_reason() -> str | None:
    """Why this process must not fork a CUDA worker, or None. CUDA does not survive a fork once initialised
    in the parent (the launcher never needs it: NVML answers its questions; set PYTORCH_NVML_BASED_CUDA_CHECK=1
    before importing torch so ``torch.cuda.is_available()`` asks NVML too)."""
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "cuda", None) is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in the launcher process"
    return None


def _execute_fork(point: Point, rank: int | None, log_path: Path, timeout_s: float, *,
                  append: bool = False) -> Outcome:
    """``harness.worker.run`` in a forked child: a fresh process for the rank (own CUDA context, allocator,
    process group, DeepSpeed patches) without paying the interpreter + torch + transformers import again (the
    launcher's imports are inherited). Same records, same timeout handling as a subprocess."""
    reason = fork_unsafe_reason()
    if reason is not None:  # fall back to a fresh interpreter: correct, only slower
        return _execute_subprocess(worker_command(point, rank), log_path, timeout_s, append=append)
    sys.stdout.flush()
    sys.stderr.flush()
    with open(log_path, "a" if append else "w") as log:
        log.write(f"$ fork: harness.worker.run --run-dir {point.run_dir}"
                  f"{'' if rank is None else f' --rank {rank}'}\n")
        log.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            _fork_child(point, rank, log.fileno())
    return _wait_child(pid, timeout_s, log_path)


def _fork_child(point: Point, rank: int | None, log_fd: int) -> None:
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher's handler (if any) is not the rank's
        os.setsid()  # its own process group: a timeout kills it and anything it started
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        # Fresh stream objects on the log (the parent's may be a test runner's capture, not fds 1/2).
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.update({"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
        from harness import worker

        code = worker.run(point.run_dir, point.spec, point.opts, rank=rank)
    except BaseException:  # noqa: BLE001 - the child reports and exits; the parent records it as an error
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)  # no interpreter teardown: no atexit of the parent, records are already fsynced


def _wait_child(pid: int, timeout_s: float, log_path: Path) -> Outcome:
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return Outcome(os.waitstatus_to_exitcode(status), False, _tail(log_path))
            if time.monotonic() >= deadline:
                status = _terminate_child(pid)
                return Outcome(os.waitstatus_to_exitcode(status), True, _tail(log_path))
            time.sleep(0.05)
    except BaseException:  # Ctrl-C / SIGTERM: take the child down with us
        _terminate_child(pid)
        raise


def _terminate_child(pid: int, grace_s: float = 10.0) -> int:
    """SIGTERM to the child's process group, SIGKILL after ``grace_s``; returns its wait status."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:  # not yet its own group leader: the pid itself
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            time.sleep(0.05)
    return os.waitpid(pid, 0)[1]


def _execute_inprocess(point: Point) -> Outcome:
    from harness import worker

    try:
        return Outcome(worker.run(point.run_dir, point.spec, point.opts), False, None)
    except Exception as err:  # noqa: BLE001 - a harness bug in one point must not end the sweep
        return Outcome(1, False, f"{type(err).__name__}: {err}"[-STDERR_TAIL_CHARS:])


def _execute_subprocess(command: list[str], log_path: Path, timeout_s: float, *, append: bool = False) -> Outcome:
    """Run in its own session (so a timeout kills torchrun and every rank), output to the run's log file."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "a" if append else "w") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            returncode, timed_out = proc.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            returncode, timed_out = proc.returncode, True
        except BaseException:  # Ctrl-C / Slurm's SIGTERM: take the ranks down with us
            _kill_group(proc)
            raise
    return Outcome(returncode, timed_out, _tail(log_path))


def _kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-STDERR_TAIL_CHARS:]
    except OSError:
        return ""


# --------------------------------------------------------------------------------------------- finishing

def finish(point: Point, outcome: Outcome, *, started: str, duration_s: float) -> RunRecord:
    """Merge ranks, append the table rows, then write result.json (the 'done' marker) last."""
    from harness.records import RankRecord
    from harness.table import rank_rows, table_path, upsert_rows

    ranks: list[RankRecord] = []
    for rank in point.expected_ranks:
        data = read_json(point.run_dir / f"rank{rank}.json")
        if data is not None:
            ranks.append(rank_from_dict(data))
    record = merge_ranks(ranks, spec_id=point.spec.spec_id, run_id=point.run_id, campaign=point.opts.campaign,
                         gpu_key=point.gpu_key, world_size=point.spec.parallel.world_size,
                         expected_ranks=point.expected_ranks)
    if outcome.timed_out and record.status != "oom":
        record.status = "timeout"
        record.error = f"timed out after {point.opts.launcher.timeout_s} s (launcher.timeout_s)"
    elif not ranks and outcome.returncode:
        record.error = f"worker exited with code {outcome.returncode} before writing a rank record"
    record.returncode = outcome.returncode
    if record.status != "ok" or outcome.returncode:
        record.stderr_tail = outcome.stderr_tail
    record.variant = point.variant
    record.started_at, record.finished_at, record.duration_s = started, utc_now(), round(duration_s, 3)
    env = read_json(point.run_dir / "env.json") or {}
    options = options_to_dict(point.opts)
    path = table_path(Path(point.opts.paths.measurements_dir).expanduser(), point.gpu_key, point.opts.campaign)
    upsert_rows(path, rank_rows(point.spec, record, ranks, env, options))
    update_meta(path.with_suffix(".meta.json"), env, point.opts.campaign)
    write_json(point.run_dir / "result.json", to_dict(record))
    return record


def update_meta(path: Path, env: dict[str, Any], campaign: str) -> None:
    """``<campaign>.meta.json`` beside the table: provenance of every run appended to it."""
    with locked(path):
        meta = read_json(path) or {"campaign": campaign, "git_shas": [], "hosts": [], "versions": {},
                                   "first_run_at": env.get("captured_at")}
        for key, value in (("git_shas", env.get("git_sha")), ("hosts", env.get("hostname"))):
            if value and value not in meta[key]:
                meta[key].append(value)
        for package, version in (env.get("versions") or {}).items():
            seen = meta["versions"].setdefault(package, [])
            if version and version not in seen:
                seen.append(version)
        meta["dirty_runs"] = meta.get("dirty_runs", 0) + (1 if env.get("git_dirty") else 0)
        meta["last_run_at"] = env.get("captured_at")
        write_json(path, meta)


def summary_line(record: RunRecord, run_dir: Path) -> str:
    peak = record.peak_allocated_bytes
    peak_text = "n/a" if peak is None else f"{peak / 1024**3:.2f} GiB" if peak >= 1024**3 else f"{peak / 1024**2:.1f} MiB"
    rate = f" {record.tokens_per_s:.0f} tok/s" if record.tokens_per_s else ""
    error = f" ({record.error[:160]})" if record.error and record.status != "ok" else ""
    return f"{record.status:7s} {record.run_id} peak_allocated={peak_text}{rate} {run_dir}{error}"
