"""``fsdp``: FSDP2 (``fully_shard``), through ``harness.fake.wrap`` (the contract shared with the CPU oracle).

What the estimator needs to know, exactly:

* Sharding: ``fully_shard(layer, mesh=mesh, mp_policy=mp)`` on every decoder layer in order (the layer list of
  ``harness.tp.decoder_layers``), then ``fully_shard(model, ...)`` on the root; embeddings, final norm and
  lm_head belong to the root group. FSDP2 defaults otherwise: ``reshard_after_forward=True`` (the root keeps
  its parameters unsharded between forward and backward), no CPU offload.
* Precision: ``fp32`` / ``bf16`` build the model in that dtype, no policy. ``amp_*``: fp32 model, forward under
  ``torch.autocast``. ``mixed_bf16`` / ``mixed_fp16``: the model is built in **fp32** and the fp32 shards are
  the master weights; ``MixedPrecisionPolicy(param_dtype=bf16|fp16, reduce_dtype=fp32)`` all-gathers 16-bit
  copies for forward/backward, upcasts the 16-bit unsharded grads to fp32 for the reduce-scatter and leaves
  fp32 sharded grads. AdamW (torch, foreach) steps the fp32 shards directly: no MasterWeightOptimizer, no
  autocast, no GradScaler.
* The optimizer is built after sharding, on the sharded DTensor parameters.
* ``parallel.ep > 1`` (a mixture-of-experts model): transformers' own expert parallelism (``harness.ep``): each
  rank owns num_experts / ep experts, tokens go to them all-to-all, each experts module is an FSDP2 unit on the
  world / ep ranks holding the same experts; the rest is sharded as above.
* ``parallel.cp > 1``: torch's context parallelism (``harness.cp``): FSDP2 as above over every rank (dp x cp),
  each micro-batch's forward and backward inside ``context_parallel`` over the (dp, cp) mesh's cp axis (GPUs
  only).
* Initialisation (``build_sharded``): parameters on the meta device, ``fully_shard``, then ``to_empty`` on the
  rank's device and the model's own init; buffers computed on the host and copied in. No rank holds the whole
  model (torchtitan's recipe); the step peaks are what a full-size build then sharding gives, byte for byte.
"""

from __future__ import annotations

from estimator.profiler.build import build_optimizer
from harness.fake.wrap import build_training, make_mesh, wrap_model
from harness.methods.base import TorchTrainer, WrapContext, build_sharded, unsynced_micro_batch


def wrap(ctx: WrapContext) -> TorchTrainer:
    if ctx.spec.parallel.cp > 1:
        from harness.cp import check_device

        check_device(ctx.device, ctx.fake_pg)  # before building anything: CP has no CPU path
    built = build_training(ctx.spec)  # fp32 weights for mixed_* (the shards are the masters)
    if ctx.spec.parallel.ep > 1:  # transformers' own expert parallelism (harness.ep)
        model = build_sharded(ctx, built, lambda m: _expert_parallel(ctx, m))
    else:
        mesh = make_mesh(ctx.spec, ctx.device.type)
        model = build_sharded(ctx, built, lambda m: wrap_model(m, ctx.spec, mesh, ctx.config, fake=ctx.fake_pg,
                                                               device=ctx.device))
    optimizer = build_optimizer(model.parameters(), built)
    # Forward uses the spec's precision: autocast for amp_* and under accelerate's wrapper (outputs_fp32); mixed_*
    # casts through the FSDP policy.
    no_sync = unsynced_micro_batch(model, ctx.spec.parallel.method, ctx.spec.training.grad_sync)
    if ctx.spec.parallel.cp > 1:
        from harness.cp import ContextParallelTrainer, cp_mesh

        mesh = cp_mesh(ctx.device.type, ctx.spec.parallel.world_size, ctx.spec.parallel.cp)
        return ContextParallelTrainer(model, optimizer, ctx.spec.training, ctx.device, no_sync=no_sync, mesh=mesh)
    return TorchTrainer(model, optimizer, ctx.spec.training, ctx.device, no_sync=no_sync)


def _expert_parallel(ctx: WrapContext, model):
    """``parallel.ep > 1``: the experts sharded and dispatched by transformers (``harness.ep.distribute``), each
    experts module an FSDP2 unit on the efsdp mesh, the dense part FSDP2 per decoder layer and root as above. The
    all-to-all exchanges real split sizes, so a fake process group cannot run it."""
    from harness.ep import distribute

    if ctx.fake_pg:
        raise ValueError("ep: expert parallelism exchanges tokens all-to-all; it needs real process groups "
                         "(gloo on CPU, NCCL on GPUs), not the emulated ranks")
    return distribute(model, ctx.spec.parallel.world_size, ctx.spec.parallel.ep, ctx.spec.training.precision)
