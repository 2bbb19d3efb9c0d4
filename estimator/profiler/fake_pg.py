"""Fake process groups and DTensor on fake tensors: what the TP profiler and the CPU oracle (``harness.fake``)
both need to trace a distributed model in one process, one rank at a time.

* ``fake_process_group(rank, world)``: ``torch.distributed`` initialised on torch's "fake" backend (collectives
  are no-ops that keep shapes), destroyed on exit whatever happens, so nothing leaks into later code;
* ``device_mesh_untracked``: DeviceMesh's host-side rank tensors built outside fake mode and uncounted;
* ``skip_dtensor_meta_propagation``: DTensor's global-shape metadata propagation not counted as allocations;
* ``clear_dtensor_caches_if_world_changed``: DTensor's process-wide sharding caches dropped when the traced
  (rank, world, mesh) changes.

``counter`` arguments are any recorder with a ``paused()`` context manager (``harness.fake.counter
.StorageCounter``, ``estimator.profiler.trace.StorageRecorder``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

_last_dtensor_world: tuple | None = None


def clear_dtensor_caches_if_world_changed(key: tuple) -> None:
    """DTensor caches sharding decisions process-wide, keyed by DeviceMesh equality, which ignores the rank and
    the process-group names (group names depend on the rank: rank 0 of a 2x2 mesh gets groups "1", "3", rank 3
    gets "2", "4"). After a trace destroys its process group, a later trace of another rank or world would reuse
    output specs carrying the old mesh (stale group names: "Could not resolve the process group registered under
    the name 3"; the old rank's coordinate). Clear the caches whenever (rank, world, mesh shape) changes; the
    same key gives the same group names and coordinates, so the cache stays valid (and warm) then."""
    global _last_dtensor_world
    if key != _last_dtensor_world:
        clear_dtensor_caches()
        _last_dtensor_world = key


def clear_dtensor_caches() -> None:
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # the Python LRU caches and the C++ fast-path cache
    for fn in (ShardingPropagator._propagate_tensor_meta_cached, getattr(_redistribute, "_gen_transform_infos", None)):
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int, cache_key: tuple | None = None) -> Iterator[None]:
    """The default process group on the "fake" backend for ``rank`` of ``world_size``, destroyed on exit.

    ``cache_key``: passed to ``clear_dtensor_caches_if_world_changed`` (default ``(rank, world_size)``)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("a default process group is already initialized; a fake-PG trace needs its own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        clear_dtensor_caches_if_world_changed(cache_key if cache_key is not None else (rank, world_size))
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def device_mesh_untracked(counter: Any | None, fake: bool = True) -> Iterator[None]:
    """DeviceMesh builds and reads small host-side rank tensors (``nonzero``, ``tolist``): impossible on fake
    tensors, and never device memory on a GPU. FSDP2 creates meshes inside the trace (e.g. the 2-D SPMD mesh of
    FSDP+TP), so run DeviceMesh's constructor and its ``mesh`` property with fake mode suspended (``fake``) and
    the counter paused."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    orig_init = DeviceMesh.__init__
    orig_mesh = DeviceMesh.__dict__["mesh"]

    def untracked():
        stack = contextlib.ExitStack()
        if fake:
            stack.enter_context(unset_fake_temporarily())
        if counter is not None:
            stack.enter_context(counter.paused())
        return stack

    @functools.wraps(orig_init)
    def init(self, *args, **kwargs):
        with untracked():
            orig_init(self, *args, **kwargs)

    def mesh(self):
        with untracked():
            return orig_mesh.fget(self)

    DeviceMesh.__init__ = init
    DeviceMesh.mesh = property(mesh)
    try:
        yield
    finally:
        DeviceMesh.__init__ = orig_init
        DeviceMesh.mesh = orig_mesh


@contextlib.contextmanager
def skip_dtensor_meta_propagation(counter: Any) -> Iterator[None]:
    """DTensor computes output metadata by running each new (op, specs) combination on fake tensors of the
    *global* shape (``ShardingPropagator._propagate_tensor_meta_non_cached``). Without an outer fake mode it
    uses its own FakeTensorMode, which a counter ignores; under our FakeTensorMode it reuses ours, and those
    global-shape temporaries would be counted as allocations. They never exist on a GPU: pause counting there.

    This is what inflated "FSDP2's first step on fake tensors" (env-recipes §4): the propagation results are
    cached (lru_cache, process-wide), so only the first trace in a process paid it, in its first step.
    """
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    from estimator.profiler.build import patched_attr

    def make(orig):
        def propagate(self, *args, **kwargs):
            with counter.paused():
                return orig(self, *args, **kwargs)
        return propagate

    with patched_attr(ShardingPropagator, "_propagate_tensor_meta_non_cached", make):
        yield
