"""Per-GPU residual coefficients (``coefficients/<gpu-key>.json``): allocator slack, CUDA context, cuBLAS, NCCL.

Pure standard library; the JSON is applied with plain arithmetic:

    allocated += cublas_workspace_bytes(coeffs)                       (workspaces come from the allocator)
    reserved   = reserved_from_allocated(allocated, coeffs)           allocated x (1 + ratio) + bytes
    device     = device_from_reserved(reserved, coeffs, n_comms)      + CUDA context + NCCL x communicators

A file with ``"calibrated": false`` holds documented priors (each term's source is in its ``notes``). A fitted
file (``python -m calibrate fit``) has ``"calibrated": true``, ``"source": "fit"``, the fit's provenance, and a
``valid_range``: ``range_notes`` says when a spec lies outside what the fit saw.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
# valid_range keys: numeric [min, max] spans, and lists of the categorical values a fit saw.
RANGE_SPANS = ("params", "world_size", "micro_batch_size", "seq_len", "lora_rank")
RANGE_SETS = ("methods", "precisions", "optimizers", "attn", "model_families")
# term -> (integer-valued?, minimum)
REQUIRED_TERMS: dict[str, tuple[bool, float]] = {
    "cuda_context_bytes": (True, 0),
    "cublas_workspace_bytes": (True, 0),
    "cublas_workspaces": (True, 0),
    "reserved_slack_ratio": (False, 0),
    "reserved_slack_bytes": (True, 0),
    "nccl_bytes_per_communicator": (True, 0),
    "upper_bound_ratio": (False, 1),
}


@dataclass(frozen=True)
class Coefficients:
    gpu_key: str
    calibrated: bool
    source: str
    description: str
    cuda_context_bytes: int
    cublas_workspace_bytes: int
    cublas_workspaces: int
    reserved_slack_ratio: float
    reserved_slack_bytes: int
    nccl_bytes_per_communicator: int
    upper_bound_ratio: float
    path: str = ""
    # Further terms a calibrated file may carry, and the documentation blocks, kept as read.
    extra_terms: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    notes: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    valid_range: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    provenance: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


def _fail(where: str, key: str, message: str) -> None:
    raise ValueError(f"coefficients: {where}: {key!r} {message}")


def parse_coefficients(data: Any, where: str) -> Coefficients:
    """Validate a decoded coefficient file; ``where`` names it in the one-line ``ValueError``."""
    if not isinstance(data, dict):
        raise ValueError(f"coefficients: {where}: must hold a JSON object")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        _fail(where, "schema_version", f"is {version!r}; this build reads {SCHEMA_VERSION}")
    for key, kind in (("gpu_key", str), ("calibrated", bool)):
        if not isinstance(data.get(key), kind):
            _fail(where, key, f"must be a {kind.__name__}, got {data.get(key)!r}")
    terms = data.get("terms")
    if not isinstance(terms, dict):
        _fail(where, "terms", "must be an object of named numbers")
    values: dict[str, Any] = {}
    for name, (integer, minimum) in REQUIRED_TERMS.items():
        if name not in terms:
            _fail(where, f"terms.{name}", "is missing")
        value = terms[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            _fail(where, f"terms.{name}", f"must be a number, got {value!r}")
        if value < minimum:
            _fail(where, f"terms.{name}", f"must be >= {minimum}, got {value!r}")
        if integer and value != int(value):
            _fail(where, f"terms.{name}", f"must be a whole number, got {value!r}")
        values[name] = int(value) if integer else float(value)
    blocks = {}
    for key in ("notes", "valid_range", "provenance"):
        block = data.get(key, {})
        if not isinstance(block, dict):
            _fail(where, key, "must be an object")
        blocks[key] = block
    _check_valid_range(blocks["valid_range"], where)
    return Coefficients(
        gpu_key=data["gpu_key"], calibrated=data["calibrated"], source=str(data.get("source", "")),
        description=str(data.get("description", "")), path=where,
        extra_terms={k: v for k, v in terms.items() if k not in REQUIRED_TERMS}, **values, **blocks)


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _check_valid_range(block: dict[str, Any], where: str) -> None:
    for key in RANGE_SPANS:
        span = block.get(key)
        if span is not None and not (isinstance(span, list) and len(span) == 2 and all(map(_is_number, span))
                                     and span[0] <= span[1]):
            _fail(where, f"valid_range.{key}", f"must be [min, max], got {span!r}")
    for key in RANGE_SETS:
        values = block.get(key)
        if values is not None and not (isinstance(values, list) and all(isinstance(v, str) for v in values)):
            _fail(where, f"valid_range.{key}", f"must be a list of names, got {values!r}")


def _read(path: Path | Any, where: str) -> Coefficients:
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise ValueError(f"coefficients: cannot read {where} ({err.__class__.__name__})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"coefficients: {where} is not valid JSON ({err.__class__.__name__})") from None
    return parse_coefficients(data, where)


@functools.lru_cache(maxsize=64)
def _packaged(key: str) -> Coefficients:
    resource = resources.files("estimator") / "coefficients" / f"{key}.json"
    where = f"coefficients/{key}.json"
    if not resource.is_file():
        raise ValueError(f"coefficients: no {where} shipped for GPU {key!r}; pass a file path")
    coeffs = _read(resource, where)
    if coeffs.gpu_key != key:
        _fail(where, "gpu_key", f"is {coeffs.gpu_key!r}, expected {key!r}")
    return coeffs


def load_coefficients(gpu_key: str, path: str | Path | None = None) -> Coefficients:
    """The shipped coefficients of a GPU (key or alias; ``"generic"`` for an unknown device), or ``path``'s.

    A user file (``path``) overrides the shipped one whatever GPU it names; it is validated the same way.
    """
    if path is not None:
        return _read(Path(path).expanduser(), str(path))
    from estimator.hardware.gpus import get_gpu  # key or alias -> catalogue key ("gpu: ..." error if unknown)

    return _packaged(get_gpu(gpu_key).key)


def cublas_workspace_bytes(coeffs: Coefficients) -> int:
    """Allocator bytes held by cuBLAS workspaces (one per handle and stream; forward + backward threads)."""
    return coeffs.cublas_workspace_bytes * coeffs.cublas_workspaces


def reserved_from_allocated(allocated_bytes: int, coeffs: Coefficients) -> int:
    """Caching-allocator reserved bytes at an allocated peak: ``allocated x (1 + ratio) + slack bytes``."""
    if allocated_bytes < 0:
        raise ValueError(f"allocated_bytes: must be >= 0, got {allocated_bytes!r}")
    return math.ceil(allocated_bytes * (1.0 + coeffs.reserved_slack_ratio)) + coeffs.reserved_slack_bytes


def device_from_reserved(reserved_bytes: int, coeffs: Coefficients, num_communicators: int) -> int:
    """Device (nvidia-smi) bytes: reserved + CUDA context + NCCL buffers of each communicator."""
    if reserved_bytes < 0:
        raise ValueError(f"reserved_bytes: must be >= 0, got {reserved_bytes!r}")
    if isinstance(num_communicators, bool) or not isinstance(num_communicators, int) or num_communicators < 0:
        raise ValueError(f"num_communicators: must be a non-negative integer, got {num_communicators!r}")
    return reserved_bytes + coeffs.cuda_context_bytes + num_communicators * coeffs.nccl_bytes_per_communicator


def upper_bound_bytes(device_bytes: int, coeffs: Coefficients) -> int:
    """Upper end of the device estimate's range: ``device x upper_bound_ratio``."""
    return math.ceil(device_bytes * coeffs.upper_bound_ratio)


