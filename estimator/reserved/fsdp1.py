"""An FSDP1 rank's step as the caching allocator sees it: the single-GPU step at full depth
(``estimator.profiler.expand``) with FSDP1's flat-parameter buffers added at the unit boundaries, on FSDP1's
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

Without ``use_orig_params`` (``_Unit.orig_params``): the flat parameter is the tensors concatenated, no alignment or
divisibility padding; a rank whose chunk (``torch.chunk``) is short of a whole shard pads its clone into a new
tensor at setup (``_get_shard``: ``F.pad``), and each post-backward pads the flat gradient (after the cast) into a new
tensor of shard x world elements before the reduce-scatter, freed as ``_reduce_grad`` returns. Setup's full flat
parameter is freed at ``shard`` as with ``use_orig_params`` (its storage resized to 0; the modules' views keep only
the storage object). The optimizer steps the flat shards themselves, one per unit whose flat parameter requires
grad, in ``model.parameters()`` order (``_stepped_units``); their ``.grad`` is the new shard
(``prepare_gradient_for_optim``), so ``zero_grad`` frees it, after the step; no ``_use_unsharded_grad_views``.
Gradient accumulation reducing every micro-batch: the first micro-batch's new shards become the flat parameters'
``.grad``, a later one's are added into them (the pre-backward moves ``.grad`` back to ``_saved_grad_shard``) and
the cycle's ``zero_grad`` frees them (``_micro_steps``); under ``no_sync`` it keeps the prior (not modelled yet).

LoRA (peft's ``fsdp_auto_wrap_policy``, what the HF Trainer gives a PEFT model): each lora_A / lora_B weight is a
unit of its own inside its decoder layer's, which holds the frozen weights alone (``_adapter_events``): set up
before their layer, lazily initialised after it, gathered around their forward output (and the recompute's),
reduce-scattered as each gradient is made; the optimizer steps their pieces. A layer whose last op is an adapter
(down_proj's lora_B) has its recompute stop early, after lora_A (``_early_stopped_adapter``).

Gradient accumulation reducing every micro-batch (``_micro_steps``): a later micro-batch's new shards are added
into the kept ones and freed; the next cycle's first root pre-forward drops them. Under ``no_sync()``
(``_no_sync_micro_steps``) the flat gradients are held from the cycle's first micro-batch and reduced by the last.

CPU offload (FULL_SHARD, HYBRID_SHARD; ``_Unit.offload``): setup sends each shard to the host once made; every
``_unshard`` copies the host shard to the device on the pre-unshard stream (``_from_host``: under mixed precision a
full-precision copy cast into the 16-bit shard and dropped at once, the 16-bit shard dropped after the all-gather,
and again, without an all-gather, in the root's pre-backward; without mixed precision the copy is the all-gather's
input); the new shards stay on the device until backward's final callback (``final_callback``); the optimizer
steps the host shards (no device op). A checkpointed recompute under mixed precision makes its copies again (not
built: refused).

QLoRA as answer.ai fsdp_qlora runs it (bitsandbytes NF4 with bf16 ``quant_storage``, bf16 adapters, flat parameters):
each packed weight is ``numel / 4`` bf16 elements of its layer's flat parameter (``packed_flat``), so its gathers,
reshards and shards are the packed unit's; each quant state is made once at setup, kept whole on the device (also
under CPU offload) and never freed; the dequantized bf16 copy each ``MatMul4Bit`` makes in forward, the recompute
and backward is in the profile's trace. Checked against a real CPU run event for event (bitsandbytes 0.50.2,
use_orig_params false, with and without checkpointing, the padded last rank); with ``use_orig_params`` refused.

BACKWARD_PRE prefetching: the root's pre-backward unshards the last layer; each layer's pre-backward the one
before it (with LoRA: its last adapter; the first adapter's the layer before).

Forward prefetch (``forward_prefetch``, ``_boundary``'s ``prefetch``): from the second step on, each pre-forward
unshards the next unit in the pre-forward order the first step recorded (the root's: layer 0), after its own
(``_pre_forward_unshard``; same streams as any ``_unshard``); the first step gathers each unit in its own
pre-forward. Each layer's post-backward then comes a layer later (autograd reaches its flat parameter's split
one layer later), layer 0's after the embeddings' backward; the new shards take reserved keys, so the next step
frees them whichever order the two steps made them in. Not with gradient accumulation or LoRA (refused). Frees made with ``record_stream`` are taken as complete at the next allocation (the GPU keeping up
with the CPU); ``limit_all_gathers`` bounds how far ahead it can run (docs/allocator.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from estimator.methods.fsdp1 import FlatUnit, Fsdp1Sizes, flat_layout, packed_flat, shard_pieces
from estimator.models.params import ParamInfo
from estimator.profiler.expand import (
    ALLOC,
    FREE,
    FREE_PREVIOUS,
    Expansion,
    ExpansionError,
    alloc_on,
)
from estimator.reserved.accumulate import FREE_CYCLE, FREE_PREVIOUS_CYCLE, KeyedBuilds, MicroSteps
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
# Which micro-batch a post-backward belongs to: no accumulation (or a cycle's first, reducing every micro-batch);
# a later one reducing every micro-batch (its new shards added into the kept ones); under no_sync the cycle's
# first (its flat gradients held), a middle one (added into them), the last (the held ones reduced)
SYNC, ADD_SHARD, HOLD, HOLD_ADD, REDUCE_HELD = "sync", "add_shard", "hold", "hold_add", "reduce_held"
MICRO_BATCHES = (SYNC, ADD_SHARD, HOLD, HOLD_ADD, REDUCE_HELD)


def why_not_fsdp1(options) -> str | None:
    """The FSDP1 settings this replay follows (None), or what it does not model yet."""
    # HYBRID_SHARD is FULL_SHARD within the node (``Fsdp1Options.shard_size``) plus an all-reduce of each new
    # shard across the nodes, in place on the post-backward stream: the same allocations.
    if options.sharding_strategy not in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"):
        return f"fsdp1 {options.sharding_strategy}: not modelled yet"
    if options.cpu_offload and options.sharding_strategy not in ("FULL_SHARD", "HYBRID_SHARD"):
        return (f"fsdp1 with CPU offload under {options.sharding_strategy}: replayed resharding after forward "
                "(FULL_SHARD, HYBRID_SHARD) only")
    if options.backward_prefetch != "BACKWARD_PRE":
        return "fsdp1: only BACKWARD_PRE prefetching is modelled yet"
    return None


@dataclass(frozen=True)
class _Unit:
    params: list[ParamInfo]   # registration order (the flat parameter's)
    flat: FlatUnit
    mixed: bool
    paddings: tuple[int, ...]  # padding segments' elements, flat order
    offsets: tuple[int, ...]   # each tensor's offset in the flat parameter
    sharded: bool = True       # False: NO_SHARD (the flat parameter is whole on every rank)
    orig_params: bool = True   # use_orig_params; False: the optimizer steps the flat shards themselves
    offload: bool = False      # CPU offload: the shard lives on the host (``_local_shard``), the step runs there
    # bytes of each tensor's quant state (QLoRA's packed 4-bit rows, ``packed_flat``; 0 for the others), kept whole
    # on the device beside the flat parameter
    quant_states: tuple[int, ...] = ()

    @property
    def stepped_bytes(self) -> int:
        """What this rank keeps of the flat parameter (its padded shard; NO_SHARD: all of it), and so of its
        gradient: the tensor the optimizer steps without ``use_orig_params``."""
        flat = self.flat
        return (flat.shard_numel if self.sharded else flat.numel) * flat.param_elem

    def short_chunk_numel(self, shard_rank: int) -> int | None:
        """Elements of ``shard_rank``'s chunk of the flat parameter where ``torch.chunk`` leaves it short of a
        whole shard (``_get_shard`` then pads its clone: ``F.pad``), else None. Only without ``use_orig_params``:
        its layout is not padded to a multiple of the shard group."""
        flat = self.flat
        chunk = max(0, min(flat.shard_numel, flat.numel - shard_rank * flat.shard_numel))
        return chunk if self.sharded and chunk < flat.shard_numel else None

    @property
    def mp_bytes(self) -> int:
        return self.flat.shard_numel * self.flat.compute_elem if self.mixed else 0

    @property
    def unsharded_bytes(self) -> int:
        return self.flat.shard_numel * self.flat.world * self.flat.compute_elem


def _adapter(layer: int, index: int) -> tuple:
    """The unit key of a decoder layer's ``index``-th adapter weight (peft's ``fsdp_auto_wrap_policy``)."""
    return ("adapter", layer, index)


def _adapters_of(units: dict, layer: int) -> list[tuple]:
    """The layer's adapter units in registration (= forward) order."""
    return [g for g in units if isinstance(g, tuple) and g[1] == layer]


