"""``zero1`` / ``zero2`` / ``zero3`` / ``zero_offload``: ``deepspeed.initialize`` with a config generated from
the spec (or the user's JSON, ``deepspeed_config=path``, with the batch-size keys set from the spec).

Generated config, exactly:

* ``zero_optimization``: ``stage`` = spec.parallel.zero_stage (zero_offload = stage 2); every ZeroSpec field
  under its DeepSpeed name (bucket sizes in elements, ``overlap_comm`` = ZeroSpec.overlap_comm_for(stage)).
  ``offload_optimizer: {device: cpu, pin_memory}`` for zero_offload or ZeroSpec.offload_optimizer;
  ``offload_param: {device: cpu, pin_memory}`` for ZeroSpec.offload_param (stage 3).
* Precision: ``mixed_fp16`` -> ``fp16.enabled`` (dynamic loss scale), ``mixed_bf16`` -> ``bf16.enabled``: 16-bit
  model, fp32 master partitions in the ZeRO optimizer. ``bf16`` (pure) -> ``bf16`` with
  ``bf16_master_weights_and_grads`` and ``bf16_optimizer_states``. ``fp32`` -> no block. ``amp_*`` -> fp32 model,
  no block, forward under ``torch.autocast`` (ours, like every other method).
* Optimizer: ``adamw`` -> ``{"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": true, "foreach": true}}``
  (torch's foreach AdamW like the other methods; no FusedAdam/CPUAdam JIT build); ``adamw_fused`` -> torch
  AdamW with ``fused: true``; ``sgd`` and ``adamw_8bit`` are passed as client optimizers. With optimizer
  offload, ``zero_force_ds_cpu_optimizer: false`` lets torch's AdamW step the CPU partitions (DeepSpeedCPUAdam
  would need a JIT build; the GPU memory is the same).
* ``train_micro_batch_size_per_gpu`` / ``gradient_accumulation_steps`` from the spec, ``train_batch_size`` =
  their product x data-parallel ranks.

CPU and fake process group (env-recipes §2-3): the shm comm op JIT build is skipped (``build_shm_op``) and,
under the fake group, ZeRO-3's rank-agreement assertion is disabled (broadcasts are no-ops there).
The model is built full-size on the device before ``deepspeed.initialize`` partitions it (no ``zero.Init``).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from typing import Any

import torch

from estimator.spec import RunSpec
from harness.methods.base import WrapContext, build_on_device

LR = 1e-5


def ds_config(spec: RunSpec, user_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpeed config dict for a spec (pure; unit-tested)."""
    training, parallel = spec.training, spec.parallel
    batch = {"train_micro_batch_size_per_gpu": training.micro_batch_size,
             "gradient_accumulation_steps": training.grad_accum_steps,
             "train_batch_size": training.micro_batch_size * training.grad_accum_steps * parallel.dp}
    if user_config is not None:
        return {**user_config, **batch}
    config: dict[str, Any] = {**batch, "steps_per_print": 10**9, "wall_clock_breakdown": False,
                              "zero_allow_untested_optimizer": True,
                              "zero_optimization": zero_section(spec)}
    config.update(precision_section(training.precision))
    optimizer = optimizer_section(training.optimizer)
    if optimizer is not None:
        config["optimizer"] = optimizer
    if config["zero_optimization"].get("offload_optimizer"):
        config["zero_force_ds_cpu_optimizer"] = False
    return config


def zero_section(spec: RunSpec) -> dict[str, Any]:
    stage = spec.parallel.zero_stage
    zero = spec.parallel.zero
    section: dict[str, Any] = {"stage": stage}
    for f in dataclasses.fields(zero):
        if f.name in ("offload_optimizer", "offload_param", "pin_memory", "overlap_comm"):
            continue
        section[f.name] = getattr(zero, f.name)
    section["overlap_comm"] = zero.overlap_comm_for(stage)
    if zero.offload_optimizer or spec.parallel.method == "zero_offload":
        section["offload_optimizer"] = {"device": "cpu", "pin_memory": zero.pin_memory}
    if zero.offload_param and stage == 3:
        section["offload_param"] = {"device": "cpu", "pin_memory": zero.pin_memory}
    return section


def precision_section(precision: str) -> dict[str, Any]:
    if precision == "mixed_fp16":
        return {"fp16": {"enabled": True}}
    if precision == "mixed_bf16":
        return {"bf16": {"enabled": True}}
    if precision == "bf16":
        return {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}
    return {}


def optimizer_section(optimizer: str) -> dict[str, Any] | None:
    if optimizer == "adamw":
        return {"type": "AdamW", "params": {"lr": LR, "torch_adam": True, "foreach": True}}
    if optimizer == "adamw_fused":
        return {"type": "AdamW", "params": {"lr": LR, "torch_adam": True, "fused": True}}
    return None  # sgd, adamw_8bit: client optimizer


def _client_optimizer(model: torch.nn.Module, spec: RunSpec) -> torch.optim.Optimizer | None:
    if optimizer_section(spec.training.optimizer) is not None:
        return None
    from estimator.profiler.build import _inner_optimizer  # the plain optimizer; DeepSpeed adds the masters

    return _inner_optimizer([p for p in model.parameters() if p.requires_grad], spec.training, LR)


def patch_deepspeed(*, fake_pg: bool) -> None:
    """Skip the CPU shm comm op build (~30 s of JIT); under the fake group, disable the rank-agreement check.
    ``import deepspeed.comm.torch as x`` would bind the torch module, hence sys.modules (env-recipes §2)."""
    importlib.import_module("deepspeed.comm.torch")
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    if fake_pg:
        coordinator = importlib.import_module("deepspeed.runtime.zero.partitioned_param_coordinator")
        coordinator.assert_ints_same_as_other_ranks = lambda *args, **kwargs: None


class DeepSpeedTrainer:
    def __init__(self, engine: Any, spec: RunSpec, device: torch.device) -> None:
        self.model = engine
        self.engine = engine
        self.training = spec.training
        self.device = device

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        from estimator.profiler.build import autocast_context

        with autocast_context(self.training, self.device):
            return self.engine(**batch).loss

    def backward(self, loss: torch.Tensor, scale: float = 1.0) -> None:
        self.engine.backward(loss)  # DeepSpeed scales by 1/gradient_accumulation_steps itself

    def step(self) -> None:
        self.engine.step()  # steps the optimizer at the accumulation boundary, zeroes grads

    def micro_batch(self, is_last: bool):
        import contextlib

        return contextlib.nullcontext()

    def close(self) -> None:
        try:
            self.engine.destroy()
        except Exception:  # noqa: BLE001 - best effort between emulated ranks
            pass
        self.engine = self.model = None


def wrap(ctx: WrapContext) -> DeepSpeedTrainer:
    import deepspeed

    patch_deepspeed(fake_pg=ctx.fake_pg)
    user = None
    if ctx.options.deepspeed_config:
        from estimator.deepspeed_config import load_deepspeed_config

        user = load_deepspeed_config(ctx.options.deepspeed_config)
    config = ds_config(ctx.spec, user)
    model = build_on_device(ctx, ctx.spec.training)
    deepspeed.init_distributed(dist_backend=ctx.dist.backend, auto_mpi_discovery=False)
    client = _client_optimizer(model, ctx.spec)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config,
                                           model_parameters=None if client is not None else
                                           [p for p in model.parameters() if p.requires_grad])
    ctx.notes.append("deepspeed: model built full-size on the device, then partitioned by initialize()")
    return DeepSpeedTrainer(engine, ctx.spec, ctx.device)
