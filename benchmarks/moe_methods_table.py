"""Mixture-of-experts under every method the harness runs on CPU, each rank against the estimate (issue 17).

    PYTHONPATH=. .venv/bin/python benchmarks/moe_methods_table.py [--configs CONFIG.json ...]
        [--methods ddp zero1 zero2 zero3 fsdp fsdp1 lora-attn lora-all-linear lora-experts lora-experts-ckpt
                   lora-attn-every2 lora-experts-every2]
        [--world 2]
        [--points 1x64 2x128] [--precisions bf16 mixed_bf16] [--csv docs/error_matrix/moe_methods.csv]
    PYTHONPATH=. .venv/bin/python benchmarks/moe_methods_table.py --rescore docs/error_matrix/moe_methods.csv

Each point is a real harness run (``backend=cpu``, ``memory_source counted-cpu``; multi-rank methods emulate ranks
0 and N-1 on torch's fake process group), scored as ``zero_cpu_check.compare`` scores ZeRO: each rank's measured
peak against that rank's ``traced_allocated_bytes`` (the estimate less the cuBLAS workspace a CPU run has not).
The routers are left as trained (random init), not forced: moe_routing.csv shows the estimate is the same for any
routing. ZeRO runs with ``--buckets small`` by default (``zero_cpu_check``'s 1e5-element buckets). ``lora-*`` are
single-rank LoRA runs (rank 8) with the adapters on the attention projections (``q_proj,k_proj,v_proj,o_proj``), on
every linear layer (``all-linear``: attention, routers, dense and shared MLPs) and on the experts' projections by
name (``gate_proj,up_proj,down_proj``; Mixtral ``w1,w2,w3``); a ``-ckpt`` suffix (``lora-experts-ckpt``) adds
gradient checkpointing, ``-everyK`` (``lora-attn-every2``) every-k:K checkpointing (layers K-1, 2K-1, ...), a
``METHOD+`` prefix (``zero3+lora-experts``) runs it under that multi-rank method.
Transformers' fused experts hold parameters, not
Linear modules: peft turns these names into ``target_parameters`` on the fused experts where it knows the family's
conversion, and matches dense or shared-expert MLPs by name where the model has such modules. A point the harness
cannot run, or the estimator cannot estimate, is a row whose ``result`` says so, not a crash.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.table_csv import read_rows, write_rows
from benchmarks.zero_cpu_check import compare, estimate_ranks, measured_phase, point_spec, run_point

HERE = Path(__file__).resolve().parent
CONFIGS = [HERE / "configs" / f"{name}_tiny.json" for name in ("qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v2")]
ATTENTION = "q_proj,k_proj,v_proj,o_proj"
LORA_TARGETS = {"lora-attn": ATTENTION, "lora-all-linear": "all-linear", "lora-experts": "gate_proj,up_proj,down_proj"}
# the experts' projections by their per-expert names, which peft (>= 0.18, transformers 5) turns into
# target_parameters on the fused experts' gate_up_proj / down_proj where the family converts them
EXPERT_PROJECTIONS = {"mixtral": "w1,w2,w3"}
LORA_RANK = 8
CKPT = "-ckpt"  # a LoRA method's suffix: with gradient checkpointing
EVERY_K = re.compile(r"-every(\d+)$")  # a LoRA method's suffix: every-k:K checkpointing (``lora-attn-every2``)


def harness_method(method: str, world: int, family: str) -> tuple[str, int, list[str]]:
    """The harness's method, world size and extra overrides of a table method (``lora-*-ckpt``: the LoRA method
    with gradient checkpointing; ``METHOD+lora-*``: that LoRA under a multi-rank method, e.g. ``zero3+lora-experts``)."""
    parallel, _, lora_method = method.rpartition("+")
    lora, ckpt = lora_method.removesuffix(CKPT), ["training.grad_ckpt=true"] if lora_method.endswith(CKPT) else []
    if every := EVERY_K.search(lora_method):
        lora = lora_method[:every.start()]
        ckpt = ["training.grad_ckpt=true", f"training.ckpt_policy='every-k:{every.group(1)}'"]
    if lora in LORA_TARGETS:  # hydra splits on commas outside quotes
        targets = EXPERT_PROJECTIONS.get(family, LORA_TARGETS[lora]) if lora == "lora-experts" \
            else LORA_TARGETS[lora]
        return parallel or "single", world if parallel else 1, [
            f"training.lora_rank={LORA_RANK}", f"training.lora_targets='{targets}'", *ckpt]
    return method, world, []


def error_line(exc: Exception) -> str:
    """The most specific line of a failed run's output: the exception's own line, not the harness's summary."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"[\w.]*(Error|Exception)\b", line)]
    return (raised or lines or [repr(exc)])[-1][:300]


def measured_peaks(run_dir: Path) -> list[tuple[int, int, str]]:
    """Each measured rank's peak allocated bytes and the phase that reached it, read from the run's records."""
    records = [json.loads(path.read_text()) for path in sorted(run_dir.glob("rank*.json"))]
    return [(rec["rank"], rec["peak_allocated_bytes"], measured_phase(rec)) for rec in records]


