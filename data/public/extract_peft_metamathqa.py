"""Rows from PEFT's MetaMathQA method comparison (huggingface/peft, method_comparison/MetaMathQA/results/*.json).

Every version of every result file is a separate run (the benchmark is re-run on new torch/transformers
releases), so each copy under ``sources/peft_metamathqa/`` is one row. What the numbers mean comes from the
benchmark's code at the commit that added the file (``run.py``/``utils.py``, same directory):

* ``accelerator_memory_max`` (``cuda_memory_max`` before 2025-08) = ``max_memory_reserved()`` at the end of the
  run minus ``max_memory_reserved()`` right after a 1x1 ``nn.Linear`` was moved to the device (one 2 MiB
  small-pool segment), so the value is max reserved over the whole run (training, generation-based evaluation
  with batch 50, the short wiki-loss passes) less 2 MiB; the row adds the 2 MiB back (``value_offset_bytes``).
* one L40S, the model loaded with ``dtype`` (bfloat16: pure bf16 weights, gradients and AdamW states; ``use_amp``
  false), ``torch.optim.<optimizer_type>`` with default (foreach) implementation, ``attn_implementation`` null
  (transformers' default: sdpa), gradient checkpointing only when ``use_gc`` is true (the field is absent before
  2026-07, when the code had no checkpointing path), PEFT adapters in fp32 (``autocast_adapter_dtype``).
* batches of ``batch_size`` samples from a length-bucketed iterator, each padded to its longest sample,
  samples truncated at ``max_seq_length`` tokens; the train loop keeps ``outputs`` alive through backward, and
  with them the key/value cache (``model(**batch)`` passes no ``use_cache``: the config's true).
Standard library only.
"""

from __future__ import annotations

import json

from common import SOURCES, manifest, ref, row

SOURCE = "peft_metamathqa"
GPUS = {"NVIDIA L40S": "l40s-48gb"}
MODELS = {"meta-llama/Llama-3.2-3B": "meta-llama/Llama-3.2-3B"}
# Plain LoRA: every field that changes what is stored or computed must be at its default.
LORA_DEFAULTS = {"use_dora": (False, None), "use_bdlora": (None,), "velora_config": (None,),
                 "lora_ga_config": (None,), "eva_config": (None,), "corda_config": (None,),
                 "trainable_token_indices": (None,), "modules_to_save": (None,), "layer_replication": (None,),
                 "target_parameters": (None,), "use_qalora": (False, None), "bias": ("none", None),
                 "lora_bias": (False, None), "arrow_config": (None,), "monteclora_config": (None,),
                 "alora_invocation_tokens": (None,), "init_lora_weights": (True, "gaussian", None)}


def _scope(peft: dict | None, train: dict) -> tuple[str, int, str, list[str]]:
    """(adapter, LoRA rank, LoRA targets, reasons the estimator cannot express the run)."""
    out = []
    if train["optimizer_type"] != "AdamW":
        out.append(f"optimizer {train['optimizer_type']}")
    if train.get("compile"):
        out.append("torch.compile")
    if train["dtype"] not in ("bfloat16", "float32", "float16"):
        out.append(f"dtype {train['dtype']} (bitsandbytes default 4/8-bit, not QLoRA's NF4 recipe)")
    if peft is None:
        return "full", 0, "auto", out
    kind = peft["peft_type"]
    if kind != "LORA":
        return kind.lower(), 0, "auto", out + [f"adapter {kind}"]
    for key, allowed in LORA_DEFAULTS.items():
        if peft.get(key) not in allowed:
            out.append(f"LoRA {key}={peft.get(key)}")
    targets = peft["target_modules"]
    targets = ",".join(sorted(targets)) if isinstance(targets, list) else str(targets)
    return ("dora" if peft.get("use_dora") else "lora"), int(peft["r"]), targets, out


def _mean_tokens(tinfo: dict) -> str:
    """The run's own mean sample length: run.py's ``train total tokens`` counts each sample's tokens + 1 (EOS)."""
    final = [m for m in tinfo.get("metrics") or [] if "train total tokens" in m]
    if not final or not final[-1].get("train samples"):
        return ""
    mean = final[-1]["train total tokens"] / final[-1]["train samples"] - 1
    return f"; mean {mean:.1f} tokens per sample over the run (metrics: train total tokens / train samples, less EOS)"


