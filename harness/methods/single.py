"""``single``: one GPU, no wrapper; mixed_* uses build.MasterWeightOptimizer (fp32 masters + AdamW states)."""

from __future__ import annotations

from estimator.profiler.build import build_optimizer
from harness.methods.base import TorchTrainer, WrapContext, build_on_device


def wrap(ctx: WrapContext) -> TorchTrainer:
    model = build_on_device(ctx, ctx.spec.training)
    optimizer = build_optimizer(model.parameters(), ctx.spec.training)
    return TorchTrainer(model, optimizer, ctx.spec.training, ctx.device)
