"""What a ZeRO-3 replay must hold, read off the real allocator snapshots of DeepSpeed ZeRO-3 ranks (H100, torch 2.11,
DeepSpeed 0.19.8, Llama-3.2-1B mixed_bf16 b1 s1024, 2 and 4 emulated ranks: ``benchmarks/zero3_trace_anatomy.py``).
No torch here: the snapshots are read with the restricted unpickler and replayed through the allocator model."""

import pathlib

import pandas as pd
import pytest

from benchmarks.zero3_trace_anatomy import DEFAULT, _requests, _trace, stream_pools
from estimator.allocator.requests import simulate

MEASURED = pathlib.Path(__file__).resolve().parents[2] / "data/measurements/h100-80gb/gpu_snapshots.csv"


def _measured(path: pathlib.Path) -> int:
    run_id, rank = path.name.split(".")[0], int(path.name.split(".")[1].removeprefix("rank"))
    rows = pd.read_csv(MEASURED)
    row = rows[(rows["run_id"] == run_id) & (rows["rank"] == rank)]
    assert len(row) == 1 and row.iloc[0]["method"] == "zero3"
    return int(row.iloc[0]["peak_reserved_bytes"])


@pytest.mark.parametrize("path", DEFAULT, ids=lambda p: p.name.split(".snapshot")[0])
def test_three_streams_and_plain_frees_explain_the_reserved_peak(path):
    """On DeepSpeed's three streams (default, allgather, reduce-scatter), with every ``record_stream`` free taken
    at once (the GPU keeps up: 519 of the 521 waited for no allocation) and the setup's one ``empty_cache``, the
    rank's own requests give its reserved peak to the byte; merged onto one stream they fall 8-18 % short. So a
    ZeRO-3 timeline needs each tensor's stream, not the record_stream completion times."""
    trace, streams, _, _ = _trace(path)
    assert len(streams) == 3
    measured = _measured(path)
    assert simulate(_requests(trace, streams, "requested"))["peak_reserved_bytes"] == measured
    assert simulate(_requests(trace, streams, "completed"))["peak_reserved_bytes"] == measured
    one_stream = simulate(_requests(trace, streams, "requested", one_stream=True))["peak_reserved_bytes"]
    assert one_stream < 0.93 * measured


@pytest.mark.parametrize("path", DEFAULT, ids=lambda p: p.name.split(".snapshot")[0])
def test_the_reserved_peak_is_the_sum_of_each_streams_own_peak(path):
    """Pools never share blocks and nothing is released after the setup's empty_cache, so each stream's sequence
    can be replayed on its own: a ZeRO-3 timeline need not place the allgather and reduction streams' requests
    among the default stream's. The two side streams' pools do not depend on the world size here (the gathered
    buffers and the flattened reduction bucket are full-size tensors)."""
    trace, streams, _, _ = _trace(path)
    pools = stream_pools(trace, streams)
    assert sum(pools.values()) == _measured(path)
    assert (pools[1], pools[2]) == (2_197_815_296, 975_175_680)


def _table():
    from estimator.api import _param_table
    from estimator.columns import spec_from_columns
    from estimator.profiler.cache import load_model_profile

    rows = pd.read_csv(MEASURED)
    spec = spec_from_columns(rows[rows["method"] == "zero3"].iloc[0].to_dict())
    arch, profile = load_model_profile(spec.model, spec.training, 1, allow_build=False)
    return _param_table(profile, arch.num_layers), spec


def test_the_reduction_streams_flushes_follow_from_the_parameter_table():
    """Stage 3's IPG flushes in backward order (500M-element bucket): the final norm and eight layers, eight
    layers, then the tied embedding alone (no concatenation): the snapshots' two reduction-stream allocations per
    step, to the byte."""
    from estimator.reserved.zero3_gathers import reduction_flushes

    table, spec = _table()
    assert reduction_flushes(table, spec.parallel.zero.reduce_bucket_size) == [973_148_160, 973_144_064, 0]