def _units(table: list[ParamInfo], num_layers: int, sizes: Fsdp1Sizes) -> dict:
    """Unit -> _Unit: every decoder layer (its tensors in table order) and the root (the rest, registration
    order); with LoRA each adapter weight its own unit (``_adapter``) and the layer its frozen tensors alone."""
    aligned = sizes.options.use_orig_params
    lora = bool(sizes.adapters)

    def unit(params: list[ParamInfo], flat: FlatUnit) -> _Unit:
        # QLoRA's packed 4-bit rows as the flat parameter holds them (16-bit elements, numel / 4), their quant states
        # beside it (packed weights under mixed_* are refused by ``fsdp1_sizes``: one 16-bit dtype per unit)
        packed = [packed_flat(p, flat.param_elem) for p in params]
        params = [row for row, _ in packed]
        offsets, paddings, _total = flat_layout(params, flat.world, flat.compute_elem, aligned)
        return _Unit(params, flat, sizes.mixed, tuple(paddings), tuple(offsets), sizes.sharded, aligned,
                     sizes.options.cpu_offload, tuple(int(state) for _, state in packed))
    units = {"root": unit([p for p in model_order(table) if p.layer is None], sizes.root)}
    for layer in range(num_layers):
        params = [p for p in table if p.layer == layer]
        units[layer] = unit([p for p in params if not (lora and p.trainable)], sizes.unit_of(layer))
        adapters = [p for p in params if lora and p.trainable]
        if len(adapters) != len(sizes.adapters):
            raise ExpansionError(f"fsdp1: layer {layer}'s adapters differ from the sized layer's")
        for index, (p, flat) in enumerate(zip(adapters, sizes.adapters)):
            units[_adapter(layer, index)] = adapter = unit([p], flat)
            if adapter.offsets[-1] + p.numel + sum(adapter.paddings) != flat.numel:
                raise ExpansionError(f"fsdp1: {p.name} differs from the sized layer's adapter")
    return units


def fsdp1_setup(table: list[ParamInfo], buffers: tuple[int, int], num_layers: int, sizes: Fsdp1Sizes,
                rank: int = 0) -> Setup:
    """Per unit in wrap order (``_wrap_order``): its tensors moved, the flat parameter, the shard (without
    ``use_orig_params`` a short chunk's clone padded into a new tensor); the moved tensors and the full flat
    parameter freed. QLoRA: each packed weight's quant state (``quant_state.``) moves with it (bitsandbytes'
    ``Params4bit.to`` moves the state too) and stays, whole, under CPU offload as well (only flat parameters go to
    the host). Then the module buffers."""
    allocations: list[tuple[str, int]] = []
    frees: list[tuple[int, tuple[int, ...]]] = []
    units = _units(table, num_layers, sizes)
    for name in _wrap_order(units, num_layers):
        unit = units[name]
        elem = unit.flat.param_elem
        moved_at = []
        for p, state in zip(unit.params, unit.quant_states or (0,) * len(unit.params)):
            if state:
                allocations.append((f"quant_state.{p.name}", state))
            moved_at.append(len(allocations))
            allocations.append((f"moved.{p.name}", p.numel * elem))
        paddings = []
        for n in unit.paddings:  # ones(n) * a magic value: the ones go at once
            allocations.extend([(f"padding_ones.{name}", n * elem), (f"padding.{name}", n * elem)])
            frees.append((len(allocations) - 1, (len(allocations) - 2,)))
            paddings.append(len(allocations) - 1)
        allocations.append((f"flat.{name}", unit.flat.numel * elem))
        frees.append((len(allocations) - 1, tuple(paddings)))  # the list that held them goes after the cat
        moved = tuple(moved_at)
        if not unit.sharded:  # NO_SHARD keeps the flat parameter itself (``FlatParamHandle.shard``: no clone)
            frees.append((len(allocations) - 1, moved))
            continue
        # ``shard`` resizes the full flat parameter's storage to 0 (without use_orig_params the modules' views of it
        # stay until the first forward's unshard replaces them, but hold no memory)
        flat = len(allocations) - 1
        short = unit.short_chunk_numel(rank % unit.flat.world)
        if short is None:
            allocations.append((f"shard.{name}", unit.flat.shard_numel * elem))
            # CPU offload: the shard goes to the host once made (``flat_param_to(cpu)``)
            frees.append((len(allocations) - 1, (*moved, flat, *((len(allocations) - 1,) if unit.offload else ()))))
            continue
        clone = ()
        if short:  # an empty chunk's clone is no allocation
            allocations.append((f"shard_chunk.{name}", short * elem))
            clone = (len(allocations) - 1,)
        allocations.append((f"shard.{name}", unit.flat.shard_numel * elem))
        frees.append((len(allocations) - 1, (*clone, *moved, flat, *((len(allocations) - 1,) if unit.offload else ()))))
    non_layer, per_layer = buffers
    if per_layer:
        allocations.extend((f"buffers.{layer}", per_layer) for layer in range(num_layers))
    if non_layer:
        allocations.append(("buffers", non_layer))
    return Setup(allocations, [], [], frees_after=tuple(frees))


