"""How each torch-native method wraps the model: the contract between the CPU oracle and the real harness.

The oracle (``harness.fake.trace``) calls these with ``fake=True`` on a fake process group; the harness worker
should call them (or do exactly the same) with ``fake=False`` on NCCL, so that both trace the same program.

Methods (``spec.parallel.method``), N = world size:

``single``
    The model from ``estimator.profiler.build.build_model``; the optimizer from ``build_optimizer``.
``ddp``
    ``DistributedDataParallel(model)`` with torch defaults: ``bucket_cap_mb=25`` (first bucket 1 MiB),
    ``gradient_as_bucket_view=False`` (param ``.grad`` and the flat buckets are separate tensors, so a rank
    holds grads + buckets), ``find_unused_parameters=False``, ``broadcast_buffers=True``. Real runs:
    ``device_ids=[local_rank]``. Fake runs add ``init_sync=False`` (no data to broadcast) and a no-op comm hook
    (the fake PG's all-reduce future returns None, which DDP rejects); NCCL all-reduce is in place on the
    bucket, so the no-op hook changes no allocation. Fake runs also skip DDP's bucket rebuild (2nd iteration):
    it writes a tensor's data in C++ (impossible on fake tensors) and only regroups the same bytes.
    Gradient accumulation: ``no_sync()`` on every micro-batch but the last.
``fsdp``
    FSDP2: ``fully_shard(layer, mesh=mesh, mp_policy=mp)`` on every decoder layer in order, then
    ``fully_shard(model, mesh=mesh, mp_policy=mp)`` on the root (embeddings, final norm, lm_head and anything
    outside the layers go to the root group); defaults otherwise (``reshard_after_forward=True``; FSDP2 keeps the
    root's parameters unsharded between forward and backward). The optimizer is built on ``model.parameters()``
    after sharding (the sharded DTensors). Gradient accumulation: every micro-batch reduce-scatters (no
    ``set_requires_gradient_sync(False)``).
``tp``
    ``estimator.profiler.tp.apply_tp(model, mesh_1d(N), config)`` (see ``estimator.models.tp_plans``). Optimizer: foreach AdamW
    cannot take DTensor (split) and plain (replicated: embeddings, norms, lm_head) tensors in one list (torch
    raises "got mixed torch.Tensor and DTensor"), so ``build_method_optimizer`` builds one optimizer per kind
    (DTensor params first, then plain ones) and steps them in that order (``estimator.profiler.tp
    .build_tp_optimizer``, ``OptimizerChain``; foreach temporaries and mixed_* grad conversion per optimizer).
``dp_tp``
    2-D mesh ``init_device_mesh(dev, (dp, tp), mesh_dim_names=("dp", "tp"))``; rank r sits at
    ``(r // tp, r % tp)`` (TP groups are consecutive ranks). ``apply_tp`` over ``mesh["tp"]``, then FSDP2 exactly as
    ``fsdp`` over ``mesh["dp"]``.

Optimizer, every method: ``build_method_optimizer(model, spec)`` (= ``build.build_optimizer`` over the wrapped
model's trainable parameters, split in two for ``tp``), built after wrapping.

Precision (``spec.training.precision``) per method:

* ``fp32``: fp32 weights, grads and AdamW states. ``bf16``: everything bf16 (no master copy; FSDP2 without a
  mixed-precision policy). ``amp_bf16`` / ``amp_fp16``: fp32 weights, grads, states; forward under
  ``torch.autocast(dtype)``.
* ``mixed_bf16`` / ``mixed_fp16`` for ``single``/``ddp``/``tp``: 16-bit model weights and grads; fp32 masters
  and AdamW states in ``build.MasterWeightOptimizer`` (DDP buckets are 16-bit).
* ``mixed_bf16`` / ``mixed_fp16`` for ``fsdp``/``dp_tp``: the model is built in **fp32** and sharded; the fp32
  shards are the master weights and AdamW steps them directly (no MasterWeightOptimizer);
  ``MixedPrecisionPolicy(param_dtype=bfloat16|float16, reduce_dtype=float32)`` (``output_dtype=None``,
  ``cast_forward_inputs=True``): FSDP2 casts each shard to 16 bits into the all-gather buffer, runs forward and
  backward with 16-bit unsharded params, upcasts the 16-bit unsharded grads to fp32 for the reduce-scatter,
  and leaves fp32 sharded grads. No autocast. (No GradScaler for fp16 anywhere.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from estimator.profiler.tp import OptimizerChain  # noqa: F401  (re-exported: it moved there)
from estimator.spec import FSDP_METHODS, RunSpec, TrainingSpec

FSDP2_METHODS = ("fsdp", "dp_tp")
TORCH_METHODS = ("single", "ddp", "fsdp", "fsdp1", "tp", "dp_tp")
# Methods whose mixed_* precision is fp32 shards + a 16-bit compute policy (no MasterWeightOptimizer).
SHARDED_MASTER_METHODS = FSDP_METHODS


def _fp32_variant(training: TrainingSpec) -> TrainingSpec:
    """Same spec with fp32 weights and a plain optimizer (amp_* builds fp32 weights; no autocast is applied
    because the forward uses the original spec)."""
    return dataclasses.replace(training, precision="amp_fp16" if training.precision == "mixed_fp16" else "amp_bf16")


def build_training(spec: RunSpec) -> TrainingSpec:
    """Training spec to pass to ``build_model`` and ``build_optimizer`` for this method."""
    if spec.parallel.method in SHARDED_MASTER_METHODS and spec.training.precision.startswith("mixed_"):
        return _fp32_variant(spec.training)
    return spec.training


def fsdp_mp_policy(training: TrainingSpec):
    """FSDP2 MixedPrecisionPolicy for mixed_*; None otherwise."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if training.precision == "mixed_bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if training.precision == "mixed_fp16":
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    return None


