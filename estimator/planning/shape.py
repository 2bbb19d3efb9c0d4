"""What the planner knows about a model: architecture facts, parameter counts and the throughput model's view
(``ModelShape``). Below both ``plan`` and ``throughput``, so neither imports the other for it."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from estimator.models.arch import resolve_arch
from estimator.models.moe import moe_facts
from estimator.models.params import param_counts
from estimator.profiler.cache import load_model_profile
from estimator.spec import TrainingSpec


@dataclass(frozen=True)
class ModelShape:
    """What the throughput model needs to know about a model."""

    params: int              # all parameters
    matmul_params: int       # parameters a token's matmuls use (LM head included, input embedding and the routed
    #                          experts a token is not sent to excluded)
    layers: int
    hidden_size: int
    head_params: int = 0     # the LM head's matmul parameters (V x h, tied or not): replicated under TP
    replicated_params: int = 0   # parameters every TP rank holds whole (embeddings, LM head, final norm)
    trainable_params: int | None = None   # None = all (full fine-tuning)
    kv_dim: int = 0          # key/value heads x head dim (what ring attention moves per token and tensor)
    moe_layers: int = 0      # mixture-of-experts layers (0: a dense model)
    experts: int = 0         # routed experts per MoE layer
    top_k: int = 0           # experts each token is routed to
    expert_params: int = 0   # the routed experts' parameters, every layer

    @property
    def trainable(self) -> int:
        return self.params if self.trainable_params is None else self.trainable_params

    def trainable_per_rank(self, tp: int) -> float:
        """Trainable parameters one TP rank holds (the decoder layers split, the rest replicated)."""
        if self.trainable_params is not None:      # LoRA: adapters live in the split layers
            return self.trainable_params / tp
        return (self.params - self.replicated_params) / tp + self.replicated_params


# --- model facts ----------------------------------------------------------------------------------------
_LEARNED_POSITIONS = {"opt", "gpt2", "gpt_neo", "biogpt", "gpt_bigcode", "gptj"}
_GATED_MLP = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "mixtral", "olmo", "olmo2"}


def _position_params(arch) -> int:
    if arch.model_type in _LEARNED_POSITIONS and arch.max_positions:
        return arch.max_positions * arch.hidden_size
    return 0


def _lora_params(arch, rank: int, targets: str) -> int:
    """Approximate LoRA adapter count: r*(in+out) per adapted linear ("auto" = query and value)."""
    h, kv = arch.hidden_size, arch.num_kv_heads * arch.head_dim
    if targets == "all-linear":
        per_layer = rank * (2 * h + (h + kv) * 2 + 2 * h) + rank * (h + arch.ffn_size) * (
            3 if arch.model_type in _GATED_MLP else 2)
    else:
        per_layer = rank * ((h + h) + (h + kv))
    return arch.num_layers * per_layer


@functools.lru_cache(maxsize=128)
def model_facts(model: str) -> dict[str, Any]:
    """Architecture facts (``estimator.models.arch``); raises ``ValueError("model: ...")`` for an unknown model."""
    return {"arch": resolve_arch(model)}


@functools.lru_cache(maxsize=256)
def model_shape(model: str, lora_rank: int = 0, lora_targets: str = "auto", *, params: int | None = None,
                trainable: int | None = None) -> ModelShape:
    """The throughput model's view of ``model``. ``params`` / ``trainable`` come from an estimate (exact:
    the profiled parameter table, LoRA adapters included); otherwise they are counted here."""
    arch = model_facts(model)["arch"]
    summary = model_summary(model)
    params = params or int(summary["params"])
    vh = arch.vocab_size * arch.hidden_size
    positions = _position_params(arch)
    matmul = params - positions - (0 if arch.tie_word_embeddings else vh) - summary["unrouted_expert_params"]
    replicated = vh + positions + (0 if arch.tie_word_embeddings else vh)
    if lora_rank:
        trainable = trainable or _lora_params(arch, lora_rank, lora_targets)
    return ModelShape(params=params, matmul_params=matmul, layers=arch.num_layers,
                      hidden_size=arch.hidden_size, head_params=vh, replicated_params=replicated,
                      trainable_params=trainable if lora_rank else None,
                      kv_dim=arch.num_kv_heads * arch.head_dim, moe_layers=summary["moe_layers"],
                      experts=summary["experts"], top_k=summary["top_k"],
                      expert_params=summary["expert_params"])


def model_summary(model: str) -> dict:
    """Architecture facts and parameter count of a model (catalogue name, config path or hub id)."""
    arch, profile = load_model_profile(model, TrainingSpec())
    total, _ = param_counts(profile["params"], arch.num_layers)
    moe = moe_facts(arch.config, profile["params"], arch.num_layers, total)
    # MoE: compute follows the experts a token is routed to (top-k of each layer's experts), not all of them
    unrouted = total - moe.active_params if moe and moe.active_params is not None else 0
    routed = moe is not None and bool(moe.top_k)
    return {"name": arch.name, "model_type": arch.model_type, "params": total, "unrouted_expert_params": unrouted,
            "moe_layers": moe.moe_layers if routed else 0, "experts": moe.experts if routed else 0,
            "top_k": moe.top_k if routed else 0, "expert_params": moe.expert_params if routed else 0,
            "layers": arch.num_layers,
            "hidden_size": arch.hidden_size, "vocab_size": arch.vocab_size, "num_heads": arch.num_heads,
            "num_kv_heads": arch.num_kv_heads, "ffn_size": arch.ffn_size, "max_positions": arch.max_positions,
            "tie_word_embeddings": arch.tie_word_embeddings}
