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

from estimator.profiler.fake_pg import (
    clear_dtensor_caches,
    clear_dtensor_caches_if_world_changed,
    device_mesh_untracked,
    fake_process_group,
    skip_dtensor_meta_propagation,
)
from estimator.spec import FSDP_METHODS, RunSpec
from harness.fake.counter import StorageCounter
from harness.fake.wrap import (
    FSDP2_METHODS,
    TORCH_METHODS,
    build_method_optimizer,
    build_training,
    make_mesh,
    wrap_model,
)
from harness.methods.base import gradient_sync

# FSDP2 allocates its optimizer state in step 1; FSDP1 also records the execution order its prefetching follows.
STEADY_FROM_STEP_2 = FSDP_METHODS
_UNSUPPORTED_OPTIMIZERS = {"adamw_8bit": "bitsandbytes' 8-bit AdamW needs CUDA"}


def _check(spec: RunSpec, config: dict[str, Any]) -> None:
    method = spec.parallel.method
    if method not in TORCH_METHODS:
        raise ValueError(f"method: the fake-tensor oracle traces torch-native methods only "
                         f"({', '.join(TORCH_METHODS)}); {method!r} runs under DeepSpeed, measure it on a GPU")
    if spec.training.optimizer in _UNSUPPORTED_OPTIMIZERS:
        raise ValueError(f"optimizer: {spec.training.optimizer!r} cannot be traced "
                         f"({_UNSUPPORTED_OPTIMIZERS[spec.training.optimizer]})")
    if method in ("tp", "dp_tp"):
        from estimator.models.tp_plans import check_tp

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


@contextlib.contextmanager
def _fsdp1_tags(counter: StorageCounter) -> Iterator[None]:
    """FSDP1: the low-precision shard and the all-gather output (the unsharded flat parameter, which the
    parameters view), and the post-backward hook's reduce path (cast, padding, reduce-scatter output)."""
    from torch.distributed.fsdp import _flat_param as flat_mod
    from torch.distributed.fsdp import _runtime_utils as runtime

    patches = [(flat_mod.FlatParamHandle, "_use_low_precision_shard", "All Gather"),
               (flat_mod.FlatParamHandle, "_alloc_padded_unsharded_flat_param", "Unsharded Param"),
               (runtime, "_post_backward_hook", "Reduce Scatter")]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]

    def tagged(fn, cat):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with counter.tagged(cat):
                return fn(*args, **kwargs)
        return inner

    try:
        for (owner, name, cat), (_, _, fn) in zip(patches, saved):
            setattr(owner, name, tagged(fn, cat))
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


@contextlib.contextmanager
def _fsdp1_fake_storage_checks() -> Iterator[None]:
    """FSDP1 asks whether tensors share or hold memory through ``data_ptr()``, which is 0 for every fake tensor
    (so "same storage" was always true and "allocated" always false); ask the storages themselves."""
    from torch.distributed.fsdp import _flat_param as flat_mod

    saved = flat_mod._same_storage, flat_mod._data_ptr_allocated

    def same_storage(a, b) -> bool:
        return a.untyped_storage()._cdata == b.untyped_storage()._cdata

    def allocated(tensor) -> bool:
        return tensor.untyped_storage().size() > 0

    flat_mod._same_storage, flat_mod._data_ptr_allocated = same_storage, allocated
    try:
        yield
    finally:
        flat_mod._same_storage, flat_mod._data_ptr_allocated = saved


