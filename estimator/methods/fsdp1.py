"""FSDP1 (``FullyShardedDataParallel``): one flat parameter per unit, replayed event by event over a profiled step.

Units as accelerate's TRANSFORMER_BASED_WRAP builds them: one per decoder layer, the root holding everything
else (embeddings, final norm, head). What each unit allocates (torch 2.13, ``torch/distributed/fsdp/
_flat_param.py`` and ``_runtime_utils.py``; order checked against the CPU oracle, ``harness.fake.trace_run``):

* the flat parameter: the unit's tensors concatenated in registration order; with ``use_orig_params`` each
  tensor starts 16-byte aligned (in the compute dtype) and the total is padded to a multiple of the shard group,
  without it the last shard is padded. Every rank keeps its shard ``S`` in the parameters' dtype (fp32 under
  mixed_*: the shards are the master weights);
* unshard: under mixed_* a 16-bit copy of the shard (freed once the all-gather is issued), then the padded
  unsharded flat parameter ``U`` in the compute dtype, which the parameters view. Layers free it after forward
  (FULL_SHARD, HYBRID_SHARD; SHARD_GRAD_OP keeps it to backward) and after backward; the root keeps it from its
  pre-forward to its post-backward. ``forward_prefetch`` unshards the next layer in each pre-forward;
  BACKWARD_PRE unshards the next layer in each pre-backward (two layers unsharded while one computes),
  BACKWARD_POST after the current one is freed;
* backward: the parameters' gradients are held until the unit's last one exists, then concatenated into the
  flat gradient (every element, zeros where a tensor has no gradient) in the compute dtype. The post-backward
  hook frees ``U``, casts the flat gradient to the reduce dtype (fp32 under mixed_*), pads it to ``S`` x N when
  the flat parameter is not already padded, reduce-scatters into a new shard that stays as the sharded gradient
  (added in place under accumulation), and drops the unsharded copies when it returns.

``limit_all_gathers`` (the rate limiter) only decides how far the CPU runs ahead of the GPU, i.e. how many freed
blocks the caching allocator still waits on: reserved memory, not allocated. CPU offload keeps shards, optimizer
states and the step on the host; a GPU copy of each shard is made for its all-gather, and the sharded gradients
stay on the GPU until backward ends. NO_SHARD keeps the whole flat parameter and its full-size gradient.

LoRA: FSDP1 flattens tensors of one dtype only, so fp32 adapters over 16-bit weights cannot share a decoder
layer's unit; peft's ``fsdp_auto_wrap_policy`` (what the HF Trainer gives a PEFT model under FSDP) makes every
leaf module with a trainable weight (each ``lora_A``/``lora_B`` Linear) a unit of its own inside the decoder-layer
units, which then hold the frozen base weights alone (no gradient, no reduction). An adapter unit's gradient
becomes this rank's shard in its post-backward, within its layer's backward; its transient gathers (one adapter
weight at a time: KiB to a few MiB) are not counted, but SHARD_GRAD_OP keeps them from forward to backward as it
keeps the layer's. Prefetching follows the units' post-forward order (each layer's adapters before it), so the
previous layer is gathered by this layer's first adapter near the end of its backward: placed at the layer
boundary (docs/error_matrix/README.md, Finding 13). Not modelled: mixed_* (FSDP1's MixedPrecision would cast the
adapters to 16 bits, which changes what they save for backward) and prefetching other than BACKWARD_PRE.

LoRA with ``lora_wrap`` "layer" (the decoder-layer policy alone: Lightning's ``FSDPStrategy(auto_wrap_policy=
{Block})``, LitGPT's scripts): the adapters are flattened with their layer's frozen weights (one dtype: built in
16 bits). With ``use_orig_params`` a flat parameter with any trainable tensor requires a gradient, and in forward
the tensors are its views, frozen ones included, so autograd makes every frozen weight's gradient too: the unit
then behaves as full fine-tuning's (full-size flat gradient, reduce-scatter, a sharded gradient of the whole
shard, held unsharded under ``no_sync``), while the optimizer steps only the adapters' pieces of the shard. The
frozen weights' gradients are placed at the end of their layer's backward, beside the flat gradient they are
concatenated into.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from estimator.allocator.model import MIN_BLOCK_BYTES
from estimator.methods.fsdp_replay import (
    BACKWARD_LAYER,
    FIRST,
    FORWARD_LAYER,
    LATER,
    MICRO_BATCHES,
    SYNCED_LAST,
    UNSYNCED_FIRST,
    UNSYNCED_LATER,
    Walk,
    segment_layer,
    set_part,
)
from estimator.methods.state import StepModel, optimizer_state_bytes, step_temp_bytes
from estimator.methods.timeline import Replay, segment_sequence
from estimator.models.params import ParamInfo, largest_layer
from estimator.spec import Fsdp1Spec, RunSpec, model_code_release

FP32 = 4
HALF = 2
ALIGN_BYTES = 16
BUFFERS = ("root_params", "layer_params", "low_precision_shard", "flat_grad", "reduce", "kept_inputs")
GRADS = ("root_grads", "layer_grads", "grad_shards", "held_grads")


@dataclass(frozen=True)
class FlatUnit:
    """One FSDP1 unit's flat parameter on one rank."""

    numel: int                  # flat parameter numel (alignment and divisibility padding included when aligned)
    shard_numel: int            # S: every rank's padded shard
    param_elem: int             # bytes per element of the flat parameter (and of the sharded gradient)
    compute_elem: int           # bytes per element of the unsharded parameter and its gradient
    reduce_elem: int
    trainable: bool
    local_trainable_numel: int  # elements of trainable tensors inside this rank's shard (optimizer state)
    world: int                  # shard group size
    # Elements of frozen tensors in a unit that has trainable ones: with ``use_orig_params`` their views of the
    # flat parameter require a gradient, so autograd makes one for each (``frozen_grad_bytes``).
    frozen_numel: int = 0

    @property
    def frozen_grad_bytes(self) -> float:
        return float(self.frozen_numel * self.compute_elem)

    @property
    def unsharded_bytes(self) -> float:
        return float(self.shard_numel * self.world * self.compute_elem)

    @property
    def flat_grad_bytes(self) -> float:
        return float(self.numel * self.compute_elem) if self.trainable else 0.0


