"""Every experiment file composes and every grid point is a valid, plannable spec (a dry run)."""

import pytest

from harness.config import to_run
from harness.environment import CPU_DEVICE
from harness.launch import plan_point, prepare
from harness.sweep import JobComposer, expand_sweep, validate_jobs
from tests.harness.conftest import CONF, cli, compose, path_overrides

EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def covering(jobs):
    """A subset of jobs in which every swept value appears at least once (greedy, in sweep order)."""
    seen, chosen = set(), []
    for job in jobs:
        if set(job) - seen:
            chosen.append(job)
            seen |= set(job)
    return chosen


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_points_are_valid_specs(experiment, tmp_path):
    config = compose(f"experiment={experiment}", "dry_run=true", *path_overrides(tmp_path), hydra_config=True)
    jobs = expand_sweep(config)
    assert len(jobs) > 1, "an experiment file is a grid"
    composer = JobComposer("measure")
    run_ids = set()
    for job in covering(jobs):
        spec, opts = to_run(composer.compose(job))
        point = plan_point(spec, opts, CPU_DEVICE, check_device=False)
        prepare(point)  # what dry_run=true writes
        assert (point.run_dir / "spec.json").exists()
        run_ids.add(point.run_id)
    assert len(run_ids) == len(covering(jobs))


def test_invalid_grid_point_is_reported_with_its_key_and_overrides(tmp_path):
    config = compose("experiment=paper_table2", "dry_run=true", *path_overrides(tmp_path), hydra_config=True)
    jobs = [job + ["training.seq_len=4096"] for job in expand_sweep(config)[:2]]
    problem = validate_jobs(config, jobs)
    assert problem.startswith("training.seq_len: 4096 exceeds") and "[point: model=opt-125m" in problem


def test_multirun_dry_run_writes_a_spec_per_point_and_a_summary(tmp_path):
    result = cli("-m", "experiment=smoke_cpu", "dry_run=true", *path_overrides(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    specs = list((tmp_path / "runs/smoke_cpu/cpu").glob("*/spec.json"))
    assert len(specs) == 8
    assert "sweep smoke_cpu: 8 points: 8 dry_run" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_full_multirun_dry_run_of_every_experiment(experiment, tmp_path):
    result = cli("-m", f"experiment={experiment}", "dry_run=true", *path_overrides(tmp_path), timeout=1800)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "points: " in result.stdout and "without a result" not in result.stdout


@pytest.mark.slow
def test_submitit_route_runs_each_point_as_a_job(tmp_path):
    result = cli("-m", "launcher=slurm_local", "model=tiny-llama", "training.seq_len=64,128", "dry_run=true",
                 *path_overrides(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(list((tmp_path / "runs").rglob("spec.json"))) == 2
    assert "2 points: 2 dry_run" in result.stdout