def _row(entry: dict, data: dict) -> dict:
    info, train, peft = data["run_info"], data["run_info"]["train_config"], data["run_info"]["peft_config"]
    tinfo, meta = data["train_info"], data["meta_info"]
    packages = meta["package_info"]
    adapter, rank, targets, out_of_scope = _scope(peft, train)
    key = "accelerator_memory_max" if "accelerator_memory_max" in tinfo else "cuda_memory_max"
    precision = {"bfloat16": "bf16", "float16": "bf16", "float32": "fp32"}.get(train["dtype"], "bf16")
    if train["dtype"] == "float16" or train.get("use_amp"):
        out_of_scope.append(f"dtype {train['dtype']} with use_amp={train.get('use_amp')}")
    accelerator = meta["system_info"].get("accelerator") or meta["system_info"].get("gpu")
    ok = tinfo["status"] == "success" and not info.get("error_msg")
    assumptions = [
        "value = max_memory_reserved() over the whole run (training, then generation eval at batch 50 every "
        "250 steps and at the end); the training step is assumed to set it",
        "the 2 MiB segment of the 1x1 Linear the benchmark subtracts is added back (value_offset_bytes)",
        f"seq_len = max_seq_length {train['max_seq_length']}: the cap; the longest batch over {train['max_steps']} "
        f"steps of {train['batch_size']} samples is assumed to reach it (samples <= 1300 characters, which the "
        "benchmark's data.py ties to the 768-token limit); re-score with the batch lengths when --lengths lands",
        "attention: attn_implementation null -> transformers' default sdpa",
        "batch = padded: each batch is padded to its longest sample, so transformers builds the 4-D attention mask "
        "(SDPA keeps it per layer and repeats the grouped key/value heads)",
        "torch.optim.AdamW default foreach implementation; gradient clipping at 1.0 (foreach norm)",
        "use_cache: the Llama config's (true): run.py calls model(**batch, num_items_in_batch=...) with no "
        "use_cache and no checkpointing, so each layer's key/value cache stays in the output object, which the "
        "loop keeps through backward and the optimizer step",
        "run.py empties the cache every 10 steps (ACCELERATOR_EMPTY_CACHE_SCHEDULE, huggingface/peft@026d1e01), so "
        "the reserved peak is what at most 10 consecutive steps of mixed lengths reserve"]
    return row(
        row_id=f"{SOURCE}:{entry['commit'][:12]}:{info['experiment_name']}", source=SOURCE, source_ref=ref(entry),
        source_table=f"train_info.{key}", source_key=info["experiment_name"],
        model=MODELS[train["model_id"]], gpu=GPUS[accelerator], method="single", world_size=1,
        micro_batch_size=int(train["batch_size"]), seq_len=int(train["max_seq_length"]), precision=precision,
        optimizer="adamw", grad_ckpt=bool(train.get("use_gc") or False),
        attn=train.get("attn_implementation") or "sdpa", lora_rank=rank, lora_targets=targets,
        lora_dropout=float((peft or {}).get("lora_dropout") or 0) if rank else 0.0,
        model_hub_id=train["model_id"], framework="transformers+peft (custom loop)", adapter=adapter,
        loop="manual", batch="padded", use_cache=True, padding="longest", max_length=int(train["max_seq_length"]), seq_len_basis="max_length_cap",
        lengths="MetaMathQA filtered to <= 1300 characters (query + response), Llama-3 tokenizer, bucketed by "
                "length (bucket_factor x batch), padded per batch to the longest sample" + _mean_tokens(tinfo),
        rescore_lengths=True, torch_version=packages.get("torch-version", ""),
        transformers_version=packages.get("transformers-version", ""),
        peft_version=packages.get("peft-version", ""), bitsandbytes_version=packages.get("bitsandbytes-version", ""),
        other_versions=f"datasets {packages.get('datasets-version', '')}",
        quantity="max_reserved", scope="per_gpu", value=int(tinfo[key]), unit="B",
        value_offset_bytes=2 * 1024**2,
        complete=ok, in_scope=ok and not out_of_scope,
        missing="" if ok else f"run status {tinfo['status']}: {info.get('error_msg', '')[:80]}",
        assumptions="; ".join(assumptions + ([f"not expressible: {', '.join(out_of_scope)}"] if out_of_scope
                                             else [])))


def extract() -> list[dict]:
    entries = manifest(SOURCE)
    rows, seen = [], set()
    for local, entry in sorted(entries.items()):
        data = json.loads((SOURCES / SOURCE / local).read_text())
        run = (data["run_info"]["experiment_name"], data["run_info"]["created_at"])
        if run in seen:  # the same run re-committed (2025-07 renamed cuda_memory_max): one measurement, one row
            continue
        seen.add(run)
        rows.append(_row(entry, data))
    return rows
