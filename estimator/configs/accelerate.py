"""accelerate's config YAML (``accelerate config`` / ``accelerate launch --config_file``).

Keys as ``accelerate config`` writes them (accelerate 1.15, ``commands/config/config_args.py`` and
``cluster.py``; https://huggingface.co/docs/accelerate/package_reference/cli#accelerate-config and
https://huggingface.co/docs/accelerate/usage_guides/fsdp, .../usage_guides/deepspeed). ``num_processes`` is the
total number of processes over all machines. Without ``fsdp_version`` accelerate launch runs FSDP1
(``utils/launch.py`` sets ``FSDP_VERSION=1``). The DeepSpeed plugin's settings become a DeepSpeed config read by
``estimator.configs.deepspeed_json``; a ``deepspeed_config_file`` is read as it is.
"""

from __future__ import annotations

from typing import Any

from estimator.configs.common import read_fsdp_options
from estimator.configs.hf import _relative
from estimator.configs.reading import Reading, unknown_keys, words

NO_EFFECT = words("""
compute_environment debug machine_rank num_machines main_process_ip main_process_port rdzv_backend same_network
main_training_function enable_cpu_affinity gpu_ids tpu_name tpu_zone tpu_use_cluster tpu_use_sudo command_file
commands tpu_vm tpu_env downcast_bf16 mpirun_config ipex_config megatron_lm_config use_cpu dynamo_config fp8_config
""")
DS_PLUGIN_NO_EFFECT = words("""
deepspeed_multinode_launcher deepspeed_hostfile deepspeed_exclusion_filter deepspeed_inclusion_filter
zero3_save_16bit_model gradient_clipping deepspeed_moe_layer_cls_names zero3_init_flag offload_optimizer_nvme_path
offload_param_nvme_path
""")
_DISTRIBUTED = {"NO": "single", "MULTI_GPU": "ddp", "FSDP": "fsdp", "DEEPSPEED": "deepspeed"}


def read_accelerate(path: str, data: dict[str, Any]) -> Reading:
    reading = Reading(path, "accelerate config")
    handled = {"distributed_type", "num_processes", "mixed_precision", "fsdp_config", "deepspeed_config",
               "parallelism_config", "use_cpu", "dynamo_config"}
    kind = str(data.get("distributed_type", "NO")).upper()
    if kind not in _DISTRIBUTED:
        reading.fail("distributed_type", f"{kind} is not a GPU data-parallel setup the estimator models "
                                         f"({', '.join(_DISTRIBUTED)})")
    processes = data.get("num_processes")
    if processes not in (None, -1):
        reading.set("world_size", reading.count("num_processes", processes), "num_processes")
    method = _DISTRIBUTED[kind]
    reading.set("method", method, "distributed_type")
    _read_mixed_precision(reading, data.get("mixed_precision"))
    if method == "fsdp":
        options = data.get("fsdp_config") or {}
        if not isinstance(options, dict):
            reading.fail("fsdp_config", f"must be a mapping, got {options!r}")
        read_fsdp_options(reading, options, "fsdp_config.", version=None, gpus_per_node=_gpus_per_node(reading, data))
    elif data.get("fsdp_config"):
        reading.no_effect.append("fsdp_config (distributed_type is not FSDP)")
    if method == "deepspeed":
        _read_deepspeed_plugin(reading, data.get("deepspeed_config") or {}, data.get("mixed_precision"))
    elif data.get("deepspeed_config"):
        reading.no_effect.append("deepspeed_config (distributed_type is not DEEPSPEED)")
    if data.get("parallelism_config"):
        reading.not_modelled("parallelism_config", "context/tensor parallel sizes from accelerate are not read")
    if reading.flag("use_cpu", data.get("use_cpu")):
        reading.not_modelled("use_cpu", "a CPU run: the estimate is for the GPU the spec names")
    elif "use_cpu" in data:
        reading.no_effect.append("use_cpu")
    dynamo = data.get("dynamo_config") or {}
    if isinstance(dynamo, dict) and str(dynamo.get("dynamo_backend", "NO")).upper() not in ("NO", "EAGER"):
        reading.not_modelled("dynamo_config.dynamo_backend", "torch.compile is not modelled; estimated eager")
    unknown_keys(reading, data, handled, NO_EFFECT)
    reading.assume("grad_sync", "last", "accelerate's accumulate() skips the gradient sync (no_sync) on all but "
                   "the last micro-batch unless GradientAccumulationPlugin(sync_each_batch=True)", weak=True)
    reading.assume("loop", "manual", "an accelerate config alone: accelerate's examples keep `outputs` bound "
                   "through backward; pass the Trainer's arguments too (or --loop trainer) for a Trainer script", weak=True)
    return reading


