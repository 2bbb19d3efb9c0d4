"""How a mixture-of-experts model names its routed experts' tensors: the one fact both the family facts
(``estimator.models.moe``) and ZeRO-3's leaf modules (``estimator.models.zero3_leaf``) read, kept below both."""

from __future__ import annotations


def is_routed_expert(name: str) -> bool:
    """A routed expert's tensor (``mlp.experts.gate_up_proj``, ``block_sparse_moe.experts.3.w1.weight``), not a
    shared expert's (``mlp.shared_experts.*``, ``mlp.shared_expert.*``) nor the router's."""
    return ".experts." in f".{name}"