def _stream_sequence(path, stream: int) -> list[tuple[str, int]]:
    trace, streams, _, _ = _trace(path)
    return [("+" if e["action"] == "alloc" else "-", e["size"]) for e in trace
            if streams[e["stream"]] == stream and e["action"] in ("alloc", "free_requested")]


@pytest.mark.parametrize("path", DEFAULT, ids=lambda p: p.name.split(".snapshot")[0])
def test_the_coordinator_emulation_is_the_allgather_streams_sequence(path):
    """The emulated parameter coordinator (``estimator.reserved.zero3_gathers``: per-module gathers in the first
    step, prefetches, the coalesced flat tensor and its per-parameter copy-out at the first wait, releases by
    reuse distance) makes every allocation and free of the allgather stream in all three steps, in order, to the
    byte; its pool is the snapshots' (the same at 2 and 4 ranks)."""
    from estimator.reserved.zero3_gathers import emulate, pool_requests

    table, _ = _table()
    world = 2 if path.name.startswith("c4819") else 4
    ops = emulate(table, world)
    assert [("+" if sign > 0 else "-", nbytes) for step in ops.steps for sign, _, nbytes in step] == \
        _stream_sequence(path, 1)
    assert simulate(pool_requests(ops))["peak_reserved_bytes"] == 2_197_815_296


def test_the_estimate_replays_the_measured_zero3_ranks():
    """Every measured ZeRO-3 rank of Llama-3.2-1B (H100 snapshots at 2 and 4 ranks; the H200's emulated rows at 2,
    4 and 8 ranks, micro-batch 1 and 4) and of OPT-1.3b, Pythia-1b and BLOOM-1b1 (H200, 2 and 8 ranks,
    micro-batch 2: their module trace recorded in the profile, ``tests/estimator/test_zero3_arch.py``): the
    reserved peak replayed to the byte at micro-batch 1 and within 0.06 % otherwise (the prior was 5-28 %
    under); the allocated level within 0.25 %."""
    from calibrate.terms import rank_estimates
    from estimator.hardware.residuals import load_coefficients

    root = MEASURED.parents[1]
    checked = 0
    for gpu, table in (("h100-80gb", "gpu_snapshots"), ("h200-141gb", "gpu_emulated")):
        rows = pd.read_csv(root / gpu / f"{table}.csv")
        rows = rows[(rows["run_status"] == "ok") & (rows["method"] == "zero3")]
        for (_, row), (_, rank) in zip(rows.iterrows(), rank_estimates(rows, load_coefficients(gpu),
                                                                       allow_build=False)):
            assert rank.reserved_source == "replayed", row["run_id"]
            measured = int(row["peak_reserved_bytes"])
            if row["micro_batch_size"] == 1:
                assert rank.peak_reserved_bytes == measured, row["run_id"]
            assert abs(rank.peak_reserved_bytes - measured) < 0.0006 * measured, row["run_id"]
            allocated = int(row["peak_allocated_bytes"])
            assert abs(rank.peak_allocated_bytes - allocated) < 0.0025 * allocated, row["run_id"]
            checked += 1
    assert checked == 28


def test_other_architectures_keep_the_prior_with_the_reason():
    """Qwen2.5's attention projections carry biases (two tensors per module: coalesced gathers of their own), a
    structure the module trace is not checked on."""
    from estimator.api import estimate
    from estimator.spec import ParallelSpec, RunSpec, TrainingSpec

    spec = RunSpec(model="Qwen/Qwen2.5-0.5B", gpu="h100-80gb",
                   training=TrainingSpec(precision="mixed_bf16", micro_batch_size=1, seq_len=1024),
                   parallel=ParallelSpec(method="zero3", world_size=2))
    result = estimate(spec, allow_build=False)
    assert result.reserved_source == "prior"
    assert any(n.startswith("reserved: prior") and "Llama-style" in n for n in result.notes)


H200 = MEASURED.parents[1] / "h200-141gb"


