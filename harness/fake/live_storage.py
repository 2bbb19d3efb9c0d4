"""A third measurement, for where the two fake-tensor oracles disagree: the MemTracker oracle's own program
(``harness.fake.memtracker.build(..., fake=False)``) on real CPU tensors, with the size of every live storage
summed after every operator.

It shares no accounting with either oracle: no hooks, no categories, no bookkeeping of frees. Each storage is
held by a weak reference from the moment an operator returns it or takes it as an argument (and every tensor the
interpreter holds when measuring starts: parameters, optimizer states, FSDP's flat parameters), and it is read
again at every operator: ``UntypedStorage.nbytes()`` is its size now, so FSDP1's ``resize_`` frees and
re-allocations count as they happen, and a storage counts until the interpreter lets it go. Real compute: tiny
configs only. Python's reference counting frees a storage at once, as the caching allocator would see the free.

    peak = live_storage.peak_bytes(memtracker.build(config, variant, fake=False), b, s)

Finding 13 of docs/error_matrix/README.md: with FSDP1 and LoRA this sides with the project's tracer, and
MemTracker misses the frozen root unit's sharded flat parameter.
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from harness.fake import memtracker as mt


class LiveStorages(TorchDispatchMode):
    """Keeps the running peak of the bytes of every storage it has seen that is still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, weakref.ref] = {}
        self.peak_bytes = 0

    def add(self, tensor: torch.Tensor) -> None:
        # a wrapper subclass holds no memory of its own: a DTensor (FSDP2's sharded parameters, expert shards) wraps
        # its rank's local tensor, the functional collectives' AsyncCollectiveTensor the collective's output; their
        # own storages report a size (the global one, or the inner tensor's) and hold nothing: count the inner ones
        if is_traceable_wrapper_subclass(tensor):
            for inner in inner_tensors(tensor):
                self.add(inner)
            return
        if tensor.device.type != "cpu":
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in self.storages:
            self.storages[key] = weakref.ref(storage, lambda _ref, key=key: self.storages.pop(key, None))

    def live_bytes(self) -> int:
        return sum(s.nbytes() for ref in list(self.storages.values()) if (s := ref()) is not None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten((out, args, kwargs))[0]:
            if isinstance(item, torch.Tensor):
                self.add(item)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes())
        return out


def inner_tensors(wrapper: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a traceable wrapper subclass holds (those of its ``__tensor_flatten__`` attributes that are
    tensors): a DTensor's ``_local_tensor`` (not its ``device_mesh``), an AsyncCollectiveTensor's ``elem``."""
    names, _context = wrapper.__tensor_flatten__()
    return [inner for name in names if isinstance(inner := getattr(wrapper, name), torch.Tensor)]


def peak_bytes(built: mt.Built, b: int, s: int, loop: str = "trainer", batch: str = "full") -> int:
    """Peak live storage bytes over two steady-state steps at (b, s) of a real-tensor build (one warm-up step
    first, as ``memtracker.peak_bytes`` does)."""
    if not built.step_scalars:
        mt.warm_up(built)
    mode = LiveStorages()
    for obj in gc.get_objects():  # what exists before the steps: parameters, flat parameters, optimizer states
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            mode.add(obj)
    mode.peak_bytes = mode.live_bytes()
    with mt._contexts(built, batch), mode:
        mt._train_steps(built, b, s, loop, batch, 2)
    return mode.peak_bytes
