"""Meanings shared by several tools: optimizer names, attention implementations, FSDP plugin options."""

from __future__ import annotations

import json
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
# accelerate's FSDP_BACKWARD_PREFETCH names (1-based) -> Fsdp1Spec.backward_prefetch.
FSDP1_PREFETCH = {"1": "BACKWARD_PRE", "2": "BACKWARD_POST", "BACKWARD_PRE": "BACKWARD_PRE",
                  "BACKWARD_POST": "BACKWARD_POST", "NO_PREFETCH": "NONE", "NONE": "NONE"}
# What accelerate's FSDP1 plugin runs when the config leaves a setting out (accelerate 1.15
# ``FullyShardedDataParallelPlugin.__post_init__``; ``accelerate launch`` and the Trainer pass use_orig_params=True):
# no backward prefetch, unlike torch's own default (BACKWARD_PRE).
ACCELERATE_FSDP1_DEFAULTS = {"backward_prefetch": "NONE"}
# Options of the FSDP plugin that leave the per-rank peak as the estimate models it (wrapping per decoder
# layer, state-dict format, loading path). The FSDP1-only ones (prefetch, use_orig_params, limit_all_gathers)
# have no effect under FSDP2, which accelerate ignores or rejects them for.
FSDP_NO_EFFECT = frozenset({
    "auto_wrap_policy", "transformer_layer_cls_to_wrap", "min_num_params", "state_dict_type",
    "cpu_ram_efficient_loading", "sync_module_states", "forward_prefetch", "backward_prefetch",
    "backward_prefetch_policy", "use_orig_params", "limit_all_gathers", "xla", "xla_fsdp_grad_ckpt",
    "xla_fsdp_settings", "activation_checkpointing_policy", "save_16bit_model",
})


