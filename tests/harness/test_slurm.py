"""The harness's three Slurm routes, run for real against a Slurm controller (docs/harness.md, "Sweeps"):

* one allocation running a sweep sequentially (``slurm/measure_node.sbatch``); resubmitting resumes it;
* one submitit job per point (``launcher=slurm``, hydra-submitit-launcher's Slurm plugin);
* a point across two nodes (``slurm/measure_multinode.sbatch``: ``srun torchrun --nnodes 2`` with a c10d
  rendezvous on the first node).

Points are tiny CPU runs (gloo); the cluster schedules GPU GRES as a GPU cluster does. ``slurm/local_cluster.sh
start`` stands up such a cluster on one machine (CI does, see .ci/run). Skipped when no controller answers,
unless ``LLMEM_REQUIRE_SLURM=1`` (CI sets it once its cluster is up): then a missing cluster fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.files import read_json
from tests.harness.conftest import ROOT, cli, path_overrides

POINT = ["model=tiny-llama", "data=synthetic", "backend=cpu", "training.seq_len=64", "training.precision=fp32",
         "training.micro_batch_size=2"]
JOB_TIMEOUT_S = 600


def idle_nodes() -> list[str] | None:
    """Names of the idle nodes of the default partition, or None when no controller answers."""
    if shutil.which("sinfo") is None:
        return None
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0:
        return None
    return sorted({line.split()[0] for line in out.stdout.splitlines() if line.split()[1:2] == ["idle"]})


@pytest.fixture(scope="module")
def nodes() -> list[str]:
    found = idle_nodes()
    if not found:
        reason = "no Slurm controller with idle nodes answers (slurm/local_cluster.sh start sets one up)"
        if os.environ.get("LLMEM_REQUIRE_SLURM") == "1":
            pytest.fail(f"LLMEM_REQUIRE_SLURM=1 but {reason}")
        pytest.skip(reason)
    return found


def job_env(**extra: str) -> dict[str, str]:
    # sbatch exports the submitter's environment: the job activates this interpreter's venv, offline data.
    return {**os.environ, "VENV": sys.prefix, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **extra}


def sbatch(script: str, out_dir: Path, *options: str, **env: str) -> tuple[int, str]:
    """Submit and wait for the job (``sbatch --wait``); returns (exit code, the job's output)."""
    out_file = out_dir / "slurm-%j.out"
    proc = subprocess.run(["sbatch", "--wait", "--parsable", f"--output={out_file}", "--cpus-per-task=1",
                           *options, f"slurm/{script}"], cwd=ROOT, capture_output=True, text=True,
                          env=job_env(**env), timeout=JOB_TIMEOUT_S)
    job_id = proc.stdout.strip().split(";")[0]
    output = (out_dir / f"slurm-{job_id}.out").read_text() if job_id else ""
    return proc.returncode, output + proc.stderr


def results(root: Path) -> dict[str, dict]:
    return {path.parent.name: read_json(path) for path in (root / "runs").rglob("result.json")}


def test_one_allocation_runs_a_sweep_and_a_resubmission_resumes_it(nodes, tmp_path):
    extra = f"paths.root_dir={tmp_path} method=ddp,tp"
    code, output = sbatch("measure_node.sbatch", tmp_path, "--gpus-per-node=2", EXPERIMENT="smoke_cpu",
                          EXTRA=extra)
    assert code == 0, output[-3000:]
    assert "sweep smoke_cpu: 2 points: 2 ok" in output, output[-3000:]
    first = results(tmp_path)
    assert len(first) == 2 and {r["status"] for r in first.values()} == {"ok"}
    for run_id in first:
        env = read_json(next((tmp_path / "runs").rglob(f"{run_id}/env.json")))
        assert env["slurm_job_id"] and env["slurm_nodelist"]  # provenance says where it ran

    code, output = sbatch("measure_node.sbatch", tmp_path, "--gpus-per-node=2", EXPERIMENT="smoke_cpu",
                          EXTRA=extra)
    assert code == 0, output[-3000:]
    assert output.count("skip ") == 2 and "2 points: 2 ok" in output, output[-3000:]
    again = results(tmp_path)
    assert {k: v["finished_at"] for k, v in again.items()} == {k: v["finished_at"] for k, v in first.items()}


def test_submitit_launcher_runs_each_point_as_its_own_slurm_job(nodes, tmp_path):
    result = cli("-m", "experiment=smoke_cpu", "launcher=slurm", "method=ddp,fsdp", "hydra.launcher.cpus_per_task=1",
                 "hydra.launcher.mem_gb=1", *path_overrides(tmp_path), timeout=JOB_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sweep smoke_cpu: 2 points: 2 ok" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]
    job_ids = set()
    for run_dir in {p.parent for p in (tmp_path / "runs").rglob("result.json")}:
        assert read_json(run_dir / "result.json")["status"] == "ok"
        job_ids.add(read_json(run_dir / "env.json")["slurm_job_id"])
    assert len(job_ids) == 2 and None not in job_ids  # one Slurm job per point
    # The job asked Slurm for the point's GPUs (gpus_per_node = parallel.world_size), one task per point.
    submissions = [p.read_text() for p in (tmp_path / "runs").rglob("*_submission.sh")]
    assert submissions and all("--gpus-per-node=2" in s and "--ntasks-per-node=1" in s for s in submissions)


def test_a_point_across_two_nodes_rendezvous_with_srun_torchrun(nodes, tmp_path):
    if len(nodes) < 2:
        pytest.skip("the multi-node route needs two idle nodes")
    overrides = " ".join([*POINT, "method=ddp", "parallel.world_size=2", f"paths.root_dir={tmp_path}"])
    code, output = sbatch("measure_multinode.sbatch", tmp_path, "--nodes=2", "--gpus-per-node=1",
                          OVERRIDES=overrides)
    assert code == 0, output[-3000:]
    (run_id, result), = results(tmp_path).items()
    assert result["status"] == "ok" and result["rank_status"] == {"0": "ok", "1": "ok"}, result.get("stderr_tail")
    run_dir = next((tmp_path / "runs").rglob(f"{run_id}/result.json")).parent
    command = (run_dir / "worker.log").read_text().splitlines()[0]
    assert command.startswith("$ srun --nodes=2 --ntasks=2 --ntasks-per-node=1")
    assert "--nnodes=2 --nproc_per_node=1 --rdzv_backend=c10d" in command
    ranks = {r: read_json(run_dir / f"rank{r}.json") for r in (0, 1)}
    assert {ranks[r]["node"] for r in ranks} == set(nodes[:2])  # one rank on each node
