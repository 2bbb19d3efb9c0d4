"""Read a user's DeepSpeed JSON into a ``RunSpec``: ZeRO stage and offload, precision, batch sizes, buckets.

Pure standard library. Defaults are DeepSpeed 0.19.8's (``deepspeed/runtime/zero/config.py``,
``offload_config.py``, ``runtime/constants.py``), and they match ``ZeroSpec``'s:
reduce/allgather bucket 5e8, overlap_comm = (stage == 3), contiguous_gradients and reduce_scatter true,
stage3_prefetch_bucket_size 5e7, stage3_param_persistence_threshold 1e5, stage3_max_live_parameters and
stage3_max_reuse_distance 1e9, sub_group_size 1e9, offload ``pin_memory`` true, ``leaf_module``: the MoE block
classes of ``DEFAULT_LEAF_MODULE_CLASSES`` (``leaf_module_config.py``), no names, no suffixes.

``"auto"`` is resolved the way Hugging Face's integration does (``transformers/integrations/deepspeed.py``,
``HfTrainerDeepSpeedConfig``):

* ``reduce_bucket_size`` is hidden².
* For stage 3 only, ``stage3_prefetch_bucket_size`` is int(0.9 x hidden²) and
  ``stage3_param_persistence_threshold`` is 10 x hidden.
* The micro-batch size, gradient accumulation and the fp16/bf16 switches come from the training
  arguments, i.e. from ``base``.
* Any other "auto" is dropped, so DeepSpeed's own default applies (``DeepSpeedConfigModel`` ignores
  "auto" values).

Mapping to methods:

* Stage 0 is the DeepSpeed engine without ZeRO: every rank keeps full 16-bit weights, gradients and the
  fp32 master + Adam states, and gradients are all-reduced. That is ``ddp`` on several GPUs and
  ``single`` on one.
* Stages 1, 2 and 3 map to ``zero1``, ``zero2`` and ``zero3``.
* Optimizer offload at stage 1 or 2 maps to ``zero_offload`` (ZeRO-Offload); at stage 3 the method stays
  ``zero3`` with ``ZeroSpec.offload_optimizer`` / ``offload_param`` set (ZeRO-3 Offload, ZeRO-Infinity).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import fields
from pathlib import Path
from typing import Any

from estimator.spec import ParallelSpec, RunSpec, ZeroSpec

AUTO = "auto"
_ZERO_DEFAULTS = {f.name: f.default for f in fields(ZeroSpec)}
# DeepSpeed's pydantic model accepts these spellings (populate_by_name=True with stage3_* aliases).
_ALIASES = {
    "stage3_prefetch_bucket_size": ("stage3_prefetch_bucket_size", "prefetch_bucket_size"),
    "stage3_param_persistence_threshold": ("stage3_param_persistence_threshold", "param_persistence_threshold"),
    "stage3_max_live_parameters": ("stage3_max_live_parameters", "max_live_parameters"),
    "stage3_max_reuse_distance": ("stage3_max_reuse_distance", "max_reuse_distance"),
}
_TRUE = {"true", "1", "yes", "y", "on", "t"}
_FALSE = {"false", "0", "no", "n", "off", "f"}
_OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def _fail(key: str, message: str) -> None:
    raise ValueError(f"deepspeed: {key}: {message}")


def parse_count(key: str, value: Any, *, minimum: int = 0) -> int:
    """A whole number written as a JSON int, an integral float (``5e8``) or a numeric string (``"5e8"``).

    DeepSpeed takes the JSON number 5e8. Its pydantic int fields reject the *string* "5e8"; we accept it.
    """
    if isinstance(value, bool):
        _fail(key, f"must be a number, got {value!r}")
    number: Any = value
    if isinstance(value, str):
        text = value.strip()
        try:
            number = int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                _fail(key, f"must be a number, got {value!r}")
    if isinstance(number, float):
        if not math.isfinite(number) or not number.is_integer():
            _fail(key, f"must be a whole number, got {value!r}")
        number = int(number)
    if not isinstance(number, int):
        _fail(key, f"must be a number, got {value!r}")
    if number < minimum:
        _fail(key, f"must be >= {minimum}, got {value!r}")
    return number


def parse_flag(key: str, value: Any) -> bool:
    """A boolean as DeepSpeed's pydantic fields take it: true/false, 0/1, or "true"/"yes"/"on"/"1"/...."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    _fail(key, f"must be true or false, got {value!r}")
    raise AssertionError  # unreachable


