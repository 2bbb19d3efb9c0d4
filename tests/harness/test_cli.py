"""The command line: one-line errors naming the key, exit code 2."""

from tests.harness.conftest import cli, path_overrides


def test_bad_value_is_one_line_exit_2(tmp_path):
    result = cli("training.seq_len=-1", "dry_run=true", *path_overrides(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip() == "error: training.seq_len: must be a positive integer, got -1"


def test_typo_is_one_line_exit_2(tmp_path):
    result = cli("training.seq_lenn=3", "dry_run=true", *path_overrides(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip() == "error: training.seq_lenn: Key 'seq_lenn' not in 'TrainingConf'"


def test_sweep_with_one_invalid_point_stops_before_running(tmp_path):
    result = cli("-m", "model=tiny-llama", "training.seq_len=64,-1", "dry_run=true", *path_overrides(tmp_path))
    assert result.returncode == 2
    assert "error: training.seq_len: must be a positive integer, got -1  [point: " in result.stderr
    assert not (tmp_path / "runs").exists()


def test_pure_bf16_with_optimizer_offload_is_refused_before_running(tmp_path):
    result = cli("model=tiny-llama", "method=zero_offload", "training.precision=bf16", "dry_run=true",
                 *path_overrides(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: training.precision: bf16 with optimizer offload needs")