def flat_layout(params: list[ParamInfo], world: int, compute_elem: int, aligned: bool
                ) -> tuple[list[int], list[int], int]:
    """(each tensor's offset in the flat parameter, the padding segments' elements in flat order, the total).
    ``aligned`` (``use_orig_params``): each tensor starts 16-byte aligned and the total is padded to a multiple
    of the shard group (``_init_flat_param_and_metadata``)."""
    align = ALIGN_BYTES // compute_elem if aligned else 0
    offsets: list[int] = []
    paddings: list[int] = []
    total = 0
    for p in params:
        if align and total % align:
            paddings.append(align - total % align)
            total += paddings[-1]
        offsets.append(total)
        total += p.numel
    if aligned and total % world:
        paddings.append(world - total % world)
        total += paddings[-1]
    return offsets, paddings, total


def shard_pieces(params: list[ParamInfo], offsets: list[int], shard: int, rank: int) -> list[int]:
    """Elements of each tensor inside ``rank``'s shard of ``shard`` elements."""
    lo, hi = rank * shard, (rank + 1) * shard
    return [max(0, min(off + p.numel, hi) - max(off, lo)) for off, p in zip(offsets, params)]


def flat_unit(params: list[ParamInfo], world: int, rank: int, compute_elem: int, param_elem: int,
              reduce_elem: int, aligned: bool) -> FlatUnit:
    offsets, _paddings, total = flat_layout(params, world, compute_elem, aligned)
    shard = math.ceil(total / world) if total else 0
    local = sum(n for n, p in zip(shard_pieces(params, offsets, shard, rank), params) if p.trainable)
    trainable = any(p.trainable for p in params)
    return FlatUnit(numel=total, shard_numel=shard, param_elem=param_elem, compute_elem=compute_elem,
                    reduce_elem=reduce_elem, trainable=trainable, local_trainable_numel=local, world=world,
                    frozen_numel=sum(p.numel for p in params if not p.trainable) if trainable else 0)


@dataclass(frozen=True)
class Fsdp1Sizes:
    root: FlatUnit
    layer: FlatUnit
    options: Fsdp1Spec
    mixed: bool  # 16-bit compute from fp32 shards (MixedPrecision param_dtype)
    adapters: tuple[FlatUnit, ...] = ()  # LoRA: one unit per adapter weight of a decoder layer
    # Each decoder layer's own unit where layers are not all alike (a dense first layer before expert layers);
    # empty: every layer is ``layer``.
    layers: tuple[FlatUnit, ...] = ()
    # Bytes per token a decoder layer's unit keeps from its backward to the end of backward (its input and the
    # input's gradient: ``reentrant_kept_input_bytes``); 0: none kept.
    kept_input_bytes_per_token: float = 0.0
    # QLoRA: every 4-bit weight's quant state, whole on this rank (not a parameter: neither flattened nor sharded).
    quant_state_bytes: float = 0.0

    def unit_of(self, index: int) -> FlatUnit:
        """Decoder layer ``index``'s unit."""
        return self.layers[index] if self.layers else self.layer

    @property
    def adapter_kept_bytes(self) -> float:
        """One layer's adapter gradients as this rank keeps them (its shards; NO_SHARD: whole)."""
        return float(sum((u.shard_numel if self.sharded else u.numel) * u.param_elem for u in self.adapters))

    @property
    def sharded(self) -> bool:
        return self.options.sharding_strategy != "NO_SHARD"

    @property
    def frees_after_forward(self) -> bool:
        """Layers reshard after forward (NO_SHARD frees its 16-bit copy there, the root's too)."""
        return self.options.sharding_strategy != "SHARD_GRAD_OP"

    def unsharded_bytes(self, unit: FlatUnit) -> float:
        """What an unshard allocates: the padded unsharded flat parameter; NO_SHARD: the 16-bit copy of the
        whole flat parameter under mixed_*, nothing otherwise (the parameters are the flat parameter)."""
        if not self.sharded and not self.mixed:
            return 0.0
        if unit is not self.root and not self.frees_after_forward:  # SHARD_GRAD_OP keeps the adapters' gathers too
            return unit.unsharded_bytes + sum(a.unsharded_bytes for a in self.adapters)
        return unit.unsharded_bytes

    def keeps_grad_shard(self, unit: FlatUnit) -> bool:
        """Whether a unit's sharded gradient survives to the next micro-batch. With ``use_orig_params`` the
        gradient is exposed as views for the original tensors, ``None`` for frozen ones and for those outside this
        rank's shard (``_use_sharded_grad_views``), and the next pre-forward drops the flat gradient when every
        view is ``None`` (``_reset_flat_param_grad_info_if_needed``): a rank whose shard of the unit holds no
        trainable element starts each micro-batch without it (seen on real CPU runs of LoRA inside the layer
        units, benchmarks/fsdp1_lora_layer_wrap.py)."""
        return unit.trainable and not (self.options.use_orig_params and self.sharded
                                       and unit.local_trainable_numel == 0)

    def low_precision_shard_bytes(self, unit: FlatUnit) -> float:
        return float(unit.shard_numel * unit.compute_elem) if self.mixed and self.sharded else 0.0


