"""Estimator allocated peak vs a full-depth fake-tensor trace of the real transformers model (CPU oracle).

    .venv/bin/python benchmarks/error_matrix.py [--models A B ...] [--quick] [--csv out.csv]
    .venv/bin/python benchmarks/error_matrix.py --method tp --tp 4 [--models ...] [--corners] [--csv out.csv]

Matrix: architectures x batch {1,4,16} x seq {128,512,2048} x checkpointing x eager/sdpa x fp32/bf16 (sequences
beyond a model's positions are skipped). Prints one row per point (per rank for distributed methods) and the
max |error|. ``single``: the oracle is a direct two-step StorageRecorder trace (``tests/estimator/oracle_util``,
storages unrounded). Other torch-native methods (``tp``, ``ddp``, ``fsdp``, ``dp_tp``): ``harness.fake.trace_run``
(two steps, fake process group, ranks 0 and N-1, each storage rounded to ``--round-to`` bytes, 512 like the CUDA
caching allocator; the estimator's profile is unrounded, which costs well under 0.1 % at these sizes). Both run
AdamW foreach with zero_grad(set_to_none). ``--corners``: only the corners of the matrix (b, s) in
{(1, 128), (16, 2048)} plus (4, 512), for the variants (fp32, eager, no ckpt) and (bf16, sdpa, ckpt).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import sys
import time

from estimator.api import estimate
from estimator.models.arch import load_config, resolve_arch
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec

MODELS = ("facebook/opt-125m", "bigscience/bloom-560m", "Salesforce/codegen-350M-nl", "EleutherAI/pythia-1b",
          "HuggingFaceTB/SmolLM2-135M", "Qwen/Qwen2.5-0.5B", "bigcode/gpt_bigcode-santacoder")
# Families with a TP plan (estimator.models.tp_plans); SmolLM2-135M's 9 heads / 3 kv heads and santacoder's MQA do not split.
TP_MODELS = ("facebook/opt-125m", "bigscience/bloom-560m", "Salesforce/codegen-350M-nl", "EleutherAI/pythia-1b",
             "meta-llama/Llama-3.2-1B", "Qwen/Qwen2.5-0.5B", "EleutherAI/gpt-neo-1.3B", "microsoft/BioGPT-Large")
CORNER_POINTS = ((1, 128), (4, 512), (16, 2048))
CORNER_VARIANTS = ((False, "eager", "fp32"), (True, "sdpa", "bf16"))


def _variant(text: str) -> tuple[bool, str, str]:
    """"fp32-eager-nockpt" -> (grad_ckpt, attn, precision)."""
    precision, attn, ckpt = text.split("-")
    return ckpt == "ckpt", attn, precision


def _points(args) -> list[tuple]:
    if args.corners:
        variants = [_variant(v) for v in args.variants] if args.variants else CORNER_VARIANTS
        return [(b, s, ckpt, attn, precision) for (ckpt, attn, precision) in variants
                for b, s in CORNER_POINTS]
    batches, seqs = ((1, 4), (128, 512)) if args.quick else ((1, 4, 16), (128, 512, 2048))
    return [(b, s, ckpt, attn, precision) for ckpt, attn, precision, b, s in
            itertools.product((False, True), ("eager", "sdpa"), ("fp32", "bf16"), batches, seqs)]


def _traced(spec: RunSpec, model: str, round_to: int) -> dict[int, int]:
    """rank -> traced peak allocated bytes."""
    if spec.parallel.method == "single":
        from tests.estimator.oracle_util import traced_peak_bytes

        return {0: traced_peak_bytes(load_config(model), spec.training)}
    from harness.fake import trace_run

    result = trace_run(spec, round_to=round_to)
    return {rank: rec["peak_allocated_bytes"] for rank, rec in result["per_rank"].items()}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="*", default=None)
    parser.add_argument("--method", default="single", choices=("single", "ddp", "fsdp", "tp", "dp_tp"))
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (tp: default --gpus)")
    parser.add_argument("--gpus", type=int, default=None, help="world size (default: tp for tp, 2 otherwise)")
    parser.add_argument("--quick", action="store_true", help="batch {1,4}, seq {128,512} only")
    parser.add_argument("--corners", action="store_true", help="corners of the matrix only (see module doc)")
    parser.add_argument("--variants", nargs="*", help="with --corners: PRECISION-ATTN-CKPT|NOCKPT, e.g. "
                        "bf16-eager-ckpt (default fp32-eager-nockpt bf16-sdpa-ckpt)")
    parser.add_argument("--round-to", type=int, default=512, help="oracle storage rounding (non-single methods)")
    parser.add_argument("--csv")
    args = parser.parse_args()
    sys.path.insert(0, ".")

    method = args.method
    tp = args.tp or (args.gpus if method == "tp" and args.gpus else (2 if method in ("tp", "dp_tp") else 1))
    gpus = args.gpus or (tp if method == "tp" else (1 if method == "single" else 2 * tp))
    parallel = ParallelSpec(method=method, world_size=gpus, tp=tp)
    models = args.models or list(TP_MODELS if tp > 1 else MODELS)
    rows, worst = [], 0.0
    for model in models:
        max_pos = resolve_arch(model).max_positions
        for b, s, ckpt, attn, precision in _points(args):
            if max_pos and s > max_pos:
                continue
            training = TrainingSpec(micro_batch_size=b, seq_len=s, grad_ckpt=ckpt, attn=attn, precision=precision)
            spec = RunSpec(model=model, parallel=parallel, training=training)
            try:
                est = estimate(spec)
            except ValueError as err:
                if str(err).startswith("tp:"):
                    print(f"{model}: skipped ({err})", flush=True)
                    break
                raise
            started = time.perf_counter()
            traced = _traced(spec, model, args.round_to)
            ranks = {r.rank: r for r in est.ranks}
            for rank, value in sorted(traced.items()):
                mine = ranks.get(rank, est.ranks[-1])
                predicted = mine.traced_allocated_bytes
                err = (predicted - value) / value
                worst = max(worst, abs(err))
                rows.append({"model": model, "method": method, "world_size": gpus, "tp": tp, "rank": rank,
                             "micro_batch_size": b, "seq_len": s, "grad_ckpt": ckpt, "attn": attn,
                             "precision": precision, "predicted_bytes": predicted, "traced_bytes": value,
                             "error_pct": round(100 * err, 4), "trace_s": round(time.perf_counter() - started, 1)})
                print(" ".join(f"{v}" for v in rows[-1].values()), flush=True)
    if args.csv and rows:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    print(f"points {len(rows)}  max |error| {100 * worst:.4f} %")
    return 0 if worst < 0.01 else 1


if __name__ == "__main__":
    raise SystemExit(main())
