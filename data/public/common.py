"""The published-measurement table's columns and the helpers every extractor shares.

A row is one published measurement: where it was published, the run's spec in the estimator's own columns
(``estimator.columns.SPEC_INPUT_COLUMNS``, so ``spec_from_columns`` rebuilds the RunSpec), what was measured and
in which unit, and how complete the source is. ``README.md`` next to this file is the data dictionary.
Standard library only (the extractors run without the project installed).
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "sources"

# Mirrors estimator.columns.SPEC_INPUT_COLUMNS (tests/calibrate/test_public.py checks they agree).
SPEC = ["model", "gpu", "method", "world_size", "tp", "micro_batch_size", "seq_len", "precision", "optimizer",
        "grad_ckpt", "attn", "lora_rank", "lora_targets", "lora_dropout", "lora_dtype", "qlora", "qlora_prep", "qlora_quantizer", "qlora_bnb",
        "grad_accum_steps",
        "loop",
        "batch", "outputs_fp32", "grad_sync", "model_code", "use_cache", "ce", "ce_chunks", "activation_offload",
        "ckpt_policy", "ckpt_reentrant", "vocab_size", "full_range_slices", "memory_cap_bytes", "zero_reduce_bucket_size", "zero_allgather_bucket_size", "zero_overlap_comm",
        "zero_contiguous_gradients",
        "zero_reduce_scatter", "zero_stage3_prefetch_bucket_size", "zero_stage3_param_persistence_threshold",
        "zero_stage3_max_live_parameters", "zero_stage3_max_reuse_distance", "zero_sub_group_size",
        "zero_offload_optimizer", "zero_offload_param", "zero_pin_memory", "zero_leaf_classes", "zero_leaf_names",
        "zero_leaf_name_suffixes", "fsdp1_sharding_strategy",
        "fsdp1_use_orig_params", "fsdp1_cpu_offload", "fsdp1_backward_prefetch", "fsdp1_forward_prefetch",
        "fsdp1_limit_all_gathers", "fsdp1_gpus_per_node", "fsdp1_lora_wrap", "pp", "pp_schedule", "pp_microbatches", "pp_virtual",
        "pp_engine"]
# no published row pipelines: torch's defaults with pp 1
PP_DEFAULTS = {"pp": 1, "pp_schedule": "1f1b", "pp_microbatches": 0, "pp_virtual": 0, "pp_engine": "torch"}
ZERO_DEFAULTS = {"zero_reduce_bucket_size": 500_000_000, "zero_allgather_bucket_size": 500_000_000,
                 "zero_overlap_comm": "", "zero_contiguous_gradients": True, "zero_reduce_scatter": True,
                 "zero_stage3_prefetch_bucket_size": 50_000_000, "zero_stage3_param_persistence_threshold": 100_000,
                 "zero_stage3_max_live_parameters": 1_000_000_000, "zero_stage3_max_reuse_distance": 1_000_000_000,
                 "zero_sub_group_size": 1_000_000_000, "zero_offload_optimizer": False, "zero_offload_param": False,
                 "zero_pin_memory": False,
                 # DeepSpeed 0.19.8's leaf_module default (estimator.spec.DEFAULT_LEAF_MODULE_CLASSES), as JSON lists
                 "zero_leaf_classes": json.dumps([
                     "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                     "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                     "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"]),
                 "zero_leaf_names": "[]", "zero_leaf_name_suffixes": "[]"}
# torch's FSDP1 defaults (use_orig_params as accelerate sets it); the rows' FSDP runs are FSDP1 where their
# extractor says so.
FSDP1_DEFAULTS = {"fsdp1_sharding_strategy": "FULL_SHARD", "fsdp1_use_orig_params": True, "fsdp1_cpu_offload": False,
                  "fsdp1_backward_prefetch": "BACKWARD_PRE", "fsdp1_forward_prefetch": False,
                  "fsdp1_limit_all_gathers": True, "fsdp1_gpus_per_node": 8, "fsdp1_lora_wrap": "adapter"}
IDENTITY = ["row_id", "source", "source_ref", "source_table", "source_key"]
CONTEXT = ["model_hub_id", "framework", "adapter", "padding", "max_length", "seq_len_basis", "lengths",
           "rescore_lengths"]
VERSIONS = ["torch_version", "transformers_version", "peft_version", "deepspeed_version", "bitsandbytes_version",
            "other_versions"]
MEASURE = ["quantity", "scope", "value", "unit", "value_offset_bytes", "value_bytes"]
STATUS = ["complete", "in_scope", "missing", "assumptions"]
COLUMNS = IDENTITY + SPEC + CONTEXT + VERSIONS + MEASURE + STATUS

QUANTITIES = ("max_allocated", "max_reserved", "peak_active", "nvml_used", "unknown")
SCOPES = ("per_gpu", "sum")
UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "MB": 10**6, "GB": 10**9}
LOOPS = ("trainer", "manual", "unknown")
PADDINGS = ("longest", "max_length", "packed", "")


def row(**fields) -> dict:
    """A complete row: defaults for the ZeRO/TP columns, the value in bytes, every column present."""
    out = {c: "" for c in COLUMNS}
    out.update({"tp": 1, "grad_accum_steps": 1, "qlora": False, "lora_rank": 0, "lora_targets": "auto",
                "lora_dropout": 0.0, "lora_dtype": "auto", "qlora_prep": "auto", "qlora_quantizer": "transformers", "outputs_fp32": False, "grad_sync": "every", "use_cache": False,
                "ckpt_reentrant": False, "vocab_size": 0, "memory_cap_bytes": 0, "value_offset_bytes": 0, "complete": True, "in_scope": True,
                **ZERO_DEFAULTS, **FSDP1_DEFAULTS, **PP_DEFAULTS})
    unknown = set(fields) - set(COLUMNS)
    if unknown:
        raise KeyError(f"unknown columns {sorted(unknown)}")
    out.update(fields)
    if not out["model_code"]:  # the model code the run executed is its transformers release's
        out["model_code"] = out["transformers_version"]
    if out["qlora"] is True and not out["qlora_bnb"]:  # the 4-bit matmul the run executed is its release's
        out["qlora_bnb"] = out["bitsandbytes_version"]
    if out["full_range_slices"] == "":
        out["full_range_slices"] = records_full_range_slices(out["torch_version"])
    if out["quantity"] not in QUANTITIES or out["scope"] not in SCOPES or out["loop"] not in LOOPS:
        raise ValueError(f"{out['row_id']}: bad quantity/scope/loop {out['quantity']}/{out['scope']}/{out['loop']}")
    if out["padding"] not in PADDINGS:
        raise ValueError(f"{out['row_id']}: bad padding {out['padding']!r}")
    if out["value"] != "":
        out["value_bytes"] = int(round(float(out["value"]) * UNITS[out["unit"]])) + int(out["value_offset_bytes"])
    if not out["complete"] and not out["missing"]:
        raise ValueError(f"{out['row_id']}: an incomplete row must say what is missing")
    return out


def records_full_range_slices(torch_version: str) -> bool:
    """Whether a torch release records a ``SliceBackward`` for a full-range ``:`` (``TrainingSpec.full_range_slices``):
    2.4 and before (checked on 2.4.1; 2.11 and 2.13 elide it; the releases between are not checked: false)."""
    parts = re.match(r"(\d+)\.(\d+)", torch_version or "")
    return bool(parts) and (int(parts[1]), int(parts[2])) <= (2, 4)


def manifest(source: str) -> dict[str, dict]:
    """``sources/<source>/MANIFEST.json`` as {local file: entry}; each file's sha256 is checked."""
    root = SOURCES / source
    entries = json.loads((root / "MANIFEST.json").read_text())["files"]
    for entry in entries:
        digest = hashlib.sha256((root / entry["file"]).read_bytes()).hexdigest()
        if digest != entry["sha256"]:
            raise ValueError(f"{source}/{entry['file']}: sha256 differs from MANIFEST.json (edited copy?)")
    return {e["file"]: e for e in entries}


def ref(entry: dict) -> str:
    return f"{entry['repo']}@{entry['commit']}:{entry['path']}"


def markdown_tables(text: str) -> list[tuple[str, list[dict]]]:
    """Every pipe table in a markdown text as (nearest heading above it, rows as {header: cell})."""
    tables, heading, lines = [], "", text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.startswith("|") and i + 1 < len(lines) and set(lines[i + 1].strip()) <= set("|-: "):
            header = [c.strip() for c in line.strip("|").split("|")]
            body = []
            i += 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
                if any(cells):
                    body.append(dict(zip(header, cells)))
                i += 1
            tables.append((heading, body))
            continue
        i += 1
    return tables


def write_csv(rows: list[dict], path: Path) -> None:
    rows = sorted(rows, key=lambda r: r["row_id"])
    ids = [r["row_id"] for r in rows]
    if len(ids) != len(set(ids)):
        raise ValueError("duplicate row_id")
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
