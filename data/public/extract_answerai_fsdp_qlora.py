"""Rows from AnswerDotAI/fsdp_qlora ``benchmarks_03_2024.md`` (2 x RTX 3090 and 2 x RTX 4090, Feb-Mar 2024).

What the numbers mean, from the repository's ``train.py`` (AnswerDotAI/fsdp_qlora@50efa1efa0ed1451b466686bc89c07007637ae48,
2024-03-26, the first commit that logs both allocated and reserved memory as the page quotes them; its
memory-shaping code for ``--train_type lora`` is the same from 049515f, 2024-03-19, which added the page's
``--dataset_samples``, up to the page's own commit e877dda). train.py is not copied; its values are here:

* ``Peak Memory (GiB)`` is ``torch.cuda.max_memory_reserved(local_rank) / 2**30`` on rank 0 after epoch 0
  (``reset_peak_memory_stats`` right before the loop, so model loading and wrapping are excluded); the page says
  so ("the reported peak reserved memory"), and its note under the LoRA context-length table gives the same runs'
  ``max_memory_allocated`` (8.28 / 9.16 GiB), which are rows of their own.
* the page's template: ``python train.py --model_name meta-llama/Llama-2-7b-hf --batch_size B --context_length
  2048 --train_type lora|qlora --use_gradient_checkpointing True --reentrant_checkpointing True --use_cpu_offload
  False --dataset dummy --dataset_samples 1024``; the tables vary train type, batch size, context length,
  ``--use_cpu_offload`` and the sharding strategy (``DDP True``: ``--sharding_strategy ddp``, FSDP1's NO_SHARD,
  "still using FSDP, but in distributed data parallel mode"). Two GPUs on one machine.
* defaults of train.py at that commit: ``precision bf16`` (the model loaded in bf16 and cast with
  ``model.to(bf16)``, no FSDP MixedPrecision policy, no autocast: pure bf16), ``optimizer adamw``
  (``torch.optim.AdamW``, foreach default), gradient accumulation 1, LoRA r=64, alpha 16, dropout 0.1 on
  ``k_proj q_proj v_proj up_proj down_proj gate_proj`` (``lora_target_modules all``: no ``o_proj``) through
  peft's ``get_peft_model``; ``attn_implementation sdpa``, ``use_cache=False``; FSDP1 (``FullyShardedDataParallel``)
  with the llama-recipes LoRA policy (each trainable leaf Linear, i.e. each LoRA A/B, its own unit, plus one
  unit per ``LlamaDecoderLayer``), ``use_orig_params=False``, ``limit_all_gathers=True``, backward prefetch at
  torch's default (BACKWARD_PRE, as the page says), ``CPUOffload(offload_params=True)`` with
  ``--use_cpu_offload``; FSDP's ``apply_activation_checkpointing`` (REENTRANT) on every decoder layer.
* data: ``--dataset dummy`` is 1,024 copies of an Alpaca-formatted sample whose output is
  ``"output" * context_length * 2``, truncated to ``context_length``: every row is exactly ``context_length``
  tokens, and the model is called with ``attention_mask=None`` (``batch=full``).
* the loop: ``output = model(input_ids, labels=labels)``, ``loss = output.loss``, ``loss.backward()``, the
  optimizer step, and only then ``output = None``: the output object is alive through backward (``loop=manual``).

Unpinned: torch ("Pytorch >= 2.2 is recommended", train.py's comment "torch 2.2 sdpa uses flash attn 2"),
transformers and peft (``pip install llama-recipes`` in Feb-Mar 2024: transformers 4.37-4.39, peft 0.8-0.10).
What those releases change, recorded on each row: peft before 0.12 casts new LoRA weights to the base layer's
dtype (``self.to(weight.device, dtype=weight.dtype)`` in ``LoraLayer.update_layer``, peft v0.8.2 to v0.11.1; 0.12
added ``autocast_adapter_dtype``, fp32 adapters), so the adapters, their gradients and AdamW states are bf16 and
peft feeds them the bf16 inputs: ``lora_dtype model`` for LoRA as for QLoRA (train.py casts the model to bf16
before ``get_peft_model``); and Llama's model code of those releases returns fp32 logits (``logits.float()``),
which the manual loop holds through backward: ``model_code`` 4.44 (profiles traced with transformers 4.44.2 and
peft 0.12.0 building the adapters in bf16 ship for these rows).

QLoRA under FSDP1 (bnb 4-bit weights with ``quant_storage`` bf16, no kbit preparation, bf16 adapters) is the
estimator's ``qlora`` with ``lora_dtype model`` (docs/fsdp1_qlora.md). Yi-34B and Mistral-7B-v0.2 are not in the
catalogue: those rows are kept, out of scope.
Standard library only.
"""

