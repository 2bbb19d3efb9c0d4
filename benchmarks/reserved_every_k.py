"""every-k checkpointing's reserved replay (``estimator.reserved.every_k``) against the analytic allocated estimate of
the same spec; writes a table.

    PYTHONPATH=. .venv/bin/python benchmarks/reserved_every_k.py [--csv docs/error_matrix/reserved_every_k_cpu.csv]

Tiny Llama and OPT configs (6 layers), every-k:2 and :3, single / ddp / tp / zero1 / zero2 (ZeRO not at pure bf16:
its replay refuses that), several (micro-batch, sequence) points. Per row: the replay's requested peak less the
estimate's allocated peak (less its block rounding, plus the three batch tensors the estimator does not count;
0 is the same to the byte), the replayed reserved peak and the prior the estimate fell back to before (allocated
x 1.1 + 64 MiB). Exit 1 when a single / ddp / tp / zero1 row is not byte-equal where the activations peak (the rows
marked ``activation_peak``: the peak is not the optimizer step's, where a pre-existing 4 bytes differ with or
without checkpointing, test_reserved_every_k), or any row whose difference is not full checkpointing's at the same
point (ZeRO-2's replay sits a fixed amount under its estimate with or without every-k: not every-k's).
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

from estimator import api  # noqa: E402
from estimator.hardware.residuals import load_coefficients  # noqa: E402
from estimator.reserved import rank as reserved_rank  # noqa: E402
from estimator.reserved.timeline import INT64  # noqa: E402
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec, ckpt_every  # noqa: E402

CONFIGS = {family: json.loads((Path(__file__).resolve().parent / "configs" / f"{family}_6layer_tiny.json").read_text())
           for family in ("llama", "opt")}
PRECISIONS = ("fp32", "mixed_bf16", "bf16")
METHODS = (("single", 1), ("ddp", 2), ("tp", 2), ("zero1", 2), ("zero2", 2))
POINTS = ((8, 256), (4, 512), (2, 128), (1, 32))
MIB = 1024 * 1024


def replay_rank(spec: RunSpec, rank: int = 0, est=None):
    """(the estimate, a rank's replay) with the estimate's own profile and coefficients; exits naming why a spec
    is not replayed. ``est``: the spec's estimate, when made already."""
    training = spec.training
    b, s, every = training.micro_batch_size, training.seq_len, ckpt_every(training.ckpt_policy)
    est = est or api.estimate(spec, alloc_conf="")
    tp = spec.parallel.tp
    arch, profile = (api.every_k_profile(spec.model, training, tp, every) if every
                     else api.load_model_profile(spec.model, training, tp))
    regime, table = api._regime(profile, b, s), api._param_table(profile, arch.num_layers)
    reason = reserved_rank.why_not(spec, regime, arch.num_layers, table)
    if reason is not None:
        raise SystemExit(f"{spec}: {reason}")
    coeffs = load_coefficients(est.gpu_key)
    return est, reserved_rank.replay_reserved(spec, profile, regime, table, arch.num_layers,
                                              workspace_bytes=coeffs.cublas_workspace_bytes,
                                              workspaces=coeffs.cublas_workspaces, allowed_bytes=None, conf_text="",
                                              rank=rank)


def requested_less_estimate(replayed, rank, b: int, s: int) -> int:
    """The replay's requested peak less the estimate's allocated, with the estimate's block rounding taken out and
    the ``3 b s`` int64 elements every replay comparison adds (tests/estimator/test_reserved.py)."""
    rounding = rank.breakdown.get("allocator_rounding", 0)
    assert rank.reserved_source == "replayed" and rank.peak_reserved_bytes == replayed.peak_reserved_bytes
    return replayed.peak_requested_bytes - (rank.peak_allocated_bytes - rounding + 3 * b * s * INT64)


def _difference(spec: RunSpec) -> tuple[int, int, int, bool]:
    """(replay's requested less the estimate's, replayed reserved, the estimate's allocated, activation peak)."""
    est, replayed = replay_rank(spec)
    diff = requested_less_estimate(replayed, est, spec.training.micro_batch_size, spec.training.seq_len)
    return diff, replayed.peak_reserved_bytes, est.peak_allocated_bytes, "optim" not in est._worst().phase


def _row(name: str, path: str, precision: str, method: str, world: int, every: int, b: int, s: int) -> dict:
    def spec(policy: str) -> RunSpec:
        return RunSpec(model=path, parallel=ParallelSpec(method=method, world_size=world,
                                                         tp=world if method == "tp" else 1),
                       training=TrainingSpec(precision=precision, grad_ckpt=True, ckpt_policy=policy,
                                             micro_batch_size=b, seq_len=s))

    mixed = spec(f"every-k:{every}")
    diff, reserved, allocated, activations = _difference(mixed)
    return {"model": name, "precision": precision, "method": method, "world": world, "every": every, "b": b,
            "s": s, "activation_peak": activations, "requested_less_estimate_bytes": diff,
            "full_ckpt_requested_less_estimate_bytes": _difference(spec(""))[0],
            "estimate_allocated_bytes": allocated, "replayed_reserved_bytes": reserved,
            "prior_reserved_bytes": api.estimate(mixed, replay_reserved=False).peak_reserved_bytes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", default=None)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in CONFIGS.items():
            path = Path(tmp) / f"{name}.json"
            path.write_text(json.dumps(config))
            for precision in PRECISIONS:
                for method, world in METHODS:
                    if precision == "bf16" and method.startswith("zero"):
                        continue
                    for every in (2, 3):
                        rows += [_row(name, str(path), precision, method, world, every, b, s) for b, s in POINTS]
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    exact = [r for r in rows if r["method"] != "zero2" and r["activation_peak"]]
    off = [r for r in exact if r["requested_less_estimate_bytes"] != 0]
    inherited = sum(r["requested_less_estimate_bytes"] == r["full_ckpt_requested_less_estimate_bytes"] for r in rows)
    gaps = [abs(r["requested_less_estimate_bytes"]) for r in rows]
    vs_prior = [r["replayed_reserved_bytes"] / r["prior_reserved_bytes"] - 1 for r in rows]
    print(f"{len(rows)} rows; single/ddp/tp/zero1 where activations peak: {len(exact) - len(off)} of {len(exact)} "
          f"byte-equal; every-k's requested - estimate = full checkpointing's in {inherited} of {len(rows)}; "
          f"|requested - estimate| median {statistics.median(gaps)} B, max {max(gaps)} B; replayed reserved vs the "
          f"prior: median {statistics.median(vs_prior):+.1%}, from {min(vs_prior):+.1%} to {max(vs_prior):+.1%}")
    if inherited != len(rows):
        return 1
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