def load_deepspeed_config(ds_config: dict[str, Any] | str | Path) -> dict[str, Any]:
    """A copy of the config dict, from a dict, a JSON file path or JSON text."""
    if isinstance(ds_config, dict):
        return copy.deepcopy(ds_config)
    if not isinstance(ds_config, (str, Path)):
        raise ValueError(f"deepspeed: expected a dict or a JSON file path, got {type(ds_config).__name__}")
    text = str(ds_config)
    path = Path(text).expanduser()
    if not text.lstrip().startswith("{"):
        if not path.is_file():
            raise ValueError(f"deepspeed: no such config file {text!r}")
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"deepspeed: cannot read {str(path)!r} ({err.__class__.__name__})") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"deepspeed: config is not valid JSON (line {err.lineno}: {err.msg})") from None
    if not isinstance(config, dict):
        raise ValueError("deepspeed: config must be a JSON object")
    return config


def _section(config: dict[str, Any], key: str) -> dict[str, Any]:
    value = config.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        _fail(key, f"must be an object, got {value!r}")
    return value


def _switch(config: dict[str, Any], *keys: str) -> bool | str | None:
    """``<section>.enabled`` of the first present section: True / False, None for "auto", "absent"."""
    for key in keys:
        if key in config:
            value = _section(config, key).get("enabled", False)
            return None if value == AUTO else parse_flag(f"{key}.enabled", value)
    return "absent"


def _precision(config: dict[str, Any], base: str) -> str:
    fp16 = _switch(config, "fp16")
    bf16 = _switch(config, "bf16", "bfloat16")
    if fp16 is True and bf16 is True:
        _fail("fp16.enabled", "fp16 and bf16 cannot both be enabled (DeepSpeed refuses)")
    if bf16 is True:
        return "mixed_bf16"
    if fp16 is True:
        return "mixed_fp16"
    if fp16 is None or bf16 is None:
        # "auto": the training arguments decide. accelerate fills the switch from --mixed_precision and adds
        # the section when it is missing (DeepSpeedPlugin.set_mixed_precision); an explicit false stays false.
        family = ("bf16" if base in ("bf16", "amp_bf16", "mixed_bf16")
                  else "fp16" if base in ("amp_fp16", "mixed_fp16") else None)
        if family and {"fp16": fp16, "bf16": bf16}[family] is not False:
            return f"mixed_{family}"
    return "fp32"


def _offload(zero: dict[str, Any], key: str, deprecated: str) -> tuple[bool, bool]:
    """(enabled, pin_memory) of ``offload_optimizer`` / ``offload_param`` (or the deprecated boolean)."""
    section = zero.get(key)
    if section is None and deprecated in zero and zero[deprecated] != AUTO:
        pin = zero.get("cpu_offload_use_pin_memory", True)
        return (parse_flag(f"zero_optimization.{deprecated}", zero[deprecated]),
                True if pin == AUTO else parse_flag("zero_optimization.cpu_offload_use_pin_memory", pin))
    if section is None:
        return False, True
    if not isinstance(section, dict):
        _fail(f"zero_optimization.{key}", f"must be an object, got {section!r}")
    device = section.get("device", "none")
    device = "none" if device in (AUTO, None) else device
    if device not in _OFFLOAD_DEVICES:
        _fail(f"zero_optimization.{key}.device", f"must be one of {', '.join(_OFFLOAD_DEVICES)}, got {device!r}")
    pin = section.get("pin_memory", True)
    return device != "none", True if pin == AUTO else parse_flag(f"zero_optimization.{key}.pin_memory", pin)


