"""Rows from foundation-model-stack/fms-acceleration ``scripts/benchmarks/refs/a100_80gb.csv`` (IBM's reference
benchmarks of fms-hf-tuning on A100-80GB, 1 and 2 GPUs), every version that ships a ``requirements.txt`` (the pip
freeze of the run), with the benchmark configs of the same commit.

What the numbers mean, from the repository's code at the same commit (``scripts/benchmarks/benchmark.py``,
``scripts/run_benchmarks.sh``, ``scripts/benchmarks/README.md``) and fms-hf-tuning's ``tuning/sft_trainer.py``
at the version the freeze names:

* ``mem_nvidia_mem_reserved`` (MiB): ``nvidia-smi --query-gpu timestamp,name,index,memory.used --loop 1`` runs
  beside each experiment; per GPU, the largest ``memory.used`` minus the first reading (taken before the job
  starts, so an idle GPU's own few MiB), then the mean over the job's GPUs (``get_peak_mem_usage_by_device_id``,
  ``peak_nvidia_mem_by_device_id.mean()``). So: device-level memory of the process (CUDA context, NCCL, the
  caching allocator's reserve), per GPU, sampled once a second (a shorter peak can be missed): ``nvml_used``.
* ``mem_peak_torch_mem_alloc_in_bytes`` (B): the HF Trainer's memory tracker (``skip_memory_metrics False``) on
  rank 0 only; the benchmark sums the stage deltas (before init, init, train) and adds the train stage's
  ``peaked_delta``, which is ``torch.cuda.max_memory_allocated()`` since the peak stats were reset at the start of
  ``train()``: ``max_allocated`` of rank 0.
* the run (``benchmark.py`` + ``defaults.yaml`` + ``scenarios.yaml``): ``sft_trainer.py`` for 100 steps
  (``max_steps``), ``per_device_train_batch_size`` = effective batch (4 or 8) // GPUs, gradient accumulation 1,
  ``gradient_checkpointing True`` (transformers' default: reentrant), ``use_flash_attn True`` (flash_attention_2),
  HF Trainer's default optimizer (``adamw_torch``: foreach AdamW), alpaca-cleaned formatted into one text field,
  ``--packing True`` (benchmark.py's default matrix) with ``--max_seq_len 4096`` (argparse takes it as
  ``--max_seq_length``): TRL packs the text into rows of ``min(4096, tokenizer.model_max_length)`` tokens with no
  attention mask (the run's own ``train_tokens_per_second x train_runtime`` is exactly 100 steps x batch x 4096 for
  Mistral and x 2048 for SantaCoder, whose tokenizer caps the length), so every row is full.
* model loaded with ``torch_dtype`` and no quantization unless a framework config says so; ``bf16``/``fp16``
  columns are the Trainer flags (accelerate's autocast). 1 GPU: ``python sft_trainer.py``; 2 GPUs: ``accelerate
  launch --config_file accelerate.yaml``: FSDP1 FULL_SHARD, TRANSFORMER_BASED_WRAP (one unit per decoder layer),
  BACKWARD_PRE, no forward prefetch, no offload, ``mixed_precision 'no'`` in the file (the Trainer's ``--bf16``
  switches it on), ``use_orig_params`` and ``limit_all_gathers`` left at accelerate's defaults (true).
* LoRA (``peft_method lora``): r 16, alpha 16, dropout 0.1 on the ``target_modules`` column. ``baseline-peft-bnb``:
  bitsandbytes NF4 with double quantization, compute dtype = torch_dtype, prepared by TRL's SFTTrainer (peft's
  ``prepare_model_for_kbit_training``, then ``peft_module_casting_to_bf16`` under ``--bf16``).
* ``use_cache``: left at the model config's true by fms-hf-tuning, TRL's SFTTrainer and the Trainer; GPTBigCode's
  forward (transformers 4.44-4.57) never turns it off under checkpointing, so its ``presents`` (per layer, a view
  of the whole fused QKV output) live until the loss; Mistral's forward turns it off.
* rows without ``train_loss`` did not train (out of memory: their nvidia-smi column sits at the board's 80 GB) and
  give no row; a row whose figures are all the same as in an earlier version (re-committed, not re-run) gives one.
Standard library only.
"""

