"""``python -m calibrate report``: the estimator's error against every measurement, as markdown + CSV + PNG.

Sections: (1) the paper's Table 2 (single GPU, the largest batch that ran under a cap) with the published
baselines beside ours; (2) Figures 8-9 (error per model, per method and world size); (3) Table 3 (the
planner's method vs the measured fastest); (4) predicted vs measured, error distribution, and the three
levels (allocated, reserved, device). Every row says where it came from: a real multi-GPU run, a real single
GPU, emulated ranks (one GPU, fake process group: no NCCL buffers), or the CPU fake-tensor oracle.
With no measurements it still writes a report, saying so.
"""

from __future__ import annotations

import datetime as _dt
import math
import time
from pathlib import Path

import numpy as np
import pandas as pd

from calibrate import data as D
from calibrate.export import git_state
from calibrate.fit import LEVELS, level_metrics
from calibrate.terms import analytic_terms, predict, replayed_levels
from estimator.columns import measured_spec_from_columns
from estimator.hardware.residuals import Coefficients, load_coefficients

GIB = 1024**3
SOURCES = {"real_multi": "real multi-GPU run", "real_single": "real single GPU", "emulated": "emulated ranks",
           "fake": "CPU fake-tensor oracle"}
REGENERATE = [
    "python -m harness -m experiment=paper_table2        # measure on a GPU machine (docs/harness.md); also",
    "python -m harness -m experiment=paper_fig8_adp       # paper_fig9_tp, paper_fig9_dptp, paper_table3",
    "python -m calibrate fit                              # fit estimator/coefficients/<gpu>.json",
    "python -m calibrate report                           # this report",
]
BASELINES = ("llmem", "deepspeed", "accelerate", "rule_of_thumb")
MAX_BATCH_SEARCH = 512   # largest micro-batch searched for Table 2's predicted maxima (shown as ">=512")


# --- rows, predictions, sources ------------------------------------------------------------------------------
def source_of(row: pd.Series) -> str:
    if row["measured_by"] == "fake_tensor_trace" or row["memory_source"] == "fake_tensor_trace":
        return "fake"
    if bool(row["emulated"]) or row["measured_by"] == "emulated_fake_pg":
        return "emulated"
    return "real_multi" if int(row["world_size"]) > 1 else "real_single"


def coefficients_for(key: str, directory: Path | None) -> Coefficients:
    """``directory/<key>.json`` when given and present, else the estimator's shipped file for ``key``."""
    if directory is not None and (Path(directory) / f"{key}.json").is_file():
        return load_coefficients(key, Path(directory) / f"{key}.json")
    return load_coefficients(key)


def predicted_rows(rows: pd.DataFrame, coefficients_dir: Path | None, allow_build: bool
                   ) -> tuple[pd.DataFrame, dict[str, Coefficients]]:
    """Rows that carry a spec, joined with the estimator's terms, predictions, signed % errors and source.
    Fake-tensor rows are compared at the allocated level with the analytical bytes (no GPU, no workspace)."""
    rows = rows[rows["rank"] != -1].copy()
    rows = rows.join(analytic_terms(rows, allow_build=allow_build))
    rows["source"] = [source_of(r) for _, r in rows.iterrows()]
    used: dict[str, Coefficients] = {}
    parts = []
    for key, group in rows.groupby("gpu_key"):
        if key in D.NON_GPU_KEYS:
            pred = pd.DataFrame({"pred_allocated_bytes": group["analytic_allocated_bytes"],
                                 "pred_reserved_bytes": np.nan, "pred_device_bytes": np.nan}, index=group.index)
        else:
            used[key] = coefficients_for(str(key), coefficients_dir)
            levels = replayed_levels(group, used[key], allow_build=allow_build)
            pred = predict(group.join(levels), group["emulated"], used[key]).join(levels[["reserved_source"]])
        parts.append(pred)
    rows = rows.join(pd.concat(parts)) if parts else rows
    rows["reserved_source"] = rows["reserved_source"].fillna("") if "reserved_source" in rows else ""
    for level in LEVELS:
        measured = rows[f"peak_{level}_bytes"]
        rows[f"err_{level}_pct"] = (rows[f"pred_{level}_bytes"] - measured) / measured * 100.0
    return rows, used


def _ok(rows: pd.DataFrame) -> pd.DataFrame:
    return rows[(rows["run_status"] == "ok") & (rows["rank_status"] == "ok")
                & rows["analytic_allocated_bytes"].notna()]


