"""Process-group setup for a rank: real (torchrun: NCCL on GPUs, gloo on CPU), emulated (torch's fake
process group: allocations real, collectives no-ops) or none (method ``single``).

Emulation follows docs/../env-recipes.md §3: ``FakeStore`` + backend ``fake``; DeepSpeed additionally needs
RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* in the environment (set here) and two patches (in methods/deepspeed.py).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    emulated: bool
    backend: str | None  # nccl | gloo | fake | None (no process group)

    @property
    def device_type(self) -> str:
        return self.device.type


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) when started by torchrun / srun torchrun, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    return None


def pick_device(backend: str, local_rank: int) -> torch.device:
    if backend == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("backend: cuda requested but torch sees no GPU")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init(*, method: str, rank: int, world_size: int, local_rank: int, device: torch.device, emulated: bool,
         timeout_s: float = 1800.0) -> DistContext:
    """Initialise the process group this rank needs (none for ``single`` on one GPU)."""
    ctx = DistContext(rank=rank, world_size=world_size, local_rank=local_rank, device=device, emulated=emulated,
                      backend=None)
    if method == "single" and world_size == 1:
        return ctx
    timeout = timedelta(seconds=timeout_s)
    if emulated:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers backend "fake"

        _set_rank_env(rank, world_size, local_rank=0)
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size, timeout=timeout)
        ctx.backend = "fake"
        return ctx
    backend = "nccl" if device.type == "cuda" else "gloo"
    if torchrun_env() is None:  # a one-rank job of a distributed method, started without torchrun
        _set_rank_env(rank, world_size, local_rank)
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    else:
        kwargs = {"device_id": device} if device.type == "cuda" and bind_device_id(torch.__version__) else {}
        dist.init_process_group(backend, timeout=timeout, **kwargs)
    ctx.backend = backend
    return ctx


def bind_device_id(torch_version: str) -> bool:
    """Whether to pass ``device_id`` to ``init_process_group`` (eager NCCL init on this rank's GPU; the device is
    set either way). Not in 2.6.0 < torch < 2.7.1, where it makes NCCL collectives hang at random
    (pytorch/pytorch#153960): DeepSpeed's own init skips it there too (deepspeed/comm/torch.py)."""
    from packaging.version import Version

    return not Version("2.6.0") < Version(torch_version) < Version("2.7.1")


def _set_rank_env(rank: int, world_size: int, local_rank: int) -> None:
    # DeepSpeed and device-mesh helpers read these even when the group is created by hand.
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
                       "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1")})
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def teardown() -> None:
    """Destroy the group (and DeepSpeed's handle on it) so the next emulated rank starts clean."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    try:
        import sys

        comm = sys.modules.get("deepspeed.comm.comm")
        if comm is not None:
            comm.cdb = None
    except Exception:  # noqa: BLE001 - DeepSpeed internals are best effort
        pass
