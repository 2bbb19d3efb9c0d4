"""Fitting the residual terms of one GPU key, cross-validating them, and measuring the "fits" verdict.

Three small models, each on *measured* quantities so that each isolates one piece of physics:

    allocated_measured - analytic_allocated   = W                          (cuBLAS workspaces: a constant)
    reserved_measured  - allocated_measured   = ratio x allocated + bytes  (caching-allocator slack, on the rows
                                                                            the estimator does not replay)
    device_measured    - reserved_measured    = context + nccl x comms     (CUDA context, NCCL buffers)

``W`` is the median residual (robust to the odd run); the two linear models are non-negative least squares
(``LinearRegression(positive=True)``, in GiB for conditioning). A term the rows cannot identify (every row
without NCCL, one allocation size only) keeps the prior's value and says so. The upper bound is a quantile of
measured / predicted device bytes over out-of-fold predictions, so the verdict's safety margin reflects an
unseen model family rather than the rows it was fitted on.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from sklearn.linear_model import LinearRegression
from sklearn.model_selection import GroupKFold, LeaveOneGroupOut

from calibrate.terms import effective_communicators, predict
from estimator.hardware.residuals import Coefficients

GIB = 1024**3
LEVELS = ("allocated", "reserved", "device")
# name -> grouping column; run in this order, the first with >= 2 groups gives the upper bound's predictions.
CV_SCHEMES = {"leave_one_model_family_out": "model_family", "leave_one_method_out": "method"}
FALLBACK_SCHEME = ("grouped_kfold_by_run", "run_id")
DEFAULT_UPPER_QUANTILE = 0.99
DEFAULT_MAX_CV_ERROR_PCT = 5.0
MIN_SLACK_RUNS = 3  # independent runs the reserved formula is fitted on (a run's ranks count once)


@dataclass
class TermFit:
    """The fitted terms of one GPU key and how each was obtained."""

    workspace_total_bytes: int
    reserved_slack_ratio: float
    reserved_slack_bytes: int
    cuda_context_bytes: int
    nccl_bytes_per_communicator: int
    sources: dict[str, str] = field(default_factory=dict)   # term -> "fitted ..." | "prior kept: why"
    rows: dict[str, int] = field(default_factory=dict)      # level -> rows fitted on


def _nonneg_linear(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(slope, intercept) of y ~ slope x + intercept with slope >= 0 and intercept >= 0 (x, y in GiB)."""
    model = LinearRegression(positive=True).fit(x.reshape(-1, 1), y)
    slope, intercept = float(model.coef_[0]), float(model.intercept_)
    if intercept < 0:  # a negative constant has no physical meaning: refit through the origin
        model = LinearRegression(positive=True, fit_intercept=False).fit(x.reshape(-1, 1), y)
        slope, intercept = float(model.coef_[0]), 0.0
    return slope, intercept


def _identifiable(x: np.ndarray) -> bool:
    return len(x) >= 3 and len(np.unique(x)) >= 2


# The workspace sizes torch chooses itself (``getChosenWorkspaceSize``, CUBLAS_WORKSPACE_CONFIG unset): 4096 KiB x 2
# + 16 KiB x 8 before Hopper, 4096 KiB x 8 from sm90 on.
TORCH_WORKSPACE_BYTES = (4096 * 1024 * 2 + 16 * 1024 * 8, 4096 * 1024 * 8)
WORKSPACE_SNAP_BYTES = 1024 * 1024


def fit_workspace(rows: pd.DataFrame, workspaces: int = 1) -> float:
    """The cuBLAS workspaces' total bytes: the median of measured - analytical allocated (>= 0), less what the
    allocator replay adds where the estimator runs it (``replay_extra_bytes``: block rounding, flush buffers).
    Within ``WORKSPACE_SNAP_BYTES`` of one of torch's own sizes (per workspace of ``workspaces``), that size: the
    replay requests the workspace, and a size torch never asks for moves every block after it."""
    residual = rows["peak_allocated_bytes"].to_numpy(float) - rows["analytic_allocated_bytes"].to_numpy(float)
    if "replay_extra_bytes" in rows:
        residual = residual - rows["replay_extra_bytes"].to_numpy(float)
    total = max(0.0, float(np.median(residual)))
    near = [size for size in TORCH_WORKSPACE_BYTES if abs(total / workspaces - size) <= WORKSPACE_SNAP_BYTES]
    return float(near[0] * workspaces) if near else total


