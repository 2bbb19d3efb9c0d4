"""Bad tables are refused with the file and line named; the CLI says so in one line and exits 2."""

import random
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from calibrate import data as D
from calibrate.cli import main
from estimator.columns import COLUMNS, spec_from_columns
from tests.calibrate import synth

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def good_rows():
    rng = random.Random(1)
    specs = [synth.spec_for("facebook/opt-125m", "ddp", 2, 1, 256, False),
             synth.spec_for("facebook/opt-125m", "single", 1, 2, 256, True)]
    return [row for spec in specs for row in synth.measured_rows(spec, False, rng)]  # 3 rows: lines 2-4


def _write(tmp_path, rows, key="h100-80gb"):
    return synth.write_table(tmp_path / key / "campaign.csv", rows)


def _problems(tmp_path, rows, key="h100-80gb"):
    _write(tmp_path, rows, key)
    with pytest.raises(D.ValidationError) as info:
        D.load([tmp_path])
    return info.value.problems


def test_a_good_table_loads(tmp_path, good_rows):
    _write(tmp_path, good_rows)
    table = D.load([tmp_path])
    assert len(table.rows) == 3 and table.rows["_line"].tolist() == [2, 3, 4]
    assert table.files[0]["gpu_key"] == "h100-80gb" and len(table.files[0]["sha256"]) == 64


def _set(line, **cells):
    def mutate(rows):
        rows[line - 2].update(cells)
    return mutate


CASES = [
    (_set(3, peak_reserved_bytes=""), "line 3: peak_reserved_bytes is empty on an ok CUDA row"),
    (_set(4, peak_allocated_bytes=-5), "line 4: peak_allocated_bytes is negative"),
    (_set(2, peak_allocated_bytes=10 * synth.GIB, peak_reserved_bytes=9 * synth.GIB),
     "line 2: peak_allocated_bytes exceeds peak_reserved_bytes"),
    (_set(3, peak_reserved_bytes=90 * synth.GIB), "line 3: peak_reserved_bytes exceeds device_total_bytes"),
    (_set(4, peak_device_bytes=90 * synth.GIB), "line 4: peak_device_bytes exceeds device_total_bytes"),
    (_set(2, memory_cap_bytes=synth.GIB), "line 2: peak_reserved_bytes exceeds memory_cap_bytes"),
    (_set(3, gpu_key="a100-80gb"), "line 3: gpu_key is not 'h100-80gb' (the folder's key)"),
    (_set(4, method="bogus"), "line 4: spec cells do not make a RunSpec (method: 'bogus' is not one of"),
    (_set(2, micro_batch_size="two"), "line 2: micro_batch_size is not a number"),
    (_set(3, run_status="done"), "line 3: run_status is not one of ok, oom, error, timeout"),
    (_set(4, emulated="maybe"), "line 4: emulated is not True/False"),
    (_set(2, run_id=""), "line 2: run_id is empty"),
    (lambda rows: rows.append(dict(rows[0])), "line 5: duplicate (run_id, rank)"),
]


@pytest.mark.parametrize("mutate,expected", CASES, ids=[c[1].split(": ", 1)[1][:40] for c in CASES])
def test_bad_rows_are_named(tmp_path, good_rows, mutate, expected):
    rows = [dict(r) for r in good_rows]
    mutate(rows)
    problems = _problems(tmp_path, rows)
    assert len(problems) == 1, problems
    assert problems[0].endswith("h100-80gb/campaign.csv: " + expected) or \
        f"h100-80gb/campaign.csv: {expected}" in problems[0], problems


def test_a_missing_column_names_the_file(tmp_path, good_rows):
    path = _write(tmp_path, good_rows)
    frame = pd.read_csv(path, dtype=str, keep_default_na=False).drop(columns=["peak_device_bytes", "rank"])
    frame.to_csv(path, index=False)
    (problem,) = _problems_from(tmp_path)
    assert problem.endswith("campaign.csv: missing columns rank, peak_device_bytes")


def _problems_from(root):
    with pytest.raises(D.ValidationError) as info:
        D.load([root])
    return info.value.problems


def test_mixed_gpu_keys_in_a_standalone_file(tmp_path, good_rows):
    rows = [dict(r) for r in good_rows]
    rows[2]["gpu_key"] = "a100-80gb"
    path = synth.write_table(tmp_path / "mine.csv", rows)
    with pytest.raises(D.ValidationError) as info:
        D.load([path])
    assert info.value.problems == [f"{D.display_path(path)}: line 4: mixed gpu_key in one file (first row says "
                                   "'h100-80gb')"]


def test_an_unknown_gpu_key(tmp_path, good_rows):
    rows = [dict(r, gpu_key="h100") for r in good_rows]  # an alias, not the estimator's key
    (problem,) = _problems(tmp_path, rows, key="h100")
    assert "lines 2, 3, 4: gpu_key 'h100' is not a GPU key of the estimator" in problem


def test_failed_and_oom_rows_need_no_measurements(tmp_path, good_rows):
    rows = [dict(r) for r in good_rows] + synth.oom_rows()
    _write(tmp_path, rows)
    table = D.load([tmp_path])
    assert set(table.rows["run_status"]) == {"ok", "oom", "error"}


def test_pandas_typed_rows_rebuild_the_spec(tmp_path, good_rows):
    """spec_from_columns (estimator/columns.py) takes pandas' own types too: numpy ints, floats, NaN."""
    path = _write(tmp_path, good_rows)
    frame = pd.read_csv(path)  # default dtypes: int64, float64 (empty cells), bool, NaN
    spec = synth.spec_for("facebook/opt-125m", "single", 1, 2, 256, True)
    assert spec_from_columns(frame.iloc[2].to_dict()) == spec
    assert list(frame.columns) == COLUMNS


def test_cli_bad_table_one_line_exit_2(tmp_path, good_rows, capsys):
    rows = [dict(r) for r in good_rows]
    rows[1]["peak_allocated_bytes"] = -1
    _write(tmp_path, rows)
    assert main(["fit", "--data", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "campaign.csv: line 3: peak_allocated_bytes" \
        in lines[0]
    assert not (tmp_path / "out").exists()


def test_cli_unknown_gpu_selection_one_line(tmp_path, good_rows, capsys):
    _write(tmp_path, good_rows)
    assert main(["fit", "--data", str(tmp_path), "--gpu", "a100-40gb"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: gpu: no measurements for a100-40gb under {tmp_path}"]


def test_cli_bad_option_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        main(["fit", "--max-cv-error-pct", "lots"])
    assert info.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_module_entry_point_on_empty_data(tmp_path):
    """``python -m calibrate fit`` on a folder without tables: one line, exit 2, no traceback."""
    result = subprocess.run([sys.executable, "-m", "calibrate", "fit", "--data", str(tmp_path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: data: no GPU measurements under {tmp_path} (the harness writes them: python -m harness ..., "
        "docs/harness.md)"]
