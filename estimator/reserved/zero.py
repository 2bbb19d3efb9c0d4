"""A DeepSpeed ZeRO-1/2 rank's timeline as the caching allocator sees it: the single-GPU step at full depth
(``estimator.profiler.expand``) with DeepSpeed 0.19's own tensors (``deepspeed/runtime/zero/stage_1_and_2.py``),
contiguous gradients; with ``overlap_comm`` (off by default below stage 3; on in the Hugging Face examples' configs)
the reductions run on DeepSpeed's reduction stream.

Setup (``DeepSpeedZeroOptimizer.__init__``): the model full size on the device, each tensor on its own; the
trainable tensors flattened into one 16-bit buffer (``model.parameters()`` order, padded to 2 x world elements),
then each original freed as its parameter becomes a view of the buffer; the fp32 master partition
(``partition.clone().float()``: the 16-bit clone freed once cast; fp32 weights keep the clone); the fp32
gradient of ``initialize_optimizer_states``, made and dropped.

Each step, in backward (ZeRO-2: at each gradient's hook, in the order backward finishes them; ZeRO-1: after
backward, over the tensors in flat order):

* the first hook allocates the IPG bucket (``reduce_bucket_size`` elements of the 16-bit dtype);
* a gradient that would overflow the bucket flushes it first; the gradient is then copied into the bucket and
  its own storage freed, except an oversized one (more elements than the bucket), which keeps its storage;
* a flush reduces the bucket's slices (``average_tensor``): every slice of it concatenated into one buffer when
  there is more than one (``allreduce_bucket``'s flatten), freed after the reduction; then each gradient that
  overlaps this rank's partition is copied into ``grads_in_partition`` (allocated at the first one: every tensor
  that overlaps the partition, in full), an oversized one's storage freed then; an oversized gradient of another
  partition goes too (ZeRO-2; ZeRO-1 holds it until the end of the reduction);
* the epilogue flushes what is left and frees the bucket.

The optimizer step (after the loss is freed): an fp64 copy of each gradient piece of the partition for the norm,
one at a time; the partition's gradients flattened (16-bit) and cast to fp32, the flat copy then
``grads_in_partition`` freed; Adam over the one fp32 partition (its states on the first step, one ``sqrt``
temporary); the fp32 gradient freed.

Gradient accumulation: ZeRO-2 reduces every micro-step (a later micro-step's ``grads_in_partition`` is added into
the cycle's first); ZeRO-1 reduces at the boundary only, the gradients accumulating in ``.grad`` in the model's
dtype and the IPG bucket living the whole cycle (``_zero1_micro_steps``). Checked against real DeepSpeed CPU runs
on the fake process group
(``tests/estimator/test_reserved_zero.py``) and the H200's ZeRO ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from estimator.methods.state import ZeroLayout, zero_layout
from estimator.models.params import ParamInfo
from estimator.profiler.expand import ALLOC, FREE, Expansion, ExpansionError
from estimator.reserved.accumulate import FREE_CYCLE, MicroSteps, accumulating_backward
from estimator.reserved.fsdp import (
    BufferOps,
    Tensor,
    _Builder,
    _grads_by_group,
    boundary_marks,
    method_expansion,
)
from estimator.reserved.timeline import Setup, model_order, setup_allocations

FP32, FP64 = 4, 8
DEFAULT, REDUCTION = 0, 1  # allocator streams
STAGES = (1, 2)
OPTIMIZERS = ("adamw", "adamw_fused", "sgd")
PRECISIONS = ("mixed_bf16", "mixed_fp16", "fp32")


def offloads_optimizer(parallel) -> bool:
    """ZeRO-1/2 with the optimizer on the host (``cpu_offload`` in ``stage_1_and_2.py``): the zero_offload
    method (stage 2) or ``offload_optimizer`` set."""
    return parallel.method == "zero_offload" or parallel.zero.offload_optimizer


def why_not_zero(spec) -> str | None:
    """Why this ZeRO spec's reserved peak cannot be replayed (None: it can)."""
    parallel, training = spec.parallel, spec.training
    zcfg = parallel.zero
    if parallel.method not in ("zero1", "zero2", "zero_offload"):  # zero3: zero3.why_not_zero3
        return f"{parallel.method}: not in the replay yet"
    if offloads_optimizer(parallel):
        reason = _why_not_offload(spec)
        if reason is not None:
            return reason
    if not zcfg.contiguous_gradients:
        return "ZeRO without contiguous_gradients: not in the replay yet"
    if training.precision not in PRECISIONS:
        return f"ZeRO under {training.precision}: not in the replay yet"
    if training.optimizer not in OPTIMIZERS:
        return f"ZeRO with {training.optimizer}: its step over the partition is not in the replay yet"
    if training.qlora:
        return "ZeRO with QLoRA: its quantized base is not in the replay yet"
    if training.grad_accum_steps > 1 and parallel.method == "zero1" and zcfg.overlap_comm:
        return "ZeRO-1 with gradient accumulation and overlap_comm: not in the replay yet"
    return None