from __future__ import annotations

import csv
import re

from common import SOURCES, manifest, ref, row

SOURCE = "fms_acceleration"
CSV = "scripts/benchmarks/refs/a100_80gb.csv"
MODELS = {"mistralai/Mistral-7B-v0.1": "mistralai/Mistral-7B-v0.1",
          "bigcode/gpt_bigcode-santacoder": "bigcode/gpt_bigcode-santacoder"}
BASELINE = ("none", "baseline-peft-bnb")   # plain transformers(+peft); the other framework configs are plugins
PLUGINS = {"accelerated-peft-bnb": "fms-acceleration's accelerated-peft plugin loads and prepares the 4-bit model "
                                   "itself (no fp32 upcast of the non-quantized weights)",
           "accelerated-peft-autogptq": "GPTQ-quantized base weights (the plugin's triton kernels)",
           "foak": "fused-ops-and-kernels plugin (Triton kernels for LoRA/QLoRA, RMSNorm, RoPE, cross-entropy)"}
STEPS_KEY = "max_steps"
# fms-hf-tuning's sft_trainer.py adds the special tokens a tokenizer lacks (a LlamaTokenizer(Fast) always gets
# bos/eos/unk "<s>", "</s>", "<unk>", which it has, and pad "<pad>", which it has not) and then always calls
# ``tokenizer_and_embedding_resize``: ``model.resize_token_embeddings(ceil(len(tokenizer) / m) * m)`` with m =
# ``embedding_size_multiple_of``. Tokenizer entries of the hub models that load a LlamaTokenizerFast (32,000, no
# pad token); GPTBigCode's (SantaCoder's) tokenizer length is not checked here, so its rows keep the config's.
LLAMA_TOKENIZER_ENTRIES = {hub: 32000 for hub in (
    "mistralai/Mistral-7B-v0.1", "mistralai/Mixtral-8x7B-Instruct-v0.1", "NousResearch/Llama-2-70b-hf",
    "TheBloke/Mistral-7B-v0.1-GPTQ", "TheBloke/Mixtral-8x7B-Instruct-v0.1-GPTQ", "TheBloke/Llama-2-70B-GPTQ")}
# ``embedding_size_multiple_of``'s default at the fms-hf-tuning commit of each freeze (tuning/config/configs.py):
# 8 at these two, 1 at 398c2a8, c40ae7f, d360202 and v2.5.0.
MULTIPLE_OF_8 = ("85f32cb15019", "7dfd4e71a0de")


def _yaml_flat(text: str) -> dict:
    """``key: value`` lines at any depth (the benchmark files use distinct keys), comments dropped."""
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].rstrip()
        if ":" in line and not line.strip().startswith("-"):
            key, _, value = line.strip().partition(":")
            if value.strip():
                out[key.strip()] = value.strip().strip("'\"")
    return out


def _versions(text: str) -> dict:
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==([^\s]+)$", text, flags=re.M))
    pins.update({k: v.rsplit("@", 1)[-1][:12] for k, v in re.findall(r"^([A-Za-z0-9_.-]+) @ (git\+\S+)$", text,
                                                                      flags=re.M)})
    other = ", ".join(f"{k} {pins[k]}" for k in ("accelerate", "trl", "fms-hf-tuning", "flash-attn",
                                                  "nvidia-nccl-cu12") if k in pins)
    return {"torch_version": pins.get("torch", ""), "transformers_version": pins.get("transformers", ""),
            "peft_version": pins.get("peft", ""), "bitsandbytes_version": pins.get("bitsandbytes", ""),
            "deepspeed_version": pins.get("deepspeed", ""), "other_versions": other}


