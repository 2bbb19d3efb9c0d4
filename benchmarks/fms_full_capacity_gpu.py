"""fms-acceleration's Mistral-7B full fine-tuning on one GPU, re-run near an A100-80GB's capacity, sampled as the
rows were sampled.

    PYTHONPATH=<transformers 4.48.1, ...> python3 benchmarks/fms_full_capacity_gpu.py \\
        [--batches 4,8] [--steps 6] [--cap-gib 79.5] [--lora-rank 16] [--snapshot-dir DIR [--stack-frames]] [--json OUT]

The rows (data/public, ``fms_acceleration:*:none:Mistral-7B-v0.1:full:x1:b{4,8}:nvml``): Mistral-7B-v0.1 in pure
bf16 (``torch_dtype=bfloat16``: bf16 weights, gradients and AdamW states), packed rows of 4,096 tokens with no
attention mask, flash-attn 2 (here SDPA: the same saved tensors for an unmasked causal bf16 attention), the HF
Trainer's reentrant per-layer checkpointing, foreach AdamW with two parameter groups, clipping at 1.0, 100 steps;
the value is (peak - first) of nvidia-smi's memory.used, sampled every second. The published b8 level (70-72
GiB) is below the b4 one (74-75 GiB) with the same allocated peak (the optimizer step), and the estimator's
replay puts b8 at the allocator's limit with one release-and-retry (docs/report/public.md). This runs the step
with the allocator capped where an A100-80GB's would stop (``--cap-gib``, torch's
``set_per_process_memory_fraction``: 80 GiB less a 0.5 GiB context by default), samples the device's used memory
every second and every 50 ms from a thread (``cudaMemGetInfo``: the device-wide figure nvidia-smi shows), and
writes the allocator's history (every segment event, with times) so the retry path can be replayed.
``--lora-rank 16`` runs the rows' single-GPU LoRA instead (``...:lora:x1:b{4,8}:nvml``; needs peft 0.13.2): at
32,001 vocabulary rows the estimate holds one fp32-logits segment more than those rows publish
(``benchmarks/fms_lora_loss_segments.py``), and its snapshot tells whether the GPU makes it.

Each point runs in its own interpreter; the peaks are those of the whole process, setup included (the
Trainer's first reading is before the model reaches the GPU).
"""

from __future__ import annotations

import argparse
import json
import sys

from fms_fsdp1_lora_gpu import MISTRAL_7B, _ints, run_point_script

_POINT = r"""
import gzip, json, pickle, sys, threading, time
import torch
import transformers

config, b, s, steps, cap_gib, snapshot, lora_rank, frames = json.loads(sys.argv[1])
torch.cuda.init()
total = torch.cuda.get_device_properties(0).total_memory
if cap_gib:
    torch.cuda.set_per_process_memory_fraction(cap_gib * 2**30 / total)


def used():
    free, total_now = torch.cuda.mem_get_info()
    return total_now - free


first = used()
samples = {1.0: [], 0.05: []}
stop = threading.Event()


def sampler(interval):
    while not stop.is_set():
        samples[interval].append((time.perf_counter(), used()))
        time.sleep(interval)


threads = [threading.Thread(target=sampler, args=(i,), daemon=True) for i in samples]
for t in threads:
    t.start()
if snapshot:
    # frames: each request's Python stack (a larger history; names the temporaries a CPU trace lacks)
    torch.cuda.memory._record_memory_history(enabled="all", context="all" if frames else None, stacks="python",
                                             max_entries=3_000_000)
torch.manual_seed(0)
cfg = transformers.MistralConfig(**config)
with torch.device("cuda"):
    model = transformers.MistralForCausalLM._from_config(cfg, attn_implementation="sdpa", torch_dtype=torch.bfloat16)
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
if lora_rank:  # the rows' LoRA: fms-hf-tuning's q/k/v/o adapters through TRL (fp32 adapters, input grads on)
    import peft
    model.enable_input_require_grads()
    model = peft.get_peft_model(model, peft.LoraConfig(r=lora_rank, lora_alpha=16, lora_dropout=0.1,
                                                       target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                                       task_type="CAUSAL_LM"))
model.train()
named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
groups = [{"params": [p for n, p in named if "bias" not in n and "norm" not in n], "weight_decay": 0.0},
          {"params": [p for n, p in named if "bias" in n or "norm" in n], "weight_decay": 0.0}]
opt = torch.optim.AdamW(groups, lr=1e-5)
ids = torch.randint(0, cfg.vocab_size, (b, s), device="cuda")
torch.cuda.synchronize()
setup_peak = torch.cuda.max_memory_allocated()
per_step, error = [], None
start = time.perf_counter()
try:
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        loss = out["loss"]
        del out
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        per_step.append({"s": round(time.perf_counter() - t0, 3),
                         "max_allocated": torch.cuda.max_memory_allocated(),
                         "max_reserved": torch.cuda.max_memory_reserved(),
                         "reserved_after": torch.cuda.memory_reserved(),
                         "num_alloc_retries": stats.get("num_alloc_retries", 0),
                         "num_ooms": stats.get("num_ooms", 0)})
except torch.OutOfMemoryError as exc:
    error = str(exc).splitlines()[0]
stop.set()
for t in threads:
    t.join()
snap_bytes = None
if snapshot:
    data = gzip.compress(pickle.dumps(torch.cuda.memory._snapshot()), compresslevel=6)
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(snapshot, "wb") as handle:
        handle.write(data)
    snap_bytes = len(data)
peak = {f"{k:g}s": max(v for _, v in rows) - first for k, rows in samples.items() if rows}
print(json.dumps({"batch": b, "seq_len": s, "steps": steps, "cap_gib": cap_gib, "lora_rank": lora_rank,
                  "error": error,
                  "device_total_bytes": total, "first_used_bytes": first, "sampled_peak_minus_first_bytes": peak,
                  "sampled_used_timeline": [(round(t - start, 2), u) for t, u in samples[1.0]],
                  "setup_peak_allocated_bytes": setup_peak, "per_step": per_step, "snapshot_bytes": snap_bytes,
                  "torch": torch.__version__, "transformers": transformers.__version__,
                  "gpu": torch.cuda.get_device_name()}))
"""


