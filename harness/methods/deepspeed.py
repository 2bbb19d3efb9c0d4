"""``zero1`` / ``zero2`` / ``zero3`` / ``zero_offload``: ``deepspeed.initialize`` with a config generated from
the spec (or the user's JSON, ``deepspeed_config=path``, with the batch-size keys set from the spec).

Generated config, exactly:

* ``zero_optimization``: ``stage`` = spec.parallel.zero_stage (zero_offload = stage 2); every ZeroSpec field
  under its DeepSpeed name (bucket sizes in elements, ``overlap_comm`` = ZeroSpec.overlap_comm_for(stage));
  at stage 3 ``leaf_module: {classes, names, name_suffixes}`` from ZeroSpec's ``leaf_*`` where not DeepSpeed's
  default.
  ``offload_optimizer: {device: cpu, pin_memory}`` for zero_offload or ZeroSpec.offload_optimizer;
  ``offload_param: {device: cpu, pin_memory}`` for ZeroSpec.offload_param (stage 3).
* Precision: ``mixed_fp16`` -> ``fp16.enabled`` (dynamic loss scale starting at 1), ``mixed_bf16`` -> ``bf16.enabled``: 16-bit
  model, fp32 master partitions in the ZeRO optimizer. ``bf16`` (pure) -> ``bf16`` with
  ``bf16_master_weights_and_grads`` and ``bf16_optimizer_states``. ``fp32`` -> no block. ``amp_*`` -> fp32 model,
  no block, the model's forward under ``torch.autocast`` (ours, like every other method; entered inside the engine
  call, see ``autocast_inside``).
* Optimizer: ``adamw`` -> ``{"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": true, "foreach": true}}``
  (torch's foreach AdamW like the other methods; no FusedAdam/CPUAdam JIT build); ``adamw_fused`` -> torch
  AdamW with ``fused: true``; ``sgd`` and ``adamw_8bit`` are passed as client optimizers. With optimizer
  offload, ``zero_force_ds_cpu_optimizer: false`` lets torch's AdamW step the CPU partitions (DeepSpeedCPUAdam
  would need a JIT build; the GPU memory is the same).
* ``train_micro_batch_size_per_gpu`` / ``gradient_accumulation_steps`` from the spec, ``train_batch_size`` =
  their product x data-parallel ranks.

CPU and fake process group (env-recipes §2-3): the shm comm op JIT build is skipped (``build_shm_op``) and,
under the fake group, ZeRO-3's rank-agreement assertion is disabled (broadcasts are no-ops there). On CUDA, the
free memory DeepSpeed's ZeRO-1/2 setup asks for honours the memory cap (``report_free_memory``).
ZeRO-1/2 build the model full-size on the device before ``deepspeed.initialize`` partitions it; ZeRO-3 builds it
under transformers' ``zero.Init`` (``zero3_init``), as the Hugging Face Trainer does.
Gradient accumulation: ``engine.step()`` after every micro-batch (DeepSpeed counts micro-batches there); only the
boundary's, in the optimizer phase, updates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

from estimator.profiler.build import HeldOutputs, offload_context
from estimator.spec import LEAF_FIELDS, RunSpec, ZeroSpec
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
        if f.name in ("offload_optimizer", "offload_param", "pin_memory", "overlap_comm", *LEAF_FIELDS):
            continue
        section[f.name] = getattr(zero, f.name)
    section["overlap_comm"] = zero.overlap_comm_for(stage)
    leaf = {key: list(getattr(zero, name)) for key, name in zip(("classes", "names", "name_suffixes"), LEAF_FIELDS)}
    if stage == 3 and any(getattr(zero, name) != getattr(ZeroSpec, name) for name in LEAF_FIELDS):
        section["leaf_module"] = leaf  # DeepSpeed's default otherwise: the generated config as before
    if zero.offload_optimizer or spec.parallel.method == "zero_offload":
        section["offload_optimizer"] = {"device": "cpu", "pin_memory": zero.pin_memory}
    if zero.offload_param and stage == 3:
        section["offload_param"] = {"device": "cpu", "pin_memory": zero.pin_memory}
    return section


def precision_section(precision: str) -> dict[str, Any]:
    if precision == "mixed_fp16":
        # Loss scale 1 to start (dynamic, as DeepSpeed's default): memory does not depend on the scale, but an update
        # skipped on overflow does (no optimizer temporaries), and DeepSpeed's default 2**16 on a randomly
        # initialised model can skip the first updates of a 2-step measurement. A user JSON keeps its own scale.
        return {"fp16": {"enabled": True, "initial_scale_power": 0}}
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


def autocast_inside(model: torch.nn.Module, spec: RunSpec, device: torch.device) -> None:
    """amp_* (and accelerate's mixed precision over 16-bit weights, ``TrainingSpec.forward_autocast``): run the
    model's own forward under ``torch.autocast``; an autocast around ``engine(**batch)`` is
    switched off on GPUs. DeepSpeed's engine forward calls the module inside ``autocast_if_enabled``
    (deepspeed/runtime/torch_autocast.py), which, when a CUDA autocast is already on and the config has no
    ``torch_autocast`` section, enters ``torch.autocast("cuda", enabled=False)``: the step would run in fp32. (CPU
    runs never showed it: ``torch.is_autocast_enabled()`` asks about CUDA only.) That section is no way out: it also
    makes ZeRO communicate Linear weights and gradients in 16 bits, not the amp program of the other methods."""
    from estimator.profiler.build import autocast_context, autocast_dtype

    if autocast_dtype(spec.training) is None:
        return
    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with autocast_context(spec.training, device):
            return forward(*args, **kwargs)

    model.forward = autocast_forward


def report_free_memory(cap_bytes: int | None) -> None:
    """CUDA: ZeRO-1/2 setup flattens each parameter group on the GPU when ``get_accelerator().available_memory()``
    can hold the flat copy, else moves the group to the CPU first (deepspeed/runtime/zero/stage_1_and_2.py).
    DeepSpeed's CUDA answer is NVML's free memory, which ignores the allocator cap (a capped run would flatten on the
    GPU and OOM in setup where the real 16 GB card goes through the CPU), and maps the device with
    ``int(CUDA_VISIBLE_DEVICES[i])``, which raises on GPU/MIG UUIDs. Answer with cudaMemGetInfo's free bytes, and
    under a cap with what the capped allocator can still reserve."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cuda":
        return

    def available_memory(device_index: Any = None) -> int:
        free_bytes = int(torch.cuda.mem_get_info(device_index)[0])
        if cap_bytes is None:
            return free_bytes
        return min(free_bytes, max(0, cap_bytes - int(torch.cuda.memory_reserved(device_index))))

    accelerator.available_memory = available_memory


class DeepSpeedTrainer:
    def __init__(self, engine: Any, spec: RunSpec, device: torch.device) -> None:
        self.model = engine
        self.engine = engine
        self.training = spec.training
        self.device = device
        self.held = HeldOutputs(spec.training.loop, spec.training.outputs_fp32)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # amp_*: autocast is inside the model's forward (autocast_inside); activation offload around the engine's
        with offload_context(self.training, self.device):
            return self.held.forward(self.engine, batch)

    def backward(self, loss: torch.Tensor, scale: float = 1.0) -> None:
        self.engine.backward(loss)  # DeepSpeed scales by 1/gradient_accumulation_steps itself
        if not self.engine.is_gradient_accumulation_boundary():
            # DeepSpeed counts micro-batches in step() ((micro_steps + 1) % gradient_accumulation_steps): one call
            # per micro-batch, else the boundary (and the update) would come every gradient_accumulation_steps-th
            # harness step. Off the boundary step() updates nothing.
            self.engine.step()

    def step(self) -> None:
        self.engine.step()  # steps the optimizer at the accumulation boundary, zeroes grads

    @property
    def skipped_steps(self) -> int:
        """Optimizer updates DeepSpeed skipped on an fp16 overflow (dynamic loss scale): no update ran then."""
        return int(getattr(self.engine, "skipped_steps", 0) or 0)

    def micro_batch(self, is_last: bool):
        import contextlib

        return contextlib.nullcontext()

    def close(self) -> None:
        self.held.clear()
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
        from estimator.configs.deepspeed_json import load_deepspeed_config

        user = load_deepspeed_config(ctx.options.deepspeed_config)
    config = ds_config(ctx.spec, user)
    report_free_memory(ctx.memory_cap_bytes)
    deepspeed.init_distributed(dist_backend=ctx.dist.backend, auto_mpi_discovery=False)
    with zero3_init(ctx, config) as partitioned:
        model = build_on_device(ctx, ctx.spec.training)
    if partitioned and ctx.fake_pg and ctx.dist.rank != 0:
        fill_own_partitions(model)
    autocast_inside(model, ctx.spec, ctx.device)
    client = _client_optimizer(model, ctx.spec)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config,
                                           model_parameters=None if client is not None else
                                           [p for p in model.parameters() if p.requires_grad])
    ctx.notes.append("deepspeed: " + ("parameters partitioned as they were built (zero.Init through transformers)"
                                      if partitioned else
                                      "model built full-size on the device, then partitioned by initialize()"))
    return DeepSpeedTrainer(engine, ctx.spec, ctx.device)


