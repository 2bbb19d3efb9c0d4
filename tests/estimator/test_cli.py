import json
import subprocess
import sys

import pytest

from estimator.io.cli import main


def test_default_compares_all_methods(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for method in ("single", "ddp", "zero1", "zero2", "zero3", "fsdp", "zero_offload"):
        assert method in out


def test_json_has_contract_keys(capsys):
    assert main(["--model", "facebook/opt-125m", "--method", "zero3", "--gpus", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"peak_allocated_bytes", "peak_reserved_bytes", "peak_device_bytes", "fits", "breakdown"} <= set(data)


@pytest.mark.parametrize("argv", [
    ["--model", "no-such-model"], ["--micro-batch-size", "0"], ["--model", "facebook/opt-125m", "--gpu", "x"],
    ["--model", "facebook/opt-125m", "--seq-len", "99999"], ["--method", "nope"],
    ["--model", "facebook/opt-125m", "--method", "tp", "--gpus", "5"],
    ["--model", "facebook/opt-125m", "--lora-dropout", "0.1"],
    ["--model", "facebook/opt-125m", "--lora-rank", "8", "--lora-dropout", "1.5"],
    ["--model", "facebook/opt-125m", "--lora-rank", "8", "--lora-dropout", "some"],
])
def test_user_errors_are_one_line_exit_2(argv):
    result = subprocess.run([sys.executable, "-m", "estimator", *argv], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_from_run(tmp_path, capsys):
    from estimator.spec import RunSpec

    (tmp_path / "spec.json").write_text(RunSpec(model="facebook/opt-125m").to_json())
    assert main(["--from-run", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "facebook/opt-125m"


def test_from_run_of_a_cpu_run_predicts_for_a_gpu(tmp_path, capsys):
    from estimator.spec import RunSpec

    (tmp_path / "spec.json").write_text(RunSpec(model="facebook/opt-125m", gpu="cpu").to_json())
    assert main(["--from-run", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpu"] == "h100-80gb" and any("measured without a GPU" in n for n in data["notes"])
    assert main(["--from-run", str(tmp_path), "--gpu", "a100-40gb", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpu"] == "a100-40gb"


def test_check_exit_code_when_not_fitting():
    assert main(["--model", "facebook/opt-1.3b", "--method", "single", "--gpu", "t4-16gb", "--check",
                 "--micro-batch-size", "8"]) == 1