def _why_not_offload(spec) -> str | None:
    """The offloaded ZeRO-1/2 paths not in the replay (``_StepOffload``: checked on the H200's zero_offload
    ranks)."""
    parallel, training = spec.parallel, spec.training
    if parallel.zero_stage != 2:
        return "ZeRO-1 with optimizer offload: not checked against a run yet"
    if training.grad_accum_steps > 1:
        return ("ZeRO with optimizer offload and gradient accumulation: the gradients accumulate on the host "
                "through a GPU buffer (async_accumulate_grad_in_cpu_via_gpu), not in the replay yet")
    if training.precision not in ("mixed_bf16", "mixed_fp16"):
        return f"ZeRO with optimizer offload under {training.precision}: not in the replay yet"
    if training.lora or training.qlora:
        return "ZeRO with optimizer offload and LoRA: not checked against a run yet"
    if parallel.zero.overlap_comm_for(2):
        return "ZeRO with optimizer offload and overlap_comm: not checked against a run yet"
    return None


def zero_setup(table: list[ParamInfo], buffers: tuple[int, int], num_layers: int, world: int, elem16: int,
               offload: bool = False) -> Setup:
    """The model on the device, DeepSpeed's flattening and the rank's fp32 master partition (module docstring).
    With LoRA (16-bit adapters, ``estimator.models.profiles.adapters_in_16bit``): the base model first, then
    peft's adapters in fp32, then DeepSpeed's cast of each to 16 bits (the fp32 one freed). ``offload``
    (``offloads_optimizer``): the master partition and its gradient are made on the host (``self.device`` is the
    CPU), so the 16-bit clone the master is cast from goes at once; then ``temp_grad_buffer_for_gpu_offload``,
    ``largest_param_numel`` 16-bit elements on the GPU, for the life of the run."""
    frozen = [p for p in table if not p.trainable]
    base = setup_allocations(frozen or table, buffers, num_layers, "single", False)
    allocations = list(base.allocations)
    frees: list[tuple[int, tuple[int, ...]]] = []
    if frozen:
        adapters = [p for p in model_order(table) if p.trainable]
        fp32 = len(allocations)
        # peft makes them fp32; DeepSpeed casts 16-bit runs' (fp32 runs keep them as made)
        allocations += [(p.name if p.elem_bytes == FP32 else f"{p.name}.fp32", p.numel * FP32) for p in adapters]
        for j, p in enumerate(adapters):
            if p.elem_bytes < FP32:
                allocations.append((p.name, p.nbytes))
                frees.append((len(allocations) - 1, (fp32 + j,)))
    index = {name: i for i, (name, _) in enumerate(allocations)}
    layout = zero_layout(table, world)
    partition = layout.partition_numel
    allocations.append(("zero.flat", partition * world * elem16))
    frees.append((len(allocations) - 1, tuple(index[p.name] for p in layout.flat if p.name in index)))
    allocations.append(("zero.partition_clone", partition * elem16))
    if offload:
        frees.append((len(allocations) - 1, (len(allocations) - 1,)))
        largest = max(p.numel for p in table if p.trainable)
        allocations.append(("zero.temp_grad_buffer_for_gpu_offload", largest * elem16))
        return Setup(allocations, [], [], tuple(frees))
    if elem16 != FP32:
        allocations.append(("zero.master", partition * FP32))
        frees.append((len(allocations) - 1, (len(allocations) - 2,)))
    allocations.append(("zero.initial_grad", partition * FP32))
    frees.append((len(allocations) - 1, (len(allocations) - 1,)))
    return Setup(allocations, [], [], tuple(frees))