def _framework(name: str) -> str:
    """Why a framework config other than plain transformers(+peft) is out of scope ('' for the baselines)."""
    if name in BASELINE:
        return ""
    found = [why for key, why in PLUGINS.items() if key in name]
    return f"{name}: {'; '.join(found) or 'an fms-acceleration plugin'}"


def _precision(weights: str, half: str, world: int, lora: bool) -> tuple[str, str]:
    """The estimator's own reading (estimator/configs/build.py, resolve_precision): a sharded run with the
    Trainer's 16-bit switch keeps fp32 shards (accelerate's FSDP prepare upcasts every flat parameter that requires
    grad), otherwise the weights' dtype; ('', reason) when no precision expresses it. With LoRA the frozen base's
    flat parameters require no grad (the Trainer gives PEFT models peft's fsdp_auto_wrap_policy: each adapter
    Linear its own unit), so nothing but the adapters, already fp32 (peft's autocast_adapter_dtype), is upcast:
    bf16."""
    if weights == "float16":
        return "", ("pure fp16 weights (torch_dtype float16, no fp32 masters)" if not half else
                    "fp16 weights with fp16 autocast and a GradScaler") + ": no precision of the estimator's"
    if weights != "bfloat16":
        return "", f"torch_dtype {weights}"
    if world > 1 and half and not lora:
        return "mixed_bf16", ""
    return "bf16", ""


