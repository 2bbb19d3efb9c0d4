"""Method registry: ``spec.parallel.method`` -> a function ``wrap(ctx) -> Trainer`` that builds the model on the
rank's device, wraps it and builds the optimizer. One module per family; the torch-native ones delegate to
``harness.fake.wrap`` so the GPU harness and the CPU fake-tensor oracle run the same program.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.methods.base import TorchTrainer, WrapContext


def _lazy(module: str, attr: str = "wrap") -> Callable[[WrapContext], Any]:
    # Import on use: DeepSpeed costs ~2 s to import and is not needed by the torch-native methods.
    def wrap(ctx: WrapContext) -> Any:
        import importlib

        return getattr(importlib.import_module(f"harness.methods.{module}"), attr)(ctx)
    wrap.__name__ = f"{module}.{attr}"
    return wrap


WRAPPERS: dict[str, Callable[[WrapContext], Any]] = {
    "single": _lazy("single"),
    "ddp": _lazy("ddp"),
    "fsdp": _lazy("fsdp"),
    "fsdp1": _lazy("fsdp1"),
    "tp": _lazy("tp"),
    "dp_tp": _lazy("tp", "wrap_dp_tp"),
    "zero1": _lazy("deepspeed"),
    "zero2": _lazy("deepspeed"),
    "zero3": _lazy("deepspeed"),
    "zero_offload": _lazy("deepspeed"),
}


def wrap(ctx: WrapContext) -> Any:
    """The Trainer (forward / backward / step / micro_batch / close) for the spec's method; pipeline parallelism
    (``parallel.pp > 1``, methods single and fsdp) runs torch's pipelining (``harness.methods.pipeline``), or
    DeepSpeed's pipeline engine with ``parallel.pp_engine=deepspeed`` (``harness.methods.ds_pipeline``)."""
    if ctx.spec.parallel.pp > 1 and ctx.spec.parallel.pp_engine == "deepspeed":
        return _lazy("ds_pipeline")(ctx)
    if ctx.spec.parallel.pp > 1:
        return _lazy("pipeline")(ctx)
    return WRAPPERS[ctx.spec.parallel.method](ctx)


__all__ = ["WRAPPERS", "TorchTrainer", "WrapContext", "wrap"]
