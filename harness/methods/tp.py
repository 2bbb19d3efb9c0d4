"""``tp`` and ``dp_tp``: tensor parallelism with ``harness.tp.apply_tp`` (per-architecture
``parallelize_module`` plans from ``estimator.tp_plans``; owned by the TP engineer), through
``harness.fake.wrap`` (the contract shared with the CPU oracle).

* ``tp``: a 1-D mesh over all ranks; decoder-layer linears split colwise/rowwise, embeddings, norms and
  lm_head replicated (every rank holds the full logits). mixed_*: 16-bit (DTensor) weights, fp32 masters in
  build.MasterWeightOptimizer.
* ``dp_tp``: 2-D mesh ``(dp, tp)`` named ("dp", "tp"), TP groups are consecutive ranks (rank r at
  ``(r // tp, r % tp)``); ``apply_tp`` over ``mesh["tp"]`` then FSDP2 over ``mesh["dp"]`` exactly as ``fsdp``
  (including its fp32-shards mixed-precision policy).

Data: all ranks of a TP group read the same micro-batches (data-parallel rank = rank // tp).

Optimizer: torch's foreach AdamW refuses a param group that mixes DTensors (split layers) and plain tensors
(the replicated embeddings, norms, lm_head of ``tp``): ``_foreach_mul_ got mixed torch.Tensor and DTensor``.
So for ``tp`` the optimizer gets two param groups, DTensors and plain tensors (each foreach call then spans
one group: the transient is per group, not per model). ``dp_tp`` needs no split (FSDP2 makes every param a
DTensor).
"""

from __future__ import annotations

import torch

from estimator.profiler.build import _inner_optimizer, build_optimizer
from harness.fake.wrap import build_training, make_mesh, wrap_model
from harness.methods.base import TorchTrainer, WrapContext, build_on_device


def _require_apply_tp() -> None:
    try:
        from harness.tp import apply_tp  # noqa: F401
    except ImportError as err:  # the TP plans live in another module; say so instead of a bare traceback
        raise NotImplementedError(f"method tp: harness.tp.apply_tp is not available ({err})") from None


def wrap(ctx: WrapContext) -> TorchTrainer:
    _require_apply_tp()
    built = build_training(ctx.spec)
    mesh = make_mesh(ctx.spec, ctx.device.type)
    model = build_on_device(ctx, built)
    model = wrap_model(model, ctx.spec, mesh, ctx.config, fake=ctx.fake_pg, device=ctx.device)
    optimizer = build_grouped_optimizer(list(model.parameters()), built)
    return TorchTrainer(model, optimizer, ctx.spec.training, ctx.device)


def _split(params: list[torch.Tensor]) -> list[dict]:
    from torch.distributed.tensor import DTensor

    dtensors = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    return [{"params": group} for group in (dtensors, plain) if group]


def build_grouped_optimizer(params: list[torch.Tensor], training):
    """build_optimizer, with DTensor and plain-tensor params in separate groups when both exist."""
    trainable = [p for p in params if p.requires_grad]
    optimizer = build_optimizer(trainable, training)
    inner = getattr(optimizer, "inner", optimizer)
    flat = getattr(optimizer, "masters", trainable)
    groups = _split(flat)
    if len(groups) < 2:
        return optimizer
    lr = inner.param_groups[0]["lr"]
    regrouped = _inner_optimizer(groups, training, lr)
    if inner is optimizer:
        return regrouped
    optimizer.inner = regrouped  # MasterWeightOptimizer: same masters, grouped inner optimizer
    optimizer.param_groups, optimizer.state = regrouped.param_groups, regrouped.state
    return optimizer


wrap_dp_tp = wrap  # the mesh shape and the FSDP step over "dp" come from the spec's method
