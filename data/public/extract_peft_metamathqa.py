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
import statistics

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


# A run whose per-window mean reserved follows its windows' mean sample length this closely emptied the cache
# after every step (run.py before huggingface/peft@90d3fc05, 2025-11-13), so each step's reserved is that step's own.
LINEAR_R = 0.98
# The line is in the windows' mean sample length; a batch is padded to its longest sample, which exceeds the
# batch's mean by about one sample sd (~95 tokens here) for 4 samples drawn at random and by far less in the
# BucketIterator's sorted buckets of 80. A batch at the cap is credited this much padding before the comparison.
PAD_MARGIN_TOKENS = 96


def _pipeline(data: dict) -> tuple:
    """What fixes the sequence of training batches: every run with the same key trains on the same batches
    (data.py filters MetaMathQA in file order, run.py's BucketIterator has no shuffle)."""
    train, meta = data["run_info"]["train_config"], data["meta_info"]
    return (meta["dataset_info"]["metamath"]["sha"], meta["model_info"]["sha"], train["model_id"],
            train["query_template"], train["max_seq_length"], train["batch_size"], train["max_steps"])


def cap_line(data: dict) -> dict | None:
    """The run's own length-to-reserved line, and where its published max lies on it.

    Each 250-step window logs its tokens (tokens / sec x train time) and its mean reserved after a step; when the
    cache is emptied after every step the mean reserved is linear in the window's mean sample length (weights +
    activations per padded token). Every term that grows faster than linearly with the length (the attention
    mask) only adds, so the line's value at the cap, less the padding margin, is a lower bound for a batch that
    reaches the cap. None when
    the run's windows are not that linear (the cache emptied every 10 steps keeps blocks of earlier steps)."""
    tinfo = data["train_info"]
    windows = [m for m in tinfo.get("metrics") or [] if m.get("tokens / sec") and m.get("mem reserved avg")]
    if len(windows) < 10 or tinfo.get("status") != "success":
        return None
    samples = [m["train samples"] for m in windows]  # cumulative
    samples = [b - a for a, b in zip([0] + samples[:-1], samples)]
    if min(samples) <= 0:
        return None
    per_sample = [m["tokens / sec"] * m["train time"] / n for m, n in zip(windows, samples)]
    reserved_gib = [m["mem reserved avg"] / 2**30 for m in windows]
    if len(set(per_sample)) < 2 or statistics.correlation(per_sample, reserved_gib) < LINEAR_R:
        return None
    slope, intercept = statistics.linear_regression(per_sample, reserved_gib)
    key = "accelerator_memory_max" if "accelerator_memory_max" in tinfo else "cuda_memory_max"
    cap = data["run_info"]["train_config"]["max_seq_length"]
    max_gib = tinfo[key] / 2**30
    return {"name": data["run_info"]["experiment_name"], "slope_gib": slope, "intercept_gib": intercept,
            "at_cap_gib": intercept + slope * (cap - PAD_MARGIN_TOKENS), "max_gib": max_gib,
            "tokens_at_max": (max_gib - intercept) / slope if slope > 0 else float("inf")}


