"""Context-parallel ranks on fake tensors: torch's own ring attention under ``FSDPMemTracker`` (issue 18).

``peak_bytes(config, precision, world, cp, rank, b, s, grad_ckpt=False)``: FSDP2 over ``world`` ranks (dp x cp,
torchtitan's ``dp_shard_cp`` mesh; ``harness.fake.memtracker``'s model, loop and tracker), each rank training on
its ``s / cp`` tokens, every SDPA call run as ``context_parallel`` runs it on the GPU: torch's
``_templated_ring_attention`` forward and ``_templated_ring_attention_backward`` over the rank's cp group of the
fake process group (flash kernel, all-gather rotation, head-tail load balancing), their allocations counted op by
op. ``tp_peak_bytes``: cp x tp, ``harness.fake.trace_run``'s dp_tp rank with SDPA run as the same ring over the
rank's cp group (every tp-th rank, ``cp_group_ranks``).

Two things differ from calling ``context_parallel`` itself, each for a measured reason:

* ``context_parallel`` wraps q, k, v as sequence-sharded DTensors and the ring runs inside DTensor's dispatch,
  where no dispatch mode sees its local tensors (MemTracker and ``live_storage`` would count the DTensors' wrappers
  and miss the ring's buffers). Here an ``autograd.Function`` calls the handler's body directly on the local
  tensors and saves what autograd saves for the DTensor op (q, k, v, the merged output and logsumexp, the kernel's
  cumulative lengths and philox state): the same calls, minus the wrappers, which allocate nothing.
* On fake tensors the functional collectives wait at once (``_are_we_tracing``) and ``wait_tensor``'s meta kernel
  returns a fresh tensor: a second copy of every gathered buffer, which the GPU's ``wait_tensor`` (it returns its
  input) never makes. ``wait_tensor`` returns its input here. What stays different: the GPU's work holds a
  collective's input until the wait, one step later (``ring_*_extra(held_until_wait=True)`` in the estimator).

The batch is the rank's (b, s / cp) slice (the load balancer's gather and the kept originals are
input-batch-sized, as is the batch the estimator leaves out). CP on real CPU tensors is impossible:
``_scaled_dot_product_flash_attention_for_cpu`` has no CP handler nor DTensor sharding rule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator


@contextlib.contextmanager
def _waits_return_input() -> Iterator[None]:
    """``wait_tensor`` returns its input, as the GPU's does, for the ring's own collectives only (a TP layer's
    collectives keep the fake tensors' behaviour the TP profile and ``harness.fake.trace_run`` were traced with)."""
    import torch.distributed._functional_collectives as fc

    saved, fc.wait_tensor = fc.wait_tensor, (lambda tensor: tensor)
    try:
        yield
    finally:
        fc.wait_tensor = saved


def _ring_function(group):
    import torch
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention

    aten = torch.ops.aten

    class RingFlash(torch.autograd.Function):
        @staticmethod
        def forward(ctx, query, key, value, is_causal, scale):
            with _waits_return_input():
                return RingFlash._forward(ctx, query, key, value, is_causal, scale)

        @staticmethod
        def _forward(ctx, query, key, value, is_causal, scale):
            out, lse, *rest = cp_attention._templated_ring_attention(
                group, 2, aten._scaled_dot_product_flash_attention, query=query, key=key, value=value,
                is_causal=is_causal, dropout_p=0.0, scale=scale)
            cum_q, cum_k, max_q, max_k, seed, offset = rest[:6]
            ctx.save_for_backward(query, key, value, out, lse, cum_q, cum_k, seed, offset)
            ctx.meta = (max_q, max_k, is_causal, scale)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            with _waits_return_input():
                return RingFlash._backward(ctx, grad_out)

        @staticmethod
        def _backward(ctx, grad_out):
            query, key, value, out, lse, cum_q, cum_k, seed, offset = ctx.saved_tensors
            max_q, max_k, is_causal, scale = ctx.meta
            dq, dk, dv, *_ = cp_attention._templated_ring_attention_backward(
                group, 2, aten._scaled_dot_product_flash_attention_backward.default, grad_out=grad_out,
                grad_out_name="grad_out", query=query, key=key, value=value, out=out, logsumexp=lse,
                is_causal=is_causal, cum_seq_q=cum_q, cum_seq_k=cum_k, max_q=max_q, max_k=max_k, dropout_p=0.0,
                philox_seed=seed, philox_offset=offset, scale=scale)
            return dq, dk, dv, None, None

    def ring_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        from harness.fake.cuda_kernels import sdpa_backend

        if attn_mask is not None or dropout_p or not is_causal:
            raise ValueError("cp: the ring attention oracle takes causal, unmasked, dropout-free attention")
        if torch.is_autocast_enabled("cpu"):
            low = torch.get_autocast_dtype("cpu")
            query, key, value = (t.to(low) for t in (query, key, value))
            with torch.autocast("cpu", enabled=False):
                return ring_sdpa(query, key, value, None, 0.0, True, scale, enable_gqa)
        if sdpa_backend(query, key, value, None, 0.0, True, enable_gqa) != "flash" or query.size(-1) % 8:
            raise ValueError("cp: the oracle runs the flash kernel only (16-bit q/k/v, head dim a multiple of 8)")
        if scale is None:
            scale = 1.0 / math.sqrt(query.size(-1))
        return RingFlash.apply(query, key, value, True, scale)

    return ring_sdpa


@contextlib.contextmanager
def ring_attention(group) -> Iterator[None]:
    """SDPA runs torch's ring attention over ``group`` while ``cuda_kernels()`` is on (it installs
    ``cuda_kernels.cuda_sdpa``), and ``wait_tensor`` returns its input."""
    import torch.distributed._functional_collectives as fc

    from harness.fake import cuda_kernels

    saved = cuda_kernels.cuda_sdpa, fc.wait_tensor
    cuda_kernels.cuda_sdpa, fc.wait_tensor = _ring_function(group), (lambda tensor: tensor)
    try:
        yield
    finally:
        cuda_kernels.cuda_sdpa, fc.wait_tensor = saved


def cp_group_ranks(world: int, cp: int, tp: int = 1) -> list[list[int]]:
    """Every cp group of torchtitan's mesh (dp_shard, cp, tp), TP innermost: for each block of cp x tp ranks and
    each tp position, the cp ranks every tp-th apart (consecutive ranks when tp = 1)."""
    block = cp * tp
    return [[start + c * tp + t for c in range(cp)] for start in range(0, world, block) for t in range(tp)]


def cp_group(world: int, cp: int, rank: int, tp: int = 1):
    """The fake process group's cp sub-group of ``rank`` (``cp_group_ranks``)."""
    import torch.distributed as dist

    mine = None
    for ranks in cp_group_ranks(world, cp, tp):  # every rank creates every group, as new_group requires
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def peak_bytes(config: dict, precision: str, world: int, cp: int, rank: int, b: int, s: int,
               grad_ckpt: bool = False, **techniques) -> int:
    """FSDPMemTracker's peak of one cp rank over two steady steps (``harness.fake.memtracker.peak_bytes``);
    ``techniques``: the long-context ``Variant`` fields (``ce``, ``ce_chunks``, ``activation_offload``)."""
    from harness.fake import memtracker as mt

    if s % (2 * cp) or world % cp:
        raise ValueError(f"cp: seq_len {s} must be a multiple of 2 x cp and world {world} of cp {cp}")
    variant = dataclasses.replace(mt.Variant(precision, "sdpa", grad_ckpt, "cuda", **techniques), fsdp_world=world,
                                  rank=rank)
    built = mt.build(config, variant)
    try:
        group = cp_group(world, cp, rank)
        with ring_attention(group):
            return mt.peak_bytes(built, b, s // cp)
    finally:
        mt.close(built)


@contextlib.contextmanager
def _sdpa_as_ring(world: int, cp: int, tp: int, rank: int) -> Iterator[None]:
    """``F.scaled_dot_product_attention`` runs torch's ring attention over ``rank``'s cp group (entered inside
    ``harness.fake.trace``'s CUDA kernel patches, so it takes their place)."""
    import torch.nn.functional as F

    saved, F.scaled_dot_product_attention = F.scaled_dot_product_attention, _ring_function(
        cp_group(world, cp, rank, tp))
    try:
        yield
    finally:
        F.scaled_dot_product_attention = saved


def tp_peak_bytes(config: dict, precision: str, world: int, cp: int, tp: int, rank: int, b: int, s: int,
                  grad_ckpt: bool = False, **fields) -> int:
    """cp x tp (torchtitan's (dp_shard, cp, tp) mesh): the steady peak of global ``rank`` as
    ``harness.fake.trace_run`` counts it for method dp_tp (TP inside each tp group, FSDP2 over the world / tp dp x cp
    ranks of each TP position), every rank training on its ``s / cp`` tokens with each SDPA call run by torch's
    ring attention over its cp group (its ``heads / tp`` local heads). ``fields``: more ``TrainingSpec`` fields
    (peft's LoRA: ``lora_rank``, ``lora_targets``)."""
    from estimator.spec import ParallelSpec, RunSpec, TrainingSpec
    from harness.fake.trace import trace_run

    if s % (2 * cp) or world % (cp * tp):
        raise ValueError(f"cp: seq_len {s} must be a multiple of 2 x cp and world {world} of cp x tp {cp * tp}")
    training = TrainingSpec(micro_batch_size=b, seq_len=s // cp, precision=precision, attn="sdpa",
                            grad_ckpt=grad_ckpt, **fields)
    spec = RunSpec(model="cp-tp", training=training, parallel=ParallelSpec(method="dp_tp", world_size=world, tp=tp))
    run = trace_run(spec, [rank], config=config,
                    rank_context=lambda r: _sdpa_as_ring(world, cp, tp, r))
    return run["per_rank"][rank]["peak_allocated_bytes"]
