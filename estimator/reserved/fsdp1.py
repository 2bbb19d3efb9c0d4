"""An FSDP1 rank's step as the caching allocator sees it: the single-GPU step at full depth
(``estimator.reserved.expand``) with FSDP1's flat-parameter buffers added at the unit boundaries, on FSDP1's
streams.

``FullyShardedDataParallel`` per decoder layer, then the root (everything else), as ``estimator.methods.fsdp1``
sizes it (its allocated peak is what this replay reproduces, tensor by tensor). Read off torch 2.13
(``torch/distributed/fsdp/_runtime_utils.py``, ``_flat_param.py``) and checked against a real CPU run on the fake
process group, event for event (``tests/estimator/test_reserved_fsdp1.py``). Per unit:

* setup, in wrap order (layers, then the root): each tensor moved to the device, the flat parameter
  concatenated (``flatten_tensors``), the rank's shard cloned, the moved tensors and the full flat parameter
  freed; the first forward's lazy init then allocates and frees, per unit (root first), the 16-bit shard copy
  (mixed precision), the padded unsharded buffer and (mixed precision) its full-precision twin;
* ``_unshard``: the 16-bit copy of the shard on the pre-unshard stream (mixed precision), the padded unsharded
  flat parameter on the unshard stream, the copy freed (``record_stream`` on the unshard stream);
* reshard (FULL_SHARD: after forward and after backward): the unsharded flat parameter freed (``record_stream``
  on the default stream);
* post-backward: autograd concatenates the unit's gradients into the flat gradient (compute dtype) and frees
  them. It does so on the unshard stream: ``use_orig_params`` makes the tensors views of the flat parameter
  inside ``_unshard``, under the unshard stream, and autograd runs a backward node on its forward's stream; a
  tensor used twice (a tied embedding) has its two gradients summed there too (the real H100 FSDP1 snapshots,
  docs/LOG.md session 20: the 116 MiB flat gradients of Llama-3.2-1B's layers and the root's 501 MiB ones sit in
  the unshard stream's pools). The hook reshards, then on the post-backward stream casts the flat gradient to the
  reduce dtype, allocates the new shard (``_saved_grad_shard``) and frees the cast and the flat gradient
  (``record_stream`` onto the post-backward stream);
* ``use_orig_params``: the optimizer steps each tensor's piece of the shard (``foreach`` AdamW: its states on
  the first step, one ``sqrt`` temporary per piece, freed last to first); ``zero_grad`` frees nothing (the
  tensors' gradients view the flat gradient), the next forward's root pre-forward drops the flat gradients.

BACKWARD_PRE prefetching: the root's pre-backward unshards the last layer; each layer's pre-backward the one
before it. Frees made with ``record_stream`` are taken as complete at the next allocation (the GPU keeping up
with the CPU); ``limit_all_gathers`` bounds how far ahead it can run (docs/allocator.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from estimator.methods.fsdp1 import FlatUnit, Fsdp1Sizes, flat_layout, shard_pieces
from estimator.models.params import ParamInfo
from estimator.reserved.expand import (
    ALLOC,
    FREE,
    FREE_PREVIOUS,
    Expansion,
    ExpansionError,
    alloc_on,
)
from estimator.reserved.fsdp import (
    OPTIMIZERS,
    BufferOps,
    _Builder,
    _grads_by_group,
    _group_of,
    boundary_marks,
    method_expansion,
)
from estimator.reserved.timeline import Setup, model_order

PRE_UNSHARD, UNSHARD, POST_BACKWARD = 3, 4, 5  # allocator streams (0 the default; FSDP2's are 1 and 2)


def why_not_fsdp1(options) -> str | None:
    """The FSDP1 settings this replay follows (None), or what it does not model yet."""
    # HYBRID_SHARD is FULL_SHARD within the node (``Fsdp1Options.shard_size``) plus an all-reduce of each new
    # shard across the nodes, in place on the post-backward stream: the same allocations.
    if options.sharding_strategy not in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"):
        return f"fsdp1 {options.sharding_strategy}: not modelled yet"
    if options.cpu_offload:
        return "fsdp1 with CPU offload: not modelled yet"
    if not options.use_orig_params:
        return "fsdp1 without use_orig_params: its flat-parameter optimizer step is not modelled yet"
    if options.backward_prefetch != "BACKWARD_PRE" or options.forward_prefetch:
        return "fsdp1: only the default prefetching (BACKWARD_PRE, no forward prefetch) is modelled yet"
    return None


@dataclass(frozen=True)
class _Unit:
    params: list[ParamInfo]   # registration order (the flat parameter's)
    flat: FlatUnit
    mixed: bool
    paddings: tuple[int, ...]  # padding segments' elements, flat order
    offsets: tuple[int, ...]   # each tensor's offset in the flat parameter
    sharded: bool = True       # False: NO_SHARD (the flat parameter is whole on every rank)

    @property
    def mp_bytes(self) -> int:
        return self.flat.shard_numel * self.flat.compute_elem if self.mixed else 0

    @property
    def unsharded_bytes(self) -> int:
        return self.flat.shard_numel * self.flat.world * self.flat.compute_elem


def _units(table: list[ParamInfo], num_layers: int, sizes: Fsdp1Sizes) -> dict:
    """Unit -> _Unit: every decoder layer (its tensors in table order) and the root (the rest, registration
    order)."""
    aligned = sizes.options.use_orig_params

    def unit(params: list[ParamInfo], flat: FlatUnit) -> _Unit:
        offsets, paddings, _total = flat_layout(params, flat.world, flat.compute_elem, aligned)
        return _Unit(params, flat, sizes.mixed, tuple(paddings), tuple(offsets), sizes.sharded)
    units = {"root": unit([p for p in model_order(table) if p.layer is None], sizes.root)}
    for layer in range(num_layers):
        units[layer] = unit([p for p in table if p.layer == layer], sizes.layer)
    return units


def fsdp1_setup(table: list[ParamInfo], buffers: tuple[int, int], num_layers: int, sizes: Fsdp1Sizes) -> Setup:
    """Per unit in wrap order (layers, then the root): its tensors moved, the flat parameter, the shard; the moved
    tensors and the full flat parameter freed. Then the module buffers."""
    allocations: list[tuple[str, int]] = []
    frees: list[tuple[int, tuple[int, ...]]] = []
    units = _units(table, num_layers, sizes)
    for name in [*range(num_layers), "root"]:
        unit = units[name]
        elem = unit.flat.param_elem
        first = len(allocations)
        allocations.extend((f"moved.{p.name}", p.numel * elem) for p in unit.params)
        paddings = []
        for n in unit.paddings:  # ones(n) * a magic value: the ones go at once
            allocations.extend([(f"padding_ones.{name}", n * elem), (f"padding.{name}", n * elem)])
            frees.append((len(allocations) - 1, (len(allocations) - 2,)))
            paddings.append(len(allocations) - 1)
        allocations.append((f"flat.{name}", unit.flat.numel * elem))
        frees.append((len(allocations) - 1, tuple(paddings)))  # the list that held them goes after the cat
        moved = tuple(range(first, first + len(unit.params)))
        if not unit.sharded:  # NO_SHARD keeps the flat parameter itself (``FlatParamHandle.shard``: no clone)
            frees.append((len(allocations) - 1, moved))
            continue
        allocations.append((f"shard.{name}", unit.flat.shard_numel * elem))
        frees.append((len(allocations) - 1, (*moved, len(allocations) - 2)))
    non_layer, per_layer = buffers
    if per_layer:
        allocations.extend((f"buffers.{layer}", per_layer) for layer in range(num_layers))
    if non_layer:
        allocations.append(("buffers", non_layer))
    return Setup(allocations, [], [], frees_after=tuple(frees))


class _Step(BufferOps):
    """One step's FSDP1 tensors and the ops that make and free them."""

    def __init__(self, build: _Builder, units: dict, grads: dict) -> None:
        super().__init__(build)
        self.units, self.grads = units, grads
        self.unsharded: dict = {}      # unit -> padded unsharded flat parameter
        self.grad_shards: dict = {}    # unit -> new shard (the sharded gradient)

    def unshard(self, out: list, g) -> None:
        unit = self.units[g]
        if not unit.sharded:  # NO_SHARD computes with the 16-bit copy itself (mixed precision), else in place
            self.unsharded[g] = self._alloc(out, unit.mp_bytes, PRE_UNSHARD) if unit.mp_bytes else None
            return
        self.unsharded[g] = self._staged(out, (unit.mp_bytes, PRE_UNSHARD), unit.unsharded_bytes, UNSHARD)

    def reshard(self, out: list, g) -> None:
        tensor = self.unsharded.pop(g)
        if tensor is not None:
            self._free(out, tensor)

    def post_backward(self, out: list, g) -> None:
        unit, flat = self.units[g], self.units[g].flat
        if not flat.trainable:
            self.reshard(out, g)
            return
        # the split's backward fills the padding segments (no gradient) with zeros before it concatenates
        zeros = [self._alloc(out, n * flat.compute_elem, UNSHARD) for n in unit.paddings]
        flat_grad = self._alloc(out, flat.numel * flat.compute_elem, UNSHARD)
        for key, size_index in self.grads.get(g, []):
            out.append((FREE, key, size_index))
        for tensor in zeros:
            self._free(out, tensor)
        self.reshard(out, g)
        # the use_orig_params layout already divides by the shard group: no F.pad before the reduce-scatter
        cast = (self._alloc(out, flat.numel * flat.reduce_elem, POST_BACKWARD)
                if flat.reduce_elem != flat.compute_elem else None)
        if not unit.sharded:
            self._keep_whole_grad(out, g, flat_grad, cast)
            return
        # the reduce dtype is the shards' (fp32 under mixed precision), so the new shard is kept as it is
        self.grad_shards[g] = self._alloc(out, flat.shard_numel * flat.reduce_elem, POST_BACKWARD)
        for tensor in (cast, flat_grad):
            if tensor is not None:
                self._free(out, tensor)

    def _keep_whole_grad(self, out: list, g, flat_grad, cast) -> None:
        """NO_SHARD's ``_reduce_grad_no_shard``, on the post-backward stream: the all-reduce is in place on the
        (cast) flat gradient, which is cast to the parameters' dtype if it differs and kept as the unit's
        gradient until the next root pre-forward."""
        flat = self.units[g].flat
        kept = cast if cast is not None else flat_grad
        if flat.param_elem != (flat.reduce_elem if cast is not None else flat.compute_elem):
            kept = self._alloc(out, flat.numel * flat.param_elem, POST_BACKWARD)
            if cast is not None:
                self._free(out, cast)
        if kept is not flat_grad:
            self._free(out, flat_grad)
        self.grad_shards[g] = kept

    def lazy_init(self, out: list, order: list) -> None:
        """The first forward's ``init_flat_param_attributes``: buffers allocated and freed once per unit (NO_SHARD:
        the 16-bit copy alone)."""
        for g in order:
            unit = self.units[g]
            sizes = [unit.mp_bytes, unit.unsharded_bytes if unit.sharded else 0]
            if unit.mixed and unit.sharded:
                sizes.append(unit.flat.shard_numel * unit.flat.world * unit.flat.param_elem)
            for nbytes in sizes:
                if nbytes:
                    self._free(out, self._alloc(out, nbytes))



