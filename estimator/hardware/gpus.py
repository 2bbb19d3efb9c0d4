"""GPU catalogue: capacity, bandwidth and peak throughput per GPU key (``catalogue/gpus.json``).

Pure standard library. Keys look like ``h100-80gb``. ``get_gpu`` also takes aliases, case-insensitively
(``H100``, ``h100-sxm-80gb``, ``NVIDIA A100-SXM4-40GB``). A family name that matches more than one board
(``a100``, ``v100``) raises with the choices instead of guessing a capacity.
``normalize_gpu_name`` maps what ``torch.cuda.get_device_name()`` reports, plus the device's total memory,
to a key. An unknown device maps to ``"generic"`` (nanochat's rule: no guessed numbers).
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

GENERIC = "generic"
MIB = 1 << 20
# A measured total may sit a few % under the nvidia-smi total (driver reservation, ECC on GDDR). Beyond
# this relative gap the device is another board (H100 NVL 94 GB, a MIG slice) and maps to "generic".
CAPACITY_TOLERANCE = 0.10

# torch.cuda.get_device_name() patterns, most specific first, matched on the lower-cased name. Each maps to the
# candidate keys of that family; total memory picks among them (else a capacity in the name, else the first).
_DEVICE_PATTERNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"\bh200\b", ("h200-141gb",)),                      # "NVIDIA H200", "NVIDIA H200 NVL"; not GH200
    (r"\bh100\b", ("h100-80gb",)),                       # "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"
    (r"\ba100\b", ("a100-80gb", "a100-40gb")),           # "NVIDIA A100-SXM4-40GB", "NVIDIA A100 80GB PCIe"
    (r"\bv100s?\b", ("v100-32gb", "v100-16gb")),         # "Tesla V100-SXM2-16GB", "Tesla V100S-PCIE-32GB"
    (r"\bl40s\b", ("l40s-48gb",)),                       # "NVIDIA L40S" (plain L40 is another board)
    (r"\ba10g?\b", ("a10-24gb",)),                       # "NVIDIA A10", "NVIDIA A10G"; not A100
    (r"\bl4\b", ("l4-24gb",)),                           # "NVIDIA L4"; not L40/L40S
    (r"\brtx\s*4090\b", ("rtx4090-24gb",)),              # "NVIDIA GeForce RTX 4090", "... RTX 4090 D"
    (r"\brtx\s*3090\b(?!\s*ti\b)", ("rtx3090-24gb",)),   # "NVIDIA GeForce RTX 3090"; not the 3090 Ti
    (r"\bt4\b", ("t4-16gb",)),                           # "Tesla T4"; not T400
)
_AMBIGUOUS = {"a100": ("a100-40gb", "a100-80gb"), "v100": ("v100-16gb", "v100-32gb")}


@dataclass(frozen=True)
class GpuSpec:
    key: str
    name: str
    architecture: str                    # volta | turing | ampere | ada | hopper | unknown
    compute_capability: str | None       # "9.0"
    form_factor: str | None              # sxm | pcie
    memory_type: str | None
    capacity_bytes: int | None           # nvidia-smi total (None for "generic")
    capacity_source: str
    torch_total_bytes: int | None        # one observed torch total_memory (driver-dependent), if known
    memory_bandwidth_bytes_per_s: float | None
    peak_tflops: dict[str, float | None] = field(hash=False)   # dense fp32 / tf32 / bf16 / fp16
    tflops_source: str = ""
    interconnect: str = "pcie"           # nvlink | pcie
    interconnect_bandwidth_bytes_per_s: float | None = None    # per direction
    host_bandwidth_bytes_per_s: float | None = None            # PCIe to host, per direction
    interconnect_source: str = ""
    aliases: tuple[str, ...] = ()

    @property
    def capacity_mib(self) -> float | None:
        return None if self.capacity_bytes is None else self.capacity_bytes / MIB

    @property
    def supports_bf16(self) -> bool:
        return bool(self.peak_tflops.get("bf16"))


def _canonical(name: str) -> str:
    """'NVIDIA GeForce RTX_4090' -> 'rtx-4090': lower case, '-' separators, vendor words dropped."""
    text = re.sub(r"[\s_]+", "-", name.strip().lower())
    for prefix in ("nvidia-", "tesla-", "geforce-"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    return text.replace("geforce-", "")


def _gbs(value: Any) -> float | None:
    return None if value is None else float(value) * 1e9


@functools.lru_cache(maxsize=1)
def _catalogue() -> dict[str, GpuSpec]:
    data = json.loads((resources.files("estimator") / "catalogue" / "gpus.json").read_text())
    gpus: dict[str, GpuSpec] = {}
    for key, row in data["gpus"].items():
        cap, torch_total = row.get("capacity_mib"), row.get("torch_total_mib")
        gpus[key] = GpuSpec(
            key=key, name=row["name"], architecture=row["architecture"],
            compute_capability=row.get("compute_capability"), form_factor=row.get("form_factor"),
            memory_type=row.get("memory_type"),
            capacity_bytes=None if cap is None else int(cap) * MIB,
            capacity_source=row.get("capacity_source", ""),
            torch_total_bytes=None if torch_total is None else int(torch_total) * MIB,
            memory_bandwidth_bytes_per_s=_gbs(row.get("memory_bandwidth_gbs")),
            peak_tflops={k: (None if v is None else float(v)) for k, v in row["peak_tflops"].items()},
            tflops_source=row.get("tflops_source", ""), interconnect=row.get("interconnect", "pcie"),
            interconnect_bandwidth_bytes_per_s=_gbs(row.get("interconnect_bandwidth_gbs")),
            host_bandwidth_bytes_per_s=_gbs(row.get("host_bandwidth_gbs")),
            interconnect_source=row.get("interconnect_source", ""),
            aliases=tuple(row.get("aliases", ())))
    return gpus


@functools.lru_cache(maxsize=1)
def _alias_index() -> dict[str, str]:
    index: dict[str, str] = {}
    for key, spec in _catalogue().items():
        index[key] = key
        for alias in spec.aliases:
            index.setdefault(_canonical(alias), key)
    return index


def list_gpus(include_generic: bool = False) -> list[GpuSpec]:
    """Catalogue entries in file order (``generic`` only when asked)."""
    return [spec for key, spec in _catalogue().items() if include_generic or key != GENERIC]


def get_gpu(key: str) -> GpuSpec:
    """Catalogue entry for a key, an alias or a full device name; ``ValueError("gpu: ...")`` otherwise."""
    if not isinstance(key, str) or not key.strip():
        raise ValueError(f"gpu: must be a GPU key such as h100-80gb, got {key!r}")
    text = _canonical(key)
    index = _alias_index()
    if text in index:
        return _catalogue()[index[text]]
    if text in _AMBIGUOUS:
        raise ValueError(f"gpu: {key!r} is ambiguous; use one of {', '.join(_AMBIGUOUS[text])}")
    family = _family(key.lower())  # a full device name: "NVIDIA H100 80GB HBM3", "Tesla V100-SXM2-16GB"
    if family:
        written = _written_capacity(key.lower(), family)
        if len(family) == 1 or written:
            return _catalogue()[written or family[0]]
        raise ValueError(f"gpu: {key!r} is ambiguous; use one of {', '.join(sorted(family))}")
    known = [k for k in _catalogue() if k != GENERIC]
    close = difflib.get_close_matches(text, list(index), n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(dict.fromkeys(index[c] for c in close))}?)" if close else ""
    raise ValueError(f"gpu: unknown GPU {key!r}{hint}; known: {', '.join(known)}")


def cap_from_fraction(key: str, fraction: float) -> int:
    """The allocator cap ``torch.cuda.set_per_process_memory_fraction(fraction)`` sets on GPU ``key``: CUDA's
    allocator allows ``size_t(fraction x total_memory)`` bytes (torch's total, else the catalogue's capacity)."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"memory_fraction: must be in (0, 1] as set_per_process_memory_fraction takes it, "
                         f"got {fraction!r}")
    gpu = get_gpu(key)
    total = gpu.torch_total_bytes or gpu.capacity_bytes
    if total is None:
        raise ValueError(f"gpu: {gpu.key!r} has no known memory; a fraction needs one (give the cap in GiB)")
    return int(fraction * total)


