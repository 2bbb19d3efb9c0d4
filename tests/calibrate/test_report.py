"""The report runs with no data (and says so) and on the synthetic tree (every section, CSV and plot)."""

import pandas as pd

from calibrate.cli import main


def test_report_on_an_empty_data_dir(tmp_path, capsys):
    data, out = tmp_path / "measurements", tmp_path / "report"
    data.mkdir()
    assert main(["report", "--data", str(data), "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "## No measurements yet" in text and "python -m calibrate fit" in text
    assert "wrote" in capsys.readouterr().out


def test_report_on_synthetic_data(synthetic_root, exported, tmp_path):
    _, coefficients = exported
    out = tmp_path / "report"
    assert main(["report", "--data", str(synthetic_root), "--out", str(out), "--no-build",
                 "--coefficients", str(coefficients.parent)]) == 0
    text = (out / "report.md").read_text()
    for heading in ("## Where the numbers come from", "## Table 2", "## Figures 8-9", "## Table 3",
                    "## Predicted vs measured", "python -m calibrate report"):
        assert heading in text
    assert "(calibrated fit)" in text
    for source in ("real multi-GPU run", "real single GPU", "emulated ranks", "CPU fake-tensor oracle"):
        assert f"| {source} |" in text
    for name in ("scatter_by_method.png", "scatter_by_family.png", "error_distribution.png", "levels.png",
                 "fig8_9_fsdp.png", "fig8_9_zero3.png"):
        assert (out / name).stat().st_size > 1000 and f"]({name})" in text

    t2 = pd.read_csv(out / "table2.csv")
    assert len(t2) == 6 and (t2["max_micro_batch"] > 0).all()
    assert {"llmem_gib", "deepspeed_gib", "accelerate_gib", "rule_of_thumb_gib", "fake_trace_allocated_gib"} \
        <= set(t2.columns)
    assert t2["llmem_gib"].notna().all() and t2["deepspeed_gib"].isna().all()  # DeepSpeed: ZeRO methods only
    assert (t2["ours_err_pct"].abs() < 1).all()  # the fitted file reproduces planted physics

    fig = pd.read_csv(out / "fig8_9.csv")
    assert set(fig["world_size"]) == {2, 4} and set(fig["source"]) == {"real_multi", "emulated"}
    t3 = pd.read_csv(out / "table3.csv")
    assert len(t3) == 6 and set(t3["agree"]) <= {"yes", "no"}
    rows = pd.read_csv(out / "rows.csv")
    fake = rows[rows["source"] == "fake"]
    assert len(fake) == 9 and fake["pred_device_bytes"].isna().all() and (fake["err_allocated_pct"].abs() < 1e-6).all()
    summary = pd.read_csv(out / "summary.csv")
    assert set(summary["level"]) == {"allocated", "reserved", "device"}


def test_rows_the_estimator_replays_are_scored_with_the_replayed_reserved_level():
    """The report scores what `python -m estimator` says: where the estimator replays the caching allocator, the
    replay's reserved level (here: this project's H200 runs, 3 steps, snapshot recorded), not the prior's
    allocated x (1 + ratio) + bytes."""
    from pathlib import Path

    from calibrate import data as D
    from calibrate.report import predicted_rows
    from estimator.api import estimate
    from estimator.columns import spec_from_columns

    table = D.load([Path(__file__).resolve().parents[2] / "data/measurements/h200-141gb/gpu_snapshots.csv"])
    rows, _ = predicted_rows(table.rows, None, allow_build=False)
    single = rows[(rows["method"] == "single") & (rows["model"] == "facebook/opt-350m")].iloc[0]
    assert single["reserved_source"] == "replayed"
    expected = estimate(spec_from_columns(single.to_dict()), allow_build=False).ranks[0].peak_reserved_bytes
    assert single["pred_reserved_bytes"] == expected
    # measured on the H200: 10,494,148,608 B reserved; the replay is within 0.1 % of it
    assert abs(single["err_reserved_pct"]) < 0.1
