"""torchtune recipe configs (``tune run <recipe> --config FILE``): the YAML of ``recipes/configs/``.

Fields as the shipped recipes use them (https://pytorch.org/torchtune/stable/deep_dives/configs.html and
e.g. ``recipes/configs/llama3_2/1B_lora.yaml``): ``model._component_`` (the model builder; ``lora_``/``qlora_``
builders take ``lora_rank``, ``lora_attn_modules``, ``apply_lora_to_mlp``, ``apply_lora_to_output``),
``batch_size``, ``gradient_accumulation_steps``, ``dtype``, ``enable_activation_checkpointing``,
``optimizer._component_`` (+ ``fused``), ``tokenizer.max_seq_len``, ``dataset.packed``, and the distributed
recipes' ``fsdp_cpu_offload`` / ``fsdp_reshard_after_forward``. ``_component_`` values are dotted names read as
strings, never imported. torchtune trains in ``dtype`` throughout (weights, gradients and optimizer states; no
autocast), so ``dtype: bf16`` is the estimator's ``bf16``. Its distributed recipes shard with FSDP2
(``fully_shard`` per layer); the world size is ``tune run --nproc_per_node``, not in the file.
"""

from __future__ import annotations

import re
from typing import Any

from estimator.configs.reading import Reading, unknown_keys, words

# torchtune model builders -> the catalogue model of the same architecture (torchtune's own module names differ,
# the shapes are the same).
BUILDERS = {
    "llama3_2_1b": "meta-llama/Llama-3.2-1B", "llama3_2_3b": "meta-llama/Llama-3.2-3B",
    "llama3_1_8b": "meta-llama/Llama-3.1-8B", "llama3_8b": "meta-llama/Llama-3.1-8B",
    "llama2_7b": "meta-llama/Llama-2-7b-hf", "llama2_13b": "meta-llama/Llama-2-13b-hf",
    "mistral_7b": "mistralai/Mistral-7B-v0.1", "qwen2_5_0_5b": "Qwen/Qwen2.5-0.5B", "qwen2_5_7b_base": "Qwen/Qwen2.5-7B",
    "qwen2_5_7b_instruct": "Qwen/Qwen2.5-7B",
}
# torchtune LoRA module names -> Hugging Face module names of the same layers.
ATTN_MODULES = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")  # torchtune's w1, w3, w2
NO_EFFECT = words("""
tokenizer checkpointer resume_from_checkpoint save_adapter_weights_only seed shuffle lr_scheduler epochs
max_steps_per_epoch output_dir metric_logger log_every_n_steps log_peak_memory_stats device profiler
clip_grad_norm custom_sharded_layers dataset_val run_val_every_n_steps batch_size_val loss_parallel
optimizer_in_bwd_max_norm log_level
""")
DTYPES = {"bf16": "bf16", "fp32": "fp32", "float32": "fp32", "bfloat16": "bf16"}


def read_torchtune(path: str, data: dict[str, Any]) -> Reading:
    reading = Reading(path, "torchtune recipe")
    handled = {"model", "batch_size", "gradient_accumulation_steps", "dtype", "enable_activation_checkpointing",
               "enable_activation_offloading", "optimizer", "tokenizer", "dataset", "fsdp_cpu_offload",
               "fsdp_reshard_after_forward", "compile", "loss", "optimizer_in_bwd", "tensor_parallel_dim",
               "tensor_parallel_plan", "data_parallel_shard_dim", "data_parallel_replicate_dim"}
    _read_model(reading, data.get("model") or {})
    if data.get("batch_size") is not None:
        reading.set("micro_batch_size", reading.count("batch_size", data["batch_size"]), "batch_size")
    if data.get("gradient_accumulation_steps") is not None:
        reading.set("grad_accum_steps", reading.count("gradient_accumulation_steps",
                                                      data["gradient_accumulation_steps"]),
                    "gradient_accumulation_steps")
    dtype = str(data.get("dtype", "bf16")).lower()
    if dtype not in DTYPES:
        reading.fail("dtype", f"must be bf16 or fp32, got {data.get('dtype')!r}")
    (reading.set if "dtype" in data else reading.assume)("precision", DTYPES[dtype], "dtype")
    if data.get("enable_activation_checkpointing") is not None:
        reading.set("grad_ckpt", reading.flag("enable_activation_checkpointing",
                                              data["enable_activation_checkpointing"]),
                    "enable_activation_checkpointing")
    _read_optimizer(reading, data.get("optimizer") or {})
    _read_lengths(reading, data.get("tokenizer") or {}, data.get("dataset") or {})
    _read_distributed(reading, data)
    _read_unmodelled(reading, data)
    reading.assume("attn", "sdpa", "torchtune's attention calls scaled_dot_product_attention")
    reading.assume("loop", "trainer", "torchtune's recipes drop the logits before backward")
    unknown_keys(reading, data, handled, NO_EFFECT)
    return reading


