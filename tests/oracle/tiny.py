"""Tiny configs of each TP-supported family (from the catalogue config, shrunk), for fast oracle / TP tests."""

from __future__ import annotations

import copy
from typing import Any

from estimator.models.arch import load_config

# family -> (catalogue model, overrides). hidden 64; heads 4 (codegen 8: its qkv layout needs heads % (4*tp));
# dropouts 0 so that a real run is deterministic.
_TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("meta-llama/Llama-3.2-1B", {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                          "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000,
                                          "max_position_embeddings": 256}),
    "mistral": ("mistralai/Mistral-7B-v0.1", {"hidden_size": 64, "intermediate_size": 128,
                                              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                              "vocab_size": 1000, "max_position_embeddings": 256}),
    "qwen2": ("Qwen/Qwen2.5-0.5B", {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 256}),
    "opt": ("facebook/opt-125m", {"hidden_size": 64, "ffn_dim": 128, "num_attention_heads": 4,
                                  "word_embed_proj_dim": 64, "vocab_size": 1000, "max_position_embeddings": 256,
                                  "dropout": 0.0, "attention_dropout": 0.0}),
    "biogpt": ("microsoft/BioGPT-Large", {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                          "vocab_size": 1000, "max_position_embeddings": 256,
                                          "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
                                          "activation_dropout": 0.0, "layerdrop": 0.0}),
    "gpt_neo": ("EleutherAI/gpt-neo-1.3B", {"hidden_size": 64, "num_heads": 4, "vocab_size": 1000,
                                            "max_position_embeddings": 256, "window_size": 16}),
    "gpt_neox": ("EleutherAI/pythia-1b", {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                          "vocab_size": 1000, "max_position_embeddings": 256}),
    "bloom": ("bigscience/bloom-560m", {"n_embed": 64, "n_head": 4, "vocab_size": 1000}),
    "codegen": ("Salesforce/codegen-350M-nl", {"n_embd": 64, "n_head": 8, "rotary_dim": 4, "vocab_size": 1000,
                                               "n_positions": 256, "n_ctx": 256}),
    "gpt_bigcode": ("bigcode/gpt_bigcode-santacoder", {"n_embd": 64, "n_head": 4, "n_inner": 128,
                                                       "multi_query": False, "vocab_size": 1000,
                                                       "n_positions": 256, "resid_pdrop": 0.0,
                                                       "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
}
FAMILIES = tuple(_TINY)


def tiny_config(family: str, num_layers: int = 2) -> dict[str, Any]:
    from estimator.profiler.build import with_num_layers

    model, overrides = _TINY[family]
    config = copy.deepcopy(load_config(model))
    config.update(overrides)
    return with_num_layers(config, num_layers)


def catalogue_model(family: str) -> str:
    return _TINY[family][0]