def fill_own_partitions(model: torch.nn.Module) -> None:
    """Emulated ranks other than 0: zero.Init initialises the weights on rank 0 and broadcasts them, a no-op on the
    fake process group, leaving this rank's partitions uninitialised. Give them finite values: NaN weights make
    DeepSpeed skip the update as an overflow, and with it the optimizer's temporaries."""
    with torch.no_grad():
        for param in model.parameters():
            shard = getattr(param, "ds_tensor", None)
            if shard is not None and shard.is_floating_point():
                shard.normal_(0.0, 0.02)


@contextlib.contextmanager
def zero3_init(ctx: WrapContext, config: dict[str, Any]) -> Iterator[bool]:
    """ZeRO-3: build the model as the Hugging Face Trainer does, under transformers' own ``zero.Init`` (a live
    ``HfDeepSpeedConfig`` makes ``from_config`` partition every parameter as its module is built and initialise the
    weights gathered, module by module): no rank holds the whole model. Yields whether it applies: not below stage
    3, not for QLoRA (transformers skips zero.Init for quantized models), not for pretrained weights (copied into a
    whole model)."""
    applies = (config["zero_optimization"].get("stage") == 3 and not ctx.spec.training.qlora
               and not ctx.options.model.pretrained)
    if not applies:
        yield False
        return
    from transformers.integrations import HfDeepSpeedConfig

    hf_ds_config = HfDeepSpeedConfig(config)  # transformers holds it by weak reference: alive only in here
    try:
        yield True
    finally:
        del hf_ds_config
