"""Rows from LitGPT's published fine-tuning memory tables (Lightning-AI/litgpt).

Two tables, each read with the code of the LitGPT commit that produced it:

* ``tutorials/resource-tables.md`` ("Finetuning with LoRA on 1 GPU" / "on Multiple GPUs"; LitGPT commit
  8641822, A100-SXM4-40GB, torch 2.1.0+cu121, bitsandbytes 0.41.1). ``finetune/lora.py`` at 8641822: LoRA r=8 on
  query and value, AdamW (bitsandbytes PagedAdamW when quantized), ``--precision bf16-true``, the first
  iteration's micro-batch holds the longest training sample and is padded to it (the table states those lengths
  per tokenizer), one GPU: no checkpointing; several GPUs: FSDP (full shard) with activation checkpointing of every
  Block; gradient accumulation ``batch_size // micro_batch_size`` = 128 // micro-batch (not divided by the device
  count); ``Memory used`` = ``torch.cuda.max_memory_allocated() / 1e9`` (GB).
  Several GPUs (Lightning at 71aed751, the commit LitGPT 8641822's requirements.txt pins; the page says 2.1.0.rc0;
  torch 2.1): ``finetune/lora.py:83-85`` ``FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy=
  {Block})``: FSDP1, one unit per Block with its LoRA tensors inside (``fsdp1_lora_wrap=layer``; bf16-true builds
  them in bf16), ``lightning/fabric/strategies/fsdp.py:175`` ``use_orig_params=True``, ``:756`` non-reentrant
  checkpoint wrappers inside the units, torch's default BACKWARD_PRE and FULL_SHARD; ``lora.py:215``
  ``fabric.no_backward_sync(model, enabled=is_accumulating)`` = ``module.no_sync()`` (``fsdp.py:773``) on every
  micro-batch but the last (``grad_sync=last``). With ``use_orig_params`` a Block's flat parameter requires a
  gradient (its adapters do), so every frozen weight gets one: under ``no_sync`` each rank holds the whole layer
  stack's unsharded bf16 gradients (about the whole model) beside its weight shard. The model is built on the
  meta device (``lora.py:128`` ``init_module(empty_init=True)``, ``fsdp.py:339-343``) and materialized one unit at
  a time by FSDP, and ``load_raw`` unshards one unit at a time (FULL_STATE_DICT load hooks): no setup peak.
* ``config_hub/finetune/README.md`` (the config files next to it, LitGPT commit 00af8b0d, A10G): the YAML gives
  LoRA rank/targets, quantization, devices, micro-batch, max_seq_length 512, AdamW; ``litgpt/finetune/*.py`` at
  that commit: FSDP with activation checkpointing when devices > 1, batches padded to their longest sample and
  cut at max_seq_length, gradient accumulation ``global_batch_size // devices // micro_batch_size``
  (``TrainArgs.gradient_accumulation_iters``: with full fine-tuning every later micro-batch starts with all
  gradients held), ``max_memory_allocated() / 1e9``. The README says every run is single-GPU and that
  ``--devices`` is what uses more GPUs, so the world size is the config's ``devices``, not the machine's count.
  A full fine-tuning row published below its own model states (bf16 weights + gradients + two AdamW states =
  8 bytes/parameter) cannot have run as its config says; what ran instead is not published: incomplete.

LitGPT runs its own model code (not transformers): SDPA attention, the LM head evaluated in chunks of 128 tokens
and a chunked cross-entropy; the loop keeps the logits alive through backward (``loop=manual``). OOM and N/A
entries are not measurements and give no row. The estimator's ``ce=chunked`` (torchtune's loss) is not this loss
and the rows do not use it: at both commits (8641822 ``lit_gpt/utils.py``, 00af8b0d ``litgpt/utils.py``
``chunked_cross_entropy``) LitGPT's LoRA scripts keep the list of bf16 head outputs (``model(input_ids,
lm_head_chunk_size=128)``) bound through backward and take ``F.cross_entropy`` of each bf16 chunk (a bf16
log-softmax saved per chunk), and ``finetune/full.py`` computes the whole head, slices off the last position (a
copy) and cross-entropies 128-row pieces of it; torchtune's loss applies the head inside the loss, upcasts each
chunk to fp32 (an fp32 log-softmax saved per chunk) and binds no logits in the output, and the estimator models
it for full fine-tuning only. What each holds from the loss to its backward is the same size (LitGPT: the bf16
head outputs + a bf16 log-softmax, 2 + 2 bytes per token and vocabulary entry; torchtune: one fp32 log-softmax, 4
bytes), the chunks' transients differ (LitGPT: 128-token bf16 pieces; torchtune: ``ce_chunks`` fp32 pieces), but
``ce`` is refused with LoRA (``TrainingSpec``: the long-context techniques are modelled for full fine-tuning
only), so the LoRA rows cannot carry it. LitGPT's LoRA tensors are made under ``fabric.init_module``, so
``bf16-true`` builds them in bf16: the LoRA rows carry ``lora_dtype=model`` (the adapters' inputs, dropped inputs
and states in bf16, not peft's fp32). Left unmodelled: LitGPT drops the input once per fused QKV where peft's
q/k/v adapters each keep one, and ``zero_pad`` (``lora.py`` at 00af8b0d) pads the adapter output to the qkv width
with ``new_zeros`` + ``index_copy_``, which saves no tensor for backward (a forward transient only). QLoRA rows
are Lightning's recipe (``qlora_quantizer=lightning``: Lightning 71aed751's ``BitsandbytesPrecision`` quantizes
every Linear, the LM head included, from fp16; norms, embedding and adapters bf16: ``lora_dtype=model``, no kbit
preparation) under the row's bitsandbytes (``qlora_bnb``, from ``bitsandbytes_version``: 0.41.1 keeps each 4-bit
Linear's input, ``estimator.profiler.bnb_041``); bitsandbytes' PagedAdamW holds the adapters' states in managed
memory, outside ``max_memory_allocated`` (not modelled: AdamW's bf16 states of the adapters are counted, 4 x 2 B
per trainable parameter, 17 MB for Llama-2-7B's q/v adapters). Standard library only.
"""

