"""Tensor parallelism for the harness: re-exports ``estimator.profiler.tp`` (moved there so that the estimator's
TP profiles, the CPU oracle and the real runs apply the very same plans and build the same optimizer).

See ``estimator.profiler.tp`` for what ``apply_tp`` does and ``estimator.models.tp_plans`` for the per-family plans.
"""

from __future__ import annotations

from estimator.profiler.tp import (
    OptimizerChain,
    apply_tp,
    build_tp_optimizer,
    codegen_permutation,
    decoder_layers,
    split_params,
)

__all__ = ["OptimizerChain", "apply_tp", "build_tp_optimizer", "codegen_permutation", "decoder_layers",
           "split_params"]
