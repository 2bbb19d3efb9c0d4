"""The estimator against real GPU measurements: this project's harness runs on one NVIDIA H200 (torch 2.11,
data/measurements/h200-141gb/, session 15). Profiles for every measured spec ship, so nothing is traced here."""

import pathlib
import statistics

import pandas as pd

from calibrate.terms import rank_estimates
from estimator.hardware.residuals import load_coefficients

MEASUREMENTS = pathlib.Path(__file__).resolve().parents[2] / "data" / "measurements" / "h200-141gb"


SESSION_15 = "6362787470fda86aec0aa84543cbfa5a57cd7e4d"  # the harness's git sha in each row
SESSION_25 = "5ea8c9220392da1da6bf51a86466109f7ce49415"
SESSION_26 = "262911dfe08e6d0aa6d082bcf5a67adc1027f04e"
SESSION_30 = "ad1c8d2f2ed935acd5a505fadf8e393f7839c92f"


def scored(table: str, git_sha: str | None = None, run_ids: tuple[str, ...] = ()) -> list[tuple[pd.Series, object]]:
    rows = pd.read_csv(MEASUREMENTS / f"{table}.csv")
    rows = rows[(rows["run_status"] == "ok") & ((rows["git_sha"] == git_sha) if git_sha else True)
                & (rows["run_id"].isin(run_ids) if run_ids else True)]
    results = rank_estimates(rows, load_coefficients("h200-141gb"), allow_build=False)
    assert not [r for r in results if isinstance(r, str)]
    return [(row, rank) for (_, row), (_, rank) in zip(rows.iterrows(), results)]


def pct(predicted: int, measured: int) -> float:
    return 100.0 * (predicted - measured) / measured


def test_three_step_runs_are_matched_at_the_allocated_and_reserved_level():
    """The snapshot runs measured 3 steps (the cache's steady state, which the replay reaches): single GPU in
    three precisions and both loops, and two FSDP2 ranks, whose side-stream pools the replay reproduces to the
    byte. Allocated includes the allocator's block rounding (docs/allocator.md)."""
    for row, rank in scored("gpu_snapshots", SESSION_15):
        assert rank.reserved_source == "replayed"
        assert abs(pct(rank.peak_allocated_bytes, row["peak_allocated_bytes"])) < 0.2, row["run_id"]
        assert abs(pct(rank.peak_reserved_bytes, row["peak_reserved_bytes"])) < 0.15, row["run_id"]


def test_single_gpu_runs_across_architectures_batches_and_precisions():
    results = scored("gpu_single")
    assert len(results) >= 120
    allocated = [abs(pct(rank.peak_allocated_bytes, row["peak_allocated_bytes"])) for row, rank in results]
    reserved = [abs(pct(rank.peak_reserved_bytes, row["peak_reserved_bytes"])) for row, rank in results]
    assert max(allocated) < 0.5
    assert statistics.median(reserved) < 0.1 and sorted(reserved)[int(0.9 * len(reserved))] < 2.0


def test_every_method_on_emulated_ranks_at_the_allocated_level():
    """DDP, FSDP2, TP, dp_tp and DeepSpeed ZeRO-1/2/3 at 2/4/8 ranks (Llama-3.2-1B, ranks 0 and last)."""
    results = scored("gpu_emulated", SESSION_15)
    assert {row["method"] for row, _ in results} == {"ddp", "fsdp", "tp", "dp_tp", "zero1", "zero2", "zero3"}
    assert max(abs(pct(rank.peak_allocated_bytes, row["peak_allocated_bytes"])) for row, rank in results) < 1.0


def test_deepspeed_zero12_ranks_are_replayed_to_the_byte():
    """DeepSpeed ZeRO-1/2's own tensors in the replay (estimator/reserved/zero.py): the flat buffer, the master
    partition, the IPG bucket and its flushes, grads_in_partition and the partition's step. Every rank's reserved
    peak is the H200's (the prior was 8-14 % under in the median, 36 % at worst) and the allocated one too (the
    flush's concatenated slices included)."""
    zero = [(row, rank) for row, rank in scored("gpu_emulated", SESSION_15) if row["method"] in ("zero1", "zero2")]
    assert len(zero) == 24
    for row, rank in zero:
        assert rank.reserved_source == "replayed", row["run_id"]
        assert rank.peak_reserved_bytes == row["peak_reserved_bytes"], row["run_id"]
        assert abs(pct(rank.peak_allocated_bytes, row["peak_allocated_bytes"])) < 0.01, row["run_id"]




