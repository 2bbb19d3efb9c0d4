"""liger_kernel's FSDP1 forward-prefetch runs (data/public/extract_liger_kernel.py), step by step: each logged step's
allocated and reserved peaks against the estimator at that step's padded length, the reserved level replayed over
steps 1..k in order (the allocator's cache only grows, so step k's reserved peak is the run's level so far).

Rank 0's padded length per step is not logged; it is taken from each step's token increment (the sum over the four
ranks of 32 x each rank's padded length) over 128, rounded up (``ceil16``, what calibrate public uses) or down
(``floor16``) to the padding multiple of 16. The Llama-3 run is an incomplete row in the table (its allocated peak
follows rank 0's length); it is here because its allocated levels show how far rank 0's length strays from the mean.

    PYTHONPATH=. python benchmarks/liger_kernel_steps.py --csv docs/error_matrix/liger_kernel_steps.csv
"""

from __future__ import annotations

import argparse
import ast
import csv
from pathlib import Path

from calibrate.public import load
from estimator.api import StepSequence, estimate
from estimator.columns import spec_from_columns

GIB = 2**30
RESULTS = Path("data/public/sources/liger_kernel/38411af30940/examples/huggingface/results")
RUNS = {"Mistral-7B-v0.1": "mistral_use_liger_False_patching_type_None.log",
        "Meta-Llama-3-8B": "llama_use_liger_False_patching_type_None.log"}
ROUNDINGS = {"ceil16": lambda tokens: -(-tokens // (128 * 16)) * 16, "floor16": lambda tokens: tokens // (128 * 16) * 16}


def step_lines(log: str) -> list[dict]:
    return [ast.literal_eval(line) for line in (RESULTS / log).read_text().splitlines()
            if line.startswith("{") and "train_runtime" not in line]


def rows(table: Path) -> list[dict]:
    out = []
    measured = load(table)
    for model, log in RUNS.items():
        row = next(r for r in measured if r["source"] == "liger_kernel" and f":{model}:" in r["row_id"])
        spec = spec_from_columns(row)
        lines = step_lines(log)
        seen = [line["num_input_tokens_seen"] for line in lines]
        increments = [after - before for before, after in zip([0] + seen, seen)]
        for rounding, rnd in ROUNDINGS.items():
            lengths = [rnd(tokens) for tokens in increments]
            for k in range(2, len(lines) + 1):
                line = lines[k - 1]
                alloc = estimate(spec.replace(**{"training.seq_len": lengths[k - 1]}),
                                 replay_reserved=False).peak_allocated_bytes
                sequence = StepSequence(shapes=tuple((32, n) for n in lengths[:k]))
                reserved = estimate(spec.replace(**{"training.seq_len": max(lengths[:k])}),
                                    sequence=sequence).peak_reserved_bytes
                m_alloc = line["step_peak_memory_allocated_MB"] * 2**20
                m_res = line["step_peak_memory_reserved_MB"] * 2**20
                out.append({"model": model, "rounding": rounding, "step": line["step"], "padded_len": lengths[k - 1],
                            "measured_allocated_gib": round(m_alloc / GIB, 3),
                            "estimated_allocated_gib": round(alloc / GIB, 3),
                            "allocated_err_pct": round(100 * (alloc / m_alloc - 1), 2),
                            "measured_reserved_gib": round(m_res / GIB, 3),
                            "replayed_reserved_gib": round(reserved / GIB, 3),
                            "reserved_err_pct": round(100 * (reserved / m_res - 1), 2)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path, default=Path("data/public/measurements.csv"))
    parser.add_argument("--csv", type=Path, required=True)
    args = parser.parse_args()
    out = rows(args.table)
    with args.csv.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(out[0]))
        writer.writeheader()
        writer.writerows(out)
    for r in out:
        print(*r.values(), sep="\t")


if __name__ == "__main__":
    main()