def _wrap_order(units: dict, num_layers: int) -> list:
    """The order the auto-wrap policy makes the units (a post-order walk: a layer's adapters before the layer,
    the root last)."""
    return [*(g for layer in range(num_layers) for g in (*_adapters_of(units, layer), layer)), "root"]


def _lazy_init_order(units: dict, num_layers: int) -> list:
    """``_all_fsdp_states``' order (a pre-order walk): the root, then each layer before its adapters."""
    return ["root", *(g for layer in range(num_layers) for g in (layer, *_adapters_of(units, layer)))]


def _stepped_units(units: dict, num_layers: int) -> list:
    """The units whose flat parameter requires grad, in ``model.parameters()`` order (each FSDP module's flat
    parameter is its wrapped module's first parameter, before its children's: the pre-order walk)."""
    return [g for g in _lazy_init_order(units, num_layers) if units[g].flat.trainable]


class _Step(BufferOps):
    """One step's FSDP1 tensors and the ops that make and free them."""

    def __init__(self, build: _Builder, units: dict, grads: dict, micro: str = SYNC, held: dict | None = None,
                 unit_pieces: dict | None = None, shard_keys: dict | None = None) -> None:
        super().__init__(build)
        self.units, self.grads = units, grads
        # unit -> the key its new shard takes (forward prefetch: the first step, which does not prefetch, makes
        # its FSDP tensors in another order than the steady step, yet the next step frees the shards by key)
        self.shard_keys = shard_keys or {}
        self.unit_pieces = unit_pieces or {}  # unit -> bytes of each tensor's piece of this rank's shard
        self.micro = micro  # MICRO_BATCHES
        self.held: dict = dict(held or {})  # unit -> its unsharded flat gradient held under no_sync
        self.unsharded: dict = {}      # unit -> padded unsharded flat parameter
        self.grad_shards: dict = {}    # unit -> new shard (the sharded gradient)

    def unshard(self, out: list, g) -> None:
        unit = self.units[g]
        if not unit.sharded:  # NO_SHARD computes with the 16-bit copy itself (mixed precision), else in place
            self.unsharded[g] = self._alloc(out, unit.mp_bytes, PRE_UNSHARD) if unit.mp_bytes else None
            return
        if unit.offload:
            self.unsharded[g] = self._from_host(out, unit, unit.unsharded_bytes)
            return
        self.unsharded[g] = self._staged(out, (unit.mp_bytes, PRE_UNSHARD), unit.unsharded_bytes, UNSHARD)

    def _from_host(self, out: list, unit: _Unit, unsharded_bytes: int):
        """CPU offload's ``_unshard`` (``pre_unshard``, ``_use_low_precision_shard``): the host shard copied to the
        device on the pre-unshard stream (``_local_shard.to(device)``); mixed precision casts that copy into the
        16-bit shard and drops it at once, and the 16-bit shard goes after the all-gather; without, the copy is
        the all-gather's input, dropped as the unsharded flat parameter replaces it. ``unsharded_bytes`` 0: a unit
        still unsharded (the root's pre-backward), whose ``pre_unshard`` makes and drops the copies all the same
        under mixed precision (it skips them only without offload). Returns the unsharded flat parameter."""
        flat = unit.flat
        staged = self._alloc(out, unit.mp_bytes, PRE_UNSHARD) if unit.mp_bytes else None
        copy = self._alloc(out, flat.shard_numel * flat.param_elem, PRE_UNSHARD) if staged or unsharded_bytes else None
        if staged is not None and copy is not None:
            self._free(out, copy)
            copy = None
        tensor = self._alloc(out, unsharded_bytes, UNSHARD) if unsharded_bytes else None
        for left in (copy, staged):
            if left is not None:
                self._free(out, left)
        return tensor

    def refresh(self, out: list, g) -> None:
        """``_unshard`` of a unit that is still unsharded, under CPU offload: its transient device copies alone."""
        unit = self.units[g]
        if unit.offload and unit.mixed:
            self._from_host(out, unit, 0)

    def final_callback(self, out: list, order: list) -> None:
        """CPU offload: each new shard was copied into the host gradient (``_offload_grad``) and is dropped as
        ``prepare_gradient_for_optim`` deletes ``_saved_grad_shard``, unit by unit in pre-order, as backward
        ends (``_post_backward_final_callback``)."""
        for g in order:
            if self.units[g].offload and g in self.grad_shards:
                self._free(out, self.grad_shards.pop(g))

    @staticmethod
    def emit(out: list, op: tuple) -> None:
        """An op of the event list, moved here."""
        out.append(op)

    def unshard_once(self, out: list, g) -> None:
        """``_unshard`` where the unit is not unsharded yet (an adapter prefetched, or resharded since)."""
        if g not in self.unsharded:
            self.unshard(out, g)

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
        if self.micro == HOLD:  # no_sync: the flat gradient stays the flat parameter's .grad
            self.held[g] = flat_grad
            # ``_use_unsharded_grad_views``: a tensor without a gradient gets ``empty_like`` of its (sharded) self
            # before its ``.grad.data`` is pointed at its view of the flat gradient
            for nbytes in self.unit_pieces.get(g, ()):
                if nbytes:
                    self._free(out, self._alloc(out, nbytes))
            return
        if self.micro == HOLD_ADD:  # added into the held one; autograd drops it once the hooks are done
            self._free(out, flat_grad)
            return
        cast = (self._alloc(out, flat.numel * flat.reduce_elem, POST_BACKWARD)
                if flat.reduce_elem != flat.compute_elem else None)
        if not unit.sharded:
            self._keep_whole_grad(out, g, flat_grad, cast)
            return
        # ``_get_reduce_scatter_tensors``: a flat gradient short of a whole number of shards is padded into a new
        # tensor (F.pad), freed as ``_reduce_grad`` returns, after the cast; the use_orig_params layout never is
        padded_numel = flat.shard_numel * flat.world
        padded = (self._alloc(out, padded_numel * flat.reduce_elem, POST_BACKWARD)
                  if padded_numel > flat.numel else None)
        # the reduce dtype is the shards' (fp32 under mixed precision), so the new shard is kept as it is; a later
        # micro-batch's is added into the saved one in place and goes as ``_reduce_grad`` returns. After no_sync the
        # held gradient (this micro-batch's added into it) is reduced; this micro-batch's stays referenced by
        # autograd until the hook returns
        new_shard = self._alloc(out, flat.shard_numel * flat.reduce_elem, POST_BACKWARD, self.shard_keys.get(g))
        self.grad_shards[g] = new_shard
        for tensor in (cast, padded, flat_grad, new_shard if self.micro == ADD_SHARD else None):
            if tensor is not None:
                self._free(out, tensor)
        if self.micro == REDUCE_HELD:
            held = self.held.pop(g)
            out.append((FREE_CYCLE, held.key, held.size_index))

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
              reshard_after_forward: bool, layer0_at_suffix: bool = True, prefetch: bool = False) -> None:
    """FSDP1's events at the start of a segment instance (``methods.fsdp1._schedule``, tensor by tensor).
    SHARD_GRAD_OP (``reshard_after_forward`` off) keeps each layer unsharded from its forward to its
    post-backward, so backward has nothing to unshard. With LoRA adapter units (``_adapter_events``) a layer's
    pre-backward prefetches its last adapter, not the layer before it: BACKWARD_PRE gathers the unit that
    finished its forward just before this one (``get_handle_to_backward_prefetch``), and the layer's adapters
    finish theirs inside the layer's. ``layer0_at_suffix``: layer 0's post-backward runs as its backward ends
    (trainable, or its inputs require grad); else in backward's final callback, after the root's.

    ``prefetch``: forward prefetch, from the second step on (``get_handle_to_forward_prefetch`` reads the
    pre-forward order the first step records): each pre-forward, after its own unit's ``_unshard`` (skipped
    where prefetched), unshards the next unit in that order on the same streams (the root's: layer 0). A layer's
    flat parameter is then split into its views one layer earlier, so autograd, which runs ready nodes by
    creation order, reaches its post-backward one layer later (``methods.fsdp1._backward_events``): layer L's
    backward starts with layer L + 2's post-backward, the embeddings' with layer 1's, and layer 0's runs after
    them (``_step_ops``)."""
    last = num_layers - 1
    delay = int(prefetch)
    adapters = _adapters_of(step.units, layer) if layer is not None else []
    if name == "prefix":
        prefix_at.append(len(out))  # the root's pre-forward: lazy init (first step), previous shards freed
        step.unshard(out, "root")
        if prefetch:
            step.unshard(out, 0)
    elif name in ("fw_first", "fw", "fw_last"):
        if name != "fw_first" and reshard_after_forward:
            step.reshard(out, layer - 1)
        if not prefetch:
            step.unshard(out, layer)
        elif layer != last:
            step.unshard(out, layer + 1)
    elif name == "mid_fw":
        if reshard_after_forward:
            step.reshard(out, last)
    elif name == "mid_bw":  # the root's post-forward, after the loss: NO_SHARD frees the root's 16-bit copy
        if not step.units["root"].sharded:
            step.reshard(out, "root")
    elif name == "engine_start":  # the root's pre-backward (NO_SHARD: its copy again) prefetches the last layer
        if not step.units["root"].sharded:
            step.unshard(out, "root")
        else:  # still unsharded: under CPU offload its copies are made and dropped again
            step.refresh(out, "root")
        if reshard_after_forward:
            step.unshard(out, last)
    elif name in ("bw_first", "bw", "bw_last") and adapters:
        # the layer's pre-backward, then the frozen layer after it resharded by its inputs' gradient hook
        step.unshard_once(out, adapters[-1])
        if layer != last:
            step.post_backward(out, layer + 1)
    elif name in ("bw_first", "bw", "bw_last"):
        if layer + 1 + delay <= last:
            step.post_backward(out, layer + 1 + delay)
        if layer > 0 and reshard_after_forward:
            step.unshard(out, layer - 1)
    elif name == "suffix":
        if prefetch and num_layers > 1:
            step.post_backward(out, 1)
        elif layer0_at_suffix and not prefetch:
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


