"""``fsdp1``: ``FullyShardedDataParallel`` (FSDP1, flat parameters), through ``harness.fake.wrap.apply_fsdp1``
(the contract shared with the CPU oracle).

What the estimator needs to know, exactly:

* Units: one FSDP unit per decoder layer (``ModuleWrapPolicy`` over the decoder-layer class, as accelerate's
  ``TRANSFORMER_BASED_WRAP`` builds it), the root unit holding embeddings, final norm and lm_head. Every other
  setting comes from ``spec.parallel.fsdp1`` (sharding strategy, ``use_orig_params``, parameter offload,
  backward/forward prefetch, ``limit_all_gathers``; HYBRID_SHARD over a (nodes, gpus_per_node) mesh).
* Precision: as ``fsdp``: ``mixed_*`` builds fp32 weights (the flat shards are the masters) and all-gathers
  16-bit copies through ``MixedPrecision(param_dtype, reduce_dtype=fp32)``; ``fp32``/``bf16`` no policy.
* Initialisation: the model is built on the host, then FSDP moves it to the rank's device one unit at a time
  as it flattens and shards (``device_id``), so no rank holds the whole model on the GPU: what accelerate and
  the Trainer do with a CPU-loaded model. The optimizer is built after wrapping, on the flat (or, with
  ``use_orig_params``, the original-shaped view) parameters.
* LoRA: peft's ``fsdp_auto_wrap_policy`` (each adapter Linear its own unit), or with ``lora_wrap`` "layer" the
  adapters inside their layer's unit, built in the layer's 16-bit dtype (Lightning's bf16-true LitGPT runs).
* Gradient accumulation: every micro-batch reduce-scatters, or with ``training.grad_sync=last`` only the last
  (``no_sync()`` on the others, as the HF Trainer runs it: unsharded flat gradients held in between).
"""

from __future__ import annotations

import torch

from estimator.models.profiles import run_adapters_in_16bit
from estimator.profiler.build import build_model, build_optimizer, lora_adapters_16bit
from harness.fake.wrap import build_training, make_mesh, wrap_model
from harness.methods.base import TorchTrainer, WrapContext, unsynced_micro_batch


def wrap(ctx: WrapContext) -> TorchTrainer:
    training = build_training(ctx.spec)  # fp32 weights for mixed_* (the flat shards are the masters)
    torch.manual_seed(ctx.options.seed)  # equal replicas on every rank (FSDP1 does not broadcast by default)
    with lora_adapters_16bit(run_adapters_in_16bit(ctx.spec)):  # adapters inside a 16-bit layer unit: 16-bit
        model = build_model(ctx.config, training, "cpu")
    if ctx.options.model.pretrained:
        from harness.weights import load_pretrained

        ctx.notes.append(load_pretrained(model, ctx.options.model.name))
    mesh = make_mesh(ctx.spec, ctx.device.type)
    model = wrap_model(model, ctx.spec, mesh, ctx.config, fake=ctx.fake_pg, device=ctx.device)
    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], training)
    no_sync = unsynced_micro_batch(model, ctx.spec.parallel.method, ctx.spec.training.grad_sync)
    return TorchTrainer(model, optimizer, ctx.spec.training, ctx.device, no_sync=no_sync)