def fit_terms(rows: pd.DataFrame, prior: Coefficients) -> TermFit:
    """Fit on ``rows`` (ok CUDA rows with analytical terms; see ``fit_rows``)."""
    if rows.empty:
        raise ValueError("no ok CUDA rows to fit")
    sources: dict[str, str] = {}
    alloc = rows["peak_allocated_bytes"].to_numpy(float)
    reserved = rows["peak_reserved_bytes"].to_numpy(float)
    device = rows["peak_device_bytes"].to_numpy(float)

    workspace = fit_workspace(rows, prior.cublas_workspaces or 1)
    snapped = workspace / (prior.cublas_workspaces or 1) in TORCH_WORKSPACE_BYTES
    sources["cublas_workspace_bytes"] = (f"fitted: median of measured - analytical allocated (less the replay's "
                                         f"block rounding) over {len(rows)} rows"
                                         + (", within 1 MiB of torch's own size, which it takes" if snapped else "")
                                         + (" (negative median clamped to 0)" if workspace == 0 else ""))

    # Allocation retries mean the allocator flushed its cache under pressure: reserved was squeezed, so those
    # rows say nothing about the slack it keeps when free to. Rows whose reserved level the estimator replays
    # through the caching-allocator model never use the formula: it is fitted on the others alone.
    calm = (rows["num_alloc_retries"].fillna(0) == 0).to_numpy()
    if "reserved_source" in rows:
        calm = calm & (rows["reserved_source"] != "replayed").to_numpy()
    x, y = alloc[calm] / GIB, (reserved[calm] - alloc[calm]) / GIB
    # a run's ranks share one allocation stream: the formula needs independent runs, not rank rows
    runs = int(rows.loc[calm, "run_id"].nunique()) if "run_id" in rows else len(x)
    if runs < MIN_SLACK_RUNS:
        ratio, slack_gib = prior.reserved_slack_ratio, prior.reserved_slack_bytes / GIB
        sources["reserved_slack_ratio"] = (f"prior kept: {runs} run(s) without allocation retries whose reserved "
                                           f"level the estimator does not replay (fewer than {MIN_SLACK_RUNS})")
        sources["reserved_slack_bytes"] = sources["reserved_slack_ratio"]
    elif _identifiable(x):
        ratio, slack_gib = _nonneg_linear(x, y)
        sources["reserved_slack_ratio"] = f"fitted: non-negative least squares over {len(x)} rows"
        sources["reserved_slack_bytes"] = sources["reserved_slack_ratio"]
    else:
        ratio = prior.reserved_slack_ratio
        slack_gib = max(0.0, float(np.median(y - ratio * x))) if len(x) else prior.reserved_slack_bytes / GIB
        sources["reserved_slack_ratio"] = "prior kept: fewer than 3 rows or one allocation size"
        sources["reserved_slack_bytes"] = (f"fitted: median over {len(x)} rows with the prior ratio" if len(x)
                                           else "prior kept: no row without allocation retries whose reserved "
                                                "level the estimator does not replay")

    comms = effective_communicators(rows["communicators"], rows["emulated"]).to_numpy(float)
    extra = (device - reserved) / GIB
    if _identifiable(comms):
        nccl_gib, context_gib = _nonneg_linear(comms, extra)
        sources["nccl_bytes_per_communicator"] = f"fitted: non-negative least squares over {len(rows)} rows"
        sources["cuda_context_bytes"] = sources["nccl_bytes_per_communicator"]
    else:
        nccl_gib = prior.nccl_bytes_per_communicator / GIB
        context_gib = max(0.0, float(np.median(extra - nccl_gib * comms)))
        sources["nccl_bytes_per_communicator"] = ("prior kept: no real multi-rank rows (emulated ranks and single "
                                                  "GPUs hold no NCCL buffers)")
        sources["cuda_context_bytes"] = f"fitted: median of device - reserved over {len(rows)} rows"
    return TermFit(workspace_total_bytes=int(round(workspace)), reserved_slack_ratio=round(ratio, 9),
                   reserved_slack_bytes=int(round(slack_gib * GIB)), cuda_context_bytes=int(round(context_gib * GIB)),
                   nccl_bytes_per_communicator=int(round(nccl_gib * GIB)), sources=sources,
                   rows={"allocated": len(rows), "reserved": int(calm.sum()) if runs >= MIN_SLACK_RUNS else 0,
                         "device": len(rows)})


