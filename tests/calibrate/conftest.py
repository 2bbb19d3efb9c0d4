"""Session fixtures: one synthetic measurement tree (planted coefficients), one fit of it, one export."""

import pytest

from calibrate import data as D
from calibrate.export import fit_gpu
from calibrate.terms import analytic_terms
from tests.calibrate import synth


@pytest.fixture(scope="session")
def synthetic_root(tmp_path_factory):
    return synth.build(tmp_path_factory.mktemp("measurements"))


@pytest.fixture(scope="session")
def fitted(synthetic_root):
    """The in-process fit of the synthetic h100-80gb rows: an ``export.Outcome``."""
    table = D.load([synthetic_root], [synth.GPU])
    rows = table.rows.join(analytic_terms(table.rows, allow_build=False))
    return fit_gpu(rows, table.files, synth.GPU)


@pytest.fixture(scope="session")
def exported(synthetic_root, tmp_path_factory):
    """``python -m calibrate fit`` (in process) on the synthetic tree: (exit code, path of the written file)."""
    from calibrate.cli import main

    out = tmp_path_factory.mktemp("coefficients")
    code = main(["fit", "--data", str(synthetic_root), "--out", str(out), "--no-build"])
    return code, out / f"{synth.GPU}.json"
