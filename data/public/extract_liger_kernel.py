"""Rows from linkedin/Liger-Kernel's Hugging Face Trainer example (``examples/huggingface``, Sep 2024): full
fine-tuning of Meta-Llama-3-8B and Mistral-7B-v0.1 under FSDP1 on one node of 4 x A100 80GB, each run a log of
per-step torch memory peaks. Only the runs without Liger's kernels (``use_liger False``) are kept: the patched
runs replace RMSNorm, RoPE, SwiGLU and the loss with Triton kernels the estimator does not model. Another
publisher, script and harness than the a100-80gb sources already in the table (fms_acceleration,
ms_swift_benchmark, universal_llm_trainer).

Files copied at 38411af (the commit that added the Llama log; the Mistral log is unchanged since 92047d9e, which
added it) and, for the run script and its batch size, at 92047d9e (``run_patching_methods.sh``: the next commit
switched the script to Gemma with batch 24, after the Llama run). What the numbers mean, from the code:

* ``callback.py`` (``EfficiencyCallback``): ``torch.cuda.reset_peak_memory_stats()`` at every step begin,
  ``max_memory_allocated()`` / ``max_memory_reserved()`` at step end, divided by 2**20 ("MB" = MiB), logged from
  step 2 on (``n_warmup_steps=2`` skips global step 1; the log's ``step`` key is the global step). The Trainer logs on rank 0 only:
  rank 0's peaks. The row is the largest step peak (``total_peak_*`` on the last line, checked equal).
* ``run_patching_methods.sh`` (92047d9e): ``torchrun --nproc-per-node=4 training.py --bf16 --max_steps 10
  --per_device_train_batch_size 32 --fsdp "full_shard auto_wrap" --fsdp_config config/fsdp_config.json``, HF
  Trainer defaults otherwise (``adamw_torch``, no accumulation). The batch is checked against the log:
  ``train_samples_per_second x train_runtime`` = 10 steps x 4 ranks x 32 samples, and every step's
  ``num_input_tokens_seen`` increment (the sum over ranks of batch x padded length) is a multiple of 32 x 16.
* ``config/fsdp_config.json``: ``backward_prefetch backward_pre``, ``forward_prefetch true``,
  ``activation_checkpointing true`` (accelerate's ``apply_activation_checkpointing``: a non-reentrant
  checkpoint wrapper around each decoder layer); the Trainer's defaults otherwise (``use_orig_params`` true, the
  transformer-layer wrap policy from the model's ``_no_split_modules``; accelerate's ``limit_all_gathers`` true).
* ``training.py``: ``AutoModelForCausalLM.from_pretrained(..., use_cache=False, torch_dtype=bfloat16)``
  (attention at transformers' default: SDPA), TRL's SFTTrainer with ``max_seq_length=512`` over tatsu-lab/alpaca's
  ``text`` field and ``DataCollatorForCompletionOnlyLM(pad_to_multiple_of=16)``, tokenizer padding left with the
  EOS token as pad: each batch padded to its longest sample (a multiple of 16), at most 512 tokens, with an
  attention mask (``batch=padded``).
* precision: ``--bf16`` under FSDP over bf16 weights: accelerate upcasts the trainable flat parameters to fp32 and
  autocasts the step (``mixed_bf16``, the estimator's own reading, as for fms_acceleration's FSDP rows); the
  Trainer's accelerate wrapper returns fp32 outputs (``outputs_fp32``).
* the longest batch: Mistral's allocated peak is the same in every logged step (34,547.7 MiB, within 0.25 MiB):
  the optimizer step (fp32 shards and Adam states), which no batch length sets, so the row is complete with the
  512-token cap as an upper bound. Llama-3's is not: its steps take four values, a floor at three steps
  (38,307.6x MiB, jittering like Mistral's: 1.109 x Mistral's, the ratio of the models' parameters, so the
  optimizer step) and three levels 1,792 MiB apart above it (two 16-token padding steps of 32 rows of 128,256
  fp32 logits and their copies), the top one at three steps. The top is a length no larger than 512 that the log
  does not give (the token counts are sums over the four ranks; Alpaca's longest of 32 samples is mostly far below
  the cap): the Llama rows are incomplete (``missing``), kept for the record.
* reserved: Mistral's reserved peak grows step by step (45.8 -> 50.4 -> 56.2 -> 56.8 GiB) while its allocated
  peak stays put: the cache grows with the mix of padded lengths, one shape per step. The steps' lengths
  (``step_lengths``, ``data/public/lengths/liger_kernel_alpaca_mistral_steps.json``, which the Mistral rows name
  in ``lengths`` so ``calibrate public`` replays those steps in order): rank 0's padded length is not logged, only
  each step's ``num_input_tokens_seen`` increment, the sum over the four ranks of 32 x each rank's padded length;
  their mean, rounded up to the padding multiple of 16, stands in for rank 0's (each rank pads to the longest of
  its own 32 samples, so rank 0's may be longer or shorter: the approximation's spread is measured in
  docs/error_matrix/README.md, "FSDP1 forward prefetch"). Alpaca's own token lengths are not reachable here
  (tatsu-lab/alpaca is on the hub; stanford_alpaca's ``alpaca_data.json``, blob 3779ddbc, is absent from every
  stored copy); Mistral-7B-v0.1's tokenizer is (mistral_common 1.12.0's ``data/tokenizer.model.v1``), the data not.

Versions: ``requirements.txt`` pins transformers 4.43.3 only (torch, trl, accelerate unpinned, Sep 2024). GPU:
the example's README ("single node with 4xA100 80GB GPUs"). Standard library only.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

from common import HERE, SOURCES, manifest, ref, row

SOURCE = "liger_kernel"
GPU = "a100-80gb"
WORLD = 4
BATCH = 32
PAD_MULTIPLE = 16
MAX_SEQ_LEN = 512
MAX_STEPS = 10
UNIT = "MiB"  # callback.py: bytes / 2**20
LENGTHS = "data/public/lengths/liger_kernel_alpaca_mistral_steps.json"
# transformers 4.43.3 traced as 4.44: Llama's and Mistral's forwards are the same in 4.43-4.44 for memory (fp32
# logits upcast in the forward, loss on a shifted copy inside the model).
MODEL_CODE = "4.44"
# Meta-Llama-3-8B differs from Llama-3.1-8B only in max_position_embeddings and rope_scaling, which shape no
# training memory (as in extract_peft_experiments.py): the catalogue's Llama-3.1-8B stands in.
RUNS = {
    "examples/huggingface/results/llama_use_liger_False_patching_type_None.log": dict(
        key="Meta-Llama-3-8B", hub="meta-llama/Meta-Llama-3-8B", model="meta-llama/Llama-3.1-8B",
        note="meta-llama/Meta-Llama-3-8B estimated as the catalogue's meta-llama/Llama-3.1-8B (configs differ only in "
             "max_position_embeddings and rope_scaling)",
        missing="seq_len: the padded length of rank 0's longest batch at the peak step (the allocated peak steps "
                "with the length, 1,792 MiB per 32 tokens above a length-free floor; the log gives only token sums "
                "over the four ranks; 512 is the cap, not the peak's length)"),
    "examples/huggingface/results/mistral_use_liger_False_patching_type_None.log": dict(
        key="Mistral-7B-v0.1", hub="mistralai/Mistral-7B-v0.1", model="mistralai/Mistral-7B-v0.1", note="",
        missing="", lengths=LENGTHS),
}
QUANTITY_KEYS = {"max_allocated": "step_peak_memory_allocated_MB", "max_reserved": "step_peak_memory_reserved_MB"}
TOTAL_KEYS = {"max_allocated": "total_peak_memory_allocated_MB", "max_reserved": "total_peak_memory_reserved_MB"}


def log_lines(text: str) -> list[dict]:
    """The Trainer's logged dicts (one per line, Python literals)."""
    return [ast.literal_eval(line) for line in text.splitlines() if line.startswith("{")]


