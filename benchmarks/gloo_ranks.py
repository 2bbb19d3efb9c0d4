"""Real CPU ranks on gloo for the oracles that count every live storage (expert parallelism, pipelines): joining
the process group in a freshly spawned interpreter, a free port for it, and the storage counter that leaves out
what gloo allocates and NCCL, the estimate's backend, does not."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join(rank: int, world: int, port: int):
    """This spawned interpreter as gloo rank ``rank`` of ``world`` (one CPU thread); returns ``torch.distributed``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    sys.path.insert(0, str(REPO))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return dist


def nccl_live_storages_class():
    import torch
    from torch.utils._pytree import tree_flatten

    from harness.fake.live_storage import LiveStorages

    class NcclLiveStorages(LiveStorages):
        """``LiveStorages`` less gloo's own reduce-scatter buffer: ``ProcessGroupGloo`` reduce-scatters a clone of
        the whole input (all-reduced, then split into the output), which NCCL, the estimate's backend, does not
        allocate; the clone first shows up as the argument of the split that follows the collective."""

        def __init__(self) -> None:
            super().__init__()
            self.clone_key: int | None = None  # the clone's storage while gloo splits it and copies out of it

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.c10d._reduce_scatter_base_.default:
                self.clone_key = -1  # the next split's input is the clone
            elif self.clone_key == -1 and func is torch.ops.aten.split.Tensor:
                self.clone_key = args[0].untyped_storage()._cdata
            elif self.clone_key is not None and func is not torch.ops.aten.copy_.default:
                self.clone_key = None  # gloo's copy-out is over; the clone is gone
            for item in tree_flatten((out, args, kwargs))[0]:
                if isinstance(item, torch.Tensor) and item.untyped_storage()._cdata == self.clone_key:
                    continue  # the clone: never added, hence never counted
                if isinstance(item, torch.Tensor):
                    self.add(item)
            self.peak_bytes = max(self.peak_bytes, self.live_bytes())
            return out

    return NcclLiveStorages
