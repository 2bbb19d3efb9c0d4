"""Trace the real transformers model of a RunSpec on fake tensors and a fake process group, per rank.

See ``harness.fake`` for the contract. Everything torch-related is imported here, lazily from the package.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from typing import Any

import torch

from estimator.spec import RunSpec
from harness.fake.counter import StorageCounter
from harness.fake.wrap import (
    FSDP_METHODS,
    TORCH_METHODS,
    build_method_optimizer,
    build_training,
    make_mesh,
    wrap_model,
)

_UNSUPPORTED_OPTIMIZERS = {"adamw_8bit": "bitsandbytes' 8-bit AdamW needs CUDA"}


def _check(spec: RunSpec, config: dict[str, Any]) -> None:
    method = spec.parallel.method
    if method not in TORCH_METHODS:
        raise ValueError(f"method: the fake-tensor oracle traces torch-native methods only "
                         f"({', '.join(TORCH_METHODS)}); {method!r} runs under DeepSpeed, measure it on a GPU")
    if spec.training.qlora:
        raise ValueError("qlora: 4-bit bitsandbytes weights cannot be traced on fake CPU tensors")
    if spec.training.optimizer in _UNSUPPORTED_OPTIMIZERS:
        raise ValueError(f"optimizer: {spec.training.optimizer!r} cannot be traced "
                         f"({_UNSUPPORTED_OPTIMIZERS[spec.training.optimizer]})")
    if method in ("tp", "dp_tp"):
        from estimator.tp_plans import check_tp

        check_tp(config, spec.parallel.tp)


def _ranks(spec: RunSpec, ranks) -> list[int]:
    n = spec.parallel.world_size
    if ranks is None:
        ranks = (0, n - 1)
    out = sorted({int(r) for r in ranks})
    bad = [r for r in out if not 0 <= r < n]
    if bad or not out:
        raise ValueError(f"ranks: {bad or 'none'} not in 0..{n - 1} (world size {n})")
    return out


@contextlib.contextmanager
def _fsdp_tags(counter: StorageCounter) -> Iterator[None]:
    """Count FSDP2's all-gather / unsharded-param / reduce-scatter buffers under their own categories."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_mod

    categories = {"foreach_all_gather": "All Gather", "foreach_all_gather_copy_out": "Unsharded Param",
                  "foreach_reduce": "Reduce Scatter"}
    saved = {name: getattr(group_mod, name) for name in categories}

    def tagged(fn, cat):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with counter.tagged(cat):
                return fn(*args, **kwargs)
        return inner

    try:
        for name, cat in categories.items():
            setattr(group_mod, name, tagged(saved[name], cat))
        yield
    finally:
        for name, fn in saved.items():
            setattr(group_mod, name, fn)


_last_dtensor_world: tuple | None = None


def _clear_dtensor_caches_if_world_changed(key: tuple) -> None:
    """DTensor caches sharding decisions process-wide, keyed by DeviceMesh equality, which ignores the rank and
    the process-group names (group names depend on the rank: rank 0 of a 2x2 mesh gets groups "1", "3", rank 3
    gets "2", "4"). After a trace destroys its process group, a later trace of another rank or world would reuse
    output specs carrying the old mesh (stale group names: "Could not resolve the process group registered under
    the name 3"; the old rank's coordinate). Clear the caches whenever (rank, world, mesh shape) changes; the
    same key gives the same group names and coordinates, so the cache stays valid (and warm) then."""
    global _last_dtensor_world
    if key != _last_dtensor_world:
        _clear_dtensor_caches()
        _last_dtensor_world = key


def _clear_dtensor_caches() -> None:
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # the Python LRU caches and the C++ fast-path cache
    for fn in (ShardingPropagator._propagate_tensor_meta_cached, getattr(_redistribute, "_gen_transform_infos", None)):
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()


@contextlib.contextmanager
def _device_mesh_untracked(counter: StorageCounter | None, fake: bool = True) -> Iterator[None]:
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
def _skip_dtensor_meta_propagation(counter: StorageCounter) -> Iterator[None]:
    """DTensor computes output metadata by running each new (op, specs) combination on fake tensors of the
    *global* shape (``ShardingPropagator._propagate_tensor_meta_non_cached``). Without an outer fake mode it
    uses its own FakeTensorMode, which the counter ignores; under our FakeTensorMode it reuses ours, and those
    global-shape temporaries would be counted as allocations. They never exist on a GPU: pause counting there.

    This is what inflated "FSDP2's first step on fake tensors" (env-recipes §4): the propagation results are
    cached (lru_cache, process-wide), so only the first trace in a process paid it, in its first step.
    """
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    orig = ShardingPropagator._propagate_tensor_meta_non_cached

    @functools.wraps(orig)
    def propagate(self, *args, **kwargs):
        with counter.paused():
            return orig(self, *args, **kwargs)

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = orig