def _boundary(step: _Step, out: list, name: str, layer: int | None, num_layers: int, prefix_at: list,
              reshard_after_forward: bool) -> None:
    """FSDP1's events at the start of a segment instance (``methods.fsdp1._schedule``, tensor by tensor).
    SHARD_GRAD_OP (``reshard_after_forward`` off) keeps each layer unsharded from its forward to its
    post-backward, so backward has nothing to unshard."""
    last = num_layers - 1
    if name == "prefix":
        prefix_at.append(len(out))  # the root's pre-forward: lazy init (first step), previous shards freed
        step.unshard(out, "root")
    elif name == "fw_first":
        step.unshard(out, 0)
    elif name in ("fw", "fw_last"):
        if reshard_after_forward:
            step.reshard(out, layer - 1)
        step.unshard(out, layer)
    elif name == "mid_fw":
        if reshard_after_forward:
            step.reshard(out, last)
    elif name == "mid_bw":  # the root's post-forward, after the loss: NO_SHARD frees the root's 16-bit copy
        if not step.units["root"].sharded:
            step.reshard(out, "root")
    elif name == "engine_start":  # the root's pre-backward (NO_SHARD: its copy again) prefetches the last layer
        if not step.units["root"].sharded:
            step.unshard(out, "root")
        if reshard_after_forward:
            step.unshard(out, last)
    elif name in ("bw_first", "bw", "bw_last"):
        if layer != last:
            step.post_backward(out, layer + 1)
        if layer > 0 and reshard_after_forward:
            step.unshard(out, layer - 1)
    elif name == "suffix":
        step.post_backward(out, 0)
    else:
        raise ExpansionError(f"fsdp1: no boundary events for segment {name!r}")


