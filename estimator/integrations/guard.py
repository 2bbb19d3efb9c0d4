"""Check a run before its first step, record its measured peaks after a few: the core every integration uses.

``MemoryGuard.check(model, optimizer, ...)`` predicts this rank's peak for the spec the job really runs and
logs it; when the run will not fit it warns, or with ``stop_if_oom=True`` raises ``WillNotFitError`` before
the first step. ``MemoryGuard.step()`` after each optimizer step reads the peaks since the previous call;
after ``warmup_steps + measured_steps`` steps the rank writes its row (``estimator.integrations.record``).
Opt-in (nothing is written without ``record_dir``) and fail-safe: any other failure is logged once and the
guard turns itself off; the user's training continues.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from estimator.integrations import live
from estimator.integrations.memory import MemoryReader, default_reader

LOG = logging.getLogger("estimator.integrations")
GIB = 1024**3
# CPU runs are predicted for this GPU (the allocated level is the comparable one), as the CLI does for CPU runs.
CPU_PREDICT_GPU = "h100-80gb"


class WillNotFitError(RuntimeError):
    """Raised by ``check`` with ``stop_if_oom=True`` when the predicted peak exceeds the device."""


class MemoryGuard:
    def __init__(self, record_dir: str | Path | None = None, *, gpu: str | None = None, stop_if_oom: bool = False,
                 warmup_steps: int = 1, measured_steps: int = 2, campaign: str = "my-runs",
                 memory_reader: MemoryReader | None = None, coefficients: Any = None) -> None:
        self.record_dir = Path(record_dir) if record_dir else None
        self.gpu = gpu
        self.stop_if_oom = stop_if_oom
        self.warmup_steps = max(0, int(warmup_steps))
        self.measured_steps = max(1, int(measured_steps))
        self.campaign = campaign
        self.reader = memory_reader
        self.coefficients = coefficients
        self.estimate = None
        self.report = None
        self.spec = None
        self.steps: list[dict[str, Any]] = []
        self.active = True
        self.recorded: Path | None = None
        self._run_id = ""
        self._last_step_s: float | None = None

    # ------------------------------------------------------------------ before the first step
    def check(self, model: Any, optimizer: Any = None, *, training_args: Any = None,
              settings: dict[str, Any] | None = None) -> Any:
        """Predict this rank's peak; returns the ``Estimate`` (None when the prediction failed: logged)."""
        try:
            self.spec, self.report, measured_key = self._spec(model, optimizer, training_args, settings or {})
            from estimator.api import estimate

            self.estimate = estimate(self.spec, self.coefficients)
            self._measured_key = measured_key
        except Exception as err:  # noqa: BLE001 - never break the user's run
            self._disable(f"memory check skipped: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
            return None
        self._announce()
        self._start(model)
        return self.estimate

    def _spec(self, model: Any, optimizer: Any, training_args: Any, given: dict[str, Any]):
        from estimator.configs import spec_from_data, spec_from_readings

        gpu_key, _, _ = live.device_gpu_key()
        # A non-catalogue model's config.json: beside the records, or in a temporary folder (never the cwd).
        folder = self.record_dir / "models" if self.record_dir else Path(tempfile.gettempdir()) / "llmem-models"
        flags: dict[str, Any] = {"model": live.model_reference(model, folder), "world_size": live.world_size(),
                                 **live.model_facts(model), **live.fsdp1_facts(model)}
        if live.outputs_fp32(model):
            flags["outputs_fp32"] = True
        name = live.optimizer_name(optimizer) if optimizer is not None else None
        if name:
            flags["optimizer"] = name
        flags["gpu"] = (self.gpu or gpu_key or CPU_PREDICT_GPU).lower()
        flags.update({k: v for k, v in given.items() if v is not None})
        if training_args is not None:
            resolved = getattr(getattr(training_args, "hf_deepspeed_config", None), "config", None)
            if isinstance(resolved, dict):
                flags["deepspeed"] = resolved  # "auto" already filled in by the Trainer
            spec, report = spec_from_data("hf", "TrainingArguments", training_args.to_dict(), flags)
        else:
            spec, report = spec_from_readings([], flags)
        return spec, report, gpu_key or "cpu"

    def _announce(self) -> None:
        est, rank = self.estimate, live.rank()
        line = (f"rank {rank}: predicted peak {est.peak_allocated_bytes / GIB:.2f} GiB allocated, "
                f"{est.peak_device_bytes / GIB:.2f} GiB on the device (bound {est.upper_bound_bytes / GIB:.2f}) "
                f"of {est.capacity_bytes / GIB:.2f} GiB ({est.spec.parallel.method}, world "
                f"{est.spec.parallel.world_size}, micro-batch {est.spec.training.micro_batch_size}, seq "
                f"{est.spec.training.seq_len}, {est.spec.training.precision})")
        LOG.info(line)
        for item in self.report.assumed + self.report.not_modelled:
            LOG.info("memory estimate: %s", item)
        if not est.fits:
            message = (f"{line}: this run will likely run out of GPU memory "
                       "(python -m estimator plan suggests a layout that fits)")
            if self.stop_if_oom:
                raise WillNotFitError(message)
            LOG.warning(message)

    def _start(self, model: Any) -> None:
        if self.record_dir is None:
            return
        try:
            self.reader = self.reader or default_reader()
            if self.reader is None:
                self._disable("memory recording off: no CUDA device and no memory reader given")
                return
            self._run_id = self._new_run_id()
            self.reader.start(model)
            self._last_step_s = time.perf_counter()
        except Exception as err:  # noqa: BLE001
            self._disable(f"memory recording off: {type(err).__name__}: {err}")

    def _new_run_id(self) -> str:
        """One id for every rank of the job: rank 0's random token, broadcast when a process group exists."""
        token = [uuid.uuid4().hex[:8]]
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.broadcast_object_list(token, src=0)
        except Exception:  # noqa: BLE001 - ranks then record under their own ids
            pass
        return f"{self.spec.spec_id}-{hashlib.sha256(token[0].encode()).hexdigest()[:8]}"

    # ------------------------------------------------------------------ after each optimizer step
    def step(self) -> None:
        """Call after each optimizer step (the HF and Lightning callbacks do)."""
        if not self.active or self.reader is None or self.record_dir is None or self.recorded:
            return
        try:
            now = time.perf_counter()
            peaks = self.reader.read()
            self.reader.reset()
            self.steps.append({**peaks, "step_time_s": now - (self._last_step_s or now),
                               "warmup": len(self.steps) < self.warmup_steps})
            self._last_step_s = now
            if len(self.steps) >= self.warmup_steps + self.measured_steps:
                self._record()
        except Exception as err:  # noqa: BLE001
            self._disable(f"memory recording off: {type(err).__name__}: {err}")

    def _record(self) -> None:
        from estimator.integrations.record import environment, table_row, write_json, write_row

        measured = [s for s in self.steps if not s["warmup"]]
        peaks = {k: _max(s.get(k) for s in measured) for k in ("peak_allocated_bytes", "peak_reserved_bytes",
                                                                "peak_device_bytes")}
        peaks["device_total_bytes"] = _max(s.get("device_total_bytes") for s in measured)
        times = [s["step_time_s"] for s in measured if s["step_time_s"]]
        env = environment()
        rank = live.rank()
        spec = self.spec if self._measured_key != "cpu" else self.spec.replace(gpu="cpu")
        row = table_row(spec, run_id=self._run_id, campaign=self.campaign, gpu_key=self._measured_key, rank=rank,
                        memory_source=self.reader.source, peaks=peaks, steps=len(self.steps),
                        warmup_steps=self.warmup_steps, step_time_s=sum(times) / len(times) if times else None,
                        env=env)
        self.recorded = write_row(self.record_dir, self.campaign, row)
        write_json(self.record_dir, self._run_id, rank, {
            "row": row, "spec": self.spec.to_dict(), "prediction": self.estimate.to_dict(),
            "configs": self.report.to_dict(), "steps": self.steps, "environment": env})
        predicted = self.estimate.peak_allocated_bytes
        if self._measured_key == "cpu":  # CPU runs lack the cuBLAS workspace and block rounding (as the CLI compares)
            predicted = self.estimate.traced_allocated_bytes
        measured_alloc = peaks["peak_allocated_bytes"]
        if measured_alloc:
            LOG.info("rank %d: measured peak %d bytes allocated vs predicted %d (%+.1f %%); recorded in %s",
                     rank, measured_alloc, predicted, 100 * (predicted - measured_alloc) / measured_alloc,
                     self.recorded)
        self.close()

    def close(self) -> None:
        try:
            if self.reader is not None:
                self.reader.close()
        except Exception as err:  # noqa: BLE001
            LOG.warning("memory reader close failed: %s", err)

    def _disable(self, message: str) -> None:
        self.active = False
        LOG.warning(message)
        self.close()


def _max(values) -> int | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def check_memory(model: Any, optimizer: Any = None, *, micro_batch_size: int, seq_len: int,
                 grad_accum_steps: int = 1, loop: str = "manual", record_dir: str | Path | None = None,
                 **guard_options: Any) -> MemoryGuard:
    """For a hand-written loop: predict now (warn, or raise ``WillNotFitError`` with ``stop_if_oom=True``) and
    return the guard; call ``guard.step()`` after each ``optimizer.step()`` to record the measured peaks."""
    guard = MemoryGuard(record_dir, **guard_options)
    guard.check(model, optimizer, settings={"micro_batch_size": micro_batch_size, "seq_len": seq_len,
                                             "grad_accum_steps": grad_accum_steps, "loop": loop})
    return guard
