"""every-k checkpointing's reserved replay under the sharded methods (FSDP2, dp_tp, FSDP1) against the analytic
allocated estimate of the same spec and rank; writes a table.

    PYTHONPATH=. .venv/bin/python benchmarks/reserved_every_k_sharded.py \
        [--csv docs/error_matrix/reserved_every_k_sharded_cpu.csv]

The sibling of ``benchmarks/reserved_every_k.py`` (single / ddp / tp / ZeRO-1/2): the same tiny Llama and OPT
configs (6 layers), precisions, every-k:2 and :3 and (micro-batch, sequence) points; fsdp and fsdp1 (FULL_SHARD) on
2 and 4 ranks, dp_tp on 2 x 2 and 4 x 2; the first and the last rank the estimate reports. Per row: the replay's
requested peak less the estimate's allocated peak of that rank (less its block rounding, plus the three batch
tensors the estimator does not count; 0 is the same to the byte), the same under full checkpointing at the same
point, the replayed reserved peak and the prior the estimate fell back to before (allocated x 1.1 + 64 MiB).
``--summarize CSV`` prints a written table's summary.

``--grad-sync-last``: FSDP2 and dp_tp accumulating 2 and 3 micro-batches under grad_sync last (the unsharded
gradients held between micro-batches, ``estimator.reserved.fsdp._no_sync_micro_steps``), without checkpointing and
with every-k:2; the reference column is then the same spec's difference with one micro-batch.
Left out, as the estimate refuses them with every-k: LoRA (every-k is modelled for full fine-tuning only) and
ZeRO-3 (its replay refuses checkpointing of any kind: ``estimator.reserved.zero3.why_not_zero3``). Exit 1 when a
row's difference is neither 0 nor full checkpointing's at the same point and rank (``unexplained``).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from reserved_every_k import CONFIGS, POINTS, PRECISIONS, replay_rank, requested_less_estimate  # noqa: E402

from estimator import api  # noqa: E402
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec  # noqa: E402

# (method, world, tp)
METHODS = (("fsdp", 2, 1), ("fsdp", 4, 1), ("dp_tp", 4, 2), ("dp_tp", 8, 2), ("fsdp1", 2, 1), ("fsdp1", 4, 1))


def rank_differences(spec: RunSpec) -> list[dict]:
    """Per rank the estimate reports: (rank, replay's requested less the estimate's, replayed reserved, the
    estimate's allocated, whether the activations peak). The estimate's reserved level must be the replay's."""
    b, s = spec.training.micro_batch_size, spec.training.seq_len
    est = api.estimate(spec, alloc_conf="")
    out = []
    for rank in est.ranks:
        replayed = replay_rank(spec, rank.rank, est)[1]
        out.append({"rank": rank.rank, "diff": requested_less_estimate(replayed, rank, b, s),
                    "reserved": replayed.peak_reserved_bytes, "allocated": rank.peak_allocated_bytes,
                    "activations": "optim" not in rank.phase})
    return out


def _rows(name: str, path: str, precision: str, method: str, world: int, tp: int, every: int, b: int, s: int
          ) -> list[dict]:
    def spec(policy: str) -> RunSpec:
        return RunSpec(model=path, parallel=ParallelSpec(method=method, world_size=world, tp=tp),
                       training=TrainingSpec(precision=precision, grad_ckpt=True, ckpt_policy=policy,
                                             micro_batch_size=b, seq_len=s))

    mixed = spec(f"every-k:{every}")
    full = {r["rank"]: r["diff"] for r in rank_differences(spec(""))}
    prior = {r.rank: r.peak_reserved_bytes for r in api.estimate(mixed, replay_reserved=False).ranks}
    return [{"model": name, "precision": precision, "method": method, "world": world, "tp": tp, "rank": r["rank"],
             "every": every, "b": b, "s": s, "activation_peak": r["activations"],
             "requested_less_estimate_bytes": r["diff"], "full_ckpt_requested_less_estimate_bytes": full[r["rank"]],
             "estimate_allocated_bytes": r["allocated"], "replayed_reserved_bytes": r["reserved"],
             "prior_reserved_bytes": prior[r["rank"]]}
            for r in rank_differences(mixed)]


def _no_sync_rows(name: str, path: str, precision: str, method: str, world: int, tp: int, accum: int,
                  policy: str, b: int, s: int) -> list[dict]:
    """FSDP2 / dp_tp accumulating under grad_sync last (unsharded gradients held between micro-batches), against
    the same spec without accumulation (``full_ckpt_...``: the column the exit rule reads; here one
    micro-batch's difference at the same point)."""
    def spec(k: int) -> RunSpec:
        return RunSpec(model=path, parallel=ParallelSpec(method=method, world_size=world, tp=tp),
                       training=TrainingSpec(precision=precision, grad_ckpt=bool(policy), ckpt_policy=policy,
                                             micro_batch_size=b, seq_len=s, grad_accum_steps=k,
                                             grad_sync="last"))

    held = spec(accum)
    single = {r["rank"]: r["diff"] for r in rank_differences(spec(1))}
    prior = {r.rank: r.peak_reserved_bytes for r in api.estimate(held, replay_reserved=False).ranks}
    return [{"model": name, "precision": precision, "method": method, "world": world, "tp": tp, "rank": r["rank"],
             "accum": accum, "ckpt_policy": policy or "off", "b": b, "s": s, "activation_peak": r["activations"],
             "requested_less_estimate_bytes": r["diff"], "full_ckpt_requested_less_estimate_bytes": single[r["rank"]],
             "estimate_allocated_bytes": r["allocated"], "replayed_reserved_bytes": r["reserved"],
             "prior_reserved_bytes": prior[r["rank"]]}
            for r in rank_differences(held)]


def _matrix(no_sync: bool) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in CONFIGS.items():
            path = Path(tmp) / f"{name}.json"
            path.write_text(json.dumps(config))
            for precision in PRECISIONS:
                for method, world, tp in METHODS:
                    if no_sync and method == "fsdp1":
                        continue
                    for variant in (2, 3):  # K of every-k, or micro-batches
                        for b, s in POINTS:
                            if no_sync:
                                for policy in ("", "every-k:2"):
                                    rows += _no_sync_rows(name, str(path), precision, method, world, tp, variant,
                                                          policy, b, s)
                            else:
                                rows += _rows(name, str(path), precision, method, world, tp, variant, b, s)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", default=None)
    parser.add_argument("--summarize", metavar="CSV", help="summarize a written table, computing nothing")
    parser.add_argument("--grad-sync-last", action="store_true",
                        help="FSDP2 / dp_tp accumulating 2 or 3 micro-batches under grad_sync last instead")
    args = parser.parse_args(argv)
    if args.summarize:
        with open(args.summarize, newline="") as handle:
            rows = list(csv.DictReader(handle))
        print(summary(rows))
        return 1 if unexplained(rows) else 0
    rows = _matrix(args.grad_sync_last)
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    print(summary(rows))
    return 1 if unexplained(rows) else 0


def unexplained(rows: list[dict]) -> list[dict]:
    """Rows whose difference is neither 0 nor full checkpointing's at the same point and rank (what the replay
    and the estimate already differ by without every-k), nor held gradients' known one (``_below_in_flight``)."""
    return [r for r in rows if int(r["requested_less_estimate_bytes"]) not in
            (0, int(r["full_ckpt_requested_less_estimate_bytes"])) and not _below_in_flight(r)]


def _below_in_flight(row: dict) -> bool:
    """grad_sync last without mixed precision, the replay under the analytic estimate: where checked against a real
    run (tests/estimator/test_reserved_fsdp.py::test_held_gradients_requested_peak_equals_a_real_runs, fp32
    (4, 512)), the replay's requested peak is the real run's to the byte and the estimate 139,520 B above it. Not
    traced; the suspect is the analytic's re-made gradient counted in flight beside the held ones
    (``methods.fsdp_replay``: ``largest_grad_bytes``)."""
    return ("accum" in row and not str(row["precision"]).startswith("mixed_")
            and int(row["requested_less_estimate_bytes"]) < 0)


def summary(rows: list[dict]) -> str:
    diff = [int(r["requested_less_estimate_bytes"]) for r in rows]
    activations = [r for r in rows if str(r["activation_peak"]) == "True"]
    exact = sum(int(r["requested_less_estimate_bytes"]) == 0 for r in activations)
    below = [r for r in rows if int(r["requested_less_estimate_bytes"]) not in
             (0, int(r["full_ckpt_requested_less_estimate_bytes"])) and _below_in_flight(r)]
    inherited = [r for r in rows if int(r["requested_less_estimate_bytes"]) != 0 and r not in unexplained(rows)
                 and r not in below]
    vs_prior = [int(r["replayed_reserved_bytes"]) / int(r["prior_reserved_bytes"]) - 1 for r in rows]
    return (f"{len(rows)} rows; byte-equal: {diff.count(0)} of {len(rows)} ({exact} of {len(activations)} where the "
            f"activations peak); {len(inherited)} differ by full checkpointing's difference at the same point "
            f"({sorted({int(r['requested_less_estimate_bytes']) for r in inherited})} B, at "
            f"{sorted({(int(r['b']), int(r['s'])) for r in inherited})}), "
            + (f"{len(below)} under the estimate without mixed precision (the estimate's, checked: "
               f"{min(int(r['requested_less_estimate_bytes']) for r in below)} to "
               f"{max(int(r['requested_less_estimate_bytes']) for r in below)} B), " if below else "")
            + f"{len(unexplained(rows))} otherwise; "
            f"|requested - estimate| median {statistics.median(map(abs, diff))} B, max {max(map(abs, diff))} B; "
            f"replayed reserved vs the prior: median {statistics.median(vs_prior):+.1%}, from {min(vs_prior):+.1%} "
            f"to {max(vs_prior):+.1%}")


if __name__ == "__main__":
    sys.exit(main())