def _per_token_bytes(polys: list, size_index: int) -> float | None:
    """Bytes per (row, position) of a size that is ``b * s * c`` alone (an activation of one token-wide row),
    else None."""
    if size_index >= len(polys):
        return None
    c0, c1, c2, c3, c4, c5 = polys[size_index]
    return c4 if not any(abs(c) > 1e-6 for c in (c0, c1, c2, c3, c5)) else None


def _adapter_pairs(units: dict, layer: int) -> list[tuple[tuple, tuple]]:
    """The layer's (lora_A, lora_B) units, forward order. ExpansionError for other trainable layer tensors (DoRA's
    magnitudes, biases), whose forward the replay cannot place."""
    adapters = _adapters_of(units, layer)
    names = [units[g].params[0].name for g in adapters]
    pairs = list(zip(adapters[::2], adapters[1::2]))
    if len(adapters) % 2 or any(".lora_A." not in units[a].params[0].name or ".lora_B." not in units[b].params[0].name
                                for a, b in pairs):
        raise ExpansionError(f"fsdp1: layer {layer}'s trainable tensors are not lora_A/lora_B pairs: {names}")
    return pairs


def _constant_bytes(polys: list, size_index: int) -> float | None:
    """The bytes of a size that depends on neither ``b`` nor ``s``, else None."""
    if size_index >= len(polys):
        return None
    c0, *rest = polys[size_index]
    return c0 if not any(abs(c) > 1e-6 for c in rest) else None


