"""Estimator allocated peak vs a full-depth fake-tensor trace of the real transformers model (CPU oracle).

    .venv/bin/python benchmarks/error_matrix.py [--models A B ...] [--quick] [--csv out.csv]

Single-GPU matrix: architectures x batch {1,4,16} x seq {128,512,2048} x checkpointing x eager/sdpa x fp32/bf16.
Prints one row per point and the max |error|. The oracle runs two AdamW-foreach steps with zero_grad(set_to_none).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import sys
import time

from estimator.api import estimate
from estimator.arch import load_config
from estimator.spec import RunSpec, TrainingSpec

MODELS = ("facebook/opt-125m", "bigscience/bloom-560m", "Salesforce/codegen-350M-nl", "EleutherAI/pythia-1b",
          "HuggingFaceTB/SmolLM2-135M", "Qwen/Qwen2.5-0.5B", "bigcode/gpt_bigcode-santacoder")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--quick", action="store_true", help="batch {1,4}, seq {128,512} only")
    parser.add_argument("--csv")
    args = parser.parse_args()
    sys.path.insert(0, ".")
    from tests.estimator.oracle_util import traced_peak_bytes

    batches, seqs = ((1, 4), (128, 512)) if args.quick else ((1, 4, 16), (128, 512, 2048))
    rows, worst = [], 0.0
    for model, b, s, ckpt, attn, precision in itertools.product(args.models, batches, seqs, (False, True),
                                                                ("eager", "sdpa"), ("fp32", "bf16")):
        training = TrainingSpec(micro_batch_size=b, seq_len=s, grad_ckpt=ckpt, attn=attn, precision=precision)
        est = estimate(RunSpec(model=model, training=training))
        predicted = est.peak_allocated_bytes - est.breakdown.get("cublas_workspace", 0)
        started = time.perf_counter()
        traced = traced_peak_bytes(load_config(model), training)
        err = (predicted - traced) / traced
        worst = max(worst, abs(err))
        rows.append({"model": model, "micro_batch_size": b, "seq_len": s, "grad_ckpt": ckpt, "attn": attn,
                     "precision": precision, "predicted_bytes": predicted, "traced_bytes": traced,
                     "error_pct": round(100 * err, 4), "trace_s": round(time.perf_counter() - started, 1)})
        print(" ".join(f"{v}" for v in rows[-1].values()), flush=True)
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    print(f"points {len(rows)}  max |error| {100 * worst:.4f} %")
    return 0 if worst < 0.01 else 1


if __name__ == "__main__":
    raise SystemExit(main())