def _summed_grad_keys(grads: dict, table: list[ParamInfo]) -> set[int]:
    """The gradient keys autograd makes as a sum, on the node that consumes them (the flat parameter's view, on
    the unshard stream): those of tensors used twice in forward (tied embeddings). ``grads`` lists each unit's
    keys in ``model.parameters()`` order, as ``_grads_by_group`` does."""
    by_group: dict = {}
    for p in table:
        if p.trainable:
            by_group.setdefault(_group_of(p), []).append(p)
    return {key for g, keys in grads.items() for p, (key, _size) in zip(by_group.get(g, []), keys, strict=True)
            if p.tied_names}


def _step_ops(expansion: Expansion, ops: list, marks: tuple, build: _Builder, units: dict, table: list,
              optimizer: str, first: bool, num_layers: int, scalar: set[int], pieces: list[int],
              reshard_after_forward: bool) -> tuple[list, dict[int, int], tuple[int, int], list, int]:
    """The FSDP1 step's ops, where each old op index went, where its optimizer part begins (before and after the
    loss is freed), the gradient shards (the next step's root pre-forward frees them) and where the root's
    pre-forward begins."""
    grads = {g: list(keys) for g, keys in _grads_by_group(expansion, ops, table).items()}
    summed = _summed_grad_keys(grads, table)
    step = _Step(build, units, grads)
    grad_keys = expansion.grad_keys
    cut, at_mark, seed = boundary_marks(ops, marks, scalar)
    out: list = []
    moved: dict[int, int] = {}
    prefix_at: list = []
    seed_free = None
    for index, op in enumerate(ops[:cut]):
        for name, layer in at_mark.get(index, ()):
            _boundary(step, out, name, layer, num_layers, prefix_at, reshard_after_forward)
        moved[index] = len(out)
        if op[0] == FREE and op[1] in grad_keys:  # gradients go at their unit's post-backward
            continue
        if seed is not None and op[0] == FREE and op[1] == seed[1]:
            seed_free = op  # held until the root's post-backward, backward's last hook
            continue
        out.append((alloc_on(UNSHARD), *op[1:]) if op[0] == ALLOC and op[1] in summed else op)
    for name, layer in at_mark.get(cut, ()):
        _boundary(step, out, name, layer, num_layers, prefix_at, reshard_after_forward)
    step.post_backward(out, "root")
    if seed_free is not None:
        out.append(seed_free)
    optimizer_at = moved[cut] = len(out)
    made = {op[1] for op in ops[:cut] if op[0] == ALLOC}
    out.extend(op for op in ops[cut:] if op[0] == FREE and op[1] in made and op[1] not in grad_keys)
    loss_freed_at = len(out)
    step.adamw(out, pieces, first, optimizer)  # the tensors' pieces of the shards, parameter order
    if step.unsharded:
        raise ExpansionError("fsdp1: unsharded flat parameters left at the end of the step")
    shards = [step.grad_shards[g] for g in ["root", *range(num_layers)] if g in step.grad_shards]
    return out, moved, (optimizer_at, loss_freed_at), shards, prefix_at[0]


