"""A Hugging Face ``TrainerCallback`` (also TRL's trainers, which are Trainers): check before the first step,
record the measured peaks after a few. Imports transformers; import it only where transformers is installed.

    from estimator.integrations.hf import MemoryEstimatorCallback
    trainer = SFTTrainer(..., callbacks=[MemoryEstimatorCallback(record_dir="memory-records")])
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from estimator.integrations.guard import MemoryGuard, WillNotFitError

__all__ = ["MemoryEstimatorCallback", "WillNotFitError"]


class MemoryEstimatorCallback(TrainerCallback):
    """``record_dir``: where rows go (None: check only). ``seq_len``: the padded length of a batch when the
    arguments do not say it (TRL's ``max_length`` does). ``stop_if_oom``: raise ``WillNotFitError`` from
    ``on_train_begin`` instead of warning. ``memory_reader``: where measured peaks come from (default CUDA)."""

    def __init__(self, record_dir: str | Path | None = None, *, seq_len: int | None = None,
                 stop_if_oom: bool = False, **guard_options: Any) -> None:
        self.guard = MemoryGuard(record_dir, stop_if_oom=stop_if_oom, **guard_options)
        self.seq_len = seq_len

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.guard.check(model, optimizer, training_args=args,
                         settings={"seq_len": self.seq_len, "loop": "trainer"})

    def on_step_end(self, args, state, control, **kwargs):
        self.guard.step()

    def on_train_end(self, args, state, control, **kwargs):
        self.guard.close()
