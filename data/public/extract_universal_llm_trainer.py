"""Rows from ljm565/universal-llm-trainer ``docs/gpu_test.md`` (H100, RTX Pro 6000, A100 tables).

What the numbers mean, from the repository's code at the same commit (9efd14b):

* the trainer's only memory readout is ``torch.cuda.memory_reserved() / 1E9`` printed as ``G`` each step
  (``src/trainer/trainer.py``); reserved memory never shrinks inside an epoch (``empty_cache`` runs at its end),
  so the figure is the run's max reserved. The table writes ``GiB``, but its own "Model Mem." column is in
  GB: Llama 3.1 8B in bf16 (8.03e9 parameters x 2 B = 16.1e9 B) is listed as "16 GiB", Llama 2 13B as 26.2 and
  Phi3-mini (3.82e9 x 2 B) as 7.6-7.7; so the unit is taken as GB (1e9 B), and whole-number values carry a
  rounding of +-0.5 GB.
* the train step (``_, loss = self.model(...)``, ``del_logits_after_forward: True`` in every config) drops the
  output object before ``loss.backward()``: ``loop=trainer``. The model is called without labels and the loss is
  ``nn.CrossEntropyLoss`` on its logits sliced ``[:, :-1]`` and reshaped (``src/models/llama3.py``). With a bf16
  model (full, LoRA) that is a bf16 log-softmax over 2 x 8,192 x 128k logits, where transformers' labels path,
  which the estimator's profiles trace, upcasts to fp32 and keeps an fp32 log-softmax (~8 GB more here): no spec
  column expresses that loss path, so those rows are out of scope. QLoRA loads the non-quantized modules in fp32
  (``dtype=float32``), so its LM head returns fp32 logits and both loss paths keep an fp32 log-softmax: in scope.
* model loaded with ``dtype=bfloat16`` (``bit: bfloat16``; QLoRA: ``bit: 4``, the rest of the model fp32,
  bitsandbytes NF4 double quant, compute bf16), ``torch.optim.AdamW`` (foreach), ``amp_training: False``
  (pure bf16), ``attn_implementation: null`` (transformers 4.49's default: sdpa), gradient checkpointing on,
  LoRA r=8 on all seven projections (``config_lora/llm_lora_config.yaml``), micro-batch 2, every sample 8,192
  tokens ("without padding, fully filled tokens"), gradient accumulation 1 (full) or 32 (LoRA/QLoRA).
* rows marked ``*`` run FSDP1 (``fsdp_train: True``, ``cpu_offload: True``, size-based wrap) on 2 GPUs.
Standard library only.
"""

from __future__ import annotations

import re

from common import SOURCES, manifest, markdown_tables, ref, row

SOURCE = "universal_llm_trainer"
GPUS = {"H100": "h100-80gb", "A100": "a100-80gb"}   # A100: the 78-80 GB peaks need the 80 GB board
# config (model, model_size) -> hub id the trainer loads (src/utils/training_utils.py) -> catalogue model
HUB = {("llama3.1", "8b"): "meta-llama/Llama-3.1-8B-Instruct", ("llama2", "13b"): "meta-llama/Llama-2-13b-hf",
       ("llama3.1", "70b"): "meta-llama/Llama-3.1-70B-Instruct", ("llama3", "8b"): "meta-llama/Meta-Llama-3-8B-Instruct",
       ("gemma", "7b"): "google/gemma-7b", ("gemma2", "9b"): "google/gemma-2-9b-it",
       ("phi3", "4b"): "microsoft/Phi-3-mini-128k-instruct"}
CATALOGUE = {"meta-llama/Llama-3.1-8B-Instruct": "meta-llama/Llama-3.1-8B",
             "meta-llama/Llama-2-13b-hf": "meta-llama/Llama-2-13b-hf"}
ALL_LINEAR = "down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj"