class _Step(BufferOps):
    """One step's DeepSpeed tensors and the ops that make and free them (module docstring)."""

    def __init__(self, build: _Builder, layout: ZeroLayout, rank: int, stage: int, elem16: int, bucket: int,
                 grad_of: dict, first: bool, optimizer: str, overlap: bool = False, micro: str = "only") -> None:
        super().__init__(build)
        self.micro = micro  # "only" (no accumulation), "first" or "later" micro-step of an accumulation cycle
        self.layout, self.rank, self.stage, self.elem16, self.bucket_numel = layout, rank, stage, elem16, bucket
        # overlap_comm: two buckets (one filling while the other reduces); the reduction and the copies into the
        # partition run on the reduction stream, whose allocations have their own pools
        self.overlap, self.reduce_stream = overlap, REDUCTION if overlap else DEFAULT
        # process_gradients: ZeRO-2, or any stage with overlap_comm, reduces in each gradient's hook
        self.reduces_in_backward = stage == 2 or overlap
        self.grad_of, self.first, self.optimizer = grad_of, first, optimizer
        self.flat_index = {id(p): k for k, p in enumerate(layout.flat)}
        self.ipg: list[Tensor] | None = None
        self.in_partition: Tensor | None = None
        self.pending: list[ParamInfo] = []
        self.elements = 0
        self.oversized: ParamInfo | None = None
        self.held: list[ParamInfo] = []   # ZeRO-1: oversized gradients of other partitions, to the epilogue
        self.mine = [k for k, _ in enumerate(layout.flat) if rank in layout.ranks_of(k)]
        # the partition's tail past the last tensor (the last rank's: the buffer is padded to 2 x world)
        end = sum(p.numel for p in layout.flat)
        self.pad_numel = max(0, min((rank + 1) * layout.partition_numel, layout.partition_numel * layout.world)
                             - max(end, rank * layout.partition_numel))
        self.pad: Tensor | None = None

    def _free_grad(self, out: list, p: ParamInfo) -> None:
        key, size_index = self.grad_of[id(p)]
        out.append((FREE, key, size_index))

    def hook(self, out: list, p: ParamInfo) -> None:
        """``reduce_independent_p_g_buckets_and_remove_grads`` for one gradient (after ``setup_buckets``)."""
        if p.numel == 0:
            return
        self.setup_buckets(out)
        if self.elements + p.numel > self.bucket_numel:
            self.flush(out)
        if p.numel > self.bucket_numel:
            self.oversized = p
        else:
            self._free_grad(out, p)  # copied into the bucket; the gradient becomes a view of it
        self.pending.append(p)
        self.elements += p.numel

    def setup_buckets(self, out: list) -> None:
        if self.ipg is None:
            self.ipg = [self._alloc(out, self.bucket_numel * self.elem16) for _ in range(1 + self.overlap)]

    def _pending_slices(self) -> list[list[int]]:
        """[partition, elements] of the pending gradients, consecutive pieces of one partition merged."""
        slices: list[list[int]] = []
        for p in self.pending:
            for partition, numel in self.layout.pieces(self.flat_index[id(p)]):
                if slices and slices[-1][0] == partition:
                    slices[-1][1] += numel
                else:
                    slices.append([partition, numel])
        return slices

    def flush(self, out: list) -> None:
        """``reduce_ipg_grads``: the slices reduced (one concatenation when there are several), then copied."""
        self._reduce_pending(out)
        for p in self.pending:
            mine = self.rank in self.layout.ranks_of(self.flat_index[id(p)])
            if mine and self.in_partition is None:
                numel = sum(self.layout.flat[k].numel for k in self.mine)
                self.in_partition = self._alloc(out, numel * self.elem16, self.reduce_stream)
            if p is self.oversized:
                if mine or self.stage == 2:
                    self._free_grad(out, p)
                else:
                    self.held.append(p)
        self.pending, self.elements, self.oversized = [], 0, None

    def _reduce_pending(self, out: list) -> None:
        chunk: list[int] = []
        for _, numel in self._pending_slices():  # allreduce_and_scatter: chunks of just over reduce_bucket_size
            chunk.append(numel)
            if sum(chunk) > self.bucket_numel:
                self._concatenate(out, chunk)
                chunk = []
        self._concatenate(out, chunk)

    def _concatenate(self, out: list, chunk: list[int]) -> None:
        if len(chunk) > 1:  # one tensor is flattened as a view
            self._free(out, self._alloc(out, sum(chunk) * self.elem16, self.reduce_stream))

    def epilogue(self, out: list) -> None:
        """``independent_gradient_partition_epilogue``: the last flush, the bucket freed, then every gradient
        attribute cleared. Under accumulation (``micro``): a micro-step after the cycle's first adds its
        ``grads_in_partition`` into the first's and frees it here; the zero pad of the accumulation boundary
        (a few bytes) is left out."""
        self.flush(out)
        if self.pad_numel and self.micro == "only":  # get_flat_partition pads the gradient list with zeros
            self.pad = self._alloc(out, self.pad_numel * self.elem16)
        for bucket in self.ipg or ():  # overlap_comm: freed after a synchronize, so at once
            self._free(out, bucket)
        self.ipg = None
        if self.micro == "later" and self.in_partition is not None:
            self._free(out, self.in_partition)
            self.in_partition = None
        for p in self.held:
            self._free_grad(out, p)
        self.held = []

    def optimizer_step(self, out: list) -> None:
        """The norm's fp64 copies, the flat fp32 gradient, the optimizer over the partition (module docstring)."""
        partition = self.layout.partition_numel
        for k in self.mine:
            numel = dict(self.layout.pieces(k))[self.rank]
            self._free(out, self._alloc(out, numel * FP64))
        # flatten: one piece is viewed, not copied; an fp32 gradient is not cast (the flat tensor, or that view)
        flat = self._alloc(out, partition * self.elem16) if len(self.mine) + bool(self.pad) > 1 else None
        grad32 = self._alloc(out, partition * FP32) if self.elem16 != FP32 else flat
        if flat is not None and grad32 is not flat:
            self._free(out, flat)
        held = self.in_partition if grad32 is None else None  # the fp32 view keeps grads_in_partition alive
        if self.in_partition is not None and held is None:
            self._free(out, self.in_partition)
        self.in_partition = None
        if self.pad is not None:
            self._free(out, self.pad)
            self.pad = None
        self.adamw(out, [partition * FP32], self.first, self.optimizer)
        for tensor in (grad32, held):
            if tensor is not None:
                self._free(out, tensor)


