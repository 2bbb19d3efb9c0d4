"""fit -> export -> estimator load round trip; refusal above the CV threshold; the valid-range note."""

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from calibrate.cli import main
from calibrate.terms import PROBE
from estimator.api import estimate
from estimator.columns import spec_from_columns
from estimator.hardware import residuals
from estimator.hardware.residuals import REQUIRED_TERMS, load_coefficients
from tests.calibrate import synth


def test_cli_fit_writes_a_file_the_estimator_loads(exported, synthetic_root):
    code, path = exported
    assert code == 0 and path.is_file()
    doc = json.loads(path.read_text())
    coeffs = load_coefficients("h100-80gb", path)
    assert coeffs.calibrated and coeffs.source == "fit" and doc["schema_version"] == residuals.SCHEMA_VERSION
    assert {name: getattr(coeffs, name) for name in REQUIRED_TERMS} == doc["terms"]
    prov = coeffs.provenance
    assert {"date", "git_sha", "versions", "data_files", "rows", "features", "cv", "verdict"} <= set(prov)
    assert {"numpy", "pandas", "scikit-learn", "python"} <= set(prov["versions"])
    (data_file,) = prov["data_files"]  # the fake/ table is not this GPU's
    on_disk = synthetic_root / "h100-80gb" / "synthetic.csv"
    assert data_file["sha256"] == hashlib.sha256(on_disk.read_bytes()).hexdigest()
    assert data_file["rows"] == sum(1 for _ in on_disk.open()) - 1
    assert set(prov["features"]) == {"allocated", "reserved", "device", "upper_bound"}
    assert coeffs.valid_range["methods"] == ["ddp", "fsdp", "single", "zero2", "zero3"]
    assert coeffs.valid_range["seq_len"] == [256, 512] and coeffs.valid_range["world_size"] == [1, 4]


def test_round_trip_agrees_with_the_estimator(exported, fitted):
    """What calibrate predicted with its fitted terms is what ``estimate`` gives with the exported file."""
    _, path = exported
    assert json.loads(path.read_text())["terms"] == {n: getattr(fitted.coefficients, n) for n in REQUIRED_TERMS}
    rows = fitted.rows[(fitted.rows["run_status"] == "ok") & ~fitted.rows["emulated"].astype(bool)]
    assert len(rows) > 40
    for _, row in rows.iterrows():
        est = estimate(spec_from_columns(row.to_dict()), str(path), allow_build=False)
        rank = next(r for r in est.ranks if r.rank == row["rank"])
        for level in ("allocated", "reserved", "device"):
            ours = getattr(rank, f"peak_{level}_bytes")
            assert ours == pytest.approx(row[f"pred_{level}_bytes"], rel=1e-9), (level, row["_line"])
        assert est.calibrated


def test_the_fitted_file_changes_the_estimate(exported):
    """The fitted terms where the estimator keeps the formula (ZeRO-3); where it replays the allocator (DDP) the
    reserved level stays the replay's and the file moves the levels around it."""
    _, path = exported
    c = load_coefficients("h100-80gb", path)
    spec = synth.spec_for("facebook/opt-125m", "zero3", 2, 2, 512, False)
    # the GPU's documented priors (h100-80gb's shipped file is itself a fit now: session 25)
    documented = dataclasses.replace(load_coefficients("generic"), gpu_key="h100-80gb")
    prior, fitted = estimate(spec, documented, allow_build=False), estimate(spec, str(path), allow_build=False)
    analytic = estimate(spec, PROBE, allow_build=False).peak_allocated_bytes
    assert fitted.reserved_source == "prior"
    assert fitted.peak_allocated_bytes == analytic + c.cublas_workspace_bytes * c.cublas_workspaces
    assert fitted.peak_reserved_bytes == residuals.reserved_from_allocated(fitted.peak_allocated_bytes, c)
    assert fitted.peak_device_bytes == fitted.peak_reserved_bytes + c.cuda_context_bytes + c.nccl_bytes_per_communicator
    assert fitted.peak_device_bytes != prior.peak_device_bytes and fitted.calibrated and not prior.calibrated
    assert not any("uncalibrated" in n for n in fitted.notes)
    replayed = estimate(synth.spec_for("facebook/opt-125m", "ddp", 2, 2, 512, False), str(path), allow_build=False)
    assert replayed.reserved_source == "replayed"
    assert replayed.peak_device_bytes == (replayed.peak_reserved_bytes + c.cuda_context_bytes
                                          + c.nccl_bytes_per_communicator)


