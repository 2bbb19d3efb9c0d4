"""Rows from PEFT's DeepSpeed and FSDP guides (huggingface/peft ``docs/source/accelerate/deepspeed.md`` and
``fsdp.md``): Llama-2-70B fine-tuned with the guides' own example (``examples/sft``) on 8 x H100 80GB (LoRA, ZeRO-3 or
FSDP) and on two smaller GPUs (QLoRA, ZeRO-3 or FSDP), each with one "memory consumed per GPU" figure. A separate
campaign from the ``peft_metamathqa`` benchmark (another author, another script, other GPUs) in the same repository.

What the numbers mean, from the guides and the example at the commit that added each figure (aa2ca83ca for the
LoRA sections, 6008f272a for the QLoRA ones; ``examples/sft/train.py`` and ``utils.py`` are read there, not copied):

* the LoRA figures are read off a screenshot of the run's GPU-memory chart: "64 GB (80%)" (ZeRO-3) and "72-80 GB
  (90-98%)" (FSDP, the rise to 80 being the ``FULL_STATE_DICT`` save at the end, so 72 while training). The
  percentages are of the board: 80 % of an H100's 79.65 GiB is 63.7 GiB, 90 % is 71.7 GiB, while 64e9 and 72e9 B
  would be 75 % and 84 %: the figures are GiB. A memory-used chart of a run reads the driver's used memory (NVML),
  and what it shows is the level over the run, not a sampled peak of one step: ``nvml_used``, per GPU.
* the run (``run_peft_deepspeed.sh`` / ``run_peft_fsdp.sh`` with their accelerate configs): ``train.py`` on TRL's
  SFTTrainer, ``--packing True --max_seq_len 2048`` (argparse takes it as ``--max_seq_length``: packed rows of 2048
  tokens), micro-batch 8, gradient accumulation 4, ``--bf16``, checkpointing with ``use_reentrant False``,
  flash_attention_2, LoRA r 8 on ``all-linear``, dropout 0.1; the HF Trainer's default AdamW. ``utils.py`` loads
  the model without ``torch_dtype`` (fp32) and adds ChatML tokens (embeddings resized to a multiple of 8).
* ZeRO-3 (``deepspeed_config.yaml``): stage 3, no offload, ``zero3_init_flag`` (``zero.Init`` partitions the fp32
  checkpoint into bf16 shards; the optimizer keeps fp32 masters of the adapters), 8 processes; accelerate builds
  the DeepSpeed config from the plugin, which sets no bucket or prefetch size: DeepSpeed's defaults.
* FSDP (``fsdp_config.yaml``): FSDP1 FULL_SHARD, BACKWARD_PRE, ``use_orig_params false``, no offload, bf16 mixed
  precision over the fp32 weights, and ``train.py`` replaces the wrap policy with peft's ``fsdp_auto_wrap_policy``.
* QLoRA sections: "36.6 GB" per GPU (ZeRO-3 on "2X40GB GPUs") and "19.6 GB" (FSDP with CPU offload on "2X24GB
  GPUs"; "35.6 GB/ GPU" without offload): the GPUs are not named and the quantity is not said.
Standard library only.
"""

from __future__ import annotations

import re

from common import SOURCES, manifest, ref, row

SOURCE = "peft_accelerate_docs"
MODEL = {"meta-llama/Llama-2-70b-hf": "meta-llama/Llama-2-70b-hf"}
GIB_OF_H100 = 81559 / 1024   # nvidia-smi total of the h100-80gb catalogue key, in GiB


# The launch commands' arguments that shape memory, as the example scripts give them (the figures, not the
# scripts: ``examples/sft/<script>`` at each commit of huggingface/peft).
SCRIPT_ARGS = {
    ("aa2ca83ca", "run_peft_deepspeed.sh"): {"per_device_train_batch_size": "8", "gradient_accumulation_steps": "4"},
    ("aa2ca83ca", "run_peft_fsdp.sh"): {"per_device_train_batch_size": "8", "gradient_accumulation_steps": "4"},
    ("6008f272a", "run_peft_qlora_deepspeed_stage3.sh"): {"per_device_train_batch_size": "2",
                                                          "gradient_accumulation_steps": "2"},
    ("6008f272a", "run_peft_qlora_fsdp.sh"): {"per_device_train_batch_size": "2", "gradient_accumulation_steps": "2"},
}
COMMON_ARGS = {"model_name_or_path": "meta-llama/Llama-2-70b-hf", "max_seq_len": "2048",
               "gradient_checkpointing": "True", "use_flash_attn": "True", "lora_r": "8",
               "lora_target_modules": "all-linear", "lora_dropout": "0.1"}


