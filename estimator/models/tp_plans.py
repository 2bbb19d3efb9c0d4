"""Tensor-parallel (TP) plans per model family: which decoder-layer linears are split, and how.

Pure standard library (imported on the estimator's no-torch predict path). ``estimator/profiler/tp.py`` applies these
plans with ``torch.distributed.tensor.parallel.parallelize_module``; the estimator reads the same data to
know which parameter dimension is split (``param_shard_dim``) and whether a split is legal (``check_tp``).

Layout (Megatron pairing, one all-reduce in forward and one in backward per block):

* attention: Q/K/V projections (or the fused QKV linear) **colwise** (output features split, each rank holds
  whole heads), the output projection **rowwise** (input features split; the partial sums are all-reduced);
* MLP: up / gate (``fc1``, ``c_fc``, ``dense_h_to_4h``, ...) **colwise**, down (``fc2``, ``c_proj``, ...)
  **rowwise**.
* colwise splits ``weight`` dim 0 and ``bias`` dim 0; rowwise splits ``weight`` dim 1, its ``bias`` is
  replicated (added once, after the all-reduce).
* Everything outside the decoder layers (token/position embeddings, final norm, ``lm_head``) and every
  norm inside a layer is **replicated** on every TP rank: we do *not* use vocab-parallel embeddings or a
  vocab-parallel loss, so every rank holds the full embedding/lm_head and computes the full ``(b, s, V)``
  logits. (This is what ``parallelize_module`` with a per-layer plan gives and what the harness runs; a
  Megatron-style vocab-parallel run would hold ``V/tp`` of the embedding and logits.)

LoRA (peft): a colwise target keeps ``base_layer`` colwise, ``lora_A`` replicated and ``lora_B`` colwise;
a rowwise target keeps ``base_layer`` rowwise, ``lora_A`` rowwise (input split) and ``lora_B`` replicated.

Per-family attribute patches (``attr_div``): modules that store a head count and use it to reshape get the
count divided by ``tp`` on every rank (e.g. OPT's ``self_attn.num_heads``; without the patch the
``view(b, -1, num_heads, head_dim)`` silently folds the missing heads into the *sequence* dimension).
Families whose reshape infers the head count (``view(..., -1, head_dim)``: Llama, Mistral, Qwen2, BioGPT,
GPT-NeoX) need none. ``special`` names extra transformations implemented in ``estimator/profiler/tp.py``:

* ``bloom_alibi``: BLOOM builds the ALiBi bias for all ``n_head`` heads in the model and passes it to every
  layer as ``(batch * n_head, 1, kv)``; each rank keeps the slice of its own heads. BLOOM's fused
  ``query_key_value`` is head-interleaved (``view(b, s, n_head, 3, head_dim)``), so a contiguous colwise
  chunk holds whole heads with their Q, K and V.
* GPT-NeoX's fused ``query_key_value`` is also head-interleaved (``view(..., -1, 3 * head_size)``): contiguous
  colwise chunks hold whole heads; no patch needed.
* ``codegen_mp4``: CodeGen's ``qkv_proj`` output is laid out for a hard-coded ``mp_num = 4`` (four blocks,
  each ``[q | v | k]`` for a quarter of the heads) and the forward reshapes with ``mp_num = 4`` whatever the
  local width. Before sharding, the rows of ``qkv_proj`` (and the columns of ``out_proj``) are permuted so
  that rank ``r``'s contiguous chunk is again four ``[q | v | k]`` blocks over its own heads; the function of
  the model is unchanged (a head permutation). The forward's block width is ``embed_dim // 4`` (transformers
  5.23), so ``embed_dim`` is divided by tp with the heads. Needs ``n_head % (4 * tp) == 0``.
* GPT-BigCode with ``multi_query=True`` (e.g. SantaCoder) packs ``[q (all heads) | k | v (one shared head)]``
  in one ``c_attn``: a colwise split would cut the single K/V head, and sharding Q alone needs a split module
  plus a partial-gradient reduction for the replicated K/V. We refuse it (``check_tp`` raises); non-MQA
  GPT-BigCode (per-head interleaved ``c_attn``) is supported.

Sources: transformers 5 ``base_model_tp_plan`` (llama, mistral, qwen2, gpt_neox match the plans below) and the
modeling code of each family (transformers 5.23), read for the reshape of each attention.
"""