class _StepOffload(_Step):
    """ZeRO-2 with the optimizer on the host (``cpu_offload``). A flush reduces as without offload, but
    ``copy_grads_in_partition`` makes no ``grads_in_partition``: for each gradient of the bucket that overlaps
    the rank's partition, in the bucket's order, ``set_norm_for_param_grad_in_gpu`` casts its piece to fp64 for
    the norm (freed once taken) and ``async_inplace_copy_grad_to_fp32_buffer_from_gpu`` casts it to fp32 for the
    copy into the host's fp32 gradient (freed after the copy). So a rank whose partition holds a large tensor
    (the embedding, first in the flat buffer: rank 0's) makes that piece's fp64 and fp32 copies, the ranks' peaks
    differ. The optimizer steps on the host; its copy into the 16-bit partition and the all-gather make nothing
    on the GPU. The norm's scalars and the overflow check's temporaries (a few bytes) are left out."""

    def flush(self, out: list) -> None:
        self._reduce_pending(out)
        for p in self.pending:
            k = self.flat_index[id(p)]
            if self.rank in self.layout.ranks_of(k):
                numel = dict(self.layout.pieces(k))[self.rank]
                self._free(out, self._alloc(out, numel * FP64, self.reduce_stream))
                self._free(out, self._alloc(out, numel * FP32, self.reduce_stream))
            if p is self.oversized:
                self._free_grad(out, p)
        self.pending, self.elements, self.oversized = [], 0, None

    def epilogue(self, out: list) -> None:
        self.flush(out)
        for bucket in self.ipg or ():
            self._free(out, bucket)
        self.ipg = None

    def optimizer_step(self, out: list) -> None:
        return None


def _grad_params(expansion: Expansion, ops: list, table: list[ParamInfo]) -> dict:
    """id(ParamInfo) -> (gradient key, size index) of this step's gradients."""
    by_group: dict = {}
    for p in table:
        if p.trainable:
            by_group.setdefault("root" if p.layer is None else p.layer, []).append(p)
    out = {}
    for g, grads in _grads_by_group(expansion, ops, table).items():
        for p, grad in zip(by_group.get(g, []), grads):
            out[id(p)] = grad
    return out


