"""axolotl YAML (``axolotl train FILE``), as its config reference documents it
(https://docs.axolotl.ai/docs/config-reference.html): ``base_model``, ``sequence_len``, ``micro_batch_size``,
``gradient_accumulation_steps``, ``optimizer`` (transformers' ``optim`` names), ``gradient_checkpointing``,
``flash_attention`` / ``sdp_attention`` / ``eager_attention`` / ``xformers_attention``, ``adapter`` (lora/qlora)
with ``lora_r``, ``lora_target_modules``, ``lora_target_linear``, ``load_in_4bit``, ``bf16``/``fp16``
(``auto``: bf16 where the GPU has it), ``sample_packing``, ``deepspeed`` (a JSON path), ``fsdp``/``fsdp_config``
and ``fsdp_version``. axolotl runs the HF Trainer; it loads the base model in the training dtype
(``torch_dtype`` follows ``bf16``/``fp16``), so ``bf16: true`` on one GPU or DDP trains bf16 weights.
"""

from __future__ import annotations

from typing import Any

from estimator.configs.common import read_fsdp_options, read_hf_optimizer, read_reentrant
from estimator.configs.hf import HF_NO_EFFECT, _relative
from estimator.configs.reading import Reading, unknown_keys, words

NO_EFFECT = HF_NO_EFFECT | words("""
base_model_config model_type tokenizer_type tokenizer_config strict datasets test_datasets dataset_prepared_path
val_set_size output_dir hub_model_id hub_strategy hf_use_auth_token lora_alpha lora_fan_in_fan_out
lora_model_dir lora_modules_to_save wandb_project wandb_entity wandb_watch wandb_name wandb_run_id wandb_log_model
wandb_mode num_epochs lr_scheduler learning_rate train_on_inputs group_by_length tf32 early_stopping_patience
resume_from_checkpoint auto_resume_from_checkpoints local_rank logging_steps warmup_steps warmup_ratio
evals_per_epoch eval_table_size eval_max_new_tokens saves_per_epoch save_steps save_total_limit debug
weight_decay special_tokens tokens chat_template eval_sample_packing pad_to_sequence_len trust_remote_code
save_safetensors eval_batch_size max_steps cosine_min_lr_ratio dataset_processes shuffle_merged_datasets
plugins max_grad_norm adam_beta1 adam_beta2 adam_epsilon bnb_config_kwargs
default_system_message dataloader_num_workers dataloader_pin_memory dataloader_prefetch_factor
""")
_ATTN_KEYS = (("flash_attention", "flash"), ("sdp_attention", "sdpa"), ("eager_attention", "eager"))


def read_axolotl(path: str, data: dict[str, Any]) -> Reading:
    reading = Reading(path, "axolotl config")
    handled = {"base_model", "sequence_len", "micro_batch_size", "gradient_accumulation_steps", "optimizer",
               "gradient_checkpointing", "gradient_checkpointing_kwargs", "flash_attention", "sdp_attention", "eager_attention", "xformers_attention",
               "adapter", "lora_r", "lora_target_modules", "lora_target_linear", "lora_dropout", "load_in_4bit", "load_in_8bit",
               "bf16", "fp16", "bfloat16", "float16", "sample_packing", "deepspeed", "fsdp", "fsdp_config",
               "fsdp_version", "torch_compile", "batch_size", "unsloth_lora_mlp", "unsloth_lora_qkv",
               "unsloth_lora_o", "liger_cross_entropy", "liger_fused_linear_cross_entropy", "gpu_memory_limit"}
    if not data.get("base_model"):
        reading.fail("base_model", "missing: it names the model")
    reading.set("model", str(data["base_model"]), "base_model")
    _read_sizes(reading, data)
    if data.get("optimizer"):
        read_hf_optimizer(reading, "optimizer", data["optimizer"])
    else:
        reading.assume("optimizer", "adamw_fused", "axolotl passes optim to the Trainer (adamw_torch_fused default)")
    gc = data.get("gradient_checkpointing")
    if gc not in (None, False):
        reading.set("grad_ckpt", True, "gradient_checkpointing")
        if isinstance(gc, str) and gc.lower() != "true":
            reading.not_modelled(f"gradient_checkpointing={gc}", "estimated as plain checkpointing")
    elif gc is False:
        reading.set("grad_ckpt", False, "gradient_checkpointing")
    else:
        reading.assume("grad_ckpt", False, "axolotl's gradient_checkpointing default is off")
    read_reentrant(reading, {"gradient_checkpointing_kwargs": data.get("gradient_checkpointing_kwargs")})
    _read_attention(reading, data)
    _read_adapter(reading, data)
    _read_precision(reading, data)
    if reading.flag("sample_packing", data.get("sample_packing")):
        reading.set("packing", True, "sample_packing")
    if data.get("deepspeed"):
        reading.set("deepspeed", _relative(reading, data["deepspeed"]), "deepspeed")
        reading.set("method", "deepspeed", "deepspeed")
    if data.get("fsdp") or data.get("fsdp_version") or (data.get("fsdp_config") and data.get("fsdp") is not False):
        _read_fsdp(reading, data)
    for key in ("torch_compile", "unsloth_lora_mlp", "unsloth_lora_qkv", "unsloth_lora_o",
                "liger_fused_linear_cross_entropy", "liger_cross_entropy"):
        if data.get(key):
            reading.not_modelled(key, "fused kernels are not modelled; estimated with the plain HF modules")
    reading.assume("loop", "trainer", "axolotl trains with the HF Trainer")
    unknown_keys(reading, data, handled, NO_EFFECT)
    return reading