def step_lines(lines: list[dict]) -> list[dict]:
    """The per-step lines that carry the callback's memory peaks (not the final summary line)."""
    return [line for line in lines if "step_peak_memory_allocated_MB" in line and "train_runtime" not in line]


def check_batch(lines: list[dict], path: str) -> None:
    """The run's global batch and padding, from the log itself: samples/s x runtime = steps x ranks x batch, and
    each step's token increment (sum over ranks of batch x padded length) a multiple of batch x pad multiple."""
    summary = next(line for line in lines if "train_runtime" in line)
    samples = summary["train_samples_per_second"] * summary["train_runtime"]
    if abs(samples - MAX_STEPS * WORLD * BATCH) > 1.0:
        raise ValueError(f"{path}: {samples:.1f} samples is not {MAX_STEPS} steps x {WORLD} x {BATCH}")
    seen = [line["num_input_tokens_seen"] for line in lines if "loss" in line]
    for before, after in zip([0] + seen, seen):
        if (after - before) % (BATCH * PAD_MULTIPLE):
            raise ValueError(f"{path}: a step of {after - before} tokens is not batch {BATCH} x a multiple of "
                             f"{PAD_MULTIPLE}")


def step_lengths(lines: list[dict]) -> list[int]:
    """Each step's padded length standing in for rank 0's: the step's ``num_input_tokens_seen`` increment (the sum
    over the ranks of batch x padded length) over ranks x batch, rounded up to the padding multiple."""
    seen = [line["num_input_tokens_seen"] for line in lines if "loss" in line and "train_runtime" not in line]
    return [-(-(after - before) // (WORLD * BATCH * PAD_MULTIPLE)) * PAD_MULTIPLE
            for before, after in zip([0] + seen, seen)]


def lengths_file(entry: dict, lines: list[dict]) -> dict:
    """The content of ``LENGTHS``: the Mistral run's steps, with where they come from."""
    return {
        "dataset": "tatsu-lab/alpaca 'text', SFTTrainer max_seq_length 512, Mistral-7B-v0.1 tokenizer",
        "kind": "steps",
        "rows": BATCH,
        "padded_lengths": step_lengths(lines),
        "source": f"{ref(entry)}: num_input_tokens_seen per step",
        "notes": f"Global steps 1-{MAX_STEPS} in order. Rank 0's padded length is not logged: each value is the "
                 f"step's token increment (the sum over {WORLD} ranks of {BATCH} x each rank's padded length) "
                 f"over {WORLD * BATCH}, rounded up to a multiple of {PAD_MULTIPLE}. Written by "
                 "data/public/extract_liger_kernel.py --lengths.",
    }


def peak_count(lines: list[dict], key: str) -> int:
    """How many logged steps reach the maximum of ``key`` to the hundredth of a MiB."""
    top = max(line[key] for line in lines)
    return sum(line[key] == top for line in lines)


def distinct_levels(lines: list[dict], key: str, tolerance_mib: float = 1.0) -> int:
    """How many distinct values ``key`` takes over the steps (values within ``tolerance_mib`` are one level)."""
    levels: list[float] = []
    for value in sorted(line[key] for line in lines):
        if not levels or value - levels[-1] > tolerance_mib:
            levels.append(value)
    return len(levels)


def _spec(run: dict) -> dict:
    return dict(model=run["model"], gpu=GPU, method="fsdp1", world_size=WORLD, micro_batch_size=BATCH,
                seq_len=MAX_SEQ_LEN, precision="mixed_bf16", optimizer="adamw", grad_ckpt=True, ckpt_reentrant=False,
                attn="sdpa", grad_accum_steps=1, loop="trainer", batch="padded", outputs_fp32=True, use_cache=False,
                model_code=MODEL_CODE, fsdp1_sharding_strategy="FULL_SHARD", fsdp1_use_orig_params=True,
                fsdp1_cpu_offload=False, fsdp1_backward_prefetch="BACKWARD_PRE", fsdp1_forward_prefetch=True,
                fsdp1_limit_all_gathers=True, fsdp1_gpus_per_node=WORLD)


def _assumptions(run: dict, lines: list[dict]) -> list[str]:
    key = QUANTITY_KEYS["max_allocated"]
    spread = max(line[key] for line in lines) - min(line[key] for line in lines)
    notes = [run["note"]] if run["note"] else []
    notes += ["transformers 4.43.3 (requirements.txt) traced as 4.44: the same Llama/Mistral forward for memory",
              "torch, trl and accelerate unpinned (Sep 2024)",
              f"batch {BATCH} per rank x {WORLD} ranks, checked against the log (samples/s x runtime, token "
              "increments); run_patching_methods.sh at 92047d9e",
              "FSDP1 FULL_SHARD via the Trainer (--fsdp 'full_shard auto_wrap', decoder-layer units), BACKWARD_PRE, "
              "forward_prefetch true, use_orig_params and limit_all_gathers at their defaults (true)",
              "checkpointing: fsdp_config activation_checkpointing (accelerate's non-reentrant checkpoint wrapper "
              "around each decoder layer)",
              "--bf16 under FSDP over bf16 weights: accelerate upcasts the trainable shards to fp32 and autocasts "
              "(mixed_bf16); HF Trainer default optimizer adamw_torch",
              "tatsu-lab/alpaca text, SFTTrainer max_seq_length 512, left padding to the batch's longest sample "
              "(multiple of 16) with an attention mask (batch=padded)",
              f"quantity: rank 0's per-step peak (reset at each step begin, /2**20), maximum over logged steps "
              f"{lines[0]['step']}-{lines[-1]['step']} (step 1 is the callback's warm-up, not logged)"]
    if spread < 1.0:
        notes.append(f"seq_len 512 is an upper bound: the allocated peak is the same in every logged step (spread "
                     f"{spread:.2f} MiB), so no step's length sets it")
    else:
        notes.append(f"the allocated peak varies with the batch's length ({distinct_levels(lines, key)} levels over "
                     f"{len(lines)} logged steps, the top at {peak_count(lines, key)}); seq_len 512 is the cap only")
    return notes


def _rows(entry: dict, path: str, run: dict) -> list[dict]:
    lines = log_lines((SOURCES / SOURCE / entry["file"]).read_text())
    check_batch(lines, path)
    steps = step_lines(lines)
    notes = "; ".join(_assumptions(run, steps))
    rows = []
    for quantity, key in QUANTITY_KEYS.items():
        top = max(steps, key=lambda line: line[key])
        if top[key] != steps[-1][TOTAL_KEYS[quantity]]:
            raise ValueError(f"{path}: largest {key} {top[key]} is not the run's {TOTAL_KEYS[quantity]}")
        rows.append(row(
            row_id=f"{SOURCE}:{run['key']}:full:x{WORLD}:b{BATCH}:{quantity}", source=SOURCE, source_ref=ref(entry),
            source_table=f"{key}, maximum over steps {steps[0]['step']}-{steps[-1]['step']}",
            source_key=f"step {top['step']} | {key}: {top[key]}", **_spec(run), model_hub_id=run["hub"],
            framework="HF Trainer / TRL SFTTrainer, FSDP1 via accelerate (Liger-Kernel examples/huggingface, "
                      "use_liger False)", adapter="full", padding="longest", max_length=MAX_SEQ_LEN,
            seq_len_basis="max_length_cap", lengths=run.get("lengths") or "tatsu-lab/alpaca truncated to 512, "
            "padded to each batch's longest (multiple of 16)", rescore_lengths=bool(run.get("lengths")),
            transformers_version="4.43.3",
            other_versions="trl, accelerate, torch unpinned (Sep 2024)", quantity=quantity, scope="per_gpu",
            value=top[key], unit=UNIT, complete=not run["missing"], missing=run["missing"], in_scope=True,
            assumptions=notes))
    return rows


def extract() -> list[dict]:
    entries = {entry["path"]: entry for entry in manifest(SOURCE).values() if entry["commit"].startswith("38411af")}
    rows = []
    for path, run in RUNS.items():
        rows += _rows(entries[path], path, run)
    return rows


def write_lengths() -> Path:
    """Writes ``LENGTHS`` from the Mistral log."""
    path = next(p for p, run in RUNS.items() if run.get("lengths"))
    entry = next(e for e in manifest(SOURCE).values() if e["path"] == path and e["commit"].startswith("38411af"))
    out = HERE.parent.parent / LENGTHS
    out.write_text(json.dumps(lengths_file(entry, log_lines((SOURCES / SOURCE / entry["file"]).read_text())),
                              indent=2) + "\n")
    return out


if __name__ == "__main__":
    if "--lengths" in sys.argv:
        print(write_lengths())
    for r in extract():
        print(r["row_id"], r["value"], r["in_scope"], Path(r["source_ref"]).name)
