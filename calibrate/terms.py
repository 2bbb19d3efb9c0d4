"""The estimator's analytical terms for every measured row, computed by the estimator itself.

``estimate`` is called once per distinct spec with *probe* coefficients: no workspace, no slack, no context
and one byte per NCCL communicator. Its allocated peak is then the analytical allocated bytes (model states,
activations, temporaries) and ``device - reserved`` counts the communicators it assumes. Nothing of the
estimator's accounting is re-implemented here, so a change in the estimator is a change in what is fitted.

Predictions for given coefficients apply ``estimator.hardware.residuals``' own functions to those terms: the same
arithmetic ``estimate`` runs, so an exported file reproduces them exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pandas as pd

from estimator.api import Estimate, RankEstimate, estimate
from estimator.columns import measured_spec_from_columns
from estimator.hardware import residuals
from estimator.hardware.residuals import Coefficients
from estimator.models.arch import resolve_arch
from estimator.spec import RunSpec

PROBE = Coefficients(gpu_key="probe", calibrated=True, source="probe", description="analytical terms only",
                     cuda_context_bytes=0, cublas_workspace_bytes=0, cublas_workspaces=0, reserved_slack_ratio=0.0,
                     reserved_slack_bytes=0, nccl_bytes_per_communicator=1, upper_bound_ratio=1.0)
TERM_COLUMNS = ["analytic_allocated_bytes", "communicators", "model_family", "params", "estimate_error"]


def rank_estimates(rows: pd.DataFrame, coeffs: Coefficients, *, allow_build: bool = True,
                   progress: Callable[[int, int], None] | None = None, replay_reserved: bool = True
                   ) -> list[tuple[Estimate, RankEstimate] | str]:
    """Per row, ``estimate``'s result under ``coeffs`` and the row's rank in it (ranks the estimator does not
    model separately, it computes ranks 0 and N-1, take its worst rank), or why it cannot be estimated. One
    estimate per distinct spec."""
    cache: dict[RunSpec, Estimate | str] = {}
    out: list[tuple[Estimate, RankEstimate] | str] = []
    total = len(rows)
    for n, (_, row) in enumerate(rows.iterrows()):
        if progress:
            progress(n, total)
        try:
            spec = measured_spec_from_columns(row.to_dict())
        except (ValueError, TypeError, KeyError) as err:
            out.append(f"spec: {err}")
            continue
        if spec not in cache:
            try:
                cache[spec] = estimate(spec, coeffs, allow_build=allow_build, replay_reserved=replay_reserved)
            except ValueError as err:
                cache[spec] = str(err).splitlines()[0]
        est = cache[spec]
        if isinstance(est, str):
            out.append(est)
            continue
        ranks = {r.rank: r for r in est.ranks}
        rank = int(row["rank"]) if not pd.isna(row["rank"]) else -1
        out.append((est, ranks.get(rank, ranks[est.worst_rank])))
    return out


def analytic_terms(rows: pd.DataFrame, *, allow_build: bool = True,
                   progress: Callable[[int, int], None] | None = None) -> pd.DataFrame:
    """Per row: ``analytic_allocated_bytes``, ``communicators`` (the estimator's, for a real job),
    ``model_family`` (the config's model_type), ``params``, and ``estimate_error`` (why the estimator could not
    estimate the row; the other cells are then empty)."""
    out = {c: [] for c in TERM_COLUMNS}
    # The analytical bytes alone: no allocator replay (its block rounding and its ZeRO flush buffers are in
    # ``replayed_levels``, with the workspaces a replay needs).
    for (_, row), result in zip(rows.iterrows(), rank_estimates(rows, PROBE, allow_build=allow_build,
                                                                  progress=progress, replay_reserved=False)):
        out["model_family"].append(_family(str(row["model"])))
        if isinstance(result, str):
            for c in ("analytic_allocated_bytes", "communicators", "params"):
                out[c].append(math.nan)
            out["estimate_error"].append(result)
            continue
        est, rank = result
        out["analytic_allocated_bytes"].append(rank.peak_allocated_bytes)
        out["communicators"].append(rank.peak_device_bytes - rank.peak_reserved_bytes)
        out["params"].append(est.params)
        out["estimate_error"].append("")
    return pd.DataFrame(out, index=rows.index)


REPLAYED_COLUMNS = ("replayed_reserved_bytes", "replayed_allocated_bytes", "reserved_source")


def with_replayed_levels(rows: pd.DataFrame, coeffs: Coefficients, *, allow_build: bool = False) -> pd.DataFrame:
    """``rows`` (with ``analytic_terms``) joined with ``replayed_levels`` under ``coeffs`` and
    ``replay_extra_bytes``: what a replayed allocated level holds beyond the analytical bytes and the workspaces
    (the allocator's block rounding, ZeRO-1/2's flush buffers; 0 where the estimator does not replay)."""
    levels = replayed_levels(rows, coeffs, allow_build=allow_build)
    extra = (levels["replayed_allocated_bytes"] - rows["analytic_allocated_bytes"]
             - residuals.cublas_workspace_bytes(coeffs))
    return rows.join(levels).assign(replay_extra_bytes=extra.fillna(0.0))


def replayed_levels(rows: pd.DataFrame, coeffs: Coefficients, *, allow_build: bool = True) -> pd.DataFrame:
    """Per row, the reserved and allocated levels ``estimate`` itself gives with ``coeffs`` where it replays the
    rank's timeline through the caching-allocator model (``replayed_reserved_bytes``, ``replayed_allocated_bytes``:
    with the allocator's block rounding; NaN where it keeps the prior's ``allocated x (1 + ratio) + bytes``, which
    ``predict`` computes), and ``reserved_source``. A report that scored the prior's formula on rows the estimator
    replays would score numbers no user is shown."""
    replayed, allocated, sources = [], [], []
    for result in rank_estimates(rows, coeffs, allow_build=allow_build):
        rank = None if isinstance(result, str) else result[1]
        if rank is not None and rank.reserved_source == "replayed":
            replayed.append(rank.peak_reserved_bytes)
            allocated.append(rank.peak_allocated_bytes)
            sources.append("replayed")
        else:
            replayed.append(math.nan)
            allocated.append(math.nan)
            sources.append("prior" if rank is not None else "")
    return pd.DataFrame({"replayed_reserved_bytes": replayed, "replayed_allocated_bytes": allocated,
                         "reserved_source": sources}, index=rows.index)


def _family(model: str) -> str:
    """The model family used for leave-one-family-out: the config's ``model_type`` (opt, llama, bloom, ...)."""
    try:
        return resolve_arch(model).model_type
    except ValueError:
        return model