def _read_sizes(reading: Reading, data: dict[str, Any]) -> None:
    if data.get("sequence_len") is not None:
        reading.set("seq_len", reading.count("sequence_len", data["sequence_len"]), "sequence_len")
    else:
        reading.assume("seq_len", 512, "axolotl's sequence_len default")
    if data.get("micro_batch_size") is not None:
        reading.set("micro_batch_size", reading.count("micro_batch_size", data["micro_batch_size"]),
                    "micro_batch_size")
    else:
        reading.assume("micro_batch_size", 1, "axolotl's micro_batch_size default")
    if data.get("gradient_accumulation_steps") is not None:
        reading.set("grad_accum_steps", reading.count("gradient_accumulation_steps",
                                                      data["gradient_accumulation_steps"]),
                    "gradient_accumulation_steps")
    if data.get("batch_size") is not None:
        reading.no_effect.append("batch_size (the global batch; micro_batch_size sets the per-GPU one)")


def _read_attention(reading: Reading, data: dict[str, Any]) -> None:
    for key, attn in _ATTN_KEYS:
        if data.get(key):
            reading.set("attn", attn, key)
            return
    if data.get("xformers_attention"):
        reading.not_modelled("xformers_attention", "estimated as sdpa (memory-efficient attention, no S x S)")
        reading.set("attn", "sdpa", "xformers_attention")
        return
    reading.assume("attn", "sdpa", "no attention switch set: transformers' default implementation")


def _read_adapter(reading: Reading, data: dict[str, Any]) -> None:
    adapter = str(data.get("adapter") or "").lower()
    if adapter not in ("", "lora", "qlora"):
        reading.not_modelled(f"adapter={adapter}", "only LoRA and QLoRA adapters are modelled; estimated as "
                             "full fine-tuning")
        return
    if not adapter:
        return
    reading.set("lora_rank", reading.count("lora_r", data.get("lora_r", 8)), "lora_r")
    if reading.flag("lora_target_linear", data.get("lora_target_linear")):
        reading.set("lora_targets", "all-linear", "lora_target_linear")
    elif data.get("lora_target_modules"):
        modules = data["lora_target_modules"]
        reading.set("lora_targets", modules if isinstance(modules, str) else ",".join(map(str, modules)),
                    "lora_target_modules")
    reading.lora_dropout("lora_dropout", data)
    if adapter == "qlora" or reading.flag("load_in_4bit", data.get("load_in_4bit")):
        reading.set("qlora", True, "adapter" if adapter == "qlora" else "load_in_4bit")
    if reading.flag("load_in_8bit", data.get("load_in_8bit")):
        reading.not_modelled("load_in_8bit", "8-bit base weights are not modelled; estimated as 16-bit")


def _read_precision(reading: Reading, data: dict[str, Any]) -> None:
    bf16, fp16 = data.get("bf16"), data.get("fp16")
    if isinstance(bf16, str) and bf16.lower() == "auto":
        reading.set("half", "bf16", "bf16")
        reading.notes.append("bf16: auto is read as bf16 (every GPU key but V100/T4 has it); use --precision on "
                             "an fp16-only GPU")
    elif bf16 is not None and reading.flag("bf16", bf16):
        reading.set("half", "bf16", "bf16")
    elif fp16 is not None and reading.flag("fp16", fp16):
        reading.set("half", "fp16", "fp16")
    else:
        reading.assume("half", "none", "neither bf16 nor fp16 is set")
    half = reading.settings.get("half")
    if half and half.value in ("bf16", "fp16"):
        reading.assume("weights_dtype", half.value, "axolotl loads the base model in the training dtype")


def _read_fsdp(reading: Reading, data: dict[str, Any]) -> None:
    words = data.get("fsdp") or []
    words = words.split() if isinstance(words, str) else list(words) if isinstance(words, list) else []
    options = data.get("fsdp_config") or {}
    if not isinstance(options, dict):
        reading.fail("fsdp_config", f"must be a mapping, got {options!r}")
    version = data.get("fsdp_version", options.get("fsdp_version", options.get("version")))
    options = {k: v for k, v in options.items() if k not in ("fsdp_version", "version")}
    strategy = next((w for w in words if w.lower() in ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")),
                    None)
    read_fsdp_options(reading, options, "fsdp_config.", version=version if version is not None else 1,
                      strategy=strategy, offload="offload" in [str(w).lower() for w in words])
