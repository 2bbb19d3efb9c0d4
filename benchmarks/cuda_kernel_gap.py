"""Where the CUDA path's kernels save different tensors than the CPU kernels a fake CPU trace runs.

    PYTHONPATH=. .venv/bin/python benchmarks/cuda_kernel_gap.py [--csv out.csv]

For each case: the estimate (peak allocated minus cuBLAS workspace), the MemTracker oracle on the CPU kernels and
on the CUDA kernel choice (``harness.fake.memtracker``), and the padded-batch CPU trace (what issue 13's
reporter measured). Cases: a dropout model (OPT: hidden dropout 0.1), attention dropout with MQA (santacoder:
attn_pdrop 0.1), fp32 SDPA with GQA (Qwen2.5: math fallback on CUDA), and bf16 SDPA with GQA (no gap).
"""

from __future__ import annotations

import argparse
import csv
import sys
import time

CASES = (("facebook/opt-125m", "bf16", "eager", 4, 512), ("bigcode/gpt_bigcode-santacoder", "bf16", "sdpa", 4, 512),
         ("Qwen/Qwen2.5-0.5B", "fp32", "sdpa", 4, 512), ("Qwen/Qwen2.5-0.5B", "bf16", "sdpa", 4, 512))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--csv")
    args = parser.parse_args()
    sys.path.insert(0, ".")
    from estimator.api import estimate
    from estimator.spec import RunSpec, TrainingSpec
    from harness.fake import memtracker as mt

    rows = []
    for model, precision, attn, b, s in CASES:
        training = TrainingSpec(micro_batch_size=b, seq_len=s, precision=precision, attn=attn)
        est = estimate(RunSpec(model=model, training=training))
        row = {"model": model, "precision": precision, "attn": attn, "micro_batch_size": b, "seq_len": s,
               "estimate_bytes": est.traced_allocated_bytes}
        config = mt.load_model_config(model)
        for name, kernels, batch in (("cpu", "cpu", "full"), ("cuda", "cuda", "full"), ("cpu_padded", "cpu", "padded"),
                                     ("cuda_padded", "cuda", "padded")):
            started = time.perf_counter()
            row[f"memtracker_{name}_bytes"] = mt.oracle_peak(config, mt.Variant(precision, attn, False, kernels), b, s,
                                                             "trainer", batch)
            row[f"{name}_s"] = round(time.perf_counter() - started, 1)
        row["estimate_vs_cuda_pct"] = round(100 * (row["estimate_bytes"] / row["memtracker_cuda_bytes"] - 1), 3)
        rows.append(row)
        print(row, flush=True)
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