from __future__ import annotations

import re

from common import SOURCES, manifest, ref, row

SOURCE = "answerai_fsdp_qlora"
TRAIN_REF = "AnswerDotAI/fsdp_qlora@50efa1efa0ed1451b466686bc89c07007637ae48:train.py"
# the case studies' machines: two GPUs of one kind each
MACHINES = {"3090": "rtx3090-24gb", "4090": "rtx4090-24gb"}
MODELS = {"Llama-2 7B": ("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-7b-hf"), "Yi 34B": ("01-ai/Yi-34B", None),
          "Llama-2 70B": ("meta-llama/Llama-2-70b-hf", "meta-llama/Llama-2-70b-hf"),
          "Mistral 7B v0.2 Base": ("mistral-community/Mistral-7B-v0.2", None)}
TARGETS = "down_proj,gate_proj,k_proj,q_proj,up_proj,v_proj"
WORLD = 2
# the runs' transformers is unpinned (4.37-4.39 in Feb-Mar 2024); 4.44 is the oldest release the profiler traces,
# and Llama's forward and loss are the same from 4.37 to 4.45 where they shape memory: the logits upcast to fp32 in
# forward (held by this manual loop) and a shifted fp32 copy in the loss; SDPA without a mask runs causal.
MODEL_CODE = "4.44"
# the 3090 LoRA context-length runs' allocated peaks, from the note under that table
ALLOCATED_NOTE = re.compile(r"peak allocated memory is ([0-9.]+) GiB vs ([0-9.]+) GiB")


def _tables(text: str):
    """(machine, heading, caption, header cells, rows, note after the table) for every pipe table."""
    lines = text.splitlines()
    machine, heading, i = "", "", 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("## Case Study:"):
            found = re.search(r"Dual (\d{4})", line)
            machine = found.group(1) if found else ""
        elif line.startswith("## "):
            machine = ""
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.startswith("|") and i + 1 < len(lines) and set(lines[i + 1].strip()) <= set("|-: "):
            header = [c.strip() for c in line.strip("|").split("|")]
            body, i = [], i + 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                body.append(dict(zip(header, (c.strip() for c in lines[i].strip().strip("|").split("|")))))
                i += 1
            caption, after = "", []
            while i < len(lines) and not lines[i].strip().startswith(("|", "#")):
                stripped = lines[i].strip()
                if not caption and re.fullmatch(r"\*[^*].*\*", stripped):
                    caption = stripped.strip("*")
                elif stripped:
                    after.append(stripped)
                i += 1
            yield machine, heading, caption, header, body, " ".join(after)
            continue
        i += 1


def _model_of(caption: str):
    for name, ids in MODELS.items():
        if caption.startswith(name):
            return ids
    raise ValueError(f"unknown model in caption {caption!r}")


def _truthy(cell: str) -> bool:
    return cell.strip().lower() == "true"


