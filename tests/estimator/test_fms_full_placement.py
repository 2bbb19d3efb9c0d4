"""fms-acceleration's single-GPU Mistral-7B full fine-tuning at b4 (published nvml_used 74.26 GiB for the
transformers 4.44 / 4.45 commits, torch 2.4.1) against the H200 re-run of the same configuration
(benchmarks/fms_full_capacity_gpu.py: transformers 4.48.1, torch 2.11; snapshot in
data/measurements/h200-141gb/snapshots_bench/). Where the estimate's -5.2 % lies (benchmarks/fms_full_stream.py
--torch-slices, docs/allocator.md): the real stream with torch 2.4.1's slices meets the published level; the
estimate's own stream does not: its gradients take other segments from the last layer's recomputation on, where
the real run makes temporaries the trace lacks (not located further). No torch."""

import csv
import pathlib
from collections import Counter

import pytest

from estimator.allocator.snapshot import load_snapshot

ROOT = pathlib.Path(__file__).resolve().parents[2]
SNAPSHOTS = ROOT / "data" / "measurements" / "h200-141gb" / "snapshots_bench"
MIB, GIB = 1024 * 1024, 1024**3
ROW_ID = "fms_acceleration:9239802cc91a:none:Mistral-7B-v0.1:full:x1:b4:nvml"  # transformers 4.45.2, torch 2.4.1
CONTEXT_PRIOR_BYTES = 512 * MIB  # a100-80gb's documented CUDA-context prior (no fitted term ships)
STEPS_RECORDED = 6


def _row() -> dict:
    with open(ROOT / "data" / "public" / "measurements.csv") as handle:
        return next(r for r in csv.DictReader(handle) if r["row_id"] == ROW_ID)


def _sizes(name: str) -> Counter:
    trace = load_snapshot(str(SNAPSHOTS / f"{name}.snapshot.pickle.gz"))["device_traces"][0]
    return Counter(event["size"] for event in trace if event["action"] == "alloc")


@pytest.mark.slow
def test_the_real_full_step_with_torch_24s_slices_meets_the_published_level(monkeypatch):
    """The recorded stream rewritten with torch 2.4.1's full-range slices, in 4.45's loss order, plus the context
    prior is the published device level within 0.2 %; the estimate's stream stays two logits segments short, with
    more of those segments left wholly free when step 1 ends (3 of 4 against the real run's 1)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from fms_full_stream import as_445_loss_order, free_logits_segments, generated, through
    from fms_lora_loss_segments import HIDDEN, with_full_range_slices
    from reserved_stream_diff import recorded

    row = _row()
    assert row["torch_version"] == "2.4.1" and row["full_range_slices"] == "True"
    published = int(row["value_bytes"])
    rec, starts, _ = recorded(SNAPSHOTS / "fms_mistral7b_full_b4.snapshot.pickle.gz", 4 * 4096 * 8, 0)
    real, real_starts = with_full_range_slices(as_445_loss_order(rec, 4, 4096, 32001), starts, 4, 4096, 32001,
                                               HIDDEN)
    real_peak = through(real, None)[0]
    assert abs(real_peak + CONTEXT_PRIOR_BYTES - published) / published < 0.002
    estimate, estimate_starts = generated(row, 32001)
    gap = real_peak - through(estimate, None)[0]  # 73.80 vs 69.87 GiB: 4,032 MiB
    assert 2 * 2000 * MIB <= gap < 3 * 2000 * MIB
    logits_bytes = int(0.95 * 4 * 4096 * 32001 * 2)
    assert free_logits_segments(real, real_starts[2], logits_bytes) == (1, 4)
    assert free_logits_segments(estimate, estimate_starts[2], logits_bytes) == (3, 4)


@pytest.mark.slow
def test_the_norm_weight_gradient_blocks_are_not_what_the_estimate_lacks(monkeypatch):
    """65 blocks of 138,412,032 B per step (2 x 32 layer norms + the final norm) in the full run, none in the LoRA
    run (norm weights frozen); injected into the estimate's stream at each norm weight's gradient they leave its
    reserved peak as it is."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from fms_full_stream import NORM_REDUCTION_BYTES, generated, through, with_norm_reductions

    assert _sizes("fms_mistral7b_full_b4")[NORM_REDUCTION_BYTES] == 65 * STEPS_RECORDED
    assert _sizes("fms_mistral7b_lora16_b4")[NORM_REDUCTION_BYTES] == 0
    estimate, _ = generated(_row(), 32001)
    injected, count = with_norm_reductions(estimate, 4, 4096, 4096)
    assert count == 65 * 3  # the estimate's three steps
    assert through(injected, None)[0] == through(estimate, None)[0]