def _vocab_size(hub: str, versions: dict) -> int:
    """The embedding rows fms-hf-tuning trains after adding the tokenizer's ``<pad>`` (0: the config's)."""
    entries = LLAMA_TOKENIZER_ENTRIES.get(hub)
    if entries is None:
        return 0
    multiple = 8 if any(f"fms-hf-tuning {c}" in versions["other_versions"] for c in MULTIPLE_OF_8) else 1
    return -(-(entries + 1) // multiple) * multiple


def _row(entry: dict, versions: dict, steps: int, cells: dict, quantity: str, earlier: bool) -> dict:
    hub = cells["model_name_or_path"]
    world = int(cells["num_gpus"])
    batch = int(cells["per_device_train_batch_size"])
    frame = cells.get("framework_config") or "none"
    lora = cells["peft_method"] == "lora"
    qlora = frame.endswith("-bnb") or "-bnb-" in frame
    half = "bf16" if cells.get("bf16", "").upper() == "TRUE" else ("fp16" if cells.get("fp16", "").upper() == "TRUE"
                                                                   else "")
    tokens = float(cells["train_tokens_per_second"]) * float(cells["train_runtime"]) / (steps * batch)
    seq_len = int(round(tokens))
    if abs(tokens - seq_len) > 1 or seq_len not in (2048, 4096):
        raise ValueError(f"{hub} {frame}: tokens per row {tokens:.1f} is not a packed 2048/4096")
    precision, why_not = _precision(cells["torch_dtype"], half, world, lora)
    out = [why_not] if why_not else []
    if _framework(frame):
        out.append(_framework(frame))
    if hub not in MODELS:
        out.append(f"{hub} is not in the estimator's catalogue")
    if qlora and world > 1:
        out.append("QLoRA sharded by FSDP (bnb_4bit_quant_storage = torch_dtype): the estimator does not shard "
                   "4-bit weights")
    method = "single" if world == 1 else "fsdp1"
    targets = ",".join(sorted(cells["target_modules"].split())) if lora else "auto"
    adapter = "qlora" if qlora else ("lora" if lora else "full")
    notes = [f"configs: scenarios.yaml, defaults.yaml, accelerate.yaml, requirements.txt at {entry['commit'][:12]}",
             f"seq_len {seq_len}: packed rows (TRL ConstantLengthDataset, no attention mask); the run's "
             f"train_tokens_per_second x train_runtime / ({steps} steps x batch {batch}) = {tokens:.1f} tokens",
             "optimizer: HF Trainer default adamw_torch (foreach AdamW); checkpointing reentrant (ckpt_reentrant: "
             "the Trainer of 4.44-4.48 passes no use_reentrant, and torch 2.4's checkpoint defaults to it), called "
             "by the model's layer loop around each decoder layer (before transformers 4.52)",
             "use_cache: the model config's (true); nothing turns it off: fms-hf-tuning's sft_trainer.py (the "
             "freeze's commit), TRL's SFTTrainer 0.10-0.13 and the Trainer pass no use_cache (Mistral's code then "
             "turns it off under checkpointing; GPTBigCode's (4.44-4.48) does not: each layer's present key/value, "
             "a view of its c_attn output, is kept until the forward returns)"]
    if quantity == "nvml_used":
        notes.append("value = mean over the job's GPUs of (peak - first) nvidia-smi memory.used, sampled every "
                     "second: a peak shorter than a second can be missed")
    else:
        notes.append("value = rank 0's max_memory_allocated over trainer.train() (HF memory tracker, stage sums)")
    if world > 1:
        notes.append("FSDP1 via accelerate: FULL_SHARD, one unit per decoder layer, BACKWARD_PRE, use_orig_params "
                     "and limit_all_gathers at accelerate's default (true)")
        if entry["commit"].startswith("4e81c64"):
            notes.append("accelerate 0.33 reads the yaml's fsdp_backward_prefetch_policy as BACKWARD_PRE")
    if world > 1 and lora:
        notes.append("FSDP1 with LoRA: the Trainer wraps a PEFT model with peft's fsdp_auto_wrap_policy (each adapter "
                     "Linear its own unit inside the frozen decoder-layer units), which the fsdp1 method models")
    if precision == "mixed_bf16":
        notes.append("--bf16 under FSDP: accelerate upcasts the sharded trainable parameters to fp32 (mixed_bf16)")
    elif world > 1 and half:
        notes.append("--bf16 under FSDP with LoRA: accelerate upcasts only flat parameters that require grad, and the "
                     "Trainer wraps PEFT models with peft's fsdp_auto_wrap_policy (each adapter Linear its own unit, "
                     "already fp32), so the frozen base stays bf16: precision bf16")
    if half and precision == "bf16":
        notes.append("--bf16 over bf16 weights: autocast runs the step (layer_norm and cross_entropy in fp32); the "
                     "estimator's bf16 has no autocast")
    if lora:
        notes.append("LoRA r 16, alpha 16, dropout 0.1 (a dropout mask per adapted projection, inside each "
                     "checkpointed layer's recomputation)")
    if qlora:
        notes.append("QLoRA: peft's prepare_model_for_kbit_training (non-quantized weights fp32), then TRL's "
                     "peft_module_casting_to_bf16 casts embed_tokens and lm_head back to bf16 under --bf16 and "
                     "autocast runs the step; the estimator's QLoRA keeps them fp32 without autocast")
    vocab_size = _vocab_size(hub, versions)
    if vocab_size:
        notes.append(f"vocab_size {vocab_size}: fms-hf-tuning adds the LlamaTokenizerFast's missing <pad> and resizes "
                     f"the embedding to len(tokenizer) = 32,001 rounded up to embedding_size_multiple_of")
    if earlier:
        notes.append("re-run of an earlier version's configuration (different figures)")
    value, unit = ((float(cells["mem_nvidia_mem_reserved"]), "MiB") if quantity == "nvml_used"
                   else (int(float(cells["mem_peak_torch_mem_alloc_in_bytes"])), "B"))
    tag = "nvml" if quantity == "nvml_used" else "alloc"
    return row(
        row_id=f"{SOURCE}:{entry['commit'][:12]}:{frame}:{hub.rsplit('/', 1)[1]}:{adapter}:x{world}:b{batch}:{tag}",
        source=SOURCE, source_ref=ref(entry), source_table="mem_nvidia_mem_reserved" if tag == "nvml"
        else "mem_peak_torch_mem_alloc_in_bytes",
        source_key=" | ".join(f"{k}={cells.get(k, '')}" for k in ("framework_config", "model_name_or_path", "num_gpus",
                                                                   "peft_method", "per_device_train_batch_size",
                                                                   "torch_dtype", "bf16", "fp16")),
        model=MODELS.get(hub, hub), gpu="a100-80gb", method=method, world_size=world,
        micro_batch_size=batch, seq_len=seq_len, precision=precision or "bf16", optimizer="adamw", grad_ckpt=True,
        attn="flash", ckpt_reentrant=True, vocab_size=vocab_size, lora_rank=int(float(cells["r"])) if lora else 0, lora_targets=targets,
        lora_dropout=float(cells.get("lora_dropout") or 0) if lora else 0.0, qlora=qlora,
        grad_accum_steps=1, loop="trainer", batch="full", outputs_fp32=bool(half), use_cache=True, model_hub_id=hub,
        framework=f"fms-hf-tuning (HF Trainer / TRL SFTTrainer){', accelerate FSDP1' if world > 1 else ''}",
        adapter=adapter, padding="packed", max_length=seq_len, seq_len_basis="longest_sample",
        lengths=f"packed: every row {seq_len} tokens", rescore_lengths=False, **versions,
        quantity=quantity, scope="per_gpu", value=value, unit=unit, complete=True, in_scope=not out,
        assumptions="; ".join(notes + ([f"not expressible: {'; '.join(out)}"] if out else [])))


def extract() -> list[dict]:
    entries = manifest(SOURCE)
    by_commit: dict[str, dict] = {}
    for local, entry in entries.items():
        by_commit.setdefault(entry["commit"], {})[entry["path"]] = (local, entry)
    rows, seen = [], {}
    for commit in sorted(by_commit, key=lambda c: _date_order(by_commit[c])):
        files = by_commit[commit]
        if CSV not in files:
            continue
        text = {path: (SOURCES / SOURCE / local).read_text() for path, (local, _) in files.items()}
        steps = int(_yaml_flat(text["scripts/benchmarks/defaults.yaml"])[STEPS_KEY])
        versions = _versions(text["scripts/benchmarks/refs/requirements.txt"])
        entry = files[CSV][1]
        for cells in csv.DictReader(text[CSV].splitlines()):
            if not cells.get("train_loss"):
                continue  # did not train (OOM): not a measurement
            config = tuple(cells.get(k, "") for k in ("framework_config", "model_name_or_path", "num_gpus",
                                                      "peft_method", "per_device_train_batch_size"))
            figures = tuple(cells.get(k, "") for k in ("train_loss", "train_runtime", "mem_nvidia_mem_reserved",
                                                       "mem_peak_torch_mem_alloc_in_bytes"))
            if seen.get(config) == figures:
                continue  # re-committed unchanged: one measurement
            earlier = config in seen
            seen[config] = figures
            if cells.get("mem_nvidia_mem_reserved"):
                rows.append(_row(entry, versions, steps, cells, "nvml_used", earlier))
            if cells.get("mem_peak_torch_mem_alloc_in_bytes") not in ("", None) and \
                    float(cells["mem_peak_torch_mem_alloc_in_bytes"]) > 0:
                rows.append(_row(entry, versions, steps, cells, "max_allocated", earlier))
    return rows


# The versions in the order they were committed (MANIFEST lists commits, not dates): by the torch/transformers
# freeze, which only moves forward in this file's history.
ORDER = ["c3a069c842f2", "b6c1455bf12b", "4e81c64453ec", "97fc3c138e09", "9239802cc91a", "24bdadb228e2"]


def _date_order(files: dict) -> int:
    commit = next(iter(files.values()))[1]["commit"][:12]
    return ORDER.index(commit) if commit in ORDER else len(ORDER)
