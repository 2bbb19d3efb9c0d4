"""Per-rank main: ``python -m harness.worker --run-dir DIR`` (under torchrun for real multi-rank runs).

Reads ``DIR/spec.json`` (the RunSpec) and ``DIR/harness.json`` (HarnessOptions, backend and data.online
already resolved by the launcher) and writes ``DIR/rank<r>.json`` for every rank it measures:

* started by torchrun / ``srun torchrun``: this process is one real rank (NCCL on GPUs, gloo on CPU);
* ``emulate``: rank ``--rank R`` of an N-rank job on a fake process group (allocations real, collectives
  no-ops: no throughput, no NCCL buffers). The launcher starts one worker per emulated rank: torch caches
  process-group names in DTensor/DeviceMesh state, so a second fake group in the same process breaks
  (``Could not resolve the process group registered under the name 3``), and a fresh process also gives each
  rank a clean allocator and its own CUDA-context reading;
* otherwise: the single rank of a one-process job;
* ``backend=fake``: ``harness.fake.trace_run`` (fake tensors, full-size torch-native methods), same records.

Per rank: build the data, build + wrap the model (``harness.methods``), run warm-up + measured steps with the
memory probe reading every phase (forward, backward, optimizer), and catch OOM as data (``status: oom`` with the
peak reached). Exit codes: 0 = records written, 3 = this rank OOMed (torchrun then stops the other ranks),
1 = this rank failed.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_ERROR, EXIT_OOM = 0, 1, 3


@dataclass
class Where:
    """Where a rank is, for the OOM record: step -1 is setup (model build and wrapping)."""

    step: int = -1
    phase: str = "setup"


# --------------------------------------------------------------------------------------------- entry

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, help="run directory holding spec.json and harness.json")
    parser.add_argument("--rank", type=int, default=None, help="emulated runs: the rank to measure")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_dir = Path(args.run_dir)
    spec, opts = load_run(run_dir)
    return run(run_dir, spec, opts, rank=args.rank)


def load_run(run_dir: Path):
    from estimator.spec import RunSpec
    from harness.files import read_json
    from harness.options import options_from_dict

    spec = RunSpec.from_json((run_dir / "spec.json").read_text())
    opts = options_from_dict(read_json(run_dir / "harness.json") or {})
    return spec, opts


def run(run_dir: Path, spec, opts, *, rank: int | None = None) -> int:
    """Measure every rank this process is responsible for; returns the exit code."""
    from harness.distributed import torchrun_env
    from harness.options import resolve_ranks

    if opts.backend == "fake":
        records = run_fake(spec, opts, run_dir)
    elif (env := torchrun_env()) is not None:
        real_rank, world_size, local_rank = env
        records = [measure_rank(spec, opts, run_dir, rank=real_rank, world_size=world_size,
                                local_rank=local_rank, emulated=False)]
    elif opts.emulated:
        ranks = [rank] if rank is not None else resolve_ranks(opts.emulate.ranks, spec.parallel.world_size)
        records = [measure_rank(spec, opts, run_dir, rank=r, world_size=spec.parallel.world_size, local_rank=0,
                                emulated=True) for r in ranks]
    else:
        records = [measure_rank(spec, opts, run_dir, rank=0, world_size=spec.parallel.world_size, local_rank=0,
                                emulated=False)]
    write_records(run_dir, records)
    if (torchrun_env() is not None and spec.parallel.world_size > 1) or rank is not None:
        status = records[0].status
        return EXIT_OK if status == "ok" else EXIT_OOM if status == "oom" else EXIT_ERROR
    return EXIT_OK


def write_records(run_dir: Path, records) -> None:
    from harness.files import write_json
    from harness.records import to_dict

    for record in records:
        write_json(run_dir / f"rank{record.rank}.json", to_dict(record))


# --------------------------------------------------------------------------------------------- one rank

def measure_rank(spec, opts, run_dir: Path, *, rank: int, world_size: int, local_rank: int, emulated: bool):
    from harness import distributed
    from harness.memory import MemoryProbe, host_peak_rss_bytes
    from harness.records import RankRecord

    t0 = time.perf_counter()
    record = RankRecord(rank=rank, world_size=world_size, status="error", spec_id=spec.spec_id,
                        run_id=run_dir.name, emulated=emulated,
                        measured_by="emulated_fake_pg" if emulated else "real_run", node=node_name())
    where = Where()
    probe = trainer = snapshot_path = None
    try:
        device = distributed.pick_device(opts.backend, local_rank)
        probe = MemoryProbe(device, sample_interval_s=opts.memory.sample_interval_s,
                            count_cpu=opts.memory.count_cpu)
        record.memory_source = probe.source
        probe.start()
        snapshot_path = _start_history(probe, opts, run_dir, rank)
        _init_device(probe, record, opts, spec.training.memory_cap_bytes)
        if rank == 0:
            from harness.environment import enrich_env_file

            enrich_env_file(run_dir / "env.json", device)
        dist_ctx = distributed.init(method=spec.parallel.method, rank=rank, world_size=world_size,
                                    local_rank=local_rank, device=device, emulated=emulated,
                                    timeout_s=opts.launcher.timeout_s)
        trainer, batches = _setup(spec, opts, dist_ctx, probe, record)
        record.setup_time_s = round(time.perf_counter() - t0, 3)
        run_steps(trainer, batches, probe, record, spec, opts, where)
        record.status = "ok"
    except BaseException as err:  # noqa: BLE001 - every failure becomes a record; Ctrl-C still propagates
        _record_failure(record, err, where, probe)
        if isinstance(err, KeyboardInterrupt):
            raise
    finally:
        record.host_peak_rss_bytes = host_peak_rss_bytes()
        _notes(record, emulated, probe)
        record.finalize()
        _dump_history(snapshot_path, record)
        _cleanup(trainer, probe)
        if record.status == "ok" or emulated:
            try:
                distributed.teardown()  # after a failure the peers may sit in a collective: exit instead (main)
            except Exception as err:  # noqa: BLE001 - a failed teardown must not lose the measurement
                record.notes.append(f"teardown: {type(err).__name__}: {str(err)[:200]}")
    print(f"[rank {rank}/{world_size}] {record.status} peak_allocated={record.peak_allocated_bytes} "
          f"steps={len(record.steps)} {record.error or ''}".rstrip(), flush=True)
    return record


def node_name() -> str:
    """Slurm's name for this node (set in every job step; several slurmd may share a host), else the host."""
    import socket

    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _init_device(probe, record, opts, spec_cap_bytes: int = 0) -> None:
    """Create the CUDA context, apply the memory cap (the spec's, else the options') and measure the context
    alone. The cap applied is recorded (the rows' ``memory_cap_bytes``, which the spec read back carries)."""
    import torch

    from harness.memory import cap_bytes_to_apply

    if not probe.enabled:
        return
    torch.empty(1, device=probe.device)  # the context exists from here on
    probe.reset_counters()
    record.device_total_bytes = probe.total_bytes()
    cap = cap_bytes_to_apply(spec_cap_bytes, opts.memory.cap_gib, opts.memory.cap_fraction,
                             record.device_total_bytes)
    record.memory_cap_bytes = probe.set_cap(cap) if cap else None
    record.cuda_context_bytes = probe.context_bytes()


