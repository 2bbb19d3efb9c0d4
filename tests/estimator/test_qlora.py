"""QLoRA: the estimator and the fake-tensor trace against real bitsandbytes NF4 weights on CPU tensors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("bitsandbytes")

from estimator.api import estimate  # noqa: E402
from estimator.spec import RunSpec, TrainingSpec  # noqa: E402

from .test_matches_trace import TINY  # noqa: E402

# The tiny oracle configs, wide enough that the NF4 blocks (64 values) and 512-byte rounding do not dominate.
SMALL = {
    "llama": {**TINY["llama"], "hidden_size": 128, "intermediate_size": 320, "num_hidden_layers": 4,
              "vocab_size": 2048},
    # no dropout: a real CPU run draws CPU dropout masks, the profile CUDA's (estimator.profiler.cuda_path)
    "opt": {**TINY["opt"], "hidden_size": 128, "ffn_dim": 512, "num_hidden_layers": 4, "vocab_size": 2048,
            "word_embed_proj_dim": 128, "dropout": 0.0, "attention_dropout": 0.0},
}


def _spec(tmp_path, family: str, training: TrainingSpec) -> RunSpec:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMALL[family]))
    return RunSpec(model=str(path), training=training)


@pytest.mark.parametrize("family", sorted(SMALL))
@pytest.mark.parametrize("training", [
    TrainingSpec(precision="bf16", micro_batch_size=2, seq_len=64, attn="eager", lora_rank=8, qlora=True),
    TrainingSpec(precision="mixed_bf16", micro_batch_size=1, seq_len=96, grad_ckpt=True, lora_rank=4, qlora=True),
])
def test_qlora_estimate_matches_real_bitsandbytes_run(tmp_path, family, training):
    """Real NF4 weights (quantized by bitsandbytes on the move to the CPU), peft's kbit preparation, two AdamW
    steps, every storage counted in 512-byte blocks; and the fake-tensor trace of the same program. The real run
    is a subprocess: real CPU kernels start OpenMP threads, and a later fork of this process (the campaign's
    fork isolation test) would deadlock on them."""
    from harness.fake import trace_run

    spec = _spec(tmp_path, family, training)
    code = ("import json, sys; from estimator.spec import RunSpec; from harness.fake import trace_run; "
            "spec = RunSpec.from_json(sys.stdin.read()); "
            "print(json.dumps(trace_run(spec, fake_tensors=False)['per_rank'][0]))")
    out = subprocess.run([sys.executable, "-c", code], input=spec.to_json(), capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], check=True)
    real = json.loads(out.stdout.strip().splitlines()[-1])
    fake = trace_run(spec, config=SMALL[family])["per_rank"][0]
    rank = estimate(spec).ranks[0]
    predicted = rank.traced_allocated_bytes
    measured = real["peak_allocated_bytes"]
    assert abs(fake["peak_allocated_bytes"] - measured) / measured < 0.001
    assert abs(predicted - measured) / measured < 0.005


def test_qlora_weights_are_nf4_and_the_rest_fp32(tmp_path):
    """The kbit recipe: decoder linears packed 4-bit with an 8-bit absmax per 64 (+ a few small state tensors
    each), embeddings, norms, head and the adapters in fp32."""
    training = TrainingSpec(precision="bf16", micro_batch_size=1, seq_len=64, lora_rank=8, qlora=True)
    qlora = estimate(_spec(tmp_path, "llama", training))
    lower, upper = _weights_bounds(SMALL["llama"], 8, 4, 4)
    assert lower <= qlora.breakdown["weights"] <= upper
    assert any(n.startswith("qlora:") for n in qlora.notes)


def test_qlora_with_flash_attention_casts_its_fp32_inputs(tmp_path):
    """peft's QLoRA keeps the residual stream fp32; transformers' FlashAttention-2 path casts fp32 query, key and
    value to the quantized model's dtype before the kernel (``get_target_dtype``), where SDPA would run CUDA's
    fp32 math kernel with grouped-query heads and keep (b, heads, s, s) probabilities per layer."""
    from estimator.api import load_model_profile

    gqa = {**SMALL["llama"], "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 256,
           "max_position_embeddings": 2048}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(gqa))
    peaks, backends = {}, {}
    for attn in ("sdpa", "flash"):
        training = TrainingSpec(precision="bf16", micro_batch_size=2, seq_len=512, attn=attn, lora_rank=8,
                                qlora=True, grad_ckpt=True)
        peaks[attn] = estimate(RunSpec(model=str(path), training=training)).peak_allocated_bytes
        backends[attn] = load_model_profile(str(path), training)[1]["sdpa_backends"]
    assert backends == {"sdpa": ["math"], "flash": ["flash"]}
    # the probabilities: 2 x 8 heads x 512^2 x 4 B for the checkpointed layer recomputed in backward, at least
    assert peaks["sdpa"] - peaks["flash"] > 2 * 8 * 512 * 512 * 4


def _weights_bounds(cfg: dict, rank: int, adapter_bytes: int, other_bytes: int) -> tuple[int, int]:
    """(lower, upper) of a tiny Llama's QLoRA weights: decoder linears NF4 (0.5 B + an 8-bit absmax per 64), the
    embedding, norms and head at ``other_bytes``, q/v adapters at ``adapter_bytes``; per weight at most six
    512-byte blocks of small state (the absmax rounded up, the code tables, the offset, the nested absmax)."""
    h, ffn, layers, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    linear = layers * (2 * h * h + 2 * h * kv + 3 * h * ffn)
    non_linear = 2 * vocab * h + (2 * layers + 1) * h
    adapters = layers * rank * (h + h + h + kv)
    lower = linear * (0.5 + 1 / 64) + other_bytes * non_linear + adapter_bytes * adapters
    return lower, lower + 7 * layers * 6 * 512


def test_qlora_without_kbit_preparation_keeps_the_rest_and_the_adapters_bf16(tmp_path):
    """``lora_dtype`` model (answer.ai fsdp_qlora's recipe): the same NF4 linears, but embedding, norms, head and
    adapters in bf16 (2 bytes where peft's recipe keeps 4), its own profile, and a note naming the recipe."""
    training = TrainingSpec(precision="bf16", micro_batch_size=1, seq_len=64, lora_rank=8, qlora=True,
                            lora_dtype="model")
    plain = estimate(_spec(tmp_path, "llama", training))
    lower, upper = _weights_bounds(SMALL["llama"], 8, 2, 2)
    assert lower <= plain.breakdown["weights"] <= upper
    assert any("without kbit preparation" in n for n in plain.notes)
    prepared = estimate(_spec(tmp_path, "llama", TrainingSpec(precision="bf16", micro_batch_size=1, seq_len=64,
                                                              lora_rank=8, qlora=True)))
    assert prepared.breakdown["weights"] > upper  # fp32 embedding, norms, head and adapters
    assert plain.peak_allocated_bytes < prepared.peak_allocated_bytes  # a bf16 residual stream, not fp32


@pytest.mark.slow
@pytest.mark.parametrize("training", [
    TrainingSpec(precision="bf16", micro_batch_size=2, seq_len=128, lora_rank=8, qlora=True, lora_dtype="model"),
    TrainingSpec(precision="bf16", micro_batch_size=4, seq_len=96, grad_ckpt=True, attn="eager", lora_rank=8,
                 lora_targets="all-linear", qlora=True, lora_dtype="model"),
    # peft's fp32 adapters on the unprepared base: each takes an fp32 copy of its bf16 input
    TrainingSpec(precision="bf16", micro_batch_size=2, seq_len=128, lora_rank=8, lora_targets="all-linear",
                 qlora=True, qlora_prep="none"),
])
def test_qlora_without_kbit_preparation_matches_real_bitsandbytes_run(tmp_path, training):
    """The real run (bf16 but the adapters, NF4 linears quantized by bitsandbytes on CPU) against the estimate:
    the 1 % bar (benchmarks/qlora_bf16_check.py, docs/error_matrix/qlora_bf16*.csv)."""
    spec = _spec(tmp_path, "llama", training)
    code = ("import json, sys; from estimator.spec import RunSpec; from harness.fake import trace_run; "
            "spec = RunSpec.from_json(sys.stdin.read()); "
            "print(json.dumps(trace_run(spec, fake_tensors=False)['per_rank'][0]))")
    out = subprocess.run([sys.executable, "-c", code], input=spec.to_json(), capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])["peak_allocated_bytes"]
    predicted = estimate(spec).ranks[0].traced_allocated_bytes
    assert abs(predicted - measured) / measured < 0.01
