"""ZeRO-3 under gradient accumulation (``estimator.reserved.zero3._accumulating``, ``zero3_gathers._micro_step_start``),
checked against the H200 snapshots of run c52aa7c82eb40050 (DeepSpeed 0.19.8 ZeRO-3, Llama-3.2-1B mixed_bf16 b1 s1024,
4 emulated ranks, grad_accum_steps 2, three optimizer steps). No torch: the snapshots are read with the restricted
unpickler."""

import pathlib
from collections import Counter

import pandas as pd
import pytest

from estimator.reserved.accumulate import MicroSteps

ROOT = pathlib.Path(__file__).resolve().parents[2]
H200 = ROOT / "data" / "measurements" / "h200-141gb"
RUN = "c52aa7c82eb40050-a4b7c02a"


def _rows() -> pd.DataFrame:
    rows = pd.read_csv(H200 / "gpu_snapshots.csv")
    return rows[rows["run_id"] == RUN]


def _table_and_spec():
    from estimator.api import _param_table
    from estimator.columns import spec_from_columns
    from estimator.profiler.cache import load_model_profile

    spec = spec_from_columns(_rows().iloc[0].to_dict())
    arch, profile = load_model_profile(spec.model, spec.training, 1, allow_build=False)
    return _param_table(profile, arch.num_layers), spec


def _emulate(accumulate: int, steps: int):
    from estimator.reserved.zero3_gathers import emulate

    table, spec = _table_and_spec()
    z = spec.parallel.zero
    return emulate(table, spec.parallel.world_size, steps=steps, prefetch_bucket=z.stage3_prefetch_bucket_size,
                   max_live=z.stage3_max_live_parameters, max_reuse=z.stage3_max_reuse_distance,
                   persistence=z.stage3_param_persistence_threshold, accumulate=accumulate)


def test_the_accumulating_ranks_replay_to_the_byte():
    """Both traced ranks: the reserved peak replayed to the byte (the prior was 21.1 % under)."""
    from calibrate.terms import rank_estimates
    from estimator.hardware.residuals import load_coefficients

    rows = _rows()
    assert sorted(rows["rank"]) == [0, 3] and set(rows["grad_accum_steps"]) == {2}
    for (_, row), (_, rank) in zip(rows.iterrows(), rank_estimates(rows, load_coefficients("h200-141gb"),
                                                                   allow_build=False)):
        assert rank.reserved_source == "replayed"
        assert rank.peak_reserved_bytes == int(row["peak_reserved_bytes"]) == 15_961_423_872


def test_a_micro_step_after_one_without_an_optimizer_step():
    """The micro-step after the trace-recording one fetches the persistent tensors on the allgather stream (the
    recording step released them, no ``_post_step`` gathered them) and its optimizer step's ``release_and_reset_all``
    frees them; a later cycle's micro-steps gather what a plain steady step does, the first without the final
    release (nothing is left gathered at its backward's end, so the same ops)."""
    plain, accumulating = _emulate(1, 2), _emulate(2, 4)
    sizes = [[(sign, nbytes) for sign, _, nbytes in step] for step in accumulating.steps]
    steady = [(sign, nbytes) for sign, _, nbytes in plain.steps[1]]
    assert sizes[0] == [(sign, nbytes) for sign, _, nbytes in plain.steps[0]]
    assert sizes[2] == sizes[3] == steady
    norm = 4096  # 2048 bf16 elements: below the persistence threshold (33 norms)
    assert Counter(sizes[1])[1, norm] == Counter(sizes[1])[-1, norm] == 33 and Counter(steady)[1, norm] == 0
    for step in sizes:  # every micro-step frees what it gathers
        assert sum(sign * nbytes for sign, nbytes in step) == 0


def test_the_allgather_stream_of_the_real_run():
    """All six micro-steps of the recorded allgather stream: the same allocations and frees per micro-step and the
    same pool; in order but for one swap (a coalesced gather's parameters come from a Python set in DeepSpeed's
    ``__all_gather_params``, their copy-out order is not the parameters' order there)."""
    from benchmarks.zero3_trace_anatomy import _trace, stream_pools
    from estimator.allocator.requests import simulate
    from estimator.reserved.zero3_gathers import pool_requests

    trace, streams, _, _ = _trace(H200 / "snapshots" / f"{RUN}.rank0.snapshot.pickle.gz")
    recorded = [("+" if e["action"] == "alloc" else "-", e["size"]) for e in trace
                if streams[e["stream"]] == 1 and e["action"] in ("alloc", "free_requested")]
    ops = _emulate(2, 6)
    at = 0
    for step in ops.steps:
        generated = [("+" if sign > 0 else "-", nbytes) for sign, _, nbytes in step]
        assert Counter(generated) == Counter(recorded[at:at + len(generated)])
        at += len(generated)
    assert at == len(recorded)
    generated = [("+" if sign > 0 else "-", nbytes) for step in ops.steps for sign, _, nbytes in step]
    assert sum(a != b for a, b in zip(generated, recorded)) == 2
    assert simulate(pool_requests(ops))["peak_reserved_bytes"] == stream_pools(trace, streams)[1] == 2_227_175_424


def test_the_first_cycles_own_micro_steps():
    micro = MicroSteps(first_head=["fh"], head=["h"], middle=["m"], before_optimizer=["b"], first_tail=["ft"],
                       tail=["t"], last=["l"], first_middle=["fm"], first_last=["fl"])
    assert [micro.ops(0, m, 3) for m in range(3)] == [["fh", "b"], ["fm", "b"], ["fl", "ft"]]
    assert [micro.ops(1, m, 3) for m in range(3)] == [["h", "b"], ["m", "b"], ["l", "t"]]
    assert micro.ops(0, 1, 2) == ["fl", "ft"]
    plain = MicroSteps(first_head=["fh"], head=["h"], middle=["m"], before_optimizer=["b"], first_tail=["ft"],
                       tail=["t"])
    assert [plain.ops(0, m, 3) for m in range(3)] == [["fh", "b"], ["m", "b"], ["m", "ft"]]


@pytest.mark.parametrize("accum", [2, 4])
def test_zero3_with_accumulation_is_replayed(accum):
    from estimator.reserved.zero3 import why_not_zero3
    from estimator.spec import ParallelSpec, RunSpec, TrainingSpec

    spec = RunSpec(model="meta-llama/Llama-3.2-1B",
                   training=TrainingSpec(precision="mixed_bf16", micro_batch_size=1, seq_len=1024,
                                         grad_accum_steps=accum),
                   parallel=ParallelSpec(method="zero3", world_size=4))
    assert why_not_zero3(spec) is None


def test_four_micro_steps_replay_from_the_shipped_profile():
    """k > 2: the first cycle's middle micro-steps and its last each their own ops; the replay runs (its peak is
    at least the two-micro-step one's: the same tensors, one more micro-step's gathers)."""
    from estimator.api import estimate
    from estimator.spec import ParallelSpec, RunSpec, TrainingSpec

    def reserved(accum: int) -> int:
        spec = RunSpec(model="meta-llama/Llama-3.2-1B", gpu="h200-141gb",
                       training=TrainingSpec(precision="mixed_bf16", micro_batch_size=1, seq_len=1024,
                                             grad_accum_steps=accum),
                       parallel=ParallelSpec(method="zero3", world_size=4))
        result = estimate(spec, allow_build=False)
        assert result.reserved_source == "replayed"
        return result.ranks[0].peak_reserved_bytes

    assert reserved(4) >= reserved(2) == 15_961_423_872