def _reduce_after_backward(out: list, step: _Step) -> None:
    """ZeRO-1's ``reduce_gradients`` after backward (in flat order; ZeRO-2 reduced in the hooks), then the
    epilogue."""
    if not step.reduces_in_backward:
        for p in step.layout.flat:
            if id(p) in step.grad_of:
                step.hook(out, p)
    step.epilogue(out)


def _backward_ops(expansion: Expansion, ops: list, marks: tuple, table: list[ParamInfo], step: _Step, polys: list,
                  boundary: bool = True) -> tuple[list, dict[int, int], list]:
    """The ZeRO step's forward and backward with DeepSpeed's events, where each old op index went, and the
    frees that precede the optimizer step (the loss). ``boundary`` False: a ZeRO-1 micro-step before the
    accumulation boundary, whose gradients stay in ``.grad`` unreduced (the hooks only set up the bucket)."""
    grad_keys = expansion.grad_keys
    scalar = {i for i, poly in enumerate(polys) if 0 < poly[0] <= 8 and not any(poly[1:])}
    cut, _at_mark, _seed = boundary_marks(ops, marks, scalar)
    param_of_key = {step.grad_of[id(p)][0]: p for p in table if id(p) in step.grad_of}
    out: list = []
    moved: dict[int, int] = {}
    # Gradients whose hooks are due: AccumulateGrad runs once the node that made the gradient is done (its other
    # outputs allocated, its saved tensors released), i.e. at the next allocation after a free.
    ready: list[ParamInfo] = []
    released = False
    for index, op in enumerate(ops[:cut]):
        if ready and op[0] == FREE:
            released = True
        elif ready and released:
            for p in ready:
                step.hook(out, p) if step.reduces_in_backward else step.setup_buckets(out)
            ready, released = [], False
        moved[index] = len(out)
        if op[0] == FREE and op[1] in grad_keys:  # DeepSpeed frees the gradients itself
            continue
        out.append(op)
        if op[0] == ALLOC and op[1] in param_of_key:
            ready.append(param_of_key[op[1]])
    for p in ready:
        step.hook(out, p) if step.reduces_in_backward else step.setup_buckets(out)
    if boundary:
        _reduce_after_backward(out, step)
    moved[cut] = len(out)
    made = {op[1] for op in ops[:cut] if op[0] == ALLOC}
    return out, moved, [op for op in ops[cut:] if op[0] == FREE and op[1] in made and op[1] not in grad_keys]


@dataclass(frozen=True)
class ZeroStep:
    expansion: Expansion
    sizes: list[int]  # bytes of DeepSpeed's tensors, size indices ``base`` + j


def zero_step(expansion: Expansion, table: list[ParamInfo], world: int, rank: int, stage: int, elem16: int,
              bucket_numel: int, optimizer: str, base_size_index: int, polys: list, overlap: bool = False,
              accumulating: bool = False, offload: bool = False) -> ZeroStep:
    """The expansion with DeepSpeed's events for ``rank``; new tensors' sizes take indices from
    ``base_size_index`` on. ExpansionError where the step cannot be built."""
    if stage not in STAGES:
        raise ExpansionError(f"zero: stage {stage} is not in the replay")
    if optimizer not in OPTIMIZERS:
        raise ExpansionError(f"zero: the {optimizer} optimizer's step over the partition is not modelled")
    layout = zero_layout(table, world)
    build = _Builder(expansion.steady.keys, base_size_index)
    first_marks, steady_marks = expansion.marks
    start, ends = build.next_key, []

    def built(first: bool, micro: str) -> tuple[list, dict[int, int], list, list, set[int]]:
        """(forward and backward, moved indices, the loss's frees, the optimizer step, the key of the
        ``grads_in_partition`` backward leaves to it) of one kind of step; every kind's DeepSpeed tensors take
        the same keys, in the same order."""
        events, marks = (expansion.first, first_marks) if first else (expansion.steady, steady_marks)
        build.next_key = start
        step = (_StepOffload if offload else _Step)(build, layout, rank, stage, elem16, int(bucket_numel),
                                                    _grad_params(expansion, events.ops, table), first, optimizer,
                                                    overlap, micro)
        body, moved, loss = _backward_ops(expansion, events.ops, marks, table, step, polys)
        kept = {step.in_partition.key} if step.in_partition is not None else set()
        tail: list = []
        step.optimizer_step(tail)
        ends.append(build.next_key)
        return body, moved, loss, tail, kept

    (first_body, first_moved, first_loss, first_tail, _), (body, _, loss, tail, _) = (built(True, "only"),
                                                                                    built(False, "only"))
    micro = None
    if accumulating and stage == 1:
        if overlap:
            raise ExpansionError("zero: ZeRO-1 with gradient accumulation and overlap_comm is not in the replay")
        micro = _zero1_micro_steps(expansion, table, layout, build, start, rank, elem16, int(bucket_numel),
                                   optimizer, polys, ends)
    elif accumulating:
        head_first, _, _, first_cycle_tail, in_partition = built(True, "first")
        head, _, _, cycle_tail, _ = built(False, "first")
        middle = built(False, "later")[0]
        micro = MicroSteps(first_head=head_first, head=head, middle=middle, before_optimizer=loss,
                           first_tail=first_loss + _cycle_frees(first_cycle_tail, in_partition),
                           tail=loss + _cycle_frees(cycle_tail, in_partition))
    first_ops, steady_ops = first_body + first_loss + first_tail, body + loss + tail
    optimizer_at = (len(first_body) + len(first_loss), len(body) + len(loss))
    return ZeroStep(expansion=method_expansion("zero", expansion, first_ops, steady_ops, max(ends), first_moved,
                                               optimizer_at, micro=micro), sizes=build.sizes)