def _gib(value: float) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value / GIB:.2f}"


def _pct(value: float) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:+.1f}"


def markdown_table(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "_(no rows)_\n"
    head = "| " + " | ".join(map(str, frame.columns)) + " |"
    rule = "|" + "|".join("---" for _ in frame.columns) + "|"
    body = ["| " + " | ".join(str(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join([head, rule, *body]) + "\n"


# --- (1) Table 2 ---------------------------------------------------------------------------------------------
def _baselines(spec, coeffs: Coefficients | None) -> dict[str, float]:
    """The published estimators' per-GPU totals for one spec (NaN where one does not cover the method)."""
    from estimator.baselines import equations as B
    from estimator.models.params import expand_params
    from estimator.models.profiles import run_adapters_in_16bit
    from estimator.profiler.cache import load_model_profile

    # the profile the estimate has just read (16-bit adapters where the method computes them so), never a build
    arch, profile = load_model_profile(spec.model, spec.training, allow_build=False,
                                       adapters_16bit=run_adapters_in_16bit(spec))
    params = expand_params(profile["params"], arch.num_layers)
    calls = {"llmem": lambda: B.llmem(arch, params, spec, coefficients=coeffs),
             "deepspeed": lambda: B.deepspeed_model_states(params, spec),
             "accelerate": lambda: B.accelerate_estimate(params, spec),
             "rule_of_thumb": lambda: B.rule_of_thumb(params, spec)}
    out = {}
    for name, call in calls.items():
        try:
            out[name] = float(call().total_bytes)
        except ValueError:
            out[name] = math.nan
    return out


def _max_batches(spec, coeffs: Coefficients, capped: bool, capacity: float) -> tuple[str, str]:
    """(ours, LLMem's) largest micro-batch predicted to fit ``capacity``. Under an allocator cap our reserved
    bound is what the cap limits; otherwise the device bound, as ``Estimate.fits``."""
    from estimator.api import estimate
    from estimator.baselines import equations as B
    from estimator.models.params import expand_params
    from estimator.planning.plan import search_max_micro_batch
    from estimator.profiler.cache import load_model_profile

    def bytes_at(b: int) -> int:
        est = estimate(spec.replace(**{"training.micro_batch_size": b}), coeffs, allow_build=False)
        return math.ceil(est.peak_reserved_bytes * coeffs.upper_bound_ratio) if capped else est.upper_bound_bytes

    ours = search_max_micro_batch(bytes_at, int(capacity), cap=MAX_BATCH_SEARCH)
    arch, profile = load_model_profile(spec.model, spec.training, allow_build=False)
    params = expand_params(profile["params"], arch.num_layers)

    def llmem_at(b: int) -> int:
        return B.llmem(arch, params, spec.replace(**{"training.micro_batch_size": b}), coefficients=coeffs).total_bytes

    # LLMem's own bs_search (B.llmem_max_batch) steps bs = 1, 2, ...; its estimate never decreases with bs, so
    # a bracketing search finds the same answer in a handful of calls.
    llmem = search_max_micro_batch(llmem_at, int(capacity), cap=MAX_BATCH_SEARCH)
    return tuple(f">={b}" if b >= MAX_BATCH_SEARCH else str(b) for b in (ours, llmem))


def table2(rows: pd.DataFrame, coeffs: dict[str, Coefficients]) -> pd.DataFrame:
    """Single GPU, real runs: per (GPU, model, sequence, precision, checkpointing, attention, cap) the largest
    micro-batch that ran (and the smallest that ran out of memory), its measured peaks, ours and the
    baselines', each with its % error, and the largest micro-batch we and LLMem predict to fit the cap."""
    from estimator.api import estimate

    runs = rows[rows["analytic_allocated_bytes"].notna() & (rows["method"] == "single")
                & (rows["source"] == "real_single")]
    runs = runs.assign(cap_bytes=runs["memory_cap_bytes"].fillna(runs["device_total_bytes"]))
    single = _ok(runs)
    if single.empty:
        return pd.DataFrame()
    keys = ["gpu_key", "model", "seq_len", "precision", "grad_ckpt", "attn", "cap_bytes"]
    best = single.loc[single.groupby(keys, dropna=False)["micro_batch_size"].idxmax()]
    ooms = runs[runs["run_status"] == "oom"].groupby(keys, dropna=False)["micro_batch_size"].min()
    fake = rows[rows["source"] == "fake"].drop_duplicates("spec_id").set_index("spec_id") \
        if "spec_id" in rows else pd.DataFrame()
    out = []
    for _, row in best.iterrows():
        spec = measured_spec_from_columns(row.to_dict())
        started = time.perf_counter()
        estimate(spec, coeffs[row["gpu_key"]], allow_build=False)
        ours_ms = (time.perf_counter() - started) * 1e3
        measured = float(row["peak_device_bytes"])
        first_oom = ooms.get(tuple(row[k] for k in keys))
        try:
            ours_mb, llmem_mb = _max_batches(spec, coeffs[row["gpu_key"]], not pd.isna(row["memory_cap_bytes"]),
                                             row["cap_bytes"])
        except ValueError:
            ours_mb, llmem_mb = "", ""
        record = {"gpu": row["gpu_key"], "model": row["model"], "seq_len": int(row["seq_len"]),
                  "precision": row["precision"], "grad_ckpt": row["grad_ckpt"], "cap_gib": _gib(row["cap_bytes"]),
                  "max_micro_batch": int(row["micro_batch_size"]),
                  "first_oom_micro_batch": "" if first_oom is None or pd.isna(first_oom) else int(first_oom),
                  "ours_max_micro_batch": ours_mb, "llmem_max_micro_batch": llmem_mb,
                  "measured_reserved_gib": _gib(row["peak_reserved_bytes"]),
                  "ours_reserved_gib": _gib(row["pred_reserved_bytes"]),
                  "measured_gib": _gib(measured), "ours_gib": _gib(row["pred_device_bytes"]),
                  "ours_err_pct": _pct(row["err_device_pct"]), "ours_ms": f"{ours_ms:.1f}"}
        try:
            base = _baselines(spec, coeffs[row["gpu_key"]])
        except ValueError:
            base = dict.fromkeys(BASELINES, math.nan)
        for name in BASELINES:
            record[f"{name}_gib"] = _gib(base[name])
            record[f"{name}_err_pct"] = _pct((base[name] - measured) / measured * 100.0)
        trace = fake.loc[row["spec_id"]] if row.get("spec_id") in fake.index else None
        record["fake_trace_allocated_gib"] = _gib(trace["peak_allocated_bytes"]) if trace is not None else ""
        record["measured_allocated_gib"] = _gib(row["peak_allocated_bytes"])
        record["fake_trace_s"] = (f"{trace['step_time_s']:.1f}" if trace is not None
                                  and not pd.isna(trace["step_time_s"]) else "")
        out.append(record)
    return pd.DataFrame(out)


# --- (2) Figures 8-9 -------------------------------------------------------------------------------------------
def per_run(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per run: the worst rank's measured and predicted device peak (ranks differ under ZeRO-3)."""
    ok = _ok(rows)
    ok = ok[ok["source"] != "fake"]
    if ok.empty:
        return pd.DataFrame()
    worst = ok.loc[ok.groupby("run_id")["peak_device_bytes"].idxmax()]
    pred = ok.groupby("run_id")["pred_device_bytes"].max()
    worst = worst.set_index("run_id").assign(pred_device_bytes=pred)
    worst["err_device_pct"] = (worst["pred_device_bytes"] - worst["peak_device_bytes"]) / worst["peak_device_bytes"] * 100
    return worst.reset_index()


def figures_8_9(runs: pd.DataFrame) -> pd.DataFrame:
    if runs.empty:
        return pd.DataFrame()
    multi = runs[runs["world_size"] > 1]
    cols = ["gpu_key", "method", "world_size", "model", "source", "micro_batch_size", "seq_len", "grad_ckpt",
            "peak_device_bytes", "pred_device_bytes", "err_device_pct"]
    return multi[cols].sort_values(["method", "world_size", "model"]).reset_index(drop=True)


# --- (3) Table 3 ---------------------------------------------------------------------------------------------
def table3(rows: pd.DataFrame, coeffs: dict[str, Coefficients], run_plan: bool) -> pd.DataFrame:
    """Per (GPU, model, world size, sequence, precision) measured with >= 2 methods on real ranks: the measured
    fastest feasible method (job tokens/s = min over ranks x dp) vs the planner's choice among those methods."""
    ok = _ok(rows)
    real = ok[ok["source"].isin(["real_multi", "real_single"]) & ok["tokens_per_s"].notna()]
    if real.empty:
        return pd.DataFrame()
    dp = pd.to_numeric(real["dp"], errors="coerce").fillna(real["world_size"])
    jobs = real.assign(job_tokens_per_s=real["tokens_per_s"] * dp).groupby("run_id").agg(
        gpu_key=("gpu_key", "first"), model=("model", "first"), world_size=("world_size", "first"),
        seq_len=("seq_len", "first"), precision=("precision", "first"), method=("method", "first"),
        grad_ckpt=("grad_ckpt", "first"), micro_batch_size=("micro_batch_size", "first"),
        job_tokens_per_s=("job_tokens_per_s", "min"))
    out = []
    for key, group in jobs.groupby(["gpu_key", "model", "world_size", "seq_len", "precision"]):
        methods = sorted(set(group["method"]))
        if len(methods) < 2:
            continue
        fastest = group.loc[group["job_tokens_per_s"].idxmax()]
        record = {"gpu": key[0], "model": key[1], "world_size": int(key[2]), "seq_len": int(key[3]),
                  "precision": key[4], "methods_measured": ", ".join(methods),
                  "measured_fastest": f"{fastest['method']} (b={int(fastest['micro_batch_size'])}"
                                      f"{', ckpt' if str(fastest['grad_ckpt']) == 'True' else ''})",
                  "measured_tokens_per_s": f"{fastest['job_tokens_per_s']:.0f}"}
        record.update(_plan_choice(key, methods, coeffs.get(key[0]), fastest["method"]) if run_plan
                      else {"plan_choice": "not run (--no-plan)", "agree": ""})
        out.append(record)
    return pd.DataFrame(out)


def _plan_choice(key: tuple, methods: list[str], coeffs: Coefficients | None, fastest: str) -> dict[str, str]:
    from estimator.api import estimate
    from estimator.planning.plan import plan

    gpu, model, world, seq, precision = key
    try:
        result = plan(model, gpus=int(world), gpu=gpu, seq_len=int(seq), precision=precision, methods=methods,
                      advise=False, estimate_fn=lambda spec: estimate(spec, coeffs, allow_build=False))
    except ValueError as err:
        return {"plan_choice": f"n/a ({str(err).splitlines()[0]})", "agree": ""}
    if result.best is None:
        return {"plan_choice": "nothing fits", "agree": "no"}
    best = result.best
    choice = f"{best.candidate.method} (b={best.micro_batch}{', ckpt' if best.candidate.grad_ckpt else ''})"
    return {"plan_choice": choice, "agree": "yes" if best.candidate.method == fastest else "no"}


# --- (4) error summaries and plots -----------------------------------------------------------------------------
def error_summary(rows: pd.DataFrame) -> pd.DataFrame:
    ok = _ok(rows)
    out = []
    for (key, source), group in ok.groupby(["gpu_key", "source"]):
        for level in LEVELS:
            have = group[group[f"peak_{level}_bytes"].notna() & group[f"pred_{level}_bytes"].notna()]
            if have.empty:
                continue
            m = level_metrics(have[f"peak_{level}_bytes"].to_numpy(), have[f"pred_{level}_bytes"].to_numpy())
            out.append({"gpu": key, "source": SOURCES[source], "level": level, "rows": m["n"],
                        "median_abs_pct": f"{m['median_abs_pct']:.2f}", "p95_abs_pct": f"{m['p95_abs_pct']:.2f}",
                        "max_abs_pct": f"{m['max_abs_pct']:.2f}", "worst_under_gib": f"{m['worst_under_gib']:.2f}"})
    return pd.DataFrame(out)


def _plots(rows: pd.DataFrame, fig89: pd.DataFrame, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    ok = _ok(rows)
    gpu_rows = ok[ok["source"] != "fake"]
    if not gpu_rows.empty:
        for by, name in (("method", "scatter_by_method.png"), ("model_family", "scatter_by_family.png")):
            fig, ax = plt.subplots(figsize=(6, 6))
            for value, group in gpu_rows.groupby(by):
                for source, marker in (("real_multi", "o"), ("real_single", "s"), ("emulated", "^")):
                    part = group[group["source"] == source]
                    if not part.empty:
                        ax.scatter(part["peak_device_bytes"] / GIB, part["pred_device_bytes"] / GIB, s=18,
                                   marker=marker, label=f"{value} ({SOURCES[source]})")
            lim = float(max(gpu_rows["peak_device_bytes"].max(), gpu_rows["pred_device_bytes"].max()) / GIB) * 1.05
            ax.plot([0, lim], [0, lim], "k--", lw=0.8)
            ax.set(xlabel="measured device peak (GiB)", ylabel="predicted device peak (GiB)",
                   title=f"predicted vs measured, by {by}")
            ax.legend(fontsize=6)
            fig.tight_layout()
            fig.savefig(out / name, dpi=110)
            plt.close(fig)
            made.append(name)
    if not ok.empty:
        fig, ax = plt.subplots(figsize=(7, 4))
        for source, group in ok.groupby("source"):
            level = "allocated" if source == "fake" else "device"
            values = group[f"err_{level}_pct"].dropna()
            if len(values):
                ax.hist(values, bins=30, alpha=0.6, label=f"{SOURCES[source]} ({level})")
        ax.set(xlabel="signed error (%)", ylabel="rows", title="error distribution")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "error_distribution.png", dpi=110)
        plt.close(fig)
        made.append("error_distribution.png")
        data = [gpu_rows[f"err_{lvl}_pct"].abs().dropna().to_numpy() for lvl in LEVELS]
        if any(len(d) for d in data):
            fig, ax = plt.subplots(figsize=(6, 4))
            ax.boxplot([d if len(d) else [np.nan] for d in data])
            ax.set_xticks(range(1, len(LEVELS) + 1), LEVELS)
            ax.set(ylabel="absolute error (%)", title="allocated vs reserved vs device level")
            fig.tight_layout()
            fig.savefig(out / "levels.png", dpi=110)
            plt.close(fig)
            made.append("levels.png")
    for method, group in fig89.groupby("method") if not fig89.empty else []:
        fig, ax = plt.subplots(figsize=(7, 4))
        models = sorted(set(group["model"]))
        worlds = sorted(set(group["world_size"]))
        width = 0.8 / len(worlds)
        for i, world in enumerate(worlds):
            at_world = group[group["world_size"] == world]
            worst = at_world.groupby("model")["err_device_pct"].apply(lambda s: s.loc[s.abs().idxmax()])
            kinds = " + ".join(sorted({SOURCES[s] for s in at_world["source"]}))
            ax.bar([models.index(m) + i * width for m in worst.index], worst.values, width,
                   label=f"{world} ranks ({kinds})")
        ax.axhline(0, color="k", lw=0.6)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(models))], [m.split("/")[-1] for m in models],
                      rotation=20, fontsize=7)
        ax.set(ylabel="device-level error (%), worst run", title=f"{method}: error per model")
        ax.legend(fontsize=7)
        fig.tight_layout()
        name = f"fig8_9_{method}.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append(name)
    return made


# --- the report ---------------------------------------------------------------------------------------------
def _header(argv: list[str] | None) -> list[str]:
    git = git_state()
    command = "python -m calibrate report " + " ".join(argv or [])
    return ["# Calibration report", "",
            f"Generated {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')} from git "
            f"{git['git_sha'] or 'unknown'}{' (dirty tree)' if git['git_dirty'] else ''} by `{command.strip()}`.", "",
            "Regenerate:", "", "```bash", *REGENERATE, "```", ""]


def _empty_report(out: Path, data: list[Path], argv: list[str] | None) -> Path:
    lines = _header(argv) + [
        "## No measurements yet", "",
        f"No measurement tables were found under {', '.join(f'`{p}`' for p in data)}. Every number the "
        "estimator prints for reserved and device memory is therefore a documented prior "
        "(`estimator/coefficients/*.json`, `\"calibrated\": false`), and no error can be reported yet.", "",
        "Run the harness on a GPU machine (commands above; `docs/harness.md`), commit the tables under "
        "`data/measurements/<gpu-key>/`, then run `python -m calibrate fit` and this report again.", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def build_report(data: list[Path], out: Path, *, coefficients_dir: Path | None = None, allow_build: bool = True,
                 plan: bool = True, argv: list[str] | None = None) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table = D.load(data)
    if table.rows.empty:
        return _empty_report(out, data, argv)
    rows, coeffs = predicted_rows(table.rows, coefficients_dir, allow_build)
    runs = per_run(rows)
    t2, fig89, t3 = table2(rows, coeffs), figures_8_9(runs), table3(rows, coeffs, plan)
    summary = error_summary(rows)
    keep = ["_file", "_line", "run_id", "gpu_key", "rank", "source", "model", "model_family", "method",
            "world_size", "micro_batch_size", "seq_len", "precision", "grad_ckpt", "run_status",
            *[f"peak_{lvl}_bytes" for lvl in LEVELS], *[f"pred_{lvl}_bytes" for lvl in LEVELS],
            *[f"err_{lvl}_pct" for lvl in LEVELS], "reserved_source", "estimate_error"]
    rows[keep].to_csv(out / "rows.csv", index=False)
    for frame, name in ((t2, "table2.csv"), (fig89, "fig8_9.csv"), (t3, "table3.csv"), (summary, "summary.csv")):
        frame.to_csv(out / name, index=False)
    plots = _plots(rows, fig89, out)
    counts = rows["source"].value_counts()
    lines = _header(argv)
    lines += ["## Where the numbers come from", "",
              "| source | rows | what it is |", "|---|---|---|"]
    what = {"real_multi": "torchrun ranks on real GPUs with NCCL: every level measured",
            "real_single": "one real GPU: every level measured",
            "emulated": "one rank of an N-rank job alone on one GPU over a fake process group: allocator memory "
                        "is the real job's, but no NCCL buffers exist (predictions for these rows leave NCCL out)",
            "fake": "CPU fake-tensor trace (harness backend=fake): allocated bytes only, compared with the "
                    "estimator's analytical allocated bytes (no GPU, no cuBLAS workspace)"}
    lines += [f"| {SOURCES[s]} | {int(counts.get(s, 0))} | {what[s]} |" for s in SOURCES] + [""]
    lines += ["Coefficients used: " + ", ".join(
        f"`{c.path}` ({'calibrated fit' if c.calibrated else 'uncalibrated prior'})" for c in coeffs.values())
        if coeffs else "Coefficients used: none (no GPU rows).", ""]
    not_estimable = rows[rows["estimate_error"] != ""]
    if len(not_estimable):
        lines += [f"{len(not_estimable)} rows could not be estimated and are left out "
                  f"(first: {not_estimable.iloc[0]['_file']} line {int(not_estimable.iloc[0]['_line'])}: "
                  f"{not_estimable.iloc[0]['estimate_error']}).", ""]
    lines += ["## Error summary (ok rows)", "", markdown_table(summary),
              "## Table 2: single GPU, the largest batch that ran under the cap", "",
              "`max_micro_batch`: the largest that ran; `first_oom_micro_batch`: the smallest that ran out of "
              "memory; `ours_` / `llmem_max_micro_batch`: the largest each predicts to fit the cap (ours: the "
              "calibrated bound on reserved bytes under an allocator cap, on device bytes otherwise). "
              "Device-level peaks (GiB) and signed % error (positive = over-estimate). Baselines: LLMem's equations, "
              "DeepSpeed's model-state estimator (ZeRO methods only: empty for `single`), accelerate's "
              "`estimate-memory` training figure, and the 8 bytes/parameter rule of thumb. `fake_trace_*`: the "
              "CPU fake-tensor oracle on the same spec (allocated bytes, and its wall time), beside the measured "
              "allocated peak. Real single-GPU runs only.", "", markdown_table(t2),
              "## Figures 8-9: error per model, per method and world size", "",
              "Worst rank of each run, device level. `source` says whether the ranks were real (NCCL) or "
              "emulated.", ""]
    lines += [f"![{p}]({p})" for p in plots if p.startswith("fig8_9_")] + [""]
    lines += [markdown_table(fig89.assign(
        peak_device_gib=fig89["peak_device_bytes"].map(_gib), pred_device_gib=fig89["pred_device_bytes"].map(_gib),
        err_pct=fig89["err_device_pct"].map(_pct), source=fig89["source"].map(SOURCES))[
        ["gpu_key", "method", "world_size", "model", "source", "micro_batch_size", "seq_len", "peak_device_gib",
         "pred_device_gib", "err_pct"]]) if not fig89.empty else "_(no multi-rank rows)_\n"]
    lines += ["## Table 3: method selection", "",
              "Measured fastest feasible method (job tokens/s from real ranks; emulated ranks have no throughput) "
              "vs the planner's choice (`estimator.planning.plan`, restricted to the methods measured).", "",
              markdown_table(t3),
              "## Predicted vs measured", ""]
    lines += [f"![{p}]({p})" for p in plots if not p.startswith("fig8_9_")] + [""]
    lines += ["CSVs: `rows.csv` (every row with its predictions and errors), `summary.csv`, `table2.csv`, "
              "`fig8_9.csv`, `table3.csv`.", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