def run_point(config: dict, batch: int, seq_len: int, steps: int, cap_gib: float | None,
              snapshot: str | None, lora_rank: int = 0, frames: bool = False) -> dict:
    return run_point_script(_POINT, [config, batch, seq_len, steps, cap_gib, snapshot, lora_rank, frames],
                            {"batch": batch, "seq_len": seq_len, "cap_gib": cap_gib, "lora_rank": lora_rank})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=_ints, default=[8, 4])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=MISTRAL_7B["num_hidden_layers"])
    parser.add_argument("--cap-gib", type=float, default=79.5,
                        help="the allocator's limit (GiB; 0: the whole device); default: an A100-80GB less 0.5 GiB")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="the rows' LoRA (q/k/v/o, alpha 16, dropout 0.1; needs peft) instead of full fine-tuning")
    parser.add_argument("--snapshot-dir", help="write each point's allocator history here")
    parser.add_argument("--stack-frames", action="store_true",
                        help="record each request's Python stack in the snapshot (with --snapshot-dir; larger files)")
    parser.add_argument("--json", help="append one JSON line per point to this file")
    args = parser.parse_args(argv)
    config = {**MISTRAL_7B, "num_hidden_layers": args.layers}
    print("batch | steps | 1 s sampled peak - first (B) | 50 ms | max allocated | max reserved | retries | s/step")
    for batch in args.batches:
        kind = f"lora{args.lora_rank}" if args.lora_rank else "full"
        snapshot = (f"{args.snapshot_dir}/fms_mistral7b_{kind}_b{batch}.snapshot.pickle.gz" if args.snapshot_dir
                    else None)
        point = run_point(config, batch, args.seq_len, args.steps, args.cap_gib or None, snapshot, args.lora_rank,
                          args.stack_frames)
        if args.json:
            with open(args.json, "a") as out:
                out.write(json.dumps(point) + "\n")
        steps = point.get("per_step") or []
        if not steps:
            print(f"{batch} | error: {point.get('error')}", flush=True)
            continue
        peak, last = point["sampled_peak_minus_first_bytes"], steps[-1]
        print(f"{batch} | {len(steps)} | {peak.get('1s', 0):,} | {peak.get('0.05s', 0):,} | "
              f"{last['max_allocated']:,} | {last['max_reserved']:,} | {last['num_alloc_retries']} | "
              f"{sum(s['s'] for s in steps) / len(steps):.2f}" + (f" | {point['error']}" if point["error"] else ""),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
