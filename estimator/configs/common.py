"""Meanings shared by several tools: optimizer names, attention implementations, FSDP plugin options."""

from __future__ import annotations

from typing import Any

from estimator.configs.reading import Reading

# transformers' ``OptimizerNames`` (TrainingArguments.optim; axolotl and LLaMA-Factory pass it through) ->
# the estimator's optimizer. https://huggingface.co/docs/transformers/main_classes/trainer#transformers.TrainingArguments
HF_OPTIMIZERS = {
    "adamw_torch": "adamw", "adamw_hf": "adamw", "adamw_torch_fused": "adamw_fused",
    "adamw_bnb_8bit": "adamw_8bit", "adamw_8bit": "adamw_8bit", "paged_adamw_8bit": "adamw_8bit",
    "paged_adamw_32bit": "adamw", "paged_adamw": "adamw", "sgd": "sgd",
}
# Names whose states the estimator sizes as another optimizer's, with what differs.
HF_OPTIMIZER_APPROX = {
    "paged_adamw_8bit": "paged: bitsandbytes keeps the 8-bit states in CUDA unified memory, which the driver can "
                        "page out; estimated as resident",
    "paged_adamw_32bit": "paged: the fp32 states live in CUDA unified memory; estimated as resident",
    "paged_adamw": "paged: the fp32 states live in CUDA unified memory; estimated as resident",
}
HF_ATTENTION = {"eager": "eager", "sdpa": "sdpa", "flash_attention_2": "flash", "flash_attention_3": "flash",
                "kernels-community/flash-attn": "flash", "kernels-community/flash-attn3": "flash"}


def read_hf_optimizer(reading: Reading, key: str, value: Any) -> None:
    name = str(value).strip().lower()
    if name in HF_OPTIMIZERS:
        reading.set("optimizer", HF_OPTIMIZERS[name], key)
        if name in HF_OPTIMIZER_APPROX:
            reading.not_modelled(key, HF_OPTIMIZER_APPROX[name])
        return
    reading.not_modelled(f"{key}={value}", "this optimizer's states are not modelled; estimated as AdamW "
                                           "(2 fp32 states per trainable parameter)")
    reading.assume("optimizer", "adamw", f"{value!r} is not modelled")


def read_attn_implementation(reading: Reading, key: str, value: Any) -> None:
    name = str(value).strip()
    if name in HF_ATTENTION:
        reading.set("attn", HF_ATTENTION[name], key)
    else:
        reading.not_modelled(f"{key}={value}", "estimated as sdpa")
        reading.assume("attn", "sdpa", f"{value!r} is not modelled")


# torch's ShardingStrategy values, as accelerate also accepts them (1-based): FSDP1 only.
FSDP1_STRATEGIES = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD",
                    "5": "HYBRID_SHARD_ZERO2"}
# Options of the FSDP plugin that leave the per-rank peak as the estimate models it (wrapping per decoder
# layer, state-dict format, loading path, prefetch of the next layer's gather).
FSDP_NO_EFFECT = frozenset({
    "auto_wrap_policy", "transformer_layer_cls_to_wrap", "min_num_params", "state_dict_type",
    "cpu_ram_efficient_loading", "sync_module_states", "forward_prefetch", "backward_prefetch",
    "backward_prefetch_policy", "use_orig_params", "limit_all_gathers", "xla", "xla_fsdp_grad_ckpt",
    "xla_fsdp_settings", "activation_checkpointing_policy", "save_16bit_model",
})


def read_fsdp_options(reading: Reading, options: dict[str, Any], prefix: str, *, version: int | None,
                      strategy: str | None = None, offload: bool = False) -> None:
    """One FSDP plugin configuration (accelerate's ``fsdp_config``, Trainer's ``fsdp``/``fsdp_config``, axolotl's).

    Keys are read with or without their ``fsdp_`` prefix. ``version`` None: the tool's default (FSDP1 for
    accelerate and Trainer). The estimator's ``fsdp`` method is FSDP2 ``fully_shard`` per decoder layer with
    ``reshard_after_forward=True`` and no offload; anything else is named as not modelled.
    """
    plain = {(k[5:] if k.startswith("fsdp_") else k): (k, v) for k, v in options.items()}
    handled = set()

    def get(name: str, default: Any = None) -> tuple[str, Any]:
        if name in plain:
            handled.add(name)
            key, value = plain[name]
            return prefix + key, value
        return "", default

    key, raw_version = get("version", version)
    version = reading.count(key or "fsdp_version", raw_version) if raw_version is not None else 1
    if version not in (1, 2):
        reading.fail(key or "fsdp_version", f"must be 1 or 2, got {raw_version!r}")
    current = reading.settings.get("method")
    if current is None or current.value != "fsdp":
        reading.set("method", "fsdp", key or f"{prefix}(FSDP)")
    key, reshard = get("reshard_after_forward")
    strategy_key, sharding = get("sharding_strategy")
    if version == 1:
        chosen = sharding if sharding is not None else (reshard if reshard is not None else strategy)
        name = FSDP1_STRATEGIES.get(str(chosen), str(chosen).upper()) if chosen is not None else "FULL_SHARD"
        where = strategy_key or key or f"{prefix}(FSDP1 default)"
        if name == "NO_SHARD":
            reading.set("method", "ddp", where)
            reading.not_modelled(where, "FSDP1 NO_SHARD estimated as DDP (every rank holds the whole model)")
        else:
            reading.not_modelled(f"{prefix}fsdp_version=1", "FSDP1's flat parameters are estimated as FSDP2 "
                                 "(fully_shard per decoder layer); the fsdp1 method is not built yet")
            if name != "FULL_SHARD":
                reading.not_modelled(f"{where}={name}", "estimated as FULL_SHARD (parameters resharded after "
                                     "forward, sharded over every rank); this strategy holds more")
    else:
        if reshard is None and strategy is not None and str(strategy).upper() == "SHARD_GRAD_OP":
            key, reshard = f"{prefix}fsdp=shard_grad_op", False
        if reshard is not None and not reading.flag(key or "reshard_after_forward", reshard):
            reading.not_modelled(f"{key}=false", "estimated with reshard_after_forward=True; keeping every "
                                 "layer's unsharded parameters from forward to backward holds more")
        if sharding is not None:
            reading.unknown.append(strategy_key)
    key, value = get("offload_params", offload)
    if "cpu_offload" in plain:
        key, value = get("cpu_offload")
    if reading.flag(key or "offload", value):
        reading.not_modelled(key or f"{prefix}offload", "FSDP CPU offload is not modelled: the estimate keeps "
                             "parameters, gradients and optimizer states on the GPU (an over-estimate)")
    key, value = get("activation_checkpointing")
    if value is not None and reading.flag(key, value):
        reading.set("grad_ckpt", True, key)
    for name, (raw_key, _) in plain.items():
        if name in handled:
            continue
        if name in FSDP_NO_EFFECT:
            reading.no_effect.append(prefix + raw_key)
        else:
            reading.unknown.append(prefix + raw_key)