from __future__ import annotations

import re

from common import SOURCES, manifest, markdown_tables, ref, row

SOURCE = "litgpt"
# LitGPT checkpoint (hub id) -> catalogue model; None: architecture not in the catalogue.
MODELS = {"meta-llama/Llama-2-7b-hf": "meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-13b-hf":
          "meta-llama/Llama-2-13b-hf", "meta-llama/Meta-Llama-3.1-8B": "meta-llama/Llama-3.1-8B",
          "meta-llama/Llama-3.2-1B": "meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-3B": "meta-llama/Llama-3.2-3B",
          "mistralai/Mistral-7B-v0.1": "mistralai/Mistral-7B-v0.1",
          "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T": "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T"}
# resource-tables.md model names -> (hub id, longest Alpaca sample in that tokenizer, as the page states)
RESOURCE_MODELS = {("1.3 B", "phi-1.5"): ("microsoft/phi-1_5", 1044),
                   ("3 B", "StableLM Alpha"): ("stabilityai/stablelm-base-alpha-3b", 1034),
                   ("7 B", "Llama 2"): ("meta-llama/Llama-2-7b-hf", 1304),
                   ("13 B", "Llama 2"): ("meta-llama/Llama-2-13b-hf", 1304),
                   ("40 B", "Falcon"): ("tiiuae/falcon-40b", 1079)}
# LitGPT LoRA switches -> transformers module names of the Llama/Mistral family
LORA_MODULES = {"lora_query": ["q_proj"], "lora_key": ["k_proj"], "lora_value": ["v_proj"],
                "lora_projection": ["o_proj"], "lora_mlp": ["gate_proj", "up_proj", "down_proj"],
                "lora_head": ["lm_head"]}