# Shared with the estimator's TP profiler (moved to estimator.profiler.fake_pg; the old names stay importable).
_clear_dtensor_caches_if_world_changed = clear_dtensor_caches_if_world_changed
_clear_dtensor_caches = clear_dtensor_caches
_device_mesh_untracked = device_mesh_untracked
_skip_dtensor_meta_propagation = skip_dtensor_meta_propagation


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
                fake_tensors: bool = True, kernels: str = "cuda", rank_context=None) -> dict[str, Any]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from estimator.models.profiles import run_adapters_in_16bit
    from estimator.profiler.build import (
        HeldOutputs,
        as_on_gpu,
        build_model,
        forward_backward,
        full_length_attention_mask,
        lora_adapters_16bit,
        materialize_fake,
        synthetic_batch,
    )

    n = spec.parallel.world_size
    method = spec.parallel.method
    training = spec.training
    built = build_training(spec)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as pg:
        # FSDP1 flattening the adapters with their 16-bit layer (lora_wrap "layer") needs them built in 16 bits
        pg.enter_context(lora_adapters_16bit(method == "fsdp1" and run_adapters_in_16bit(spec)))
        cache_key = (rank, n, method, spec.parallel.tp)
        if n > 1:
            pg.enter_context(fake_process_group(rank, n, cache_key))
        else:
            clear_dtensor_caches_if_world_changed(cache_key)
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
            if fake_tensors:  # CUDA's kernel choices, or the CPU's to compare with a real CPU run
                stack.enter_context(as_on_gpu(training.batch) if kernels == "cuda"
                                    else full_length_attention_mask(padded=training.batch != "full"))
            if rank_context is not None:  # inside the process group and the kernels' patches (ring attention)
                stack.enter_context(rank_context(rank))
            if method in FSDP2_METHODS:
                stack.enter_context(_fsdp_tags(counter))
            if method == "fsdp1":
                stack.enter_context(_fsdp1_tags(counter))
                if fake_tensors:
                    stack.enter_context(_fsdp1_fake_storage_checks())
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
            held = HeldOutputs(training.loop, training.outputs_fp32)
            records = []
            for _ in range(steps):
                counter.begin_step()
                counter.set_phase("forward")
                for micro in range(accum):
                    # DDP syncs only the last micro-batch (no_sync), as the harness does; FSDP each one, or the
                    # last only with grad_sync "last"
                    with gradient_sync(model, method, training.grad_sync, micro == accum - 1):
                        forward_backward(model, batch, training, "cpu", scale=1.0 / accum, held=held)
                counter.set_phase("optimizer")
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                records.append(counter.end_step())
                counter.set_phase("setup")
            local_params = sum(_local_numel(p) for p in model.parameters())
            held.clear()
            del model, optimizer, batch

    steady = records[1:] if method in STEADY_FROM_STEP_2 and len(records) > 1 else records
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
    if method in STEADY_FROM_STEP_2:
        notes.append(f"{method}: peak_allocated_bytes and breakdown_at_peak are the steady state, max over steps >= 2 "
                     "(step 1 has no optimizer state before its optimizer step). The first-step inflation seen "
                     "with MemTracker on fake tensors (env-recipes §4) was DTensor sharding-propagation "
                     "temporaries counted as allocations; this counter excludes them")
    if method == "ddp":
        notes.append("ddp: fake run uses init_sync=False and a no-op comm hook; buckets are torch defaults "
                     "(25 MiB, first 1 MiB, gradient_as_bucket_view=False)")
    if method in ("tp", "dp_tp"):
        notes.append("tp: decoder-layer linears split (estimator.models.tp_plans); embeddings, norms and lm_head "
                     "replicated, so every rank holds the full logits")
    if training.precision.startswith("amp_"):
        notes.append("amp: traced under CPU autocast, whose op cast lists differ slightly from CUDA's")
    if training.attn == "flash":
        notes.append("attn flash: traced with SDPA's CPU flash-style kernel (no S x S matrix)")
    if training.grad_ckpt:
        notes.append("grad_ckpt: recomputed activations are counted as Temp (created in backward)")
    if method in FSDP2_METHODS and training.precision.startswith("mixed_"):
        notes.append("fsdp mixed_*: fp32 sharded params + MixedPrecisionPolicy(param_dtype=16-bit, "
                     "reduce_dtype=fp32); AdamW steps the fp32 shards directly")
    return notes


def trace_run(spec: RunSpec, ranks=None, *, config: dict[str, Any] | None = None, round_to: int = 512,
              steps: int = 2, fake_tensors: bool = True, kernels: str = "cuda", rank_context=None) -> dict[str, Any]:
    """Per-rank peak allocated bytes of ``steps`` training steps of ``spec`` (see ``harness.fake``).

    ``kernels``: "cuda" traces the kernels a GPU runs (``estimator.profiler.cuda_path``), "cpu" the CPU's.
    ``fake_tensors=False`` runs the same program on real CPU tensors (same fake process group, CPU kernels): a
    validation mode for small configs (it allocates the memory it reports). ``rank_context(rank)``: a context
    manager entered around each rank's steps, once its process group and kernel patches are up
    (``harness.fake.context_parallel.tp_peak_bytes`` runs SDPA as ring attention over the rank's cp group)."""
    from estimator.models.arch import load_config

    if config is None:
        config = load_config(spec.model)
    _check(spec, config)
    if steps < 1:
        raise ValueError(f"steps: must be >= 1, got {steps}")
    t0 = time.perf_counter()
    per_rank = {}
    for rank in _ranks(spec, ranks):
        per_rank[rank] = _trace_rank(spec, config, rank, round_to=round_to, steps=steps,
                                     fake_tensors=fake_tensors, kernels=kernels, rank_context=rank_context)
    return {"per_rank": per_rank, "trace_s": round(time.perf_counter() - t0, 3),
            "measured_by": "fake_tensor_trace" if fake_tensors else "cpu_tensor_trace", "notes": _notes(spec, round_to),
            "spec_id": spec.spec_id, "round_to": round_to, "steps": steps}