def _adapter_forwards(ops: list, start: int, end: int, pairs: list, units: dict, polys: list,
                      out_elem: int | None, recompute: bool = False) -> list[tuple[tuple, tuple | None]]:
    """Each adapter pair's forward in ``ops[start:end]``: ((first op, last op, weight copies) of lora_A's, of
    lora_B's). An
    adapter's forward is its Linear: under autocast (``out_elem``: its dtype's bytes) the 16-bit copies of its
    weight and of a full-precision input, then the output, ``b * s`` times its weight's rows (in the adapter's
    dtype without autocast), then what the Linear frees. lora_A's output is the first of its size after the
    previous pair; lora_B's follows with nothing but its weight's copy between. ``recompute``: the checkpointed
    recompute may stop after the last pair's lora_A (its lora_B span then None: ``_early_stopped_adapter``).
    ExpansionError where a pair is not found."""
    def per_token(g, dim: int) -> int:
        p = units[g].params[0]
        return p.shape[dim] * (out_elem or p.elem_bytes)

    def own_copy(g, i: int) -> bool:  # the 16-bit weight, or (lora_A) input, autocast makes for the Linear
        weight = units[g].params[0].numel * (out_elem or 0)
        return bool(out_elem) and (_constant_bytes(polys, ops[i][2]) == weight
                                   or _per_token_bytes(polys, ops[i][2]) == per_token(g, 1))

    def span(g, out_at: int, first: int) -> tuple[int, int, tuple[int, ...]]:
        """(first op, last op, its weight copies' op indices) of the Linear whose output is at ``out_at``; its
        copies start no earlier than ``first``."""
        lo = out_at
        while lo > first and ops[lo - 1][0] == ALLOC and own_copy(g, lo - 1):
            lo -= 1
        hi = out_at
        while hi + 1 < end and ops[hi + 1][0] != ALLOC:
            hi += 1
        weight = units[g].params[0].numel * (out_elem or 0)
        return lo, hi, tuple(i for i in range(lo, out_at) if _constant_bytes(polys, ops[i][2]) == weight)

    def lora_b_output(b, after: int) -> int | None:
        for j in range(after, end):
            if ops[j][0] != ALLOC:
                continue
            if _per_token_bytes(polys, ops[j][2]) == per_token(b, 0):
                return j
            if not own_copy(b, j):
                return None
        return None
    found: list = []
    at = start
    for a, b in pairs:
        for i in range(at, end):
            if ops[i][0] != ALLOC or _per_token_bytes(polys, ops[i][2]) != per_token(a, 0):
                continue
            a_span = span(a, i, at)
            j = lora_b_output(b, a_span[1] + 1)
            if j is None and recompute and (a, b) == pairs[-1]:
                found.append((a_span, None))
                at = a_span[1] + 1
                break
            if j is not None:
                b_span = span(b, j, a_span[1] + 1)
                found.append((a_span, b_span))
                at = b_span[1] + 1
                break
        else:
            raise ExpansionError(f"fsdp1: the forward of {units[a].params[0].name} is not in the event list")
    return found


def _node_done_at(ops: list, grad_at: int, stops: set[int], cut: int) -> tuple[str, int]:
    """Where the autograd node that made the gradient at ``grad_at`` has finished and the gradient's
    ``AccumulateGrad`` runs: after the node's other outputs, the release of its saved tensors and the sums of
    its outputs into gradients already waiting for them (the engine's input buffers: an allocation of an output's
    size that frees the output and the waiting gradient), i.e. before the next allocation; or after the op before
    the next segment boundary (``stops``) or the optimizer part."""
    outputs: dict[int, int] = {}  # key -> size index
    freed = False
    i = grad_at + 1
    while i < cut:
        if i in stops:
            return "after", i - 1
        kind, key, size = ops[i]
        if kind == ALLOC and not freed:
            outputs[key] = size
        elif kind == ALLOC:
            frees = _frees_after(ops, i, cut)
            summed = [k for k in frees if outputs.get(k) == size]
            if not summed or len(frees) < 2:
                return "before", i
            del outputs[summed[0]]
            outputs[key] = size  # the sum is the output now
        else:
            freed = True
        i += 1
    return "after", cut - 1


def _frees_after(ops: list, at: int, cut: int) -> set[int]:
    """The keys freed right after the op at ``at``, up to the next allocation."""
    keys: set[int] = set()
    for kind, key, _size in ops[at + 1:cut]:
        if kind == ALLOC:
            break
        keys.add(key)
    return keys


def _adapter_events(ops: list, cut: int, at_mark: dict, units: dict, grads: dict, polys: list, recompute: bool,
                    out_elem: int | None) -> tuple[dict, dict, set[int]]:
    """(op index -> adapter events before it, op index -> those after it, the keys whose frees those events
    move), an event being (``_Step`` method, its argument: a unit or an op). peft's adapters are FSDP units inside the layer's (``fsdp_auto_wrap_policy``), FULL_SHARD:

    * forward (and the checkpointed recompute in backward): each adapter weight unsharded just before its
      output is made, resharded right after (already unsharded: a prefetch, which the recompute's reshard
      frees all the same);
    * backward, per adapter as its gradient is made: its pre-backward (unshard it if it is not, prefetch the unit
      that finished its forward before it: the previous adapter, or for the first adapter the previous layer),
      and once the gradient's node is done its post-backward (``_Step.post_backward``)."""
    events: tuple[dict, dict, set[int]] = ({}, {}, set())
    stops = set(at_mark) | {cut}
    bounds = sorted(stops)
    alloc_at = {op[1]: i for i, op in enumerate(ops[:cut]) if op[0] == ALLOC}
    for start, entries in sorted(at_mark.items()):
        end = next(b for b in bounds if b > start)
        for name, layer in entries:
            if layer is None or not _adapters_of(units, layer):
                continue
            if name not in ("bw_first", "bw", "bw_last"):
                _adapter_gathers(events, ops, start, end, units, layer, polys, out_elem)
                continue
            made = {alloc_at[key]: g for g, (key, _size) in zip(_adapters_of(units, layer), grads.get(layer, []),
                                                                 strict=True)}
            early: set = set()
            if recompute:  # the recompute runs before the layer's first gradient
                stopped = _adapter_gathers(events, ops, start, min([end, *made]), units, layer, polys, out_elem, True)
                if stopped is not None:
                    _early_stopped_adapter(events, ops, at_mark, start, units, layer, stopped)
                    early.add(stopped)
            _adapter_backwards(events, ops, made, units, layer, stops, cut, early)
    return events


def _adapter_gathers(events: tuple[dict, dict, set[int]], ops: list, start: int, end: int, units: dict, layer: int,
                     polys: list, out_elem: int | None, recompute: bool = False) -> tuple | None:
    """Each adapter's unshard before its forward, its reshard after it (``_adapter_events``). Autocast's 16-bit
    copy of the weight goes with the Linear's other temporaries: under FSDP the weight is a view of the flat
    parameter, not a leaf, so autocast does not cache the copy to the end of the forward as it does on one GPU
    (``cached_cast``), where the event list was traced. Returns the lora_B unit a recompute stopped before
    (``_early_stopped_adapter``), else None."""
    before, after, moved = events
    pairs = _adapter_pairs(units, layer)
    stopped = None
    for (a, b), spans in zip(pairs, _adapter_forwards(ops, start, end, pairs, units, polys, out_elem, recompute)):
        for unit, span in zip((a, b), spans):
            if span is None:
                stopped = unit
                continue
            first, last, copies = span
            before.setdefault(first, []).append(("unshard_once", unit))
            after.setdefault(last, []).extend(("emit", (FREE, *ops[i][1:])) for i in copies)
            after[last].append(("reshard", unit))
            moved.update(ops[i][1] for i in copies)
    return stopped


