"""Does FSDP1 with peft's wrap policy cost more per sample than one GPU? A real CPU run, every storage counted.

    PYTHONPATH=. .venv/bin/python benchmarks/fsdp1_lora_per_sample.py [--seq-len 256] [--vocab-size 1024] [--layers 8]

The fms-acceleration Mistral-7B LoRA rows on two GPUs (FSDP1, peft's ``fsdp_auto_wrap_policy``, reentrant
checkpointing, packed 4,096-token rows) grow by 0.4-0.7 GiB more per sample than the same commits' one-GPU rows,
while their batch-independent part matches the estimate. (Found in session 24 with ``fsdp1_lora_versions.py``
under the rows' own torch 2.4.1 and transformers 4.45.2: the reentrant checkpoint around each FSDP1 unit that
transformers before 4.52 makes keeps every recomputed layer's input and its gradient, ``TrainingSpec.
ckpt_reentrant``; this project's torch 2.13 / transformers 5.24, which this script runs, checkpoint inside the unit
and keep nothing.) This runs the step on real CPU tensors on the fake
process group (``harness.fake.memtracker.build(..., fake=False)``, the peak of live storages over two steady
steps: ``harness.fake.live_storage.peak_bytes``) for a tiny Mistral with LoRA r 8 on q, k, v, o (dropout 0.1) and
checkpointing, at micro-batch 1 and 2: one GPU, and FSDP1 x 2 (rank 1) with use_orig_params off and on, each with
reentrant and non-reentrant checkpointing. It prints each case's peak and its growth per sample. Each point runs
in its own interpreter (a fresh process group and allocator state). The defaults keep the logits (vocab x 13 B
per token at the loss) below the layers' share, as Mistral-7B's are (32,000 vocab beside 32 layers of 4,096):
with a vocabulary far above the hidden size the peak sits at the loss, which neither FSDP nor the checkpointing
flavour touches.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_size": 256,
          "intermediate_size": 896, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 4096, "tie_word_embeddings": False}

_POINT = """
import json, sys
import torch.distributed.fsdp as fsdp
import transformers
from harness.fake import live_storage, memtracker as mt

config, reentrant, world, use_orig, b, s = json.loads(sys.argv[1])
enable = transformers.PreTrainedModel.gradient_checkpointing_enable
# The Trainer's default in the rows' transformers (4.39-4.48) is reentrant; the harness builds non-reentrant.
transformers.PreTrainedModel.gradient_checkpointing_enable = (
    lambda self, gradient_checkpointing_kwargs=None: enable(
        self, gradient_checkpointing_kwargs={"use_reentrant": bool(reentrant)}))
if use_orig:  # accelerate's default; the harness's MemTracker build passes use_orig_params=False
    wrapper = fsdp.FullyShardedDataParallel
    fsdp.FullyShardedDataParallel = lambda *a, **k: wrapper(*a, **{**k, "use_orig_params": True})
variant = mt.Variant("bf16", "sdpa", True, "cpu", fsdp_world=world, rank=world - 1,
                     fsdp1="FULL_SHARD" if world > 1 else None, lora_rank=8,
                     lora_targets="q_proj,k_proj,v_proj,o_proj", lora_dropout=0.1)
built = mt.build(config, variant, fake=False)
try:
    print(live_storage.peak_bytes(built, b, s))
finally:
    mt.close(built)
"""


def peak_bytes(config: dict, reentrant: bool, world: int, use_orig: bool, batch: int, seq_len: int) -> int:
    point = json.dumps([config, reentrant, world, use_orig, batch, seq_len])
    done = subprocess.run([sys.executable, "-c", _POINT, point], cwd=ROOT, capture_output=True, text=True,
                          check=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    return int(done.stdout.strip().splitlines()[-1])


def point_arguments(argv: list[str] | None, description: str) -> tuple[argparse.Namespace, dict]:
    """(--seq-len, --vocab-size, --layers) and the tiny Mistral config they make (``fsdp1_lora_versions`` too)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args(argv)
    if args.seq_len < 8 or args.vocab_size < 16 or args.layers < 1:
        parser.error("--seq-len must be at least 8, --vocab-size at least 16, --layers at least 1")
    return args, {**CONFIG, "vocab_size": args.vocab_size, "num_hidden_layers": args.layers}


def main(argv: list[str] | None = None) -> int:
    args, config = point_arguments(argv, __doc__.split("\n\n")[0])
    print("case | peak b1 (B) | peak b2 (B) | per sample (B)")
    for world, use_orig in ((1, False), (2, False), (2, True)):
        for reentrant in (False, True):
            b1, b2 = (peak_bytes(config, reentrant, world, use_orig, b, args.seq_len) for b in (1, 2))
            name = ("one GPU" if world == 1 else f"FSDP1 x2 use_orig_params={use_orig}") + (
                ", reentrant" if reentrant else ", non-reentrant")
            print(f"{name} | {b1:,} | {b2:,} | {b2 - b1:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
