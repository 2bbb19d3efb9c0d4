"""Does peft's input hook change dense every-k LoRA estimates? (helper moek, issue 17; docs/error_matrix/README.md)

With checkpointing on, ``get_peft_model`` makes the embedding output need a gradient (``enable_input_require_grads``);
the plain profile every-k mixes with the checkpointed one is traced without checkpointing, so without that hook.
This estimates the ``every-k`` LoRA rows of ``docs/error_matrix/long_context_lora_counted_cpu.csv`` (small-llama and
small-opt, (2, 512), r16 q_proj/v_proj, bf16, eager) with the plain profile as it is and traced with the hook
(``estimator.profiler.build.embedding_output_grads``), against the rows' measured bytes.

    LLMEM_CACHE_DIR=$(mktemp -d) PYTHONPATH=. .venv/bin/python benchmarks/every_k_input_hook.py
"""

from __future__ import annotations

import csv
import json
import tempfile
from pathlib import Path

import estimator.profiler.cache as cache
from benchmarks import long_context_check as lc
from estimator.api import estimate
from estimator.spec import RunSpec, TrainingSpec

TABLE = Path(__file__).resolve().parents[1] / "docs" / "error_matrix" / "long_context_lora_counted_cpu.csv"


def main() -> int:
    rows = [r for r in csv.DictReader(TABLE.open()) if r["technique"].startswith("every-k")
            and r["precision"] == "bf16"]
    plain_loader = cache.load_model_profile

    def hooked_loader(model, training, tp=1, **kwargs):
        if training.lora and not training.grad_ckpt:
            kwargs["input_grads"] = True
        return plain_loader(model, training, tp, **kwargs)

    tmp = Path(tempfile.mkdtemp())
    try:
        for row in rows:
            path = tmp / f"{row['model']}.json"
            path.write_text(json.dumps(lc._config(row["model"])))
            every = row["technique"].split()[0]
            training = TrainingSpec(micro_batch_size=int(row["micro_batch_size"]), seq_len=int(row["seq_len"]),
                                    precision=row["precision"], attn="eager", grad_ckpt=True, ckpt_policy=every,
                                    lora_rank=16, lora_targets="q_proj,v_proj")
            measured = int(row["measured_bytes"])
            out = []
            for label, loader in (("plain", plain_loader), ("hooked", hooked_loader)):
                cache.load_model_profile = loader
                predicted = estimate(RunSpec(model=str(path), training=training)).traced_allocated_bytes
                out.append(f"{label} {predicted} ({100 * (predicted - measured) / measured:+.3f} %)")
            print(row["model"], every, row["precision"], "measured", measured, *out, flush=True)
    finally:
        cache.load_model_profile = plain_loader
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
