"""DeepSpeed ZeRO-3's parameter gathers on its allgather stream, as the caching allocator sees them: an emulation of
``PartitionedParameterCoordinator`` (DeepSpeed 0.19, ``deepspeed/runtime/zero/partitioned_param_coordinator.py``)
over the modules that hold parameters, in forward order and then in reverse for backward.

* Each module's fetch gathers its parameters that are not available in one call (``__all_gather_params``), one
  buffer per call on the allgather stream: ``partition numel x world`` elements of each parameter, one parameter
  alone (``_all_gather_sequential``) or several in one flat tensor (``_all_gather_coalesced``), each parameter a
  view of it, so the buffer is freed when its last parameter is released.
* The first step records the module trace: every parameter released after its module (persistent ones too: under
  ``stage3_param_persistence_threshold`` they are gathered and dropped like the rest, 4 KiB of Llama's norms).
* Later steps prefetch: after each fetch, parameters are popped off the trace's queue (those of the module just
  fetched, then up to ``stage3_prefetch_bucket_size`` elements, within ``stage3_max_live_parameters``) and
  gathered in one call; a release keeps what a module within ``stage3_max_reuse_distance`` elements of the trace
  will use again, and what a prefetch fetched for a later use. Persistent parameters stay gathered (not on this
  stream after the first step). Backward's end releases everything (``release_and_reset_all``).

Only the allgather stream's own requests matter for its pool: no other stream reuses its blocks, and its
``record_stream`` frees complete at once (``benchmarks/zero3_trace_anatomy.py``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from estimator.models.params import ParamInfo
from estimator.reserved.timeline import model_order


@dataclass
class _Param:
    key: str
    numel: int
    elem_bytes: int
    persistent: bool
    available: bool = False
    buffer: int | None = None


@dataclass(frozen=True)
class Module:
    name: str
    params: tuple[str, ...]


@dataclass
class GatherOps:
    """(+1, buffer id, bytes) allocations and (-1, buffer id, bytes) frees on the allgather stream, per step."""

    steps: list[list[tuple[int, int, int]]] = field(default_factory=list)


def modules_of(table: list[ParamInfo]) -> tuple[list[Module], list[Module]]:
    """(forward, backward) module traces of a Hugging Face decoder, as DeepSpeed's hooks see them: every module
    whose forward runs, parameter-less ones included (each fetch may prefetch). Forward, in pre-forward order: the
    causal-LM wrapper, the base model, the modules before the layers (the embedding), the rotary embedding; per
    decoder layer the layer, then its blocks each after its norm (``input_layernorm``, attention with its
    projections, ``post_attention_layernorm``, MLP with its projections and the activation after the first), the
    modules after the layers, a tied head. Backward (pre-backward hooks on the outputs that need grad): the
    reverse of the post-forward order, the rotary embedding left out."""
    order = model_order(table)
    direct: dict[str, list[str]] = {}
    seen: list[str] = []
    for p in order:
        owner = p.name.rsplit(".", 1)[0]
        if owner not in direct:
            direct[owner] = []
            seen.append(owner)
        direct[owner].append(p.name)
    tied = [(other.rsplit(".", 1)[0], p.name) for p in order for other in p.tied_names]
    before = [m for m in seen if not m.split(".")[-2:-1] or not _layer_of(m)]
    layers: dict[int, list[str]] = {}
    for m in seen:
        layer = _layer_of(m)
        if layer is not None:
            layers.setdefault(layer, []).append(m)
    first_layer_at = next((i for i, m in enumerate(seen) if _layer_of(m) is not None), len(seen))
    head = [m for m in seen[:first_layer_at] if _layer_of(m) is None]
    tail = [m for m in seen[first_layer_at:] if _layer_of(m) is None]
    del before
    base = head[0].split(".")[0] if head else "model"
    forward: list[tuple[str, tuple[str, ...]]] = [("", ()), (base, ())]
    post: list[str] = []
    for m in head:
        forward.append((m, tuple(direct[m])))
        post.append(m)
    forward.append((f"{base}.rotary_emb", ()))
    post.append(f"{base}.rotary_emb")
    for layer in sorted(layers):
        prefix = layers[layer][0].split(f".{layer}.")[0] + f".{layer}"
        forward.append((prefix, ()))
        blocks: dict[str, list[str]] = {}
        norms: list[str] = []
        for m in layers[layer]:
            rest = m[len(prefix) + 1:]
            if "." in rest:
                blocks.setdefault(f"{prefix}.{rest.split('.')[0]}", []).append(m)
            else:
                norms.append(m)
        for k, (block, leaves) in enumerate(blocks.items()):
            if k < len(norms):
                forward.append((norms[k], tuple(direct[norms[k]])))
                post.append(norms[k])
            forward.append((block, ()))
            for j, leaf in enumerate(leaves):
                forward.append((leaf, tuple(direct[leaf])))
                post.append(leaf)
                if j == 0 and len(leaves) == 3:  # gated MLP: act_fn(gate(x)) * up(x)
                    forward.append((f"{block}.act_fn", ()))
                    post.append(f"{block}.act_fn")
            post.append(block)
        for norm in norms[len(blocks):]:
            forward.append((norm, tuple(direct[norm])))
            post.append(norm)
        post.append(prefix)
    for m in tail:
        forward.append((m, tuple(direct[m])))
        post.append(m)
    post.append(base)
    for owner, name in tied:
        forward.append((owner, (name,)))
        post.append(owner)
    post.append("")
    params_of = dict(forward)
    backward = [(m, params_of.get(m, ())) for m in reversed(post) if not m.endswith("rotary_emb")]
    return [Module(n, ps) for n, ps in forward], [Module(n, ps) for n, ps in backward]


def _layer_of(module: str) -> int | None:
    parts = module.split(".")
    for a, b in zip(parts, parts[1:]):
        if a in ("layers", "h", "layer", "blocks") and b.isdigit():
            return int(b)
    return None


def emulate(table: list[ParamInfo], world: int, steps: int = 3, prefetch_bucket: int = 50_000_000,
            max_live: int = 1_000_000_000, max_reuse: int = 1_000_000_000, persistence: int = 100_000
            ) -> GatherOps:
    params = {p.name: _Param(p.name, p.numel, p.elem_bytes, p.numel < persistence) for p in table}
    forward, backward = modules_of(table)
    trace = forward + backward
    ops = GatherOps()
    next_buffer = [0]
    buffers: dict[int, set[str]] = {}
    buffer_bytes: dict[int, int] = {}

    def gather(out: list, names: list[str]) -> None:
        todo = [n for n in names if not params[n].available]
        if not todo:
            return
        b = next_buffer[0]
        next_buffer[0] += 1
        nbytes = sum(math.ceil(params[n].numel / world) * world * params[n].elem_bytes for n in todo)
        buffers[b], buffer_bytes[b] = set(todo), nbytes
        out.append((1, b, nbytes))
        for n in todo:
            params[n].available, params[n].buffer = True, b

    def release(out: list, name: str) -> None:
        p = params[name]
        if not p.available:
            return
        p.available = False
        held = buffers[p.buffer]
        held.discard(name)
        if not held:
            out.append((-1, p.buffer, buffer_bytes.pop(p.buffer)))
            del buffers[p.buffer]
        p.buffer = None

    # step 1: the trace is recorded, nothing prefetched, every parameter released after its module
    out: list = []
    for m in trace:
        gather(out, list(m.params))
        for n in m.params:
            release(out, n)
    ops.steps.append(out)
    queue_order = [(n, step_id) for step_id, m in enumerate(trace) for n in m.params]
    for p in params.values():  # persistent parameters: gathered once, kept (not on this stream's books)
        if p.persistent:
            p.available = True
    for _ in range(steps - 1):
        out = []
        queue = deque(queue_order)
        fetched_for: dict[str, int] = {}
        n_available = 0
        for step_id, m in enumerate(trace):
            names = list(m.params)
            before = {n for n in names if not params[n].available}
            gather(out, names)
            n_available += sum(params[n].numel for n in before)
            not_yet = {n for n in names if fetched_for.get(n, -10**10) < step_id}
            discarded: set[str] = set()
            while queue and len(discarded) < len(not_yet):
                n, used_at = queue.popleft()
                fetched_for[n] = used_at
                discarded.add(n)
            limit = min(max_live - n_available, prefetch_bucket)
            prefetch: list[str] = []
            numel = 0
            while queue and numel < limit:
                n, used_at = queue.popleft()
                fetched_for[n] = max(fetched_for.get(n, -10**10), used_at)
                if not params[n].available and n not in prefetch:
                    prefetch.append(n)
                    numel += params[n].numel
            if prefetch:
                gather(out, prefetch)
                n_available += numel
            # release after the module (step_id already advanced past its fetch)
            now = step_id + 1
            keep = {n for n in names if fetched_for.get(n, -10**10) > now}
            traversed = 0
            for later in trace[now:]:
                if traversed >= max_reuse:
                    break
                for n in later.params:
                    keep.add(n)
                    traversed += params[n].numel
            for n in names:
                if n not in keep and params[n].available and not params[n].persistent:
                    release(out, n)
                    n_available -= params[n].numel
        for n, p in params.items():  # backward's end: release_and_reset_all
            if not p.persistent:
                release(out, n)
        ops.steps.append(out)
    return ops


def pool_requests(ops: GatherOps, stream: int = 1) -> list[tuple]:
    """The gathers as ``estimator.allocator.requests`` tuples (one key per buffer and step)."""
    out: list[tuple] = []
    for k, step in enumerate(ops.steps):
        for sign, b, nbytes in step:
            out.append(("alloc", (k, b), nbytes, stream) if sign > 0 else ("free", (k, b)))
    return out


def reduction_flushes(table: list[ParamInfo], bucket_numel: int) -> list[int]:
    """Bytes of each IPG flush's concatenation on the reduction stream, in backward order (stage 3's
    ``__reduce_and_partition_ipg_grads``: a gradient that would overflow ``reduce_bucket_size`` elements flushes the
    bucket first; a flush of one tensor reduces it in place, 0 here). Backward order: the profile's
    ``backward_index`` where it has one, else the reverse of ``model.parameters()`` with a tied embedding last."""
    trainable = [p for p in model_order(table) if p.trainable]
    if all(p.backward_index is not None for p in trainable):
        order = sorted(trainable, key=lambda p: p.backward_index)
    else:
        tied = [p for p in trainable if p.tied_names]
        order = [p for p in reversed(trainable) if not p.tied_names] + tied
    flushes: list[int] = []
    pending: list[ParamInfo] = []
    elements = 0

    def flush() -> None:
        flushes.append(sum(p.numel * p.elem_bytes for p in pending) if len(pending) > 1 else 0)

    for p in order:
        if elements + p.numel > bucket_numel and elements:
            flush()
            pending, elements = [], 0
        pending.append(p)
        elements += p.numel
    if pending:
        flush()
    return flushes
