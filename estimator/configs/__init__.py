"""Read users' training configs into one ``RunSpec``: HF ``TrainingArguments`` / TRL ``SFTConfig`` (JSON or
YAML), accelerate config YAML, DeepSpeed JSON, torchtune recipe YAML, axolotl YAML, LLaMA-Factory YAML.

``spec_from_configs(paths, flags)`` -> (spec, report). Each file's tool is recognised from its keys, or named
with a prefix (``accelerate:path.yaml``). Nothing in a config is executed or imported: JSON and YAML are read
as plain data (``yaml.safe_load``), torchtune's ``_component_`` paths stay strings, pickles are refused.
Pure standard library except PyYAML, imported when a YAML file is read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from estimator.configs.build import ConfigReport, build_report, merge, spec_from_settings
from estimator.configs.load import load_mapping
from estimator.configs.reading import Reading
from estimator.spec import RunSpec

__all__ = ["ConfigReport", "TOOLS", "detect_tool", "read_config", "spec_from_configs", "spec_from_data",
           "spec_from_readings"]


def _readers() -> dict[str, Callable[[str, dict[str, Any]], Reading]]:
    from estimator.configs.accelerate import read_accelerate
    from estimator.configs.axolotl import read_axolotl
    from estimator.configs.deepspeed import read_deepspeed
    from estimator.configs.hf import read_hf
    from estimator.configs.llamafactory import read_llamafactory
    from estimator.configs.torchtune import read_torchtune

    return {"hf": read_hf, "trl": read_hf, "accelerate": read_accelerate, "deepspeed": read_deepspeed,
            "torchtune": read_torchtune, "axolotl": read_axolotl, "llamafactory": read_llamafactory}


TOOLS = ("hf", "trl", "accelerate", "deepspeed", "torchtune", "axolotl", "llamafactory")
_LLAMAFACTORY_KEYS = {"stage", "finetuning_type", "cutoff_len", "template", "lora_target", "flash_attn",
                      "quantization_bit"}
_HF_KEYS = {"per_device_train_batch_size", "gradient_accumulation_steps", "output_dir", "optim", "bf16", "fp16",
            "learning_rate", "gradient_checkpointing", "num_train_epochs", "max_steps", "max_length",
            "max_seq_length", "packing", "model_name_or_path"}


def detect_tool(data: dict[str, Any]) -> str | None:
    """Which tool's format a mapping is, from keys only that tool writes."""
    keys = set(data)
    if keys & {"distributed_type", "compute_environment"}:
        return "accelerate"
    if keys & {"zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size"}:
        return "deepspeed"
    if any(isinstance(v, dict) and "_component_" in v for v in data.values()):
        return "torchtune"
    if "base_model" in keys:
        return "axolotl"
    if "model_name_or_path" in keys and keys & _LLAMAFACTORY_KEYS:
        return "llamafactory"
    if keys & _HF_KEYS:
        return "hf"
    return None


def read_config(argument: str) -> Reading:
    """One ``--config`` argument: ``PATH`` or ``TOOL:PATH``."""
    tool, _, rest = argument.partition(":")
    path = rest if tool in TOOLS and rest else argument
    forced = tool if tool in TOOLS and rest else None
    data = load_mapping(path)
    tool = forced or detect_tool(data)
    if tool is None:
        raise ValueError(f"config: {path}: cannot tell which tool this config is for (none of the keys that "
                         f"HF/TRL, accelerate, DeepSpeed, torchtune, axolotl or LLaMA-Factory write); name it: "
                         f"--config TOOL:{path} with TOOL one of {', '.join(TOOLS)}")
    return _readers()[tool](path, data)


def spec_from_configs(arguments: list[str], flags: dict[str, Any] | None = None) -> tuple[RunSpec, ConfigReport]:
    """The spec the configs describe, explicit ``flags`` (setting name -> value) winning, and what was read."""
    return spec_from_readings([read_config(a) for a in arguments], flags)


def spec_from_data(tool: str, name: str, data: dict[str, Any], flags: dict[str, Any] | None = None
                   ) -> tuple[RunSpec, ConfigReport]:
    """The same from a mapping already in memory (a live ``TrainingArguments.to_dict()``)."""
    return spec_from_readings([_readers()[tool](name, data)], flags)


def spec_from_readings(readings: list[Reading], flags: dict[str, Any] | None = None
                       ) -> tuple[RunSpec, ConfigReport]:
    settings, conflicts = merge(readings, flags or {})
    named = settings.get("deepspeed")
    if named is not None and isinstance(named.value, str) and named.value not in [r.path for r in readings]:
        from estimator.configs.deepspeed import read_deepspeed

        ds = read_deepspeed(named.value, load_mapping(named.value))  # its keys, for the report
        readings.append(Reading(ds.path, ds.tool, unknown=ds.unknown, unmodelled=ds.unmodelled,
                                no_effect=ds.no_effect))
    report = build_report(readings, settings, conflicts)
    spec = spec_from_settings(settings, report)
    return spec, report