def _unshard(sz: Fsdp1Sizes, unit: FlatUnit, part: str) -> list:
    """pre_unshard (the 16-bit shard copy), the all-gather into the unsharded flat parameter, post_unshard."""
    mp = sz.low_precision_shard_bytes(unit)
    events = []
    if mp:
        events.append(set_part("low_precision_shard", lambda st: mp))
    events.append(set_part(part, lambda st: st[part] + sz.unsharded_bytes(unit)))
    if mp:
        events.append(set_part("low_precision_shard", lambda st: 0.0))
    return events


def _free(sz: Fsdp1Sizes, unit: FlatUnit, part: str) -> list:
    return [set_part(part, lambda st: max(st[part] - sz.unsharded_bytes(unit), 0.0))]


def _post_backward(sz: Fsdp1Sizes, unit: FlatUnit, params_part: str, grads_part: str, micro: str,
                   prefetch: FlatUnit | None, grad_bytes: float | None = None) -> list:
    """The unit's gradients are complete: flat gradient, reshard (BACKWARD_POST prefetches ``prefetch`` here),
    reduce. ``grad_bytes``: the unit's own parameter gradients to drop (None: everything in ``grads_part``).
    ``micro``: which micro-batch (``methods.fsdp_replay.MICRO_BATCHES``)."""
    accumulating = micro == LATER
    prefetched = [] if prefetch is None else _unshard(sz, prefetch, "layer_params")
    if not unit.trainable:
        events = _adapters_post_backward(sz, grads_part, grad_bytes, accumulating) if unit is not sz.root else []
        return events + _free(sz, unit, params_part) + prefetched
    frozen = unit.frozen_grad_bytes  # the frozen tensors' gradients, made in the unit's backward (placed at its end)
    drop = (lambda st: 0.0) if grad_bytes is None else (lambda st: max(st[grads_part] - grad_bytes - frozen, 0.0))
    events = [set_part(grads_part, lambda st: st[grads_part] + frozen)] if frozen else []
    events += [set_part("flat_grad", lambda st: unit.flat_grad_bytes), set_part(grads_part, drop)]
    if micro in (UNSYNCED_FIRST, UNSYNCED_LATER, SYNCED_LAST):
        events += _held_flat_grad(unit, micro)
    events += _free(sz, unit, params_part) + prefetched
    if micro in (UNSYNCED_FIRST, UNSYNCED_LATER):  # no_sync: nothing reduced
        return events
    cast = float(unit.numel * unit.reduce_elem) if unit.reduce_elem != unit.compute_elem else 0.0
    if cast:
        events.append(set_part("reduce", lambda st: cast))
    if not sz.sharded:
        # NO_SHARD all-reduces in place and keeps the full gradient (cast to the parameters' dtype if needed).
        kept = float(unit.numel * unit.param_elem)
        if unit.param_elem != (unit.reduce_elem if cast else unit.compute_elem):
            events.append(set_part("reduce", lambda st: st["reduce"] + kept))
        if accumulating:  # autograd added this micro-batch's gradient into the one kept
            kept = 0.0
        return events + [_keep_flat_grad(kept)]
    padded = unit.shard_numel * unit.world
    if padded > unit.numel:  # F.pad into a new tensor of S x N elements
        events.append(set_part("reduce", lambda st: st["reduce"] + padded * unit.reduce_elem))
    new_shard = float(unit.shard_numel * unit.reduce_elem)
    events.append(set_part("grad_shards", lambda st: st["grad_shards"] + new_shard))
    kept = float(unit.shard_numel * unit.param_elem)
    if kept != new_shard:  # cast to the parameters' dtype: a new tensor, the reduced one freed
        events += [set_part("grad_shards", lambda st: st["grad_shards"] + kept),
                   set_part("grad_shards", lambda st: st["grad_shards"] - new_shard)]
    if accumulating and sz.keeps_grad_shard(unit):  # added in place into the saved shard
        events.append(set_part("grad_shards", lambda st: st["grad_shards"] - kept))
    if micro == SYNCED_LAST and unit.param_elem != unit.compute_elem:
        events.append(set_part("held_grads", lambda st: st["held_grads"] - unit.flat_grad_bytes))
    return events + [set_part("reduce", lambda st: 0.0), set_part("flat_grad", lambda st: 0.0)]


