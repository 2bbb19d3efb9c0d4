"""Mixture-of-experts against a real CPU run, with the router forced to balanced and to skewed routing (issue 17).

    PYTHONPATH=. .venv/bin/python benchmarks/moe_routing_table.py [--configs CONFIG.json ...]
        [--precisions fp32 bf16] [--points 1x128 2x256 4x64] [--csv docs/error_matrix/moe_routing.csv]

Fake tensors cannot follow data-dependent routing, so the oracle is a real CPU run of a small config
(``harness.fake.live_storage``: every live storage summed after every operator, two steady steps after a warm-up),
once with every router's choice replaced by an even spread (token t -> experts t*k .. t*k+k-1 mod E) and once by
the most skewed one (every token -> experts 0 .. k-1). The estimate is ``traced_allocated_bytes`` (allocated less
what only a GPU has: the cuBLAS workspace, the allocator's rounding), the same for both routings (the estimator's
claim: dropless experts save the same bytes however the tokens are routed, ``estimator.models.moe``). Eager
attention and no dropout, so the CPU run's kernels are the ones the estimate traces, grouped matmuls aside (CUDA
runs its grouped_mm kernel or the fallback; both return the same tensors).
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from harness.ep import ROUTINGS, force_routing  # the EP oracle forces the routers the same way

HERE = Path(__file__).resolve().parent
CONFIGS = [HERE / "configs" / f"{name}_tiny.json" for name in ("qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v2")]


def measured_bytes(config: dict, precision: str, b: int, s: int, routing: str) -> int:
    import torch

    from harness.fake import live_storage
    from harness.fake import memtracker as mt

    torch.manual_seed(0)
    built = mt.build(config, mt.Variant(precision=precision, attn="eager", kernels="cpu"), fake=False)
    if not force_routing(built.model, ROUTINGS[routing]):
        raise ValueError("no top-k router found in the model")
    return live_storage.peak_bytes(built, b, s)


def estimated_bytes(path: Path, precision: str, b: int, s: int) -> int:
    from estimator.api import estimate
    from estimator.spec import RunSpec, TrainingSpec

    spec = RunSpec(model=str(path), gpu="h100-80gb",
                   training=TrainingSpec(precision=precision, attn="eager", micro_batch_size=b, seq_len=s))
    return int(estimate(spec).traced_allocated_bytes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", type=Path, default=CONFIGS)
    parser.add_argument("--precisions", nargs="*", default=["fp32", "bf16"])
    parser.add_argument("--points", nargs="*", default=["1x128", "2x256", "4x64"])
    parser.add_argument("--csv", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = []
    started = time.perf_counter()
    # each real run in a fresh interpreter: the live-storage count starts from every tensor the process holds
    pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1)
    for path in args.configs:
        config = json.loads(path.read_text())
        for precision in args.precisions:
            for point in args.points:
                b, s = (int(x) for x in point.split("x"))
                predicted = estimated_bytes(path, precision, b, s)
                for routing in ROUTINGS:
                    measured = pool.submit(measured_bytes, config, precision, b, s, routing).result()
                    rows.append({"family": config["model_type"], "config": path.name, "precision": precision,
                                 "micro_batch_size": b, "seq_len": s, "routing": routing,
                                 "measured_bytes": measured, "estimate_bytes": predicted,
                                 "error_pct": round(100 * (predicted - measured) / measured, 4)})
                    print(f"{config['model_type']:<12}{precision:<6}b{b:<3}s{s:<5}{routing:<10}"
                          f"{measured:>12}{predicted:>12}{rows[-1]['error_pct']:>+9.3f} %", flush=True)
    worst = max(abs(r["error_pct"]) for r in rows)
    print(f"rows {len(rows)}  max |error| {worst:.3f} %  elapsed {time.perf_counter() - started:.0f} s")
    if args.csv:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with args.csv.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
