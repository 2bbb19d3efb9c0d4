"""The allocator cap's flags (``TrainingSpec.memory_cap_bytes``), shared by ``python -m estimator`` and ``python -m
estimator plan``, and the cap a harness run applied (``--from-run``)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

GIB = 1024**3


def add_cap_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-fraction", type=float, default=None, metavar="F",
                   help="the run caps PyTorch's caching allocator with torch.cuda.set_per_process_memory_fraction(F) "
                        "(0 < F <= 1 of the GPU's memory as torch counts it): past the cap the allocator releases its "
                        "cached blocks and retries, then runs out of memory; the output reports the retries")
    p.add_argument("--memory-cap-gib", type=float, default=None, metavar="GIB",
                   help="the same cap in GiB (the harness's memory.cap_gib: e.g. 16 for a 16 GB V100 emulated on a "
                        "larger GPU)")


def cap_bytes_from_args(args: argparse.Namespace, gpu_key: str) -> int | None:
    """The cap the flags give on GPU ``gpu_key`` in bytes, None without one. ValueError (one line) for a bad value
    or both flags."""
    fraction, gib = getattr(args, "memory_fraction", None), getattr(args, "memory_cap_gib", None)
    if fraction is not None and gib is not None:
        raise ValueError("memory_cap: give --memory-fraction or --memory-cap-gib, not both")
    if gib is not None:
        if not math.isfinite(gib) or gib <= 0:
            raise ValueError(f"memory_cap_gib: must be a positive number of GiB, got {gib:g}")
        return int(gib * GIB)
    if fraction is not None:
        from estimator.hardware.gpus import cap_from_fraction

        return cap_from_fraction(gpu_key, fraction)
    return None


def run_cap_bytes(run_dir: Path, gpu_key: str) -> int | None:
    """The allocator cap a harness run applied: its rank records' ``memory_cap_bytes`` (what the worker set), else
    its options' ``memory.cap_gib`` / ``memory.cap_fraction`` (a run whose ranks never wrote); None: uncapped."""
    for path in sorted(run_dir.glob("rank*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if record.get("memory_cap_bytes"):
            return int(record["memory_cap_bytes"])
    try:
        memory = json.loads((run_dir / "harness.json").read_text()).get("memory") or {}
    except (OSError, json.JSONDecodeError):
        return None
    if memory.get("cap_gib"):
        return int(float(memory["cap_gib"]) * GIB)
    if memory.get("cap_fraction"):
        from estimator.hardware.gpus import cap_from_fraction

        return cap_from_fraction(gpu_key, float(memory["cap_fraction"]))
    return None