def effective_communicators(communicators: pd.Series, emulated: pd.Series) -> pd.Series:
    """Communicators that really held NCCL buffers: none on emulated ranks (a fake process group)."""
    return communicators.where(~emulated.astype(bool), 0)


def predict(terms: pd.DataFrame, emulated: pd.Series, coeffs: Coefficients) -> pd.DataFrame:
    """Allocated / reserved / device predictions of every row, with the estimator's own arithmetic
    (``estimator.api`` adds the workspace to the analytical bytes, then applies ``estimator.hardware.residuals``).
    Where ``terms`` carries ``replayed_levels`` (the estimator replays the rank through the caching-allocator
    model), the reserved and allocated levels are the replay's, as ``estimate`` reports them; the device level
    adds what the formula adds above reserved (context, and NCCL only where real buffers existed)."""
    comms = effective_communicators(terms["communicators"], emulated)
    workspace = residuals.cublas_workspace_bytes(coeffs)
    replayed = terms.get("replayed_reserved_bytes", pd.Series(math.nan, index=terms.index))
    replayed_alloc = terms.get("replayed_allocated_bytes", pd.Series(math.nan, index=terms.index))
    alloc, reserved, device = [], [], []
    for analytic, n_comm, r_replay, a_replay in zip(terms["analytic_allocated_bytes"], comms, replayed,
                                                     replayed_alloc):
        if pd.isna(analytic):
            alloc.append(math.nan)
            reserved.append(math.nan)
            device.append(math.nan)
            continue
        a = int(round(analytic + workspace)) if pd.isna(r_replay) else int(a_replay)
        r = residuals.reserved_from_allocated(a, coeffs) if pd.isna(r_replay) else int(r_replay)
        alloc.append(a)
        reserved.append(r)
        device.append(residuals.device_from_reserved(r, coeffs, int(n_comm)))
    return pd.DataFrame({"pred_allocated_bytes": alloc, "pred_reserved_bytes": reserved,
                         "pred_device_bytes": device}, index=terms.index)
