"""Synthetic measurement tables with planted coefficients.

Every "measured" figure is the estimator's own prediction under TRUTH (``estimate(spec, TRUTH)``), taken
apart only where reality differs from the estimate (emulated ranks hold no NCCL buffers), plus noise. This
goes through ``estimate`` with real coefficients, not through calibrate's probe, so a bug in how calibrate
extracts the analytical terms or applies the fitted ones shows up as a failed recovery.
Only shipped profiles are used (mixed_bf16 sdpa, with and without checkpointing): nothing is built.
"""

from __future__ import annotations

import csv
import dataclasses
import random
from pathlib import Path

from estimator.api import estimate
from estimator.columns import COLUMNS, spec_columns
from estimator.hardware.gpus import get_gpu
from estimator.hardware.residuals import Coefficients
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec

MIB = 1024**2
GIB = 1024**3
GPU = "h100-80gb"
TRUTH = Coefficients(gpu_key=GPU, calibrated=True, source="truth", description="planted",
                     cuda_context_bytes=600 * MIB, cublas_workspace_bytes=48 * MIB, cublas_workspaces=2,
                     reserved_slack_ratio=0.07, reserved_slack_bytes=40 * MIB,
                     nccl_bytes_per_communicator=700 * MIB, upper_bound_ratio=1.0)
MODELS = ("facebook/opt-125m", "Qwen/Qwen2.5-0.5B", "HuggingFaceTB/SmolLM2-135M")
# (method, world size, emulated): the 4-rank jobs run as emulated ranks on one GPU (no NCCL buffers)
LAYOUTS = (("single", 1, False), ("ddp", 2, False), ("fsdp", 2, False), ("zero2", 4, True), ("zero3", 4, True),
           ("fsdp", 4, True))
SHAPES = ((1, 256), (2, 512), (4, 256))


def spec_for(model: str, method: str, world: int, b: int, s: int, ckpt: bool, gpu: str = GPU) -> RunSpec:
    return RunSpec(model=model, gpu=gpu, parallel=ParallelSpec(method=method, world_size=world),
                   training=TrainingSpec(micro_batch_size=b, seq_len=s, precision="mixed_bf16", attn="sdpa",
                                         grad_ckpt=ckpt))


def grid() -> list[tuple[RunSpec, bool]]:
    out = []
    for model in MODELS:
        for i, (method, world, emulated) in enumerate(LAYOUTS):
            for j, (b, s) in enumerate(SHAPES):
                out.append((spec_for(model, method, world, b, s, ckpt=(i + j) % 2 == 1), emulated))
    return out


def _base(spec: RunSpec, run_id: str, emulated: bool, status: str = "ok") -> dict:
    row = {c: "" for c in COLUMNS}
    row.update(spec_columns(spec))
    row.update({"run_id": run_id, "spec_id": spec.spec_id, "campaign": "synthetic", "gpu_key": spec.gpu,
                "world_size": spec.parallel.world_size, "run_status": status, "rank_status": status,
                "emulated": emulated, "measured_by": "emulated_fake_pg" if emulated else "real_run",
                "memory_source": "cuda", "device_total_bytes": get_gpu(spec.gpu).capacity_bytes,
                "num_alloc_retries": 0, "num_ooms": 0, "num_steps": 2, "warmup_steps": 0, "measured_steps": 2,
                "padding": "max_length", "data_keep": "full_rows", "torch_version": "2.13.0",
                "gpu_name": "NVIDIA H100 80GB HBM3"})
    return row


