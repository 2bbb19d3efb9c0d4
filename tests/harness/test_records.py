"""Record schema: summaries, merge over ranks, JSON round trip."""

import json

import pytest

from harness.records import (
    PhaseRecord,
    RankRecord,
    StepRecord,
    merge_ranks,
    merge_status,
    rank_from_dict,
    run_from_dict,
    summarize_steps,
    to_dict,
)


def step(index, allocated, *, warmup=False, tokens_per_s=None, time_s=1.0):
    phases = [PhaseRecord("forward", peak_allocated_bytes=allocated - 10),
              PhaseRecord("backward", peak_allocated_bytes=allocated),
              PhaseRecord("optimizer", peak_allocated_bytes=allocated - 5)]
    return StepRecord(step=index, warmup=warmup, phases=phases, peak_allocated_bytes=allocated,
                      peak_reserved_bytes=allocated + 100, step_time_s=time_s, tokens_per_s=tokens_per_s)


def test_summary_excludes_warmup_and_takes_max():
    summary = summarize_steps([step(0, 1000, warmup=True), step(1, 500), step(2, 700, tokens_per_s=10.0)])
    assert summary["peak_allocated_bytes"] == 700
    assert summary["peak_reserved_bytes"] == 800
    assert summary["peak_backward_allocated_bytes"] == 700
    assert summary["peak_forward_allocated_bytes"] == 690
    assert summary["tokens_per_s"] == 10.0
    assert summary["peak_device_bytes"] is None  # never measured: None, not 0


def test_summary_of_warmup_only_steps_uses_them():
    assert summarize_steps([step(0, 42, warmup=True)])["peak_allocated_bytes"] == 42


@pytest.mark.parametrize(("statuses", "expected"), [
    (["ok", "ok"], "ok"), (["ok", "oom"], "oom"), (["error", "oom"], "oom"), (["ok", "error"], "error"),
    (["ok", "timeout"], "timeout"), ([], "error")])
def test_merge_status(statuses, expected):
    assert merge_status(statuses) == expected


def test_merge_is_max_over_ranks_and_names_the_worst_rank():
    r0 = RankRecord(rank=0, world_size=4, status="ok", steps=[step(0, 100), step(1, 300)]).finalize()
    r3 = RankRecord(rank=3, world_size=4, status="ok", steps=[step(0, 100), step(1, 400)]).finalize()
    run = merge_ranks([r0, r3], spec_id="s", run_id="s", campaign="c", gpu_key="cpu", world_size=4,
                      expected_ranks=[0, 3])
    assert (run.status, run.peak_allocated_bytes, run.worst_rank) == ("ok", 400, 3)
    assert run.rank_status == {"0": "ok", "3": "ok"}


def test_missing_rank_is_an_error_unless_another_rank_ran_out_of_memory():
    r0 = RankRecord(rank=0, world_size=2, status="ok").finalize()
    run = merge_ranks([r0], spec_id="s", run_id="s", campaign="c", gpu_key="cpu", world_size=2,
                      expected_ranks=[0, 1])
    assert run.status == "error" and run.rank_status["1"] == "missing"
    oom = RankRecord(rank=0, world_size=2, status="oom", error="OutOfMemoryError: x").finalize()
    run = merge_ranks([oom], spec_id="s", run_id="s", campaign="c", gpu_key="cpu", world_size=2,
                      expected_ranks=[0, 1])
    assert run.status == "oom" and "rank 0: OutOfMemoryError" in run.error


def test_json_round_trip():
    record = RankRecord(rank=1, world_size=2, status="ok", steps=[step(0, 10), step(1, 20)],
                        data={"source": "synthetic"}, notes=["n"]).finalize()
    again = rank_from_dict(json.loads(json.dumps(to_dict(record))))
    assert again == record
    run = merge_ranks([record], spec_id="s", run_id="r", campaign="c", gpu_key="cpu", world_size=2,
                      expected_ranks=[1])
    assert run_from_dict(json.loads(json.dumps(to_dict(run)))) == run


def test_other_schema_versions_are_refused_with_the_key_named():
    with pytest.raises(ValueError, match="^schema_version:"):
        rank_from_dict({"rank": 0, "world_size": 1, "status": "ok", "schema_version": 99})
