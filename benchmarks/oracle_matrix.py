"""The estimator beside two oracles over the full matrix, resumable: the project's tracer and torch's MemTracker.

    PYTHONPATH=. .venv/bin/python benchmarks/oracle_matrix.py [--models A B ...] [--method single|fsdp|fsdp1 --gpus N]
        [--fsdp-sharding FULL_SHARD|SHARD_GRAD_OP|NO_SHARD]
        [--batches 1 4 16] [--seqs 128 512 2048] [--ckpt off on] [--attn eager sdpa] [--precision fp32 bf16]
        [--loops trainer manual] [--oracles project memtracker memtracker_cpu] [--jobs N]
        [--cache docs/error_matrix/oracle_cache.jsonl] [--csv out.csv] [--issue-order] [--budget-s S]

Oracles (per point; ``single``: rank 0, ``fsdp``/``fsdp1``: ranks 0 and N-1). ``fsdp1`` runs with
``use_orig_params=False`` everywhere (estimate and both oracles): torch's MemTracker hooks every module
parameter's gradient accumulation, which FSDP1's ``use_orig_params`` views in forward do not allow
(``tests/estimator/test_fsdp1.py`` checks use_orig_params=True against the project's tracer).

* ``project``: ``tests/estimator/oracle_util.traced_peak_bytes`` (single) / ``harness.fake.trace_run`` (fsdp,
  512-B rounding), both loops (``TrainingSpec.loop``), full-length batch, CUDA's kernel choice
  (``estimator.profiler.cuda_path``; entries computed before 2026-11-24 traced the CPU's and were dropped).
* ``memtracker``: ``harness.fake.memtracker`` with the CUDA kernel choice (SDPA backend, dropout) and without
  the optimizer's host-side step scalars; both loops, full-length batch.
* ``memtracker_cpu``: the same on the CPU kernels (what a plain fake-tensor trace runs).

The estimate (``estimator.estimate``, peak allocated minus the cuBLAS workspace) is computed for each row's loop
(``TrainingSpec.loop``). Every computed point is one
JSON line in ``--cache`` keyed by the full point and oracle; a re-run skips points already there. Work is split
in units (model, variant, rank, oracle) run by ``--jobs`` worker processes; a memtracker unit builds its fake
model once and runs every (b, s, loop) of the variant on it (two steady-state steps each: the same result as a
fresh build, ``tests/oracle/test_memtracker_oracle.py``). ``--issue-order``: SDPA without checkpointing and
micro-batch >= 2 first (the cases issue 13 found under-estimated).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass

MODELS = ("facebook/opt-125m", "Qwen/Qwen2.5-0.5B", "HuggingFaceTB/SmolLM2-135M", "EleutherAI/pythia-1b",
          "bigcode/gpt_bigcode-santacoder", "bigscience/bloom-560m")
ORACLES = ("project", "memtracker", "memtracker_cpu")
DEFAULT_CACHE = "docs/error_matrix/oracle_cache.jsonl"


@dataclass(frozen=True)
class Unit:
    """One build: everything but (b, s, loop)."""

    model: str
    method: str
    world: int
    rank: int
    precision: str
    attn: str
    grad_ckpt: bool
    oracle: str
    fsdp1: str | None = None  # fsdp1's sharding strategy


def point_key(unit: Unit, b: int, s: int, loop: str) -> str:
    fields = dict(unit.__dict__, micro_batch_size=b, seq_len=s, loop=loop, batch="full")
    if fields["fsdp1"] is None:  # keys written before fsdp1 existed stay valid
        fields.pop("fsdp1")
    return json.dumps(fields, sort_keys=True)


def read_cache(path: str) -> dict[str, dict]:
    done: dict[str, dict] = {}
    if os.path.exists(path):
        with open(path) as handle:
            for line in handle:
                if line.strip():
                    row = json.loads(line)
                    done[row["key"]] = row
    return done


def _append(path: str, row: dict) -> None:
    """One line per point; a single small O_APPEND write, so concurrent workers do not interleave lines."""
    with open(path, "a") as handle:
        handle.write(json.dumps(row) + "\n")


def _run_unit(args: tuple) -> int:
    """Compute every missing point of one unit; returns how many were computed."""
    unit, points, cache = args
    if unit.oracle == "project":
        return _run_project(unit, points, cache)
    return _run_memtracker(unit, points, cache)


def _run_memtracker(unit: Unit, points: list[tuple[int, int, str]], cache: str) -> int:
    from harness.fake import memtracker as mt

    config = mt.load_model_config(unit.model)
    variant = mt.Variant(unit.precision, unit.attn, unit.grad_ckpt,
                         "cpu" if unit.oracle == "memtracker_cpu" else "cuda", unit.world, unit.rank, unit.fsdp1)
    started = time.perf_counter()
    built = mt.build(config, variant)
    mt.warm_up(built)
    setup_s = time.perf_counter() - started
    try:
        for b, s, loop in points:
            t0 = time.perf_counter()
            peak = mt.peak_bytes(built, b, s, loop, "full")
            _append(cache, {"key": point_key(unit, b, s, loop), "peak_bytes": peak,
                            "point_s": round(time.perf_counter() - t0, 2), "setup_s": round(setup_s, 2)})
    finally:
        mt.close(built)
    return len(points)


def _run_project(unit: Unit, points: list[tuple[int, int, str]], cache: str) -> int:
    from estimator.models.arch import load_config
    from estimator.spec import RunSpec, TrainingSpec

    config = load_config(unit.model)
    for b, s, loop in points:
        training = TrainingSpec(micro_batch_size=b, seq_len=s, grad_ckpt=unit.grad_ckpt, attn=unit.attn,
                                precision=unit.precision, loop=loop)
        t0 = time.perf_counter()
        if unit.method == "single":
            from tests.estimator.oracle_util import traced_peak_bytes

            peak = traced_peak_bytes(config, training)
        else:
            from harness.fake import trace_run

            spec = RunSpec(model=unit.model, parallel=_parallel(unit.method, unit.world, unit.fsdp1),
                           training=training)
            peak = trace_run(spec, ranks=(unit.rank,))["per_rank"][unit.rank]["peak_allocated_bytes"]
        _append(cache, {"key": point_key(unit, b, s, loop), "peak_bytes": peak,
                        "point_s": round(time.perf_counter() - t0, 2), "setup_s": 0.0})
    return len(points)


def _parallel(method: str, world: int, sharding: str | None):
    from estimator.spec import Fsdp1Spec, ParallelSpec

    if method != "fsdp1":
        return ParallelSpec(method=method, world_size=world)
    return ParallelSpec(method=method, world_size=world,
                        fsdp1=Fsdp1Spec(sharding_strategy=sharding, use_orig_params=False))


def _variants(args) -> list[tuple[str, str, bool]]:
    variants = [(p, a, c == "on") for p, a, c in itertools.product(args.precision, args.attn, args.ckpt)]
    if args.issue_order:  # SDPA without checkpointing first
        variants.sort(key=lambda v: (v[1] != "sdpa" or v[2], v))
    return variants


def _ranks(args) -> list[int]:
    return [0] if args.method == "single" else sorted({0, args.gpus - 1})


def _sizes(args, model: str) -> list[tuple[int, int]]:
    from estimator.models.arch import resolve_arch

    max_pos = resolve_arch(model).max_positions
    sizes = [(b, s) for b, s in itertools.product(args.batches, args.seqs) if not (max_pos and s > max_pos)]
    if args.issue_order:
        sizes.sort(key=lambda p: (p[0] < 2, p))
    return sizes


def plan_units(args, done: dict[str, dict]) -> list[tuple[Unit, list[tuple[int, int, str]], str]]:
    work = []
    world = args.gpus if args.method != "single" else 1
    for precision, attn, ckpt in _variants(args):
        for model in args.models:
            for rank, oracle in itertools.product(_ranks(args), args.oracles):
                unit = Unit(model, args.method, world, rank, precision, attn, ckpt, oracle, _sharding(args))
                points = [(b, s, loop) for (b, s) in _sizes(args, model) for loop in args.loops
                          if point_key(unit, b, s, loop) not in done]
                if points:
                    work.append((unit, points, args.cache))
    return work


def _sharding(args) -> str | None:
    return args.fsdp_sharding if args.method == "fsdp1" else None


def _estimate_bytes(model: str, method: str, world: int, rank: int, b: int, s: int, precision: str, attn: str,
                    ckpt: bool, loop: str, sharding: str | None = None) -> int:
    from estimator.api import estimate
    from estimator.spec import RunSpec, TrainingSpec

    training = TrainingSpec(micro_batch_size=b, seq_len=s, grad_ckpt=ckpt, attn=attn, precision=precision,
                            loop=loop)
    est = estimate(RunSpec(model=model, parallel=_parallel(method, world, sharding), training=training))
    ranks = {r.rank: r for r in est.ranks}
    mine = ranks.get(rank, est.ranks[-1])
    return mine.traced_allocated_bytes


def table(args, done: dict[str, dict]) -> list[dict]:
    rows = []
    world = args.gpus if args.method != "single" else 1
    for precision, attn, ckpt in _variants(args):
        for model in args.models:
            for rank, (b, s), loop in itertools.product(_ranks(args), _sizes(args, model), args.loops):
                found = {}
                for oracle in args.oracles:
                    unit = Unit(model, args.method, world, rank, precision, attn, ckpt, oracle, _sharding(args))
                    row = done.get(point_key(unit, b, s, loop))
                    if row is not None:
                        found[oracle] = row
                if not found:
                    continue
                estimate = _estimate_bytes(model, args.method, world, rank, b, s, precision, attn, ckpt, loop,
                                           _sharding(args))
                out = {"model": model, "method": args.method, "world_size": world, "rank": rank,
                       "fsdp1_sharding": _sharding(args) or "",
                       "micro_batch_size": b, "seq_len": s, "grad_ckpt": ckpt, "attn": attn,
                       "precision": precision, "loop": loop, "estimate_bytes": estimate}
                for oracle in args.oracles:
                    value = found.get(oracle, {}).get("peak_bytes")
                    out[f"{oracle}_bytes"] = value
                    out[f"{oracle}_error_pct"] = (round(100 * (estimate - value) / value, 4)
                                                  if value and estimate is not None else None)
                    out[f"{oracle}_point_s"] = found.get(oracle, {}).get("point_s")
                rows.append(out)
    return rows


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--method", default="single", choices=("single", "fsdp", "fsdp1"))
    parser.add_argument("--gpus", type=int, default=4, help="fsdp / fsdp1 world size")
    parser.add_argument("--fsdp-sharding", default="FULL_SHARD", choices=("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"),
                        help="fsdp1's sharding strategy")
    parser.add_argument("--batches", nargs="*", type=int, default=[1, 4, 16])
    parser.add_argument("--seqs", nargs="*", type=int, default=[128, 512, 2048])
    parser.add_argument("--ckpt", nargs="*", default=["off", "on"], choices=("off", "on"))
    parser.add_argument("--attn", nargs="*", default=["eager", "sdpa"], choices=("eager", "sdpa"))
    parser.add_argument("--precision", nargs="*", default=["fp32", "bf16"])
    parser.add_argument("--loops", nargs="*", default=["trainer", "manual"], choices=("trainer", "manual"))
    parser.add_argument("--oracles", nargs="*", default=["project", "memtracker"], choices=ORACLES)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--cache", default=DEFAULT_CACHE)
    parser.add_argument("--csv")
    parser.add_argument("--issue-order", action="store_true", help="SDPA, no checkpointing, b >= 2 first")
    parser.add_argument("--budget-s", type=float, default=None, help="stop submitting units after this long")
    parser.add_argument("--table-only", action="store_true", help="write the table from the cache, compute nothing")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    sys.path.insert(0, ".")
    os.makedirs(os.path.dirname(args.cache) or ".", exist_ok=True)
    started = time.perf_counter()
    if not args.table_only:
        work = plan_units(args, read_cache(args.cache))
        print(f"{sum(len(w[1]) for w in work)} points to compute in {len(work)} units", flush=True)
        with multiprocessing.get_context("spawn").Pool(args.jobs, maxtasksperchild=1) as pool:
            pending = []
            for item in work:
                if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
                    break
                pending.append(pool.apply_async(_run_unit, (item,)))
                while len([p for p in pending if not p.ready()]) >= args.jobs:
                    time.sleep(1)
                    if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
                        break
            for p in pending:
                p.get()
    rows = table(args, read_cache(args.cache))
    for row in rows:
        print(" ".join(str(v) for v in row.values()), flush=True)
    if args.csv and rows:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    errors = [abs(r[f"{o}_error_pct"]) for r in rows for o in args.oracles if r.get(f"{o}_error_pct") is not None]
    print(f"rows {len(rows)}  max |error| {max(errors, default=0):.4f} %  elapsed {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
