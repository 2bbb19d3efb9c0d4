"""Launcher: run dirs, skipping and resuming, timeouts and crashes, dry runs (no real worker)."""

import json
import sys

import pytest

from estimator.spec import RunSpec
from harness import launch
from harness.config import to_run
from harness.environment import CPU_DEVICE
from harness.files import read_json
from harness.launch import Outcome, plan_point, run_point
from harness.records import RankRecord, to_dict
from harness.table import read_rows
from tests.harness.conftest import compose, path_overrides


def point_args(tmp_path, *overrides):
    return to_run(compose("model=tiny-llama", "backend=cpu", "data.online=false", *overrides,
                          *path_overrides(tmp_path)))


class FakeWorker:
    """Stands in for the worker: writes rank records with a chosen status; can be 'killed' mid-point."""

    def __init__(self, status="ok", kill_on=None):
        self.status, self.kill_on, self.calls = status, kill_on, []

    def __call__(self, point):
        self.calls.append(point.spec.training.micro_batch_size)
        if point.spec.training.micro_batch_size == self.kill_on:
            raise KeyboardInterrupt  # the sweep is killed while this point runs
        for rank in point.expected_ranks:
            record = RankRecord(rank=rank, world_size=point.spec.parallel.world_size, status=self.status,
                                spec_id=point.spec.spec_id, run_id=point.run_id, memory_source="none-cpu",
                                peak_allocated_bytes=1000 * (rank + 1))
            (point.run_dir / f"rank{rank}.json").write_text(json.dumps(to_dict(record)))
        return Outcome(0, False, None)


def sweep(tmp_path, sizes, *overrides):
    records = []
    for size in sizes:
        spec, opts = point_args(tmp_path, f"training.micro_batch_size={size}", "training.seq_len=64", *overrides)
        records.append(run_point(spec, opts, device=CPU_DEVICE))
    return records


def test_resume_after_an_interrupted_sweep_skips_finished_points(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "execute", FakeWorker(kill_on=2))
    with pytest.raises(KeyboardInterrupt):
        sweep(tmp_path, [1, 2, 3])
    worker = FakeWorker()
    monkeypatch.setattr(launch, "execute", worker)
    records = sweep(tmp_path, [1, 2, 3])
    assert worker.calls == [2, 3]  # point 1 finished before the kill; point 2 lost only itself
    assert [r.status for r in records] == ["ok", "ok", "ok"]
    rows = read_rows(tmp_path / "data/measurements/cpu/default.csv")
    assert sorted(int(r["micro_batch_size"]) for r in rows) == [1, 2, 3]  # once each, no duplicate


def test_errors_are_kept_unless_asked_and_ok_or_oom_never_rerun(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "execute", FakeWorker(status="error"))
    assert sweep(tmp_path, [1])[0].status == "error"
    worker = FakeWorker(status="oom")
    monkeypatch.setattr(launch, "execute", worker)
    sweep(tmp_path, [1])
    assert worker.calls == []  # error kept by default
    sweep(tmp_path, [1], "rerun_errors=true")
    assert worker.calls == [1]
    sweep(tmp_path, [1], "rerun_errors=true")
    assert worker.calls == [1]  # oom is data: never re-run
    sweep(tmp_path, [1], "force=true")
    assert worker.calls == [1, 1]


def test_a_hanging_worker_times_out_with_its_output_recorded(tmp_path, monkeypatch):
    code = "import time; print('still loading', flush=True); time.sleep(60)"
    monkeypatch.setattr(launch, "worker_command", lambda point, rank=None: [sys.executable, "-c", code])
    record = sweep(tmp_path, [1], "launcher.timeout_s=2")[0]
    assert record.status == "timeout" and "launcher.timeout_s" in record.error
    assert "still loading" in record.stderr_tail and record.duration_s < 30
    assert read_json(tmp_path / "runs/default/cpu" / record.run_id / "result.json")["status"] == "timeout"


