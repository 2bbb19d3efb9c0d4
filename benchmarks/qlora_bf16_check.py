"""QLoRA without kbit preparation (``qlora`` + ``lora_dtype model``: answer.ai fsdp_qlora's recipe) against a real
bitsandbytes run on CPU tensors: a tiny Llama, NF4 double-quantized decoder linears (quantized by bitsandbytes on
the move to the CPU), embedding, norms, head and adapters bf16, two AdamW steps, every storage counted in 512-byte
blocks (``harness.fake.trace_run(spec, fake_tensors=False)``, a subprocess per point), beside the estimator's
traced allocated peak (the profile traced with fake tensors) at several batch / sequence points.

    PYTHONPATH=. nice .venv/bin/python benchmarks/qlora_bf16_check.py [--out docs/error_matrix/qlora_bf16.csv]
    PYTHONPATH=. nice .venv/bin/python benchmarks/qlora_bf16_check.py --fp32-adapters \
        --out docs/error_matrix/qlora_bf16_fp32_adapters.csv

``--fp32-adapters``: ``qlora_prep`` none with ``lora_dtype`` auto (no kbit preparation, peft's fp32 adapters: each
takes an fp32 copy of its input), as peft 0.13 leaves a uint8-stored 4-bit base's adapters.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# tests/estimator/test_qlora.py's SMALL llama: wide enough that the NF4 blocks and 512-byte rounding do not dominate
CONFIG = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 320, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048, "max_position_embeddings": 1024,
          "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
POINTS = [  # (micro-batch, seq, checkpointing, attention, LoRA targets)
    (1, 64, False, "sdpa", "auto"), (2, 128, False, "sdpa", "auto"), (4, 256, False, "sdpa", "all-linear"),
    (2, 128, True, "sdpa", "auto"), (4, 256, True, "eager", "all-linear"), (8, 128, False, "eager", "auto"),
]
REAL = ("import json, sys; from estimator.spec import RunSpec; from harness.fake import trace_run; "
        "spec = RunSpec.from_json(sys.stdin.read()); "
        "print(json.dumps(trace_run(spec, fake_tensors=False)['per_rank'][0]))")


def spec_for(config_path: Path, b: int, s: int, ckpt: bool, attn: str, targets: str, fp32_adapters: bool = False,
             dropout: float = 0.0):
    from estimator.spec import RunSpec, TrainingSpec

    recipe = {"qlora_prep": "none"} if fp32_adapters else {"lora_dtype": "model"}
    return RunSpec(model=str(config_path), training=TrainingSpec(
        precision="bf16", micro_batch_size=b, seq_len=s, grad_ckpt=ckpt, attn=attn, lora_rank=8,
        lora_targets=targets, lora_dropout=dropout, qlora=True, **recipe))


def main() -> None:
    from estimator.api import estimate

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "docs/error_matrix/qlora_bf16.csv"))
    parser.add_argument("--fp32-adapters", action="store_true")
    parser.add_argument("--dropout", type=float, default=0.0, help="LoRA dropout (CPU masks: the trace draws CUDA's)")
    parser.add_argument("--points", type=int, default=len(POINTS), help="the first N points only")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(CONFIG))
        for b, s, ckpt, attn, targets in POINTS[:args.points]:
            spec = spec_for(path, b, s, ckpt, attn, targets, args.fp32_adapters, args.dropout)
            out = subprocess.run([sys.executable, "-c", REAL], input=spec.to_json(), capture_output=True, text=True,
                                 cwd=ROOT, check=True)
            measured = json.loads(out.stdout.strip().splitlines()[-1])["peak_allocated_bytes"]
            est = estimate(spec)
            predicted = est.ranks[0].traced_allocated_bytes
            rows.append({"adapters": "fp32" if args.fp32_adapters else "bf16", "micro_batch": b, "seq": s, "grad_ckpt": ckpt, "attn": attn, "lora_targets": targets,
                         "measured_bytes": measured, "predicted_bytes": predicted,
                         "weights_bytes": int(est.breakdown["weights"]),
                         "error_pct": round(100 * (predicted - measured) / measured, 3)})
            print(rows[-1], flush=True)
    with open(args.out, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    worst = max(abs(r["error_pct"]) for r in rows)
    print(f"{len(rows)} points, max |error| {worst:.3f} %")


if __name__ == "__main__":
    main()