@contextlib.contextmanager
def _hf_full_length_mask() -> Iterator[None]:
    """Let transformers skip the 4-D attention mask for SDPA as it does on the GPU for our batch.

    The traced batch is ``synthetic_batch``: full length, ``attention_mask`` all ones. On real tensors
    transformers checks that (``fast_all``) and calls SDPA with ``attn_mask=None, is_causal=True`` (flash /
    memory-efficient kernels, ``enable_gqa`` instead of ``repeat_kv``). On fake tensors it cannot read the mask
    (``is_tracing`` is true for FakeTensor) and materialises a ``(b, 1, s, s)`` mask instead, which changes the
    SDPA path and adds per-layer mask copies. We tell it what the data would have told it: no padding.
    """
    from torch._subclasses.fake_tensor import is_fake
    from transformers import masking_utils

    orig = masking_utils._ignore_causal_mask_sdpa

    @functools.wraps(orig)
    def ignore_causal_mask_sdpa(padding_mask, *args, **kwargs):
        if padding_mask is not None and is_fake(padding_mask):
            padding_mask = None  # all ones by construction (synthetic_batch)
        return orig(padding_mask, *args, **kwargs)

    masking_utils._ignore_causal_mask_sdpa = ignore_causal_mask_sdpa
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = orig


def _instrument_optimizer(optimizer, counter: StorageCounter) -> None:
    """After the optimizer lazily creates its state (``_init_group``), count state and stepped grads as such."""
    for opt in getattr(optimizer, "optimizers", None) or [optimizer]:
        _instrument_one_optimizer(opt, counter)


def _instrument_one_optimizer(optimizer, counter: StorageCounter) -> None:
    inner = getattr(optimizer, "inner", optimizer)
    if not hasattr(inner, "_init_group"):
        return
    orig = inner._init_group

    @functools.wraps(orig)
    def init_group(group, *args, **kwargs):
        out = orig(group, *args, **kwargs)
        for p in group["params"]:
            if p.grad is not None:
                counter.retag(p.grad, "Gradient")
            state = inner.state.get(p)
            if state:
                counter.retag([v for v in state.values() if isinstance(v, torch.Tensor)], "Optstate")
        return out

    inner._init_group = init_group


def _trace_rank(spec: RunSpec, config: dict[str, Any], rank: int, *, round_to: int, steps: int,
                fake_tensors: bool = True) -> dict[str, Any]:
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from estimator.profiler.build import build_model, forward_backward, materialize_fake, synthetic_batch

    n = spec.parallel.world_size
    method = spec.parallel.method
    training = spec.training
    built = build_training(spec)
    t0 = time.perf_counter()
    if n > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

        if dist.is_initialized():
            raise RuntimeError("a default process group is already initialized; trace_run needs its own")
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=n)
    _clear_dtensor_caches_if_world_changed((rank, n, method, spec.parallel.tp))
    try:
        mesh = make_mesh(spec, "cpu")  # outside FakeTensorMode (init_device_mesh reads a scalar)
        # Built on meta *outside* FakeTensorMode: built inside it, the meta->fake conversion memoizes a weakref to
        # every meta param and to_empty's swap_tensors then fails ("Couldn't swap Embedding.weight").
        meta_model = build_model(config, built, "cpu", meta=True) if fake_tensors else None
        counter = StorageCounter(round_to=round_to)
        with contextlib.ExitStack() as stack:
            stack.enter_context(_device_mesh_untracked(counter, fake=fake_tensors))
            if fake_tensors:
                stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(counter)
            stack.enter_context(_skip_dtensor_meta_propagation(counter))
            if fake_tensors:
                stack.enter_context(_hf_full_length_mask())
            if method in FSDP_METHODS:
                stack.enter_context(_fsdp_tags(counter))
            if fake_tensors:
                model = materialize_fake(meta_model)
                del meta_model
            else:  # validation mode: real CPU tensors (small models only), same program otherwise
                torch.manual_seed(0)
                model = build_model(config, built, "cpu")
            vocab = model.config.vocab_size
            # DDP allocates its gradient buckets in its constructor (C++ Reducer, seen by the dispatch mode)
            with counter.tagged("DDP Bucket") if method == "ddp" else contextlib.nullcontext():
                model = wrap_model(model, spec, mesh, config, fake=True)
            optimizer = build_method_optimizer(model, spec)
            batch = synthetic_batch(training.micro_batch_size, training.seq_len, vocab, "cpu")
            counter.retag(list(model.buffers()), "Buffer")
            counter.retag(list(model.parameters()), "Parameter")
            counter.retag(getattr(optimizer, "masters", []), "Master Param")
            counter.retag(list(batch.values()), "Inputs")
            _instrument_optimizer(optimizer, counter)
            for p in model.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda p: counter.retag(p.grad, "Gradient"))
            model.register_forward_pre_hook(lambda *a: counter.set_phase("forward"), prepend=True)
            model.register_forward_hook(lambda *a: counter.set_phase("backward"), always_call=True)
            setup_bytes, setup_peak = counter.current, counter.max_total
            setup_breakdown = counter.snapshot()
            t_setup = time.perf_counter() - t0

            accum = training.grad_accum_steps
            records = []
            for _ in range(steps):
                counter.begin_step()
                counter.set_phase("forward")
                for micro in range(accum):
                    # DDP syncs only the last micro-batch (no_sync), as the harness does; FSDP syncs each one.
                    sync = contextlib.nullcontext() if method != "ddp" or micro == accum - 1 else model.no_sync()
                    with sync:
                        forward_backward(model, batch, training, "cpu", scale=1.0 / accum)
                counter.set_phase("optimizer")
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                records.append(counter.end_step())
                counter.set_phase("setup")
            local_params = sum(_local_numel(p) for p in model.parameters())
            del model, optimizer, batch
    finally:
        if n > 1 and dist.is_initialized():
            dist.destroy_process_group()

    steady = records[1:] if method in FSDP_METHODS and len(records) > 1 else records
    best = max(steady, key=lambda r: r["peaks"]["peak"])
    return {
        "peak_allocated_bytes": best["peaks"]["peak"],
        "step_peaks": [r["peaks"] for r in records],
        "step_breakdowns": [r["breakdown"] for r in records],
        "step_peak_phases": [r["phase"] for r in records],
        "breakdown_at_peak": best["breakdown"],
        "peak_step": records.index(best) + 1,
        "peak_phase": best["phase"],
        "setup_bytes": int(setup_bytes),
        "setup_peak_bytes": int(setup_peak),
        "setup_breakdown": setup_breakdown,
        "local_param_numel": int(local_params),
        "setup_s": round(t_setup, 3),
        "trace_s": round(time.perf_counter() - t0, 3),
    }