@dataclass(frozen=True)
class Fsdp1Step:
    expansion: Expansion
    sizes: list[int]  # bytes of the FSDP1 tensors, size indices ``base`` + j


def _shifted(moved: dict[int, int], at: int, by: int) -> dict[int, int]:
    return {k: v + by if v >= at else v for k, v in moved.items()}


def fsdp1_step(expansion: Expansion, table: list[ParamInfo], sizes: Fsdp1Sizes, optimizer: str, rank: int,
               base_size_index: int, num_layers: int, polys: list) -> Fsdp1Step:
    """The expansion with FSDP1's events; the new tensors' sizes take indices from ``base_size_index`` on.
    ExpansionError where the step cannot be built."""
    if optimizer not in OPTIMIZERS:
        raise ExpansionError(f"fsdp1: the {optimizer} optimizer's step over shards is not modelled")
    reason = why_not_fsdp1(sizes.options)
    if reason:
        raise ExpansionError(reason)
    units = _units(table, num_layers, sizes)
    if any(not units[layer].params for layer in range(num_layers)) or not units["root"].params:
        raise ExpansionError("fsdp1: a decoder layer or the root holds no parameters")
    piece_of: dict[str, int] = {}
    for unit in units.values():
        # the rank's place in its shard group (HYBRID_SHARD: within the node)
        shard_rank = rank % unit.flat.world
        for p, n in zip(unit.params, shard_pieces(unit.params, unit.offsets, unit.flat.shard_numel, shard_rank)):
            piece_of[p.name] = n * unit.flat.param_elem
    pieces = [piece_of[p.name] for p in model_order(table) if p.trainable and piece_of[p.name]]
    build = _Builder(expansion.steady.keys, base_size_index)
    first_marks, steady_marks = expansion.marks
    scalar = {i for i, poly in enumerate(polys) if 0 < poly[0] <= 8 and not any(poly[1:])}
    common = dict(build=build, units=units, table=table, optimizer=optimizer, num_layers=num_layers,
                  scalar=scalar, pieces=pieces,
                  reshard_after_forward=sizes.frees_after_forward)
    start = build.next_key
    steady_ops, _moved, steady_optimizer, steady_shards, steady_prefix = _step_ops(
        expansion, expansion.steady.ops, steady_marks, first=False, **common)
    steady_keys = build.next_key
    build.next_key = start  # the first step's tensors take the same keys in the same order
    first_ops, first_moved, first_optimizer, first_shards, first_prefix = _step_ops(
        expansion, expansion.first.ops, first_marks, first=True, **common)
    if [t.key for t in first_shards] != [t.key for t in steady_shards]:
        raise ExpansionError("fsdp1: the gradient shards of the first and the steady step differ")
    lazy: list = []  # keys after every other tensor of the step, so both steps keep theirs
    _Step(build, units, {}).lazy_init(lazy, ["root", *range(num_layers)])
    first_ops[first_prefix:first_prefix] = lazy
    first_moved = _shifted(first_moved, first_prefix, len(lazy))
    # the previous step's gradient shards go at the root's pre-forward (``_clear_grads_if_needed``)
    previous = [(FREE_PREVIOUS, t.key, t.size_index) for t in steady_shards]
    steady_ops[steady_prefix:steady_prefix] = previous
    step_keys = max(steady_keys, build.next_key)
    # kept to the next step: the shards, a manual loop's outputs
    return Fsdp1Step(expansion=method_expansion(
        "fsdp1", expansion, first_ops, steady_ops, step_keys, first_moved,
        (first_optimizer[1] + len(lazy), steady_optimizer[0] + len(previous)), grad_keys=frozenset()),
        sizes=build.sizes)
