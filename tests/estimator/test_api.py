import dataclasses

import pytest

from estimator.api import estimate
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec

MODEL = "facebook/opt-125m"  # shipped profiles: no torch needed


def _spec(method="single", world=1, tp=1, **training):
    return RunSpec(model=MODEL, parallel=ParallelSpec(method=method, world_size=world, tp=tp),
                   training=TrainingSpec(**training), gpu="h100-80gb")


def test_contract_fields():
    est = estimate(_spec())
    data = est.to_dict()
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "peak_device_bytes", "fits", "breakdown", "phase",
                "worst_rank", "ranks", "capacity_bytes", "headroom_bytes"):
        assert key in data
    assert est.peak_allocated_bytes <= est.peak_reserved_bytes <= est.peak_device_bytes
    assert sum(est.breakdown.values()) == pytest.approx(est.peak_allocated_bytes, rel=1e-6)


def test_sharding_reduces_model_state():
    single = estimate(_spec()).peak_allocated_bytes
    ddp = estimate(_spec("ddp", 4)).peak_allocated_bytes
    zero3 = estimate(_spec("zero3", 4)).peak_allocated_bytes
    fsdp = estimate(_spec("fsdp", 4)).peak_allocated_bytes
    assert ddp > single > fsdp and single > zero3


def test_offload_reports_host_ram():
    est = estimate(_spec("zero_offload", 2))
    assert est.host_ram_bytes > 0


def test_seq_beyond_positions_is_a_field_error():
    with pytest.raises(ValueError, match="^seq_len: "):
        estimate(_spec(seq_len=4096))


def test_unknown_gpu_is_a_field_error():
    with pytest.raises(ValueError, match="^gpu: "):
        estimate(RunSpec(model=MODEL, gpu="b300"))


def test_qlora_stores_frozen_linear_weights_in_4_bits():
    from estimator.model_params import NF4_DOUBLE_QUANT_BYTES_PER_ELEM

    training = TrainingSpec(precision="bf16", lora_rank=8, micro_batch_size=1, seq_len=256)
    lora = estimate(RunSpec(model="Qwen/Qwen2.5-0.5B", training=training))
    qlora = estimate(RunSpec(model="Qwen/Qwen2.5-0.5B", training=dataclasses.replace(training, qlora=True)))
    saved = lora.breakdown["weights"] - qlora.breakdown["weights"]
    # Every decoder linear weight goes from 2 bytes to ~0.516; embeddings (tied head) stay 16-bit.
    arch_linear = 24 * (896 * 896 * 2 + 896 * 128 * 2 + 3 * 896 * 4864)
    assert saved == pytest.approx(arch_linear * (2 - NF4_DOUBLE_QUANT_BYTES_PER_ELEM), rel=1e-3)
    assert qlora.peak_allocated_bytes < lora.peak_allocated_bytes
