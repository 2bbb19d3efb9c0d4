"""Where measured peaks come from. A reader has ``source`` (the table's ``memory_source``), ``start(model)``,
``reset()`` (peaks count from now), ``read()`` (peaks since the last reset: ``peak_allocated_bytes``,
``peak_reserved_bytes``, ``peak_device_bytes``, ``device_total_bytes``; None where not measured) and ``close()``.

``CudaReader`` reads ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` and the driver's used memory
of this process (NVML's per-process figure when NVML sees our pid, else ``mem_get_info`` total - free, which
also counts other processes on the device). Tests on CPU pass another reader (the harness's counted-cpu
storage counter): the integration never imports the harness.
"""

from __future__ import annotations

import os
from typing import Any, Protocol


class MemoryReader(Protocol):
    source: str

    def start(self, model: Any) -> None: ...

    def reset(self) -> None: ...

    def read(self) -> dict[str, int | None]: ...

    def close(self) -> None: ...


class CudaReader:
    source = "cuda"

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.device = torch.cuda.current_device()
        self._nvml = _nvml_handle(self.device)
        self._device_peak: int | None = None

    def start(self, model: Any) -> None:
        self.reset()

    def reset(self) -> None:
        self.torch.cuda.synchronize(self.device)
        self.torch.cuda.reset_peak_memory_stats(self.device)
        self._device_peak = self._device_used()

    def read(self) -> dict[str, int | None]:
        self.torch.cuda.synchronize(self.device)
        used = self._device_used()
        peak = max(v for v in (used, self._device_peak) if v is not None) if used is not None else None
        return {"peak_allocated_bytes": int(self.torch.cuda.max_memory_allocated(self.device)),
                "peak_reserved_bytes": int(self.torch.cuda.max_memory_reserved(self.device)),
                "peak_device_bytes": peak,
                "device_total_bytes": int(self.torch.cuda.get_device_properties(self.device).total_memory)}

    def _device_used(self) -> int | None:
        if self._nvml is not None:
            try:
                import pynvml

                for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(self._nvml):
                    if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                        return int(proc.usedGpuMemory)
            except Exception:  # noqa: BLE001 - NVML is optional: fall back to mem_get_info
                pass
        free, total = self.torch.cuda.mem_get_info(self.device)
        return int(total - free)

    def close(self) -> None:
        pass


def _nvml_handle(device: int) -> Any | None:
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(device))
    except Exception:  # noqa: BLE001 - no NVML: mem_get_info instead
        return None


def default_reader() -> MemoryReader | None:
    """The CUDA reader on a GPU; None on CPU (nothing to measure without a pluggable reader)."""
    import torch

    return CudaReader() if torch.cuda.is_available() else None