def _gpus_per_node(reading: Reading, data: dict[str, Any]) -> tuple[str, int] | None:
    """HYBRID_SHARD's shard group: the processes of one machine (``num_processes`` counts all machines)."""
    machines, processes = data.get("num_machines"), data.get("num_processes")
    if machines in (None, 1) or processes in (None, -1):
        return None
    machines = reading.count("num_machines", machines)
    processes = reading.count("num_processes", processes)
    if processes % machines:
        reading.fail("num_processes", f"{processes} processes do not split evenly over {machines} machines")
    return "num_processes / num_machines", processes // machines


def _read_mixed_precision(reading: Reading, value: Any) -> None:
    if value is None:
        reading.assume("half", "none", "accelerate's mixed_precision default is 'no'")
        return
    name = str(value).lower()
    if name in ("bf16", "fp16"):
        reading.set("half", name, "mixed_precision")
    elif name == "no":
        reading.set("half", "none", "mixed_precision")
    elif name == "fp8":
        reading.not_modelled("mixed_precision=fp8", "FP8 GEMMs are not modelled; estimated as bf16")
        reading.set("half", "bf16", "mixed_precision")
    else:
        reading.fail("mixed_precision", f"must be no, fp16, bf16 or fp8, got {value!r}")


def _read_deepspeed_plugin(reading: Reading, plugin: dict[str, Any], mixed: Any) -> None:
    """The plugin's fields as accelerate turns them into a DeepSpeed config (``DeepSpeedPlugin.__post_init__``:
    zero stage, offload devices, gradient accumulation; batch sizes stay "auto": the script's)."""
    if not isinstance(plugin, dict):
        reading.fail("deepspeed_config", f"must be a mapping, got {plugin!r}")
    if plugin.get("deepspeed_config_file"):
        reading.set("deepspeed", _relative(reading, plugin["deepspeed_config_file"]),
                    "deepspeed_config.deepspeed_config_file")
        handled = {"deepspeed_config_file"}
    else:
        handled = {"zero_stage", "offload_optimizer_device", "offload_param_device", "gradient_accumulation_steps"}
        stage = reading.count("deepspeed_config.zero_stage", plugin.get("zero_stage", 2), minimum=0)
        config = {"zero_optimization": {
            "stage": stage,
            "offload_optimizer": {"device": str(plugin.get("offload_optimizer_device") or "none")},
            "offload_param": {"device": str(plugin.get("offload_param_device") or "none")}}}
        if stage != 3:  # accelerate only passes parameter offload at stage 3
            config["zero_optimization"].pop("offload_param")
        if str(mixed).lower() in ("bf16", "fp16"):
            config[str(mixed).lower()] = {"enabled": True}
        steps = plugin.get("gradient_accumulation_steps")
        if steps not in (None, "auto"):
            reading.set("grad_accum_steps", reading.count("deepspeed_config.gradient_accumulation_steps", steps),
                        "deepspeed_config.gradient_accumulation_steps")
        reading.set("deepspeed", config, "deepspeed_config")
    unknown_keys(reading, plugin, handled, DS_PLUGIN_NO_EFFECT, prefix="deepspeed_config.")