def _held_flat_grad(unit: FlatUnit, micro: str) -> list:
    """``AccumulateGrad`` on the flat parameter under ``no_sync`` (before the post-backward hook): the first
    micro-batch's flat gradient becomes the held ``.grad``, a later one's is added into it and freed; the last
    micro-batch then reduces the held one. Under ``MixedPrecision`` (the flat parameter full precision, its
    gradient 16-bit) the last micro-batch's new flat gradient stays beside the held one until the reduction is
    done (read off the project's tracer at 2 and 4 ranks, FULL_SHARD and SHARD_GRAD_OP: Finding 15)."""
    grad = unit.flat_grad_bytes
    if micro == UNSYNCED_FIRST:
        return [_move("flat_grad", "held_grads", grad)]
    if micro == SYNCED_LAST and unit.param_elem != unit.compute_elem:
        return []
    events = [set_part("flat_grad", lambda st: 0.0)]
    return events + ([_move("held_grads", "flat_grad", grad)] if micro == SYNCED_LAST else [])


def _move(source: str, target: str, nbytes: float):
    """Bytes that change hands between two parts of the state (no new peak)."""
    def apply(state: dict) -> bool:
        state[source] -= nbytes
        state[target] += nbytes
        return False
    return apply


def _adapters_post_backward(sz: Fsdp1Sizes, grads_part: str, grad_bytes: float | None, accumulating: bool) -> list:
    """The layer's adapter units have reduced their gradients: this rank's shards kept (added in place under
    accumulation), the traced full-size adapter gradients dropped."""
    if not sz.adapters:
        return []
    kept = 0.0 if accumulating else sz.adapter_kept_bytes
    drop = (lambda st: 0.0) if grad_bytes is None else (lambda st: max(st[grads_part] - grad_bytes, 0.0))
    return [set_part("grad_shards", lambda st: st["grad_shards"] + kept), set_part(grads_part, drop)]


def _keep_input(nbytes: float):
    """A recomputed layer's input and its gradient, kept past its backward (``reentrant_kept_input_bytes``)."""
    def apply(state: dict) -> bool:
        state["kept_inputs"] += nbytes
        return True
    return apply


def _keep_flat_grad(kept: float):
    """End of a NO_SHARD post-backward: the kept gradient becomes the unit's gradient, the copies are freed."""
    def apply(state: dict) -> bool:
        state["grad_shards"] += kept
        state["flat_grad"] = state["reduce"] = 0.0
        return False
    return apply


def _forward_events(name: str, num_layers: int, sz: Fsdp1Sizes, index: int) -> list:
    """At the start of a forward segment; ``index``: the decoder layer whose forward starts there (``prefix``: 0,
    ``mid_fw``: the layer count)."""
    opts = sz.options
    reshard_fw = sz.frees_after_forward
    if name == "prefix":  # the root's pre-forward; forward prefetching unshards the first layer there
        events = _unshard(sz, sz.root, "root_params")
        return events + (_unshard(sz, sz.unit_of(0), "layer_params") if opts.forward_prefetch else [])
    if name in FORWARD_LAYER:
        events = [] if name == "fw_first" or not reshard_fw else _free(sz, sz.unit_of(index - 1), "layer_params")
        if not opts.forward_prefetch:
            events += _unshard(sz, sz.unit_of(index), "layer_params")
        if opts.forward_prefetch and name != "fw_last" and num_layers > 1:
            events += _unshard(sz, sz.unit_of(index + 1), "layer_params")
        return events
    if name == "mid_fw":
        events = _free(sz, sz.unit_of(num_layers - 1), "layer_params") if reshard_fw else []
        return events + ([] if sz.sharded else _free(sz, sz.root, "root_params"))
    raise ValueError(f"fsdp1: unknown forward segment {name!r}")


def _backward_events(sz: Fsdp1Sizes, layer_index: int, num_layers: int, layer_grad_bytes: list[float],
                     micro: str) -> list:
    """At the start of layer ``layer_index``'s backward (-1: the suffix, after the first layer's).
    ``layer_grad_bytes``: each layer's traced parameter gradients.

    A layer's post-backward runs when autograd reaches its flat parameter's split node, which it orders by
    creation: unsharded in its own pre-forward, the split comes after the previous layer's backward; prefetched
    in the previous layer's pre-forward (``forward_prefetch``), it comes one layer later."""
    opts = sz.options
    reshard_fw = sz.frees_after_forward
    delay = 1 if opts.forward_prefetch else 0
    pre = opts.backward_prefetch == "BACKWARD_PRE"
    # BACKWARD_POST prefetches in the post-backward of the layer after the one that needs it; deferred by a
    # layer, that one has already unsharded itself.
    post = opts.backward_prefetch == "BACKWARD_POST" and not delay
    events = []
    if sz.adapters and pre and reshard_fw:
        # Prefetching follows the units' post-forward order, in which each layer's adapters come before it: a
        # layer's pre-backward prefetches its own last adapter, and the previous layer is gathered by this layer's
        # first adapter, at the end of its backward, before this layer reshards (the last layer: by the root).
        events += _unshard(sz, sz.unit_of(layer_index), "layer_params") if 0 <= layer_index < num_layers - 1 else []
        pre = False
    finished = layer_index + 1 + delay
    if finished < num_layers:
        prefetch = sz.unit_of(layer_index) if post and reshard_fw and layer_index >= 0 else None
        events += _post_backward(sz, sz.unit_of(finished), "layer_params", "layer_grads", micro, prefetch,
                                 grad_bytes=layer_grad_bytes[finished])
    if layer_index < 0:  # the suffix
        return events
    last = layer_index == num_layers - 1
    # BACKWARD_PRE: every layer was prefetched (the last by the root); BACKWARD_POST: all but the last.
    if reshard_fw and not pre and not (post and not last) and not sz.adapters:
        events += _unshard(sz, sz.unit_of(layer_index), "layer_params")
    if pre and reshard_fw and layer_index > 0:
        events += _unshard(sz, sz.unit_of(layer_index - 1), "layer_params")
    return events