def build_method_optimizer(model: nn.Module, spec: RunSpec, lr: float = 1e-5):
    """``build.build_optimizer`` over the wrapped model's trainable params, split by kind for ``tp``
    (``estimator.profiler.tp.build_tp_optimizer``: the estimator's TP profiles build it the same way)."""
    from estimator.profiler.build import build_optimizer
    from estimator.profiler.tp import build_tp_optimizer

    training = build_training(spec)
    if spec.parallel.method == "tp":
        return build_tp_optimizer(model.parameters(), training, lr)
    return build_optimizer([p for p in model.parameters() if p.requires_grad], training, lr)


def make_mesh(spec: RunSpec, device_type: str):
    """DeviceMesh for the method (None for single/ddp). Create it *outside* FakeTensorMode."""
    from torch.distributed.device_mesh import init_device_mesh

    method, n = spec.parallel.method, spec.parallel.world_size
    if method == "fsdp":
        return init_device_mesh(device_type, (n,))
    if method == "fsdp1" and spec.parallel.fsdp1.sharding_strategy == "HYBRID_SHARD":
        shard = spec.parallel.fsdp1.shard_size(n)
        return init_device_mesh(device_type, (n // shard, shard), mesh_dim_names=("replicate", "shard"))
    if method == "tp":
        return init_device_mesh(device_type, (n,))
    if method == "dp_tp":
        return init_device_mesh(device_type, (spec.parallel.dp, spec.parallel.tp), mesh_dim_names=("dp", "tp"))
    return None


def apply_fsdp(model: nn.Module, mesh, training: TrainingSpec, model_type: str) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    from estimator.profiler.tp import decoder_layers
    from harness.fake.units import fp32_kept_modules

    kwargs: dict[str, Any] = {"mesh": mesh}
    policy = fsdp_mp_policy(training)
    if policy is not None:
        kwargs["mp_policy"] = policy
    for module in fp32_kept_modules(model):  # one group per dtype, as transformers' FSDP plan shards them
        fully_shard(module, **kwargs)
    for layer in decoder_layers(model, model_type):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def fsdp1_mixed_precision(training: TrainingSpec):
    """FSDP1 MixedPrecision for mixed_* (the same contract as FSDP2's policy: 16-bit compute, fp32 reduction,
    buffers left as built); None otherwise."""
    from torch.distributed.fsdp import MixedPrecision

    dtype = {"mixed_bf16": torch.bfloat16, "mixed_fp16": torch.float16}.get(training.precision)
    return MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32) if dtype is not None else None


def apply_fsdp1(model: nn.Module, spec: RunSpec, mesh, model_type: str, device: torch.device | str) -> nn.Module:
    """FSDP1 as accelerate's TRANSFORMER_BASED_WRAP builds it: one FSDP unit (one flat parameter) per decoder
    layer, the root unit holding everything else; with LoRA peft's ``fsdp_auto_wrap_policy`` (the same, and each
    adapter Linear its own unit), or with ``lora_wrap`` "layer" the decoder-layer policy alone (the adapters in
    their layer's unit, as Lightning's ``auto_wrap_policy={Block}``); ``spec.parallel.fsdp1`` for the rest."""
    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from estimator.profiler.tp import decoder_layers

    options = spec.parallel.fsdp1
    if spec.training.lora and options.lora_wrap == "adapter":  # the HF Trainer's: each adapter Linear its own unit
        from peft.utils.other import fsdp_auto_wrap_policy

        policy = fsdp_auto_wrap_policy(model)
    else:
        policy = ModuleWrapPolicy({type(layer) for layer in decoder_layers(model, model_type)})
    prefetch = None if options.backward_prefetch == "NONE" else BackwardPrefetch[options.backward_prefetch]
    return FSDP(model, auto_wrap_policy=policy,
                sharding_strategy=ShardingStrategy[options.sharding_strategy],
                mixed_precision=fsdp1_mixed_precision(spec.training),
                cpu_offload=CPUOffload(offload_params=options.cpu_offload), backward_prefetch=prefetch,
                forward_prefetch=options.forward_prefetch, limit_all_gathers=options.limit_all_gathers,
                use_orig_params=options.use_orig_params, device_id=torch.device(device), device_mesh=mesh)


class _NoRebuildReducer:
    """Fake-PG only: DDP's bucket rebuild (2nd iteration's pre-forward) syncs bucket indices by writing a
    tensor's data in C++, impossible on fake tensors. The rebuild only reorders parameters among buckets
    (``initialize_buckets`` frees the old buckets before allocating the new ones), so total bucket bytes are
    unchanged; the fake run keeps the initial bucket assignment."""

    def __init__(self, reducer: Any) -> None:
        object.__setattr__(self, "_reducer", reducer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False


def apply_ddp(model: nn.Module, *, fake: bool, device: torch.device | str) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    if fake:
        from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

        ddp = DDP(model, init_sync=False)
        ddp.register_comm_hook(None, noop_hook)
        ddp.reducer = _NoRebuildReducer(ddp.reducer)
        return ddp
    device = torch.device(device)
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def wrap_model(model: nn.Module, spec: RunSpec, mesh, config: dict[str, Any], *, fake: bool,
               device: torch.device | str = "cpu") -> nn.Module:
    """Apply ``spec.parallel.method`` to a model built with ``build_model(config, build_training(spec))``."""
    method = spec.parallel.method
    model_type = config["model_type"]
    if method == "single":
        return model
    if method == "ddp":
        return apply_ddp(model, fake=fake, device=device)
    if method == "fsdp":
        return apply_fsdp(model, mesh, spec.training, model_type)
    if method == "fsdp1":
        return apply_fsdp1(model, spec, mesh, model_type, device)
    if method == "tp":
        from estimator.profiler.tp import apply_tp

        return apply_tp(model, mesh, config)
    if method == "dp_tp":
        from estimator.profiler.tp import apply_tp

        apply_tp(model, mesh["tp"], config)
        return apply_fsdp(model, mesh["dp"], spec.training, model_type)
    raise ValueError(f"method: {method!r} is not a torch-native method ({', '.join(TORCH_METHODS)})")