def normalize_gpu_name(device_name: str, total_memory_bytes: int | None) -> str:
    """Catalogue key for a ``torch.cuda.get_device_name()`` string; ``"generic"`` when nothing fits.

    ``total_memory_bytes`` (``get_device_properties().total_memory``; 0 or None = unknown) picks the board
    of a family (A100 40 vs 80 GB) and rejects a same-named board of another size (H100 NVL 94 GB, MIG slices).
    Without it, a capacity written in the name decides, else the family's first (largest) board.
    """
    name = (device_name or "").lower()
    family = _family(name)
    if not family or re.search(r"\bmig\b", name):  # a MIG slice is not the board
        return GENERIC
    gpus = _catalogue()
    if total_memory_bytes:
        def gap(key: str) -> float:
            capacity = gpus[key].capacity_bytes or 0
            return abs(total_memory_bytes - capacity) / capacity
        best = min(family, key=gap)
        return best if gap(best) <= CAPACITY_TOLERANCE else GENERIC
    return _written_capacity(name, family) or family[0]


def _family(name: str) -> tuple[str, ...]:
    for pattern, candidates in _DEVICE_PATTERNS:
        if re.search(pattern, name):
            return candidates
    return ()


def _written_capacity(name: str, family: tuple[str, ...]) -> str | None:
    """The family member whose capacity the name spells out ("a100-sxm4-40gb" -> a100-40gb)."""
    for size in re.findall(r"(\d+)\s*gb", name):
        for key in family:
            if key.endswith(f"-{size}gb"):
                return key
    return None