from __future__ import annotations

import re
from typing import Any

COLWISE = "colwise"
ROWWISE = "rowwise"

_LLAMA_LIKE = {
    "self_attn.q_proj": COLWISE,
    "self_attn.k_proj": COLWISE,
    "self_attn.v_proj": COLWISE,
    "self_attn.o_proj": ROWWISE,
    "mlp.gate_proj": COLWISE,
    "mlp.up_proj": COLWISE,
    "mlp.down_proj": ROWWISE,
}
_OPT_LIKE = {
    "self_attn.q_proj": COLWISE,
    "self_attn.k_proj": COLWISE,
    "self_attn.v_proj": COLWISE,
    "self_attn.out_proj": ROWWISE,
    "fc1": COLWISE,
    "fc2": ROWWISE,
}

# model_type -> plan. "layers": path of the decoder-layer ModuleList inside the *base* causal-LM model
# (after peft's get_base_model()); "layer": relative module name -> style; "attr_div": integer attributes
# (relative to a layer) divided by tp; "special": named extra transformations (see module docstring).
_PLANS: dict[str, dict[str, Any]] = {
    "llama": {"layers": "model.layers", "layer": _LLAMA_LIKE, "attr_div": (), "special": ()},
    "mistral": {"layers": "model.layers", "layer": _LLAMA_LIKE, "attr_div": (), "special": ()},
    "qwen2": {"layers": "model.layers", "layer": _LLAMA_LIKE, "attr_div": (), "special": ()},
    "opt": {"layers": "model.decoder.layers", "layer": _OPT_LIKE,
            "attr_div": ("self_attn.num_heads",), "special": ()},
    "biogpt": {"layers": "biogpt.layers", "layer": _OPT_LIKE, "attr_div": (), "special": ()},
    "gpt_neo": {"layers": "transformer.h",
                "layer": {"attn.attention.q_proj": COLWISE, "attn.attention.k_proj": COLWISE,
                          "attn.attention.v_proj": COLWISE, "attn.attention.out_proj": ROWWISE,
                          "mlp.c_fc": COLWISE, "mlp.c_proj": ROWWISE},
                "attr_div": ("attn.attention.num_heads",), "special": ()},
    "gpt_neox": {"layers": "gpt_neox.layers",
                 "layer": {"attention.query_key_value": COLWISE, "attention.dense": ROWWISE,
                           "mlp.dense_h_to_4h": COLWISE, "mlp.dense_4h_to_h": ROWWISE},
                 "attr_div": (), "special": ()},
    "bloom": {"layers": "transformer.h",
              "layer": {"self_attention.query_key_value": COLWISE, "self_attention.dense": ROWWISE,
                        "mlp.dense_h_to_4h": COLWISE, "mlp.dense_4h_to_h": ROWWISE},
              "attr_div": ("self_attention.num_heads",), "special": ("bloom_alibi",)},
    "codegen": {"layers": "transformer.h",
                "layer": {"attn.qkv_proj": COLWISE, "attn.out_proj": ROWWISE,
                          "mlp.fc_in": COLWISE, "mlp.fc_out": ROWWISE},
                "attr_div": ("attn.num_attention_heads", "attn.embed_dim"), "special": ("codegen_mp4",)},
    "gpt_bigcode": {"layers": "transformer.h",
                    "layer": {"attn.c_attn": COLWISE, "attn.c_proj": ROWWISE,
                              "mlp.c_fc": COLWISE, "mlp.c_proj": ROWWISE},
                    "attr_div": ("attn.num_heads",), "special": ()},
}

CODEGEN_MP_NUM = 4

_LAYER_PARAM = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.(.+)\.(weight|bias)$")


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(_PLANS))


def tp_plan(model_type: str) -> dict[str, str]:
    """Relative module name (inside one decoder layer) -> "colwise" | "rowwise". Unlisted = replicated."""
    return dict(_family(model_type)["layer"])


def tp_layers_path(model_type: str) -> str:
    """Dotted path of the decoder-layer ModuleList inside the base (non-peft) causal-LM model."""
    return _family(model_type)["layers"]