def _zero1_micro_steps(expansion: Expansion, table: list[ParamInfo], layout: ZeroLayout, build: _Builder,
                       start: int, rank: int, elem16: int, bucket_numel: int, optimizer: str, polys: list,
                       ends: list) -> MicroSteps:
    """ZeRO-1 under gradient accumulation (``DeepSpeedEngine.allreduce_gradients``: stage 1 reduces at the
    boundary only). Every micro-step's hooks run ``setup_buckets``, which allocates the IPG bucket once per cycle
    (``ready_for_gradients`` is reset by the boundary's epilogue); the gradients accumulate in ``.grad`` in the
    model's dtype (DeepSpeed's ``grad_accum_dtype`` defaults to it); the last micro-step's backward is followed by
    the reduction in flat order, which frees the accumulated gradients and, in its epilogue, the bucket (both made
    by the cycle's first micro-step: ``FREE_CYCLE``), then the optimizer step."""
    first_marks, steady_marks = expansion.marks
    grad_keys = expansion.grad_keys

    def step_of(first: bool) -> _Step:
        ops = (expansion.first if first else expansion.steady).ops
        return _Step(build, layout, rank, 1, elem16, bucket_numel, _grad_params(expansion, ops, table), first,
                     optimizer)

    def head(first: bool) -> tuple[list, list, _Step]:
        build.next_key = start
        events, marks = (expansion.first, first_marks) if first else (expansion.steady, steady_marks)
        step = step_of(first)
        body, _, loss = _backward_ops(expansion, events.ops, marks, table, step, polys, boundary=False)
        return body, loss, step

    def tail(first: bool, owner: _Step) -> list:
        """The boundary's reduction and the optimizer step, after the last micro-step's backward."""
        step = step_of(first)
        step.ipg = owner.ipg
        out: list = []
        _reduce_after_backward(out, step)
        out = _cycle_frees(out, set(grad_keys) | {t.key for t in owner.ipg or ()})
        step.optimizer_step(out)
        ends.append(build.next_key)
        return out

    first_head, first_loss, first_step = head(True)
    steady_head, loss, steady_step = head(False)
    middle_step = step_of(False)
    middle_step.ipg = steady_step.ipg  # set up by the cycle's first micro-step
    middle, _, _ = _backward_ops(expansion, expansion.steady.ops, steady_marks, table, middle_step, polys,
                                 boundary=False)
    return MicroSteps(first_head=first_head, head=steady_head, middle=accumulating_backward(middle, grad_keys),
                      before_optimizer=loss, first_tail=first_loss + tail(True, first_step),
                      tail=loss + tail(False, steady_step))


def _cycle_frees(ops: list, kept: set[int]) -> list:
    """The optimizer step of an accumulation cycle's last micro-step: what it frees of ``kept`` (the cycle's
    first ``grads_in_partition``) was allocated by the cycle's first micro-step."""
    return [(FREE_CYCLE, key, poly) if kind == FREE and key in kept else (kind, key, poly) for kind, key, poly in ops]