GPUS = {"A10G": "a10-24gb", "A100": "a100-40gb"}
RESOURCE_BATCH = 128  # finetune/lora.py at 8641822: batch_size; accumulation = batch_size // micro_batch_size
RESOURCE_LORA_DROPOUT = 0.05  # finetune/lora.py at 8641822: lora_dropout
BYTES_PER_PARAM_FLOOR = 8  # bf16 weights + gradients + two bf16 AdamW states
# Parameter counts of the full fine-tuning checkpoints (LitGPT's own config: Llama-3.2 untied, so the LM head counts)
FULL_PARAMS = {"meta-llama/Llama-3.2-1B": 1_498_482_688, "meta-llama/Llama-3.2-3B": 3_606_752_256,
               "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T": 1_100_048_384}
# Config names the README misspells (its model column and the neighbouring rows name the real file).
README_TYPOS = {"gemma2b/qlora.yaml": "gemma2-2b/qlora.yaml"}
COMMON = ["LitGPT's own model code: SDPA, LM head in chunks of 128 tokens and chunked cross-entropy "
          "(transformers computes the full logits)", "bf16-true: weights, gradients and AdamW states in bf16 "
          "(LoRA weights too)"]
QLORA_NOTE = ("LitGPT QLoRA: Lightning's BitsandbytesPrecision quantizes every Linear incl. the LM head to "
              "{kind} from fp16 (qlora_quantizer lightning), the rest stays bf16 (lora_dtype model: no kbit "
              "preparation), optimizer bitsandbytes PagedAdamW (states in managed memory, outside the caching "
              "allocator; counted as AdamW's bf16 states of the adapters)")


def _value(cell: str) -> float | None:
    match = re.fullmatch(r"([0-9.]+) GB", cell.strip())
    return float(match.group(1)) if match else None


def _yaml(text: str) -> dict:
    """The flat and one-level-nested scalars of a LitGPT config (all this needs; no YAML dependency)."""
    out, section = {}, ""
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        key, _, value = line.strip().partition(":")
        if indent == 0:
            section = key if not value.strip() else ""
            out[key] = value.strip()
        elif indent == 2 and section:
            out[f"{section}.{key}"] = value.strip()
    return out


def _below_states(hub: str, kind: str, value_gb: float) -> str:
    """Why a full fine-tuning row's spec cannot be known: its published peak is below the model states the
    stated run must hold ('' when it is not)."""
    params = FULL_PARAMS.get(hub)
    if kind != "full" or params is None or value_gb * 1e9 >= BYTES_PER_PARAM_FLOOR * params:
        return ""
    return (f"what ran: the published {value_gb} GB is below the model states of the stated bf16 AdamW full "
            f"fine-tuning ({params:,} parameters x {BYTES_PER_PARAM_FLOOR} B = "
            f"{BYTES_PER_PARAM_FLOOR * params / 1e9:.1f} GB before any activation), so the run differed from its "
            "config (devices, optimizer or precision) in a way the page does not say")


def _lora_dtype(quantized: bool) -> str:
    """LitGPT's LoRA tensors are created with the model under ``fabric.init_module`` (finetune/lora.py at both
    commits), so ``bf16-true`` builds them in bf16: ``model``; with QLoRA too (Lightning's ``BitsandbytesPrecision``
    casts nothing to fp32: QLoRA without kbit preparation)."""
    return "model"


def _quantizer(quantized: bool) -> str:
    """Lightning's ``BitsandbytesPrecision`` quantizes every Linear, the head included (``qlora_quantizer``)."""
    return "lightning" if quantized else "transformers"


def _targets(config: dict) -> str:
    names = [m for key, mods in LORA_MODULES.items() if config.get(key) == "true" for m in mods]
    return ",".join(sorted(names))


