"""A DeepSpeed JSON given with ``--config``: the file itself is read by ``estimator.configs.deepspeed_json`` (stage,
offload, buckets, precision, batch sizes); here only its keys are sorted into used / no effect / not understood
(https://www.deepspeed.ai/docs/config-json/)."""

from __future__ import annotations

from typing import Any

from estimator.configs.reading import Reading, unknown_keys

USED = frozenset({"zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu",
                  "gradient_accumulation_steps", "fp16", "bf16", "bfloat16", "optimizer", "zero_allow_untested_optimizer",
                  "zero_force_ds_cpu_optimizer"})
NO_EFFECT = frozenset({"scheduler", "gradient_clipping", "steps_per_print", "wall_clock_breakdown", "tensorboard",
                       "wandb", "csv_monitor", "comet", "flops_profiler", "comms_logger", "prescale_gradients",
                       "gradient_predivide_factor", "dump_state", "memory_breakdown", "elasticity", "checkpoint",
                       "activation_checkpointing", "aio", "communication_data_type", "seq_parallel_communication_data_type",
                       "data_efficiency", "curriculum_learning", "sparse_gradients", "amp"})
ZERO_USED = frozenset({"stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
                       "reduce_scatter", "stage3_prefetch_bucket_size", "prefetch_bucket_size",
                       "stage3_param_persistence_threshold", "param_persistence_threshold",
                       "stage3_max_live_parameters", "max_live_parameters", "stage3_max_reuse_distance",
                       "max_reuse_distance", "sub_group_size", "offload_optimizer", "offload_param", "cpu_offload",
                       "cpu_offload_param", "cpu_offload_use_pin_memory", "allgather_partitions"})
ZERO_NO_EFFECT = frozenset({"stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                            "stage3_gather_fp16_weights_on_model_save", "round_robin_gradients", "elastic_checkpoint",
                            "ignore_unused_parameters", "load_from_fp32_weights", "legacy_stage1",
                            "use_multi_rank_bucket_allreduce", "memory_efficient_linear", "log_trace_cache_warnings"})
_OPTIMIZERS = {"adam": "adamw", "adamw": "adamw", "sgd": "sgd"}


def read_deepspeed(path: str, data: dict[str, Any]) -> Reading:
    reading = Reading(path, "DeepSpeed config")
    reading.set("deepspeed", path, "(the whole file)")
    reading.set("method", "deepspeed", "zero_optimization")
    optimizer = data.get("optimizer")
    if isinstance(optimizer, dict) and optimizer.get("type"):
        name = str(optimizer["type"]).lower()
        if name in _OPTIMIZERS:
            reading.set("optimizer", _OPTIMIZERS[name], "optimizer.type")
        else:
            reading.not_modelled(f"optimizer.type={optimizer['type']}", "estimated as Adam (2 fp32 states)")
    zero = data.get("zero_optimization")
    if isinstance(zero, dict):
        unknown_keys(reading, zero, set(ZERO_USED), ZERO_NO_EFFECT, prefix="zero_optimization.")
        for key in ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients", "mics_shard_size"):
            if f"zero_optimization.{key}" in reading.unknown and zero.get(key) not in (None, False, 1, -1):
                reading.unknown.remove(f"zero_optimization.{key}")
                reading.not_modelled(f"zero_optimization.{key}", "ZeRO++ / MiCS layouts are not modelled")
    unknown_keys(reading, data, set(USED), NO_EFFECT)
    return reading