def point_rows(path: Path, method: str, world: int, precision: str, b: int, s: int, buckets: str,
               results: Path) -> list[dict]:
    """One point's rows: one per measured rank, or one error row."""
    name, ranks, extra = harness_method(method, world, json.loads(path.read_text())["model_type"])
    base = {"config": path.name, "method": method, "world": ranks, "precision": precision,
            "micro_batch_size": b, "seq_len": s,
            "buckets": buckets if name.startswith("zero") else ""}
    try:
        run_dir = run_point("custom", name, ranks, precision, buckets, results, b, s,
                            [f"model.name={path.resolve()}", *extra])
    except RuntimeError as exc:
        return [{**base, "rank": "", "measured_bytes": "", "estimate_bytes": "", "error_pct": "",
                 "result": error_line(exc), "measured_phase": "", "estimated_phase": ""}]
    try:
        scored_ranks = compare(run_dir)
    except Exception as exc:  # noqa: BLE001 - the estimator failing on a point is the row's result
        return [{**base, "rank": rank, "measured_bytes": measured, "estimate_bytes": "", "error_pct": "",
                 "result": f"estimate failed: {type(exc).__name__}: {error_line(exc)}", "measured_phase": phase,
                 "estimated_phase": ""} for rank, measured, phase in measured_peaks(run_dir)]
    rows = []
    for scored in scored_ranks:
        mib = 1024**2
        measured, predicted = round(scored["measured_mib"] * mib), round(scored["estimated_mib"] * mib)
        rows.append({**base, "rank": scored["rank"], "measured_bytes": measured, "estimate_bytes": predicted,
                     "error_pct": scored["error_pct"], "result": "ok",
                     "measured_phase": scored["measured_phase"], "estimated_phase": scored["estimated_phase"]})
    return rows


@functools.lru_cache(maxsize=8)
def _point_reports(point: tuple) -> tuple:
    """The estimate's (rank 0, last rank) reports of a point (its rows share one estimate)."""
    reports = estimate_ranks(point_spec(*point), [0, -1])
    return reports[0], reports[-1]


def rescored(row: dict) -> dict:
    """A committed row estimated again by today's estimator (its measurement kept): the point's spec composed as
    the harness composes it, nothing run. A row the harness could not run stays as it is."""
    if not row["measured_bytes"]:
        return row
    path = HERE / "configs" / row["config"]
    name, ranks, extra = harness_method(row["method"], int(row["world"]), json.loads(path.read_text())["model_type"])
    point = ("custom", name, ranks, row["precision"], row["buckets"] or "small", Path("/tmp/moe_methods"),
             int(row["micro_batch_size"]), int(row["seq_len"]), (f"model.name={path.resolve()}", *extra))
    try:
        mine = _point_reports(point)[0 if int(row["rank"]) == 0 else 1]
    except Exception as exc:  # noqa: BLE001 - the estimator failing on a point is the row's result
        return {**row, "estimate_bytes": "", "error_pct": "", "estimated_phase": "",
                "result": f"estimate failed: {type(exc).__name__}: {error_line(exc)}"}
    measured, predicted = int(row["measured_bytes"]), mine.traced_allocated_bytes
    return {**row, "estimate_bytes": predicted, "error_pct": round(100 * (predicted - measured) / measured, 2),
            "result": "ok", "estimated_phase": mine.phase}


def point_key(row: dict) -> tuple[str, ...]:
    return tuple(str(row[k]) for k in ("config", "method", "precision", "micro_batch_size", "seq_len"))


def kept_rows(path: Path, new_rows: list[dict]) -> list[dict]:
    """The CSV's rows for points this run did not measure again."""
    replaced = {point_key(row) for row in new_rows}
    return [row for row in read_rows(path) if point_key(row) not in replaced]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", type=Path, default=CONFIGS)
    parser.add_argument("--methods", nargs="*",
                        default=["ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp1", *LORA_TARGETS])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--points", nargs="*", default=["1x64"])
    parser.add_argument("--precisions", nargs="*", default=["bf16"])
    # small: every ZeRO bucket 1e5 elements, so the tiny models span several buckets as real models do with the
    # defaults (default buckets of 5e8 elements would make a 1 GB ZeRO row of buffers, the experts a rounding error)
    parser.add_argument("--buckets", default="small", choices=("default", "small"))
    parser.add_argument("--csv", type=Path, default=None)
    parser.add_argument("--append", action="store_true",
                        help="keep the CSV's rows of other (config, method, precision, point)s, replace the rest")
    parser.add_argument("--rescore", type=Path, default=None, metavar="CSV",
                        help="estimate a committed table's rows again (measurements kept, nothing run) and rewrite it")
    args = parser.parse_args(argv)
    rows: list[dict] = []
    started = time.perf_counter()
    if args.rescore:
        rows = [rescored(row) for row in read_rows(args.rescore)]
        for row in rows:
            print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        args.csv, args.append = args.rescore, False
    with tempfile.TemporaryDirectory(prefix="moe_methods-") as tmp:
        for path in [] if args.rescore else args.configs:
            for precision in args.precisions:
                for point in args.points:
                    b, s = (int(x) for x in point.split("x"))
                    for method in args.methods:
                        for row in point_rows(path, method, args.world, precision, b, s, args.buckets,
                                              Path(tmp)):
                            rows.append(row)
                            print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    scored = sorted(abs(float(r["error_pct"])) for r in rows if r["result"] == "ok")
    if scored:
        print(f"rows {len(rows)}  scored {len(scored)}  median |error| {scored[len(scored) // 2]:.2f} %  "
              f"max {scored[-1]:.2f} %  elapsed {time.perf_counter() - started:.0f} s")
    if args.csv and rows:
        write_rows(args.csv, (kept_rows(args.csv, rows) if args.append and args.csv.exists() else []) + rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
