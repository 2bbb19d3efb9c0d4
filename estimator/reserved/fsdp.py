"""An FSDP2 rank's step as the caching allocator sees it: the single-GPU step at full depth
(``estimator.profiler.expand``) with FSDP2's buffers added at the layer boundaries, on their own streams.

``fully_shard`` per decoder layer, then the root (everything else), torch 2.13
(``torch.distributed.fsdp._fully_shard``); the same boundaries as ``estimator.methods.fsdp_replay``, whose
allocated peak the replay reproduces, here tensor by tensor (checked against a real CPU run on the fake process
group, event for event: ``tests/estimator/test_reserved_fsdp.py``). Per group, in parameter order:

* all-gather (``foreach_all_gather``), on the all-gather copy-in stream: under a mixed-precision policy a
  16-bit copy of the shards (``_get_param_all_gather_inputs``' foreach-copy input), then the all-gather output
  (N x the padded shards), then the copy freed;
* copy-out (``wait_for_unshard``), on the default stream: each parameter's unsharded tensor (N x its padded
  shard; ``alloc_storage``), then the previous group's all-gather output freed in forward (kept one group longer
  for stream ordering; the last layer's at the root's post-forward), the group's own in backward; backward
  prefetches the next layer's all-gather after each copy-out;
* reshard: the unsharded tensors freed (post-forward for layers; the root's at its post-backward);
* post-backward (``foreach_reduce``): the previous group's reduce-scatter input freed, this one's allocated on
  the default stream (N x the padded shards of the trainable tensors, in the reduce dtype), the unsharded
  gradients freed (``unsharded_grads.clear()`` drops them last to first; the last one stays referenced by the
  loop variable until the reduce-scatter output is allocated), the output (one shard) allocated on the
  reduce-scatter stream: every sharded gradient of the group is a view of it, so ``zero_grad`` frees it when it
  reaches the group's last parameter.

The optimizer steps the shards (``foreach`` AdamW: ``exp_avg``/``exp_avg_sq`` per tensor on the first step,
one ``sqrt`` temporary per tensor, freed last to first). Each stream has its own pools in the allocator model:
blocks freed on one are never reused by another (FSDP2 keeps references instead of ``record_stream``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from estimator.models.params import ParamInfo
from estimator.profiler.expand import (
    ALLOC,
    FREE,
    FREE_PREVIOUS,
    Expansion,
    ExpansionError,
    StepEvents,
    alloc_on,
    check_step,
)
from estimator.reserved.accumulate import FREE_CYCLE, KeyedBuilds, MicroSteps, accumulating_backward
from estimator.reserved.timeline import Setup, model_order, to_empty_tied_copies

DEFAULT, ALL_GATHER, REDUCE_SCATTER = 0, 1, 2  # allocator streams
FP32 = 4
OPTIMIZERS = ("adamw", "adamw_fused", "sgd")
# A micro-batch's post-backward: SYNC reduce-scatters its gradients; under ``set_requires_gradient_sync(False)``
# (grad_sync last) HOLD keeps them unsharded (the cycle's first), HOLD_ADD adds them into the held ones, and
# REDUCE_HELD (the last) adds them and reduce-scatters the held ones (``_no_sync_micro_steps``)
SYNC, HOLD, HOLD_ADD, REDUCE_HELD = "sync", "hold", "hold_add", "reduce_held"


@dataclass(frozen=True)
class Tensor:
    key: int
    size_index: int


@dataclass(frozen=True)
class FsdpStep:
    expansion: Expansion
    sizes: list[int]  # bytes of the FSDP tensors, size indices ``base`` + j


class _Builder:
    """Keys and sizes of the FSDP tensors of one step, appended after the expansion's."""

    def __init__(self, first_key: int, base: int) -> None:
        self.next_key, self.base = first_key, base
        self.sizes: list[int] = []
        self._size_index: dict[int, int] = {}

    def tensor(self, nbytes: int, key: int | None = None) -> Tensor:
        """A new tensor of ``nbytes``: the next key, or ``key`` where the caller reserved one (``reserve``)."""
        index = self._size_index.get(nbytes)
        if index is None:
            index = self._size_index[nbytes] = self.base + len(self.sizes)
            self.sizes.append(nbytes)
        if key is None:
            key, self.next_key = self.next_key, self.next_key + 1
        return Tensor(key, index)

    def reserve(self, count: int) -> list[int]:
        """``count`` keys set aside for tensors that must keep one key across differently ordered steps."""
        keys = list(range(self.next_key, self.next_key + count))
        self.next_key += count
        return keys