def _rows(entry, machine, heading, caption, cells, allocated=None):
    hub, model = _model_of(caption)
    adapter = cells["Train Type"].strip().lower()
    batch = int(cells.get("Batch Size") or (1 if "batch size of one" in caption else 0))
    ctx_cell = cells.get("Context Length") or re.search(r"Context Length of ([0-9,]+)", caption).group(1)
    seq = int(ctx_cell.replace(",", ""))
    offload = _truthy(cells.get("CPU Offload", "False"))
    ddp = _truthy(cells.get("DDP", "False"))
    gpu = MACHINES[machine]
    out = []
    if model is None:
        out.append(f"{hub} is not in the estimator's catalogue")
    notes = [f"code semantics: {TRAIN_REF} (the page pins no commit: runs of Feb-Mar 2024; --dataset_samples, "
             "used by the page's template, exists from 049515f of 2024-03-19, and the LoRA path's memory-shaping "
             "code is unchanged from there to the page's commit)",
             "template: --use_gradient_checkpointing True --reentrant_checkpointing True --dataset dummy "
             "--dataset_samples 1024; train.py defaults: --precision bf16 (pure bf16), --optimizer adamw, "
             "gradient accumulation 1, --lora_rank 64 --lora_alpha 16 --lora_dropout 0.1, --lora_target_modules "
             "all (k, q, v, up, down, gate; no o_proj), FSDP1 use_orig_params=False, limit_all_gathers=True, "
             "backward prefetch BACKWARD_PRE (torch's default, stated by the page)",
             "every row is exactly context_length tokens (dummy output of 2 x context_length repeats, truncated); "
             "attention_mask=None",
             "loop: the output object is set to None only after backward and the optimizer step",
             "versions unpinned (pip install llama-recipes, Feb-Mar 2024): transformers 4.37-4.39 (model_code 4.44, the "
             "oldest release the profiler traces, stands in: Llama's forward returns fp32 logits, held by the manual "
             "loop, and the loss takes a shifted fp32 copy, in 4.37-4.45 alike; 4.38-4.39 also pass SDPA a "
             "materialized causal mask, not modelled), peft 0.8-0.10 (LoRA weights cast to the base layer's bf16: "
             "lora_dtype model), bitsandbytes >= 0.43.0, torch >= 2.2",
             "rank 0's figure; both ranks run the same shapes"]
    if ddp:
        notes.append("DDP True: --sharding_strategy ddp, FSDP1 NO_SHARD (the page's footnote)")
    if offload:
        notes.append("CPU Offload True: FSDP1 CPUOffload(offload_params=True)")
    if adapter == "qlora":
        notes.append("QLoRA: every Linear of model.model NF4 with quant_storage bf16, the rest and the adapters bf16, "
                     "no prepare_model_for_kbit_training (lora_dtype model); the packed weights sharded by FSDP1, "
                     "their quant states whole on each rank (docs/fsdp1_qlora.md)")
    spec = dict(
        source=SOURCE, source_ref=ref(entry), model=model or hub, gpu=gpu, method="fsdp1", world_size=WORLD,
        micro_batch_size=batch, seq_len=seq, precision="bf16", optimizer="adamw", grad_ckpt=True, attn="sdpa",
        lora_rank=64, lora_targets=TARGETS, lora_dropout=0.1, qlora=adapter == "qlora",
        lora_dtype="model", grad_accum_steps=1,
        loop="manual", batch="full", use_cache=False, fsdp1_sharding_strategy="NO_SHARD" if ddp else "FULL_SHARD",
        fsdp1_use_orig_params=False, fsdp1_cpu_offload=offload, fsdp1_backward_prefetch="BACKWARD_PRE",
        fsdp1_forward_prefetch=False, fsdp1_limit_all_gathers=True, fsdp1_gpus_per_node=WORLD, model_hub_id=hub,
        framework=f"fsdp_qlora train.py ({TRAIN_REF.split('@')[1][:7]}; custom loop, FSDP1, transformers model, peft LoRA)",
        adapter=adapter, padding="max_length", max_length=seq, seq_len_basis="longest_sample",
        lengths=f"every sample {seq} tokens (dummy data truncated to context_length)", rescore_lengths=False,
        torch_version="", transformers_version="", peft_version="", model_code=MODEL_CODE, scope="per_gpu", unit="GiB", complete=True,
        in_scope=not out)
    key = f"{SOURCE}:{machine}:{hub.rsplit('/', 1)[1]}:{adapter}:b{batch}:s{seq}" + (":ddp" if ddp else "") + (
        ":offload" if offload else "")
    source_key = " | ".join(cells.values())
    table = f"{heading} ({caption})"
    tail = [f"not expressible: {'; '.join(out)}"] if out else []
    made = [row(row_id=f"{key}:reserved", source_table=table, source_key=source_key, quantity="max_reserved",
                value=float(cells["Peak Memory (GiB)"]), assumptions="; ".join(notes + tail), **spec)]
    if allocated is not None:
        made.append(row(row_id=f"{key}:allocated", source_table=f"{table}, the note under it",
                        source_key=source_key + f" | peak allocated {allocated} GiB", quantity="max_allocated",
                        value=allocated, assumptions="; ".join(notes + ["the page's note: 'the peak allocated "
                                                                         "memory is 8.28 GiB vs 9.16 GiB' for "
                                                                         "context 512 and 2048"] + tail), **spec))
    return made


def extract() -> list[dict]:
    rows = []
    for local, entry in sorted(manifest(SOURCE).items()):
        text = (SOURCES / SOURCE / local).read_text()
        for machine, heading, caption, header, body, after in _tables(text):
            if not machine or "Peak Memory (GiB)" not in header:
                continue
            allocated = ALLOCATED_NOTE.search(after)
            for cells in body:
                extra = None
                if allocated and cells["Train Type"] == "LoRA" and "Context Length" in cells:
                    # the note's two figures are the table's 512 and 2048 rows, "respectively"
                    extra = float({"512": allocated.group(1), "2048": allocated.group(2)}[cells["Context Length"]])
                rows += _rows(entry, machine, heading, caption, cells, extra)
    return rows
