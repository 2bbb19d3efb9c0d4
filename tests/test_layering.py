"""estimator's predict path imports neither torch, hydra, numpy nor sklearn; calibrate/harness don't mix."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_predict_path_is_pure_python():
    code = ("import sys, estimator; from estimator.api import estimate; from estimator.spec import RunSpec;"
            "estimate(RunSpec(model='facebook/opt-125m'));"
            "bad = [m for m in ('torch', 'transformers', 'hydra', 'numpy', 'sklearn', 'pandas') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_harness_and_calibrate_never_import_each_other():
    for package, forbidden in (("harness", "calibrate"), ("calibrate", "harness"), ("estimator", "harness"),
                               ("estimator", "calibrate")):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            assert not re.search(rf"^\s*(from|import) {forbidden}\b", text, re.M), f"{path} imports {forbidden}"