def _args(commit: str, script: str) -> dict:
    """The ``--key value`` arguments of ``examples/sft/<script>`` at ``commit`` (``SCRIPT_ARGS``)."""
    return {**COMMON_ARGS, **SCRIPT_ARGS[commit, script]}


def _yaml(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].rstrip()
        if ":" in line:
            key, _, value = line.strip().partition(":")
            if value.strip():
                out[key.strip()] = value.strip().strip("'\"")
    return out


def _files(entries: dict, commit: str) -> dict:
    return {e["path"]: (e, (SOURCES / SOURCE / local).read_text()) for local, e in entries.items()
            if e["commit"].startswith(commit)}


def _common(args: dict) -> dict:
    return dict(model=MODEL[args["model_name_or_path"]], model_hub_id=args["model_name_or_path"],
                micro_batch_size=int(args["per_device_train_batch_size"]), seq_len=int(args["max_seq_len"]),
                optimizer="adamw", grad_ckpt=args["gradient_checkpointing"] == "True",
                attn="flash" if args["use_flash_attn"] == "True" else "eager", lora_rank=int(args["lora_r"]),
                lora_targets=args["lora_target_modules"], lora_dropout=float(args["lora_dropout"]),
                grad_accum_steps=int(args["gradient_accumulation_steps"]),
                loop="trainer", batch="full", padding="packed", max_length=int(args["max_seq_len"]),
                seq_len_basis="longest_sample", lengths=f"packed: every row {args['max_seq_len']} tokens (TRL "
                "ConstantLengthDataset over smangrul/ultrachat-10k-chatml)", rescore_lengths=False)


def _lora_rows(entries: dict) -> list[dict]:
    files = _files(entries, "aa2ca83ca")
    rows = []
    common_notes = ["model loaded in fp32 (utils.py passes no torch_dtype), ChatML tokens added and the embeddings "
                    "resized to a multiple of 8 (32,000 -> 32,008 rows; the catalogue model keeps 32,000)",
                    "versions not pinned (examples/sft/requirements.txt installs transformers, accelerate, peft and "
                    "trl from git main, 2024-02-26; deepspeed unpinned)",
                    "LoRA dropout 0.1"]
    for guide, script, config in (("deepspeed", "run_peft_deepspeed.sh", "deepspeed_config.yaml"),
                                  ("fsdp", "run_peft_fsdp.sh", "fsdp_config.yaml")):
        doc_entry, doc = files[f"docs/source/accelerate/{guide}.md"]
        args = _args("aa2ca83ca", script)
        cfg = _yaml(files[f"examples/sft/configs/{config}"][1])
        found = re.search(r"memory consumed per GPU is\s+(\d+)(?:-(\d+))? GB \((\d+)(?:-(\d+))?%\)", doc)
        value, percent = int(found.group(1)), int(found.group(3))
        if abs(value - percent / 100 * GIB_OF_H100) > 1.0:
            raise ValueError(f"{guide}: {value} GB is not {percent} % of an H100 in GiB")
        notes = [f"value: '{found.group(0).split(' is ')[1]}' read off the guide's screenshot; {percent} % of the "
                 f"H100's {GIB_OF_H100:.2f} GiB is {percent / 100 * GIB_OF_H100:.1f} GiB ({value}e9 B would be "
                 f"{value * 1e9 / 2**30 / GIB_OF_H100 * 100:.0f} %): GiB; a chart of the run's used memory (NVML), "
                 "its level over training, not a sampled peak"] + common_notes
        if guide == "deepspeed":
            method, precision, outputs_fp32 = "zero3", "mixed_bf16", False
            notes += ["ZeRO-3 with zero.Init: bf16 shards of the fp32 checkpoint, fp32 masters of the adapters; "
                      "DeepSpeed's default bucket, prefetch and persistence sizes (accelerate's plugin config sets "
                      "none); no offload", "HF Trainer default optimizer (torch AdamW) wrapped by DeepSpeed"]
        else:
            method, precision, outputs_fp32 = "fsdp", "mixed_bf16", True
            notes += [f"the guide gives {found.group(1)}-{found.group(2)} GB ({found.group(3)}-{found.group(4)} %): "
                      f"{value} while training, the rise at the end is the FULL_STATE_DICT save",
                      "FSDP1 (FULL_SHARD, BACKWARD_PRE, use_orig_params false) over fp32 weights with bf16 mixed "
                      "precision: fp32 shards (mixed_bf16); train.py sets peft's fsdp_auto_wrap_policy",
                      "FSDP1 with LoRA under mixed precision estimated as FSDP2 (the estimator's fsdp1 models peft's "
                      "wrap policy in bf16/fp32 only: MixedPrecision would cast the adapters to bf16; the config "
                      "reader does the same)"]
        rows.append(row(
            row_id=f"{SOURCE}:{guide}:lora:Llama-2-70b-hf:x{cfg['num_processes']}", source=SOURCE,
            source_ref=ref(doc_entry), source_table="Memory usage",
            source_key=f"{found.group(0)} | {script} | {config}", gpu="h100-80gb", method=method,
            world_size=int(cfg["num_processes"]), precision=precision, outputs_fp32=outputs_fp32, **_common(args),
            framework=f"TRL SFTTrainer + accelerate {'DeepSpeed ZeRO-3' if method == 'zero3' else 'FSDP1'} "
                      "(peft examples/sft)", adapter="lora", quantity="nvml_used", scope="per_gpu", value=value,
            unit="GiB", complete=True, in_scope=True, assumptions="; ".join(notes)))
    return rows


