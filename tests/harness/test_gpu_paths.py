"""CPU checks of the decisions taken on the harness's CUDA-only paths (no GPU, no CUDA mocked): NCCL device
binding, the attention kernel on CUDA, and amp autocast under DeepSpeed's engine."""

import sys
import types

import pytest
import torch

from estimator.profiler import build
from estimator.spec import RunSpec, TrainingSpec
from harness.distributed import bind_device_id
from harness.methods.deepspeed import autocast_inside


@pytest.mark.parametrize(("version", "bind"), [("2.4.1", True), ("2.6.0", True), ("2.7.0", False),
                                               ("2.7.0+cu128", False), ("2.7.1", True), ("2.11.0+cu128", True)])
def test_nccl_device_id_is_left_out_where_it_hangs(version, bind):
    assert bind_device_id(version) is bind


def test_flash_needs_flash_attn_on_cuda_and_16_bit_attention(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))  # "installed"
    assert build.attn_implementation("flash", "cuda:0", "mixed_bf16") == "flash_attention_2"
    assert build.attn_implementation("flash", "cuda:0", "amp_fp16") == "flash_attention_2"
    assert build.attn_implementation("flash", "cuda:0", "fp32") == "sdpa"  # flash-attn refuses fp32 q/k/v
    assert build.attn_implementation("flash", "cpu", "bf16") == "sdpa"
    assert build.attn_implementation("eager", "cuda:0", "fp32") == "eager"


def test_an_architecture_without_flash_attention_falls_back_as_on_cpu():
    bloom = {"model_type": "bloom", "hidden_size": 32, "n_head": 4, "n_layer": 1, "vocab_size": 128}
    model = build._from_config(build.hf_config(bloom, TrainingSpec()), torch.float32, "flash_attention_2")
    assert build.effective_attn(model) == "eager"  # BLOOM has neither FlashAttention-2 nor SDPA


def test_amp_autocast_survives_an_engine_that_turns_the_outer_one_off():
    """DeepSpeed's engine runs the module under ``torch.autocast(enabled=False)`` when a CUDA autocast is on and
    its own ``torch_autocast`` section is not: the harness's autocast has to be inside the module's forward."""
    model = torch.nn.Linear(8, 8)
    autocast_inside(model, RunSpec(training=TrainingSpec(precision="amp_bf16")), torch.device("cpu"))
    with torch.autocast("cpu", enabled=False):
        assert model(torch.randn(2, 8)).dtype == torch.bfloat16
    plain = torch.nn.Linear(8, 8)
    autocast_inside(plain, RunSpec(training=TrainingSpec(precision="fp32")), torch.device("cpu"))
    assert plain(torch.randn(2, 8)).dtype == torch.float32
