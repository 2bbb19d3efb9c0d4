"""LLaMA-Factory YAML (``llamafactory-cli train FILE``, e.g. ``examples/train_lora/llama3_lora_sft.yaml``).

Its own fields (``src/llamafactory/hparams``; https://llamafactory.readthedocs.io/en/latest/advanced/arguments.html):
``model_name_or_path``, ``stage`` (pt/sft are one causal-LM step; rm/ppo/dpo/kto run more models),
``finetuning_type`` (lora by default; full; freeze/oft not modelled), ``lora_rank`` (8), ``lora_target``
(``all`` = every linear layer), ``quantization_bit`` (4 = QLoRA), ``cutoff_len`` (2048), ``packing``,
``flash_attn`` (auto/disabled/sdpa/fa2), ``disable_gradient_checkpointing`` (checkpointing is on unless it is
set), ``pure_bf16``; the rest are Seq2SeqTrainingArguments (read as the HF Trainer's). It loads the model in
the compute dtype (bf16 with ``bf16: true``) and, unless ``pure_bf16``, keeps trainable parameters in fp32:
full fine-tuning is then fp32 weights under autocast (``amp_bf16``), LoRA a bf16 base with fp32 adapters
(``bf16``).
"""

from __future__ import annotations

from typing import Any

from estimator.configs.hf import HF_NO_EFFECT, read_training_arguments
from estimator.configs.reading import Reading, unknown_keys, words

NO_EFFECT = HF_NO_EFFECT | words("""
trust_remote_code do_train template dataset dataset_dir eval_dataset max_samples overwrite_cache
preprocessing_num_workers tokenized_path val_size plot_loss ddp_timeout lora_alpha additional_target
loraplus_lr_ratio loraplus_lr_embedding create_new_adapter train_on_prompt mask_history streaming buffer_size
mix_strategy interleave_probs preprocessing_batch_size ignore_pad_token_for_loss eval_on_each_dataset tool_format
media_dir adapter_name_or_path cache_dir model_revision hf_hub_token use_fast_tokenizer resize_vocab
split_special_tokens new_special_tokens low_cpu_mem_usage rope_scaling image_max_pixels image_min_pixels
video_max_pixels export_dir report_to upcast_layernorm upcast_lmhead_output include_num_input_tokens_seen
save_only_model
""")
_FLASH = {"auto": "sdpa", "sdpa": "sdpa", "disabled": "eager", "fa2": "flash", "fa3": "flash"}


def read_llamafactory(path: str, data: dict[str, Any]) -> Reading:
    reading = Reading(path, "LLaMA-Factory config")
    handled = read_training_arguments(reading, data)
    handled |= {"model_name_or_path", "stage", "finetuning_type", "lora_rank", "lora_target", "lora_dropout",
                "quantization_bit",
                "cutoff_len", "packing", "neat_packing", "flash_attn", "disable_gradient_checkpointing",
                "pure_bf16", "use_unsloth", "enable_liger_kernel", "use_galore", "use_badam", "use_apollo",
                "use_dora", "use_rslora", "quantization_method", "infer_backend"}
    if not data.get("model_name_or_path"):
        reading.fail("model_name_or_path", "missing: it names the model")
    reading.set("model", str(data["model_name_or_path"]), "model_name_or_path")
    stage = str(data.get("stage", "sft"))
    if stage not in ("sft", "pt"):
        reading.not_modelled(f"stage={stage}", "reward/preference stages run extra models (reference, reward); "
                             "estimated as one SFT step of the policy")
    _read_method(reading, data)
    if data.get("cutoff_len") is not None:
        reading.set("seq_len", reading.count("cutoff_len", data["cutoff_len"]), "cutoff_len")
    else:
        reading.assume("seq_len", 2048, "LLaMA-Factory's cutoff_len default")
    if reading.flag("packing", data.get("packing")) or stage == "pt" and data.get("packing") is None:
        reading.set("packing", True, "packing" if data.get("packing") else "stage=pt (packs by default)")
    flash = str(data.get("flash_attn", "auto")).lower()
    if flash not in _FLASH:
        reading.fail("flash_attn", f"must be one of {', '.join(_FLASH)}, got {data.get('flash_attn')!r}")
    (reading.set if "flash_attn" in data else reading.assume)("attn", _FLASH[flash], "flash_attn")
    disabled = reading.flag("disable_gradient_checkpointing", data.get("disable_gradient_checkpointing", False))
    (reading.set if "disable_gradient_checkpointing" in data else reading.assume)(
        "grad_ckpt", not disabled, "disable_gradient_checkpointing (LLaMA-Factory checkpoints unless disabled)")
    for key in ("use_unsloth", "enable_liger_kernel", "use_galore", "use_badam", "use_apollo", "use_dora"):
        if data.get(key):
            reading.not_modelled(key, "not modelled; estimated without it")
    reading.assume("loop", "trainer", "LLaMA-Factory trains with the HF Trainer")
    unknown_keys(reading, data, handled, NO_EFFECT)
    return reading


def _read_method(reading: Reading, data: dict[str, Any]) -> None:
    kind = str(data.get("finetuning_type", "lora")).lower()
    pure = reading.flag("pure_bf16", data.get("pure_bf16", False))
    half = reading.settings.get("half")
    if kind == "lora":
        rank = reading.count("lora_rank", data.get("lora_rank", 8))
        (reading.set if "lora_rank" in data else reading.assume)("lora_rank", rank, "lora_rank")
        target = str(data.get("lora_target", "all"))
        targets = "all-linear" if target == "all" else target
        (reading.set if "lora_target" in data else reading.assume)("lora_targets", targets, "lora_target")
        reading.lora_dropout("lora_dropout", data)
        if data.get("quantization_bit") is not None:
            bits = reading.count("quantization_bit", data["quantization_bit"])
            if bits == 4:
                reading.set("qlora", True, "quantization_bit")
            else:
                reading.not_modelled(f"quantization_bit={bits}", "only 4-bit QLoRA is modelled; estimated 16-bit")
        if half and half.value in ("bf16", "fp16"):
            reading.set("weights_dtype", half.value, "bf16/fp16 (LLaMA-Factory loads the base in the compute dtype)")
    elif kind == "full":
        if pure:
            reading.set("precision", "bf16", "pure_bf16")
        elif half and half.value in ("bf16", "fp16"):
            reading.set("weights_dtype", "fp32", "finetuning_type=full (trainable parameters upcast to fp32)")
    else:
        reading.not_modelled(f"finetuning_type={kind}", "only full and LoRA fine-tuning are modelled; estimated as "
                             "full fine-tuning")
