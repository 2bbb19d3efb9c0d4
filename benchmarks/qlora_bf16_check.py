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

``--lightning``: LitGPT's QLoRA (``qlora_quantizer lightning``: Lightning's ``BitsandbytesPrecision("nf4-dq")``
quantizes every Linear, the LM head included, from fp16), the real run quantizing with the installed bitsandbytes.
``--bnb 0.41.1``: the run's bitsandbytes is that release (``qlora_bnb``): before 0.43.2 every 4-bit Linear keeps its
input (``estimator.profiler.bnb_041``, a copy of 0.41.1's ``MatMul4Bit`` over the installed kernels, used by both the
real run and the trace, so the real run checks the trace, not the rule). The rule is checked by a count instead,
made from 0.41.1's source, not from the trace: the estimate with the release less the estimate with 0.43.2 against
``kept_input_count`` (needs ``--dropout`` above 0, so no adapter saves a 4-bit Linear's input itself).

    PYTHONPATH=. nice .venv/bin/python benchmarks/qlora_bf16_check.py --lightning --out \
        docs/error_matrix/qlora_lightning.csv
    PYTHONPATH=. nice .venv/bin/python benchmarks/qlora_bf16_check.py --lightning --bnb 0.41.1 --dropout 0.05 \
        --points 4 --out docs/error_matrix/qlora_lightning_bnb041.csv
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
             dropout: float = 0.0, lightning: bool = False, bnb: str = ""):
    from estimator.spec import RunSpec, TrainingSpec

    recipe = {"qlora_prep": "none"} if fp32_adapters else {"lora_dtype": "model"}
    if lightning:
        recipe["qlora_quantizer"] = "lightning"
    return RunSpec(model=str(config_path), training=TrainingSpec(
        precision="bf16", micro_batch_size=b, seq_len=s, grad_ckpt=ckpt, attn=attn, lora_rank=8,
        lora_targets=targets, lora_dropout=dropout, qlora=True, qlora_bnb=bnb, **recipe))


def kept_input_count(b: int, s: int, ckpt: bool, lightning: bool) -> int | None:
    """The bytes bitsandbytes 0.41.1's ``MatMul4Bit`` keeps that a run without it frees, counted from its source
    for this Llama: ``ctx.tensors = (A, B)`` when an input needs a gradient, so each 4-bit Linear whose input
    needs one keeps it, one tensor per distinct input: per layer the attention norm's output (q/k/v), the MLP
    norm's output (gate/up) and the gated product (down); the attention output reaching o_proj is a view of what
    SDPA saves (no new bytes). Layer 0's attention input needs no gradient (a frozen embedding), and with
    Lightning's 4-bit head the final norm's output is kept too. bf16 (2 B). Not counted with checkpointing
    (None): a context attribute is no saved tensor, so non-reentrant checkpointing keeps the forward's inputs as
    well, and the recomputed layer's ones live until its graph goes; where they meet the peak is the trace's."""
    if ckpt:
        return None
    hidden, inter, layers = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["num_hidden_layers"]
    per_token = layers * (2 * hidden + inter) - hidden + (hidden if lightning else 0)
    return b * s * per_token * 2


def main() -> None:
    from estimator.api import estimate

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "docs/error_matrix/qlora_bf16.csv"))
    parser.add_argument("--fp32-adapters", action="store_true")
    parser.add_argument("--dropout", type=float, default=0.0, help="LoRA dropout (CPU masks: the trace draws CUDA's)")
    parser.add_argument("--points", type=int, default=len(POINTS), help="the first N points only")
    parser.add_argument("--lightning", action="store_true", help="Lightning's quantization (the LM head 4-bit too)")
    parser.add_argument("--bnb", default="", help="the run's bitsandbytes release (qlora_bnb; default: installed)")
    args = parser.parse_args()
    if args.bnb and not args.dropout:
        parser.error("--bnb: the kept-input count needs --dropout above 0")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(CONFIG))
        for b, s, ckpt, attn, targets in POINTS[:args.points]:
            spec = spec_for(path, b, s, ckpt, attn, targets, args.fp32_adapters, args.dropout, args.lightning,
                            args.bnb)
            out = subprocess.run([sys.executable, "-c", REAL], input=spec.to_json(), capture_output=True, text=True,
                                 cwd=ROOT, check=True)
            measured = json.loads(out.stdout.strip().splitlines()[-1])["peak_allocated_bytes"]
            est = estimate(spec)
            predicted = est.ranks[0].traced_allocated_bytes
            rows.append({"adapters": "fp32" if args.fp32_adapters else "bf16", "micro_batch": b, "seq": s, "grad_ckpt": ckpt, "attn": attn, "lora_targets": targets,
                         "measured_bytes": measured, "predicted_bytes": predicted,
                         "weights_bytes": int(est.breakdown["weights"]),
                         "error_pct": round(100 * (predicted - measured) / measured, 3)})
            if args.lightning:
                rows[-1] = {"quantizer": "lightning", **rows[-1]}
            if args.bnb:  # the kept inputs: the estimate's difference from 0.43.2 against the source's count
                without = estimate(spec.replace(**{"training.qlora_bnb": "0.43.2"})).ranks[0].traced_allocated_bytes
                rows[-1].update(bnb=args.bnb, kept_predicted_bytes=predicted - without,
                                kept_counted_bytes=kept_input_count(b, s, ckpt, args.lightning))
            print(rows[-1], flush=True)
    with open(args.out, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    worst = max(abs(r["error_pct"]) for r in rows)
    print(f"{len(rows)} points, max |error| {worst:.3f} %")


if __name__ == "__main__":
    main()
