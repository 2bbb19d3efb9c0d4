
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
