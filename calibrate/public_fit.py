"""``python -m calibrate public --fit``: the residual terms that published measurements identify, per GPU key.

Only two kinds of rows pin a residual term; the others (``max_allocated``) say nothing about it:

* ``max_reserved`` rows pin the allocator residual, ``reserved = allocated x (1 + ratio) + bytes``: the
  estimator's own peak allocated is the input, the published reserved peak the target;
* ``nvml_used`` rows would pin the CUDA context (and non-PyTorch memory) above reserved.

Each term is fitted per GPU key and judged by cross-validation that leaves one *source* out: the term fitted
on the other sources predicts the held-out source's rows. A term is kept only when the key has rows from at
least ``MIN_SOURCES`` sources and its leave-one-source-out median |error| beats the prior's on the same rows;
otherwise the prior stays (and the report says why). Accepted terms are written as a coefficient file in the
estimator's schema (``estimator/hardware/residuals.py``) with the provenance: data sha256, sources, rows, CV errors and
the valid range of the rows that fitted it.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
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
    allocated_bytes: float
    measured_bytes: float
    row: dict


@dataclass
class KeyFit:
    gpu_key: str
    term: str
    points: list[Point]
    prior: tuple[float, float]
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
    """Estimable ``max_reserved`` rows, per GPU key, as (estimator allocated, published reserved) pairs."""
    out: dict[str, list[Point]] = {}
    for s in scored:
        if s.error or s.row["quantity"] != "max_reserved" or s.allocated_bytes is None:
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


def abs_pct(points: list[Point], terms: tuple[float, float]) -> list[float]:
    return [abs(predict(p, terms) - p.measured_bytes) / p.measured_bytes * 100.0 for p in points]


def judge(gpu_key: str, points: list[Point], prior: tuple[float, float]) -> KeyFit:
    """Leave-one-source-out: fit on the other sources, score the held-out one; compare with the prior."""
    fit = KeyFit(gpu_key=gpu_key, term="allocator residual (reserved_slack_ratio, reserved_slack_bytes)",
                 points=points, prior=prior)
    sources = fit.sources
    if len(sources) < MIN_SOURCES:
        fit.refused = (f"{len(points)} row(s) from {len(sources)} source ({', '.join(sources)}): leave-one-source-out "
                       f"needs {MIN_SOURCES} sources; prior kept")
        return fit
    held_out, prior_errors = [], []
    for source in sources:
        train = [p for p in points if p.source != source]
        test = [p for p in points if p.source == source]
        terms = fit_slack(train)
        errors = abs_pct(test, terms)
        held_out += errors
        prior_errors += abs_pct(test, prior)
        fit.per_source[source] = {"rows": len(test), "fitted_on_others": [round(terms[0], 4), int(terms[1])],
                                  "loso_median_abs_pct": round(float(np.median(errors)), 2),
                                  "prior_median_abs_pct": round(float(np.median(abs_pct(test, prior))), 2)}
    fit.loso_median_pct = round(float(np.median(held_out)), 2)
    fit.prior_median_pct = round(float(np.median(prior_errors)), 2)
    fit.fitted = fit_slack(points)
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


def fit_all(scored: list[Scored]) -> list[KeyFit]:
    out = []
    for key, points in sorted(reserved_points(scored).items()):
        prior = load_coefficients(key)
        out.append(judge(key, points, (prior.reserved_slack_ratio, float(prior.reserved_slack_bytes))))
    return out


def _valid_range(points: list[Point]) -> dict:
    def span(column: str) -> list[int]:
        values = [int(p.row[column]) for p in points]
        return [min(values), max(values)]

    def seen(column: str) -> list[str]:
        return sorted({str(p.row[column]) for p in points})

    return {"world_size": span("world_size"), "micro_batch_size": span("micro_batch_size"),
            "seq_len": span("seq_len"), "lora_rank": span("lora_rank"), "methods": seen("method"),
            "precisions": seen("precision"), "optimizers": seen("optimizer"), "attn": seen("attn")}


def coefficient_document(fit: KeyFit, data: Path) -> dict:
    """The prior file of the key with the fitted allocator terms and the fit's provenance."""
    prior = load_coefficients(fit.gpu_key)
    doc = json.loads(Path(prior.path).read_text()) if Path(prior.path).is_file() else None
    if doc is None:
        from importlib import resources

        doc = json.loads((resources.files("estimator") / "coefficients" / f"{fit.gpu_key}.json").read_text())
    ratio, offset = fit.fitted
    doc.update({"schema_version": SCHEMA_VERSION, "calibrated": True, "source": "public_fit",
                "description": f"{fit.gpu_key}: allocator residual fitted on published measurements "
                               f"(python -m calibrate public --fit); the other terms are the documented priors."})
    doc["terms"]["reserved_slack_ratio"] = round(ratio, 6)
    doc["terms"]["reserved_slack_bytes"] = int(round(offset))
    doc["notes"]["reserved_slack_ratio"] = (f"Fitted on {len(fit.points)} published max_reserved rows "
                                            f"({', '.join(fit.sources)}); see provenance.")
    doc["notes"]["reserved_slack_bytes"] = doc["notes"]["reserved_slack_ratio"]
    doc["valid_range"] = _valid_range(fit.points)
    doc["provenance"] = {
        "kind": PROVENANCE_KIND, "written": _dt.date.today().isoformat(),
        "command": "python -m calibrate public --fit", "data": str(data),
        "data_sha256": hashlib.sha256(Path(data).read_bytes()).hexdigest(), "rows": len(fit.points),
        "sources": fit.sources, "row_ids": sorted(p.row["row_id"] for p in fit.points),
        "cv": {"scheme": "leave one source out", "loso_median_abs_pct": fit.loso_median_pct,
               "prior_median_abs_pct": fit.prior_median_pct, "per_source": fit.per_source},
        "prior_terms": {"reserved_slack_ratio": fit.prior[0], "reserved_slack_bytes": int(fit.prior[1])}}
    return doc


