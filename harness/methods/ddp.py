"""``ddp``: ``DistributedDataParallel`` with torch defaults, through ``harness.fake.wrap.apply_ddp`` (the
contract shared with the CPU oracle): 25 MiB buckets (first 1 MiB), ``gradient_as_bucket_view=False`` (grads
and buckets are separate tensors), ``device_ids=[local_rank]`` on GPUs. On the fake process group (emulated
ranks): ``init_sync=False`` and a no-op comm hook (the fake all-reduce future returns None, which DDP rejects;
NCCL all-reduces the bucket in place, so the hook changes no allocation). Gradient accumulation syncs only on
the last micro-batch (``no_sync``). mixed_*: 16-bit weights, grads and buckets; fp32 masters and AdamW states
in build.MasterWeightOptimizer.
"""

from __future__ import annotations

from estimator.profiler.build import build_optimizer
from harness.fake.wrap import apply_ddp
from harness.methods.base import TorchTrainer, WrapContext, build_on_device


def wrap(ctx: WrapContext) -> TorchTrainer:
    model = build_on_device(ctx, ctx.spec.training)
    ddp = apply_ddp(model, fake=ctx.fake_pg, device=ctx.device)
    optimizer = build_optimizer(ddp.parameters(), ctx.spec.training)
    return TorchTrainer(ddp, optimizer, ctx.spec.training, ctx.device, no_sync=ddp.no_sync)