def shard_numel(p: ParamInfo, world: int) -> int:
    """Elements of rank 0's padded dim-0 shard (every rank stores ceil(d0 / N) rows)."""
    rows = p.shape[0] if p.shape else 1
    return math.ceil(rows / world) * (p.numel // rows if rows else 0)


@dataclass(frozen=True)
class _Group:
    params: list[ParamInfo]     # model.parameters() order
    trainable: list[ParamInfo]
    gather_bytes: int           # all-gather output
    copy_in_bytes: int          # the 16-bit copy of the shards (mixed precision), 0 without
    reduce_in_bytes: int        # reduce-scatter input, 0 for a frozen group
    # each trainable tensor's unsharded gradient held under no sync in the reduce dtype (mixed precision), in the
    # order of its gradient keys (``_grads_by_group``: the table's)
    held_bytes: tuple[int, ...] = ()


def _group(params: list[ParamInfo], world: int, mixed: bool, table_order: list[ParamInfo] = ()) -> _Group:
    shards = [shard_numel(p, world) for p in params]
    trainable = [p for p in params if p.trainable]
    reduce_elem = (lambda p: FP32) if mixed else (lambda p: p.elem_bytes)
    return _Group(params=params, trainable=trainable,
                  gather_bytes=world * sum(n * p.elem_bytes for n, p in zip(shards, params)),
                  copy_in_bytes=sum(n * p.elem_bytes for n, p in zip(shards, params)) if mixed else 0,
                  reduce_in_bytes=world * sum(shard_numel(p, world) * reduce_elem(p) for p in trainable),
                  held_bytes=tuple(p.numel * reduce_elem(p) for p in table_order if p.trainable))


def fsdp_setup(table: list[ParamInfo], buffers: tuple[int, int], num_layers: int, world: int, mixed: bool
               ) -> Setup:
    """Each parameter's padded shard (fp32 under mixed precision) in ``model.parameters()`` order, as
    ``to_empty`` after ``fully_shard`` on a meta model creates them, then the module buffers."""
    allocations = [(p.name, shard_numel(p, world) * (FP32 if mixed else p.elem_bytes)) for p in model_order(table)]
    non_layer, per_layer = buffers
    if per_layer:
        allocations.extend((f"buffers.{layer}", per_layer) for layer in range(num_layers))
    if non_layer:
        allocations.append(("buffers", non_layer))
    return Setup(allocations, [], [], to_empty_tied_copies(allocations, table, swapped=True))


class BufferOps:
    """Allocations and frees of a method's own tensors, keyed after the expansion's (``_Builder``)."""

    def __init__(self, build: _Builder) -> None:
        self.build = build

    def _alloc(self, out: list, nbytes: int, stream: int = DEFAULT, key: int | None = None) -> Tensor:
        tensor = self.build.tensor(nbytes, key)
        out.append((ALLOC if stream == DEFAULT else alloc_on(stream), tensor.key, tensor.size_index))
        return tensor

    @staticmethod
    def _free(out: list, tensor: Tensor) -> None:
        out.append((FREE, tensor.key, tensor.size_index))

    def _staged(self, out: list, staging: tuple[int, int], nbytes: int, stream: int) -> Tensor:
        """A collective's output allocated after its input's 16-bit staging copy (bytes, stream; 0 bytes: none),
        which is freed once the output exists."""
        copy = self._alloc(out, staging[0], staging[1]) if staging[0] else None
        tensor = self._alloc(out, nbytes, stream)
        if copy is not None:
            self._free(out, copy)
        return tensor

    def adamw(self, out: list, tensor_bytes: list[int], first: bool, optimizer: str) -> None:
        """``foreach`` AdamW over tensors of these bytes, in order: the states on the first step, one ``sqrt``
        temporary per tensor, freed last to first (``fused``: no temporaries; SGD: neither)."""
        if first and optimizer in ("adamw", "adamw_fused"):
            for nbytes in tensor_bytes:
                self._alloc(out, nbytes)
                self._alloc(out, nbytes)
        if optimizer == "adamw":
            temps = [self._alloc(out, nbytes) for nbytes in tensor_bytes]
            for tensor in reversed(temps):
                self._free(out, tensor)


def boundary_marks(ops: list, marks: tuple, scalar: set[int]) -> tuple[int, dict[int, list], tuple | None]:
    """(where the optimizer part begins, the segment instances starting at each op index, with backward's
    start as ``engine_start``, backward's seed allocation or None)."""
    cut = next(at for name, _layer, at in marks if name == "optimizer_pre")
    at_mark: dict[int, list] = {}
    seed = None
    for name, layer, at in marks:
        if name not in ("optimizer_pre", "optimizer"):
            at_mark.setdefault(at, []).append((name, layer))
        if name == "mid_bw":
            start = _engine_start(ops, at, scalar)
            at_mark.setdefault(start, []).append(("engine_start", None))
            seed = ops[start - 1] if start > at else None
    return cut, at_mark, seed


class _Step(BufferOps):
    """One step's FSDP2 tensors and the ops that make and free them."""

    def __init__(self, build: _Builder, groups: dict, world: int, grads: dict, first: bool, optimizer: str,
                 mixed: bool, micro: str = SYNC, held: dict | None = None) -> None:
        super().__init__(build)
        self.groups, self.world, self.grads = groups, world, grads
        self.first, self.optimizer, self.mixed = first, optimizer, mixed
        self.micro = micro
        self.held: dict = dict(held or {})  # group -> (key, size index) of its held unsharded gradients
        self.gathered: dict = {}     # group -> all-gather output
        self.unsharded: dict = {}    # group -> unsharded tensors
        self.reduce_in: Tensor | None = None
        self.reduce_out: dict = {}   # group -> reduce-scatter output (its sharded gradients)
        self.reduce_out_keys: set[int] = set()

    def all_gather(self, out: list, g) -> None:
        group = self.groups[g]
        self.gathered[g] = self._staged(out, (group.copy_in_bytes, ALL_GATHER), group.gather_bytes, ALL_GATHER)

    def free_gathered(self, out: list, g) -> None:
        self._free(out, self.gathered.pop(g))

    def copy_out(self, out: list, g) -> None:
        self.unsharded[g] = [self._alloc(out, self.world * shard_numel(p, self.world) * p.elem_bytes)
                             for p in self.groups[g].params]

    def reshard(self, out: list, g) -> None:
        for tensor in self.unsharded.pop(g):
            self._free(out, tensor)

    def post_backward(self, out: list, g) -> None:
        """Reshard (layers: ``reshard_after_backward``; the root likewise) and reduce-scatter the gradients, or
        under no sync hold them (``_hold``)."""
        grads, free = self.grads.get(g, []), FREE
        if self.mixed and self.micro in (HOLD_ADD, REDUCE_HELD):
            # ``accumulate_unsharded_grad_if_needed``: each new 16-bit gradient added into its held reduce-dtype
            # copy in place, then dropped
            for key, size_index in grads:
                out.append((FREE, key, size_index))
        if self.micro in (HOLD, HOLD_ADD):
            self._hold(out, g, grads)
            return
        if self.micro == REDUCE_HELD:  # the cycle's first micro-batch's tensors, kept to here
            grads, free = self.held.pop(g, []), FREE_CYCLE
        self.reshard(out, g)
        if self.reduce_in is not None:  # at most one reduce-scatter input in flight, even past a frozen group
            self._free(out, self.reduce_in)
            self.reduce_in = None
        group = self.groups[g]
        if not group.trainable:
            return
        self.reduce_in = self._alloc(out, group.reduce_in_bytes)
        for key, size_index in grads[-2::-1]:
            out.append((free, key, size_index))
        self.reduce_out[g] = self._alloc(out, group.reduce_in_bytes // self.world, REDUCE_SCATTER)
        self.reduce_out_keys.add(self.reduce_out[g].key)
        if grads:
            out.append((free, *grads[-1]))

    def _hold(self, out: list, g, grads: list) -> None:
        """A micro-batch under no sync: reshard and return. The cycle's first keeps each unsharded gradient: under
        mixed precision a copy in the reduce dtype (``to_accumulated_grad_if_needed``: made, then the 16-bit
        ``.grad`` dropped, parameter by parameter), else autograd's ``.grad`` itself (into which later
        micro-batches' gradients are added in place: ``_no_sync_micro_steps``)."""
        self.reshard(out, g)
        if self.micro != HOLD or not grads:
            return
        if not self.mixed:
            self.held[g] = list(grads)
            return
        held = []
        for (key, size_index), nbytes in zip(grads, self.groups[g].held_bytes):
            held.append(self._alloc(out, nbytes))
            out.append((FREE, key, size_index))
        self.held[g] = [(tensor.key, tensor.size_index) for tensor in held]

    def end_backward(self, out: list) -> None:
        if self.reduce_in is not None:
            self._free(out, self.reduce_in)
            self.reduce_in = None

    def optimizer_step(self, out: list, order: list[ParamInfo]) -> None:
        """AdamW over the shards (``BufferOps.adamw``)."""
        elem = (lambda p: FP32) if self.mixed else (lambda p: p.elem_bytes)
        self.adamw(out, [shard_numel(p, self.world) * elem(p) for p in order if p.trainable], self.first,
                   self.optimizer)

    def zero_grad(self, out: list, order: list[ParamInfo], group_of) -> None:
        """``set_to_none``: a group's reduce-scatter output goes with its last parameter's gradient."""
        last = {}
        for p in order:
            if p.trainable:
                last[group_of(p)] = p.name
        for p in order:
            g = group_of(p)
            if p.trainable and last[g] == p.name and g in self.reduce_out:
                self._free(out, self.reduce_out.pop(g))


def _group_of(p: ParamInfo):
    return "root" if p.layer is None else p.layer


def _grads_by_group(expansion: Expansion, ops: list, table: list[ParamInfo]) -> dict:
    """Each group's gradient keys (with their size index) in ``model.parameters()`` order: the backward makes a
    layer's gradients in its parameters' backward order (``ParamInfo.backward_index``), else taken as made."""
    layer_of = dict(expansion.grad_layers)
    made: dict = {}
    for kind, key, poly in ops:
        if kind == ALLOC and key in layer_of:
            g = "root" if layer_of[key] is None else layer_of[key]
            made.setdefault(g, []).append((key, poly))
    by_group: dict = {}
    for p in table:
        if p.trainable:
            by_group.setdefault(_group_of(p), []).append(p)
    out = {}
    for g, grads in made.items():
        params = by_group.get(g, [])
        if len(params) != len(grads):
            raise ExpansionError(f"fsdp: {len(grads)} gradients made for {len(params)} trainable tensors of "
                                 f"group {g}")
        if all(p.backward_index is not None for p in params):
            backward = sorted(range(len(params)), key=lambda i: params[i].backward_index)
            in_order = [None] * len(params)
            for made_at, i in enumerate(backward):
                in_order[i] = grads[made_at]
            grads = in_order
        out[g] = grads
    return out


def _boundary(step: _Step, out: list, name: str, layer: int | None, num_layers: int, first_layer_hooked: bool
              ) -> None:
    """FSDP2's events at the start of a segment instance (``fsdp_replay._boundary_events``, tensor by tensor).
    ``first_layer_hooked``: layer 0's forward inputs require grad, so its post-backward runs as its backward
    ends; else (a frozen embedding without checkpointing) in backward's final callback, after the root's."""
    last = num_layers - 1
    if name == "prefix":
        step.all_gather(out, "root")
        step.copy_out(out, "root")
    elif name in ("fw_first", "fw", "fw_last"):
        previous = "root" if layer == 0 else layer - 1
        if layer:
            step.reshard(out, layer - 1)
        step.all_gather(out, layer)
        step.copy_out(out, layer)
        step.free_gathered(out, previous)
    elif name == "mid_fw":
        step.reshard(out, last)
    elif name == "mid_bw":  # the root's post-forward frees the last gather
        step.free_gathered(out, last)
    elif name == "engine_start":  # the root's pre-backward: the last layer's all-gather
        step.all_gather(out, last)
    elif name in ("bw_first", "bw", "bw_last"):
        if layer != last:
            step.post_backward(out, layer + 1)
        step.copy_out(out, layer)
        step.free_gathered(out, layer)
        if layer > 0:
            step.all_gather(out, layer - 1)
    elif name == "suffix":
        if first_layer_hooked:
            step.post_backward(out, 0)
    else:
        raise ExpansionError(f"fsdp: no boundary events for segment {name!r}")


def _engine_start(ops: list, at: int, scalar: set[int]) -> int:
    """Where backward's hooks can first run: after ``loss.backward()`` made its seed (the segment's first
    allocation when it is a scalar), past a manual loop's frees of the previous outputs."""
    i = at
    while i < len(ops) and ops[i][0] in (FREE, FREE_PREVIOUS):
        i += 1
    return i + 1 if i < len(ops) and ops[i][0] == ALLOC and ops[i][2] in scalar else at


def _step_ops(expansion: Expansion, ops: list, marks: tuple, build: _Builder, groups: dict, table: list,
              world: int, optimizer: str, mixed: bool, first: bool, num_layers: int, scalar: set[int],
              first_layer_hooked: bool, micro: str = SYNC, held: dict | None = None
              ) -> tuple[list, dict[int, int], int, int, set[int], dict]:
    """The FSDP2 step's ops, where each old op index went, where its optimizer part begins (backward's last
    reduce-scatter done), where the optimizer's own ops begin (the loss freed), the keys of the reduce-scatter
    outputs and the gradients held (no sync). ``scalar``: size indices of constant bytes that hold one scalar;
    ``micro``, ``held``: the micro-batch's kind and the gradients the cycle's first held (``_no_sync_micro_steps``)."""
    step = _Step(build, groups, world, _grads_by_group(expansion, ops, table), first, optimizer, mixed, micro, held)
    grad_keys = expansion.grad_keys
    cut, at_mark, seed = boundary_marks(ops, marks, scalar)
    out: list = []
    moved: dict[int, int] = {}
    seed_free = None
    for index, op in enumerate(ops[:cut]):
        for name, layer in at_mark.get(index, ()):
            _boundary(step, out, name, layer, num_layers, first_layer_hooked)
        moved[index] = len(out)
        if op[0] == FREE and op[1] in grad_keys:  # gradients go at their group's post-backward
            continue
        if seed is not None and op[0] == FREE and op[1] == seed[1]:
            seed_free = op  # the engine holds backward's seed until its final callbacks (the root's) are done
            continue
        out.append(op)
    for name, layer in at_mark.get(cut, ()):
        _boundary(step, out, name, layer, num_layers, first_layer_hooked)
    step.post_backward(out, "root")  # backward's final callback: every group not yet done, root first
    if not first_layer_hooked:
        step.post_backward(out, 0)
    if not mixed and micro in (HOLD_ADD, REDUCE_HELD):
        # autograd adds each new gradient into the held ``.grad`` in place, the new one dropped as its node ends
        out = accumulating_backward(out, grad_keys)
    return (*finish_step(step, out, ops, cut, moved, seed_free, grad_keys, table, _group_of, "fsdp"), step.held)


def finish_step(step, out: list, ops: list, cut: int, moved: dict, seed_free, grad_keys: set, table: list,
                group_of, label: str) -> tuple:
    """The end of backward, then the optimizer part: (events, moved, optimizer_at, loss_freed_at, reduce-scatter
    output keys). ``group_of``: a parameter's FSDP2 group."""
    step.end_backward(out)
    if seed_free is not None:
        out.append(seed_free)
    optimizer_at = moved[cut] = len(out)
    # what the step frees before and in its optimizer part of its own (the loss): the optimizer's own tensors and
    # the full gradients are the single GPU's, replaced below
    made = {op[1] for op in ops[:cut] if op[0] == ALLOC}
    out.extend(op for op in ops[cut:] if op[0] == FREE and op[1] in made and op[1] not in grad_keys)
    loss_freed_at = len(out)
    order = model_order(table)
    step.optimizer_step(out, order)
    step.zero_grad(out, order, group_of)
    if step.unsharded or step.gathered or step.reduce_out:
        raise ExpansionError(f"{label}: buffers left at the end of the step")
    return out, moved, optimizer_at, loss_freed_at, step.reduce_out_keys


def fsdp_step(expansion: Expansion, table: list[ParamInfo], world: int, precision: str, optimizer: str,
              base_size_index: int, num_layers: int, polys: list, grad_ckpt: bool, no_sync: bool = False
              ) -> FsdpStep:
    """The expansion with FSDP2's events; the new tensors' sizes take indices from ``base_size_index`` on
    (``polys``: the profile's size polynomials); ``no_sync``: gradient accumulation under
    ``set_requires_gradient_sync(False)`` on all but the last micro-batch (``_no_sync_micro_steps``). ExpansionError
    where the step cannot be built (an optimizer not modelled, gradients that do not match)."""
    if optimizer not in OPTIMIZERS:
        raise ExpansionError(f"fsdp: the {optimizer} optimizer's step over shards is not modelled")
    mixed = precision.startswith("mixed_")
    params: dict = {}
    for p in model_order(table):
        params.setdefault(_group_of(p), []).append(p)
    if any(layer not in params for layer in range(num_layers)) or "root" not in params:
        raise ExpansionError("fsdp: a decoder layer or the root holds no parameters")
    in_table: dict = {}
    for p in table:
        in_table.setdefault(_group_of(p), []).append(p)
    groups = {g: _group(ps, world, mixed, in_table[g]) for g, ps in params.items()}
    keys = expansion.steady.keys
    build = _Builder(keys, base_size_index)
    first_marks, steady_marks = expansion.marks
    scalar = {i for i, poly in enumerate(polys) if 0 < poly[0] <= 8 and not any(poly[1:])}
    # checkpointing makes transformers call enable_input_require_grads; a trainable embedding's output needs
    # grad anyway
    hooked = grad_ckpt or any(p.trainable and p.layer is None and p.before_layers is not False for p in table)
    common = dict(build=build, groups=groups, table=table, world=world, optimizer=optimizer, mixed=mixed,
                  num_layers=num_layers, scalar=scalar, first_layer_hooked=hooked)
    first_start = build.next_key
    first_ops, first_moved, _first_optimizer, first_loss_freed, first_outputs, _held = _step_ops(
        expansion, expansion.first.ops, first_marks, first=True, **common)
    first_keys = build.next_key
    build.next_key = first_start  # the steady step's FSDP tensors reuse the first step's key range
    steady_ops, _moved, steady_optimizer, _loss_freed, steady_outputs, _held = _step_ops(
        expansion, expansion.steady.ops, steady_marks, first=False, **common)
    step_keys = max(first_keys, build.next_key)
    micro = None
    if no_sync:
        micro, keys = _no_sync_micro_steps(expansion, build, first_start, common)
        step_keys = max(step_keys, keys)
    return FsdpStep(expansion=method_expansion(
        "fsdp", expansion, first_ops, steady_ops, step_keys, first_moved, (first_loss_freed, steady_optimizer),
        grad_keys=frozenset(first_outputs | steady_outputs), micro=micro), sizes=build.sizes)


def _no_sync_micro_steps(expansion: Expansion, build: _Builder, start: int, common: dict) -> tuple[MicroSteps, int]:
    """Gradient accumulation under ``set_requires_gradient_sync(False)`` on all but the last micro-batch
    (grad_sync last: the HF Trainer's and accelerate's way), and the keys a micro-step uses. Each group's
    post-backward reshards and returns (``FSDPParamGroup.post_backward``: ``not self.reduce_grads``), holding the
    unsharded gradients from the cycle's first micro-batch (``_Step._hold``); a later one's gradients are added
    into them (mixed precision: in the post-backward, each 16-bit ``.grad`` dropped; else by autograd in place),
    and the last reduce-scatters the held ones (freed as ``FREE_CYCLE``) into the sharded gradients, which the
    optimizer step's ``zero_grad`` frees."""
    first_marks, steady_marks = expansion.marks
    built = KeyedBuilds(_step_ops, expansion, build, start, common)

    first_head, _moved, first_optimizer, _freed, _outputs, first_held = built(expansion.first.ops, first_marks,
                                                                              True, HOLD)
    head, _moved, head_optimizer, _freed, _outputs, held = built(expansion.steady.ops, steady_marks, False, HOLD)
    if first_held != held:
        raise ExpansionError("fsdp: the held gradients of the first and the steady step differ")
    middle, _moved, middle_optimizer, *_rest = built(expansion.steady.ops, steady_marks, False, HOLD_ADD)
    last, _moved, last_optimizer, loss_freed, *_rest = built(expansion.steady.ops, steady_marks, False,
                                                             REDUCE_HELD, held)
    first_last, _moved, first_last_optimizer, *_rest = built(expansion.steady.ops, steady_marks, True,
                                                             REDUCE_HELD, held)
    return MicroSteps(first_head=first_head[:first_optimizer], head=head[:head_optimizer],
                      middle=middle[:middle_optimizer], before_optimizer=last[last_optimizer:loss_freed],
                      first_tail=first_last[first_last_optimizer:], tail=last[last_optimizer:],
                      last=last[:last_optimizer]), built.keys


def method_expansion(method: str, expansion: Expansion, first_ops: list, steady_ops: list, keys: int,
                     first_moved: dict[int, int], optimizer_at: tuple[int, int], **fields) -> Expansion:
    """The expansion with a method's own ops in both steps (``first_moved``: where the first step's old op
    indices went): every free finds its tensor, and a steady step leaves nothing behind but what the next one
    frees (``FREE_PREVIOUS``); the first step's survivors are its persistent tensors (optimizer states)."""
    forward, backward = expansion.workspace_at
    kept = {key for kind, key, _ in steady_ops if kind == FREE_PREVIOUS}
    persistent = check_step(first_ops) - kept
    if check_step(steady_ops, previous_alive=kept) - kept:
        raise ExpansionError(f"{method}: tensors of a steady step are never freed")
    return replace(expansion, first=StepEvents(first_ops, keys), steady=StepEvents(steady_ops, keys),
                   workspace_at=(first_moved[forward], first_moved[backward]), optimizer_at=optimizer_at,
                   persistent_keys=frozenset(persistent), marks=((), ()), **fields)