def _component(section: dict[str, Any]) -> str:
    return str(section.get("_component_", "")) if isinstance(section, dict) else ""


def _read_model(reading: Reading, model: dict[str, Any]) -> None:
    builder = _component(model).rsplit(".", 1)[-1]
    if not builder:
        reading.fail("model._component_", "missing: the model builder names the model")
    qlora = builder.startswith("qlora_")
    base = re.sub(r"^(q?lora_)", "", builder)
    if base in BUILDERS:
        reading.set("model", BUILDERS[base], "model._component_")
    else:
        reading.notes.append(f"model._component_={_component(model)}: no catalogue model for this builder "
                             "(pass --model with its Hugging Face config.json)")
    if builder != base:
        rank = model.get("lora_rank", 8)
        reading.set("lora_rank", reading.count("model.lora_rank", rank), "model.lora_rank")
        reading.set("lora_targets", _lora_targets(reading, model), "model.lora_attn_modules")
        reading.lora_dropout("model.lora_dropout", model)
        if qlora:
            reading.set("qlora", True, "model._component_")
    known = {"_component_", "lora_rank", "lora_attn_modules", "apply_lora_to_mlp", "apply_lora_to_output",
             "lora_alpha", "lora_dropout", "use_dora", "quantize_base"}
    unknown_keys(reading, model, known, frozenset(), prefix="model.")


def _lora_targets(reading: Reading, model: dict[str, Any]) -> str:
    modules = model.get("lora_attn_modules") or []
    if isinstance(modules, str):
        modules = [modules]
    names = []
    for name in modules:
        if name not in ATTN_MODULES:
            reading.fail("model.lora_attn_modules", f"{name!r} is not one of {', '.join(ATTN_MODULES)}")
        names.append(ATTN_MODULES[name])
    if reading.flag("model.apply_lora_to_mlp", model.get("apply_lora_to_mlp", False)):
        names.extend(MLP_MODULES)
    if reading.flag("model.apply_lora_to_output", model.get("apply_lora_to_output", False)):
        names.append("lm_head")
    if not names:
        reading.fail("model.lora_attn_modules", "a LoRA builder needs at least one target module")
    return ",".join(names)


def _read_optimizer(reading: Reading, optimizer: dict[str, Any]) -> None:
    name = _component(optimizer)
    short = name.rsplit(".", 1)[-1]
    if short == "AdamW" and name.startswith("torch."):
        fused = reading.flag("optimizer.fused", optimizer.get("fused", False))
        reading.set("optimizer", "adamw_fused" if fused else "adamw", "optimizer._component_")
    elif short == "SGD":
        reading.set("optimizer", "sgd", "optimizer._component_")
    elif short in ("AdamW8bit", "PagedAdamW8bit", "Adam8bit"):
        reading.set("optimizer", "adamw_8bit", "optimizer._component_")
    elif name:
        reading.not_modelled(f"optimizer._component_={name}", "estimated as AdamW (2 states per parameter)")
        reading.assume("optimizer", "adamw", f"{name} is not modelled")