def _resource_rows(entry: dict, text: str) -> list[dict]:
    rows = []
    for heading, table in markdown_tables(text):
        if not heading.startswith("Finetuning with LoRA"):
            continue
        multi = "Multiple" in heading
        for cells in table:
            value = _value(cells.get("Max GPU RAM", ""))
            if value is None:
                continue
            hub, longest = RESOURCE_MODELS[(cells["Size"], cells["Model"])]
            world = int(cells["GPU"].split()[0]) if multi else 1
            quant = cells["Quantization"]
            model = MODELS.get(hub)
            notes = COMMON + [f"seq_len {longest}: the longest Alpaca sample in this tokenizer (the page's list); "
                              "iteration 0 pads its micro-batch to it",
                              "LoRA r=8 alpha=16 on query and value (finetune/lora.py defaults at 8641822); "
                              f"trainable parameters {cells['Trainable parameters']}",
                              f"gradient accumulation {RESOURCE_BATCH} // micro-batch (finetune/lora.py at 8641822)"]
            if quant != "None":
                notes.append(QLORA_NOTE.format(kind=quant))
            if multi:
                notes.append("FSDP1 (Lightning FSDPStrategy(auto_wrap_policy={Block}), full shard, use_orig_params): "
                             "the LoRA tensors inside each Block's unit, so every frozen weight gets a gradient; "
                             "non-reentrant checkpointing of every Block; no_backward_sync on all micro-batches but "
                             "the last (unsharded gradients held)")
            out = [] if model else [f"{hub} is not in the estimator's catalogue"]
            if quant == "bnb.nf4":
                out.append("NF4 without double quantization")
            rows.append(row(
                row_id=f"{SOURCE}:resource-tables:{'multi' if multi else 'single'}:{cells['Model']}-{cells['Size']}"
                       f":{quant}:mb{cells['Microbatch size']}:x{world}".replace(" ", ""),
                source=SOURCE, source_ref=ref(entry), source_table=heading,
                source_key=" | ".join(cells.values()), model=model or hub, gpu="a100-40gb",
                method="fsdp1" if multi else "single", world_size=world,
                micro_batch_size=int(cells["Microbatch size"]), seq_len=longest, precision="bf16",
                optimizer="adamw", grad_ckpt=multi, attn="sdpa", lora_rank=8, lora_targets="q_proj,v_proj",
                lora_dropout=RESOURCE_LORA_DROPOUT, lora_dtype=_lora_dtype(quant != "None"),
                qlora_quantizer=_quantizer(quant != "None"),
                grad_accum_steps=RESOURCE_BATCH // int(cells["Microbatch size"]),
                grad_sync="last" if multi else "every", fsdp1_lora_wrap="layer" if multi else "adapter",
                qlora=quant != "None", model_hub_id=hub, framework="litgpt 8641822 (Lightning Fabric)",
                adapter="qlora" if quant != "None" else "lora", loop="manual", padding="longest",
                max_length="", seq_len_basis="longest_sample", lengths="Alpaca (52k), longest sample stated",
                rescore_lengths=False, torch_version="2.1.0+cu121", bitsandbytes_version="0.41.1",
                other_versions="litgpt 8641822; NVIDIA driver 525.125.06", quantity="max_allocated",
                scope="per_gpu", value=value, unit="GB", complete=True, in_scope=not out,
                assumptions="; ".join(notes + ([f"not expressible: {', '.join(out)}"] if out else []))))
    return rows