def _mid_backward_events(sz: Fsdp1Sizes, num_layers: int) -> list:
    """The root's pre-backward hook (on the loss): NO_SHARD re-makes the root's 16-bit copy; BACKWARD_PRE
    prefetches the last layer."""
    events = [] if sz.sharded else _unshard(sz, sz.root, "root_params")
    if sz.options.backward_prefetch == "BACKWARD_PRE" and sz.frees_after_forward:
        events += _unshard(sz, sz.unit_of(num_layers - 1), "layer_params")
    return events


def _boundary_events(name: str, index: int | None, num_layers: int, sz: Fsdp1Sizes, layer_grad_bytes: list[float],
                     micro: str) -> list:
    """FSDP1's events at the start of a profile segment whose layer is ``index`` (``segment_layer``)."""
    if name in BACKWARD_LAYER:
        return _backward_events(sz, index, num_layers, layer_grad_bytes, micro)
    if name == "mid_bw":
        return _mid_backward_events(sz, num_layers)
    if name == "suffix":
        return _backward_events(sz, -1, num_layers, layer_grad_bytes, micro)
    return _forward_events(name, num_layers, sz, {"prefix": 0, "mid_fw": num_layers}.get(name, index))


def _schedule(num_layers: int, sz: Fsdp1Sizes, layer_grad_bytes: list[float], micro: str
              ) -> list[tuple[str, int, list]]:
    """(profile segment, repetitions, boundary events) over the step. Every layer alike: a repeated segment is
    split where its events change (the first backward layers, before any post-backward is due); layers not
    alike: one entry per layer."""
    delay = int(sz.options.forward_prefetch)
    out = []
    for name, repeats in segment_sequence(num_layers):
        if sz.layers:
            out += [(name, 1, _boundary_events(name, segment_layer(name, k, num_layers), num_layers, sz,
                                               layer_grad_bytes, micro)) for k in range(repeats)]
            continue
        index = segment_layer(name, 0, num_layers)
        if name == "bw" and delay and repeats > 1:  # the first middle layer has no post-backward due yet
            out.append((name, 1, _boundary_events(name, index, num_layers, sz, layer_grad_bytes, micro)))
            index, repeats = index - 1, repeats - 1
        out.append((name, repeats, _boundary_events(name, index, num_layers, sz, layer_grad_bytes, micro)))
    return out


def _layer_grad_bytes(segments: dict, num_layers: int, per_layer: bool) -> list[float]:
    """Each decoder layer's traced parameter gradients: its backward segment's (every layer alike: the first
    layer's, as all are)."""
    if not per_layer:
        return [segments["bw_last"]["net_grad"]] * num_layers
    return [segments["bw_last" if i == 0 else "bw_first" if i == num_layers - 1 else "bw"]["net_grad"]
            for i in range(num_layers)]


def _mixed_schedule(segments: dict, num_layers: int, sz: Fsdp1Sizes, layer_grad_bytes: list[float], micro: str
                    ) -> list[tuple[str, int, list]]:
    """``_schedule`` over a mixed layer sequence (``estimator.methods.long_context.mixed_layers``: every-k
    checkpointing), one instance at a time: each layer's boundary events by its place, whichever its kind. A
    checkpointed layer recomputes inside the unit's forward, which its pre-backward hook has unsharded; the unit's
    hooks are outside the checkpoint and run once. ``release`` (what the checkpoints kept alive) has none."""
    out, forward, backward = [], 0, 0
    for name, repeats in segments["sequence"]:
        base = name.split("+")[0]
        for _ in range(repeats):
            index = None
            if base in BACKWARD_LAYER:
                index, backward = num_layers - 1 - backward, backward + 1
            elif base in FORWARD_LAYER:
                index, forward = forward, forward + 1
            events = [] if base == "release" else _boundary_events(base, index, num_layers, sz, layer_grad_bytes,
                                                                   micro)
            out.append((name, 1, events))
    return out


