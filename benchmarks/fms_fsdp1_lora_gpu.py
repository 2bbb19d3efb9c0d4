"""fms-acceleration's plain Mistral-7B LoRA rows re-run on one CUDA GPU, with the rows' transformers and peft.

    PYTHONPATH=<transformers 4.48.1, peft 0.13.2, tokenizers 0.21, huggingface-hub 0.27> \\
        python3 benchmarks/fms_fsdp1_lora_gpu.py [--batches 2,4] [--worlds 2,1] [--layers 32] [--json OUT]

The rows (data/public, ``fms_acceleration:24bdadb228e2:none:Mistral-7B-v0.1:lora:*``): Mistral-7B-v0.1, pure
bf16 weights (``torch_dtype=bfloat16``, no --bf16 autocast), LoRA r 16 / alpha 16 / dropout 0.1 on q, k, v, o
(peft upcasts the adapters to fp32), packed rows of 4,096 tokens with no attention mask, the HF Trainer of
transformers 4.48 with gradient checkpointing left at its default (reentrant, called by the model's layer loop
around each decoder layer), TRL's ``enable_input_require_grads``, accelerate's FSDP1 (peft's auto-wrap
policy, FULL_SHARD, BACKWARD_PRE, use_orig_params, limit_all_gathers) at 2 GPUs, foreach AdamW with the
Trainer's two parameter groups, gradient clipping at 1.0, and ``max_memory_allocated`` of rank 0.

Here rank 0 of 2 runs alone on torch's fake process group (the collectives do nothing; every buffer a rank
holds is allocated as on the real job), with SDPA for flash-attn 2 (the rows' kernel: the same saved tensors
for an unmasked causal bf16 attention), each point in its own interpreter. The model is built on the GPU and
the peak is reset after wrapping, so it is that of two training steps (the Trainer's memory tracker reads the
whole of ``train()``, whose first step is the higher one here: the optimizer's state is created in it).
Each point runs reentrant (the rows) and non-reentrant (what transformers >= 4.52 does in effect): the
difference is the inputs that FSDP1's post-backward hook keeps (``estimator.methods.fsdp1``).

Measured 2026-11-27 (docs/LOG.md, session 25) on one H200, torch 2.11.0+cu130, transformers 4.48.1, peft 0.13.2
(``results/fms_fsdp1_lora_gpu_h200.jsonl``), peak allocated against the rows' published values (flash-attn 2,
torch 2.4.1): FSDP1 x 2 b2 reentrant 15,329,033,216 B (published 15,144,870,400), non-reentrant 14,103,902,720;
b4 reentrant 22,244,523,008 (published 21,959,827,968), non-reentrant 20,257,159,680; one GPU b4 reentrant
27,058,472,960 (published 26,704,571,904), non-reentrant 27,056,375,808. Reentrant checkpointing keeps 1.23 GB
(b2) and 1.99 GB (b4) more under FSDP1 and 2 MB more on one GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

MISTRAL_7B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
              "vocab_size": 32001}  # the tokenizer's added <pad> row

_POINT = r"""
import json, sys, time
import torch
import torch.distributed as dist
import transformers, peft

config, world, b, s, reentrant = json.loads(sys.argv[1])
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
cfg = transformers.MistralConfig(**config)
with torch.device("cuda"):
    model = transformers.MistralForCausalLM._from_config(cfg, attn_implementation="sdpa", torch_dtype=torch.bfloat16)
torch.set_default_dtype(torch.float32)
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": bool(reentrant)})
model.enable_input_require_grads()
model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, lora_dropout=0.1,
                                                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                                   task_type="CAUSAL_LM"))
model.train()
if world > 1:
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy, BackwardPrefetch
    from peft.utils.other import fsdp_auto_wrap_policy
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    model = FSDP(model, auto_wrap_policy=fsdp_auto_wrap_policy(model), use_orig_params=True,
                 sharding_strategy=ShardingStrategy.FULL_SHARD, backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                 forward_prefetch=False, limit_all_gathers=True, device_id=torch.device("cuda", 0))
    clip = lambda: model.clip_grad_norm_(1.0)
else:
    clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
groups = [{"params": [p for n, p in trainable if "bias" not in n and "norm" not in n], "weight_decay": 0.0},
          {"params": [p for n, p in trainable if "bias" in n or "norm" in n], "weight_decay": 0.0}]
opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=1e-4)
ids = torch.randint(0, cfg.vocab_size, (b, s), device="cuda")
torch.cuda.synchronize()
setup_peak = torch.cuda.max_memory_allocated()
torch.cuda.reset_peak_memory_stats()
start = time.perf_counter()
peaks = []
for _ in range(2):
    out = model(input_ids=ids, labels=ids)
    loss = out["loss"]
    del out
    loss.backward()
    clip()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    peaks.append(torch.cuda.max_memory_allocated())
print(json.dumps({"world": world, "batch": b, "seq_len": s, "reentrant": bool(reentrant),
                  "peak_allocated_bytes": max(peaks), "peak_after_step_bytes": peaks,
                  "peak_reserved_bytes": torch.cuda.max_memory_reserved(), "setup_peak_bytes": setup_peak,
                  "step_s": (time.perf_counter() - start) / 2, "torch": torch.__version__,
                  "transformers": transformers.__version__, "peft": peft.__version__,
                  "gpu": torch.cuda.get_device_name()}))
"""


def run_point_script(script: str, args: list, error_fields: dict) -> dict:
    """``script`` in its own interpreter (a point that dies takes nothing else with it) with ``args`` as its JSON
    argument: its last stdout line as JSON, else ``error_fields`` with the last line of its stderr."""
    done = subprocess.run([sys.executable, "-c", script, json.dumps(args)], capture_output=True, text=True)
    if done.returncode:
        return {**error_fields, "error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_point(config: dict, world: int, batch: int, seq_len: int, reentrant: bool) -> dict:
    return run_point_script(_POINT, [config, world, batch, seq_len, reentrant],
                            {"world": world, "batch": batch, "seq_len": seq_len, "reentrant": reentrant})


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=_ints, default=[2, 4])
    parser.add_argument("--worlds", type=_ints, default=[2, 1])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=MISTRAL_7B["num_hidden_layers"])
    parser.add_argument("--json", help="append one JSON line per point to this file")
    args = parser.parse_args(argv)
    config = {**MISTRAL_7B, "num_hidden_layers": args.layers}
    print("world | batch | reentrant | peak allocated (B) | peak reserved (B) | s/step")
    for world in args.worlds:
        for batch in args.batches:
            for reentrant in (True, False):
                point = run_point(config, world, batch, args.seq_len, reentrant)
                if args.json:
                    with open(args.json, "a") as out:
                        out.write(json.dumps(point) + "\n")
                if "error" in point:
                    print(f"{world} | {batch} | {reentrant} | error: {point['error']}", flush=True)
                    continue
                print(f"{world} | {batch} | {reentrant} | {point['peak_allocated_bytes']:,} | "
                      f"{point['peak_reserved_bytes']:,} | {point['step_s']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
