"""Where a run happened: GPU key, device, library versions, allocator config, git state (``env.json``).

GPU keys come from ``estimator.hardware.gpus.normalize_gpu_name`` (one table for the harness and the estimator).

The launcher (the Hydra process) must not create a CUDA context on a GPU the workers measure, so it reads the
device through NVML only (``detect_device``); the full capture with torch happens in the worker.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import re
import socket
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
GIB = 1024**3
# Marketed memory sizes (GB); an unknown board's key takes the one nearest its total memory in GiB.
_GENERIC_SIZES = (8, 10, 11, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 141, 192, 288)
VERSIONED_PACKAGES = ("torch", "transformers", "deepspeed", "peft", "tokenizers", "datasets", "hydra-core",
                      "accelerate", "nvidia-ml-py", "bitsandbytes", "flash-attn")


def normalize_gpu_name(name: str, total_memory_bytes: int) -> str:
    """The GPU key of a device: ``estimator.hardware.gpus.normalize_gpu_name`` (the catalogue keys, ``h100-80gb`` ...);
    ``cpu`` for the CPU. A board the catalogue does not know (the estimator says ``generic``) gets a key of its
    own, ``<model>-<GB>gb`` (``rtxa6000-48gb``), so measurements of different unknown GPUs never share a table."""
    if name.strip().lower() == "cpu":
        return "cpu"
    from estimator.hardware.gpus import GENERIC
    from estimator.hardware.gpus import normalize_gpu_name as catalogue_key

    key = catalogue_key(name, total_memory_bytes)
    return key if key != GENERIC else generic_gpu_key(name, total_memory_bytes)


def catalogue_gpu_key(name: str, total_memory_bytes: int) -> str:
    """What RunSpec.gpu says for this device: the estimator's key (``generic`` for an unknown board)."""
    from estimator.hardware.gpus import normalize_gpu_name as catalogue_key

    return "cpu" if name.strip().lower() == "cpu" else catalogue_key(name, total_memory_bytes)


def generic_gpu_key(name: str, total_memory_bytes: int) -> str:
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower())
             if w and w not in ("nvidia", "geforce", "tesla", "gpu", "generation")]
    size = min(_GENERIC_SIZES, key=lambda gb: abs(gb - total_memory_bytes / GIB))
    return f"{''.join(words[:2]) or 'gpu'}-{size}gb"


# --------------------------------------------------------------------------------------------- device

@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # cuda | cpu
    name: str
    total_memory_bytes: int | None
    count: int
    driver_version: str | None = None

    @property
    def gpu_key(self) -> str:
        """Directory / table key (unknown boards get their own)."""
        return "cpu" if self.kind == "cpu" else normalize_gpu_name(self.name, self.total_memory_bytes or 0)

    @property
    def spec_gpu(self) -> str:
        """RunSpec.gpu (the estimator's key; ``generic`` for a board it does not know)."""
        return "cpu" if self.kind == "cpu" else catalogue_gpu_key(self.name, self.total_memory_bytes or 0)


CPU_DEVICE = DeviceInfo(kind="cpu", name="cpu", total_memory_bytes=None, count=0)


@functools.lru_cache(maxsize=1)
def detect_device() -> DeviceInfo:
    """The first visible GPU through NVML (no CUDA context), else the CPU."""
    if not Path("/dev/nvidiactl").exists() and not os.environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        return CPU_DEVICE
    try:
        import pynvml

        pynvml.nvmlInit()
        handles = _visible_nvml_handles(pynvml)
        if not handles:
            return CPU_DEVICE
        name = pynvml.nvmlDeviceGetName(handles[0])
        name = name.decode() if isinstance(name, bytes) else name
        total = int(pynvml.nvmlDeviceGetMemoryInfo(handles[0]).total)
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
        return DeviceInfo(kind="cuda", name=name, total_memory_bytes=total, count=len(handles),
                          driver_version=driver)
    except Exception:  # noqa: BLE001 - no NVML library or no driver: treat as CPU
        return CPU_DEVICE


