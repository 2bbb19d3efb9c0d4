"""The harness worker applies the long-context techniques (``training.ce``, ``training.activation_offload``,
``training.ckpt_policy``): real CPU runs, every storage counted in 512-byte blocks, against the estimate."""

import pytest

from estimator.spec import RunSpec
from harness.environment import CPU_DEVICE
from harness.files import read_json
from tests.harness.conftest import run_point

pytest.importorskip("torch")


def _run(tmp_path, name: str, *overrides: str) -> tuple[RunSpec, int]:
    record = run_point(tmp_path / name, "model=small-llama", "data=synthetic", "training.seq_len=256",
                       "training.micro_batch_size=2", "training.precision=bf16", "training.attn=eager",
                       "method=single", "backend=cpu", "launcher.isolation=subprocess", *overrides, device=CPU_DEVICE)
    assert record.status == "ok", record.error
    run_dir = tmp_path / name / "runs/default/cpu" / record.run_id
    spec = RunSpec.from_json((run_dir / "spec.json").read_text())
    return spec, read_json(run_dir / "rank0.json")["peak_allocated_bytes"]


@pytest.mark.parametrize(("name", "overrides"), [
    ("chunked", ("training.ce=chunked", "training.ce_chunks=4")),
    ("offload", ("training.activation_offload=true",)),
    ("every-k", ("training.grad_ckpt=true", "training.ckpt_policy=every-k:2")),
])
def test_the_worker_runs_each_technique_as_the_estimate_says(tmp_path, name, overrides):
    from estimator.api import estimate

    spec, measured = _run(tmp_path, name, *overrides)
    assert spec.training != RunSpec().training  # the overrides reached the spec the worker ran
    predicted = estimate(spec.replace(gpu="h100-80gb")).traced_allocated_bytes
    error = (predicted - measured) / measured
    if name == "chunked":
        # the harness's Alpaca rows leave their prompt untrained (label -100): torchtune's loss projects the trained
        # positions only, the estimate every position (packed data): an upper bound here (+2.1 % observed)
        assert 0 <= error < 0.05
    else:
        assert abs(error) < 0.01