def _adapter_backwards(events: tuple[dict, dict, set[int]], ops: list, made: dict, units: dict, layer: int,
                       stops: set[int], cut: int, early: set = frozenset()) -> None:
    """Each adapter's pre-backward before its gradient (``made``: op index -> unit; ``early``: those whose
    pre-backward ran before the recompute, ``_early_stopped_adapter``), its post-backward once the gradient's node
    is done (``_adapter_events``)."""
    before, after, _moved = events
    adapters = _adapters_of(units, layer)
    previous = dict(zip(adapters, [layer - 1 if layer > 0 else None, *adapters]))
    for at, g in sorted(made.items()):
        if g not in early:
            before.setdefault(at, []).append(("unshard_once", g))
        if g not in early and previous[g] is not None:
            before.setdefault(at, []).append(("unshard_once", previous[g]))
        where, done = _node_done_at(ops, at, stops, cut)
        (before if where == "before" else after).setdefault(done, []).append(("post_backward", g))


def _early_stopped_adapter(events: tuple[dict, dict, set[int]], ops: list, at_mark: dict, start: int, units: dict,
                           layer: int, lora_b) -> None:
    """The layer's last adapter is its last op's (down_proj's lora_B): its output's gradient is ready, so its
    pre-backward runs (prefetching its lora_A), before the unpacking of its saved input triggers the recompute,
    which stops (non-reentrant checkpoint's early stop) once lora_A's forward has made that input: lora_B is not
    gathered again. Placed before the recompute's first allocation, found as the layer's forward's first ones."""
    before, _after, _moved = events
    adapters = _adapters_of(units, layer)
    lora_a = adapters[adapters.index(lora_b) - 1]
    before.setdefault(_recompute_start(ops, at_mark, start, layer), []).extend(
        [("unshard_once", lora_b), ("unshard_once", lora_a)])


def _recompute_start(ops: list, at_mark: dict, start: int, layer: int, n: int = 6) -> int:
    """The op index in the layer's backward segment (from ``start``) where its checkpointed recompute begins: the
    first ``n`` allocations' sizes there are those of the layer's forward. ExpansionError where none is found."""
    forward = next((at for at, entries in at_mark.items()
                    if any(name in ("fw_first", "fw", "fw_last") and g == layer for name, g in entries)), None)
    if forward is None:
        raise ExpansionError(f"fsdp1: the forward of layer {layer} is not in the event list")
    head = [op[2] for op in ops[forward:] if op[0] == ALLOC][:n]
    allocs = [i for i in range(start, len(ops)) if ops[i][0] == ALLOC]
    for k, i in enumerate(allocs):
        if [ops[j][2] for j in allocs[k:k + n]] == head:
            return i
    raise ExpansionError(f"fsdp1: the recompute of layer {layer} is not in the event list")


def _adapter_grads(grads: dict, units: dict) -> dict:
    """``grads`` with each layer's adapter gradients under their own units (a layer's keys are its trainable
    tensors', model order: the adapters')."""
    out = dict(grads)
    for layer in [g for g in grads if isinstance(g, int)]:
        adapters = _adapters_of(units, layer)
        if adapters:
            keys = out.pop(layer)
            out.update({g: [key] for g, key in zip(adapters, keys, strict=True)})
    return out


def _step_ops(expansion: Expansion, ops: list, marks: tuple, build: _Builder, units: dict, table: list,
              optimizer: str, first: bool, num_layers: int, scalar: set[int], pieces: list[int],
              reshard_after_forward: bool, polys: list, recompute: bool, layer0_at_suffix: bool,
              adapter_out_elem: int | None, unit_pieces: dict, micro: str = SYNC, held: dict | None = None,
              zero_grad_keys: set | None = None, prefetch: bool = False, shard_keys: dict | None = None
              ) -> tuple[list, dict[int, int], tuple[int, int], list, int, dict]:
    """The FSDP1 step's ops, where each old op index went, where its optimizer part begins (before and after the
    loss is freed), the gradient shards (the next step's root pre-forward frees them) and where the root's
    pre-forward begins. ``recompute``: checkpointing re-runs each layer's forward (its adapters') in backward.
    ``micro``: which micro-batch of an accumulation cycle (``MICRO_BATCHES``), ``held``: the flat gradients the
    cycle's first kept under no_sync; the flat gradients this one holds are returned last. ``zero_grad_keys`` gets
    the keys of the new shards ``zero_grad`` frees (without ``use_orig_params``). ``prefetch``: this step forward
    prefetches (``_boundary``); ``shard_keys``: unit -> its new shard's reserved key."""
    layer_grads = {g: list(keys) for g, keys in _grads_by_group(expansion, ops, table).items()}
    summed = _summed_grad_keys(layer_grads, table)
    step = _Step(build, units, _adapter_grads(layer_grads, units), micro, held, unit_pieces, shard_keys)
    grad_keys = expansion.grad_keys
    cut, at_mark, seed = boundary_marks(ops, marks, scalar)
    before, after, moved_frees = _adapter_events(ops, cut, at_mark, units, layer_grads, polys, recompute,
                                                 adapter_out_elem)
    out: list = []
    moved: dict[int, int] = {}
    prefix_at: list = []
    seed_free = None

    def boundaries(index: int) -> None:
        for name, layer in at_mark.get(index, ()):
            _boundary(step, out, name, layer, num_layers, prefix_at, reshard_after_forward, layer0_at_suffix,
                      prefetch)
    for index, op in enumerate(ops[:cut]):
        boundaries(index)
        for method, g in before.get(index, ()):
            getattr(step, method)(out, g)
        moved[index] = len(out)
        if op[0] == FREE and (op[1] in grad_keys or op[1] in moved_frees):  # gradients: at their post-backward
            pass
        elif seed is not None and op[0] == FREE and op[1] == seed[1]:
            seed_free = op  # held until the root's post-backward, backward's last hook
        else:
            out.append((alloc_on(UNSHARD), *op[1:]) if op[0] == ALLOC and op[1] in summed else op)
        for method, g in after.get(index, ()):
            getattr(step, method)(out, g)
    boundaries(cut)
    if prefetch and layer0_at_suffix:  # split into its views in the root's pre-forward: after the embeddings'
        step.post_backward(out, 0)
    step.post_backward(out, "root")
    if not layer0_at_suffix:  # backward's final callback reshards what is left, in pre-order: the root, layer 0
        step.post_backward(out, 0)
    step.final_callback(out, _lazy_init_order(units, num_layers))
    if seed_free is not None:
        out.append(seed_free)
    optimizer_at = moved[cut] = len(out)
    made = {op[1] for op in ops[:cut] if op[0] == ALLOC}
    out.extend(op for op in ops[cut:]
               if op[0] == FREE and op[1] in made and op[1] not in grad_keys and op[1] not in moved_frees)
    loss_freed_at = len(out)
    step.adamw(out, pieces, first, optimizer)  # the tensors' pieces of the shards, parameter order
    if not units["root"].orig_params and not units["root"].offload:  # zero_grad(set_to_none): each flat
        # parameter's .grad is its new shard (under CPU offload, the host gradient)
        for g in _stepped_units(units, num_layers):
            shard = step.grad_shards.pop(g)
            step._free(out, shard)
            if zero_grad_keys is not None:
                zero_grad_keys.add(shard.key)
    if step.unsharded:
        raise ExpansionError("fsdp1: unsharded flat parameters left at the end of the step")
    shards = [step.grad_shards[g] for g in _lazy_init_order(units, num_layers) if g in step.grad_shards]
    return out, moved, (optimizer_at, loss_freed_at), shards, prefix_at[0], step.held