def _batch(config: dict[str, Any], base: RunSpec) -> tuple[int, int]:
    """(micro batch, grad accumulation): DeepSpeed's ``_set_batch_related_parameters`` over the DP world."""
    def get(key: str) -> int | None:
        value = config.get(key)
        return None if value in (None, AUTO) else parse_count(key, value, minimum=1)

    world = base.parallel.dp
    train, micro, accum = get("train_batch_size"), get("train_micro_batch_size_per_gpu"), \
        get("gradient_accumulation_steps")
    if config.get("train_micro_batch_size_per_gpu") == AUTO:
        micro = base.training.micro_batch_size
    if config.get("gradient_accumulation_steps") == AUTO:
        accum = base.training.grad_accum_steps
    if train is not None:
        if micro is not None and accum is None:
            accum = train // micro // world
        elif micro is None:
            accum = accum or 1
            micro = train // world // accum
        if micro < 1 or accum < 1 or train != micro * accum * world:
            _fail("train_batch_size", f"{train} is not train_micro_batch_size_per_gpu x "
                                      f"gradient_accumulation_steps x {world} GPUs")
    return micro or base.training.micro_batch_size, accum or base.training.grad_accum_steps


_LEAF_KEYS = {"classes": "leaf_classes", "names": "leaf_names", "name_suffixes": "leaf_name_suffixes"}


