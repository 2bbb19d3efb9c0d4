"""Check a training run before it starts, and record its measured per-rank peaks after a few steps.

* ``estimator.integrations.hf.MemoryEstimatorCallback``: Hugging Face Trainer / TRL (imports transformers);
* ``estimator.integrations.lightning.MemoryEstimatorLightningCallback``: Lightning (imports lightning);
* ``check_memory(model, optimizer, micro_batch_size=..., seq_len=...)``: hand-written loops.

Not on the predict path: torch (and the frameworks) are imported here, never by ``estimator.api``. Records
are local files in the harness's table format, read by ``python -m calibrate fit|report --data DIR``.
"""

from estimator.integrations.guard import MemoryGuard, WillNotFitError, check_memory

__all__ = ["MemoryGuard", "WillNotFitError", "check_memory"]