def _layer0_hooked(units: dict, table: list[ParamInfo], grad_ckpt: bool) -> bool:
    """Whether layer 0's post-backward runs as its backward ends: its flat parameter's gradient hook (trainable),
    or the reshard-only hook on its inputs, which require grad under checkpointing (transformers'
    ``enable_input_require_grads``) or after a trainable embedding; else backward's final callback does it."""
    return (units[0].flat.trainable or grad_ckpt
            or any(p.trainable and p.layer is None and p.before_layers is not False for p in table))


@dataclass(frozen=True)
class Fsdp1Step:
    expansion: Expansion
    sizes: list[int]  # bytes of the FSDP1 tensors, size indices ``base`` + j


def _shifted(moved: dict[int, int], at: int, by: int) -> dict[int, int]:
    return {k: v + by if v >= at else v for k, v in moved.items()}


def fsdp1_step(expansion: Expansion, table: list[ParamInfo], sizes: Fsdp1Sizes, optimizer: str, rank: int,
               base_size_index: int, num_layers: int, polys: list, grad_ckpt: bool = False,
               accumulating: bool = False, autocast_elem: int | None = None, grad_sync: str = "every"
               ) -> Fsdp1Step:
    """The expansion with FSDP1's events; the new tensors' sizes take indices from ``base_size_index`` on;
    ``accumulating``: with the micro-steps of gradient accumulation (``_micro_steps``, ``grad_sync`` last:
    ``_no_sync_micro_steps``); ``autocast_elem``: the
    forward's autocast dtype's bytes, None without. ExpansionError where the step cannot be built."""
    if optimizer not in OPTIMIZERS:
        raise ExpansionError(f"fsdp1: the {optimizer} optimizer's step over shards is not modelled")
    reason = why_not_fsdp1(sizes.options)
    if reason:
        raise ExpansionError(reason)
    units = _units(table, num_layers, sizes)
    if any(not units[layer].params for layer in range(num_layers)) or not units["root"].params:
        raise ExpansionError("fsdp1: a decoder layer or the root holds no parameters")
    piece_of: dict[str, int] = {}
    unit_pieces: dict = {}
    for g, unit in units.items():
        # the rank's place in its shard group (HYBRID_SHARD: within the node)
        shard_rank = rank % unit.flat.world
        pieces = shard_pieces(unit.params, unit.offsets, unit.flat.shard_numel, shard_rank)
        piece_of.update((p.name, n * unit.flat.param_elem) for p, n in zip(unit.params, pieces))
        unit_pieces[g] = [0 if _grad_view_fits(p, n, unit.flat) else n * unit.flat.param_elem
                          for p, n in zip(unit.params, pieces)]
    if sizes.options.cpu_offload:  # the optimizer steps the host shards
        # a recompute's pre-forward makes the copies again under mixed precision (``pre_unshard``); without, the
        # unit is still unsharded and nothing is made
        if accumulating or (grad_ckpt and sizes.mixed):
            raise ExpansionError("fsdp1 with CPU offload: replayed without accumulation, and without checkpointing "
                                 "under mixed precision")
        pieces = []
    elif sizes.options.use_orig_params:
        pieces = [piece_of[p.name] for p in model_order(table) if p.trainable and piece_of[p.name]]
    elif accumulating and grad_sync == "last":
        raise ExpansionError("fsdp1 without use_orig_params under no_sync: not modelled yet")
    else:  # the optimizer steps the flat parameters themselves, i.e. this rank's shards
        pieces = [units[g].stepped_bytes for g in _stepped_units(units, num_layers)]
    build = _Builder(expansion.steady.keys, base_size_index)
    first_marks, steady_marks = expansion.marks
    scalar = {i for i, poly in enumerate(polys) if 0 < poly[0] <= 8 and not any(poly[1:])}
    prefetch = sizes.options.forward_prefetch
    if prefetch and (accumulating or sizes.adapters):
        raise ExpansionError("fsdp1 with forward prefetch: replayed without gradient accumulation or LoRA")
    shard_keys = dict(zip(_lazy_init_order(units, num_layers), build.reserve(len(units)))) if prefetch else None
    common = dict(build=build, units=units, table=table, optimizer=optimizer, num_layers=num_layers,
                  scalar=scalar, pieces=pieces, reshard_after_forward=sizes.frees_after_forward,
                  polys=_per_row_polys(polys),
                  recompute=grad_ckpt, layer0_at_suffix=_layer0_hooked(units, table, grad_ckpt),
                  adapter_out_elem=autocast_elem, unit_pieces=unit_pieces, shard_keys=shard_keys)
    start = build.next_key
    zero_grad_keys: set[int] = set()  # without use_orig_params: the new shards, the flat parameters' .grad
    steady_ops, _moved, steady_optimizer, steady_shards, steady_prefix, _held = _step_ops(
        expansion, expansion.steady.ops, steady_marks, first=False, zero_grad_keys=zero_grad_keys, prefetch=prefetch,
        **common)
    steady_keys = build.next_key
    build.next_key = start  # the first step's tensors take the same keys in the same order
    first_ops, first_moved, first_optimizer, first_shards, first_prefix, _held = _step_ops(
        expansion, expansion.first.ops, first_marks, first=True, **common)
    if [t.key for t in first_shards] != [t.key for t in steady_shards]:
        raise ExpansionError("fsdp1: the gradient shards of the first and the steady step differ")
    lazy: list = []  # keys after every other tensor of the step, so both steps keep theirs
    _Step(build, units, {}).lazy_init(lazy, _lazy_init_order(units, num_layers))
    first_ops[first_prefix:first_prefix] = lazy
    first_moved = _shifted(first_moved, first_prefix, len(lazy))
    # the previous step's gradient shards go at the root's pre-forward (``_clear_grads_if_needed``)
    previous = [(FREE_PREVIOUS, t.key, t.size_index) for t in steady_shards]
    steady_ops[steady_prefix:steady_prefix] = previous
    step_keys = max(steady_keys, build.next_key)
    first_at, steady_at = (first_optimizer[1] + len(lazy), steady_optimizer[0] + len(previous))
    micro = None
    if accumulating and grad_sync == "last":
        micro, keys = _no_sync_micro_steps(expansion, build, start, common, lazy)
        step_keys = max(step_keys, keys)
    elif accumulating:
        build.next_key = start  # a later micro-batch's tensors take the steady step's keys
        middle, _moved, middle_optimizer, _shards, _prefix, _held = _step_ops(
            expansion, expansion.steady.ops, steady_marks, first=False, micro=ADD_SHARD, **common)
        step_keys = max(step_keys, build.next_key)
        loss = steady_ops[steady_at:steady_optimizer[1] + len(previous)]
        micro = _micro_steps(first_ops, first_at - len(loss), steady_ops, steady_at, middle[:middle_optimizer[0]],
                             loss, {t.key for t in steady_shards}, zero_grad_keys)
    # kept to the next step: the shards, a manual loop's outputs
    return Fsdp1Step(expansion=method_expansion(
        "fsdp1", expansion, first_ops, steady_ops, step_keys, first_moved, (first_at, steady_at),
        grad_keys=frozenset(), micro=micro), sizes=build.sizes)


