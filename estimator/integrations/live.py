"""The spec a running job really runs, read from its live objects: the model (its config, parameter dtypes, LoRA
and 4-bit layers, attention kernel, checkpointing), the optimizer, and torch.distributed. These facts win over
what the training arguments say. torch is imported inside the functions: this module is never on the predict
path, and every reader here tolerates objects it does not know (it then leaves the setting out)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_ATTN = {"flash_attention_2": "flash", "flash_attention_3": "flash", "sdpa": "sdpa", "eager": "eager"}
_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


def unwrap(model: Any) -> Any:
    """The HF model under DDP / DeepSpeed / FSDP / peft wrappers (the one with a ``config``)."""
    seen = 0
    while seen < 8:
        seen += 1
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            return _with_config(model.get_base_model()) or model
        inner = getattr(model, "module", None)
        if inner is None or inner is model:
            break
        model = inner
    return _with_config(model) or model


def _with_config(model: Any) -> Any:
    config = getattr(model, "config", None)
    return model if config is not None and hasattr(config, "to_dict") else None


def model_reference(model: Any, folder: Path) -> str:
    """A catalogue name when the live config is a catalogue model's, else a config.json written to ``folder``
    (so the record stays predictable later, with no hub access)."""
    from estimator.models.arch import catalogue_models, config_fingerprint, load_config

    config = _config_dict(unwrap(model))
    fingerprint = config_fingerprint(config)
    name = str(config.get("_name_or_path") or "")
    candidates = [m for m in catalogue_models() if name and m.lower().endswith(name.lower().split("/")[-1])]
    for candidate in candidates:
        known = load_config(candidate)
        if config_fingerprint(known) == fingerprint and known.get("num_hidden_layers") == config.get(
                "num_hidden_layers"):
            return candidate
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"model-{fingerprint}-L{config.get('num_hidden_layers', 'x')}.json"
    path.write_text(json.dumps(config, indent=1, sort_keys=True, default=str))
    return str(path.resolve())


def _config_dict(model: Any) -> dict[str, Any]:
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the 4-bit base is a spec setting (qlora), not an architecture fact
    return json.loads(json.dumps(config, default=str))


def model_facts(model: Any) -> dict[str, Any]:
    """Settings the live model decides: LoRA rank/targets, 4-bit base, weights' dtype, attention, checkpointing."""
    facts: dict[str, Any] = {}
    base = unwrap(model)
    lora = _lora(model)
    if lora:
        facts["lora_rank"], facts["lora_targets"], facts["lora_dropout"] = lora
    facts["qlora"] = bool(getattr(base, "is_loaded_in_4bit", False))
    dtype = _weights_dtype(base, facts["qlora"])
    if dtype:
        facts["weights_dtype"] = dtype
    attn = _ATTN.get(str(getattr(base.config, "_attn_implementation", "") or ""))
    if attn:
        facts["attn"] = attn
    ckpt = getattr(base, "is_gradient_checkpointing", None)
    if isinstance(ckpt, bool):
        facts["grad_ckpt"] = ckpt
    return facts


def outputs_fp32(model: Any) -> bool | None:
    """True when accelerate wrapped the forward for mixed precision (``Accelerator.prepare_model`` keeps the
    original as ``_original_forward`` and returns fp32 copies of 16-bit outputs), on the model or any wrapper
    around it; None when it cannot tell (then the training arguments decide)."""
    seen = 0
    while model is not None and seen < 8:
        seen += 1
        if "_original_forward" in getattr(model, "__dict__", {}):
            return True
        model = getattr(model, "module", None)
    return None


def fsdp1_facts(model: Any) -> dict[str, Any]:
    """``method`` fsdp1 and its settings when ``model`` is (or holds) FSDP1 ``FullyShardedDataParallel`` units,
    read from the outermost unit as it really runs (FSDP1 turns FULL_SHARD into NO_SHARD on one rank); {}
    otherwise. FSDP2 (``fully_shard``) modules are not FullyShardedDataParallel instances."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except Exception:  # noqa: BLE001 - a torch without distributed
        return {}
    modules = model.modules() if hasattr(model, "modules") else []
    root = next((m for m in modules if isinstance(m, FullyShardedDataParallel)), None)
    if root is None:
        return {}
    strategy = getattr(root.sharding_strategy, "name", "FULL_SHARD").lstrip("_")
    prefetch = root.backward_prefetch
    settings = {"sharding_strategy": "HYBRID_SHARD" if strategy.startswith("HYBRID") else strategy,
                "cpu_offload": bool(getattr(root.cpu_offload, "offload_params", False)),
                "backward_prefetch": prefetch.name if prefetch is not None else "NONE",
                "forward_prefetch": bool(root.forward_prefetch), "limit_all_gathers": bool(root.limit_all_gathers),
                "use_orig_params": bool(getattr(root, "_use_orig_params", True))}
    if settings["sharding_strategy"] == "HYBRID_SHARD":  # the shard group is one node's ranks
        settings["gpus_per_node"] = int(root.process_group.size())
    return {"method": "fsdp1", "fsdp1": settings}


def _lora(model: Any) -> tuple[int, str, float] | None:
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    config = next(iter(configs.values()))
    rank = getattr(config, "r", None)
    targets = getattr(config, "target_modules", None)
    if not isinstance(rank, int) or not rank:
        return None
    if isinstance(targets, str):
        text = "all-linear" if targets == "all-linear" else targets
    else:
        text = ",".join(sorted(map(str, targets or []))) or "auto"
    dropout = getattr(config, "lora_dropout", 0.0)
    return rank, text, float(dropout) if isinstance(dropout, (int, float)) and 0 <= dropout < 1 else 0.0


def _weights_dtype(base: Any, qlora: bool) -> str | None:
    if qlora:  # 4-bit layers compute in bnb_4bit_compute_dtype; the rest was cast by prepare_model_for_kbit_training
        quant = getattr(base.config, "quantization_config", None)
        compute = quant.get("bnb_4bit_compute_dtype") if isinstance(quant, dict) else \
            getattr(quant, "bnb_4bit_compute_dtype", None)
        return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(str(compute).replace("torch.", ""))
    embeddings = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    return _DTYPES.get(str(getattr(weight, "dtype", "")))


def optimizer_name(optimizer: Any) -> str | None:
    """The estimator's name for a live optimizer (accelerate's wrapper unwrapped), None when not modelled."""
    inner = getattr(optimizer, "optimizer", optimizer)
    cls = type(inner).__name__
    module = type(inner).__module__
    if cls in ("AdamW", "Adam") and module.startswith("torch.optim"):
        defaults = getattr(inner, "defaults", {})
        return "adamw_fused" if defaults.get("fused") else "adamw"
    if cls == "SGD" and module.startswith("torch.optim"):
        return "sgd"
    if "8bit" in cls and module.startswith("bitsandbytes"):
        return "adamw_8bit"
    return None


def world_size() -> int:
    try:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    except Exception:  # noqa: BLE001 - no process group: one process
        return 1


def rank() -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except Exception:  # noqa: BLE001
        return 0


def device_gpu_key() -> tuple[str | None, int | None, str | None]:
    """(catalogue key, total bytes, device name) of this process's CUDA device; (None, None, None) on CPU."""
    import torch

    if not torch.cuda.is_available():
        return None, None, None
    from estimator.hardware.gpus import normalize_gpu_name

    device = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(device)
    return normalize_gpu_name(props.name, int(props.total_memory)), int(props.total_memory), props.name