def test_a_crashing_worker_is_an_error_with_the_stderr_tail(tmp_path, monkeypatch):
    code = "import sys; print('Traceback: boom', file=sys.stderr); sys.exit(7)"
    monkeypatch.setattr(launch, "worker_command", lambda point, rank=None: [sys.executable, "-c", code])
    record = sweep(tmp_path, [1])[0]
    assert (record.status, record.returncode) == ("error", 7) and "boom" in record.stderr_tail
    rows = read_rows(tmp_path / "data/measurements/cpu/default.csv")
    assert rows[0]["rank"] == "-1" and rows[0]["run_status"] == "error"  # visible in the table too


def test_dry_run_writes_the_spec_only(tmp_path):
    spec, opts = point_args(tmp_path, "dry_run=true", "method=fsdp", "parallel.world_size=2")
    record = run_point(spec, opts, device=CPU_DEVICE)
    run_dir = tmp_path / "runs/default/cpu" / record.run_id
    assert record.status == "dry_run" and not (run_dir / "result.json").exists()
    assert RunSpec.from_json((run_dir / "spec.json").read_text()) == spec.replace(gpu="cpu")
    assert read_json(run_dir / "harness.json")["backend"] == "cpu"
    assert {"git_sha", "torch_version", "gpu_key"} <= set(read_json(run_dir / "env.json"))


def test_variants_get_their_own_run_dir(tmp_path):
    def run_id(*overrides):
        spec, opts = point_args(tmp_path, "method=fsdp", "parallel.world_size=4", "training.seq_len=64",
                                *overrides)
        point = plan_point(spec, opts, CPU_DEVICE)
        return point.run_id, point.spec.spec_id
    plain, spec_id = run_id()
    assert plain == spec_id
    emulated, same_spec = run_id("emulate.enabled=true")
    capped, _ = run_id("memory.cap_gib=16")
    assert same_spec == spec_id and len({plain, emulated, capped}) == 3 and emulated.startswith(spec_id + "-")


def test_preflight_rejects_points_that_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="^training.seq_len:"):
        plan_point(*point_args(tmp_path, "training.seq_len=4096"), CPU_DEVICE)
    with pytest.raises(ValueError, match="^backend:"):
        plan_point(*point_args(tmp_path, "backend=cuda"), CPU_DEVICE)
    with pytest.raises(ValueError, match="^backend:"):
        plan_point(*point_args(tmp_path, "backend=fake", "method=zero2", "parallel.world_size=2"), CPU_DEVICE)
    with pytest.raises(ValueError, match="^emulate.ranks:"):
        plan_point(*point_args(tmp_path, "method=ddp", "emulate.world_size=2", "emulate.ranks=[0,5]"), CPU_DEVICE)
    with pytest.raises(ValueError, match="^training.precision: fsdp1 with LoRA under mixed_bf16"):
        plan_point(*point_args(tmp_path, "method=fsdp1", "parallel.world_size=2", "training=lora",
                               "training.precision=mixed_bf16", "training.seq_len=64"), CPU_DEVICE)
    # torch's FSDP1 fails on tied embeddings under NO_SHARD + LoRA + use_orig_params (small-opt ties them)
    with pytest.raises(ValueError, match="^parallel.fsdp1.sharding_strategy: NO_SHARD with LoRA and use_orig_params"):
        plan_point(*point_args(tmp_path, "model=small-opt", "method=fsdp1", "parallel.world_size=2", "training=lora",
                               "training.precision=bf16", "training.seq_len=64",
                               "parallel.fsdp1.sharding_strategy=NO_SHARD"), CPU_DEVICE)


def test_the_callers_git_state_wins_over_the_copys(monkeypatch):
    """On a lent GPU machine the working-tree copy looks modified to git (modes); the checkout's state, passed in
    HARNESS_GIT_SHA / HARNESS_GIT_DIRTY, is the one measurements record and allow_dirty checks."""
    from harness.environment import git_state

    monkeypatch.setenv("HARNESS_GIT_SHA", "a" * 40)
    monkeypatch.setenv("HARNESS_GIT_DIRTY", "0")
    git_state.cache_clear()
    try:
        assert git_state() == ("a" * 40, False)
        monkeypatch.setenv("HARNESS_GIT_DIRTY", "1")
        git_state.cache_clear()
        assert git_state() == ("a" * 40, True)
    finally:
        git_state.cache_clear()