def _per_row_polys(polys: list) -> list:
    """``polys`` for finding the adapters' outputs by their bytes per token (``_per_token_bytes``): a regime of one
    micro-batch size (a profile's b = 1 regime) fits its sizes in ``s`` alone, which are ``b * s`` ones there."""
    if any(any(poly[3:]) for poly in polys):
        return polys
    return [[c0, 0.0, 0.0, 0.0, c1, c2] for c0, c1, c2, *_rest in polys]


def _grad_view_fits(p: ParamInfo, piece_numel: int, flat: FlatUnit) -> bool:
    """Whether ``_use_unsharded_grad_views`` can make the tensor's view of the flat gradient its ``.grad`` as it
    is: its sharded self (a 1-D slice of the shard) has the view's shape (a 1-D tensor wholly in this rank's
    shard) and dtype (no mixed precision); else it is given ``empty_like`` itself first."""
    return len(p.shape) == 1 and piece_numel == p.numel and flat.param_elem == flat.compute_elem


def _no_sync_micro_steps(expansion: Expansion, build: _Builder, start: int, common: dict, lazy: list
                         ) -> tuple[MicroSteps, int]:
    """Gradient accumulation under ``no_sync()`` on every micro-batch but the last (``grad_sync`` last: what the HF
    Trainer and accelerate run), and the keys a micro-step uses. The post-backward hook reshards and returns
    (``_post_backward_hook``: ``not state._sync_gradients``): the cycle's first micro-batch keeps each flat
    gradient as the flat parameter's ``.grad`` (on the unshard stream, where autograd made it), a middle one's is
    added into it (``AccumulateGrad``) and dropped once the hooks are done, the last reduces the held one (this
    micro-batch's added into it, kept referenced by autograd until the hook returns) into new shards, which
    the next cycle's first root pre-forward drops."""
    first_marks, steady_marks = expansion.marks
    built = KeyedBuilds(_step_ops, expansion, build, start, common)
    first_head, _moved, first_optimizer, _shards, first_prefix, first_held = built(
        expansion.first.ops, first_marks, True, HOLD)
    first_head[first_prefix:first_prefix] = lazy
    head, _moved, head_optimizer, _shards, head_prefix, held = built(expansion.steady.ops, steady_marks, False, HOLD)
    if [t.key for t in first_held.values()] != [t.key for t in held.values()]:
        raise ExpansionError("fsdp1: the held flat gradients of the first and the steady step differ")
    middle, _moved, middle_optimizer, *_rest = built(expansion.steady.ops, steady_marks, False, HOLD_ADD)
    last, _moved, last_optimizer, shards, *_rest = built(expansion.steady.ops, steady_marks, False, REDUCE_HELD, held)
    first_last, _moved, first_last_optimizer, *_rest = built(expansion.steady.ops, steady_marks, True, REDUCE_HELD,
                                                            held)
    # the previous cycle's shards go at the root's pre-forward (``_clear_grads_if_needed``)
    head[head_prefix:head_prefix] = [(FREE_PREVIOUS, t.key, t.size_index) for t in shards]
    loss_at, loss_freed_at = last_optimizer
    return MicroSteps(first_head=first_head[:first_optimizer[0] + len(lazy)],
                      head=head[:head_optimizer[0] + len(shards)], middle=middle[:middle_optimizer[0]],
                      before_optimizer=last[loss_at:loss_freed_at], first_tail=first_last[first_last_optimizer[0]:],
                      tail=last[loss_at:], last=last[:loss_at]), built.keys


def _micro_steps(first_ops: list, first_end: int, steady_ops: list, steady_end: int, middle: list, loss: list,
                 shards: set[int], zero_grad_keys: set[int] = frozenset()) -> MicroSteps:
    """Gradient accumulation with a reduce-scatter every micro-batch (``grad_sync`` every: no ``no_sync``), as
    ``estimator.reserved.accumulate`` builds micro-steps, FSDP1's way: the cycle's first micro-batch keeps its new
    shards as ``_saved_grad_shard`` (then ``.grad``: ``prepare_gradient_for_optim`` moves the tensor, the next
    pre-backward moves it back), a later one adds its own into them (``_accumulate_sharded_grad``) and frees
    them (``middle``: the steady step's forward and backward so built); the optimizer's ``zero_grad`` frees
    nothing (the tensors' gradients view the shards), the next cycle's first root pre-forward drops them
    (``FREE_PREVIOUS_CYCLE``). Without ``use_orig_params`` (``zero_grad_keys``) the kept shards are the flat
    parameters' ``.grad`` (``prepare_gradient_for_optim``; the next micro-batch's pre-backward moves them back to
    ``_saved_grad_shard``: ``prepare_gradient_for_backward``) and the cycle's ``zero_grad`` frees them
    (``FREE_CYCLE``). ``first_end`` / ``steady_end``: where each step's loss is freed, its optimizer part begins."""
    if sorted(first_ops[first_end:first_end + len(loss)]) != sorted(loss):
        raise ExpansionError("fsdp1: the first step does not free the loss right before its optimizer step")
    head = [(FREE_PREVIOUS_CYCLE, key, size) if kind == FREE_PREVIOUS and key in shards else (kind, key, size)
            for kind, key, size in steady_ops[:steady_end]]

    def tail(ops: list) -> list:
        return [(FREE_CYCLE, key, size) if kind == FREE and key in zero_grad_keys else (kind, key, size)
                for kind, key, size in ops]
    return MicroSteps(first_head=first_ops[:first_end], head=head, middle=middle, before_optimizer=loss,
                      first_tail=tail(first_ops[first_end:]), tail=tail(steady_ops[steady_end:]))