def _yaml(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith((" ", "#")) and ":" in line:
            key, _, value = line.partition(":")
            out[key.strip()] = value.split("#", 1)[0].strip()
    return out


def _sections(text: str) -> list[tuple[str, str]]:
    """(GPU heading, the section's text) for each '### N. NVIDIA ...' section."""
    parts = re.split(r"^### \d+\. NVIDIA (.+)$", text, flags=re.M)
    return [(parts[i].strip(), parts[i + 1]) for i in range(1, len(parts), 2)]


def _versions(section: str) -> dict:
    found = dict(re.findall(r"(torch|transformers|bitsandbytes)==([0-9.]+)", section))
    return {"torch_version": found.get("torch", ""), "transformers_version": found.get("transformers", ""),
            "bitsandbytes_version": found.get("bitsandbytes", "")}


def _row(entry, configs, gpu_name, versions, cells) -> dict | None:
    peak = re.match(r"([0-9.]+) GiB", cells["Peak Mem. (Model Mem.)"])
    if not peak:  # OOM: not a measurement
        return None
    link = re.search(r"\((?:\.\./)+(config/[^)]+)\)", cells["Model"])
    config_entry, config = configs[link.group(1).replace("//", "/")]
    hub = HUB.get((config["model"], config["model_size"]), f"{config['model']}-{config['model_size']}")
    model = CATALOGUE.get(hub)
    fsdp = config.get("fsdp_train") == "True"
    world = len(config["device"].strip("[]").split(","))
    qlora = config["bit"] == "4"
    lora = config["peft_config_path"] not in ("False", "")
    # the LoRA config is snapshotted for the rows in scope (others keep 0: their rows are not scored)
    peft_config = configs.get(config["peft_config_path"], (None, {}))[1] if lora else {}
    lora_dropout = float(peft_config.get("lora_dropout") or 0)
    gpu = GPUS.get(gpu_name)
    out = []
    if model is None:
        out.append(f"{hub} is not in the estimator's catalogue")
    if gpu is None:
        out.append(f"GPU {gpu_name} is not in the GPU catalogue")
    if not qlora and config["bit"] in ("bfloat16", "16"):
        out.append("loss outside the model on bf16 logits (nn.CrossEntropyLoss: bf16 log-softmax); the estimator "
                   "traces transformers' labels path (fp32 upcast, fp32 log-softmax) and has no column for another "
                   "loss path")
    if fsdp:
        out.append("FSDP1 with cpu_offload=True (parameters, gradients and optimizer on the CPU): the estimator "
                   "models FSDP2 without offload")
    notes = [f"config {ref(config_entry)}", "value = memory_reserved()/1e9 as the trainer prints it (GB; the "
             "table's 'GiB' label contradicts its own Model Mem. column), rounded to whole GB by the table",
             "every sample fills 8,192 tokens (the page: without padding, fully filled tokens)",
             "loss: nn.CrossEntropyLoss on the sliced logits the model returns without labels (bf16 for a bf16 "
             "model, fp32 for QLoRA's fp32 LM head)",
             "checkpointing: the page says tests ran with both torch and Hugging Face checkpointing and publishes one "
             "value; the config's hf_checkpoint is taken",
             "attention: attn_implementation null -> sdpa (transformers 4.49 default)"]
    if qlora:
        notes.append("QLoRA: bnb NF4 double quant, compute bf16, non-quantized modules in fp32 (dtype float32)")
    return row(
        row_id=f"{SOURCE}:{gpu_name.replace(' ', '')}:{link.group(1).rsplit('/', 1)[1].removesuffix('.yaml')}",
        source=SOURCE, source_ref=ref(entry), source_table=f"NVIDIA {gpu_name}",
        source_key=" | ".join(c.strip() for c in cells.values()), model=model or hub, gpu=gpu or gpu_name,
        method="fsdp" if fsdp else "single", world_size=world, micro_batch_size=int(config["batch_size"]),
        seq_len=int(config["max_length"]), precision="bf16", optimizer="adamw", grad_ckpt=True, attn="sdpa",
        lora_rank=8 if lora else 0, lora_targets=ALL_LINEAR if lora else "auto", lora_dropout=lora_dropout,
        qlora=qlora,
        grad_accum_steps=int(config["gradient_accumuate_step"]), loop="trainer", model_hub_id=hub,
        framework="universal-llm-trainer 9efd14b (custom loop, transformers model)",
        adapter="qlora" if qlora else ("lora" if lora else "full"), padding="max_length",
        max_length=int(config["max_length"]), seq_len_basis="longest_sample",
        lengths="every sample 8,192 tokens (stated)", rescore_lengths=False, **versions,
        quantity="max_reserved", scope="per_gpu", value=float(peak.group(1)), unit="GB", complete=True,
        in_scope=not out, assumptions="; ".join(notes + ([f"not expressible: {'; '.join(out)}"] if out else [])))


def extract() -> list[dict]:
    entries = manifest(SOURCE)
    configs = {e["path"]: (e, _yaml((SOURCES / SOURCE / f).read_text())) for f, e in entries.items()
               if f.endswith(".yaml")}
    rows = []
    for local, entry in sorted(entries.items()):
        if entry["path"] != "docs/gpu_test.md":
            continue
        for gpu_name, section in _sections((SOURCES / SOURCE / local).read_text()):
            versions = _versions(section)
            for _, table in markdown_tables(section):
                for cells in table:
                    made = _row(entry, configs, gpu_name, versions, cells) if "Model" in cells else None
                    if made:
                        rows.append(made)
    return rows
