"""Both training-loop conventions run for real (CPU, every storage counted) and match the estimate."""

import pytest

from estimator.api import estimate
from estimator.spec import RunSpec
from harness.environment import CPU_DEVICE
from harness.files import read_json
from harness.records import rank_from_dict
from tests.harness.conftest import TINY_OVERRIDES, run_point


def _measured_and_estimated(tmp_path, loop: str) -> tuple[int, int]:
    # subprocess isolation: real CPU kernels in the pytest process would start OpenMP threads, after which a
    # forked run (the campaign's fork-isolation test) can deadlock
    record = run_point(tmp_path, *TINY_OVERRIDES, f"training.loop={loop}", "launcher.isolation=subprocess",
                       device=CPU_DEVICE)
    run_dir = tmp_path / "runs/default/cpu" / record.run_id
    rank0 = rank_from_dict(read_json(run_dir / "rank0.json"))
    spec = RunSpec.from_json((run_dir / "spec.json").read_text())
    assert record.status == "ok" and spec.training.loop == loop
    est = estimate(spec.replace(gpu="h100-80gb"))
    return rank0.peak_allocated_bytes, est.traced_allocated_bytes


@pytest.mark.parametrize("loop", ["trainer", "manual"])
def test_real_run_of_each_loop_matches_the_estimate(tmp_path, loop):
    measured, estimated = _measured_and_estimated(tmp_path, loop)
    assert abs(estimated - measured) / measured < 0.01


def test_manual_loop_holds_the_logits_more(tmp_path):
    trainer, _ = _measured_and_estimated(tmp_path / "t", "trainer")
    manual, _ = _measured_and_estimated(tmp_path / "m", "manual")
    logits = 2 * 64 * 1000 * 4  # micro-batch 2, seq 64, vocab 1000, fp32 (TINY_OVERRIDES)
    assert abs((manual - trainer) - logits) <= 2 * 512  # storages counted in 512-byte blocks