def reserved_fit_limit_bytes(capacity_bytes: int, coeffs: Coefficients, num_communicators: int) -> int:
    """The largest reserved peak whose upper bound still fits ``capacity_bytes`` (-1 if none does): a reserved
    level above it decides that a run does not fit, whatever else it reserves."""
    def fits(reserved: int) -> bool:
        return upper_bound_bytes(device_from_reserved(reserved, coeffs, num_communicators), coeffs) <= capacity_bytes

    if not fits(0):
        return -1
    lo, hi = 0, max(int(capacity_bytes), 1)
    while fits(hi):  # a bound ratio below 1
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # fits(lo), not fits(hi): the bound rises with the reserved level
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def provenance_notes(coeffs: Coefficients) -> list[str]:
    """"calibrated on published measurements (N rows, sources ...)" for a file ``calibrate public --fit`` wrote."""
    block = coeffs.provenance
    if not coeffs.calibrated or block.get("kind") != "published measurements":
        return []
    fitted = ", ".join(k for k in ("reserved_slack_ratio", "reserved_slack_bytes", "cuda_context_bytes")
                       if k in coeffs.notes and "Fitted" in str(coeffs.notes[k]))
    return [f"{coeffs.gpu_key}: calibrated on published measurements ({block.get('rows')} rows, sources "
            f"{', '.join(block.get('sources', []))}; fitted: {fitted or 'none'}; the other terms are priors)"]


def range_notes(coeffs: Coefficients, spec: Any, *, gpu_key: str | None = None, params: int | None = None,
                model_family: str | None = None) -> list[str]:
    """Notes for ``Estimate.notes``: coefficients fitted for another GPU, or a spec outside the fitted file's
    ``valid_range`` (the residual terms are then extrapolated). ``spec`` is a RunSpec; ``params`` the model's
    parameter count and ``model_family`` its config's model_type, when known. Priors (no range) add nothing."""
    notes = []
    name = coeffs.path or f"coefficients/{coeffs.gpu_key}.json"
    if gpu_key is not None and coeffs.gpu_key != gpu_key:
        notes.append(f"coefficients: {name} describes {coeffs.gpu_key!r}, applied to {gpu_key!r}")
    block = coeffs.valid_range
    if not block:
        return notes
    values = {"params": params, "world_size": spec.parallel.world_size,
              "micro_batch_size": spec.training.micro_batch_size, "seq_len": spec.training.seq_len,
              "lora_rank": spec.training.lora_rank, "methods": spec.parallel.method,
              "precisions": spec.training.precision, "optimizers": spec.training.optimizer,
              "attn": spec.training.attn, "model_families": model_family}
    outside = []
    for key in RANGE_SPANS:
        span, value = block.get(key), values[key]
        if span is not None and value is not None and not span[0] <= value <= span[1]:
            outside.append(f"{key} {value:,} not in {span[0]:,}..{span[1]:,}")
    for key in RANGE_SETS:
        seen, value = block.get(key), values[key]
        if seen and value is not None and value not in seen:
            outside.append(f"{key} {value!r} not in {', '.join(seen)}")
    if outside:
        notes.append(f"{coeffs.gpu_key}: spec outside the calibrated range of {name} ({'; '.join(outside)}); "
                     "the residual terms are extrapolated")
    return notes
