"""LLMem Table 2's fp16 configuration (16 GB allocator cap, mixed_fp16 with the loss scaler, eager attention,
gradient checkpointing, seq 512) on a real H200 (session 30: torch 2.11, transformers 5.17; the allocator's whole
history of each run is committed under data/measurements/h200-141gb/snapshots/). The estimator's generated stream
for each spec, replayed through the allocator model, against the level the recorded stream reaches. Profiles ship,
so nothing is traced here."""

import pathlib

import pandas as pd
import pytest

from calibrate.terms import rank_estimates
from estimator.allocator.replay import replay_device
from estimator.allocator.snapshot import check_snapshot, load_snapshot
from estimator.hardware.residuals import load_coefficients

H200 = pathlib.Path(__file__).resolve().parents[2] / "data" / "measurements" / "h200-141gb"
MIB = 1024 * 1024
# What the trace does not run, so the generated stream lacks (docs/allocator.md, helper s8fp16): the CUDA reduce
# kernel's global-memory scratch after each bias / LayerNorm-weight gradient and softmax backward's
# ``grad * output`` scratch. Each lands in a cached block; together they move the level by one 4 MiB block or none.
RESIDUE_BYTES = 4 * MIB
UNCAPPED = {"03f54c3e8b61dd96-94025a6a": "OPT-125m b4", "ae163bf45cc8f783-94025a6a": "OPT-125m b16",
            "c2085911e32d57ef-94025a6a": "OPT-350m b6", "0319c99811662588-94025a6a": "OPT-350m b12"}


def _estimates(run_ids) -> list[tuple[pd.Series, object]]:
    rows = pd.read_csv(H200 / "gpu_snapshots.csv")
    rows = rows[rows["run_id"].isin(run_ids)]
    results = rank_estimates(rows, load_coefficients("h200-141gb"), allow_build=False)
    assert not [r for r in results if isinstance(r, str)]
    return [(row, rank) for (_, row), (_, rank) in zip(rows.iterrows(), results)]


def _recorded_peak(run_id: str) -> int:
    snapshot = check_snapshot(load_snapshot(str(H200 / "snapshots" / f"{run_id}.rank0.snapshot.pickle.gz")))
    report = replay_device(snapshot, 0)
    assert report["reserved_peak_bytes"]["recorded"] == report["reserved_peak_bytes"]["simulated"]
    return report["reserved_peak_bytes"]["recorded"]


@pytest.mark.parametrize("run_id", sorted(UNCAPPED))
def test_generated_stream_reaches_the_recorded_reserved_peak(run_id):
    """No retry under the cap at these four points: the estimate is the replayed level of the generated stream.
    Before CUDA's fp16 -> fp32 softmax kernel was traced (the CPU composite's fp32 copy of the scores and the fp32
    gradient it casts back), these were +5.3, -16.1, +7.2 and -10.3 %."""
    ((row, rank),) = _estimates([run_id])
    recorded = _recorded_peak(run_id)
    assert recorded == row["peak_reserved_bytes"] and row["num_alloc_retries"] == 0
    assert rank.reserved_source == "replayed"
    assert abs(rank.peak_reserved_bytes - recorded) <= RESIDUE_BYTES, (UNCAPPED[run_id], rank.peak_reserved_bytes,
                                                                     recorded)


def test_bloom_b4_under_the_runs_cap_retries_as_measured():
    """BLOOM-560m b4 reached the 16 GiB cap once, released its cache and retried (the row's memory_cap_bytes and
    num_alloc_retries): the spec read from the row carries the cap, so the estimate replays under it. Uncapped, the
    generated stream's level was +8.5 %; under the cap it retries as the run did and lands within 0.5 % (the
    recorded stream through the model: 17,098,080,256 B, docs/allocator.md)."""
    run_id = "e2d8af99288be83b-94025a6a"
    ((row, rank),) = _estimates([run_id])
    assert row["memory_cap_bytes"] == 16 * 1024**3 and row["num_alloc_retries"] == 1
    assert rank.reserved_source == "replayed" and rank.num_alloc_retries == 1 and not rank.allocator_oom
    recorded = _recorded_peak(run_id)
    assert abs(rank.peak_reserved_bytes - recorded) / recorded < 0.005, (rank.peak_reserved_bytes, recorded)
