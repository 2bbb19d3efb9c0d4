"""The estimator's allocated peak vs a full-depth fake-tensor trace of the real transformers model."""

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from estimator.api import estimate  # noqa: E402
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec  # noqa: E402

from .oracle_util import traced_peak_bytes  # noqa: E402

# six decoder layers: deeper than the profile's shrunken model, so the replay extrapolates (shared with
# benchmarks/reserved_every_k.py)
TINY = {family: json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
                            / f"{family}_6layer_tiny.json").read_text()) for family in ("llama", "opt")}


def _tensor_peak(est) -> int:
    return est.traced_allocated_bytes


@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize("training", [
    TrainingSpec(precision="fp32", micro_batch_size=3, seq_len=96, attn="eager"),
    TrainingSpec(precision="mixed_bf16", micro_batch_size=1, seq_len=64, grad_ckpt=True),
    TrainingSpec(precision="fp32", micro_batch_size=3, seq_len=96, attn="eager", loop="manual"),
    TrainingSpec(precision="bf16", micro_batch_size=2, seq_len=64, loop="manual"),
])
def test_single_gpu_allocated_peak_within_1_percent(tmp_path, family, training):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY[family]))
    est = estimate(RunSpec(model=str(path), training=training))
    reference = traced_peak_bytes(TINY[family], training)
    assert abs(_tensor_peak(est) - reference) / reference < 0.01


@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize(("method", "world", "training"), [
    ("fsdp", 3, TrainingSpec(precision="fp32", micro_batch_size=2, seq_len=96, attn="eager")),
    ("fsdp", 4, TrainingSpec(precision="mixed_bf16", micro_batch_size=1, seq_len=64, grad_ckpt=True)),
    pytest.param("fsdp", 2, TrainingSpec(precision="bf16", micro_batch_size=2, seq_len=64, grad_accum_steps=2),
                 marks=pytest.mark.slow),
    ("fsdp", 3, TrainingSpec(precision="fp32", micro_batch_size=2, seq_len=96, attn="eager", loop="manual")),
    ("ddp", 2, TrainingSpec(precision="mixed_bf16", micro_batch_size=2, seq_len=64)),
    pytest.param("ddp", 2, TrainingSpec(precision="fp32", micro_batch_size=1, seq_len=64, grad_accum_steps=3),
                 marks=pytest.mark.slow),
])
def test_distributed_allocated_peak_within_1_percent(tmp_path, family, method, world, training):
    """Per rank, against the harness's fake-process-group trace of the wrapped model (unrounded storages)."""
    from harness.fake import trace_run

    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY[family]))
    spec = RunSpec(model=str(path), training=training, parallel=ParallelSpec(method=method, world_size=world))
    est = estimate(spec)
    traced = trace_run(spec, config=TINY[family], round_to=1)["per_rank"]
    for rank in est.ranks:
        reference = traced[rank.rank]["peak_allocated_bytes"]
        predicted = rank.traced_allocated_bytes
        assert abs(predicted - reference) / reference < 0.01, (rank.rank, predicted, reference)
