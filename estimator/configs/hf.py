"""Hugging Face ``TrainingArguments`` and TRL ``SFTConfig`` (+ TRL's ``ModelConfig``/script arguments, which
``trl sft --config FILE`` reads from the same YAML), as JSON (``TrainingArguments.to_json_string()``) or YAML.

Field names and defaults follow the documentation:
https://huggingface.co/docs/transformers/main_classes/trainer#transformers.TrainingArguments (transformers
5.23: ``per_device_train_batch_size`` 8, ``optim`` ``adamw_torch_fused``, FSDP ``fsdp_config.version`` 2) and
https://huggingface.co/docs/trl/sft_trainer#trl.SFTConfig (``max_length`` 1024; SFTConfig changes
``gradient_checkpointing`` to True and ``bf16`` to True when ``fp16`` is not set).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from estimator.configs.common import (
    REENTRANT_KEYS,
    read_attn_implementation,
    read_fsdp_options,
    read_hf_optimizer,
    read_reentrant,
)
from estimator.configs.reading import Reading, unknown_keys, words

# TrainingArguments fields (transformers 5.23 and 4.x) that leave the training step's per-rank peak unchanged:
# logging, saving, evaluation, the learning-rate schedule, data loading, hub, seeds, DDP timeouts.
HF_NO_EFFECT = words("""
accelerator_config adam_beta1 adam_beta2 adam_epsilon average_tokens_across_devices batch_eval_metrics
bf16_full_eval data_seed dataloader_drop_last dataloader_in_order dataloader_multiprocessing_context
dataloader_num_workers dataloader_persistent_workers dataloader_pin_memory dataloader_prefetch_factor ddp_backend
ddp_broadcast_buffers ddp_find_unused_parameters ddp_static_graph ddp_timeout debug disable_tqdm do_eval
do_predict do_train enable_jit_checkpoint eval_accumulation_steps eval_delay eval_do_concat_batches eval_on_start
eval_steps eval_strategy eval_use_gather_object fp16_full_eval full_determinism greater_is_better hub_always_push
hub_model_id hub_private_repo hub_revision hub_strategy hub_token ignore_data_skip include_for_metrics
include_num_input_tokens_seen label_names label_smoothing_factor learning_rate length_column_name
load_best_model_at_end local_rank log_level log_level_replica log_on_each_node logging_first_step
logging_nan_inf_filter logging_steps logging_strategy lr_scheduler_kwargs lr_scheduler_type max_grad_norm max_steps
metric_for_best_model num_train_epochs optim_args output_dir per_device_eval_batch_size prediction_loss_only project
push_to_hub remove_unused_columns report_to restore_callback_states_from_checkpoint resume_from_checkpoint run_name
save_on_each_node save_only_model save_steps save_strategy save_total_limit seed skip_memory_metrics tf32
trackio_bucket_id trackio_space_id trackio_static_space_id train_sampling_strategy use_cache warmup_steps
weight_decay
evaluation_strategy logging_dir overwrite_output_dir fp16_opt_level fp16_backend half_precision_backend
group_by_length save_safetensors hub_private_repo push_to_hub_model_id push_to_hub_organization
push_to_hub_token mp_parameters ray_scope dispatch_batches split_batches include_inputs_for_metrics
include_tokens_per_second eval_do_concat_batches warmup_ratio jit_mode_eval use_ipex bf16_full_eval
no_cuda use_mps_device tpu_num_cores tpu_metrics_debug past_index save_on_each_node logging_dir
torchdynamo ddp_bucket_cap_mb hub_strategy use_legacy_prediction_loop
predict_with_generate generation_max_length generation_num_beams generation_config sortish_sampler
""")
# TRL SFTConfig fields without an effect on the peak (data preparation, chat templates, logging).
TRL_NO_EFFECT = words("""
dataset_text_field dataset_kwargs dataset_num_proc eos_token pad_token chat_template_path truncation_mode
shuffle_dataset eval_packing completion_only_loss assistant_only_loss dataset_batch_size num_of_sequences
chars_per_token pad_to_multiple_of dataset_name dataset_config dataset_train_split dataset_test_split
dataset_streaming ignore_bias_buffers model_revision trust_remote_code
base_model_revision model_code_revision lora_alpha lora_modules_to_save lora_task_type use_rslora
bnb_4bit_quant_type use_bnb_nested_quant bnb_4bit_quant_storage lora_target_parameters config
""")
# Fields that mark a file as TRL's (SFTConfig, ModelConfig, the sft script's arguments).
TRL_FIELDS = words("""
max_length max_seq_length packing packing_strategy padding_free model_init_kwargs loss_type activation_offloading
dataset_text_field completion_only_loss assistant_only_loss use_peft lora_r lora_target_modules model_name_or_path
load_in_4bit load_in_8bit torch_dtype dtype attn_implementation use_flash_attention_2 dataset_name
""")
_HALF_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
                "float32": "fp32", "fp32": "fp32", "float": "fp32"}


def read_hf(path: str, data: dict[str, Any]) -> Reading:
    trl = bool(TRL_FIELDS & set(data))
    reading = Reading(path, "TRL SFTConfig" if trl else "HF TrainingArguments")
    handled = read_training_arguments(reading, data, trl=trl)
    if trl:
        handled |= read_trl(reading, data)
    unknown_keys(reading, data, handled, HF_NO_EFFECT | TRL_NO_EFFECT)
    reading.assume("loop", "trainer", "Trainer and TRL's SFTTrainer drop the output object before backward")
    return reading


def _read_grad_sync(reading: Reading, accelerator_config: Any) -> None:
    """The Trainer runs every micro-batch but the last under accelerate's ``no_sync`` (FSDP keeps the unsharded
    gradients) unless ``accelerator_config.gradient_accumulation_kwargs.sync_each_batch`` is set."""
    kwargs = (accelerator_config or {}).get("gradient_accumulation_kwargs") if isinstance(accelerator_config, dict) \
        else None
    if isinstance(kwargs, dict) and "sync_each_batch" in kwargs:
        every = reading.flag("accelerator_config.gradient_accumulation_kwargs.sync_each_batch",
                             kwargs["sync_each_batch"])
        reading.set("grad_sync", "every" if every else "last",
                    "accelerator_config.gradient_accumulation_kwargs.sync_each_batch")
    else:
        reading.assume("grad_sync", "last", "the Trainer skips FSDP's gradient sync (accelerate's no_sync) on all "
                       "but the last micro-batch; accelerator_config.gradient_accumulation_kwargs.sync_each_batch "
                       "reduces on every one")


def read_training_arguments(reading: Reading, data: dict[str, Any], *, trl: bool = False) -> set[str]:
    """The TrainingArguments fields that change the peak; returns the keys handled."""
    handled = set()

    def take(key: str) -> Any:
        handled.add(key)
        return data.get(key)

    if take("per_device_train_batch_size") is not None:
        reading.set("micro_batch_size", reading.count("per_device_train_batch_size",
                                                      data["per_device_train_batch_size"]),
                    "per_device_train_batch_size")
    else:
        reading.assume("micro_batch_size", 8, "TrainingArguments' per_device_train_batch_size default")
    if take("gradient_accumulation_steps") is not None:
        reading.set("grad_accum_steps", reading.count("gradient_accumulation_steps",
                                                      data["gradient_accumulation_steps"]),
                    "gradient_accumulation_steps")
    _read_grad_sync(reading, take("accelerator_config"))
    _read_half(reading, take("bf16"), take("fp16"), trl=trl)
    if take("optim") is not None:
        read_hf_optimizer(reading, "optim", data["optim"])
    else:
        reading.assume("optimizer", "adamw_fused", "TrainingArguments' optim default (adamw_torch_fused)")
    _read_checkpointing(reading, data, take, trl=trl)
    if take("deepspeed"):
        reading.set("deepspeed", _relative(reading, data["deepspeed"]), "deepspeed")
        reading.set("method", "deepspeed", "deepspeed")
    _read_trainer_fsdp(reading, take("fsdp"), take("fsdp_config"))
    _read_unmodelled(reading, data, take)
    return handled


def _read_half(reading: Reading, bf16: Any, fp16: Any, *, trl: bool) -> None:
    if bf16 is not None and reading.flag("bf16", bf16):
        reading.set("half", "bf16", "bf16")
    elif fp16 is not None and reading.flag("fp16", fp16):
        reading.set("half", "fp16", "fp16")
    elif bf16 is not None or fp16 is not None:
        reading.set("half", "none", "bf16" if bf16 is not None else "fp16")
    elif trl:
        reading.assume("half", "bf16", "SFTConfig's bf16 defaults to True when fp16 is not set")
    else:
        reading.assume("half", "none", "TrainingArguments' bf16 and fp16 default to False")


def _read_checkpointing(reading: Reading, data: dict[str, Any], take, *, trl: bool) -> None:
    # transformers >= 5.2x names it activation_checkpointing; gradient_checkpointing is the older name.
    read_reentrant(reading, {key: take(key) for key in REENTRANT_KEYS})
    for key in ("activation_checkpointing", "gradient_checkpointing"):
        value = take(key)
        if value is not None:
            reading.set("grad_ckpt", reading.flag(key, value), key)
            return
    if trl:
        reading.assume("grad_ckpt", True, "SFTConfig's gradient_checkpointing defaults to True")
    else:
        reading.assume("grad_ckpt", False, "TrainingArguments' gradient_checkpointing defaults to False")


def _read_trainer_fsdp(reading: Reading, fsdp: Any, fsdp_config: Any) -> None:
    """``fsdp``: True, or the legacy option string/list ("full_shard auto_wrap offload"); ``fsdp_config``: a
    dict or a JSON file. transformers 5 runs FSDP2 unless ``fsdp_config.version`` is 1."""
    words = fsdp.split() if isinstance(fsdp, str) else list(fsdp) if isinstance(fsdp, list) else []
    enabled = bool(words) if not isinstance(fsdp, bool) else fsdp
    if not enabled:
        return
    options = fsdp_config or {}
    if isinstance(options, str):
        from estimator.configs.load import load_mapping

        options = load_mapping(_relative(reading, options))
    if not isinstance(options, dict):
        reading.fail("fsdp_config", f"must be a mapping or a JSON file, got {options!r}")
    strategy = next((w for w in words if w.lower() in ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard",
                                                       "hybrid_shard_zero2")), None)
    version = options.get("version", options.get("fsdp_version", 2))
    options = {k: v for k, v in options.items() if k not in ("version", "fsdp_version")}
    read_fsdp_options(reading, options, "fsdp_config.", version=version, strategy=strategy,
                      offload="offload" in [w.lower() for w in words])


def _read_unmodelled(reading: Reading, data: dict[str, Any], take) -> None:
    effects = {
        "torch_compile": "torch.compile fuses kernels and changes which activations are saved; estimated eager",
        "use_liger_kernel": "Liger's fused linear cross-entropy never materialises the logits; estimated with "
                            "full logits (an over-estimate)",
        "liger_kernel_config": "see use_liger_kernel",
        "auto_find_batch_size": "the Trainer halves the batch after an OOM; estimated at the given batch",
        "torch_empty_cache_steps": "empty_cache every N steps lowers the reserved level between steps only",
        "neftune_noise_alpha": "noise on the embeddings output: one extra activation per layer input, negligible",
        "parallelism_config": "context/tensor parallelism from accelerate's ParallelismConfig is not read",
        "optim_target_modules": "GaLore/APOLLO projections are not modelled",
        "use_cpu": "a CPU run: the estimate is for the GPU the spec names",
        "torch_compile_backend": "see torch_compile", "torch_compile_mode": "see torch_compile",
    }
    for key, what in effects.items():
        value = take(key)
        if value not in (None, False, "", {}, [], 0):
            reading.not_modelled(key, what)


def read_trl(reading: Reading, data: dict[str, Any]) -> set[str]:
    """SFTConfig's own fields and TRL's ModelConfig / sft-script fields (``trl sft --config``)."""
    handled = {"max_length", "max_seq_length", "packing", "packing_strategy", "padding_free", "model_init_kwargs",
               "loss_type", "activation_offloading", "model_name_or_path", "torch_dtype", "dtype",
               "attn_implementation", "use_flash_attention_2", "use_peft", "lora_r", "lora_target_modules",
               "lora_dropout", "load_in_4bit", "load_in_8bit"}
    _read_trl_length(reading, data)
    if data.get("model_name_or_path"):
        reading.set("model", str(data["model_name_or_path"]), "model_name_or_path")
    init = data.get("model_init_kwargs") or {}
    if not isinstance(init, dict):
        reading.fail("model_init_kwargs", f"must be a mapping, got {init!r}")
    for key, source in (("dtype", data), ("torch_dtype", data), ("dtype", init), ("torch_dtype", init)):
        if source.get(key) not in (None, "auto"):
            where = key if source is data else f"model_init_kwargs.{key}"
            dtype = _HALF_DTYPES.get(str(source[key]).replace("torch.", ""))
            if dtype is None:
                reading.fail(where, f"is not a dtype the estimator knows, got {source[key]!r}")
            reading.set("weights_dtype", dtype, where)
    for key, source in (("attn_implementation", data), ("attn_implementation", init)):
        if source.get(key):
            read_attn_implementation(reading, key if source is data else f"model_init_kwargs.{key}", source[key])
    if data.get("use_flash_attention_2"):
        reading.set("attn", "flash", "use_flash_attention_2")
    _read_trl_peft(reading, data)
    _read_trl_unmodelled(reading, data, init)
    return handled


def _read_trl_length(reading: Reading, data: dict[str, Any]) -> None:
    for key in ("max_length", "max_seq_length"):  # max_seq_length: TRL < 0.20
        if key in data:
            if data[key] is None:
                reading.not_modelled(f"{key}=null", "no truncation: the longest sample sets the length; pass "
                                     "--seq-len")
                break
            reading.set("seq_len", reading.count(key, data[key]), key)
            break
    else:
        reading.assume("seq_len", 1024, "SFTConfig's max_length default")
    if reading.flag("packing", data.get("packing")):
        reading.set("packing", True, "packing")


def _read_trl_peft(reading: Reading, data: dict[str, Any]) -> None:
    if not reading.flag("use_peft", data.get("use_peft")):
        for key in ("lora_r", "lora_target_modules", "load_in_4bit"):
            if data.get(key):
                reading.not_modelled(key, "ignored: use_peft is not set, so TRL trains the full model")
        return
    rank = reading.count("lora_r", data["lora_r"]) if data.get("lora_r") is not None else 16
    if data.get("lora_r") is None:
        reading.assume("lora_rank", 16, "ModelConfig's lora_r default")
    else:
        reading.set("lora_rank", rank, "lora_r")
    targets = data.get("lora_target_modules")
    if targets:
        reading.set("lora_targets", targets if isinstance(targets, str) else ",".join(map(str, targets)),
                    "lora_target_modules")
    if data.get("lora_dropout") is None:
        reading.assume("lora_dropout", 0.05, "ModelConfig's lora_dropout default")
    reading.lora_dropout("lora_dropout", data)
    if reading.flag("load_in_4bit", data.get("load_in_4bit")):
        reading.set("qlora", True, "load_in_4bit")
    if reading.flag("load_in_8bit", data.get("load_in_8bit")):
        reading.not_modelled("load_in_8bit", "8-bit base weights are not modelled; estimated as 16-bit")


def _read_trl_unmodelled(reading: Reading, data: dict[str, Any], init: dict[str, Any]) -> None:
    loss = data.get("loss_type")
    if loss in (None, "chunked_nll"):
        reading.not_modelled("loss_type" if loss else "loss_type (default chunked_nll)",
                             "TRL's chunked loss computes the logits of non-ignored tokens in chunks; estimated "
                             "with full logits (an over-estimate of the loss peak)")
    if reading.flag("padding_free", data.get("padding_free")):
        reading.not_modelled("padding_free", "sequences are flattened into one row: estimated as micro-batch x "
                             "max_length tokens (the upper end)")
    if reading.flag("activation_offloading", data.get("activation_offloading")):
        reading.not_modelled("activation_offloading", "activations offloaded to CPU are estimated on the GPU")
    for key in sorted(set(init) - {"dtype", "torch_dtype", "attn_implementation"}):
        reading.unknown.append(f"model_init_kwargs.{key}")


def _relative(reading: Reading, value: Any) -> Any:
    """A path named inside a config: as given when it exists, else relative to the config's folder."""
    if not isinstance(value, str) or value.lstrip().startswith("{"):
        return value
    here = Path(value).expanduser()
    if here.exists() or here.is_absolute():
        return value
    beside = Path(reading.path).parent / value
    return str(beside) if beside.exists() else value
