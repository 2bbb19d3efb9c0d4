"""The estimate against fms-acceleration's Mistral-7B LoRA configuration re-run on a real H200 with the rows' own
transformers 4.48.1 and peft 0.13.2 (``benchmarks/fms_fsdp1_lora_gpu.py``, results committed in
``benchmarks/results/fms_fsdp1_lora_gpu_h200.jsonl``; docs/LOG.md, session 25): FSDP1 x 2 (rank 0 on the fake
process group) and one GPU, reentrant and non-reentrant checkpointing. Shipped profiles only (no build)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from estimator.api import estimate
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "fms_fsdp1_lora_gpu_h200.jsonl"
POINTS = [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]


def _estimate_bytes(point: dict) -> int:
    training = TrainingSpec(micro_batch_size=point["batch"], seq_len=point["seq_len"], precision="bf16",
                            grad_ckpt=True, attn="sdpa", lora_rank=16, lora_targets="k_proj,o_proj,q_proj,v_proj",
                            lora_dropout=0.1, model_code=point["transformers"], use_cache=True,
                            ckpt_reentrant=point["reentrant"])
    parallel = ParallelSpec(method="fsdp1" if point["world"] > 1 else "single", world_size=point["world"])
    spec = RunSpec(model="mistralai/Mistral-7B-v0.1", training=training, parallel=parallel)
    return estimate(spec, allow_build=False).ranks[0].peak_allocated_bytes


@pytest.mark.parametrize("point", POINTS, ids=lambda p: f"x{p['world']}-b{p['batch']}-reentrant{p['reentrant']}")
def test_estimate_is_within_2_percent_of_the_h200_run(point):
    measured = point["peak_allocated_bytes"]
    assert abs(_estimate_bytes(point) - measured) / measured < 0.02


def test_the_reentrant_excess_is_the_one_measured_on_the_gpu():
    """FSDP1's kept inputs (``reentrant_kept_input_bytes``): 1.23 GB at b2 and 1.99 GB at b4 on the GPU, the
    estimate 11-14 % more (its non-reentrant peak, at the loss, is short by about 84 MB + 67 MB per sample);
    one GPU keeps none."""
    by_key = {(p["world"], p["batch"], p["reentrant"]): p for p in POINTS}
    for (world, batch, reentrant), point in by_key.items():
        if not reentrant:
            continue
        other = by_key[(world, batch, False)]
        measured = point["peak_allocated_bytes"] - other["peak_allocated_bytes"]
        estimated = _estimate_bytes(point) - _estimate_bytes(other)
        if world == 1:
            assert abs(measured) < 0.001 * point["peak_allocated_bytes"] and estimated == 0
        else:
            assert measured > 1e9 and 1.0 <= estimated / measured < 1.15, (world, batch, estimated, measured)