def replay_fsdp1(segments: dict, num_layers: int, b: int, s: int, sizes: Fsdp1Sizes,
                 accumulating: bool | str = False) -> Replay:
    """Peak of activations + gradients + FSDP1 buffers over one steady step's forward and backward.
    ``accumulating``: which micro-batch (``methods.fsdp_replay.MICRO_BATCHES``; False / True: FIRST / LATER).
    Under ``no_sync`` the flat gradients are held unsharded in the compute dtype, a later micro-batch's added into
    them by ``AccumulateGrad``, so at most the flat gradient being made is in flight."""
    micro = accumulating if isinstance(accumulating, str) else LATER if accumulating else FIRST
    if micro not in MICRO_BATCHES:
        raise ValueError(f"fsdp1: unknown micro-batch {micro!r}")
    if sizes.layers and len(sizes.layers) != num_layers:
        raise ValueError(f"fsdp1: {len(sizes.layers)} layer units for {num_layers} decoder layers")
    walk = Walk(b, s, grad_part=lambda name: "layer_grads" if name.split("+")[0] in BACKWARD_LAYER else "root_grads")
    act = 0.0
    state = dict.fromkeys(BUFFERS + GRADS, 0.0)
    layer_units = sizes.layers or (sizes.layer,) * num_layers
    if micro in (UNSYNCED_LATER, SYNCED_LAST):
        state["held_grads"] = (sum(u.flat_grad_bytes * u.trainable for u in layer_units)
                               + sizes.root.flat_grad_bytes * sizes.root.trainable)
    accumulating = micro == LATER
    if accumulating:
        state["grad_shards"] = (sum((u.shard_numel if sizes.sharded else u.numel) * u.param_elem
                                    * sizes.keeps_grad_shard(u) for u in layer_units)
                                + (sizes.root.shard_numel if sizes.sharded else sizes.root.numel)
                                * sizes.root.param_elem * sizes.keeps_grad_shard(sizes.root)
                                + num_layers * sizes.adapter_kept_bytes)
    layer_grad_bytes = _layer_grad_bytes(segments, num_layers, bool(sizes.layers))
    schedule = _mixed_schedule(segments, num_layers, sizes, layer_grad_bytes, micro) if segments.get("sequence") \
        else _schedule(num_layers, sizes, layer_grad_bytes, micro)
    if sizes.kept_input_bytes_per_token:  # each layer's backward starts with the one above it kept
        keep = _keep_input(b * s * sizes.kept_input_bytes_per_token)
        schedule = [(name, repeats, events + [keep] if name.split("+")[0] in ("bw", "bw_last", "suffix") else events)
                    for name, repeats, events in schedule]
    for name, repeats, events in schedule:
        act, state = walk.repeat(name, segments[name], events, act, state, repeats)
    tail = []
    if sizes.options.forward_prefetch:  # the first layer's post-backward, deferred past the embeddings' backward
        tail += _post_backward(sizes, sizes.unit_of(0), "layer_params", "layer_grads", micro, None,
                               grad_bytes=layer_grad_bytes[0])
    tail += _post_backward(sizes, sizes.root, "root_params", "root_grads", micro, None)
    for event in tail:
        if event(state):
            walk.consider(act, state, "suffix")
    total, peak_act, parts, seg = walk.best
    return Replay(peak_bytes=total, peak_act_bytes=peak_act, peak_grad_bytes=sum(parts[p] for p in GRADS),
                  peak_segment=seg, end_act_bytes=act, end_grad_bytes=state["grad_shards"],
                  peak_parts={"gathered_params": parts["root_params"] + parts["layer_params"]
                              + parts["low_precision_shard"], "activations": parts["kept_inputs"],
                              "comm_buffers": parts["reduce"] + parts["flat_grad"]})


def _units(table: list[ParamInfo]) -> tuple[list[ParamInfo], list[list[ParamInfo]]]:
    """(root unit's tensors in registration order, each decoder layer's tensors)."""
    outer = [p for p in table if p.layer is None]

    def before(p: ParamInfo) -> bool:
        return p.before_layers if p.before_layers is not None else p.module_kind == "embedding"
    root = [p for p in outer if before(p)] + [p for p in outer if not before(p)]
    layers: dict[int, list[ParamInfo]] = {}
    for p in table:
        if p.layer is not None:
            layers.setdefault(p.layer, []).append(p)
    return root, [layers[i] for i in sorted(layers)]


# Bytes of one packed 4-bit weight's values: two NF4 values a byte.
NF4_VALUES_PER_BYTE = 2