def write_accepted(fits: list[KeyFit], data: Path, out_dir: Path) -> list[Path]:
    written = []
    for fit in fits:
        if fit.accepted:
            path = Path(out_dir) / f"{fit.gpu_key}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(coefficient_document(fit, data), indent=2) + "\n")
            written.append(path)
    return written


def report_lines(fits: list[KeyFit], written: list[Path]) -> list[str]:
    lines = ["## Fit: residual terms the published rows identify", "",
             "`python -m calibrate public --fit`. `max_reserved` rows pin the allocator residual (reserved = "
             "allocated x (1 + ratio) + bytes, from the estimator's own allocated peak); no source publishes "
             "`nvml_used`, so the CUDA context keeps its prior on every key. A term ships only when its "
             "leave-one-source-out median |error| beats the prior's on the same rows.", "",
             "| GPU key | rows | sources | prior (ratio, MiB) | fitted on all (ratio, MiB) | LOSO median % | "
             "prior median % | verdict |", "|---|---|---|---|---|---|---|---|"]
    for fit in fits:
        fitted = f"{fit.fitted[0]:.3f}, {fit.fitted[1] / 2**20:.0f}" if fit.fitted else "–"
        verdict = "shipped" if fit.accepted else f"refused: {fit.refused}"
        loso = "–" if fit.loso_median_pct is None else f"{fit.loso_median_pct:.2f}"
        prior = "–" if fit.prior_median_pct is None else f"{fit.prior_median_pct:.2f}"
        lines.append(f"| {fit.gpu_key} | {len(fit.points)} | {', '.join(fit.sources)} | {fit.prior[0]:.3f}, "
                     f"{fit.prior[1] / 2**20:.0f} | {fitted} | {loso} | {prior} | {verdict} |")
    lines.append("")
    for fit in fits:
        for source, block in fit.per_source.items():
            lines.append(f"- {fit.gpu_key}, held out `{source}` ({block['rows']} rows): fitted on the others "
                         f"ratio {block['fitted_on_others'][0]}, bytes {block['fitted_on_others'][1]:,}; |error| "
                         f"median {block['loso_median_abs_pct']} % vs the prior's {block['prior_median_abs_pct']} %")
    lines += ["", f"Coefficient files written: {', '.join(str(p) for p in written) or 'none'}.", ""]
    return lines
