"""Estimator speed: in-process ms per estimate and cold `python -m estimator` wall time, catalogue models.

    .venv/bin/python benchmarks/bench_estimator.py
Targets (issue 2): <= 20 ms per estimate in-process, <= 1.5 s cold CLI, on a 2-core CPU machine.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from estimator.api import estimate
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec

MODELS = ("facebook/opt-1.3b", "bigscience/bloom-560m", "meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-7B")
METHODS = (("single", 1), ("ddp", 8), ("zero3", 8), ("fsdp", 8))


def in_process_ms(repeats: int = 50) -> list[tuple[str, float]]:
    rows = []
    for model in MODELS:
        for method, world in METHODS:
            spec = RunSpec(model=model, parallel=ParallelSpec(method=method, world_size=world),
                           training=TrainingSpec(micro_batch_size=4, seq_len=2048))
            estimate(spec)  # first call loads the profile
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                estimate(spec)
                times.append((time.perf_counter() - started) * 1e3)
            rows.append((f"{model} {method}", statistics.median(times)))
    return rows


def cold_cli_s(repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "estimator", "--model", "meta-llama/Llama-3.1-8B", "--method",
                        "fsdp", "--gpus", "8"], check=True, capture_output=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


if __name__ == "__main__":
    rows = in_process_ms()
    for name, ms in rows:
        print(f"{name:<40}{ms:8.2f} ms")
    print(f"max in-process: {max(ms for _, ms in rows):.2f} ms (target 20)")
    print(f"cold CLI: {cold_cli_s():.2f} s (target 1.5)")
