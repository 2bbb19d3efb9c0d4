"""A Lightning ``Callback``: check before the first step, record the measured peaks after a few. Imports
``lightning`` (or ``pytorch_lightning``); import it only where one is installed.

    trainer = L.Trainer(callbacks=[MemoryEstimatorLightningCallback(record_dir="memory-records", seq_len=512)])

The spec comes from the module's Hugging Face model (the first submodule with a ``config``), the trainer's
precision (``bf16-mixed`` autocasts, ``bf16-true`` trains bf16 weights), strategy (DDP, FSDP1 with its live
settings, ModelParallel as FSDP2, DeepSpeed),
world size and gradient accumulation, and the train dataloader's batch size. The loop is ``manual``: Lightning
still holds the model's logits when the optimizer steps (measured, see ``on_train_start``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError:  # the older package name
    from pytorch_lightning import Callback

from estimator.integrations.guard import MemoryGuard, WillNotFitError

__all__ = ["MemoryEstimatorLightningCallback", "WillNotFitError"]
_MIXED = {"bf16-mixed": "bf16", "16-mixed": "fp16"}
_TRUE = {"bf16-true": "bf16", "32-true": "fp32", "32": "fp32"}


class MemoryEstimatorLightningCallback(Callback):
    def __init__(self, record_dir: str | Path | None = None, *, seq_len: int | None = None,
                 micro_batch_size: int | None = None, stop_if_oom: bool = False, **guard_options: Any) -> None:
        self.guard = MemoryGuard(record_dir, stop_if_oom=stop_if_oom, **guard_options)
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size

    def on_train_start(self, trainer, pl_module) -> None:
        try:
            model = _hf_model(pl_module)
            settings = _trainer_settings(trainer)
        except Exception:  # noqa: BLE001 - the guard logs what it cannot read
            model, settings = pl_module, {}
        # Measured on CPU (tests/integrations/test_lightning_callback.py): under automatic optimization a
        # logits-sized tensor (b x s x vocab) is still alive at the optimizer step, as in a manual loop.
        settings.update({"seq_len": self.seq_len, "loop": "manual"})
        if self.micro_batch_size:
            settings["micro_batch_size"] = self.micro_batch_size
        optimizer = trainer.optimizers[0] if getattr(trainer, "optimizers", None) else None
        self.guard.check(model, optimizer, settings=settings)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        accumulate = max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
        if (batch_idx + 1) % accumulate == 0:
            self.guard.step()

    def on_train_end(self, trainer, pl_module) -> None:
        self.guard.close()


def _hf_model(module: Any) -> Any:
    for candidate in module.modules():
        if hasattr(getattr(candidate, "config", None), "to_dict"):
            return candidate
    raise ValueError("model: the LightningModule holds no Hugging Face model (a submodule with .config)")


def _trainer_settings(trainer: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {"world_size": int(getattr(trainer, "world_size", 1) or 1),
                                "grad_accum_steps": int(getattr(trainer, "accumulate_grad_batches", 1) or 1)}
    precision = str(getattr(trainer, "precision", "32-true"))
    if precision in _MIXED:
        settings["half"] = _MIXED[precision]
    elif precision in _TRUE:
        settings["precision"] = _TRUE[precision]
    strategy = type(getattr(trainer, "strategy", None)).__name__
    if strategy.startswith("FSDP"):  # Lightning's FSDPStrategy is FSDP1; ModelParallelStrategy runs FSDP2
        from estimator.integrations.live import fsdp1_facts

        settings.update(fsdp1_facts(getattr(trainer.strategy, "model", None)) or {"method": "fsdp1"})
    elif strategy.startswith("ModelParallel"):
        settings["method"] = "fsdp"
    elif strategy.startswith("DeepSpeed"):
        settings["method"] = "deepspeed"
        settings["deepspeed"] = getattr(trainer.strategy, "config", None)
    loader = getattr(trainer, "train_dataloader", None)
    batch = getattr(loader, "batch_size", None)
    if isinstance(batch, int) and batch > 0:
        settings["micro_batch_size"] = batch
    return settings
