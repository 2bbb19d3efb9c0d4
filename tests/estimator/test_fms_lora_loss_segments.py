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
    from fms_lora_loss_segments import logits_min_bytes, loss_region, modern_slicing, recorded_stream

    min_bytes = logits_min_bytes(batch, 4096, 32001)
    estimate = loss_region(*generated(modern_slicing(_row(batch)), 32001), min_bytes)  # the H200 run's torch 2.11
    real = loss_region(*recorded_stream(batch), min_bytes)
    assert len(estimate[0]) == 16
    assert _shape(estimate[0]) == _shape(real[0])
    assert estimate[2] == real[2] == logits_segments_mib * MIB
    assert abs(estimate[3] - real[3]) / real[3] * 100 < RESERVED_TOLERANCE_PCT
    fifth = next(line for line in _shape(real[0]) if " #4 " in line)
    assert fifth.startswith(f"A {batch * 4096 * 32001 * 4 / MIB:.3f}MiB")  # the zero-filled b x s x V fp32 gradient


def test_the_loss_slice_rewrite_inserts_the_vocabulary_slices_node():
    """An allocation of c x b x s bytes followed by the free of a c x b x s - c x b storage gets, before it, a new
    storage of the freed one's size (the vocabulary dimension's zero-fill), freed after it; nothing else moves."""
    from estimator.reserved.torch_slices import with_full_range_slices

    polys = [[0, 0, 0, 0, 8, 0], [0, 0, 0, -8, 8, 0], [0, 0, 0, 0, 2, 0]]  # over (1, s, s^2, b, b*s, b*s^2)
    events = {"polys": polys, "size": [1, 1, 0, 2],
              "segments": {"mid_bw": [0, 1, ~0, 2, ~1, 3, ~2, ~3], "fw": [3, ~3]}}
    sliced = with_full_range_slices(events)
    assert sliced["segments"]["mid_bw"] == [0, 1, ~0, 4, ~1, 2, ~4, 3, ~2, ~3]
    assert sliced["size"] == [1, 1, 0, 2, 1] and sliced["segments"]["fw"] == [3, ~3]
    assert with_full_range_slices(events) is sliced and events["size"] == [1, 1, 0, 2]


@pytest.mark.parametrize("row_id", ["fms_acceleration:9239802cc91a:none:Mistral-7B-v0.1:lora:x1:b8:nvml",
                                    "fms_acceleration:24bdadb228e2:none:Mistral-7B-v0.1:lora:x1:b4:nvml"])
def test_torch_24s_slices_make_one_logits_segment_less(monkeypatch, row_id):
    """The estimator's event rewrite (``full_range_slices``, the rows' torch 2.4.1) replays to the reserved peak of
    the request-level rewrite of the benchmark, one logits-sized segment (4002 MiB at b8, 2002 at b4) below the
    estimate with torch 2.11's slicing."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from fms_full_stream import generated, through
    from fms_lora_loss_segments import HIDDEN, modern_slicing, with_full_range_slices

    with open(ROOT / "data" / "public" / "measurements.csv") as handle:
        row = next(r for r in csv.DictReader(handle) if r["row_id"] == row_id)
    assert row["full_range_slices"] == "True" and row["torch_version"] == "2.4.1"
    batch = int(row["micro_batch_size"])
    modern = generated(modern_slicing(row), 32001)
    stated = through(generated(row, 32001)[0], None)[0]
    assert stated == through(with_full_range_slices(*modern, batch, 4096, 32001, HIDDEN)[0], None)[0]
    assert through(modern[0], None)[0] - stated == (4002 if batch == 8 else 2002) * MIB