def test_estimator_cli_takes_the_fitted_file(exported, capsys):
    from estimator.io.cli import main as estimator_main

    _, path = exported
    code = estimator_main(["--model", "facebook/opt-125m", "--method", "ddp", "--gpus", "2", "--gpu", "h100-80gb",
                           "--micro-batch-size", "2", "--seq-len", "512", "--precision", "mixed_bf16",
                           "--coefficients", str(path), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["calibrated"] is True
    assert not any("outside the calibrated range" in n for n in out["notes"])


def test_estimate_notes_a_spec_outside_the_valid_range(exported):
    _, path = exported
    inside = synth.spec_for("facebook/opt-125m", "fsdp", 2, 2, 512, True)
    assert not [n for n in estimate(inside, str(path), allow_build=False).notes if "calibrated range" in n]
    outside = synth.spec_for("facebook/opt-350m", "zero1", 8, 16, 1024, True)
    notes = [n for n in estimate(outside, str(path), allow_build=False).notes if "calibrated range" in n]
    assert len(notes) == 1
    for part in ("seq_len 1,024 not in 256..512", "micro_batch_size 16", "world_size 8", "methods 'zero1'"):
        assert part in notes[0]
    # priors carry no range: nothing to warn about
    assert not [n for n in estimate(outside, allow_build=False).notes if "calibrated range" in n]


def test_range_notes_names_another_gpu(exported):
    _, path = exported
    coeffs = load_coefficients("h100-80gb", path)
    spec = synth.spec_for("facebook/opt-125m", "single", 1, 1, 256, False, gpu="a100-80gb")
    notes = residuals.range_notes(coeffs, spec, gpu_key="a100-80gb", params=125_239_296, model_family="opt")
    assert len(notes) == 1 and "'h100-80gb', applied to 'a100-80gb'" in notes[0]


def test_a_malformed_valid_range_is_refused(exported, tmp_path):
    _, path = exported
    doc = json.loads(path.read_text())
    doc["valid_range"]["seq_len"] = [512]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"valid_range.seq_len.*\[min, max\]"):
        load_coefficients("h100-80gb", bad)


def test_export_is_refused_above_the_cv_threshold(synthetic_root, tmp_path, capsys):
    code = main(["fit", "--data", str(synthetic_root), "--out", str(tmp_path), "--max-cv-error-pct", "0.0001",
                 "--no-build"])
    err = capsys.readouterr().err
    assert code == 1 and not list(tmp_path.iterdir())
    assert "refused: h100-80gb: leave_one_model_family_out device-level p95 error" in err
    assert "h100-80gb/synthetic.csv line " in err  # the worst rows are named


def test_the_fit_keeps_the_allocator_replay_and_fits_the_formula_on_the_other_rows():
    """A file's reserved terms apply only where the estimator does not replay the allocator. On this project's H200
    runs that is one run (every-k over DeepSeek's dense first layer; ZeRO-3 + LoRA is replayed since session 28):
    too few independent runs to fit the formula, so the slack keeps its prior; every other row keeps the replay's level, in and out of fold, and no ZeRO-3 rank is among the rows a
    refusal (the CV threshold) names."""
    from calibrate import data as D
    from calibrate.export import fit_gpu
    from calibrate.terms import analytic_terms

    table = D.load([Path(__file__).resolve().parents[2] / "data/measurements/h200-141gb"], ["h200-141gb"])
    rows = table.rows.join(analytic_terms(table.rows, allow_build=False))
    out = fit_gpu(rows, table.files, "h200-141gb")
    sources = out.rows.loc[out.rows["run_status"] == "ok", ["run_id", "method", "reserved_source"]]
    on_prior = set(sources.loc[sources["reserved_source"] != "replayed", "run_id"])
    assert on_prior == {"f5cf7c580d4ba11d-c862afd8"} and len(sources) > 200
    assert out.document["provenance"]["rows"]["fitted"]["reserved"] == 0
    assert "prior kept" in out.document["notes"]["reserved_slack_ratio"]
    assert not any("zero3 x" in why or "allocator replay" in why for why in out.refused)


def test_dry_run_writes_nothing(synthetic_root, tmp_path, capsys):
    assert main(["fit", "--data", str(synthetic_root), "--out", str(tmp_path), "--dry-run", "--no-build"]) == 0
    assert "cv leave_one_method_out" in capsys.readouterr().out and not list(tmp_path.iterdir())


def test_shipped_coefficient_files_load_and_their_data_matches():
    """Every shipped file parses; a fitted one names measurement files that exist with the recorded sha256
    (a table changed since the fit means the file needs a refit)."""
    root = Path(__file__).resolve().parents[2]
    files = [p for p in (root / "estimator" / "coefficients").glob("*.json") if not p.name.startswith("throughput_")]
    assert files
    for path in files:
        coeffs = load_coefficients(path.stem)
        assert coeffs.gpu_key == path.stem
        if coeffs.calibrated:
            for entry in coeffs.provenance["data_files"]:
                data = root / entry["path"]
                assert data.is_file(), f"{path.name}: {entry['path']} is missing"
                assert hashlib.sha256(data.read_bytes()).hexdigest() == entry["sha256"], \
                    f"{path.name}: {entry['path']} changed since the fit; run python -m calibrate fit"
