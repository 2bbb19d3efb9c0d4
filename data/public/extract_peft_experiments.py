"""Rows from BenjaminBossan/peft-experiments (Aug 2024): the PEFT maintainer's comparisons of PEFT with torchtune
and with AnswerDotAI/fsdp_qlora on one and two RTX 4090s, each with a per-step log of the run's memory peaks.

Every file is copied at e0e5696 (the repository's last commit, Apache-2.0); the logs were committed earlier
(single-GPU LoRA 6028f89, QLoRA 5f91f40, FSDP b825c5c, fsdp_qlora f4712b5) and are unchanged since; the scripts'
later edits are memory-neutral (``train.py``: variable renames; the QLoRA notebook: a state-dict hook for saving).

What the numbers mean, from the scripts that wrote them:

* each log line is one optimizer step (``log_every_n_steps=1``) with torchtune's ``get_memory_stats(device)`` (the
  torchtune ``utils`` the scripts import, ca1d7a15): ``max_memory_allocated`` / ``max_memory_reserved`` /
  ``active_bytes.all.peak`` divided by 1e9, then ``reset_peak_memory_stats``, so a line is the peak of its own
  step's four accumulated micro-batches. GB, not GiB: the runs' reserved peaks (24.75 on one GPU) would exceed
  an RTX 4090's 24,563 MiB as GiB (``_check_unit``), and the repository's fsdp_qlora copy writes the same keys
  with ``/ 1e9``. Nothing resets the peaks before the loop, so the first line also holds model loading and
  wrapping (the FSDP run's reserved 23.9, then 16.1): the run's figure is the maximum over the lines after the
  first (``SKIP_FIRST``). The fsdp_qlora copy resets right before its loop (``train.py`` line 893): all its lines
  count.
* the PEFT runs (``train-peft.ipynb``, ``llama3-lora-fsdp/train.py``): ``AutoModelForCausalLM.from_pretrained(
  "meta-llama/Meta-Llama-3-8B-Instruct", torch_dtype=bfloat16)`` at transformers 7f552e28 (July 2024, between
  4.43 and 4.44; attention at its default, SDPA), ``get_peft_model(LoraConfig(r=8, lora_alpha=16,
  lora_dropout=0.05, target_modules=...), autocast_adapter_dtype=False)`` (bf16 adapters), ``torch.optim.AdamW``
  (foreach default), no checkpointing, gradient accumulation 4; torchtune's ``InstructDataset`` of
  yahma/alpaca-cleaned, Alpaca template, ``max_seq_len=512`` (truncation), shuffled, batch 2 through
  ``padded_collate`` (padded to the batch's longest sample); the model is called with the tokens only (no
  attention mask: transformers runs SDPA causal, ``batch=full``). The loop: ``logits = model(tokens).logits``
  (the output object dropped at once), a shifted contiguous copy, ``CrossEntropyLoss`` over it, ``del logits``,
  backward: the logits are not held through backward (``loop=trainer``).
* FSDP (``llama3-lora-fsdp/train.py``, ``torchrun --nproc_per_node 2``): FSDP1 FULL_SHARD with PEFT's
  ``fsdp_auto_wrap_policy`` (one unit per decoder layer and per trainable leaf), ``mixed_precision=None`` (pure
  bf16), torch 2.3.1's defaults otherwise (``use_orig_params=False``, BACKWARD_PRE, ``limit_all_gathers=True``);
  no ``no_sync``: gradients reduced after every micro-batch. Its sampler has ``num_replicas=1``: both ranks run
  the same batches.
* the longest batch: the allocated peak of the runs' lines plateaus at one value, reached by many steps (the
  single-GPU LoRA run: 301 of 3,254 lines at the maximum to the byte): the batch shape is capped, at 2 x 512
  (``plateau_count``). Each run's maximum is that of a 2 x 512 batch.

The single-GPU QLoRA runs (``train-peft.ipynb`` at 5f91f40: ``BitsAndBytesConfig(load_in_4bit, nf4, double quant,
compute bf16)``, ``torch_dtype=bfloat16``, no ``prepare_model_for_kbit_training``: embeddings, norms and head bf16)
are the spec's ``qlora`` with ``qlora_prep`` none. Their adapters are fp32 although the notebook passes
``autocast_adapter_dtype=False``: peft 1b16753a's ``_move_adapter_to_device_of_base_layer`` casts an adapter to its
base weight's dtype only when that is a float, and the packed weight is uint8 (peft 0.21 reads the layer's
``compute_dtype``), so ``lora_dtype`` stays auto. bitsandbytes 0.43.2 and 0.43.3 both postdate the kept-input fix of
``MatMul4Bit`` (#1270, merged 2024-07-16).

Out of scope, kept: torchtune's own model code (``log_torchtune.txt``, ``log_peft_in_torchtune.txt``), and
the fsdp_qlora comparison (QLoRA/QDoRA under FSDP1 with CPU offload). Standard library only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from common import SOURCES, UNITS, manifest, ref, row

SOURCE = "peft_experiments"
UNIT = "GB"
GPU = "rtx4090-24gb"
RTX4090_TORCH_TOTAL_BYTES = 24563 * 2**20
MODEL_HUB_ID = "meta-llama/Meta-Llama-3-8B-Instruct"
# Meta-Llama-3-8B-Instruct's config differs from Llama-3.1-8B's only in max_position_embeddings (8192 vs 131072)
# and rope_scaling (none vs llama3): neither shapes training memory (transformers >= 4.40 computes the rotary
# tables per call from the positions), so the catalogue's Llama-3.1-8B entry and its shipped profiles stand in.
MODEL = "meta-llama/Llama-3.1-8B"
# transformers 7f552e28 (July 2024, between the 4.43 and 4.44 releases) is traced as 4.45: Llama's memory-shaping
# code is the same in 4.42-4.45 (the forward upcasts the logits to fp32, the loss takes a shifted fp32 copy).
MODEL_CODE = "4.45"
VERSIONS = dict(torch_version="2.3.1", peft_version="1b16753a (git)", transformers_version="7f552e28 (git)")
TORCHTUNE_LINE = re.compile(r"Step (\d+) \|(.*)")
SKIP_FIRST = 1  # lines before the first reset (model loading)
ALL_LINEAR = "down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj"

# (log path, what ran): runs is the spec; out is why the estimator cannot express it ("" in scope)
RUNS = {
    "torchtune/llama3-lora-single-device/log_peft.txt": dict(
        key="lora-1gpu", world=1, method="single", targets="q_proj,v_proj", qlora=False, framework="peft",
        code="torchtune/llama3-lora-single-device/train-peft.ipynb (6028f89)", out=""),
    "torchtune/llama3-lora-fsdp/log_peft.txt": dict(
        key="lora-fsdp1-2gpu", world=2, method="fsdp1", targets="q_proj,v_proj", qlora=False, framework="peft",
        code="torchtune/llama3-lora-fsdp/train.py (b825c5c)", out=""),
    "torchtune/llama3-lora-fsdp/log_torchtune.txt": dict(
        key="torchtune-lora-fsdp-2gpu", world=2, method="fsdp1", targets="q_proj,v_proj", qlora=False,
        framework="torchtune", code="torchtune lora_finetune_distributed, bb_8B_lora.yaml",
        out="torchtune's own Llama-3 model code and recipe, not transformers"),
    "torchtune/llama3-qlora-single-device/log_peft_bnb-0.43.2.txt": dict(
        key="qlora-1gpu-bnb0.43.2", world=1, method="single", targets=ALL_LINEAR, qlora=True, framework="peft",
        code="torchtune/llama3-qlora-single-device/train-peft.ipynb (5f91f40)", out="", qlora_prep="none"),
    "torchtune/llama3-qlora-single-device/log_peft_bnb-0.43.3.txt": dict(
        key="qlora-1gpu-bnb0.43.3", world=1, method="single", targets=ALL_LINEAR, qlora=True, framework="peft",
        code="torchtune/llama3-qlora-single-device/train-peft.ipynb (5f91f40)", out="", qlora_prep="none"),
    "torchtune/llama3-qlora-single-device/log_torchtune.txt": dict(
        key="torchtune-qlora-1gpu", world=1, method="single", targets="k_proj,o_proj,q_proj,v_proj,mlp",
        qlora=True, framework="torchtune", code="torchtune lora_finetune_single_device, bb_8B_qlora_single_device.yaml",
        out="torchtune's own Llama-3 model code with torchao NF4 weights, not transformers + bitsandbytes"),
    "torchtune/llama3-qlora-single-device/log_peft_in_torchtune.txt": dict(
        key="peft-in-torchtune-qlora-1gpu", world=1, method="single", targets=ALL_LINEAR, qlora=True,
        framework="torchtune", code="torchtune recipe with PEFT LoRA injected (peft.patch, 377b580)",
        out="torchtune's own Llama-3 model code (PEFT's LoRA layers injected into it), not transformers"),
}
# the fsdp_qlora comparison: Llama-2-7B, 2 GPUs, FSDP1 + CPU offload, batch 2 (QDoRA: 1), context 512, accumulation 4
ANSWERAI_RUNS = {
    "answerai/llama2-qlora-fsdp/log_peft.txt": ("qlora-fsdp1-offload-peft", 2, "peft QLoRA (BitsAndBytesConfig)"),
    "answerai/llama2-qlora-fsdp/log_answerai.txt": ("qlora-fsdp1-offload-answerai", 2, "fsdp_qlora custom_qlora"),
    "answerai/llama2-qdora-fsdp/log_peft.txt": ("qdora-fsdp1-offload-peft", 1, "peft QDoRA (use_dora)"),
    "answerai/llama2-qdora-fsdp/log_answerai.txt": ("qdora-fsdp1-offload-answerai", 1, "fsdp_qlora bnb_dora"),
}
QUANTITY_KEYS = {"max_allocated": "peak_memory_alloc", "max_reserved": "peak_memory_reserved"}


def torchtune_lines(text: str) -> list[dict]:
    """``Step N | key:value ...`` lines (torchtune's DiskLogger/StdoutLogger) as {"step": N, key: float}."""
    out = []
    for line in text.splitlines():
        found = TORCHTUNE_LINE.match(line.strip())
        if found:
            fields = dict(item.split(":", 1) for item in found.group(2).split())
            out.append({"step": int(found.group(1)), **{k: float(v) for k, v in fields.items()}})
    return out


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def plateau_count(lines: list[dict], key: str = "peak_memory_alloc") -> int:
    """How many lines reach the maximum of ``key`` exactly: many means the batch shape is capped."""
    top = max(line[key] for line in lines)
    return sum(line[key] == top for line in lines)


def reserved_drops(lines: list[dict]) -> list[tuple[int, float, float]]:
    """(step, previous, this) where a line's reserved peak is below the line before: the allocator released its
    cache in between (peaks are reset every step, so the level itself fell)."""
    key = "peak_memory_reserved"
    return [(b["step"], a[key], b[key]) for a, b in zip(lines, lines[1:]) if b[key] < a[key]]


def _check_unit(lines: list[dict], path: str) -> None:
    top = max(line["peak_memory_reserved"] for line in lines)
    if top * UNITS["GiB"] <= RTX4090_TORCH_TOTAL_BYTES:
        return  # GiB would fit the board too: GB then rests on the code alone
    if top * UNITS[UNIT] > RTX4090_TORCH_TOTAL_BYTES:
        raise ValueError(f"{path}: reserved peak {top} exceeds an RTX 4090 in {UNIT} too")


def _spec(run: dict) -> dict:
    world = run["world"]
    fsdp = dict(fsdp1_sharding_strategy="FULL_SHARD", fsdp1_use_orig_params=False, fsdp1_cpu_offload=False,
                fsdp1_backward_prefetch="BACKWARD_PRE", fsdp1_forward_prefetch=False, fsdp1_limit_all_gathers=True,
                fsdp1_gpus_per_node=world) if run["method"] == "fsdp1" else {}
    return dict(model=MODEL, gpu=GPU, method=run["method"], world_size=world, micro_batch_size=2, seq_len=512,
                precision="bf16", optimizer="adamw", grad_ckpt=False, attn="sdpa", lora_rank=8,
                lora_targets=run["targets"], lora_dropout=0.05, qlora=run["qlora"], grad_accum_steps=4,
                qlora_prep=run.get("qlora_prep", "auto"),
                loop="trainer", batch="full", use_cache=False, model_code=MODEL_CODE, **fsdp)


def _assumptions(run: dict, path: str, lines: list[dict]) -> list[str]:
    notes = [f"code semantics: {run['code']}",
             f"{MODEL_HUB_ID} estimated as the catalogue's {MODEL}: the configs differ only in "
             "max_position_embeddings and rope_scaling, which shape no training memory",
             "transformers 7f552e28 (July 2024) traced as 4.45: Llama returns fp32 logits in 4.42-4.45 alike",
             "pure bf16 (torch_dtype=bfloat16, no autocast); QLoRA without prepare_model_for_kbit_training: NF4 "
             "double-quant linears (uint8 storage), embedding, norms and head bf16 (qlora_prep none); the adapters "
             "fp32 despite autocast_adapter_dtype=False: peft 1b16753a casts them to the base weight's dtype only "
             "when it is a float (uint8 here), so each adapter takes an fp32 copy of its input (lora_dtype auto)"
             if run.get("qlora_prep") == "none" else
             "pure bf16 (torch_dtype=bfloat16, no autocast); LoRA adapters bf16 (autocast_adapter_dtype=False) where "
             "the estimator keeps peft's fp32 adapters (r8 q/v: 3.4M parameters, ~27 MB more in the estimate)",
             "attention at transformers' default (SDPA); tokens only, no attention mask: SDPA causal (batch=full)",
             "loop: the output object is dropped at once and the loss is taken on a shifted fp32 copy of the "
             "logits, the full fp32 logits freed before the cross-entropy (the HF in-model loss keeps them alive "
             "until the forward returns: up to one fp32 logits tensor, 0.49 GiB at 2 x 512, less at the loss)",
             f"seq_len 512: torchtune's max_seq_len truncation, batch 2 padded to its longest sample; the "
             f"allocated peak plateaus ({plateau_count(lines)} of {len(lines)} counted lines at the maximum to the "
             "byte): capped batches of 2 x 512",
             "quantity: per-step peak (torchtune get_memory_stats, /1e9, reset every step); the row is the maximum "
             f"over the run's lines after the first {SKIP_FIRST} (which also holds model loading)",
             "rank 0's figure" if run["world"] > 1 else "one GPU"]
    for step, before, after in reserved_drops(lines):
        notes.append(f"the reserved level falls at step {step} ({before} -> {after} GB): a cache release, as a "
                     "failed cudaMalloc near the board's capacity makes; the row is the run's maximum")
    if run["method"] == "fsdp1":
        notes.append("FSDP1 FULL_SHARD, peft fsdp_auto_wrap_policy, mixed_precision=None, use_orig_params=False, "
                     "BACKWARD_PRE, limit_all_gathers (torch 2.3.1 defaults); no no_sync: reduced every micro-batch; "
                     "DistributedSampler(num_replicas=1): both ranks run the same batches")
    if run["out"]:
        notes.append(f"not expressible: {run['out']}")
    return notes


def _bnb_version(path: str) -> str:
    found = re.search(r"bnb-([0-9.]+)\.txt$", path)
    return found.group(1) if found else ""


def _peak_fields(lines: list[dict], key: str, step_label: str) -> dict:
    """The row's value: the largest ``key`` over the logged steps, and where it was read (the log's own label)."""
    top = max(lines, key=lambda line: line[key])
    return {"source_table": f"{key}, maximum over steps {lines[0]['step']}-{lines[-1]['step']}",
            "source_key": f"{step_label} {top['step']} | {key}:{top[key]}", "value": top[key]}


def _torchtune_rows(entry: dict, path: str, run: dict) -> list[dict]:
    lines = torchtune_lines((SOURCES / SOURCE / entry["file"]).read_text())[SKIP_FIRST:]
    _check_unit(lines, path)
    notes = "; ".join(_assumptions(run, path, lines))
    rows = []
    for quantity, key in QUANTITY_KEYS.items():
        rows.append(row(
            row_id=f"{SOURCE}:{run['key']}:{quantity}", source=SOURCE, source_ref=ref(entry),
            **_peak_fields(lines, key, "Step"), model_hub_id=MODEL_HUB_ID,
            framework=f"{run['framework']} custom loop (torchtune data and logging)",
            adapter="qlora" if run["qlora"] else "lora", padding="longest", max_length=512,
            seq_len_basis="max_length_cap", lengths="alpaca-cleaned truncated to 512; the allocated peak plateaus at "
            "the cap", rescore_lengths=False, **VERSIONS, quantity=quantity, scope="per_gpu", unit=UNIT, in_scope=not run["out"], assumptions=notes, bitsandbytes_version=_bnb_version(path),
            **_spec(run)))
    return rows


def _answerai_rows(entry: dict, key: str, batch: int, framework: str) -> list[dict]:
    lines = json_lines((SOURCES / SOURCE / entry["file"]).read_text())
    notes = ("code semantics: the directory's train.py (fsdp_qlora cec4386 adapted), the README's command: "
             f"--train_type qlora|qdora --batch_size {batch} --context_length 512 --precision bf16 "
             "--use_gradient_checkpointing false --use_cpu_offload true --lora_rank 8 --lora_alpha 16 "
             "--gradient_accumulation_steps 4 --dataset alpaca_sample; peaks /1e9 per logged step, reset before "
             "the loop and after every line")
    # the fsdp_qlora runs are --train_type custom_qlora / bnb_dora: fsdp_qlora's own LORA / DoRA modules, not peft's
    # (the estimator's LoRA is peft's); the peft runs load through BitsAndBytesConfig (their preparation not read)
    notes += ("; not expressible: " + ("DoRA" if "qdora" in key else "fsdp_qlora's own LORA module (train_type "
              "custom_qlora), not peft's" if "answerai" in key else "peft's QLoRA loading path under FSDP1 (its kbit "
              "preparation not read)") + "; the packed 4-bit weights under FSDP1 are modelled (qlora, lora_dtype model)")
    rows = []
    for quantity, field in QUANTITY_KEYS.items():
        rows.append(row(
            row_id=f"{SOURCE}:{key}:{quantity}", source=SOURCE, source_ref=ref(entry),
            **_peak_fields(lines, field, "step"), model="meta-llama/Llama-2-7b-hf", gpu=GPU,
            method="fsdp1", world_size=2, micro_batch_size=batch, seq_len=512, precision="bf16", optimizer="adamw",
            grad_ckpt=False, attn="sdpa", lora_rank=8, lora_targets="auto", qlora=True, grad_accum_steps=4,
            loop="manual", batch="padded", fsdp1_use_orig_params=False, fsdp1_cpu_offload=True,
            fsdp1_gpus_per_node=2, model_code="4.44", model_hub_id="meta-llama/Llama-2-7b-hf", framework=framework,
            adapter="qdora" if "qdora" in key else "qlora", padding="longest", max_length=512,
            seq_len_basis="max_length_cap", lengths="alpaca_sample truncated to 512",
            rescore_lengths=False, torch_version="2.3.1", transformers_version="e4522fe3 (git)",
            peft_version="22f042a1 (git)", bitsandbytes_version="0.43.3", quantity=quantity, scope="per_gpu",
            unit=UNIT, in_scope=False, assumptions=notes))
    return rows


def extract() -> list[dict]:
    entries = {entry["path"]: entry for entry in manifest(SOURCE).values()}
    rows = []
    for path, run in RUNS.items():
        rows += _torchtune_rows(entries[path], path, run)
    for path, (key, batch, framework) in ANSWERAI_RUNS.items():
        rows += _answerai_rows(entries[path], key, batch, framework)
    return rows


if __name__ == "__main__":
    for r in extract():
        print(r["row_id"], r["value"], r["in_scope"], Path(r["source_ref"]).name)
