"""FSDP2 units beyond one per decoder layer (harness.fake.units): a 16-bit DeepSeek-V2 keeps its router in fp32,
and FSDP2 wants one dtype per group, so the router is a unit of its own, as transformers' own FSDP plan makes it.
Models are built on the meta device: no real CPU ops in this process."""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


def _meta_model(name: str, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads((CONFIGS / f"{name}_tiny.json").read_text())
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields), dtype=dtype)


def _names(model, modules) -> list[str]:
    by_module = {module: name for name, module in model.named_modules()}
    return [by_module[m] for m in modules]


def test_a_bf16_deepseek_router_is_a_unit_of_its_own():
    from harness.fake.units import fp32_kept_modules

    model = _meta_model("deepseek_v2", torch.bfloat16)
    # the first layer is dense (first_k_dense_replace=1): routers in layers 1 and 2, deepest first
    assert sorted(_names(model, fp32_kept_modules(model))) == ["model.layers.1.mlp.gate", "model.layers.2.mlp.gate"]


@pytest.mark.parametrize("name, dtype", [("deepseek_v2", torch.float32), ("qwen3_moe", torch.bfloat16)])
def test_one_dtype_models_need_no_extra_unit(name, dtype):
    from harness.fake.units import fp32_kept_modules

    assert fp32_kept_modules(_meta_model(name, dtype)) == []