def _start_history(probe, opts, run_dir: Path, rank: int) -> Path | None:
    """memory.snapshot on CUDA: the allocator's history from before the first allocation of this process (a
    cold-start trace) to the end; written after the last step, OOM or not."""
    from harness.memory import SNAPSHOT_SUFFIX, start_allocator_history

    if not (opts.memory.snapshot and probe.enabled):
        return None
    import torch

    torch.cuda.init()  # the allocator exists from here; recording before it would record nothing
    start_allocator_history(torch)
    return run_dir / f"rank{rank}{SNAPSHOT_SUFFIX}"


def _dump_history(path: Path | None, record) -> None:
    if path is None:
        return
    import torch

    from harness.memory import dump_allocator_history

    try:
        record.extra["snapshot_file"] = path.name
        record.extra["snapshot_bytes"] = dump_allocator_history(torch, path)
    except Exception as err:  # noqa: BLE001 - a failed dump must not lose the measurement
        record.notes.append(f"snapshot: {type(err).__name__}: {str(err)[:200]}")


def _setup(spec, opts, dist_ctx, probe, record):
    """Data for this rank's data-parallel shard, then the wrapped model and optimizer."""
    from estimator.profiler.build import effective_attn
    from harness import data, methods
    from harness.models import load_model_config

    config = load_model_config(spec.model)
    num_batches = (opts.steps.warmup + opts.steps.measured) * spec.training.grad_accum_steps
    built = data.build_batches(opts.data, model_name=opts.model.name, tokenizer_name=opts.model.tokenizer,
                               model_vocab=int(config["vocab_size"]), micro_batch_size=spec.training.micro_batch_size,
                               seq_len=spec.training.seq_len, num_batches=num_batches,
                               dp_rank=(dist_ctx.rank // spec.parallel.tp) % spec.parallel.dp, dp_size=spec.parallel.dp,
                               cache_dir=opts.paths.cache_dir, online=str(opts.data.online).lower() == "true")
    record.data = built.info
    padded = any(0 in row for batch in built.batches for row in batch["attention_mask"])
    if padded != (spec.training.batch == "padded"):
        record.notes.append(f"batch: training.batch={spec.training.batch} but the data's batches "
                            f"{'have' if padded else 'have no'} padding")
    ctx = methods.WrapContext(spec=spec, options=opts, dist=dist_ctx, config=config,
                              memory_cap_bytes=record.memory_cap_bytes)
    probe.begin()
    trainer = methods.wrap(ctx)
    record.notes.extend(ctx.notes)
    setup = probe.end("setup")
    record.setup_allocated_bytes = setup.allocated_bytes
    record.extra["setup_peak_allocated_bytes"] = setup.peak_allocated_bytes
    record.effective_attn = effective_attn(_hf_model(trainer.model))
    if record.effective_attn != spec.training.attn:  # flash-attn missing, fp32 attention, or not in the architecture
        record.notes.append(f"attention: {spec.training.attn} asked, {record.effective_attn} ran "
                            "(estimator.profiler.build.attn_implementation)")
    return trainer, built.batches


def _hf_model(model):
    """The transformers model under DDP / DeepSpeed (.module) wrappers (a DeepSpeed engine has a ``config`` of
    its own, so unwrap by ``.module`` first; peft models expose the HF config too)."""
    import torch

    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


# --------------------------------------------------------------------------------------------- steps

def run_steps(trainer, batches, probe, record, spec, opts, where: Where) -> None:
    """Warm-up + measured steps; one StepRecord per step, appended before it runs (an OOM keeps its phases)."""
    from harness.records import StepRecord

    total = opts.steps.warmup + opts.steps.measured
    accum = spec.training.grad_accum_steps
    for step in range(total):
        inject = opts.inject_oom if step == total - 1 else None
        rec = StepRecord(step=step, warmup=step < opts.steps.warmup)
        record.steps.append(rec)
        where.step = step
        _one_step(trainer, batches[step * accum:(step + 1) * accum], probe, rec, where, inject,
                  emulated=record.emulated)
        if step == 0:
            record.cuda_context_after_warmup_bytes = probe.context_bytes()
        print(f"[rank {record.rank}] step {step} loss={rec.loss:.4f} time={rec.step_time_s:.3f}s "
              f"peak_allocated={rec.peak_allocated_bytes}", flush=True)
    skipped = getattr(trainer, "skipped_steps", 0)
    if skipped:  # DeepSpeed fp16: an overflow skips the update, and with it the optimizer phase's temporaries
        record.extra["optimizer_steps_skipped"] = skipped
        record.notes.append(f"deepspeed: {skipped} of {total} optimizer updates skipped on fp16 overflow (dynamic "
                            "loss scale); the optimizer phase of those steps ran no update")


def _one_step(trainer, micro_batches, probe, rec, where: Where, inject: str | None, *, emulated: bool) -> None:
    import torch

    from harness.memory import step_peaks

    phases: dict[str, Any] = {}
    started = time.perf_counter()
    loss = None
    try:
        for index, rows in enumerate(micro_batches):
            batch = {k: torch.tensor(v, dtype=torch.long, device=probe.device) for k, v in rows.items()}
            rec.tokens += batch["input_ids"].numel()
            rec.seq_len_max = max(rec.seq_len_max, batch["input_ids"].shape[1])
            with trainer.micro_batch(is_last=index == len(micro_batches) - 1):
                loss = _phase("forward", lambda b=batch: trainer.forward(b), probe, phases, where, inject)
                _phase("backward", lambda value=loss: trainer.backward(value, 1.0 / len(micro_batches)), probe, phases,
                       where, inject)
            del batch
        _phase("optimizer", trainer.step, probe, phases, where, inject)
    finally:
        rec.phases = list(phases.values())
        for name, value in step_peaks(rec.phases).items():
            setattr(rec, name, value)
        rec.num_alloc_retries, rec.num_ooms = probe.counters()
    rec.step_time_s = round(time.perf_counter() - started, 6)
    rec.loss = float(loss.detach().float()) if loss is not None else None
    rec.tokens_per_s = None if emulated or not rec.step_time_s else rec.tokens / rec.step_time_s


def _phase(name: str, fn, probe, phases: dict, where: Where, inject: str | None):
    """Run one phase between probe.begin() and probe.end(); the phase is recorded even when it raises."""
    import torch

    from harness.memory import merge_phase

    where.phase = name
    probe.begin()
    started = time.perf_counter()
    failed = False
    try:
        out = fn()
        if inject == name:  # tests: simulate the allocator giving up at this phase
            raise torch.OutOfMemoryError(f"injected OOM at {name} (inject_oom) Tried to allocate 1.00 GiB")
        return out
    except BaseException:
        failed = True
        raise
    finally:
        try:
            phases[name] = merge_phase(phases.get(name), probe.end(name, time.perf_counter() - started))
        except Exception:  # noqa: BLE001 - reading the probe after a CUDA fault may fail too; keep the cause
            if not failed:
                raise


# --------------------------------------------------------------------------------------------- outcome

def _record_failure(record, err: BaseException, where: Where, probe) -> None:
    from harness.memory import is_oom, oom_request_bytes

    message = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"[:500]
    record.error = message
    if is_oom(err):
        record.status = "oom"
        record.oom_step, record.oom_phase = where.step, where.phase
        record.oom_request_bytes = oom_request_bytes(str(err))
        if where.step < 0 and probe is not None:  # OOM while building/wrapping: the setup peak is the datum
            _setup_oom_step(record, probe)
    else:
        record.status = "error"
        record.traceback = "".join(traceback.format_exception(err))[-4000:]


def _setup_oom_step(record, probe) -> None:
    from harness.records import StepRecord

    phase = probe.end("setup")
    record.steps.append(StepRecord(step=-1, warmup=False, phases=[phase],
                                   peak_allocated_bytes=phase.peak_allocated_bytes,
                                   peak_reserved_bytes=phase.peak_reserved_bytes,
                                   peak_active_bytes=phase.peak_active_bytes,
                                   peak_requested_bytes=phase.peak_requested_bytes,
                                   peak_device_bytes=phase.peak_device_bytes))


def _notes(record, emulated: bool, probe) -> None:
    if probe is not None and probe.counting:
        record.notes.append("memory: CPU run, allocated level counted from live tensor storages in 512-byte "
                            "blocks (memory_source counted-cpu); no reserved or device level")
    elif probe is not None and not probe.enabled:
        record.notes.append("memory: CPU run, no allocator statistics (memory_source none-cpu)")
    if probe is not None and probe.device_source:
        record.notes.append(f"memory: driver-level used memory from {probe.device_source}, sampled at phase "
                            "boundaries" + (" and by a background thread" if probe._sampler else ""))
    if emulated:
        record.notes.append("emulated rank (fake process group): allocator memory is the N-rank job's, "
                            "but no throughput and no NCCL buffers")


def _cleanup(trainer, probe) -> None:
    if trainer is not None:
        try:
            trainer.close()
        except Exception:  # noqa: BLE001 - cleanup never masks the measurement
            pass
    gc.collect()
    if probe is not None:
        try:
            probe.release()
        except Exception:  # noqa: BLE001 - after a sticky CUDA error (illegal address, device-side assert)
            pass  # empty_cache raises too; the record of that error must still be written
        probe.close()


# --------------------------------------------------------------------------------------------- fake backend

def run_fake(spec, opts, run_dir: Path):
    """``harness.fake.trace_run`` results as rank records (status ok, measured_by fake_tensor_trace)."""
    from harness.options import resolve_ranks
    from harness.records import RankRecord

    world_size = spec.parallel.world_size
    ranks = resolve_ranks(opts.emulate.ranks, world_size) if world_size > 1 else [0]
    base = dict(world_size=world_size, spec_id=spec.spec_id, run_id=run_dir.name, emulated=world_size > 1,
                measured_by="fake_tensor_trace", memory_source="fake_tensor_trace")
    try:
        from harness.fake import trace_run
        from harness.models import load_model_config

        result = trace_run(spec, ranks, config=load_model_config(spec.model),
                           steps=opts.steps.warmup + opts.steps.measured)
    except Exception as err:  # noqa: BLE001 - unsupported method, missing module: an error record per rank
        message = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        return [RankRecord(rank=r, status="error", error=message[:500],
                           traceback="".join(traceback.format_exception(err))[-4000:], **base) for r in ranks]
    return [fake_rank_record(rank, out, result, spec, opts, base)
            for rank, out in sorted(result["per_rank"].items(), key=lambda kv: int(kv[0]))]


def fake_rank_record(rank, out: dict[str, Any], result: dict[str, Any], spec, opts, base: dict[str, Any]):
    """One trace_run per-rank entry -> RankRecord (pure)."""
    from harness.fake.trace import STEADY_FROM_STEP_2
    from harness.records import PHASES, PhaseRecord, RankRecord, StepRecord

    steady_from = 1 if spec.parallel.method in STEADY_FROM_STEP_2 and len(out["step_peaks"]) > 1 else 0
    steps = []
    for index, peaks in enumerate(out["step_peaks"]):
        phases = [PhaseRecord(phase=p, peak_allocated_bytes=peaks.get(p)) for p in PHASES if p in peaks]
        steps.append(StepRecord(step=index, warmup=index < max(steady_from, opts.steps.warmup), phases=phases,
                                peak_allocated_bytes=peaks.get("peak")))
    record = RankRecord(rank=int(rank), status="ok", steps=steps, notes=list(result.get("notes", [])),
                        setup_allocated_bytes=out.get("setup_bytes"), setup_time_s=out.get("setup_s"),
                        data={"source": "synthetic_batch", "note": "fake trace: full-length random batch"},
                        extra={k: out.get(k) for k in ("breakdown_at_peak", "peak_step", "peak_phase",
                                                       "setup_peak_bytes", "local_param_numel", "trace_s")},
                        **base)
    record.finalize()
    record.peak_allocated_bytes = out["peak_allocated_bytes"]  # the oracle's steady-state figure
    return record


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # A failed rank leaves NCCL communicators whose peers are stuck in a collective: skip interpreter cleanup
    # (records are already written and fsynced) so torchrun sees the exit and stops the other ranks at once.
    if code:
        os._exit(code)
    sys.exit(0)