def measured_rows(spec: RunSpec, emulated: bool, rng: random.Random, truth: Coefficients = TRUTH) -> list[dict]:
    est = estimate(spec, truth)
    no_nccl = estimate(spec, dataclasses.replace(truth, nccl_bytes_per_communicator=0))
    rows = []
    for rank_est, plain in zip(est.ranks, no_nccl.ranks):
        row = _base(spec, spec.spec_id + ("-emu" if emulated else ""), emulated)
        # max_memory_allocated is deterministic for a program (the caching allocator is): no noise there. The
        # replayed reserved level depends on the cuBLAS workspaces' size to the byte (2 MiB segment rounding), which
        # calibrate reads off the allocated level.
        allocated = rank_est.peak_allocated_bytes
        reserved = max(allocated, rank_est.peak_reserved_bytes + rng.randint(-4 * MIB, 4 * MIB))
        device = (plain if emulated else rank_est).peak_device_bytes + (reserved - rank_est.peak_reserved_bytes)
        device += rng.randint(0, 8 * MIB)
        row.update({"rank": rank_est.rank, "peak_allocated_bytes": allocated, "peak_reserved_bytes": reserved,
                    "peak_device_bytes": device, "step_time_s": round(rng.uniform(0.1, 1.0), 4),
                    "tokens_per_s": "" if emulated else round(rng.uniform(1e4, 5e4), 1)})
        rows.append(row)
    return rows


def oom_rows() -> list[dict]:
    """A false fit (predicted to fit, ran out of memory), an OOM the bound catches (tiny allocator cap),
    an OOM while building the model (not judged), and a run that crashed before any rank wrote."""
    false_fit = _base(spec_for("facebook/opt-125m", "single", 1, 8, 512, False), "oom-false-fit", False, "oom")
    false_fit.update({"rank": 0, "oom_step": 1, "oom_phase": "backward", "peak_allocated_bytes": 3 * GIB,
                      "peak_reserved_bytes": 3 * GIB})
    caught = _base(spec_for("Qwen/Qwen2.5-0.5B", "single", 1, 4, 512, False), "oom-caught", False, "oom")
    caught.update({"rank": 0, "oom_step": 0, "oom_phase": "forward", "memory_cap_bytes": 2 * GIB,
                   "peak_allocated_bytes": 2 * GIB - 64 * MIB, "peak_reserved_bytes": 2 * GIB})
    setup = _base(spec_for("Qwen/Qwen2.5-0.5B", "fsdp", 2, 1, 256, False), "oom-setup", False, "oom")
    setup.update({"rank": 0, "oom_step": -1, "oom_phase": "setup"})
    crashed = _base(spec_for("facebook/opt-125m", "ddp", 2, 1, 256, False), "crashed", False, "error")
    crashed.update({"rank": -1, "error": "worker died", "memory_source": "cuda"})
    return [false_fit, caught, setup, crashed]


def fake_rows(specs: list[RunSpec], truth: Coefficients = TRUTH) -> list[dict]:
    """CPU fake-tensor oracle rows (allocated bytes only, filed under gpu key ``fake``)."""
    rows = []
    for spec in specs:
        est = estimate(spec, truth)
        row = _base(spec, spec.spec_id + "-fake", False)
        row.update({"gpu_key": "fake", "measured_by": "fake_tensor_trace", "memory_source": "fake_tensor_trace",
                    "rank": 0, "peak_allocated_bytes": est.traced_allocated_bytes,
                    "device_total_bytes": "", "step_time_s": 2.5, "tokens_per_s": ""})
        rows.append(row)
    return rows


def write_table(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return path


def build(root: Path, seed: int = 0, *, with_ooms: bool = True, with_fake: bool = True) -> Path:
    """``root/<gpu>/synthetic.csv`` (+ ``root/fake/synthetic.csv``); returns root."""
    rng = random.Random(seed)
    rows = [row for spec, emulated in grid() for row in measured_rows(spec, emulated, rng)]
    if with_ooms:
        rows += oom_rows()
    write_table(root / GPU / "synthetic.csv", rows)
    if with_fake:
        singles = [spec for spec, _ in grid() if spec.parallel.method == "single"]
        write_table(root / "fake" / "synthetic.csv", fake_rows(singles))
    return root