def packed_flat(p: ParamInfo, storage_elem: int) -> tuple[ParamInfo, float]:
    """(the tensor as a flat parameter holds it, the bytes every rank keeps beside the flat parameter). A 4-bit row
    (``stored_bytes_per_elem``: packed values and quant state, as the profiler recorded it) becomes its packed values
    viewed in ``storage_elem``-byte elements (``Params4bit(quant_storage=<16-bit dtype>)``: ``numel / 4``
    elements, checked on real CPU FSDP1 ranks, benchmarks/fsdp1_qlora_packed.py); the rest of its stored bytes is the
    quant state, not flattened. Other rows: unchanged, nothing beside."""
    if p.stored_bytes_per_elem is None:
        return p, 0.0
    packed_bytes = math.ceil(p.numel / NF4_VALUES_PER_BYTE)
    elements = math.ceil(packed_bytes / storage_elem)
    # the profile's stored bytes round each quantized tensor to the caching allocator's block
    state_bytes = max(p.nbytes - math.ceil(packed_bytes / MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES, 0)
    return replace(p, shape=(elements, 1), numel=elements, elem_bytes=storage_elem,
                   stored_bytes_per_elem=None), float(state_bytes)


def _flattened(params: list[ParamInfo], unit: str) -> tuple[list[ParamInfo], float]:
    """A unit's tensors as FSDP1 flattens them (packed 4-bit rows in the unit's dtype) and the quant states' bytes
    kept whole on every rank."""
    storage = _uniform_elem(params, unit)
    rows = [packed_flat(p, storage) for p in params]
    return [row for row, _ in rows], sum(state for _, state in rows)


def _uniform_elem(params: list[ParamInfo], unit: str) -> int:
    sizes = {p.elem_bytes for p in params}
    if len(sizes) > 1:
        raise ValueError(f"method: fsdp1 flattens each unit into one tensor and needs one dtype per unit; the {unit} "
                         f"mixes {sorted(sizes)}-byte tensors (e.g. a router kept in fp32, or fp32 LoRA adapters on 16-bit "
                         "weights); use fsdp")
    return sizes.pop() if sizes else 2


# The first transformers release whose decoder layers checkpoint themselves (``GradientCheckpointingLayer``, inside
# an FSDP1 unit wrapping them); before it the model's layer loop calls the checkpoint around the unit.
CKPT_INSIDE_LAYER_RELEASE = (4, 52)


def reentrant_kept_input_bytes(training, table: list[ParamInfo], layer: FlatUnit) -> float:
    """Bytes per token that each decoder layer keeps from its backward to the end of backward under FSDP1 (torch
    2.4-2.13, ``_register_post_backward_reshard_only_hook``). A unit whose flat parameter needs no gradient (LoRA's
    frozen layers) waits for its inputs' gradients with ``register_multi_grad_hook``, whose closure holds the
    inputs' gradient nodes until FSDP1's final callback. A reentrant checkpoint around the unit (the model's own
    checkpointing before transformers 4.52, ``use_reentrant=True``) re-enters the unit's forward in backward with a
    detached alias of the layer's saved input: a leaf, whose AccumulateGrad node the closure holds, and which gets
    the input's gradient as its ``.grad``. So every recomputed layer keeps its input and the input's gradient
    (two hidden states) past its backward. Checked on real CPU tensors (``benchmarks/fsdp1_lora_versions.py``:
    torch 2.4.1, transformers 4.45.2, tiny Mistral of 8 layers: at the first layer's backward, 7 inputs and 7
    gradients are alive that a non-reentrant run has freed; transformers 5.24: none), and on a real H200 with
    transformers 4.48.1 at Mistral-7B's size (``benchmarks/fms_fsdp1_lora_gpu.py``: FSDP1 x 2 keeps 1.23 GB more at
    b2 s4096, the estimate 1.36 GB). Non-reentrant checkpoints, and checkpoints inside the unit, re-enter
    nothing."""
    release = model_code_release(training.model_code) if training.model_code else None
    if not (training.grad_ckpt and training.ckpt_reentrant and release and layer.numel and not layer.trainable):
        return 0.0
    if tuple(int(part) for part in release.split(".")) >= CKPT_INSIDE_LAYER_RELEASE:
        return 0.0
    hidden = next((p.shape[-1] for p in table if p.layer is None and p.module_kind == "embedding"), 0)
    return float(2 * hidden * layer.compute_elem)


def check_fsdp1(spec: RunSpec, config: dict) -> None:
    """ValueError for what torch's FSDP1 cannot run. NO_SHARD with ``use_orig_params`` calls ``_use_sharded_views``
    in each post-forward (it keeps no sharded views), which re-registers every tensor as a parameter
    (``_use_unsharded_views(as_params=True)``) and asserts that a tied weight's primary (the input embedding) is a
    parameter; with LoRA the frozen root unit's forward left it a plain tensor view, so torch 2.11 fails there
    (``AssertionError: as_params=True type(prim_param)=<class 'torch.Tensor'>``: reproduced on CPU with the fake
    process group and on an H200, docs/LOG.md session 26; untied, full fine-tuning, FULL_SHARD or use_orig_params
    false run). ``config``: the model's config.json; tied where it says so (each model class has its own default)."""
    options = spec.parallel.fsdp1
    tied = config.get("tie_word_embeddings") is True
    if (spec.parallel.method == "fsdp1" and options.sharding_strategy == "NO_SHARD" and options.use_orig_params
            and spec.training.lora and tied):
        raise ValueError("parallel.fsdp1.sharding_strategy: NO_SHARD with LoRA and use_orig_params on a model with "
                         "tied embeddings fails in "
                         "torch's FSDP1 post-forward (as_params=True on the tied embedding's tensor view); use "
                         "use_orig_params false, FULL_SHARD or method ddp")


def fsdp1_sizes(spec: RunSpec, table: list[ParamInfo], rank: int = 0) -> Fsdp1Sizes:
    training, parallel = spec.training, spec.parallel
    options = parallel.fsdp1
    world = options.shard_size(parallel.world_size)
    mixed = training.precision.startswith("mixed_")
    root, layers = _units(table)
    largest = largest_layer(table)
    layer = next((params for params in layers if params[0].layer == largest), [])
    in_layer = training.lora and options.lora_wrap == "layer"
    if in_layer and not options.use_orig_params:
        raise ValueError("parallel.fsdp1.lora_wrap: layer puts frozen and trainable tensors in one flat parameter, "
                         "which FSDP1 allows only with use_orig_params true")
    adapters = [p for p in layer if p.trainable] if training.lora and not in_layer else []
    if adapters and (options.forward_prefetch or options.backward_prefetch != "BACKWARD_PRE"):
        raise ValueError("method: fsdp1 with LoRA is modelled with the default prefetching only (BACKWARD_PRE, no "
                         "forward prefetch): the adapters' units change what each prefetch gathers")
    if (adapters or in_layer) and mixed:
        raise ValueError("method: fsdp1 with LoRA under mixed_* is not modelled (FSDP1's MixedPrecision casts the "
                         "adapters to 16 bits, which changes what they keep for backward); use bf16, fp32, amp_* "
                         "or fsdp")
    if adapters:
        layer = [p for p in layer if not p.trainable]
        layers = [[p for p in params if not p.trainable] for params in layers]
    if training.grad_accum_steps > 1 and training.grad_sync == "last" and (
            adapters or options.sharding_strategy == "NO_SHARD"):
        raise ValueError("grad_sync: fsdp1 holding its gradients between micro-batches (no_sync) is modelled for "
                         "sharded strategies without LoRA or with lora_wrap layer; use grad_sync every, or fsdp")

    packed = any(p.stored_bytes_per_elem is not None for p in table)
    if packed and mixed:
        raise ValueError("method: fsdp1 with 4-bit weights under mixed_* is not modelled (FSDP1 would hold the "
                         "packed weights in fp32 shards and cast them); use bf16 as fsdp_qlora does")

    def unit(params: list[ParamInfo], name: str) -> FlatUnit:
        # mixed_*: built in fp32, so one dtype per unit whatever the model keeps in fp32 at 16 bits (DeepSeek's
        # router), and MixedPrecision gathers the whole flat parameter in 16 bits
        compute = HALF if mixed else _uniform_elem(params, name)
        param_elem = FP32 if mixed else compute
        reduce = FP32 if mixed else compute
        flat = _flattened(params, name)[0] if packed else params
        return flat_unit(flat, world, rank % world, compute, param_elem, reduce, options.use_orig_params)
    each = tuple(unit(params, "decoder layer") for params in layers)
    generic = unit(layer, "decoder layer")
    kept = reentrant_kept_input_bytes(training, table, generic) if not any(u.trainable for u in each) else 0.0
    states = sum(_flattened(params, "unit")[1] for params in [root, *layers]) if packed else 0.0
    return Fsdp1Sizes(root=unit(root, "root unit"), layer=generic, options=options,
                      mixed=mixed, adapters=tuple(unit([p], f"adapter {p.name}") for p in adapters),
                      layers=each if len(set(each)) > 1 else (), kept_input_bytes_per_token=kept,
                      quant_state_bytes=states)


def fsdp1(spec: RunSpec, table: list[ParamInfo], rank: int = 0) -> StepModel:
    """FSDP1 per decoder layer then the root (module docstring); mixed_*: fp32 flat shards, 16-bit compute,
    fp32 gradient reduction (``MixedPrecision(param_dtype=16-bit, reduce_dtype=fp32)``), AdamW on the shards."""
    training = spec.training
    sizes = fsdp1_sizes(spec, table, rank)
    options = sizes.options
    num_layers = len({p.layer for p in table if p.layer is not None})
    layer_units = [(u, 1) for u in sizes.layers] or [(sizes.layer, num_layers)]
    units = [(sizes.root, 1)] + layer_units + [(a, num_layers) for a in sizes.adapters]
    stored = [(u.shard_numel if sizes.sharded else u.numel, u, n) for u, n in units]
    weights = float(sum(numel * u.param_elem * n for numel, u, n in stored))
    grads = float(sum(numel * u.param_elem * n for numel, u, n in stored if u.trainable))
    # The optimizer's tensors: the original parameters' pieces in this shard, or the flat shards themselves.
    stepped = [ParamInfo(f"unit{k}", (numel,), numel, u.param_elem, True, "other", None)
               for k, (numel, u, n) in enumerate(
                   (u.local_trainable_numel if options.use_orig_params and sizes.sharded else numel, u, n)
                   for numel, u, n in stored if u.trainable) for _ in range(n)]
    states = optimizer_state_bytes(stepped, training.optimizer, False)
    temp = step_temp_bytes(stepped, training.optimizer, False)
    adapters = ", each LoRA adapter weight its own unit (peft's fsdp_auto_wrap_policy)" if sizes.adapters else ""
    if training.lora and options.lora_wrap == "layer":
        adapters = (", the LoRA adapters inside their layer's unit: every frozen weight of a layer gets a gradient "
                    "(use_orig_params), held and reduced as full fine-tuning's")
    notes = [f"fsdp1: FullyShardedDataParallel per decoder layer then the root{adapters} "
             f"({options.sharding_strategy}, use_orig_params={options.use_orig_params}, backward_prefetch="
             f"{options.backward_prefetch}); limit_all_gathers changes reserved, not allocated memory"]
    host = 0.0
    if options.cpu_offload:
        host, weights, states, temp = weights + states + grads, 0.0, 0.0, 0.0
        notes.append("fsdp1 cpu_offload: shards, gradients' host copies, optimizer states and the step on the host "
                     "(host_ram_bytes); checked on a real H200 (FULL_SHARD, mixed_bf16), not on the CPU oracle (no separate "
                     "device)")
    if sizes.quant_state_bytes:
        # CPUOffload moves flat parameters only: the quant states stay where bitsandbytes quantized them (the GPU).
        weights += sizes.quant_state_bytes
        notes.append(f"fsdp1 QLoRA: packed 4-bit weights sharded as 16-bit elements of their unit (numel / 4); "
                     f"their quant states ({sizes.quant_state_bytes / 2**20:.1f} MiB) whole on every rank")
    return StepModel(resident={"weights": weights, "optimizer_states": states},
                     grad_policy=lambda prev, within: prev + within, segment_extra=None,
                     step_grads=0.0 if options.cpu_offload else grads, step_temp=temp, host_bytes=host, notes=notes,
                     replay=lambda segments, layers, b, s, accumulating=False: replay_fsdp1(
                         segments, layers, b, s, sizes, accumulating=accumulating))
