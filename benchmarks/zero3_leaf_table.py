"""DeepSpeed ZeRO-3 leaf modules (``zero_optimization.leaf_module``) against the estimate (issue 17).

    PYTHONPATH=. .venv/bin/python benchmarks/zero3_leaf_table.py [--points CONFIG[+lora-experts]:PRECISION:LEAF ...]
        [--csv docs/error_matrix/zero3_leaf_cpu.csv] [--append]
    PYTHONPATH=. .venv/bin/python benchmarks/zero3_leaf_table.py --rescore docs/error_matrix/zero3_leaf_cpu.csv

Each point is a real harness run of a tiny config (``benchmarks/configs/*_tiny.json``) under zero3 on 2 emulated
ranks (``backend=cpu``, the counted-cpu source, ``--buckets small`` as ``zero_cpu_check``), b1 s64, scored as
``zero_cpu_check.compare`` scores ZeRO: each rank's measured peak against its ``traced_allocated_bytes``. LEAF is
``default`` (DeepSpeed 0.19.8's class list: Mixtral's, Qwen2-MoE's and Qwen3-MoE's MoE blocks), ``cleared`` (no
leaf module), ``names=A+B`` (classes cleared, modules A and B named) or ``suffixes=S`` (the default classes and
every module whose name ends with S). The rows also give the measured backward phase's peak, where a leaf module
changes what is held (its gradients wait for its backward), and the estimate's phase. A ``+lora-experts`` suffix on
the config (``qwen3_moe+lora-experts``) runs ``moe_methods_table``'s LoRA on the routed experts under zero3.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.moe_methods_table import harness_method
from benchmarks.table_csv import read_rows, write_rows
from benchmarks.zero_cpu_check import compare, estimate_ranks, point_spec, run_point

HERE = Path(__file__).resolve().parent
DEFAULT_POINTS = ["qwen3_moe:bf16:cleared", "qwen3_moe:bf16:names=model.layers.1.mlp+model.layers.3.mlp",
                  "mixtral:bf16:cleared", "qwen2_moe:bf16:cleared", "deepseek_v2:bf16:suffixes=mlp",
                  "llama_6layer:bf16:suffixes=mlp", "qwen3_moe:bf16:default", "deepseek_v2:bf16:default"]


def leaf_overrides(leaf: str) -> list[str]:
    """The harness overrides of a LEAF label (see the module's doc)."""
    if leaf == "default":
        return []
    if leaf == "cleared":
        return ["+parallel.zero.leaf_classes=[]"]
    kind, _, value = leaf.partition("=")
    quoted = ",".join(json.dumps(v) for v in value.split("+"))
    if kind == "names":
        return ["+parallel.zero.leaf_classes=[]", f"+parallel.zero.leaf_names=[{quoted}]"]
    if kind == "suffixes":
        return [f"+parallel.zero.leaf_name_suffixes=[{quoted}]"]
    raise ValueError(f"leaf: {leaf!r} is not default, cleared, names=A+B or suffixes=S")


def phase_peak(run_dir: Path, rank: int, phase: str) -> int:
    """A rank's peak allocated bytes in one phase of its last steady step."""
    record = json.loads((run_dir / f"rank{rank}.json").read_text())
    steady = [s for s in record["steps"] if not s["warmup"]][-1]
    return max(p["peak_allocated_bytes"] or 0 for p in steady["phases"] if p["phase"] == phase)


def point_rows(point: str, results: Path) -> list[dict]:
    config, precision, leaf = point.split(":", 2)
    config, _, lora = config.partition("+")  # qwen3_moe+lora-experts: moe_methods_table's LoRA under zero3
    path = HERE / "configs" / f"{config}_tiny.json"
    extra = harness_method(f"zero3+{lora}", 2, json.loads(path.read_text())["model_type"])[2] if lora else []
    base = {"config": path.name, "method": f"zero3+{lora}" if lora else "zero3", "precision": precision,
            "leaf": leaf, "micro_batch_size": 1, "seq_len": 64}
    try:
        run_dir = run_point("custom", "zero3", 2, precision, "small", results, 1, 64,
                            [f"model.name={path.resolve()}", *extra, *leaf_overrides(leaf)])
    except RuntimeError as exc:
        return [{**base, "rank": "", "measured_bytes": "", "measured_backward_bytes": "", "estimate_bytes": "",
                 "error_pct": "", "measured_phase": "", "estimated_phase": "",
                 "result": str(exc).strip().splitlines()[-1][:300]}]
    rows = []
    for scored in compare(run_dir):
        mib = 1024**2
        rows.append({**base, "rank": scored["rank"], "measured_bytes": round(scored["measured_mib"] * mib),
                     "measured_backward_bytes": phase_peak(run_dir, scored["rank"], "backward"),
                     "estimate_bytes": round(scored["estimated_mib"] * mib), "error_pct": scored["error_pct"],
                     "measured_phase": scored["measured_phase"], "estimated_phase": scored["estimated_phase"],
                     "result": "ok"})
    return rows


def rescored(row: dict) -> dict:
    """A committed row estimated again by today's estimator (its measurement kept, nothing run)."""
    if row["result"] != "ok":
        return row
    config, _, lora = row["method"].partition("+")
    path = HERE / "configs" / row["config"]
    extra = harness_method(row["method"], 2, json.loads(path.read_text())["model_type"])[2] if lora else []
    spec = point_spec("custom", "zero3", 2, row["precision"], "small", Path(tempfile.gettempdir()) / "zero3_leaf",
                      int(row["micro_batch_size"]), int(row["seq_len"]),
                      [f"model.name={path.resolve()}", *extra, *leaf_overrides(row["leaf"])])
    mine = estimate_ranks(spec, [int(row["rank"])])[int(row["rank"])]
    measured, predicted = int(row["measured_bytes"]), mine.traced_allocated_bytes
    return {**row, "estimate_bytes": predicted, "error_pct": round(100 * (predicted - measured) / measured, 2),
            "estimated_phase": mine.phase}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", nargs="*", default=DEFAULT_POINTS)
    parser.add_argument("--csv", type=Path, default=None)
    parser.add_argument("--append", action="store_true", help="keep the CSV's rows of points not run again")
    parser.add_argument("--rescore", type=Path, default=None, metavar="CSV",
                        help="estimate a committed table's rows again (measurements kept, nothing run)")
    args = parser.parse_args(argv)
    rows: list[dict] = []
    started = time.perf_counter()
    if args.rescore:
        rows = [rescored(row) for row in read_rows(args.rescore)]
        write_rows(args.rescore, rows)
        args.points = []
    with tempfile.TemporaryDirectory(prefix="zero3_leaf-") as tmp:
        for point in args.points:
            new = point_rows(point, Path(tmp))
            rows += new
            for row in new:
                print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            if args.csv:  # after every point: a long sweep keeps what it measured
                key = ("config", "method", "precision", "leaf")
                done = {tuple(r[k] for k in key) for r in rows}
                kept = [r for r in read_rows(args.csv) if tuple(r[k] for k in key) not in done] \
                    if args.append and args.csv.exists() else []
                write_rows(args.csv, kept + rows)
    scored = sorted(abs(float(r["error_pct"])) for r in rows if r["result"] == "ok")
    if scored:
        print(f"rows {len(rows)}  max |error| {scored[-1]:.2f} %  elapsed {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