def to_coefficients(terms: TermFit, prior: Coefficients, gpu_key: str, upper_bound_ratio: float) -> Coefficients:
    """Terms in the estimator's schema. The workspace total is split over the prior's workspace count (the
    number of cuBLAS handles x streams is a fact of PyTorch, not something the rows can separate)."""
    workspaces = prior.cublas_workspaces or 1
    return dataclasses.replace(
        prior, gpu_key=gpu_key, calibrated=True, source="fit", path="",
        cublas_workspace_bytes=int(round(terms.workspace_total_bytes / workspaces)), cublas_workspaces=workspaces,
        reserved_slack_ratio=float(terms.reserved_slack_ratio), reserved_slack_bytes=terms.reserved_slack_bytes,
        cuda_context_bytes=terms.cuda_context_bytes, nccl_bytes_per_communicator=terms.nccl_bytes_per_communicator,
        upper_bound_ratio=float(upper_bound_ratio))


def fit_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows a fit may use: whole run ok, this rank ok, CUDA memory figures, estimable by the estimator."""
    keep = ((rows["run_status"] == "ok") & (rows["rank_status"] == "ok") & (rows["memory_source"] == "cuda")
            & rows["analytic_allocated_bytes"].notna())
    return rows[keep]


# --- metrics ----------------------------------------------------------------------------------------------
def level_metrics(measured: np.ndarray, predicted: np.ndarray) -> dict[str, Any]:
    """Median / p95 / max absolute % error and the worst under-prediction (GiB; 0 = never under)."""
    measured, predicted = np.asarray(measured, float), np.asarray(predicted, float)
    if len(measured) == 0:
        return {"n": 0}
    pct = np.abs(predicted - measured) / measured * 100.0
    under = float(np.max(measured - predicted)) / GIB
    return {"n": int(len(measured)), "median_abs_pct": round(float(np.median(pct)), 4),
            "p95_abs_pct": round(float(np.percentile(pct, 95)), 4), "max_abs_pct": round(float(np.max(pct)), 4),
            "worst_under_gib": round(max(under, 0.0), 4)}


def metrics_by_level(rows: pd.DataFrame, preds: pd.DataFrame) -> dict[str, Any]:
    return {level: level_metrics(rows[f"peak_{level}_bytes"].to_numpy(), preds[f"pred_{level}_bytes"].to_numpy())
            for level in LEVELS}


@dataclass
class CvResult:
    scheme: str
    group_column: str
    overall: dict[str, Any]
    per_group: dict[str, dict[str, Any]]
    oof: pd.DataFrame                       # out-of-fold predictions, index = rows' index


def cross_validate(rows: pd.DataFrame, prior: Coefficients, scheme: str, column: str) -> CvResult | str:
    """Fit on every group but one, predict the held-out group, pool. A string says why it could not run."""
    groups = rows[column].astype(str)
    n_groups = groups.nunique()
    if n_groups < 2:
        return f"one {column} only ({groups.iloc[0] if len(groups) else 'no rows'})"
    splitter = LeaveOneGroupOut() if scheme != FALLBACK_SCHEME[0] else GroupKFold(n_splits=min(5, n_groups))
    parts = []
    for train, test in splitter.split(rows, groups=groups):
        train_rows, test_rows = rows.iloc[train], rows.iloc[test]
        terms = fit_terms(train_rows, prior)
        coeffs = to_coefficients(terms, prior, prior.gpu_key, 1.0)
        parts.append(predict(test_rows, test_rows["emulated"], coeffs))
    oof = pd.concat(parts).loc[rows.index]
    per_group = {str(g): metrics_by_level(rows[groups == g], oof[groups == g]) for g in sorted(groups.unique())}
    return CvResult(scheme=scheme, group_column=column, overall=metrics_by_level(rows, oof), per_group=per_group,
                    oof=oof)


def run_cv(rows: pd.DataFrame, prior: Coefficients) -> tuple[list[CvResult], dict[str, str]]:
    """Every grouped scheme that can run; the run-grouped k-fold only when neither can."""
    done, skipped = [], {}
    for scheme, column in CV_SCHEMES.items():
        result = cross_validate(rows, prior, scheme, column)
        if isinstance(result, str):
            skipped[scheme] = result
        else:
            done.append(result)
    if not done:
        result = cross_validate(rows, prior, *FALLBACK_SCHEME)
        if isinstance(result, str):
            skipped[FALLBACK_SCHEME[0]] = "fewer than 2 runs"
        else:
            done.append(result)
    return done, skipped


def upper_bound_ratio(measured_device: np.ndarray, predicted_device: np.ndarray, quantile: float) -> float:
    """The ``quantile`` of measured / predicted device bytes, never below 1, rounded *up* to 1e-4."""
    ratios = np.asarray(measured_device, float) / np.asarray(predicted_device, float)
    q = float(np.quantile(ratios, quantile)) if len(ratios) else 1.0
    return max(1.0, math.ceil(q * 1e4) / 1e4)


# --- the verdict --------------------------------------------------------------------------------------------
def run_capacity(rows: pd.DataFrame, catalogue_bytes: int | None) -> pd.Series:
    """What each run had to fit in: its allocator cap, else the device's total memory, else the catalogue's."""
    total = rows["device_total_bytes"].fillna(catalogue_bytes if catalogue_bytes else np.nan)
    return rows["memory_cap_bytes"].fillna(total)


def verdicts(rows: pd.DataFrame, preds: pd.DataFrame, coeffs: Coefficients, catalogue_bytes: int | None
             ) -> pd.DataFrame:
    """Per row: the bound compared with the run's capacity and whether the estimator says it fits. Under an
    allocator cap (``set_per_process_memory_fraction``) the cap limits reserved bytes, so the reserved
    prediction is bounded; otherwise the device prediction, as ``Estimate.fits`` does."""
    capped = rows["memory_cap_bytes"].notna()
    level = preds["pred_reserved_bytes"].where(capped, preds["pred_device_bytes"])
    bound = np.ceil(level.astype(float) * coeffs.upper_bound_ratio)
    capacity = run_capacity(rows, catalogue_bytes)
    return pd.DataFrame({"bound_bytes": bound, "capacity_bytes": capacity, "predicted_fits": bound <= capacity},
                        index=rows.index)


def verdict_stats(rows: pd.DataFrame, verdict: pd.DataFrame) -> dict[str, Any]:
    """False-fit rate per run: predicted to fit, but the run ran out of memory. OOMs while building the model
    (``oom_step == -1``: the harness builds full-size before sharding) are counted apart, not as false fits."""
    runs = pd.DataFrame({"run_id": rows["run_id"], "status": rows["run_status"],
                         "setup_oom": rows["oom_step"] == -1, "fits": verdict["predicted_fits"]})
    runs = runs[runs["status"].isin(["ok", "oom"])]
    per_run = runs.groupby("run_id").agg(status=("status", "first"), setup_oom=("setup_oom", "any"),
                                         fits=("fits", "all"))
    setup = per_run[(per_run["status"] == "oom") & per_run["setup_oom"]]
    judged = per_run.drop(setup.index)
    oom, ok = judged[judged["status"] == "oom"], judged[judged["status"] == "ok"]
    predicted_fit = judged[judged["fits"]]
    false_fits = int((predicted_fit["status"] == "oom").sum())
    return {"runs_ok": int(len(ok)), "runs_oom": int(len(oom)), "runs_oom_in_setup_excluded": int(len(setup)),
            "predicted_fit": int(len(predicted_fit)), "false_fits": false_fits,
            "false_fit_rate": round(false_fits / len(predicted_fit), 4) if len(predicted_fit) else None,
            "ooms_caught": int((~oom["fits"]).sum()),
            "oom_catch_rate": round(float((~oom["fits"]).mean()), 4) if len(oom) else None,
            "false_ooms": int((~ok["fits"]).sum()),
            "false_oom_rate": round(float((~ok["fits"]).mean()), 4) if len(ok) else None,
            "false_fit_run_ids": sorted(predicted_fit.index[predicted_fit["status"] == "oom"].tolist())}
