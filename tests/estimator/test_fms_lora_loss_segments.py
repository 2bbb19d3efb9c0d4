"""fms-acceleration's single-GPU Mistral-7B LoRA at 32,001 vocabulary rows against the same configuration run on a
real H200 (benchmarks/fms_full_capacity_gpu.py --lora-rank 16: transformers 4.48.1, peft 0.13.2, torch 2.11, q/k/v/o
r16, reentrant checkpointing, s 4096; snapshots in data/measurements/h200-141gb/snapshots_bench/). No torch: the
snapshots are read with the restricted unpickler, the profile is the shipped one."""

import csv
import pathlib

import pytest

from estimator.allocator.replay import replay_device
from estimator.allocator.snapshot import check_snapshot, load_snapshot

ROOT = pathlib.Path(__file__).resolve().parents[2]
SNAPSHOTS = ROOT / "data" / "measurements" / "h200-141gb" / "snapshots_bench"
MIB = 1024 * 1024
RESERVED_TOLERANCE_PCT = 0.6  # the estimate's reserved peak against the recorded one (-0.19 % b8, -0.50 % b4)


def _row(batch: int) -> dict:
    row_id = f"fms_acceleration:24bdadb228e2:none:Mistral-7B-v0.1:lora:x1:b{batch}:nvml"  # transformers 4.48.1
    with open(ROOT / "data" / "public" / "measurements.csv") as handle:
        return next(r for r in csv.DictReader(handle) if r["row_id"] == row_id)


def _shape(lines: list[str]) -> list[str]:
    """Placement lines without the request index and with segments named by first appearance in the region."""
    names: dict[str, str] = {}
    out = []
    for line in lines:
        _index, what, size, _seg, order, rest = line.split(None, 5)
        out.append(f"{what} {size} #{names.setdefault(order, str(len(names)))} {rest}")
    return out


@pytest.mark.parametrize("batch", [4, 8])
def test_the_lora_runs_replay_exactly(batch):
    report = replay_device(check_snapshot(load_snapshot(
        str(SNAPSHOTS / f"fms_mistral7b_lora16_b{batch}.snapshot.pickle.gz"))), 0)
    assert report["mismatches"] == []
    assert report["addr_matches"] == report["allocs"] > 30_000
    assert report["num_alloc_retries"] == 0
    assert report["reserved_peak_bytes"]["recorded"] == report["reserved_peak_bytes"]["simulated"]


@pytest.mark.parametrize("batch, logits_segments_mib", [(4, 9006), (8, 18006)])
def test_the_real_run_makes_the_estimates_fifth_logits_segment(monkeypatch, batch, logits_segments_mib):
    """Step 1's sixteen logits-sized requests land alike in the estimate's stream and the recorded one, both make
    five logits-sized segments (the SliceBackward zero-fill's included), and the reserved peaks agree."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from fms_full_stream import generated
    from fms_lora_loss_segments import logits_min_bytes, loss_region, recorded_stream

    min_bytes = logits_min_bytes(batch, 4096, 32001)
    estimate = loss_region(*generated(_row(batch), 32001), min_bytes)
    real = loss_region(*recorded_stream(batch), min_bytes)
    assert len(estimate[0]) == 16
    assert _shape(estimate[0]) == _shape(real[0])
    assert estimate[2] == real[2] == logits_segments_mib * MIB
    assert abs(estimate[3] - real[3]) / real[3] * 100 < RESERVED_TOLERANCE_PCT
    fifth = next(line for line in _shape(real[0]) if " #4 " in line)
    assert fifth.startswith(f"A {batch * 4096 * 32001 * 4 / MIB:.3f}MiB")  # the zero-filled b x s x V fp32 gradient
