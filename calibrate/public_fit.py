"""``python -m calibrate public --fit``: the residual terms that published measurements identify, per GPU key.

Only two kinds of rows pin a residual term; the others (``max_allocated``) say nothing about it:

* ``max_reserved`` rows pin the allocator residual, ``reserved = allocated x (1 + ratio) + bytes``: the
  estimator's own peak allocated is the input, the published reserved peak the target (rows whose reserved level
  the estimator replays through the caching-allocator model are left out: the formula never applies there);
* ``nvml_used`` rows pin the CUDA context (and non-PyTorch memory), what the device level holds beyond the
  estimator's reserved level and NCCL buffers: the estimate less its prior context is the input, the published
  device level the target.

Each term is fitted per GPU key and judged by cross-validation that leaves one *source* out: the term fitted
on the other sources predicts the held-out source's rows. A term is kept only when the key has rows from at
least ``MIN_SOURCES`` sources and its leave-one-source-out median |error| beats the prior's on the same rows
(and no held-out source gets worse); otherwise the prior stays (and the report says why). Accepted terms are
written as a coefficient file in the estimator's schema (``estimator/hardware/residuals.py``) with the
provenance: data sha256, sources, rows, CV errors and the valid range of the rows that fitted it.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from calibrate.public import Scored
from estimator.hardware.residuals import SCHEMA_VERSION, load_coefficients

MIN_SOURCES = 2
PROVENANCE_KIND = "published measurements"


@dataclass
class Point:
    source: str
    allocated_bytes: float  # the term's input: the estimator's allocated peak, or its device level less the context
    measured_bytes: float
    row: dict


@dataclass(frozen=True)
class Term:
    """A residual term a quantity identifies: its coefficient keys, fit (points -> values) and prediction."""
    name: str
    quantity: str
    keys: tuple[str, ...]
    fit: Callable[[list[Point]], tuple]
    predict: Callable[[Point, tuple], float]


@dataclass
class KeyFit:
    gpu_key: str
    term: str
    points: list[Point]
    prior: tuple
    fitted: tuple[float, float] | None = None
    loso_median_pct: float | None = None
    prior_median_pct: float | None = None
    per_source: dict[str, dict] = field(default_factory=dict)
    refused: str = ""

    @property
    def accepted(self) -> bool:
        return self.fitted is not None and not self.refused

    @property
    def sources(self) -> list[str]:
        return sorted({p.source for p in self.points})


def reserved_points(scored: list[Scored]) -> dict[str, list[Point]]:
    """Estimable ``max_reserved`` rows the estimator does not replay, per GPU key, as (estimator allocated,
    published reserved) pairs."""
    out: dict[str, list[Point]] = {}
    for s in scored:
        if s.error or s.row["quantity"] != "max_reserved" or s.allocated_bytes is None:
            continue
        if s.reserved_source == "replayed":  # the estimator replays this one: the formula never applies there
            continue
        out.setdefault(s.row["gpu"], []).append(Point(s.row["source"], s.allocated_bytes, s.measured_bytes, s.row))
    return out


def fit_slack(points: list[Point]) -> tuple[float, float]:
    """Least squares on relative error of ``a x (1 + ratio) + bytes = m``, both terms >= 0.

    With one distinct allocated value (or one row) only a ratio is identifiable: the bytes stay 0."""
    a = np.array([p.allocated_bytes for p in points])
    m = np.array([p.measured_bytes for p in points])
    w = 1.0 / m
    design = np.column_stack([a * w, w])
    target = (m - a) * w
    if len(points) >= 2 and np.ptp(a) > 0:
        ratio, offset = np.linalg.lstsq(design, target, rcond=None)[0]
        if ratio >= 0 and offset >= 0:
            return float(ratio), float(offset)
        if offset < 0:  # bytes clipped at 0: refit the ratio alone
            ratio = float(np.sum(design[:, 0] * target) / np.sum(design[:, 0] ** 2))
            return max(ratio, 0.0), 0.0
        offset = float(np.sum(design[:, 1] * target) / np.sum(design[:, 1] ** 2))  # ratio clipped at 0
        return 0.0, max(offset, 0.0)
    ratio = float(np.sum(design[:, 0] * target) / np.sum(design[:, 0] ** 2))
    return max(ratio, 0.0), 0.0


def predict(point: Point, terms: tuple[float, float]) -> float:
    return math.ceil(point.allocated_bytes * (1.0 + terms[0])) + terms[1]


def fit_context(points: list[Point]) -> tuple[float]:
    """Least squares on relative error of ``base + context = m``, context >= 0 (one constant per key)."""
    m = np.array([p.measured_bytes for p in points])
    base = np.array([p.allocated_bytes for p in points])
    return (max(float(np.sum((m - base) / m**2) / np.sum(1.0 / m**2)), 0.0),)


def predict_context(point: Point, terms: tuple[float]) -> float:
    return point.allocated_bytes + terms[0]


SLACK = Term("allocator residual (reserved_slack_ratio, reserved_slack_bytes)", "max_reserved",
             ("reserved_slack_ratio", "reserved_slack_bytes"), fit_slack, predict)
CONTEXT = Term("CUDA context and non-PyTorch memory (cuda_context_bytes)", "nvml_used", ("cuda_context_bytes",),
               fit_context, predict_context)


def abs_pct(points: list[Point], terms: tuple, term: Term = SLACK) -> list[float]:
    return [abs(term.predict(p, terms) - p.measured_bytes) / p.measured_bytes * 100.0 for p in points]


def judge(gpu_key: str, points: list[Point], prior: tuple, term: Term = SLACK) -> KeyFit:
    """Leave-one-source-out: fit on the other sources, score the held-out one; compare with the prior."""
    fit = KeyFit(gpu_key=gpu_key, term=term.name, points=points, prior=prior)
    fit.fitted = term.fit(points)  # shown in the report even where it cannot be judged (and ships only if judged)
    sources = fit.sources
    if len(sources) < MIN_SOURCES:
        fit.refused = (f"{len(points)} row(s) from {len(sources)} source ({', '.join(sources)}): leave-one-source-out "
                       f"needs {MIN_SOURCES} sources; prior kept")
        return fit
    held_out, prior_errors = [], []
    for source in sources:
        train = [p for p in points if p.source != source]
        test = [p for p in points if p.source == source]
        terms = term.fit(train)
        errors = abs_pct(test, terms, term)
        held_out += errors
        prior_errors += abs_pct(test, prior, term)
        fit.per_source[source] = {"rows": len(test), "fitted_on_others": [_rounded(v) for v in terms],
                                  "loso_median_abs_pct": round(float(np.median(errors)), 2),
                                  "prior_median_abs_pct": round(float(np.median(abs_pct(test, prior, term))), 2)}
    fit.loso_median_pct = round(float(np.median(held_out)), 2)
    fit.prior_median_pct = round(float(np.median(prior_errors)), 2)
    fit.fitted = term.fit(points)
    worse = [s for s, block in fit.per_source.items()
             if block["loso_median_abs_pct"] > block["prior_median_abs_pct"]]
    if fit.loso_median_pct >= fit.prior_median_pct:
        fit.refused = (f"leave-one-source-out median |error| {fit.loso_median_pct:.2f} % is not better than the "
                       f"prior's {fit.prior_median_pct:.2f} % on the same rows; prior kept")
    elif worse:  # pooled medians let a source with many rows outvote one the fit makes worse
        fit.refused = (f"held out, {', '.join(worse)} is predicted worse than by the prior (median |error| "
                       + ", ".join(f"{fit.per_source[s]['loso_median_abs_pct']:.2f} % vs "
                                   f"{fit.per_source[s]['prior_median_abs_pct']:.2f} %" for s in worse)
                       + "); prior kept")
    return fit


def _rounded(value: float) -> float | int:
    """A ratio to 4 places, a byte count to the byte."""
    return round(value, 4) if abs(value) < 16 else int(value)


def context_points(scored: list[Scored]) -> dict[str, list[Point]]:
    """Estimable ``nvml_used`` rows, per GPU key, as (estimate less its prior CUDA context, published) pairs."""
    out: dict[str, list[Point]] = {}
    for s in scored:
        if s.error or s.row["quantity"] != "nvml_used" or s.predicted_bytes is None:
            continue
        context = load_coefficients(s.row["gpu"]).cuda_context_bytes
        out.setdefault(s.row["gpu"], []).append(Point(s.row["source"], s.predicted_bytes - context,
                                                      s.measured_bytes, s.row))
    return out


def fit_all(scored: list[Scored]) -> list[KeyFit]:
    out = []
    for key, points in sorted(reserved_points(scored).items()):
        prior = load_coefficients(key)
        out.append(judge(key, points, (prior.reserved_slack_ratio, float(prior.reserved_slack_bytes))))
    for key, points in sorted(context_points(scored).items()):
        out.append(judge(key, points, (float(load_coefficients(key).cuda_context_bytes),), CONTEXT))
    return out


def _term_of(fit: KeyFit) -> Term:
    return next(t for t in (SLACK, CONTEXT) if t.name == fit.term)


def _valid_range(points: list[Point]) -> dict:
    def span(column: str) -> list[int]:
        values = [int(p.row[column]) for p in points]
        return [min(values), max(values)]

    def seen(column: str) -> list[str]:
        return sorted({str(p.row[column]) for p in points})

    return {"world_size": span("world_size"), "micro_batch_size": span("micro_batch_size"),
            "seq_len": span("seq_len"), "lora_rank": span("lora_rank"), "methods": seen("method"),
            "precisions": seen("precision"), "optimizers": seen("optimizer"), "attn": seen("attn")}


def coefficient_document(fits: list[KeyFit], data: Path) -> dict:
    """The prior file of the fits' GPU key with each accepted term fitted, and the fits' provenance."""
    gpu_key = fits[0].gpu_key
    prior = load_coefficients(gpu_key)
    doc = json.loads(Path(prior.path).read_text()) if Path(prior.path).is_file() else None
    if doc is None:
        from importlib import resources

        doc = json.loads((resources.files("estimator") / "coefficients" / f"{gpu_key}.json").read_text())
    names = ", ".join(f.term for f in fits)
    doc.update({"schema_version": SCHEMA_VERSION, "calibrated": True, "source": "public_fit",
                "description": f"{gpu_key}: {names} fitted on published measurements "
                               "(python -m calibrate public --fit); the other terms are the documented priors."})
    points = [p for f in fits for p in f.points]
    for fit in fits:
        term = _term_of(fit)
        for key, value in zip(term.keys, fit.fitted, strict=True):
            doc["terms"][key] = round(value, 6) if key.endswith("_ratio") else int(round(value))
            doc["notes"][key] = (f"Fitted on {len(fit.points)} published {term.quantity} rows "
                                 f"({', '.join(fit.sources)}); see provenance.")
    doc["valid_range"] = _valid_range(points)
    doc["provenance"] = {
        "kind": PROVENANCE_KIND, "written": _dt.date.today().isoformat(),
        "command": "python -m calibrate public --fit", "data": str(data),
        "data_sha256": hashlib.sha256(Path(data).read_bytes()).hexdigest(), "rows": len(points),
        "sources": sorted({p.source for p in points}), "row_ids": sorted(p.row["row_id"] for p in points),
        "cv": {"scheme": "leave one source out",
               "terms": {f.term: {"loso_median_abs_pct": f.loso_median_pct, "prior_median_abs_pct": f.prior_median_pct,
                                  "per_source": f.per_source,
                                  "prior": dict(zip(_term_of(f).keys, f.prior, strict=True))} for f in fits}}}
    return doc


def write_accepted(fits: list[KeyFit], data: Path, out_dir: Path) -> list[Path]:
    """One coefficient file per GPU key with an accepted term (every accepted term of the key in it)."""
    by_key: dict[str, list[KeyFit]] = {}
    for fit in fits:
        if fit.accepted:
            by_key.setdefault(fit.gpu_key, []).append(fit)
    written = []
    for key, accepted in sorted(by_key.items()):
        path = Path(out_dir) / f"{key}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(coefficient_document(accepted, data), indent=2) + "\n")
        written.append(path)
    return written


def report_lines(fits: list[KeyFit], written: list[Path]) -> list[str]:
    lines = ["## Fit: residual terms the published rows identify", "",
             "`python -m calibrate public --fit`. `max_reserved` rows pin the allocator residual (reserved = "
             "allocated x (1 + ratio) + bytes, from the estimator's own allocated peak); `nvml_used` rows pin the "
             "CUDA context (the device level beyond the estimator's reserved level and NCCL buffers). A term ships "
             "only when its leave-one-source-out median |error| beats the prior's on the same rows and no held-out "
             "source gets worse.", "",
             "| GPU key | term | rows | sources | prior (ratio, MiB) | fitted on all (ratio, MiB) | LOSO median % | "
             "prior median % | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for fit in fits:
        keys = _term_of(fit).keys
        fitted = _show(fit.fitted, keys) if fit.fitted else "–"
        verdict = "shipped" if fit.accepted else f"refused: {fit.refused}"
        loso = "–" if fit.loso_median_pct is None else f"{fit.loso_median_pct:.2f}"
        prior = "–" if fit.prior_median_pct is None else f"{fit.prior_median_pct:.2f}"
        lines.append(f"| {fit.gpu_key} | {', '.join(_term_of(fit).keys)} | {len(fit.points)} | "
                     f"{', '.join(fit.sources)} | {_show(fit.prior, keys)} | {fitted} | {loso} | {prior} | {verdict} |")
    lines.append("")
    for fit in fits:
        for source, block in fit.per_source.items():
            lines.append(f"- {fit.gpu_key} {', '.join(_term_of(fit).keys)}, held out `{source}` ({block['rows']} "
                         f"rows): fitted on the others {_show(block['fitted_on_others'], _term_of(fit).keys)}; |error| median "
                         f"{block['loso_median_abs_pct']} % vs the prior's {block['prior_median_abs_pct']} %")
    lines += ["", f"Coefficient files written: {', '.join(str(p) for p in written) or 'none'}.", ""]
    return lines


def _show(values, keys: tuple[str, ...]) -> str:
    """Ratios to 3 places, byte counts in MiB."""
    return ", ".join(f"{v:.3f}" if key.endswith("_ratio") else f"{v / 2**20:.0f}"
                     for v, key in zip(values, keys, strict=True))