def _confighub_rows(entry: dict, text: str, configs: dict[str, tuple[dict, dict]]) -> list[dict]:
    rows = []
    for heading, table in markdown_tables(text):
        for cells in table:
            value = _value(cells.get("Peak memory", ""))
            if value is None or "Config" not in cells:
                continue
            name = README_TYPOS.get(cells["Config"].lower(), cells["Config"].lower())
            config_entry, config = configs[name]
            hub = config["checkpoint_dir"].removeprefix("checkpoints/")
            model = MODELS.get(hub)
            kind = cells["Config"].rsplit("/", 1)[1].removesuffix(".yaml")
            devices = int(config.get("devices") or 1)
            machine = cells["Machine"]
            mb = int(cells["Micro batch size"])
            quant = config.get("quantize", "")
            notes = COMMON + [
                f"config {ref(config_entry)}", "seq_len 512 = max_seq_length: Alpaca2k batches are padded to their "
                "longest sample and cut at 512; the longest batch is assumed to reach 512 (Alpaca's longest samples "
                "exceed 1000 tokens, litgpt resource-tables.md)",
                f"machine {machine}; world size = the config's devices ({devices}): the README says every run is "
                "single-GPU unless --devices is passed", "torch/transformers versions not stated"]
            if mb != int(config["train.micro_batch_size"]):
                notes.append(f"the table's micro-batch {mb} differs from the config's {config['train.micro_batch_size']}"
                             "; the table's is used")
            if quant:
                notes.append(QLORA_NOTE.format(kind=quant))
            if devices > 1:
                notes.append("FSDP1 (Lightning FSDPStrategy(auto_wrap_policy={Block}), full shard, use_orig_params), "
                             "activation checkpointing of every Block; no_backward_sync on all micro-batches but the "
                             "last (litgpt/finetune/*.py at 00af8b0d)")
            out = [] if model else [f"{hub} is not in the estimator's catalogue"]
            if quant == "bnb.nf4":
                out.append("NF4 without double quantization")
            lora_rank = int(config["lora_r"]) if kind != "full" else 0
            accum = max(int(config["train.global_batch_size"]) // devices // mb, 1)
            notes.append(f"gradient accumulation {accum} = global_batch_size {config['train.global_batch_size']} // "
                         f"devices // micro-batch (TrainArgs.gradient_accumulation_iters)")
            missing = _below_states(hub, kind, value)
            rows.append(row(
                row_id=f"{SOURCE}:config-hub:{cells['Config']}:{machine}", source=SOURCE, source_ref=ref(entry),
                source_table=heading, source_key=" | ".join(list(cells.values())[:9]), model=model or hub,
                gpu=GPUS[machine.split("x", 1)[1]], method="fsdp1" if devices > 1 else "single",
                grad_sync="last" if devices > 1 else "every", fsdp1_lora_wrap="layer" if devices > 1 else "adapter",
                world_size=devices, micro_batch_size=mb, seq_len=int(config["train.max_seq_length"]),
                precision="bf16", optimizer="adamw", grad_ckpt=devices > 1, attn="sdpa", lora_rank=lora_rank,
                lora_targets=_targets(config) if lora_rank else "auto",
                lora_dropout=float(config.get("lora_dropout") or 0) if lora_rank else 0.0, qlora=bool(quant),
                lora_dtype=_lora_dtype(bool(quant)) if lora_rank else "auto", qlora_quantizer=_quantizer(bool(quant)),
                grad_accum_steps=accum,
                model_hub_id=hub, framework="litgpt 00af8b0d (Lightning Fabric)",
                adapter={"full": "full", "lora": "lora", "qlora": "qlora"}[kind], loop="manual", padding="longest",
                max_length=int(config["train.max_seq_length"]), seq_len_basis="max_length_cap",
                lengths="Alpaca2k (1,900 training samples), Llama-family tokenizers", rescore_lengths=True,
                other_versions="litgpt 00af8b0d", quantity="max_allocated", scope="per_gpu", value=value, unit="GB",
                complete=not missing, missing=missing, in_scope=not out,
                assumptions="; ".join(notes + ([f"not expressible: {', '.join(out)}"] if out else []))))
    return rows


def extract() -> list[dict]:
    entries = manifest(SOURCE)
    configs = {}
    for local, entry in entries.items():
        if local.endswith(".yaml"):
            name = entry["path"].removeprefix("config_hub/finetune/").lower()
            configs[name] = (entry, _yaml((SOURCES / SOURCE / local).read_text()))
    rows = []
    for local, entry in sorted(entries.items()):
        text = (SOURCES / SOURCE / local).read_text()
        if entry["path"] == "tutorials/resource-tables.md":
            rows += _resource_rows(entry, text)
        elif entry["path"] == "config_hub/finetune/README.md":
            rows += _confighub_rows(entry, text, configs)
    return rows