def test_session_30_zero2_ranks_of_three_more_architectures():
    """ZeRO-2 (default buckets) at 2 and 8 ranks on Pythia-1b (untied head), BLOOM-1b1 and OPT-1.3b (tied
    embeddings, biases), b 2 s 1024: every rank's reserved peak is the H200's to the byte, and the allocated one
    within 0.05 %. Pythia at 8 ranks peaks in backward at the head gradient's hook, where DeepSpeed allocates
    its IPG bucket: after the head's node released the logits gradient (``summary._hook_moments``; counted with
    it, +2.51 %). Open: OPT-1.3b at 8 ranks, whose real backward holds 102 MB above the replay (-1.18 %; at 2
    ranks the optimizer step is the peak and hides the same gap)."""
    results = [(row, rank) for row, rank in scored("gpu_emulated", SESSION_30) if row["method"] == "zero2"]
    assert {row["model"] for row, _ in results} == {"EleutherAI/pythia-1b", "bigscience/bloom-1b1",
                                                    "facebook/opt-1.3b"} and len(results) == 12
    for row, rank in results:
        assert rank.peak_reserved_bytes == row["peak_reserved_bytes"], row["run_id"]
        error = pct(rank.peak_allocated_bytes, row["peak_allocated_bytes"])
        if row["run_id"] == "05fda6a428ed3666-6a6b3194":  # the open OPT row: under, by the 102 MB
            assert -1.2 < error < 0, row["run_id"]
        else:
            assert abs(error) < 0.05, row["run_id"]

SHARDED = ("fsdp", "fsdp1", "tp", "dp_tp", "zero1", "zero2", "zero3")


def test_session_25_ranks_every_k_and_held_gradients_at_both_levels():
    """Session 25's snapshot and MoE runs (2026-11-27): every-k checkpointing under FSDP2, FSDP1 and dp_tp, FSDP2
    holding its gradients under accumulation (grad_sync last, fp32 and mixed), FSDP1 in every sharding strategy
    and with LoRA, TP x 8, ZeRO-1/2/3 and five MoE families at full width. Every rank is replayed; allocated is
    within 0.4 % everywhere; the sharded dense ranks' reserved level is the H200's within 0.05 %."""
    results = scored("gpu_snapshots", SESSION_25) + scored("gpu_moe", SESSION_25)
    assert len(results) >= 60
    for row, rank in results:
        assert rank.reserved_source == "replayed", row["run_id"]
        assert abs(pct(rank.peak_allocated_bytes, row["peak_allocated_bytes"])) < 0.4, row["run_id"]
        if row["method"] in SHARDED and not row["model"].endswith(".json"):
            assert abs(pct(rank.peak_reserved_bytes, row["peak_reserved_bytes"])) < 0.05, row["run_id"]


def test_session_26_fsdp1_offload_flat_accumulation_and_reentrant_lora_are_replayed_to_the_byte():
    """Session 26's FSDP1 rows (Llama-3.2-1B, mixed_bf16, 4 ranks, b1 s1024, 2026-11-27; ranks 0 and 3).
    ``cpu_offload``: each unit's host shard copied to the device and cast to 16 bits for its all-gather (the root's
    again in its pre-backward), the new shards dropped as backward ends, the step on the host (was -45.76 % on
    the prior). Without use_orig_params under accumulation 2 (reducing every micro-batch): the first
    micro-batch's new shards kept as the flat parameters' ``.grad``, the second's added into them, ``zero_grad``
    freeing them (was -22.72 %). FSDP1 x 2 with LoRA r16, bf16 and reentrant checkpointing, b4 s2048 (ranks 0 and 1):
    transformers 5.17's layers checkpoint themselves inside their unit, so nothing is kept to backward's end
    (``reentrant_kept_input_bytes`` 0) and the replay is the H200's."""
    measured = {"15898dcca26c5b27-a4b7c02a": 8_413_773_824, "5a02b66474e7545d-a4b7c02a": 12_941_524_992,
                "dc88be634d64b862-c4073027": 18_073_255_936}
    rows = scored("gpu_snapshots", SESSION_26, tuple(measured))
    ranks = {"dc88be634d64b862-c4073027": (0, 1)}
    assert sorted((row["run_id"], row["rank"]) for row, _ in rows) == [
        (r, k) for r in sorted(measured) for k in ranks.get(r, (0, 3))]
    for row, rank in rows:
        assert rank.reserved_source == "replayed", row["run_id"]
        assert rank.peak_reserved_bytes == row["peak_reserved_bytes"] == measured[row["run_id"]], row["run_id"]
        assert abs(pct(rank.peak_allocated_bytes, row["peak_allocated_bytes"])) < 0.01, row["run_id"]


def test_qwen3_moe_backward_fills_replay_the_reserved_level_to_the_byte():
    """Qwen3-30B-A3B (2 layers, transformers 5.17, b4 s1024) in mixed_bf16 and bf16: the index backwards of the
    experts' token gather and reordering fill their zeros in place on the GPU (``StorageRecorder.
    _fills_fresh_zeros``); traced out of place, the replay was -3.57 % and -3.06 % under the H200's level."""
    measured = {("gpu_snapshots", "5ab4fc0f4edbaa4d-c862afd8"): 47_190_114_304,
                ("gpu_moe", "5ab4fc0f4edbaa4d"): 47_190_114_304, ("gpu_moe", "b8d74e9f5e1c5c6b"): 26_342_326_272}
    for (table, run_id), level in measured.items():
        (row, rank), = scored(table, run_ids=(run_id,))
        assert rank.reserved_source == "replayed", run_id
        assert rank.peak_reserved_bytes == row["peak_reserved_bytes"] == level, run_id
        assert abs(pct(rank.peak_allocated_bytes, row["peak_allocated_bytes"])) < 0.01, run_id
