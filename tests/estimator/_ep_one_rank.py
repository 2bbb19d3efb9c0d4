"""A real one-rank FSDP2 unit (the experts of ep == world, transformers' ``set_gradient_divide_factor``), run in a
spawned interpreter by tests/estimator/test_reserved_ep.py: its storages recorded, FSDP2's resizes as blocks."""

from __future__ import annotations

import os

SHAPES = ((96, 64), (32, 96))  # two bf16 weights, model order


def one_rank_events(port: int, mixed: bool = False) -> list[tuple]:
    """``mixed``: fp32 shards, bf16 compute, fp32 reduction (FSDP2's ``MixedPrecisionPolicy``); else bf16."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param as param_mod
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_mod

    from estimator.profiler.trace import StorageRecorder
    from tests.estimator.test_reserved_fsdp import StorageResizes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        experts = torch.nn.Sequential(*(torch.nn.Linear(cols, rows, bias=False) for rows, cols in SHAPES))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if not mixed:
            experts, policy = experts.to(torch.bfloat16), MixedPrecisionPolicy()
        fully_shard(experts, mesh=init_device_mesh("cpu", (1,)), reshard_after_forward=True, mp_policy=policy)
        experts.set_gradient_divide_factor(2.0)
        rec = StorageRecorder()
        resizes = StorageResizes(rec)
        alloc_storage, free_storage = param_mod.alloc_storage, param_mod.free_storage

        def alloc_recorded(tensor):
            resizes.allocated(tensor, tensor.numel() * tensor.itemsize)
            alloc_storage(tensor)

        def free_recorded(tensor):
            resizes.freed(tensor)
            free_storage(tensor)

        param_mod.alloc_storage, param_mod.free_storage = alloc_recorded, free_recorded
        group_mod.alloc_storage = alloc_recorded
        x = torch.randn(8, SHAPES[0][1], dtype=torch.float32 if mixed else torch.bfloat16)
        for step in range(2):  # the second step is the one compared (the first makes the unsharded storages)
            with rec:
                rec.mark(f"forward{step}")
                y = experts(x)
                loss = y.float().pow(2).sum()
                rec.mark(f"backward{step}")
                loss.backward()
                rec.mark(f"end{step}")
                del y, loss
                for p in experts.parameters():
                    p.grad = None
        sizes = rec.timeline.sizes
        return [event if event[0] == "m" else (event[0], event[1], sizes[event[1]], event[1] >= 1 << 40)
                for event in rec.timeline.events]
    finally:
        param_mod.alloc_storage, param_mod.free_storage = alloc_storage, free_storage
        group_mod.alloc_storage = alloc_storage
        dist.destroy_process_group()
