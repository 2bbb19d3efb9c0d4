"""One rank's allocation timeline — setup, then training steps — as the caching allocator sees it.

Setup, in the order a training script creates it on the device: every parameter tensor as ``model.to(device)``
moves it (``Module._apply``: the modules in registration order; the non-layer tensors registered before the
decoder layers, the layers, the rest; a tied tensor once), the module buffers (one block per layer and one
for the rest: the profile keeps their bytes, not their tensors), DDP's gradient buckets (its constructor), the
fp32 master copies of a mixed-precision optimizer (its constructor). Then each step: the batch (input ids,
attention mask, labels: int64, allocated before the previous step's are dropped), and the step's own events
(``estimator.profiler.expand``): the first step's optimizer step creates Adam's states, every cuBLAS workspace
is allocated at its thread's first matmul (the forward's first layer; the backward's start), and DDP rebuilds
its buckets at the second step's forward in the order backward produced the gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

from estimator.models.params import ParamInfo
from estimator.profiler.expand import ALLOC, FREE, FREE_PREVIOUS, Expansion, stream_of
from estimator.reserved.accumulate import FREE_PREVIOUS_CYCLE, MicroSteps, micro_steps

MIB = 1024 * 1024
DDP_FIRST_BUCKET_BYTES = 1 * MIB   # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET_CAP_BYTES = 25 * MIB    # DistributedDataParallel(bucket_cap_mb=25)
BATCH_TENSORS = 3                  # input_ids, attention_mask, labels
INT64 = 8


@dataclass(frozen=True)
class Setup:
    """Allocations before the first step, in order: (name, bytes)."""

    allocations: list[tuple[str, int]]
    # DDP: bucket bytes in the order the rebuilt buckets are allocated (empty: no rebuild)
    rebuilt_buckets: list[int]
    # indices into ``allocations`` of the buckets the rebuild frees
    bucket_indices: list[int]
    # (i, indices): right after allocation i, these earlier allocations are freed (FSDP1's flattening)
    frees_after: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # ``torch.cuda.empty_cache()`` before allocation k (DeepSpeed ZeRO-3's ``defragment`` under LoRA: the frozen
    # tensors' partitions stay where ``zero.Init`` built them, in the segments it left; None: no release)
    empty_cache_before: int | None = None


def model_order(table: list[ParamInfo]) -> list[ParamInfo]:
    """Parameters as ``Module._apply`` visits them: non-layer tensors registered before the layers, the layers in
    order, the rest (a profile that does not record the layers' place: every non-layer tensor first)."""
    before = [p for p in table if p.layer is None and p.before_layers is not False]
    layers = [p for p in table if p.layer is not None]
    after = [p for p in table if p.layer is None and p.before_layers is False]
    return before + layers + after


def to_empty_tied_copies(allocations: list[tuple[str, int]], table: list[ParamInfo], swapped: bool
                         ) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """A model built on the meta device and materialised with ``to_empty`` (``harness.methods.base.build_sharded``,
    as torchtitan builds: fsdp, tp, dp_tp) makes a tied tensor once per module that holds it: ``Module._apply``
    visits each module's own parameters, and the head is the model's last module, so its copy comes after the
    buffers. Appends that copy to ``allocations``; returns the frees (``Setup.frees_after``). ``swapped``: DTensor
    parameters (FSDP2's shards) take ``_apply``'s ``swap_tensors`` path into the one shared parameter, so the
    embedding's first copy is freed as the head's is made, which stays; plain parameters (tp's replicated
    embedding and head) take a new ``Parameter`` per module, untying them, and the harness's ``retie`` drops the
    head's copy at once. Seen in the H200 snapshots of session 25 (FSDP2, dp_tp, TP x8: one embedding-sized
    request after the rotary buffers)."""
    index = {name: i for i, (name, _) in enumerate(allocations)}
    frees = []
    for p in table:
        for other in p.tied_names:
            first = index[p.name]
            allocations.append((f"to_empty.{other}", allocations[first][1]))
            copy = len(allocations) - 1
            frees.append((copy, (first,) if swapped else (copy,)))
    return tuple(frees)


def ddp_buckets(params: list[ParamInfo], order: list[int]) -> list[list[int]]:
    """DDP's bucket assignment (``_compute_bucket_assignment_by_size``): tensors taken in ``order``, one open
    bucket per dtype, closed once it holds at least its limit (1 MiB for the first, then 25 MiB)."""
    open_buckets: dict[int, list[int]] = {}
    sizes: dict[int, int] = {}
    limits: dict[int, int] = {}
    closed: list[list[int]] = []
    for i in order:
        p = params[i]
        key = p.elem_bytes
        open_buckets.setdefault(key, []).append(i)
        sizes[key] = sizes.get(key, 0) + p.nbytes
        if sizes[key] >= limits.get(key, DDP_FIRST_BUCKET_BYTES):
            closed.append(open_buckets.pop(key))
            sizes[key] = 0
            limits[key] = DDP_BUCKET_CAP_BYTES
    closed.extend(bucket for bucket in open_buckets.values() if bucket)
    return closed


def setup_allocations(table: list[ParamInfo], buffers: tuple[int, int], num_layers: int, method: str,
                      mixed: bool) -> Setup:
    """``buffers``: (non-layer bytes, bytes per layer)."""
    allocations: list[tuple[str, int]] = []
    ordered = model_order(table)
    for p in ordered:
        allocations.append((p.name, p.nbytes))
    non_layer_buffers, layer_buffers = buffers
    if layer_buffers:
        allocations.extend((f"buffers.{layer}", layer_buffers) for layer in range(num_layers))
    if non_layer_buffers:
        allocations.append(("buffers", non_layer_buffers))
    frees_after = to_empty_tied_copies(allocations, table, swapped=False) if method == "tp" else ()
    rebuilt: list[int] = []
    bucket_indices: list[int] = []
    if method == "ddp":
        trainable = [p for p in ordered if p.trainable]
        # Assigned in parameter order, then reversed: the reducer allocates the last parameters' bucket first.
        for bucket in reversed(sorted(ddp_buckets(trainable, list(range(len(trainable)))), key=min)):
            bucket_indices.append(len(allocations))
            allocations.append(("ddp_bucket", sum(trainable[i].nbytes for i in bucket)))
        ready = sorted(range(len(trainable)), key=lambda i: (trainable[i].backward_index is None,
                                                              trainable[i].backward_index or 0, -i))
        rebuilt = [sum(trainable[i].nbytes for i in bucket) for bucket in ddp_buckets(trainable, ready)]
    if mixed:  # MasterWeightOptimizer: p.detach().float() per trainable 16-bit parameter, optimizer by optimizer
        groups: dict[int, list[ParamInfo]] = {}
        for p in ordered:
            if p.trainable:
                groups.setdefault(p.opt_group, []).append(p)
        for group in (groups[k] for k in sorted(groups)):
            allocations.extend((f"master.{p.name}", 4 * p.numel) for p in group if p.elem_bytes < 4)
    return Setup(allocations, rebuilt, bucket_indices, frees_after)


@dataclass(frozen=True)
class StepPlan:
    """What one step allocates, keyed for a multi-step stream."""

    expansion: Expansion
    sizes: list[int]             # requested bytes by poly index at (b, s)
    batch_bytes: int             # each batch tensor
    workspace_bytes: int         # one cuBLAS workspace
    workspaces: int              # how many (forward thread, backward thread, ...)


def step_requests(plan: StepPlan, step: int, base_key: int) -> list[tuple]:
    """Requests of step ``step`` (0 = the first), keys offset by ``base_key`` + step x keys-per-step."""
    expansion = plan.expansion
    events = expansion.first if step == 0 else expansion.steady
    keys = events.keys
    offset = base_key + step * (keys + BATCH_TENSORS + plan.workspaces)
    previous = offset - (keys + BATCH_TENSORS + plan.workspaces)
    sizes = plan.sizes
    out: list[tuple] = [("alloc", offset + keys + t, plan.batch_bytes, 0) for t in range(BATCH_TENSORS)]
    if step:
        out.extend(("free", previous + keys + t) for t in range(BATCH_TENSORS))
    workspace_at = {}
    if step == 0 and plan.workspaces:
        forward, backward = expansion.workspace_at
        workspace_at = {forward: [0], backward: list(range(1, plan.workspaces))}
    for index, (kind, key, poly) in enumerate(events.ops):
        for w in workspace_at.get(index, ()):
            out.append(("alloc", offset + keys + BATCH_TENSORS + w, plan.workspace_bytes, 0))
        if kind == ALLOC or (kind > FREE_PREVIOUS and stream_of(kind)):
            out.append(("alloc", offset + key, sizes[poly], stream_of(kind)))
        elif kind == FREE:
            out.append(("free", offset + key))
        elif kind == FREE_PREVIOUS:
            out.append(("free", previous + key))
    return out


def micro_step_requests(plan: StepPlan, micro: MicroSteps, accum: int, step: int, base_key: int) -> list[tuple]:
    """Requests of micro-step ``step`` (0 = the first) of a run with an optimizer step every ``accum``
    micro-steps (``estimator.reserved.accumulate``), keys as ``step_requests`` gives them."""
    keys = plan.expansion.steady.keys
    per_step = keys + BATCH_TENSORS + plan.workspaces
    cycle, index = divmod(step, accum)
    offset = base_key + step * per_step
    previous, first_of_cycle = offset - per_step, base_key + cycle * accum * per_step
    out: list[tuple] = [("alloc", offset + keys + t, plan.batch_bytes, 0) for t in range(BATCH_TENSORS)]
    if step:
        out.extend(("free", previous + keys + t) for t in range(BATCH_TENSORS))
    workspace_at = {}
    if step == 0 and plan.workspaces:
        forward, backward = plan.expansion.workspace_at
        workspace_at = {forward: [0], backward: list(range(1, plan.workspaces))}
    for at, (kind, key, poly) in enumerate(micro.ops(cycle, index, accum)):
        for w in workspace_at.get(at, ()):
            out.append(("alloc", offset + keys + BATCH_TENSORS + w, plan.workspace_bytes, 0))
        if kind == ALLOC or (kind > FREE_PREVIOUS and stream_of(kind)):
            out.append(("alloc", offset + key, plan.sizes[poly], stream_of(kind)))
        elif kind == FREE:
            out.append(("free", offset + key))
        elif kind == FREE_PREVIOUS:
            out.append(("free", previous + key))
        elif kind == FREE_PREVIOUS_CYCLE:
            out.append(("free", first_of_cycle - accum * per_step + key))
        else:  # FREE_CYCLE
            out.append(("free", first_of_cycle + key))
    return out


def run_requests(plan: StepPlan, steps: int, accum: int = 1) -> list[tuple]:
    """Requests of ``steps`` optimizer steps of ``accum`` micro-steps each (the setup left out)."""
    if accum == 1:
        return [request for step in range(steps) for request in step_requests(plan, step, 0)]
    micro = micro_steps(plan.expansion)
    return [request for step in range(steps * accum) for request in micro_step_requests(plan, micro, accum, step, 0)]


def live_requested_peak(requests: list[tuple]) -> int:
    """The largest sum of requested bytes alive at once (the allocated level before the allocator rounds)."""
    size: dict = {}
    live = peak = 0
    for request in requests:
        if request[0] == "alloc":
            size[request[1]] = request[2]
            live += request[2]
            if live > peak:
                peak = live
        elif request[0] == "free":
            live -= size.pop(request[1])
    return peak