def _cap_evidence(runs: list[dict]) -> dict[tuple, str]:
    """{pipeline: why the cap is not the longest batch} for pipelines where a run's max lies below its own line
    at the cap (the batches are the pipeline's, so the finding holds for every run on it)."""
    refuting: dict[tuple, list[dict]] = {}
    for data in runs:
        line = cap_line(data)
        if line and line["max_gib"] < line["at_cap_gib"]:
            refuting.setdefault(_pipeline(data), []).append(line)
    out = {}
    for key, lines in refuting.items():
        cap, samples = key[4], key[5] * key[6]
        tokens = sorted(x["tokens_at_max"] for x in lines)
        typical = min(lines, key=lambda x: abs(x["slope_gib"] - statistics.median(y["slope_gib"] for y in lines)))
        out[key] = (
            f"the longest training batch: {len(lines)} runs on the same batches (dataset, tokenizer, template, "
            f"cap, batch size, steps, no shuffle) emptied the cache after every step, and each one's 20 windows "
            f"put its mean reserved on a line in the window's mean sample length (r >= {LINEAR_R}; e.g. "
            f"{typical['name']}: {typical['intercept_gib']:.2f} GiB + {typical['slope_gib']:.4f} GiB per token, the "
            f"intercept near the bf16 weights); a batch at the {cap}-token cap, credited {PAD_MARGIN_TOKENS} tokens of "
            f"padding, would reserve at least the line's {typical['at_cap_gib']:.1f} GiB, the run's max is "
            f"{typical['max_gib']:.2f} GiB: on the runs' own lines the max sits at a mean sample length of "
            f"{tokens[0]:.0f}-{tokens[-1]:.0f} tokens, so the cap was not reached; the longest batch needs the "
            f"token lengths of the first {samples:,} filtered samples (the dataset is not reachable here), and "
            "inferring it from the max would fit the row to itself")
    return out


def _mean_tokens(tinfo: dict) -> str:
    """The run's own mean sample length: run.py's ``train total tokens`` counts each sample's tokens + 1 (EOS)."""
    final = [m for m in tinfo.get("metrics") or [] if "train total tokens" in m]
    if not final or not final[-1].get("train samples"):
        return ""
    mean = final[-1]["train total tokens"] / final[-1]["train samples"] - 1
    return f"; mean {mean:.1f} tokens per sample over the run (metrics: train total tokens / train samples, less EOS)"


def _row(entry: dict, data: dict, cap_refuted: str = "") -> dict:
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
        f"seq_len = max_seq_length {train['max_seq_length']}: the cap, an upper bound of the longest batch over "
        f"{train['max_steps']} steps of {train['batch_size']} samples (samples <= 1300 characters, which the "
        "benchmark's data.py ties to the 768-token limit); re-score with the batch lengths (--lengths)",
        "attention: attn_implementation null -> transformers' default sdpa",
        "batch = padded: each batch is padded to its longest sample, so transformers builds the 4-D attention mask "
        "(SDPA keeps it per layer and repeats the grouped key/value heads)",
        "torch.optim.AdamW default foreach implementation; gradient clipping at 1.0 (foreach norm)",
        "use_cache: the Llama config's (true): run.py calls model(**batch, num_items_in_batch=...) with no "
        "use_cache and no checkpointing, so each layer's key/value cache stays in the output object, which the "
        "loop keeps through backward and the optimizer step",
        ("run.py empties the cache every 10 steps (ACCELERATOR_EMPTY_CACHE_SCHEDULE, huggingface/peft@90d3fc05), so "
         "the reserved peak is what at most 10 consecutive steps of mixed lengths reserve"
         if info["created_at"] >= "2025-11-13" else
         "run.py (before huggingface/peft@90d3fc05) empties the cache after every step, so the reserved peak is "
         "one step's")]
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
        complete=ok and not cap_refuted, in_scope=ok and not out_of_scope,
        missing=(f"run status {tinfo['status']}: {info.get('error_msg', '')[:80]}" if not ok else cap_refuted),
        assumptions="; ".join(assumptions + ([f"not expressible: {', '.join(out_of_scope)}"] if out_of_scope
                                             else [])))


def extract() -> list[dict]:
    entries = manifest(SOURCE)
    runs, seen = [], set()
    for local, entry in sorted(entries.items()):
        data = json.loads((SOURCES / SOURCE / local).read_text())
        run = (data["run_info"]["experiment_name"], data["run_info"]["created_at"])
        if run in seen:  # the same run re-committed (2025-07 renamed cuda_memory_max): one measurement, one row
            continue
        seen.add(run)
        runs.append((entry, data))
    evidence = _cap_evidence([data for _, data in runs])
    return [_row(entry, data, evidence.get(_pipeline(data), "")) for entry, data in runs]
