"""The live-storage oracle (``harness.fake.live_storage``) counts a wrapper subclass's inner tensors, never the
wrapper: the functional collectives' AsyncCollectiveTensor and DTensor hold no memory of their own."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from harness.fake.live_storage import LiveStorages

ELEMENTS = 4096
BYTES = 4 * ELEMENTS  # fp32


def test_an_async_collective_tensor_counts_its_elem_once():
    """A row-wise all-reduce's result under the functional collectives: the wrapper's own storage reports the
    16 KiB of its ``elem`` and holds nothing (the oracle counted it, 32 KiB for 16 KiB, before)."""
    elem = torch.zeros(ELEMENTS)
    wrapper = AsyncCollectiveTensor(elem)
    mode = LiveStorages()
    mode.add(wrapper)
    mode.add(elem)
    assert mode.live_bytes() == BYTES


def test_a_dtensor_counts_its_local_shard():
    """A DTensor sharded over 2 fake ranks: its local shard (half the global size), not the wrapper's global size."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        local = torch.zeros(ELEMENTS // 2)
        sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        assert sharded.untyped_storage().nbytes() == BYTES  # the wrapper's: the global size
        mode = LiveStorages()
        mode.add(sharded)
        mode.add(local)
        assert mode.live_bytes() == BYTES // 2
    finally:
        dist.destroy_process_group()