def read_fsdp_options(reading: Reading, options: dict[str, Any], prefix: str, *, version: int | None,
                      strategy: str | None = None, offload: bool = False,
                      gpus_per_node: tuple[str, int] | None = None) -> None:
    """One FSDP plugin configuration (accelerate's ``fsdp_config``, Trainer's ``fsdp``/``fsdp_config``, axolotl's).

    Keys are read with or without their ``fsdp_`` prefix. ``version`` None: the tool's default (FSDP1 for
    accelerate). Version 1 is the ``fsdp1`` method with its settings (``Fsdp1Spec``: sharding strategy, offload,
    prefetch, use_orig_params, limit_all_gathers; ``gpus_per_node``: (key, count) for HYBRID_SHARD); version 2
    is ``fsdp``, FSDP2 ``fully_shard`` per decoder layer with ``reshard_after_forward=True`` and no offload,
    anything else named as not modelled.
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
    if version == 1:
        _read_fsdp1(reading, get, prefix, strategy, offload, gpus_per_node, key or f"{prefix}(FSDP1)")
    else:
        _read_fsdp2(reading, get, prefix, strategy, offload, key or f"{prefix}(FSDP)")
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


def _read_fsdp2(reading: Reading, get, prefix: str, strategy: str | None, offload: bool, where: str) -> None:
    current = reading.settings.get("method")
    if current is None or current.value != "fsdp":
        reading.set("method", "fsdp", where)
    key, reshard = get("reshard_after_forward")
    strategy_key, sharding = get("sharding_strategy")
    if reshard is None and strategy is not None and str(strategy).upper() == "SHARD_GRAD_OP":
        key, reshard = f"{prefix}fsdp=shard_grad_op", False
    if reshard is not None and not reading.flag(key or "reshard_after_forward", reshard):
        reading.not_modelled(f"{key}=false", "estimated with reshard_after_forward=True; keeping every "
                             "layer's unsharded parameters from forward to backward holds more")
    if sharding is not None:
        reading.unknown.append(strategy_key)
    key, value = _offload(get, offload)
    if reading.flag(key or "offload", value):
        reading.not_modelled(key or f"{prefix}offload", "FSDP2 CPU offload is not modelled: the estimate keeps "
                             "parameters, gradients and optimizer states on the GPU (an over-estimate)")


def _offload(get, offload: bool) -> tuple[str, Any]:
    key, value = get("offload_params", offload)
    cpu_key, cpu_value = get("cpu_offload")
    return (cpu_key, cpu_value) if cpu_key else (key, value)


def _read_fsdp1(reading: Reading, get, prefix: str, strategy: str | None, offload: bool,
                gpus_per_node: tuple[str, int] | None, where: str) -> None:
    """FSDP1: the ``fsdp1`` method and its ``Fsdp1Spec`` fields, each from the key that gave it or accelerate's
    default (``ACCELERATE_FSDP1_DEFAULTS``)."""
    settings: dict[str, Any] = {}
    sources = []

    def took(field_name: str, value: Any, key: str) -> None:
        settings[field_name] = value
        if key:
            sources.append(key)

    reshard_key, reshard = get("reshard_after_forward")
    strategy_key, sharding = get("sharding_strategy")
    chosen, key = ((sharding, strategy_key) if sharding is not None else (reshard, reshard_key) if reshard is not None
                   else (strategy, f"{prefix}fsdp={strategy}" if strategy else ""))
    name = FSDP1_STRATEGIES.get(str(chosen), str(chosen).upper()) if chosen is not None else "FULL_SHARD"
    if name == "HYBRID_SHARD_ZERO2":
        reading.not_modelled(f"{key}={name}", "estimated as HYBRID_SHARD; _HYBRID_SHARD_ZERO2 keeps every layer's "
                             "node-sharded parameters from forward to backward (holds more)")
        name = "HYBRID_SHARD"
    if name not in FSDP1_STRATEGIES.values():
        reading.fail(key, f"{chosen!r} is not an FSDP1 sharding strategy ({', '.join(FSDP1_STRATEGIES.values())})")
    took("sharding_strategy", name, key)
    key, value = get("backward_prefetch")
    if key:
        prefetch = FSDP1_PREFETCH.get(str(value).strip().upper()) if value is not None else "NONE"
        if prefetch is None:
            reading.fail(key, f"{value!r} is not a backward prefetch mode (BACKWARD_PRE, BACKWARD_POST, NO_PREFETCH)")
        took("backward_prefetch", prefetch, key)
    else:
        took("backward_prefetch", ACCELERATE_FSDP1_DEFAULTS["backward_prefetch"], "")
        reading.notes.append("fsdp1 backward_prefetch = 'NONE': accelerate's FSDP plugin prefetches nothing unless "
                             f"the config sets {prefix}backward_prefetch")
    old_key, _ = get("backward_prefetch_policy")
    if old_key:
        reading.not_modelled(old_key, "an old key name accelerate 1.x no longer reads (it reads "
                             "fsdp_backward_prefetch); estimated with the backward prefetch above")
    for field_name in ("forward_prefetch", "use_orig_params", "limit_all_gathers"):
        key, value = get(field_name)
        if key:
            took(field_name, reading.flag(key, value), key)
    key, value = _offload(get, offload)
    if key or value:
        took("cpu_offload", reading.flag(key or "offload", value), key or f"{prefix}fsdp=offload")
    if gpus_per_node is not None:
        took("gpus_per_node", gpus_per_node[1], gpus_per_node[0])
    reading.set("method", "fsdp1", where)
    reading.set("fsdp1", settings, ", ".join(sources) or where)


# Where a config says whether checkpointing re-enters (torch.utils.checkpoint's use_reentrant): the Trainer's
# kwargs for the model's gradient_checkpointing_enable (both names), and TRL's script argument.
REENTRANT_KEYS = ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs",
                  "gradient_checkpointing_use_reentrant")


def read_reentrant(reading: Reading, values: dict[str, Any]) -> None:
    """``ckpt_reentrant`` from the first of ``REENTRANT_KEYS`` that gives it. Unset, the spec's default
    (non-reentrant) stands: what transformers 5 passes; before 5 the model's ``gradient_checkpointing_enable``
    defaulted to reentrant, which matters under FSDP1 with model code before 4.52 (pass --ckpt-reentrant)."""
    for key, value in values.items():
        if value is None:
            continue
        if key == "gradient_checkpointing_use_reentrant":
            reading.set("ckpt_reentrant", reading.flag(key, value), key)
            return
        kwargs = value
        if isinstance(kwargs, str):  # the Trainer takes a JSON string from the command line
            try:
                kwargs = json.loads(kwargs)
            except json.JSONDecodeError:
                reading.fail(key, f"must be a mapping or a JSON object, got {value!r}")
        if not isinstance(kwargs, dict):
            reading.fail(key, f"must be a mapping or a JSON object, got {value!r}")
        if "use_reentrant" in kwargs:
            reading.set("ckpt_reentrant", reading.flag(f"{key}.use_reentrant", kwargs["use_reentrant"]),
                        f"{key}.use_reentrant")
            return