def _h200_estimates(run_id: str):
    """(row, RankEstimate) of each recorded rank of an H200 snapshot run (``gpu_snapshots.csv``)."""
    from calibrate.terms import rank_estimates
    from estimator.hardware.residuals import load_coefficients

    rows = pd.read_csv(H200 / "gpu_snapshots.csv")
    rows = rows[rows["run_id"] == run_id]
    assert len(rows) == 2
    estimates = rank_estimates(rows, load_coefficients("h200-141gb"), allow_build=False)
    return [(row, rank) for (_, row), (_, rank) in zip(rows.iterrows(), estimates)]


@pytest.mark.parametrize("run_id, reserved_pct, allocated_pct", [
    ("faebe8f11fb18b64-a4b7c02a", 0.03, 0.3),  # zero3 + offload_optimizer (the prior was 13.8 % under)
    # zero_offload (the prior: 38.7 % / 23.8 % under; the allocated level 8.9 % under before it counted
    # temp_grad_buffer_for_gpu_offload, now 0.76 %)
    ("21a1459a68b208f3-a4b7c02a", 0.0, 1.0),
])
def test_the_offloaded_optimizer_rows_replay(run_id, reserved_pct, allocated_pct):
    """Llama-3.2-1B mixed_bf16 b1 s1024 on 4 emulated ranks of an H200 with the optimizer on the host
    (DeepSpeed 0.19.8). ZeRO-3: only the 16-bit partition and the IPG bucket in the setup, each flushed gradient's
    partition brought back from the host, its fp64 norm copy and fp32 cast on the reduction stream, nothing after
    backward (``zero3._Step3Offload``). ZeRO-Offload (stage 2): ``temp_grad_buffer_for_gpu_offload`` in the setup,
    each partition piece's fp64 and fp32 copies at its flush (``zero._StepOffload``): rank 0, whose partition
    holds the embedding, makes a 2 GB fp64 copy rank 3 does not, so the ranks' reserved peaks differ by 2.1 GB."""
    reserved = {}
    for row, rank in _h200_estimates(run_id):
        assert rank.reserved_source == "replayed", row["rank"]
        measured = int(row["peak_reserved_bytes"])
        assert abs(rank.peak_reserved_bytes - measured) <= reserved_pct / 100 * measured, row["rank"]
        allocated = int(row["peak_allocated_bytes"])
        assert abs(rank.peak_allocated_bytes - allocated) < allocated_pct / 100 * allocated, row["rank"]
        reserved[int(row["rank"])] = rank.peak_reserved_bytes
    if run_id.startswith("21a1459a"):
        assert reserved == {0: 10_733_223_936, 3: 8_631_877_632}


@pytest.mark.parametrize("run_id", ["f9d5e223b8a4dbd5-a4b7c02a", "d6102cd54aecdfef-a4b7c02a"])
def test_checkpointed_rows_differ_from_the_estimate_by_record_stream_timing_only(run_id):
    """ZeRO-3 with full and every-k:2 checkpointing (b2 s1024, 4 ranks, H200): the recorded requests, each free
    taken when requested, give the estimate to the byte, so the generated stream is the run's. The measured
    peak is higher (1.5 % and 3.9 %) because some ``record_stream`` frees complete late: the tied head's gathered
    copy, released right after its backward was issued, comes back to the allgather pool only once the GPU has
    run those matmuls (about 3 ms), after the next gathers were allocated. Taking each free at its recorded
    completion gives the every-k run's peak to the byte (the full run's lands 3 % over: the simulated driver's
    addresses, not the real one's, then decide the best-fit ties). A GPU timing, not in the estimator."""
    (row, rank), _ = _h200_estimates(run_id)
    path = H200 / "snapshots" / f"{run_id}.rank{int(row['rank'])}.snapshot.pickle.gz"
    trace, streams, _, _ = _trace(path)
    assert simulate(_requests(trace, streams, "requested"))["peak_reserved_bytes"] == rank.peak_reserved_bytes
    measured = int(row["peak_reserved_bytes"])
    completed = simulate(_requests(trace, streams, "completed"))["peak_reserved_bytes"]
    if run_id.startswith("d6102"):
        assert completed == measured