def tp_attr_patches(model_type: str) -> tuple[str, ...]:
    """Integer attributes (relative to a decoder layer) that hold a head count: divided by tp on each rank."""
    return tuple(_family(model_type)["attr_div"])


def tp_specials(model_type: str) -> tuple[str, ...]:
    return tuple(_family(model_type)["special"])


def _family(model_type: str) -> dict[str, Any]:
    try:
        return _PLANS[model_type]
    except KeyError:
        raise ValueError(f"tp: no tensor-parallel plan for model type {model_type!r} "
                         f"(supported: {', '.join(supported_model_types())})") from None


def param_shard_dim(model_type: str, param_name: str, tp: int) -> int | None:
    """Dimension of ``param_name`` split across the TP ranks, or None when every rank holds all of it.

    ``param_name`` is a ``named_parameters()`` name of the (optionally peft-wrapped) causal LM, e.g.
    ``model.layers.3.self_attn.q_proj.weight`` or
    ``base_model.model.model.layers.3.self_attn.q_proj.lora_B.default.weight``.
    """
    if tp <= 1:
        return None
    plan = _family(model_type)["layer"]
    match = _LAYER_PARAM.search(param_name)
    if not match:
        return None  # embeddings, final norm, lm_head: replicated
    rel, kind = match.group(2), match.group(3)
    lora = None
    for marker in (".lora_A.", ".lora_B."):
        if marker in rel + ".":
            head, _, _ = (rel + ".").partition(marker)
            lora, rel = marker.strip("."), head
            break
    if rel.endswith(".base_layer"):
        rel = rel[: -len(".base_layer")]
    style = plan.get(rel)
    if style is None:
        return None
    if lora == "lora_A":  # (r, in): split only when the input is split (rowwise)
        return 1 if style == ROWWISE and kind == "weight" else None
    if lora == "lora_B":  # (out, r): split only when the output is split (colwise)
        return 0 if style == COLWISE else None
    if style == COLWISE:
        return 0
    return 1 if kind == "weight" else None


def _facts(arch_config: Any) -> dict[str, Any]:
    """Normalised facts from a config dict or an ``estimator.models.arch.ModelArch``."""
    from estimator.models.arch import ModelArch, arch_from_config

    arch = arch_config if isinstance(arch_config, ModelArch) else arch_from_config(dict(arch_config))
    return {"model_type": arch.model_type, "heads": arch.num_heads, "kv_heads": arch.num_kv_heads,
            "ffn": arch.ffn_size, "hidden": arch.hidden_size, "config": arch.config}


def check_tp(arch_config: Any, tp: int) -> None:
    """Raise ``ValueError("tp: ...")`` (one line) when this architecture cannot be split ``tp`` ways."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp: must be a positive integer, got {tp!r}")
    facts = _facts(arch_config)
    model_type = facts["model_type"]
    if tp == 1:
        return
    _family(model_type)
    config = facts["config"]
    if model_type == "gpt_bigcode" and config.get("multi_query", True):
        raise ValueError("tp: gpt_bigcode with multi_query=True has one K/V head fused into c_attn with all "
                         "query heads; it cannot be split across TP ranks (use fsdp or ddp)")
    heads, kv_heads, ffn, hidden = facts["heads"], facts["kv_heads"], facts["ffn"], facts["hidden"]
    if heads % tp:
        raise ValueError(f"tp: {tp} does not divide the {heads} attention heads of {model_type}")
    if kv_heads % tp:
        raise ValueError(f"tp: {tp} does not divide the {kv_heads} key/value heads of {model_type} "
                         f"(K/V heads are not replicated across TP ranks)")
    if ffn % tp:
        raise ValueError(f"tp: {tp} does not divide the MLP width {ffn} of {model_type}")
    if hidden % tp:
        raise ValueError(f"tp: {tp} does not divide the hidden size {hidden} of {model_type}")
    if model_type == "codegen" and heads % (CODEGEN_MP_NUM * tp):
        raise ValueError(f"tp: codegen's qkv_proj is laid out in {CODEGEN_MP_NUM} blocks; {heads} heads need "
                         f"tp to divide {heads // CODEGEN_MP_NUM}, got {tp}")
