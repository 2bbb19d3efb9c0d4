"""estimator.models.tp_plans: pure-python TP plans, shard dims and feasibility checks."""

import subprocess
import sys

import pytest

from estimator.models import tp_plans
from estimator.models.arch import load_config

FAMILIES = ("llama", "mistral", "qwen2", "opt", "biogpt", "gpt_neo", "gpt_neox", "bloom", "codegen", "gpt_bigcode")


def test_import_is_pure_python():
    code = "import sys, estimator.models.tp_plans as t; t.check_tp({'model_type': 'llama', 'hidden_size': 64, " \
           "'num_attention_heads': 4, 'num_hidden_layers': 2, 'vocab_size': 10}, 2); " \
           "sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_pairs_colwise_with_rowwise(family):
    plan = tp_plans.tp_plan(family)
    styles = set(plan.values())
    assert styles == {"colwise", "rowwise"}
    assert tp_plans.tp_layers_path(family)


def test_hf_base_model_tp_plans_agree():
    # transformers 5 ships base_model_tp_plan for these families; ours must say the same.
    hf = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
          "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
          "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
          "layers.*.mlp.down_proj": "rowwise"}
    for family in ("llama", "mistral", "qwen2"):
        assert {f"layers.*.{k}": v for k, v in tp_plans.tp_plan(family).items()} == hf
    neox = {"layers.*.attention.query_key_value": "colwise", "layers.*.attention.dense": "rowwise",
            "layers.*.mlp.dense_h_to_4h": "colwise", "layers.*.mlp.dense_4h_to_h": "rowwise"}
    assert {f"layers.*.{k}": v for k, v in tp_plans.tp_plan("gpt_neox").items()} == neox


@pytest.mark.parametrize("name, expected", [
    ("model.layers.3.self_attn.q_proj.weight", 0),
    ("model.layers.3.self_attn.q_proj.bias", 0),
    ("model.layers.3.self_attn.o_proj.weight", 1),
    ("model.layers.3.mlp.down_proj.weight", 1),
    ("model.layers.3.input_layernorm.weight", None),
    ("model.embed_tokens.weight", None),
    ("lm_head.weight", None),
    ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", 0),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", None),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight", 0),
    ("base_model.model.model.layers.0.self_attn.o_proj.lora_A.default.weight", 1),
    ("base_model.model.model.layers.0.self_attn.o_proj.lora_B.default.weight", None),
])
def test_param_shard_dim_llama(name, expected):
    assert tp_plans.param_shard_dim("llama", name, 2) == expected
    assert tp_plans.param_shard_dim("llama", name, 1) is None


def test_param_shard_dim_rowwise_bias_is_replicated():
    assert tp_plans.param_shard_dim("opt", "model.decoder.layers.0.fc2.bias", 4) is None
    assert tp_plans.param_shard_dim("opt", "model.decoder.layers.0.fc1.bias", 4) == 0
    assert tp_plans.param_shard_dim("bloom", "transformer.h.5.self_attention.dense.weight", 2) == 1
    assert tp_plans.param_shard_dim("gpt_neo", "transformer.h.0.attn.attention.out_proj.bias", 2) is None


def test_check_tp_accepts_catalogue_models():
    tp_plans.check_tp(load_config("meta-llama/Llama-3.1-8B"), 8)
    tp_plans.check_tp(load_config("Qwen/Qwen2.5-7B"), 4)
    tp_plans.check_tp(load_config("Salesforce/codegen-2B-nl"), 8)
    tp_plans.check_tp(load_config("bigscience/bloom-560m"), 4)
    tp_plans.check_tp(load_config("facebook/opt-125m"), 1)


@pytest.mark.parametrize("model, tp, words", [
    ("meta-llama/Llama-3.1-8B", 16, "key/value heads"),     # 8 kv heads
    ("Qwen/Qwen2.5-0.5B", 4, "attention heads"),            # 14 heads
    ("microsoft/BioGPT-Large", 2, "25 attention heads"),
    ("Salesforce/codegen-350M-nl", 8, "4 blocks"),          # 16 heads, mp_num 4 -> tp | 4
    ("bigcode/gpt_bigcode-santacoder", 2, "multi_query"),
])
def test_check_tp_refuses_with_one_line(model, tp, words):
    with pytest.raises(ValueError) as err:
        tp_plans.check_tp(load_config(model), tp)
    message = str(err.value)
    assert message.startswith("tp: ") and "\n" not in message and words in message


def test_check_tp_unknown_family():
    config = {"model_type": "mamba", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
              "vocab_size": 10}
    with pytest.raises(ValueError, match="^tp: no tensor-parallel plan for model type 'mamba'"):
        tp_plans.check_tp(config, 2)
    tp_plans.check_tp(config, 1)  # tp=1 is always fine