def _visible_nvml_handles(pynvml) -> list[Any]:
    count = pynvml.nvmlDeviceGetCount()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    handles = []
    for token in (t.strip() for t in visible.split(",") if t.strip()):
        if token.isdigit() and int(token) < count:
            handles.append(pynvml.nvmlDeviceGetHandleByIndex(int(token)))
        elif token.startswith(("GPU-", "MIG-")):
            handles.append(pynvml.nvmlDeviceGetHandleByUUID(token))
        else:
            break  # CUDA stops at the first invalid entry
    return handles


# --------------------------------------------------------------------------------------------- env.json

@functools.lru_cache(maxsize=1)
def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


@functools.lru_cache(maxsize=1)
def git_state() -> tuple[str | None, bool | None]:
    """(sha, dirty) of the repository the harness runs from. ``HARNESS_GIT_SHA`` with ``HARNESS_GIT_DIRTY`` (0/1),
    as the caller read them from the checkout a copy was made of, win: on a lent GPU machine the copy's own git
    state is not the checkout's (files arrive with other modes, so every script looked modified there and the
    paper chunks refused to run). Else the checkout's git, else (None, None)."""
    env_sha = os.environ.get("HARNESS_GIT_SHA", "").strip() or None
    env_dirty = os.environ.get("HARNESS_GIT_DIRTY", "").strip().lower()
    if env_sha and env_dirty:
        return env_sha, env_dirty in ("1", "true", "yes")
    try:
        sha = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(REPO_ROOT), "-c", "core.fileMode=false", "status", "--porcelain",
                                 "--untracked-files=no"], capture_output=True, text=True, timeout=10,
                                check=True).stdout
        return sha, bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        return env_sha, None


def capture_env(device: DeviceInfo | None = None, torch_device: Any = None) -> dict[str, Any]:
    """Provenance for env.json. With ``torch_device`` (in a worker) the CUDA facts come from torch."""
    device = device or detect_device()
    versions = dict(package_versions())
    sha, dirty = git_state()
    env: dict[str, Any] = {
        "hostname": socket.gethostname(), "python_version": platform.python_version(),
        "platform": platform.platform(), "captured_at": utc_now(),
        "gpu_key": device.gpu_key, "device_kind": device.kind, "gpu_name": device.name,
        "gpu_count": device.count, "total_memory_bytes": device.total_memory_bytes,
        "driver_version": device.driver_version, "compute_capability": None, "cuda_version": None,
        "nccl_version": None,
        "torch_version": versions["torch"], "transformers_version": versions["transformers"],
        "deepspeed_version": versions["deepspeed"], "versions": versions,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "slurm_nodelist": os.environ.get("SLURM_JOB_NODELIST"),
        "git_sha": sha, "git_dirty": dirty,
    }
    if torch_device is not None:
        env.update(_torch_facts(torch_device))
    return env


def enrich_env_file(path: Path, torch_device: Any) -> None:
    """Add what only a process on the device knows (compute capability, CUDA, NCCL) to env.json."""
    from harness.files import read_json, write_json

    env = read_json(path) or {}
    env.update(_torch_facts(torch_device))
    write_json(path, env)


def _torch_facts(torch_device: Any) -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {"torch_version": torch.__version__, "cuda_version": torch.version.cuda}
    device = torch.device(torch_device)
    if device.type != "cuda":
        return facts
    props = torch.cuda.get_device_properties(device)
    facts.update({"gpu_name": props.name, "total_memory_bytes": int(props.total_memory),
                  "compute_capability": f"{props.major}.{props.minor}",
                  "gpu_key": normalize_gpu_name(props.name, int(props.total_memory))})
    try:
        facts["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 - NCCL absent (e.g. ROCm/CPU builds)
        pass
    return facts


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
