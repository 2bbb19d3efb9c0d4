"""What every method returns: a Trainer that runs forward, backward and the optimizer step as separate calls
(so the probe can read memory between them), exactly as ``estimator.profiler.build.forward_backward`` /
``train_step`` do for torch-native methods: loss from ``model(**batch).loss`` under the spec's autocast, the
output object dropped before backward (``training.loop`` "trainer") or kept bound until the next forward
("manual", ``HeldOutputs``), ``optimizer.step()`` then ``zero_grad(set_to_none=True)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from estimator.profiler.build import HeldOutputs, build_model
from estimator.spec import RunSpec, TrainingSpec
from harness.distributed import DistContext
from harness.options import HarnessOptions


@dataclass
class WrapContext:
    spec: RunSpec
    options: HarnessOptions
    dist: DistContext
    config: dict[str, Any]  # the model's HF config dict
    notes: list[str] = field(default_factory=list)
    memory_cap_bytes: int | None = None  # the allocator cap the worker applied (memory.cap_gib / cap_fraction)

    @property
    def device(self) -> torch.device:
        return self.dist.device

    @property
    def fake_pg(self) -> bool:
        return self.dist.emulated


class TorchTrainer:
    """A torch-native model + optimizer. ``no_sync(is_last)`` skips gradient sync on non-final micro-batches."""

    def __init__(self, model: torch.nn.Module, optimizer: Any, training: TrainingSpec, device: torch.device,
                 *, no_sync: Any = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.training = training
        self.device = device
        self._no_sync = no_sync
        self.held = HeldOutputs(training.loop, training.outputs_fp32)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # the spec's autocast and activation offload around the forward (build.step_forward)
        return self.held.forward(self.model, batch, self.training, self.device)

    def backward(self, loss: torch.Tensor, scale: float = 1.0) -> None:
        (loss * scale if scale != 1.0 else loss).backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def micro_batch(self, is_last: bool):
        if self._no_sync is None or is_last:
            return contextlib.nullcontext()
        return self._no_sync()

    def close(self) -> None:
        self.held.clear()
        self.model = None
        self.optimizer = None


def unsynced_micro_batch(model: torch.nn.Module, method: str, grad_sync: str) -> Any:
    """The context factory a micro-batch before the last runs in (None: every micro-batch reduces): DDP's
    ``no_sync`` always; FSDP's with ``grad_sync="last"``, as the HF Trainer and accelerate's ``accumulate()``
    run them: ``no_sync()`` for FSDP1, ``set_requires_gradient_sync(False)`` for FSDP2 (fsdp, dp_tp)."""
    if method == "ddp" or (method == "fsdp1" and grad_sync == "last"):
        return model.no_sync
    if method in ("fsdp", "dp_tp") and grad_sync == "last":
        @contextlib.contextmanager
        def no_sync():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        return no_sync
    return None


def gradient_sync(model: torch.nn.Module, method: str, grad_sync: str, last: bool):
    """The context one micro-batch runs in (``unsynced_micro_batch``)."""
    no_sync = None if last else unsynced_micro_batch(model, method, grad_sync)
    return contextlib.nullcontext() if no_sync is None else no_sync()


def build_on_device(ctx: WrapContext, training: TrainingSpec) -> torch.nn.Module:
    """The model from the shared builder, on this rank's device; pretrained weights when asked and reachable.
    Every rank seeds identically first: TP scatters from rank 0 and DDP expects equal replicas."""
    torch.manual_seed(ctx.options.seed)
    model = build_model(ctx.config, training, ctx.device)
    if ctx.options.model.pretrained:
        from harness.weights import load_pretrained

        ctx.notes.append(load_pretrained(model, ctx.options.model.name))
    return model


def build_sharded(ctx: WrapContext, training: TrainingSpec,
                  shard: Callable[[torch.nn.Module], torch.nn.Module]) -> torch.nn.Module:
    """fsdp / tp / dp_tp: parameters created on the meta device, sharded by ``shard``, then materialised on this
    rank's device and initialised, as torchtitan initialises: no rank ever holds the whole model, so a model that
    only fits sharded trains instead of OOMing in setup (the step peaks are the same either way). Buffers (rotary
    tables, attention masks) are computed for real on the host and copied into their device copies. Pretrained
    weights are copied into a whole model: that case builds full-size on the device, then shards."""
    if ctx.options.model.pretrained:
        return shard(build_on_device(ctx, training))
    torch.manual_seed(ctx.options.seed)
    with parameters_on_meta():
        model = build_model(ctx.config, training, "cpu")
    host_buffers = dict(model.named_buffers())
    model = shard(model)
    tied = tied_parameter_names(model)
    model.to_empty(device=ctx.device)
    retie(model, tied)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(host_buffers[name])
    del host_buffers
    initialize_parameters(model)
    return model


def tied_parameter_names(model: torch.nn.Module) -> list[list[str]]:
    """Names that share one parameter (a tied embedding and LM head), each group in registration order."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def retie(model: torch.nn.Module, tied: list[list[str]]) -> None:
    """``to_empty`` gives a plain (replicated) parameter a new tensor per module that holds it, which unties it
    (FSDP2 keeps its own shared parameters tied): point the others back at the first."""
    for first_name, *others in tied:
        first = model.get_parameter(first_name)
        for name in others:
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            if module._parameters[attr] is not first:
                setattr(module, attr, first)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every ``nn.Module`` parameter is registered on the meta device; buffers stay where they are built
    (accelerate's ``init_empty_weights(include_buffers=False)``). A parameter already on meta is registered as is,
    so a tied weight assigned to a second module stays one tensor."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def initialize_parameters(model: torch.nn.Module) -> None:
    """Random values for materialised (``to_empty``) parameters, with the model's own init (transformers'
    ``_init_weights``, which works on DTensor shards). The construction on meta marked every module initialised,
    so the marks go first."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wraps the HF model
    for item in [*hf.modules(), *hf.parameters(), *hf.buffers()]:
        item.__dict__.pop("_is_hf_initialized", None)
    if hasattr(hf, "initialize_weights"):
        hf.initialize_weights()
    else:  # transformers < 5
        hf.apply(hf._init_weights)
