"""Mixture-of-experts matmuls as CUDA runs them (``estimator.profiler.cuda_path``): bf16 through the grouped
kernel's meta, other dtypes through CUDA's ``_grouped_mm_fallback`` (whose allocations the meta kernel, bf16
only, cannot give), so an fp32 MoE profile traces instead of ending in a traceback."""

import json

import pytest

torch = pytest.importorskip("torch")

from estimator.api import estimate  # noqa: E402
from estimator.profiler.cuda_path import cuda_composites  # noqa: E402
from estimator.spec import RunSpec, TrainingSpec  # noqa: E402

QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 128, "intermediate_size": 384, "moe_intermediate_size": 64,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
             "num_experts": 16, "num_experts_per_tok": 4, "decoder_sparse_step": 1, "mlp_only_layers": [0],
             "vocab_size": 1000, "max_position_embeddings": 2048, "tie_word_embeddings": False,
             "norm_topk_prob": True, "router_aux_loss_coef": 0.001, "output_router_logits": False}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_grouped_mm_allocates_what_cuda_allocates(dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), cuda_composites():
        tokens = torch.empty(96, 32, dtype=dtype, requires_grad=True)
        experts = torch.empty(8, 32, 64, dtype=dtype, requires_grad=True)
        offs = torch.arange(12, 97, 12, dtype=torch.int32)
        out = torch.nn.functional.grouped_mm(tokens, experts, offs=offs)
        assert out.shape == (96, 64) and out.dtype == dtype
        out.backward(torch.empty_like(out))
        assert tokens.grad.shape == tokens.shape and experts.grad.shape == experts.shape


def test_an_fp32_moe_model_is_estimated(tmp_path):
    path = tmp_path / "qwen3_moe.json"
    path.write_text(json.dumps(QWEN3_MOE))

    def peak(precision):
        return estimate(RunSpec(model=str(path), training=TrainingSpec(precision=precision, attn="eager",
                                                                        micro_batch_size=2, seq_len=128)))

    fp32, bf16 = peak("fp32"), peak("bf16")
    # the weights, their grads and both Adam states double; activations do too, up to the bf16 path's fp32 parts
    assert fp32.breakdown["weights"] == 2 * bf16.breakdown["weights"]
    assert fp32.peak_allocated_bytes > bf16.peak_allocated_bytes


def test_a_dense_first_layer_is_counted_as_dense(tmp_path):
    """Qwen3-MoE with ``mlp_only_layers: [0]``: layer 0 holds a dense MLP, the others experts. The profile
    records the whole model's layer kinds and the parameter table gives each layer its own tensors (the estimate
    was +13.7 % over a real CPU run at b1 s160 when every layer was counted as a mixture-of-experts one)."""
    from estimator.models.params import param_counts
    from estimator.profiler.cache import load_model_profile

    def estimate_of(config, name):
        path = tmp_path / name
        path.write_text(json.dumps(config))
        spec = RunSpec(model=str(path), training=TrainingSpec(precision="bf16", attn="eager", micro_batch_size=1,
                                                               seq_len=64))
        return estimate(spec), spec

    dense_first, spec = estimate_of(QWEN3_MOE, "dense_first.json")
    assert any(n.startswith("layers: 2 kinds of decoder layer") for n in dense_first.notes)
    _arch, profile = load_model_profile(spec.model, spec.training)
    dense_mlp = 3 * 128 * 384
    experts = 16 * (128 * 2 * 64 + 64 * 128) + 16 * 128  # gate_up, down, router
    total, _ = param_counts(profile["params"], 4)
    uniform_total, _ = param_counts({**profile["params"], "layer_kinds": None}, 4)
    assert uniform_total - total == experts - dense_mlp
    uniform, _ = estimate_of({**QWEN3_MOE, "mlp_only_layers": []}, "uniform.json")
    assert not any(n.startswith("layers:") for n in uniform.notes)