def _qlora_rows(entries: dict) -> list[dict]:
    files = _files(entries, "6008f272a")
    rows = []
    texts = {"deepspeed": (r"memory consumed per GPU is \*\*([0-9.]+) GB\*\*", "run_peft_qlora_deepspeed_stage3.sh",
                           "deepspeed_config_z3_qlora.yaml", r"on (\dX\d+GB) GPUs"),
             "fsdp": (r"memory consumed per GPU is \*\*([0-9.]+) GB\*\*", "run_peft_qlora_fsdp.sh",
                      "fsdp_config_qlora.yaml", r"on (\dX\d+GB) GPUs")}
    for guide, (pattern, script, config, gpus) in texts.items():
        doc_entry, doc = files[f"docs/source/accelerate/{guide}.md"]
        section = doc[doc.index("# Use PEFT QLoRA"):]
        args = _args("6008f272a", script)
        cfg = _yaml(files[f"examples/sft/configs/{config}"][1])
        boards = re.search(gpus, section).group(1)
        figures = [(re.search(pattern, section).group(1), "")]
        if guide == "fsdp":
            figures[0] = (figures[0][0], "with CPU offload (fsdp_offload_params true)")
            figures.append((re.search(r"disabling CPU offloading, the GPU memory usage is\s+\*\*([0-9.]+) GB",
                                      section).group(1), "without CPU offload"))
        for value, variant in figures:
            offload = variant.startswith("with CPU")
            method = "zero3" if guide == "deepspeed" else "fsdp"
            why = ("sharded QLoRA: the 4-bit weights are stored in bf16 (bnb_4bit_quant_storage) and sharded by "
                   f"{'ZeRO-3' if method == 'zero3' else 'FSDP'}, and TRL skips prepare_model_for_kbit_training's "
                   "fp32 upcast; the estimator's QLoRA is peft's single-device recipe")
            if offload:
                why += "; FSDP CPU offload"
            rows.append(row(
                row_id=f"{SOURCE}:{guide}:qlora:Llama-2-70b-hf:x{cfg['num_processes']}"
                       f"{':offload' if offload else (':no-offload' if guide == 'fsdp' else '')}",
                source=SOURCE, source_ref=ref(doc_entry), source_table="Memory usage",
                source_key=f"{value} GB per GPU {variant} | {boards} | {script} | {config}".replace("  ", " "),
                gpu=f"unnamed {boards.split('X')[1]} board", method=method, world_size=int(cfg["num_processes"]),
                precision="bf16", outputs_fp32=False, qlora=True, **_common(args),
                framework="TRL SFTTrainer + accelerate (peft examples/sft)", adapter="qlora",
                other_versions="the guide asks for bitsandbytes>=0.43.0, accelerate>=0.28.0, transformers>4.38.2, "
                               "trl>0.7.11, peft>0.9.0", quantity="unknown", scope="per_gpu", value=float(value),
                unit="GB", complete=False, in_scope=False,
                missing=f"the GPU model ('{boards}' only) and the quantity measured are not stated"
                        + ("; 35.6 GB does not fit the section's 24 GB boards: another machine" if guide == "fsdp"
                           and not offload else ""),
                assumptions=f"not expressible: {why}"))
    return rows


def extract() -> list[dict]:
    entries = manifest(SOURCE)
    return _lora_rows(entries) + _qlora_rows(entries)
