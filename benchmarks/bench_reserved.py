"""The reserved replay (estimator.reserved): speed, before/after table, published reserved rows.

Needs profiles with event lists for the models it runs, e.g. in a user cache:

    LLMEM_CACHE_DIR=/tmp/llmem python -m estimator.profiler.ship --events --out /tmp/llmem/profiles \
        --variants mixed_bf16-sdpa bf16-sdpa --models meta-llama/Llama-3.2-1B Qwen/Qwen2.5-0.5B facebook/opt-1.3b \
        meta-llama/Llama-2-7b-hf meta-llama/Llama-3.1-8B
    LLMEM_CACHE_DIR=/tmp/llmem python benchmarks/bench_reserved.py speed | table | public

Targets (issue 14): estimate() with the replay <= 50 ms for a 32-layer 7B in-process, a full plan <= 1 s.
"""

from __future__ import annotations

import csv
import statistics
import sys
import time

from estimator.api import estimate
from estimator.columns import spec_from_columns
from estimator.planning.plan import plan
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec

GIB = 1024**3


def _ms(spec: RunSpec, repeats: int = 5) -> float:
    estimate(spec)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        estimate(spec)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def speed() -> None:
    for model in ("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-3.1-8B"):
        for method, world in (("single", 1), ("ddp", 8)):
            spec = RunSpec(model=model, gpu="h100-80gb", parallel=ParallelSpec(method=method, world_size=world),
                           training=TrainingSpec(precision="bf16", micro_batch_size=2, seq_len=1024))
            est = estimate(spec)
            print(f"{model:<28}{method:<8}{_ms(spec):7.1f} ms  reserved {est.reserved_source}, "
                  f"{est.ranks[0].replayed_steps} steps, allocator OOM {est.ranks[0].allocator_oom}")
    for model, precision in (("meta-llama/Llama-3.2-1B", None), ("meta-llama/Llama-2-7b-hf", "bf16")):
        plan(model, gpus=8, gpu="h100-80gb", precision=precision, advise=False)
        started = time.perf_counter()
        result = plan(model, gpus=8, gpu="h100-80gb", precision=precision)
        print(f"plan {model:<28}{time.perf_counter() - started:6.2f} s ({result.estimates} estimates)")


def table() -> None:
    print("| model | precision | b × s | allocated GiB | reserved prior → replayed GiB | expandable GiB | "
          "cached unused at the peak GiB | steps | device prior → replayed GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in ("meta-llama/Llama-3.2-1B", "Qwen/Qwen2.5-0.5B", "facebook/opt-1.3b"):
        for precision in ("mixed_bf16", "bf16"):
            for b, s in ((1, 512), (4, 1024), (8, 2048)):
                spec = RunSpec(model=model, gpu="a100-80gb",
                               training=TrainingSpec(precision=precision, micro_batch_size=b, seq_len=s))
                replayed, prior = estimate(spec, alloc_conf=""), estimate(spec, replay_reserved=False)
                expandable = estimate(spec, alloc_conf="expandable_segments:True")
                rank = replayed.ranks[0]
                print(f"| {model} | {precision} | {b} × {s} | {replayed.peak_allocated_bytes / GIB:.2f} | "
                      f"{prior.peak_reserved_bytes / GIB:.2f} → {replayed.peak_reserved_bytes / GIB:.2f} "
                      f"({replayed.reserved_source}) | {expandable.peak_reserved_bytes / GIB:.2f} | "
                      f"{rank.fragmentation_bytes / GIB:.2f} | {rank.replayed_steps} | "
                      f"{prior.peak_device_bytes / GIB:.2f} → {replayed.peak_device_bytes / GIB:.2f} |")


def public(path: str = "data/public/measurements.csv") -> None:
    """The published single-GPU LoRA rows that measured max_memory_reserved (PEFT MetaMathQA)."""
    with open(path) as handle:
        rows = [r for r in csv.DictReader(handle) if r["source"] == "peft_metamathqa" and r["adapter"] == "lora"
                and r["quantity"] == "max_reserved" and r["qlora"] == "False"]
    print("| row | published reserved GiB | allocated GiB | prior GiB | replayed GiB | expandable GiB |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        spec = spec_from_columns(row)
        replayed, prior = estimate(spec, alloc_conf=""), estimate(spec, replay_reserved=False)
        expandable = estimate(spec, alloc_conf="expandable_segments:True")
        print(f"| {row['source_key']} | {int(row['value_bytes']) / GIB:.2f} | "
              f"{replayed.peak_allocated_bytes / GIB:.2f} | {prior.peak_reserved_bytes / GIB:.2f} | "
              f"{replayed.peak_reserved_bytes / GIB:.2f} ({replayed.reserved_source}) | "
              f"{expandable.peak_reserved_bytes / GIB:.2f} |")


if __name__ == "__main__":
    {"speed": speed, "table": table, "public": public}[sys.argv[1] if len(sys.argv) > 1 else "speed"]()
