"""Expert parallelism's replayed request stream against the real gloo EP runs of docs/error_matrix/moe_ep.csv.

    PYTHONPATH=. .venv/bin/python benchmarks/reserved_ep_table.py [--table docs/error_matrix/moe_ep.csv]
        [--csv docs/error_matrix/reserved_ep.csv]

For every row of the table without checkpointing (transformers' EP on gloo CPU ranks, every live storage counted:
``benchmarks/moe_ep_table.py``), the rank's step replayed through the caching-allocator model
(``estimator.reserved.ep``): its requested peak less the batch (no cuBLAS workspace: a CPU run has none) against the
busiest rank's measured peak, beside the analytic estimate the table holds; the reserved peak the replay reaches
(on the table's GPU, no workspace). Rows the replay does not cover keep the reason (``rank.why_not``) and no
numbers. The measurements are the table's, not re-run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from benchmarks.table_csv import read_rows, write_rows

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
INT64 = 8


def replayed(config: Path, world: int, ep: int, precision: str, b: int, s: int, imbalance: float = 1.0
             ) -> tuple[int, int] | str:
    """(requested peak less the batch, reserved peak) of the rank's replay, or why there is none."""
    from estimator import api
    from estimator.profiler.expand import ExpansionError
    from estimator.reserved import rank as reserved_rank
    from estimator.spec import ParallelSpec, RunSpec, TrainingSpec

    spec = RunSpec(model=str(config), gpu="h100-80gb", parallel=ParallelSpec(method="fsdp", world_size=world, ep=ep,
                                                                              moe_imbalance=imbalance),
                   training=TrainingSpec(precision=precision, attn="eager", micro_batch_size=b, seq_len=s))
    arch, profile = api.load_model_profile(spec.model, spec.training)
    regime = api._regime(profile, b, s)
    table = api._param_table(profile, arch.num_layers)
    reason = reserved_rank.why_not(spec, regime, arch.num_layers, table)
    if reason is not None:
        return reason
    try:
        run = reserved_rank.replay_reserved(spec, profile, regime, table, arch.num_layers, workspace_bytes=0,
                                            workspaces=0, allowed_bytes=None, conf_text="")
    except ExpansionError as err:
        return f"the event list does not expand: {err}"
    return run.peak_requested_bytes - 3 * b * s * INT64, run.peak_reserved_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path, default=REPO / "docs/error_matrix/moe_ep.csv")
    parser.add_argument("--csv", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = []
    for row in read_rows(args.table):
        if row["grad_ckpt"] == "True":
            continue
        world, ep, b, s = (int(row[k]) for k in ("world_size", "ep", "micro_batch_size", "seq_len"))
        found = replayed(HERE / "configs" / row["config"], world, ep, row["precision"], b, s,
                         float(row["moe_imbalance"]))
        measured = int(row["measured_bytes"])
        out = {k: row[k] for k in ("family", "config", "precision", "world_size", "ep", "micro_batch_size",
                                   "seq_len", "routing", "moe_imbalance", "measured_bytes")}
        out["analytic_bytes"] = row["estimate_bytes"]
        if isinstance(found, str):
            out.update(replayed_requested_bytes="", replayed_reserved_bytes="", error_pct="", refused=found)
        else:
            requested, reserved = found
            out.update(replayed_requested_bytes=requested, replayed_reserved_bytes=reserved,
                       error_pct=round(100 * (requested - measured) / measured, 4), refused="")
        rows.append(out)
        print(",".join(str(v) for v in out.values()), flush=True)
    errors = [abs(r["error_pct"]) for r in rows if r["error_pct"] != ""]
    if errors:
        print(f"{len(errors)} replayed of {len(rows)}: |error| median {statistics.median(errors):.3f} %, "
              f"max {max(errors):.3f} %", file=sys.stderr)
    if args.csv:
        write_rows(args.csv, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
