"""Tidy table: spec columns, rows per rank, atomic idempotent upserts."""

import csv

from estimator.spec import ParallelSpec, RunSpec, TrainingSpec, ZeroSpec
from harness.records import RankRecord, merge_ranks
from harness.table import (
    COLUMNS,
    rank_rows,
    read_rows,
    spec_columns,
    spec_from_columns,
    table_path,
    upsert_rows,
)

SPEC = RunSpec(model="facebook/opt-125m", gpu="h100-80gb",
               parallel=ParallelSpec(method="zero3", world_size=4, zero=ZeroSpec(overlap_comm=True,
                                                                                   reduce_bucket_size=123)),
               training=TrainingSpec(micro_batch_size=4, seq_len=1024, precision="mixed_fp16", grad_ckpt=True))


def rows_for(spec, run_id, status="ok"):
    ranks = [RankRecord(rank=r, world_size=4, status=status, peak_allocated_bytes=100 + r) for r in (0, 3)]
    run = merge_ranks(ranks, spec_id=spec.spec_id, run_id=run_id, campaign="c", gpu_key="h100-80gb",
                      world_size=4, expected_ranks=[0, 3])
    return rank_rows(spec, run, ranks, {"gpu_name": "NVIDIA H100", "git_sha": "abc"},
                     {"data": {"padding": "max_length", "keep": "full_rows"}, "steps": {"warmup": 0, "measured": 2}})


def test_spec_columns_round_trip_through_csv_strings():
    row = {k: str(v) if v is not None else "" for k, v in spec_columns(SPEC).items()}
    row["world_size"] = "4"
    assert spec_from_columns(row) == SPEC
    assert spec_columns(SPEC)["zero_stage"] == 3 and spec_columns(SPEC)["dp"] == 4


def test_rows_carry_the_cap_the_worker_applied_and_read_back_into_the_spec():
    """The harness's memory.cap_gib is not in its spec: the rank record's cap fills the column, which the spec
    read back from the row carries (calibrate and the error tables then estimate under it)."""
    ranks = [RankRecord(rank=0, world_size=4, status="ok", memory_cap_bytes=16 * 1024**3)]
    run = merge_ranks(ranks, spec_id=SPEC.spec_id, run_id="capped", campaign="c", gpu_key="h100-80gb",
                      world_size=4, expected_ranks=[0])
    (row,) = rank_rows(SPEC, run, ranks, {}, {})
    assert row["memory_cap_bytes"] == 16 * 1024**3 and row["spec_id"] == SPEC.spec_id
    assert spec_from_columns(row).training.memory_cap_bytes == 16 * 1024**3
    assert rows_for(SPEC, "uncapped")[0]["memory_cap_bytes"] is None


def test_units_are_in_the_column_names():
    measured = [c for c in COLUMNS if c.startswith("peak_") or c.endswith("_context_bytes")]
    assert all(c.endswith("_bytes") for c in measured)
    assert {"micro_batch_size", "seq_len", "step_time_s", "tokens_per_s", "peak_device_bytes"} <= set(COLUMNS)


def test_one_row_per_rank(tmp_path):
    rows = rows_for(SPEC, "run1")
    assert [r["rank"] for r in rows] == [0, 3]
    assert rows[1]["peak_allocated_bytes"] == 103 and rows[0]["gpu_name"] == "NVIDIA H100"


def test_upsert_replaces_a_runs_rows_and_keeps_others(tmp_path):
    path = table_path(tmp_path, "h100-80gb", "c")
    upsert_rows(path, rows_for(SPEC, "run1"))
    upsert_rows(path, rows_for(SPEC.replace(**{"training.seq_len": 512}), "run2"))
    upsert_rows(path, rows_for(SPEC, "run1", status="oom"))  # a re-run replaces, never duplicates
    rows = read_rows(path)
    assert [(r["run_id"], r["rank"]) for r in rows] == [("run2", "0"), ("run2", "3"), ("run1", "0"), ("run1", "3")]
    assert {r["run_status"] for r in rows if r["run_id"] == "run1"} == {"oom"}
    assert not list(tmp_path.rglob("*.tmp"))  # the atomic write left no temp file


def test_older_files_gain_new_columns(tmp_path):
    path = table_path(tmp_path, "cpu", "c")
    path.parent.mkdir(parents=True)
    with open(path, "w", newline="") as handle:
        csv.writer(handle).writerows([["run_id", "rank", "old_column"], ["x", "0", "kept"]])
    upsert_rows(path, rows_for(SPEC, "run1"))
    rows = read_rows(path)
    assert rows[0]["old_column"] == "kept" and rows[1]["run_id"] == "run1"


def test_every_column_is_in_the_data_dictionary():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "data/README.md").read_text()
    missing = [c for c in COLUMNS if f"`{c}`" not in readme]
    assert not missing, f"document these columns in data/README.md: {missing}"