def _local_numel(p: torch.Tensor) -> int:
    local = getattr(p, "_local_tensor", None)
    return (local if local is not None else p).numel()


def _notes(spec: RunSpec, round_to: int) -> list[str]:
    method, training = spec.parallel.method, spec.training
    notes = [f"bytes: each live tensor storage rounded up to {round_to} B (the CUDA caching allocator's block "
             "granularity); kernel workspaces (cuBLAS, NCCL, CUDA context) and allocator slack are not counted",
             "peaks cover the training steps only (model build / wrapping excluded: setup_peak_bytes)"]
    if method in FSDP_METHODS:
        notes.append("fsdp: peak_allocated_bytes and breakdown_at_peak are the steady state, max over steps >= 2 "
                     "(step 1 has no optimizer state before its optimizer step). The first-step inflation seen "
                     "with MemTracker on fake tensors (env-recipes §4) was DTensor sharding-propagation "
                     "temporaries counted as allocations; this counter excludes them")
    if method == "ddp":
        notes.append("ddp: fake run uses init_sync=False and a no-op comm hook; buckets are torch defaults "
                     "(25 MiB, first 1 MiB, gradient_as_bucket_view=False)")
    if method in ("tp", "dp_tp"):
        notes.append("tp: decoder-layer linears split (estimator.tp_plans); embeddings, norms and lm_head "
                     "replicated, so every rank holds the full logits")
    if training.precision.startswith("amp_"):
        notes.append("amp: traced under CPU autocast, whose op cast lists differ slightly from CUDA's")
    if training.attn == "flash":
        notes.append("attn flash: traced with SDPA's CPU flash-style kernel (no S x S matrix)")
    if training.grad_ckpt:
        notes.append("grad_ckpt: recomputed activations are counted as Temp (created in backward)")
    if method in FSDP_METHODS and training.precision.startswith("mixed_"):
        notes.append("fsdp mixed_*: fp32 sharded params + MixedPrecisionPolicy(param_dtype=16-bit, "
                     "reduce_dtype=fp32); AdamW steps the fp32 shards directly")
    return notes


def trace_run(spec: RunSpec, ranks=None, *, config: dict[str, Any] | None = None, round_to: int = 512,
              steps: int = 2, fake_tensors: bool = True) -> dict[str, Any]:
    """Per-rank peak allocated bytes of ``steps`` training steps of ``spec`` (see ``harness.fake``).

    ``fake_tensors=False`` runs the same program on real CPU tensors (same fake process group): a validation
    mode for small configs (it allocates the memory it reports)."""
    from estimator.arch import load_config

    if config is None:
        config = load_config(spec.model)
    _check(spec, config)
    if steps < 1:
        raise ValueError(f"steps: must be >= 1, got {steps}")
    t0 = time.perf_counter()
    per_rank = {}
    for rank in _ranks(spec, ranks):
        per_rank[rank] = _trace_rank(spec, config, rank, round_to=round_to, steps=steps,
                                     fake_tensors=fake_tensors)
    return {"per_rank": per_rank, "trace_s": round(time.perf_counter() - t0, 3),
            "measured_by": "fake_tensor_trace" if fake_tensors else "cpu_tensor_trace", "notes": _notes(spec, round_to),
            "spec_id": spec.spec_id, "round_to": round_to, "steps": steps}