def _leaf_module(zero: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """``zero_optimization.leaf_module`` as ``ZeroSpec``'s ``leaf_*`` fields: a key left out keeps DeepSpeed's
    default (``DeepSpeedZeroLeafModuleConfig``: the MoE block classes, no names, no suffixes); a lone string is a
    list of one, as DeepSpeed coerces it. Which modules they match is found against the model
    (``estimator.models.zero3_leaf``)."""
    section = zero.get("leaf_module")
    if section is None or section == AUTO:
        return {}
    if not isinstance(section, dict):
        _fail("zero_optimization.leaf_module", f"must be an object of classes, names and name_suffixes, "
                                               f"got {section!r}")
    unknown = sorted(set(section) - set(_LEAF_KEYS))
    if unknown:
        _fail(f"zero_optimization.leaf_module.{unknown[0]}", "unknown key (known: classes, names, name_suffixes)")
    out = {}
    for key, name in _LEAF_KEYS.items():
        if key not in section or section[key] == AUTO:
            continue
        value = [section[key]] if isinstance(section[key], str) else section[key]
        if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
            _fail(f"zero_optimization.leaf_module.{key}", f"must be a list of strings, got {section[key]!r}")
        out[name] = tuple(value)
    return out


def _hf_prefetch(hidden_size: int) -> int:
    return int(0.9 * hidden_size * hidden_size)  # HF's exact expression (float order matters for int())


def spec_from_deepspeed(ds_config: dict[str, Any] | str | Path, base: RunSpec, hidden_size: int) -> RunSpec:
    """``base`` with its parallel method, ZeRO settings, precision and batch sizes taken from a DeepSpeed config.

    The ZeRO settings start from DeepSpeed's defaults, not from ``base``'s. ``hidden_size`` resolves "auto"
    buckets. World size, model, GPU and the rest of the training spec stay ``base``'s. A bad value raises a
    one-line ``ValueError`` naming the JSON key.
    """
    config = load_deepspeed_config(ds_config)
    zero = config.get("zero_optimization", {})
    if isinstance(zero, bool):  # deprecated form: "zero_optimization": true means stage 1
        zero = {"stage": 1 if zero else 0, "allgather_bucket_size": config.get("allgather_size", 5e8)}
    if zero is None:
        zero = {}
    if not isinstance(zero, dict):
        _fail("zero_optimization", f"must be an object, got {zero!r}")
    stage_value = zero.get("stage", 0)
    stage = 0 if stage_value == AUTO else parse_count("zero_optimization.stage", stage_value)
    if stage > 3:
        _fail("zero_optimization.stage", f"must be 0, 1, 2 or 3, got {stage_value!r}")

    def hidden(key: str) -> int:
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size <= 0:
            _fail(key, f"'auto' needs the model's hidden size, got hidden_size={hidden_size!r}")
        return hidden_size

    def count(name: str, auto: Any = None, minimum: int = 0) -> int:
        for key in _ALIASES.get(name, (name,)):
            if key in zero:
                value = zero[key]
                if value == AUTO:
                    return _ZERO_DEFAULTS[name] if auto is None else auto()
                return parse_count(f"zero_optimization.{key}", value, minimum=minimum)
        return _ZERO_DEFAULTS[name]

    def flag(name: str) -> Any:
        value = zero.get(name, AUTO)
        return _ZERO_DEFAULTS[name] if value in (AUTO, None) else parse_flag(f"zero_optimization.{name}", value)

    opt_on, opt_pin = _offload(zero, "offload_optimizer", "cpu_offload")
    param_on, param_pin = _offload(zero, "offload_param", "cpu_offload_param")
    if param_on and stage != 3:
        _fail("zero_optimization.offload_param", f"parameter offload needs stage 3, got stage {stage}")
    if opt_on and stage == 0:
        _fail("zero_optimization.offload_optimizer", "optimizer offload needs ZeRO stage 1, 2 or 3, got stage 0")
    zero3 = stage == 3
    leaf = _leaf_module(zero)
    zero_spec = ZeroSpec(
        reduce_bucket_size=count("reduce_bucket_size", minimum=1,
                                 auto=lambda: hidden("zero_optimization.reduce_bucket_size") ** 2),
        allgather_bucket_size=count("allgather_bucket_size"),
        overlap_comm=flag("overlap_comm"),
        contiguous_gradients=flag("contiguous_gradients"),
        reduce_scatter=flag("reduce_scatter"),
        # HF fills these two only for stage 3; otherwise DeepSpeed drops the "auto" and keeps its default.
        stage3_prefetch_bucket_size=count("stage3_prefetch_bucket_size", auto=(
            lambda: _hf_prefetch(hidden("zero_optimization.stage3_prefetch_bucket_size"))) if zero3 else None),
        stage3_param_persistence_threshold=count("stage3_param_persistence_threshold", auto=(
            lambda: 10 * hidden("zero_optimization.stage3_param_persistence_threshold")) if zero3 else None),
        stage3_max_live_parameters=count("stage3_max_live_parameters"),
        stage3_max_reuse_distance=count("stage3_max_reuse_distance"),
        sub_group_size=count("sub_group_size"),
        offload_optimizer=opt_on, offload_param=param_on,
        pin_memory=(opt_pin if opt_on else param_pin) if (opt_on or param_on) else False, **leaf)

    if base.parallel.tp != 1:
        _fail("zero_optimization", f"the base spec has tensor parallelism (tp={base.parallel.tp}); a DeepSpeed "
                                   f"config maps to data-parallel methods only")
    world = base.parallel.world_size
    if stage == 3:  # ZeRO-3 Offload / ZeRO-Infinity: stage 3 with the offload flags
        method = "zero3"
    elif opt_on:
        method = "zero_offload"
    elif stage == 0:
        method = "single" if world == 1 else "ddp"
    else:
        method = f"zero{stage}"
    micro, accum = _batch(config, base)
    return base.replace(**{
        "parallel": ParallelSpec(method=method, world_size=world, tp=1, zero=zero_spec),
        "training.precision": _precision(config, base.training.precision),
        "training.micro_batch_size": micro,
        "training.grad_accum_steps": accum,
    })