def _read_lengths(reading: Reading, tokenizer: dict[str, Any], dataset: Any) -> None:
    length = tokenizer.get("max_seq_len") if isinstance(tokenizer, dict) else None
    if length is not None:
        reading.set("seq_len", reading.count("tokenizer.max_seq_len", length), "tokenizer.max_seq_len")
    else:
        reading.notes.append("tokenizer.max_seq_len is null: torchtune does not truncate, so the longest sample "
                             "sets the length; pass --seq-len")
    datasets = dataset if isinstance(dataset, list) else [dataset]
    if any(isinstance(d, dict) and reading.flag("dataset.packed", d.get("packed", False)) for d in datasets):
        reading.set("packing", True, "dataset.packed")


def _read_distributed(reading: Reading, data: dict[str, Any]) -> None:
    if "fsdp_cpu_offload" in data or "fsdp_reshard_after_forward" in data:
        reading.set("method", "fsdp", "fsdp_* (a distributed recipe)")
        reading.assume("world_size", 2, "a distributed recipe; the world size is tune run's --nproc_per_node, not "
                       "in the file: pass --gpus")
    if reading.flag("fsdp_cpu_offload", data.get("fsdp_cpu_offload", False)):
        reading.not_modelled("fsdp_cpu_offload", "FSDP CPU offload is not modelled (an over-estimate)")
    if not reading.flag("fsdp_reshard_after_forward", data.get("fsdp_reshard_after_forward", True)):
        reading.not_modelled("fsdp_reshard_after_forward=false", "estimated with resharding after forward")
    for key in ("tensor_parallel_dim", "tensor_parallel_plan", "data_parallel_replicate_dim"):
        if data.get(key) not in (None, 1):
            reading.not_modelled(key, "torchtune's TP/HSDP layouts are not read; estimated as FSDP over every rank")


def _read_unmodelled(reading: Reading, data: dict[str, Any]) -> None:
    if "lora_rank" in reading.settings and reading.flag("enable_activation_offloading",
                                                        data.get("enable_activation_offloading", False)):
        reading.not_modelled("enable_activation_offloading", "offloaded activations of a LoRA run are estimated "
                             "on the GPU")
    elif reading.flag("enable_activation_offloading", data.get("enable_activation_offloading", False)):
        # torchtune's OffloadActivations keeps parameters and tensors under 1 KiB on the GPU and, with streams,
        # each tensor until its copy is done: estimated as save_on_cpu, which moves everything at once
        reading.set("activation_offload", True, "enable_activation_offloading")
        reading.notes.append("enable_activation_offloading: estimated as torch's save_on_cpu (torchtune's "
                             "OffloadActivations keeps parameters, tiny tensors and in-flight copies on the GPU)")
    if reading.flag("compile", data.get("compile", False)):
        reading.not_modelled("compile", "torch.compile is not modelled; estimated eager")
    if reading.flag("optimizer_in_bwd", data.get("optimizer_in_bwd", False)):
        reading.not_modelled("optimizer_in_bwd", "stepping each parameter in backward frees its gradient at "
                             "once; estimated with all gradients held (an over-estimate)")
    loss = _component(data.get("loss") or {})
    section = data.get("loss") or {}
    lora = "lora_rank" in reading.settings  # LoRA with the techniques is checked (spec) but not read from recipes yet
    if loss.endswith(".LinearCrossEntropyLoss") and not lora:
        reading.set("ce", "chunked", "loss._component_")
        chunks = section.get("num_output_chunks", 8) if isinstance(section, dict) else 8
        reading.set("ce_chunks", reading.count("loss.num_output_chunks", chunks), "loss.num_output_chunks")
    elif loss.endswith(".LigerFusedCrossEntropyLoss") and not lora:
        reading.set("ce", "fused_linear", "loss._component_")
    elif loss and ("Chunked" in loss or "Linear" in loss or not loss.endswith("CrossEntropyLoss")):
        reading.not_modelled(f"loss._component_={loss}", "chunked/fused losses hold less than the full fp32 "
                             "logits the estimate assumes")
