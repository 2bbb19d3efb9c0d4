"""The measurement table's schema: the contract between the harness (writer) and calibrate (reader).

One row per run x rank, units in the column names (``data/README.md`` is the data dictionary). It lives in
the estimator because both sides need it and neither may import the other (docs/DESIGN.md).
Spec columns are the RunSpec fields flattened: ``training.*`` and ``parallel.*`` fields keep their names,
``parallel.zero.X`` becomes ``zero_X``, ``parallel.fsdp1.X`` becomes ``fsdp1_X``, ``schema_version`` becomes
``spec_schema_version``.
Pure standard library.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from estimator.spec import Fsdp1Spec, ParallelSpec, RunSpec, TrainingSpec, ZeroSpec

ID_COLUMNS = ["run_id", "spec_id", "campaign", "gpu_key", "rank", "world_size", "run_status", "rank_status",
              "emulated", "measured_by", "memory_source"]
PP_COLUMNS = ["pp", "pp_schedule", "pp_microbatches", "pp_virtual", "pp_engine"]  # ParallelSpec's pipeline fields
SPEC_COLUMNS = (["model", "gpu", "spec_schema_version", "method", "tp", "dp", "zero_stage", *PP_COLUMNS]
                + [f.name for f in dataclasses.fields(TrainingSpec)]
                + [f"zero_{f.name}" for f in dataclasses.fields(ZeroSpec)]
                + [f"fsdp1_{f.name}" for f in dataclasses.fields(Fsdp1Spec)])
MEASURE_COLUMNS = ["peak_allocated_bytes", "peak_reserved_bytes", "peak_active_bytes", "peak_requested_bytes",
                   "peak_device_bytes", "peak_forward_allocated_bytes", "peak_backward_allocated_bytes",
                   "peak_optimizer_allocated_bytes", "setup_allocated_bytes", "cuda_context_bytes",
                   "cuda_context_after_warmup_bytes", "num_alloc_retries", "num_ooms", "device_total_bytes",
                   "host_peak_rss_bytes", "step_time_s", "tokens_per_s", "num_steps",
                   "seq_len_max", "effective_attn", "oom_step", "oom_phase", "oom_request_bytes"]
RUN_COLUMNS = ["padding", "data_keep", "data_source", "tokenizer", "warmup_steps", "measured_steps",
               "finished_at", "error", "node"]
ENV_COLUMNS = ["gpu_name", "compute_capability", "driver_version", "cuda_version", "torch_version",
               "transformers_version", "deepspeed_version", "alloc_conf", "git_sha", "git_dirty", "hostname"]
# Spec fields added after tables were first written; a table without the column means the field's default.
ADDED_SPEC_FIELDS = ("loop", "batch", "outputs_fp32", "lora_dropout", "grad_sync", "model_code", "use_cache", "ce",
                     "ce_chunks", "activation_offload", "ckpt_policy", "ckpt_reentrant", "vocab_size",
                     "full_range_slices", "lora_dtype", "qlora_prep", "qlora_quantizer", "qlora_bnb", "memory_cap_bytes",
                     "zero_leaf_classes", "zero_leaf_names", "zero_leaf_name_suffixes", *PP_COLUMNS,
                     *(f"fsdp1_{f.name}" for f in dataclasses.fields(Fsdp1Spec)))
COLUMNS = ID_COLUMNS + SPEC_COLUMNS + MEASURE_COLUMNS + RUN_COLUMNS + ENV_COLUMNS
# Columns spec_from_columns reads (``world_size`` is an identity column; ``dp``/``zero_stage`` are derived).
SPEC_INPUT_COLUMNS = ["model", "gpu", "method", "world_size", "tp"] + [
    c for c in SPEC_COLUMNS if c not in ("model", "gpu", "spec_schema_version", "method", "tp", "dp", "zero_stage",
                                         *PP_COLUMNS)] + PP_COLUMNS


def spec_columns(spec: RunSpec) -> dict[str, Any]:
    row: dict[str, Any] = {"model": spec.model, "gpu": spec.gpu, "spec_schema_version": spec.schema_version,
                           "method": spec.parallel.method, "tp": spec.parallel.tp, "dp": spec.parallel.dp,
                           "zero_stage": spec.parallel.zero_stage,
                           **{name: getattr(spec.parallel, name) for name in PP_COLUMNS}}
    row.update(dataclasses.asdict(spec.training))
    # the allocator cap's cell was a measurement column before it was a spec field: empty = none, as before
    row["memory_cap_bytes"] = spec.training.memory_cap_bytes or None
    # ZeRO-3's leaf module lists as JSON lists: a cleared list ("[]") is not an empty cell (the default)
    row.update({f"zero_{k}": json.dumps(list(v)) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(spec.parallel.zero).items()})
    row.update({f"fsdp1_{k}": v for k, v in dataclasses.asdict(spec.parallel.fsdp1).items()})
    return row


def spec_from_columns(row: dict[str, Any]) -> RunSpec:
    """Inverse of spec_columns, for rows read back as strings (``csv.DictReader``) or as pandas values
    (numpy scalars, NaN for empty cells, floats for integer columns that have a gap)."""
    def typed(cls: type, prefix: str) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(cls):
            default = getattr(cls(), f.name)
            value = parse_cell(row.get(prefix + f.name), default)
            if value is None and (f.name in ADDED_SPEC_FIELDS or prefix + f.name in ADDED_SPEC_FIELDS
                                  or isinstance(default, tuple)):
                continue  # a table written before the field existed: the harness ran the default
            out[f.name] = value
        return out
    zero = ZeroSpec(**typed(ZeroSpec, "zero_"))
    defaults = ParallelSpec()
    pipeline = {name: value for name in PP_COLUMNS  # empty in tables written before pipelining: no pipeline
                if (value := parse_cell(row.get(name), getattr(defaults, name))) is not None}
    parallel = ParallelSpec(method=str(row["method"]), world_size=_int(row["world_size"]), tp=_int(row["tp"]),
                            zero=zero, fsdp1=Fsdp1Spec(**typed(Fsdp1Spec, "fsdp1_")), **pipeline)
    return RunSpec(model=str(row["model"]), gpu=str(row["gpu"]), parallel=parallel,
                   training=TrainingSpec(**typed(TrainingSpec, "")))


def measured_spec_from_columns(row: dict[str, Any]) -> RunSpec:
    """The spec a measured row ran, model code included. The harness leaves ``model_code`` empty (the installed
    transformers ran) and records that release in ``transformers_version``; where it is not the release installed
    here, the estimate must trace that release's model code (CodeGen, for one, took eager attention before 5.24
    and SDPA since), so the row's spec names it."""
    spec = spec_from_columns(row)
    ran = parse_cell(row.get("transformers_version"), "")
    if spec.training.model_code or not ran:
        return spec
    from estimator.models.profiles import installed_version
    from estimator.spec import model_code_release

    installed = installed_version("transformers")
    if installed and model_code_release(str(ran)) == model_code_release(installed):
        return spec
    return dataclasses.replace(spec, training=dataclasses.replace(spec.training, model_code=str(ran)))


def _int(value: Any) -> int:
    value = parse_cell(value, 0)
    if value is None:
        raise ValueError("is empty")
    return int(value)


def parse_cell(value: Any, default: Any) -> Any:
    """One table cell as the Python type of the spec field whose default is ``default``; empty -> None."""
    if hasattr(value, "item") and not isinstance(value, str):
        value = value.item()  # numpy scalar -> Python scalar
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, str):
        if value == "" or (value == "None" and not isinstance(default, str)):  # str(None): an empty cell
            return None
        if isinstance(default, bool) or value in ("True", "False"):
            return value == "True"
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
        if isinstance(default, tuple):  # a JSON list (spec_columns)
            return tuple(json.loads(value))
        return value
    if isinstance(default, bool) and not isinstance(value, bool) and value in (0, 1):
        return bool(value)
    # pandas reads an integer column with an empty cell as float: 4.0 -> 4
    if isinstance(default, int) and not isinstance(default, bool) and isinstance(value, float) \
            and value.is_integer():
        return int(value)
    return value
