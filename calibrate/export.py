"""One GPU key from validated rows to a coefficient file: fit, cross-validate, bound, judge, document.

The file keeps the estimator's schema (``estimator/hardware/residuals.py``: the seven ``terms``, ``notes``,
``valid_range``) and adds the fit's provenance under ``provenance``: features and coefficients of each level,
CV metrics, verdict statistics, row counts, sha256 of every measurement file, library versions, git sha,
date. Export is refused (nothing written) when the cross-validated error exceeds the threshold.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from calibrate import fit as F
from calibrate.terms import REPLAYED_COLUMNS, predict, with_replayed_levels
from estimator.hardware.gpus import get_gpu
from estimator.hardware.residuals import REQUIRED_TERMS, SCHEMA_VERSION, Coefficients, load_coefficients

FIT_SCHEMA_VERSION = 1
WORST_ROWS_SHOWN = 5
TERM_FORMULAS = {
    "allocated": "analytic_allocated_bytes + cublas_workspace_bytes x cublas_workspaces",
    "reserved": ("the caching-allocator replay where the estimator runs it (estimator.reserved), else "
                 "allocated x (1 + reserved_slack_ratio) + reserved_slack_bytes"),
    "device": "reserved + cuda_context_bytes + nccl_bytes_per_communicator x communicators",
    "upper_bound": "device x upper_bound_ratio",
}


@dataclass
class Outcome:
    gpu_key: str
    document: dict[str, Any] | None = None
    coefficients: Coefficients | None = None
    refused: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    rows: pd.DataFrame | None = None          # the key's rows with terms, predictions and verdicts

    @property
    def ok(self) -> bool:
        return self.document is not None and not self.refused


def _where(row: pd.Series) -> str:
    return f"{row['_file']} line {int(row['_line'])}"


def valid_range(rows: pd.DataFrame) -> dict[str, Any]:
    """What the fit saw: the estimator notes a spec outside it (``estimator.hardware.residuals.range_notes``)."""
    def span(column: str) -> list[int]:
        values = pd.to_numeric(rows[column])
        return [int(values.min()), int(values.max())]

    return {"params": span("params"), "world_size": span("world_size"),
            "micro_batch_size": span("micro_batch_size"), "seq_len": span("seq_len"), "lora_rank": span("lora_rank"),
            "methods": sorted(set(rows["method"])), "precisions": sorted(set(rows["precision"])),
            "optimizers": sorted(set(rows["optimizer"])), "attn": sorted(set(rows["attn"])),
            "model_families": sorted(set(rows["model_family"]))}


def git_state() -> dict[str, Any]:
    def run(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None
    sha = run("rev-parse", "HEAD")
    status = run("status", "--porcelain") if sha else None
    return {"git_sha": sha, "git_dirty": bool(status) if status is not None else None}


def library_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("llm-memory-estimator", "numpy", "pandas", "scikit-learn"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _seen(rows: pd.DataFrame, column: str) -> list[str]:
    return sorted({str(v) for v in rows[column] if str(v) not in ("", "nan")})


def _cv_block(results: list[F.CvResult], skipped: dict[str, str], threshold_pct: float) -> dict[str, Any]:
    return {"threshold": {"level": "device", "statistic": "p95_abs_pct", "max_pct": threshold_pct,
                          "rule": "every scheme that ran must be at or under max_pct"},
            "schemes": {r.scheme: {"group_column": r.group_column, "overall": r.overall, "per_group": r.per_group}
                        for r in results},
            "skipped": skipped}


def _worst_rows(rows: pd.DataFrame, oof: pd.DataFrame) -> list[str]:
    pct = (oof["pred_device_bytes"] - rows["peak_device_bytes"]).abs() / rows["peak_device_bytes"] * 100
    out = []
    for i in pct.sort_values(ascending=False).index[:WORST_ROWS_SHOWN]:
        row = rows.loc[i]
        out.append(f"{_where(row)} ({row['model']}, {row['method']} x{int(row['world_size'])}, "
                   f"b={int(row['micro_batch_size'])}, s={int(row['seq_len'])}): {pct[i]:.1f} %")
    return out


def fit_gpu(rows: pd.DataFrame, files: list[dict], gpu_key: str, *, quantile: float = F.DEFAULT_UPPER_QUANTILE,
            max_cv_error_pct: float = F.DEFAULT_MAX_CV_ERROR_PCT, prior: Coefficients | None = None,
            command: str = "") -> Outcome:
    """Fit ``gpu_key`` from ``rows`` (validated rows of that key, joined with ``terms.analytic_terms``)."""
    out = Outcome(gpu_key=gpu_key, rows=rows)
    gpu = get_gpu(gpu_key)
    prior = prior or load_coefficients(gpu.key)
    bad = rows[(rows["estimate_error"] != "") & (rows["rank"] != -1)]
    for _, row in bad.head(WORST_ROWS_SHOWN).iterrows():
        out.warnings.append(f"{_where(row)}: not estimable, left out ({row['estimate_error']})")
    if len(bad) > WORST_ROWS_SHOWN:
        out.warnings.append(f"... and {len(bad) - WORST_ROWS_SHOWN} more rows the estimator cannot estimate")
    fitted = F.fit_rows(rows)
    if fitted.empty:
        out.refused.append(f"{gpu_key}: no ok CUDA rows the estimator can estimate; nothing to fit")
        return out
    # Where the estimator replays the allocator its reserved level is the replay's, whatever the file says: the
    # formula's terms are fitted on the other rows, and every prediction below takes the replay where it runs.
    # The replay allocates the cuBLAS workspaces, so it runs with the ones these rows measure (read off the
    # allocated level less what the replay adds to the analytical bytes: block rounding, ZeRO's flush buffers).
    rows = with_replayed_levels(rows, prior)
    workspace = F.fit_workspace(F.fit_rows(rows), prior.cublas_workspaces or 1)
    if int(round(workspace / (prior.cublas_workspaces or 1))) != prior.cublas_workspace_bytes:
        replaying = dataclasses.replace(
            prior, cublas_workspace_bytes=int(round(workspace / (prior.cublas_workspaces or 1))))
        rows = with_replayed_levels(rows.drop(columns=[*REPLAYED_COLUMNS, "replay_extra_bytes"]), replaying)
    fitted = F.fit_rows(rows)
    results, skipped = F.run_cv(fitted, prior)
    if not results:
        out.refused.append(f"{gpu_key}: cross-validation needs rows from at least 2 runs "
                           f"({len(fitted)} row(s) of {fitted['run_id'].nunique()} run)")
        return out
    for result in results:
        p95 = result.overall["device"]["p95_abs_pct"]
        if p95 > max_cv_error_pct:
            out.refused.append(f"{gpu_key}: {result.scheme} device-level p95 error {p95:.2f} % exceeds "
                               f"{max_cv_error_pct:g} %; worst rows: " + "; ".join(_worst_rows(fitted, result.oof)))
    primary = results[0]
    ratio = F.upper_bound_ratio(fitted["peak_device_bytes"].to_numpy(), primary.oof["pred_device_bytes"].to_numpy(),
                                quantile)
    terms = F.fit_terms(fitted, prior)
    coeffs = F.to_coefficients(terms, prior, gpu.key, ratio)
    preds = predict(rows, rows["emulated"], coeffs)
    verdict = F.verdicts(rows, preds, coeffs, gpu.capacity_bytes)
    oof_bound = np.ceil(primary.oof["pred_device_bytes"].astype(float) * ratio)
    exceeded = int((fitted["peak_device_bytes"] > oof_bound).sum())
    out.rows = rows.join(preds).join(verdict)
    out.coefficients = coeffs
    out.document = document(coeffs, terms, prior, fitted, rows, files, results, skipped, verdict,
                            quantile=quantile, primary=primary.scheme, exceeded=exceeded,
                            threshold_pct=max_cv_error_pct, command=command)
    return out


def document(coeffs: Coefficients, terms: F.TermFit, prior: Coefficients, fitted: pd.DataFrame,
             rows: pd.DataFrame, files: list[dict], results: list[F.CvResult], skipped: dict[str, str],
             verdict: pd.DataFrame, *, quantile: float, primary: str, exceeded: int, threshold_pct: float,
             command: str) -> dict[str, Any]:
    """The coefficient file's JSON object."""
    key = coeffs.gpu_key
    used_files = [f for f in files if f.get("gpu_key") == key]
    sources = dict(terms.sources)
    sources["cublas_workspaces"] = f"prior kept: {prior.cublas_workspaces} (cuBLAS handles x streams; the fit " \
                                   f"measures their total, {terms.workspace_total_bytes} B)"
    sources["upper_bound_ratio"] = (f"fitted: {quantile:g} quantile of measured / predicted device bytes over "
                                    f"{primary} out-of-fold predictions ({len(fitted)} rows)")
    statuses = rows["run_status"].value_counts().to_dict()
    stats = F.verdict_stats(rows, verdict)
    stats["bound_exceeded_rows"] = exceeded
    stats["bound_exceeded_rate"] = round(exceeded / len(fitted), 4)
    return {
        "schema_version": SCHEMA_VERSION,
        "gpu_key": key,
        "calibrated": True,
        "source": "fit",
        "description": (f"Fitted by `python -m calibrate fit` on {len(fitted)} measured rows "
                        f"({fitted['run_id'].nunique()} runs) of {get_gpu(key).name}. "
                        + "; ".join(f"{lvl}: {formula}" for lvl, formula in TERM_FORMULAS.items()) + "."),
        "terms": {name: getattr(coeffs, name) for name in REQUIRED_TERMS},
        "notes": {name: sources.get(name, "") for name in REQUIRED_TERMS},
        "valid_range": valid_range(fitted),
        "provenance": {
            "kind": "fit",
            "fit_schema_version": FIT_SCHEMA_VERSION,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": command,
            **git_state(),
            "versions": library_versions(),
            "measured_with": {c: _seen(fitted, c) for c in ("gpu_name", "torch_version", "cuda_version",
                                                              "driver_version")},
            "data_files": [{"path": f["path"], "sha256": f["sha256"], "rows": f["rows"]} for f in used_files],
            "rows": {"read": int(len(rows)), "fitted": {lvl: n for lvl, n in terms.rows.items()},
                     "run_status": {str(k): int(v) for k, v in statuses.items()},
                     "emulated_fitted": int(fitted["emulated"].sum()),
                     "not_estimable": int(((rows["estimate_error"] != "") & (rows["rank"] != -1)).sum())},
            "features": {
                "allocated": {"formula": TERM_FORMULAS["allocated"], "target": "peak_allocated_bytes",
                              "features": ["analytic_allocated_bytes"], "estimator": "median residual",
                              "coefficients": {"cublas_workspace_total_bytes": terms.workspace_total_bytes}},
                "reserved": {"formula": TERM_FORMULAS["reserved"],
                             "target": "peak_reserved_bytes - peak_allocated_bytes",
                             "features": ["peak_allocated_bytes"],
                             "estimator": "sklearn LinearRegression(positive=True), intercept >= 0, GiB units; "
                                          "rows with allocation retries, and rows whose reserved level the "
                                          "estimator replays, left out",
                             "coefficients": {"reserved_slack_ratio": terms.reserved_slack_ratio,
                                              "reserved_slack_bytes": terms.reserved_slack_bytes}},
                "device": {"formula": TERM_FORMULAS["device"], "target": "peak_device_bytes - peak_reserved_bytes",
                           "features": ["communicators (0 on emulated ranks)"],
                           "estimator": "sklearn LinearRegression(positive=True), intercept >= 0, GiB units",
                           "coefficients": {"cuda_context_bytes": terms.cuda_context_bytes,
                                            "nccl_bytes_per_communicator": terms.nccl_bytes_per_communicator}},
                "upper_bound": {"formula": TERM_FORMULAS["upper_bound"], "quantile": quantile,
                                "from": f"{primary} out-of-fold predictions",
                                "coefficients": {"upper_bound_ratio": coeffs.upper_bound_ratio}},
            },
            "cv": _cv_block(results, skipped, threshold_pct),
            "verdict": stats,
            "prior": {"path": prior.path, "terms": {name: getattr(prior, name) for name in REQUIRED_TERMS}},
        },
    }


def write(document: dict[str, Any], out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{document['gpu_key']}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(document, indent=2) + "\n")
    tmp.replace(path)
    return path


def command_line() -> str:
    return "python -m calibrate " + " ".join(sys.argv[1:]) if sys.argv else "python -m calibrate"
