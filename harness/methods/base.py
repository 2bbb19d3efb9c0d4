"""What every method returns: a Trainer that runs forward, backward and the optimizer step as separate calls
(so the probe can read memory between them), exactly as ``estimator.profiler.build.forward_backward`` /
``train_step`` do for torch-native methods: loss from ``model(**batch).loss`` under the spec's autocast, the
output object dropped before backward, ``optimizer.step()`` then ``zero_grad(set_to_none=True)``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from estimator.profiler.build import autocast_context, build_model
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

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with autocast_context(self.training, self.device):
            return self.model(**batch).loss

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
        self.model = None
        self.optimizer = None


def build_on_device(ctx: WrapContext, training: TrainingSpec) -> torch.nn.Module:
    """The model from the shared builder, on this rank's device; pretrained weights when asked and reachable.
    Every rank seeds identically first: TP scatters from rank 0 and DDP expects equal replicas."""
    torch.manual_seed(ctx.options.seed)
    model = build_model(ctx.config, training, ctx.device)
    if ctx.options.model.pretrained:
        from harness.weights import load_pretrained

        ctx.notes.append(load_pretrained(model, ctx.options.model.name))
    return model
