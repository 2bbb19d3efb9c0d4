"""A TorchDispatchMode that counts live tensor storages, by category, with phase and step peaks.

The same mechanism as ``torch.distributed._tools.mem_tracker.MemTracker`` (weak references with finalizers on
untyped storages, a patched ``UntypedStorage.resize_`` for FSDP2's storage resizing, DTensor ops seen only
after they desugar to local ops), with what the oracle needs on top:

* each storage is counted as the CUDA caching allocator counts a block: ``nbytes`` rounded up to a multiple
  of ``round_to`` (512 on CUDA; 1 gives MemTracker's CPU numbers);
* a category per storage, set at allocation from the current phase / context tag and re-set when the
  storage is known to play a role (``retag``): Parameter, Buffer, Gradient, Optstate, ... (see ``CATEGORIES``);
* peaks per phase (``forward``/``backward``/``optimizer``) and per step, with the category breakdown copied
  at the moment of the step peak.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch._guards import active_fake_mode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

CATEGORIES = (
    "Parameter",        # model parameters as held on this rank (FSDP: the sharded param; TP: the local shard)
    "Buffer",           # module buffers (rotary tables, causal-mask buffers, ...)
    "Gradient",         # .grad of the parameters the optimizer steps (FSDP: sharded grads; mixed_*: fp32 masters')
    "Optstate",         # optimizer state tensors (AdamW exp_avg / exp_avg_sq / step)
    "Master Param",     # fp32 master weights of mixed_* precision (MasterWeightOptimizer)
    "Activation",       # created in forward and not claimed otherwise (saved activations, logits, loss)
    "Temp",             # created in backward, not a gradient (activation grads, grad-ckpt recompute, FSDP
                        # unsharded grads before their reduce-scatter)
    "Optimizer Temp",   # created inside optimizer.step()/zero_grad() and not state (foreach intermediates)
    "Unsharded Param",  # FSDP2 all-gathered (unsharded) parameters
    "All Gather",       # FSDP2 all-gather flat buffers (copy-in input and flat output)
    "Reduce Scatter",   # FSDP2 reduce-scatter flat input (the output becomes the sharded grads)
    "DDP Bucket",       # DDP reducer gradient buckets
    "Inputs",           # the batch (input_ids, attention_mask, labels)
    "Other",            # anything allocated during setup and not claimed
)
# How these categories map onto torch's MemTracker (FSDPMemTracker) reference types, for comparisons.
MEMTRACKER_CATEGORY = {
    "Parameter": "Parameter (Sharded Param)", "Buffer": "Buffer", "Gradient": "Gradient (Sharded Grad)",
    "Optstate": "Optstate", "Optimizer Temp": "Optstate", "Master Param": "Optstate",
    "Activation": "Activation", "Temp": "Temp (incl. Unsharded Grad)", "Unsharded Param": "Unsharded Param",
    "All Gather": "All Gather", "Reduce Scatter": "Reduce Scatter", "DDP Bucket": "Temp / Other",
    "Inputs": "Other (Inputs)", "Other": "Other",
}
_PHASE_DEFAULT = {"setup": "Other", "forward": "Activation", "backward": "Temp", "optimizer": "Optimizer Temp"}
STEP_PHASES = ("forward", "backward", "optimizer")


class _Rec:
    __slots__ = ("nbytes", "cat", "ref")

    def __init__(self, nbytes: int, cat: str) -> None:
        self.nbytes = nbytes
        self.cat = cat
        self.ref: weakref.ref | None = None


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    if is_traceable_wrapper_subclass(t):  # DTensor & co: the storages of their inner tensors
        from torch.distributed._tools.common_utils import get_untyped_storages

        return list(get_untyped_storages(t))
    return [t.untyped_storage()]


class StorageCounter(TorchDispatchMode):
    """Counts live storages created while it is active. Use inside FakeTensorMode (or on real tensors)."""

    def __init__(self, round_to: int = 512) -> None:
        super().__init__()
        self.round_to = max(1, int(round_to))
        self._recs: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.current = 0
        self.by_cat: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.phase = "setup"
        self._tags: list[str] = []
        self.max_total = 0                     # over the whole life of the counter (setup included)
        self.phase_peaks: dict[str, int] = {}
        self.step_peak = 0
        self.step_peak_breakdown: dict[str, int] = {}
        self.step_peak_phase = ""
        self._fake_mode_on_entry = None
        self._orig_resize = None
        self._depth = 0
        self._paused = 0

    # ---- accounting -------------------------------------------------------------------------------------
    def _round(self, nbytes: int) -> int:
        r = self.round_to
        return -(-nbytes // r) * r if nbytes > 0 else 0

    def _category(self) -> str:
        return self._tags[-1] if self._tags else _PHASE_DEFAULT.get(self.phase, "Other")

    def _grow(self, delta: int, cat: str) -> None:
        self.current += delta
        self.by_cat[cat] += delta
        if delta <= 0:
            return
        cur = self.current
        if cur > self.max_total:
            self.max_total = cur
        if cur > self.phase_peaks.get(self.phase, 0):
            self.phase_peaks[self.phase] = cur
        if cur > self.step_peak:
            self.step_peak = cur
            self.step_peak_breakdown = dict(self.by_cat)
            self.step_peak_phase = self.phase

    def _on_free(self, rec: _Rec, _ref: Any = None) -> None:
        if rec.nbytes:
            self.current -= rec.nbytes
            self.by_cat[rec.cat] -= rec.nbytes
            rec.nbytes = 0

    def _track_storage(self, st: torch.UntypedStorage, cat: str) -> _Rec:
        rec = self._recs.get(st)
        if rec is None:
            rec = _Rec(self._round(st.nbytes()), cat)
            rec.ref = weakref.ref(st, lambda ref, rec=rec: self._on_free(rec))
            self._recs[st] = rec
            self._grow(rec.nbytes, cat)
        else:
            self._resync(st, rec)
        return rec

    def _resync(self, st: torch.UntypedStorage, rec: _Rec) -> None:
        nbytes = self._round(st.nbytes())
        if nbytes != rec.nbytes:
            delta, rec.nbytes = nbytes - rec.nbytes, nbytes
            self._grow(delta, rec.cat)

    def retag(self, tensors: Any, cat: str) -> None:
        """Count the storages of ``tensors`` (a tensor or a pytree of them) under ``cat`` from now on.
        Storages not seen before (created before the counter started) are added."""
        for t in tree_leaves(tensors):
            if not isinstance(t, torch.Tensor):
                continue
            for st in _storages(t):
                rec = self._recs.get(st)
                if rec is None:
                    self._track_storage(st, cat)
                elif rec.cat != cat:
                    self.by_cat[rec.cat] -= rec.nbytes
                    self.by_cat[cat] += rec.nbytes
                    rec.cat = cat

    # ---- phases and steps -------------------------------------------------------------------------------
    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), self.current)
        if self.current > self.step_peak:
            self.step_peak = self.current
            self.step_peak_breakdown = dict(self.by_cat)
            self.step_peak_phase = phase

    def begin_step(self) -> None:
        self.phase_peaks = {}
        self.step_peak = 0
        self.step_peak_breakdown = {}
        self.step_peak_phase = ""

    def end_step(self) -> dict[str, Any]:
        peaks = {p: int(self.phase_peaks.get(p, 0)) for p in STEP_PHASES}
        peaks["peak"] = int(self.step_peak)
        return {"peaks": peaks, "breakdown": {k: int(v) for k, v in self.step_peak_breakdown.items() if v},
                "phase": self.step_peak_phase}

    @contextlib.contextmanager
    def tagged(self, cat: str) -> Iterator[None]:
        """Storages created inside are counted under ``cat``."""
        self._tags.append(cat)
        try:
            yield
        finally:
            self._tags.pop()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Storages created inside are not counted (metadata-only computations on fake tensors)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def snapshot(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.by_cat.items() if v}

    # ---- dispatch ---------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor or issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into local ops, which we see
        if func is torch.ops._c10d_functional.wait_tensor.default and active_fake_mode() is not None:
            res = args[0]  # the fake impl of wait_tensor returns a new tensor; eager returns its input
        else:
            res = func(*args, **(kwargs or {}))
        if not self._paused and active_fake_mode() is self._fake_mode_on_entry:  # skip DTensor sharding-propagation fake ops
            cat = self._category()
            for t in tree_leaves(res):
                # Meta tensors (shape-only copies DeepSpeed keeps of its params) use no memory; fake tensors
                # report the device they fake, so they are still counted.
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    for st in _storages(t):
                        self._track_storage(st, cat)
        return res

    def _patch_resize(self) -> None:
        self._orig_resize = orig = torch.UntypedStorage.resize_
        counter = self

        def resize_(st: torch.UntypedStorage, size: int):
            out = orig(st, size)
            rec = counter._recs.get(st)
            if rec is not None:
                counter._resync(st, rec)
            return out

        torch.UntypedStorage.resize_ = resize_

    def __enter__(self) -> StorageCounter:
        if self._depth == 0:
            self._fake_mode_on_entry = active_fake_mode()
            self._patch_resize()
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth == 0 and self._orig_resize is not None:
            torch.UntypedStorage.resize_ = self._orig_resize
            self._orig_resize = None
        return super().__exit__(*exc)
