"""``tp`` and ``dp_tp``: tensor parallelism with ``estimator.profiler.tp.apply_tp`` (per-architecture
``parallelize_module`` plans from ``estimator.models.tp_plans``), through ``harness.fake.wrap`` (the contract shared with
the CPU oracle and the estimator's TP profiles).

* ``tp``: a 1-D mesh over all ranks; decoder-layer linears split colwise/rowwise, embeddings, norms and
  lm_head replicated (every rank holds the full logits). mixed_*: 16-bit (DTensor) weights, fp32 masters in
  build.MasterWeightOptimizer.
* ``dp_tp``: 2-D mesh ``(dp, tp)`` named ("dp", "tp"), TP groups are consecutive ranks (rank r at
  ``(r // tp, r % tp)``); ``apply_tp`` over ``mesh["tp"]`` then FSDP2 over ``mesh["dp"]`` exactly as ``fsdp``
  (including its fp32-shards mixed-precision policy).

Data: all ranks of a TP group read the same micro-batches (data-parallel rank = rank // tp).

Initialisation: ``build_sharded`` (parameters on meta, split, then materialised and initialised on the device; a
tied embedding and head re-tied after ``to_empty``), as ``fsdp``.

Optimizer: ``harness.fake.wrap.build_method_optimizer``, as the oracle and the estimator build it. torch's
foreach AdamW refuses one list that mixes DTensors (split layers) and plain tensors (the replicated embeddings,
norms, lm_head of ``tp``): ``got mixed torch.Tensor and DTensor``. So ``tp`` runs one optimizer per kind,
DTensors first, then plain tensors, stepped in that order (``estimator.profiler.tp.OptimizerChain``; under
mixed_* each is a MasterWeightOptimizer over its own params). ``dp_tp`` needs no split (FSDP2 makes every param
a DTensor).
"""

from __future__ import annotations

from harness.fake.wrap import build_method_optimizer, build_training, make_mesh, wrap_model
from harness.methods.base import TorchTrainer, WrapContext, build_sharded, unsynced_micro_batch


def wrap(ctx: WrapContext) -> TorchTrainer:
    built = build_training(ctx.spec)
    mesh = make_mesh(ctx.spec, ctx.device.type)
    model = build_sharded(ctx, built, lambda m: wrap_model(m, ctx.spec, mesh, ctx.config, fake=ctx.fake_pg,
                                                           device=ctx.device))
    optimizer = build_method_optimizer(model, ctx.spec)
    no_sync = unsynced_micro_batch(model, ctx.spec.parallel.method, ctx.spec.training.grad_sync)  # dp_tp
    return TorchTrainer(model, optimizer, ctx.spec.training, ctx.device, no_sync=no_sync)


wrap_dp_tp = wrap  # the mesh shape and the FSDP step over "dp" come from the spec's method
