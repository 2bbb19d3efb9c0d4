"""FSDP2 (``fully_shard`` per decoder layer, then the root) replayed event by event over a profiled step.

The profile gives the unwrapped model's activations and parameter gradients; FSDP2 adds, at layer boundaries,
the buffers below (torch 2.13, ``torch.distributed.fsdp._fully_shard``; order checked against the CPU oracle,
``harness.fake.trace_run``). Sizes per group (root = everything outside the decoder layers):

* all-gather buffer ``AG`` = N x (sum of padded dim-0 shards) in the compute dtype. It outlives its copy-out:
  it is freed after the *next* group's copy-out (FSDP2 keeps the all-gather state for stream ordering), the
  last layer's at the root's post-forward (after the loss);
* unsharded parameters ``P`` (compute dtype), freed at post-forward (layers: ``reshard_after_forward=True``)
  and post-backward; the root stays unsharded from its pre-forward to its post-backward;
* reduce-scatter input ``RS`` = N x padded gradient shard in the reduce dtype, freed when the next
  reduce-scatter starts; its output (one shard) becomes the sharded gradient. Backward prefetches the next
  layer's all-gather after each copy-out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from estimator.methods.long_context import CKPT
from estimator.methods.timeline import Replay, poly, segment_sequence

FORWARD_LAYER = ("fw_first", "fw", "fw_last")
BACKWARD_LAYER = ("bw_first", "bw", "bw_last")
# Parts of the overlay state; the first four are FSDP buffers, the rest gradients.
BUFFERS = ("root_params", "gather", "layer_params", "reduce_scatter")
GRADS = ("root_grads", "layer_grads", "grad_shards", "held_grads")
# Micro-batches under gradient accumulation. ``grad_sync="every"``: FIRST (no gradient shard yet) and LATER
# (every shard held, a new one added in place). ``grad_sync="last"`` (FSDP2's ``set_requires_gradient_sync(False)``
# on all but the last): UNSYNCED_FIRST keeps each group's unsharded gradients, UNSYNCED_LATER adds into them,
# SYNCED_LAST adds into them and reduce-scatters.
FIRST, LATER, UNSYNCED_FIRST, UNSYNCED_LATER, SYNCED_LAST = "first", "later", "unsynced_first", "unsynced_later", \
    "synced_last"
MICRO_BATCHES = (FIRST, LATER, UNSYNCED_FIRST, UNSYNCED_LATER, SYNCED_LAST)


@dataclasses.dataclass(frozen=True)
class FsdpSizes:
    root_bytes: float           # root parameters unsharded, compute dtype
    root_gather_bytes: float    # its all-gather buffer (padded)
    layer_bytes: float
    layer_gather_bytes: float
    layer_rs_in_bytes: float    # reduce-scatter input, reduce dtype (padded); 0 for a frozen layer
    layer_rs_out_bytes: float   # one rank's gradient shard
    root_rs_in_bytes: float
    root_rs_out_bytes: float
    # Unsharded gradients held between micro-batches that skip the reduce-scatter (``grad_sync="last"``): each
    # parameter's gradient, unpadded, in the reduce dtype (FSDP2's ``unsharded_accumulated_grad``) or, when that
    # is the compute dtype, the unsharded parameter's own ``.grad``.
    layer_held_bytes: float = 0.0
    root_held_bytes: float = 0.0
    # whether the held gradient is a copy in the reduce dtype (mixed precision) rather than autograd's ``.grad``,
    # into which a later micro-batch's gradient is added as soon as it is made
    held_is_copy: bool = True
    largest_grad_bytes: float = 0.0   # one parameter's unsharded gradient, compute dtype
    # Each decoder layer's own group sizes where layers are not all alike (a dense first layer before expert
    # layers); empty: every layer is the one described above.
    layers: tuple[LayerGroup, ...] = ()
    layer_experts: ExpertsUnit | None = None

    def layer(self, index: int | None) -> LayerGroup:
        """Layer ``index``'s group (None, or every layer alike: the one layer described above)."""
        if self.layers and index is not None:
            return self.layers[index]
        return LayerGroup(self.layer_bytes, self.layer_gather_bytes, self.layer_rs_in_bytes,
                          self.layer_rs_out_bytes, self.layer_held_bytes, experts=self.layer_experts)

    def sum_layers(self, num_layers: int, field: str) -> float:
        if self.layers:
            return sum(getattr(group, field) for group in self.layers)
        return num_layers * getattr(self.layer(None), field)


@dataclasses.dataclass(frozen=True)
class ExpertsUnit:
    """Under expert parallelism, a decoder layer's experts module is an FSDP2 unit of its own on the efsdp mesh
    (transformers' ``apply_fully_sharded_data_parallelism``). The experts are the layer's last module in forward,
    so in backward their gradients are the layer's first: the profile's gradient level within the layer's
    backward segment tells when they are done. Then the unit's post-backward reshards them, frees the previous
    reduce-scatter input and reduce-scatters theirs."""
    bytes: float               # this rank's experts (num_experts / ep), unsharded
    traced_grad_bytes: float   # the trace's expert gradients in this layer (every expert)
    grad_bytes: float          # this rank's
    rs_in_bytes: float
    rs_out_bytes: float
    # efsdp == 1: FSDP2 does not reduce-scatter but copies ``input / gradient_divide_factor`` (transformers sets the
    # factor to the data-parallel size), a temporary the size of the input
    divide_bytes: float = 0.0
    # its all-gather output, which forward keeps until the next unit's copy-out (FSDP2's implicit prefetch,
    # ``FSDPParamGroup.wait_for_unshard``): the experts are the layer's last unit, so it is this buffer, not the
    # layer unit's, that is held from the experts' forward to the next layer's; none on one rank (efsdp == 1: the
    # shard is copied into the unsharded parameter directly)
    deferred_gather_bytes: float = 0.0


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """One decoder layer's FSDP2 group (the fields of ``FsdpSizes`` named ``layer_*``)."""
    bytes: float
    gather_bytes: float
    rs_in_bytes: float
    rs_out_bytes: float
    held_bytes: float = 0.0
    # EP: the experts' own unit. The gather and reduce-scatter fields above are then the layer's unit without
    # them (backward prefetches one unit ahead in reverse post-forward order: layer L, experts L, layer L-1, ...,
    # so while layer L's experts run, layer L-1's unit is the one prefetched); ``bytes`` holds both.
    experts: ExpertsUnit | None = None
    # A module of the layer that a 16-bit model keeps in fp32 (DeepSeek's router, ``_keep_in_fp32_modules_strict``)
    # is an FSDP2 unit of its own (transformers' plan and the harness: one group per dtype). The router runs before
    # the experts in forward, so in backward its unit comes between the layer's (and its experts') and the
    # previous layer's: its all-gather (these bytes) is the one prefetched from the layer's pre-backward, and the
    # previous layer's is issued only at the router's pre-backward (the segment's ``router``: the trace's gradient
    # bytes made before it, and the level there). None: no such unit.
    router_gather_bytes: float | None = None

    @property
    def deferred_gather_bytes(self) -> float:
        """The all-gather output forward still holds after this layer (its last unit's)."""
        return self.gather_bytes if self.experts is None else self.experts.deferred_gather_bytes


Event = Callable[[dict], bool]  # mutates the state; True when the state can be a new peak (it grew)


def set_part(part: str, value: Callable[[dict], float]) -> Event:
    """An event setting one part of the overlay state."""
    def apply(state: dict) -> bool:
        old = state[part]
        state[part] = value(state)
        return state[part] > old
    return apply


def _reduce_scatter(rs_in: float, rs_out: float, grads: str, accumulating: bool) -> list[Event]:
    """Reduce-scatter a group's unsharded grads; accumulating, the new shard is added in place and freed."""
    events = [set_part("reduce_scatter", lambda st: rs_in),
              set_part(grads, lambda st: 0.0),
              set_part("grad_shards", lambda st: st["grad_shards"] + rs_out)]
    if accumulating:
        events.append(set_part("grad_shards", lambda st: st["grad_shards"] - rs_out))
    return events


def _unsynced(held: float, grads: str, micro: str) -> list[Event]:
    """``FSDPParamGroup.post_backward`` without the reduce-scatter: the first micro-batch keeps the gradients
    (converted to the reduce dtype, the 16-bit ones freed), a later one has added them into the held ones."""
    if micro == UNSYNCED_FIRST:
        return [set_part("held_grads", lambda st: st["held_grads"] + held), set_part(grads, lambda st: 0.0)]
    return [set_part(grads, lambda st: 0.0)]


def _synced_last(rs_in: float, rs_out: float, held: float, grads: str) -> list[Event]:
    """The last micro-batch: the new gradients added into the held ones and freed, the reduce-scatter input
    copied from them, then they go; the shard is the step's first."""
    return [set_part(grads, lambda st: 0.0), set_part("reduce_scatter", lambda st: rs_in),
            set_part("held_grads", lambda st: st["held_grads"] - held),
            set_part("grad_shards", lambda st: st["grad_shards"] + rs_out)]


def _group_post_backward(rs_in: float, rs_out: float, held: float, grads: str, micro: str) -> list[Event]:
    if micro in (UNSYNCED_FIRST, UNSYNCED_LATER):
        return _unsynced(held, grads, micro)
    if micro == SYNCED_LAST:
        return _synced_last(rs_in, rs_out, held, grads)
    return _reduce_scatter(rs_in, rs_out, grads, micro == LATER)


def _post_backward(group: LayerGroup, micro: str) -> list[Event]:
    """A finished layer: reshard, free the previous reduce-scatter input, reduce-scatter this layer's grads
    (or keep them: ``_group_post_backward``)."""
    return [set_part("layer_params", lambda st: 0.0),
            *_group_post_backward(group.rs_in_bytes, group.rs_out_bytes, group.held_bytes, "layer_grads", micro)]


def _pre_backward(group: LayerGroup, prefetched: LayerGroup | None) -> list[Event]:
    events = [set_part("layer_params", lambda st: group.bytes), set_part("gather", lambda st: 0.0)]
    router = group.router_gather_bytes
    if router is not None:  # the previous layer waits for the router's pre-backward (``LayerGroup``)
        events.append(set_part("gather", lambda st: router))
    elif prefetched is not None:
        events.append(set_part("gather", lambda st: prefetched.gather_bytes))
    return events


def _prefetched_in_backward(name: str, sz: FsdpSizes, index: int | None) -> LayerGroup | None:
    """The layer a backward layer segment prefetches: the one before it in post-forward order. None for the first
    layer, whose backward is the last; but after forward-only first layers (``forward_only_layers``) the last
    backward still prefetches the forward-only layer before it, whose backward never comes."""
    if name == "bw_last" and not index:
        return None
    return sz.layer(None if index is None else index - 1)


def forward_only_layers(segments: dict, num_layers: int) -> int:
    """The first decoder layers an explicit ``sequence`` leaves to the prefix (LoRA past dense first layers:
    ``estimator.methods.timeline.loop_segments``): those its forward layer segments do not stand for."""
    sequence = segments.get("sequence")
    if not sequence:
        return 0
    return num_layers - sum(reps for name, reps in sequence if name.removesuffix(CKPT) in FORWARD_LAYER)


def _forward_layer_events(here: LayerGroup, previous_gather_bytes: float) -> list[Event]:
    """A layer's pre-forward: the previous unit's parameters resharded, this one's all-gathered (the previous
    all-gather output still held), copied out, its all-gather output kept."""
    return [set_part("layer_params", lambda st: 0.0),
            set_part("gather", lambda st: previous_gather_bytes + here.gather_bytes),
            set_part("layer_params", lambda st: here.bytes),
            set_part("gather", lambda st: here.gather_bytes)]


def segment_layer(name: str, k: int, num_layers: int) -> int | None:
    """The decoder layer of the ``k``-th instance of a profile segment (None: outside the layers)."""
    return {"fw_first": 0, "fw": 1 + k, "fw_last": num_layers - 1, "bw_first": num_layers - 1,
            "bw": num_layers - 2 - k, "bw_last": 0}.get(name)


def _boundary_events(name: str, num_layers: int, sz: FsdpSizes, micro: str, index: int | None = None,
                     first: int = 0) -> list[Event]:
    """FSDP2 events at the start of a profile segment (its layer's pre-hook, or the previous one's post-hook);
    ``index``: the segment's layer (None: the generic layer, every layer alike). ``first``: forward-only first
    layers, whose forward runs in the prefix: each is all-gathered, run and resharded there, as any layer's
    forward; no backward ever unshards them."""
    def near(offset: int) -> LayerGroup:  # the layer ``offset`` away from this one
        return sz.layer(None if index is None else index + offset)

    here = sz.layer(index)
    if name == "prefix":
        events = [set_part("gather", lambda st: sz.root_gather_bytes),
                  set_part("root_params", lambda st: sz.root_bytes)]
        for layer in range(first):
            previous = sz.root_gather_bytes if layer == 0 else sz.layer(layer - 1).deferred_gather_bytes
            events += _forward_layer_events(sz.layer(layer), previous)
        return events
    if name == "fw_first" and not index:
        return [set_part("gather", lambda st: sz.root_gather_bytes + here.gather_bytes),
                set_part("layer_params", lambda st: here.bytes),
                set_part("gather", lambda st: here.gather_bytes)]
    if name in FORWARD_LAYER:
        return _forward_layer_events(here, near(-1).deferred_gather_bytes)
    if name == "mid_fw":
        return [set_part("layer_params", lambda st: 0.0),
                set_part("gather", lambda st: sz.layer(num_layers - 1).deferred_gather_bytes)]
    if name == "mid_bw":  # root post-forward frees the last gather; backward's first prefetch re-gathers it
        last = sz.layer(num_layers - 1)
        return [set_part("gather", lambda st: 0.0), set_part("gather", lambda st: last.gather_bytes)]
    if name in BACKWARD_LAYER:
        first = name == "bw_first" or num_layers == 1
        return ([] if first else _post_backward(near(+1), micro)) + _pre_backward(
            here, _prefetched_in_backward(name, sz, index))
    if name == "suffix":
        return _post_backward(sz.layer(first), micro)
    raise ValueError(f"fsdp: unknown profile segment {name!r}")


def _root_post_backward(sz: FsdpSizes, micro: str) -> list[Event]:
    return [set_part("root_params", lambda st: 0.0),
            *_group_post_backward(sz.root_rs_in_bytes, sz.root_rs_out_bytes, sz.root_held_bytes, "root_grads",
                                  micro),
            set_part("reduce_scatter", lambda st: 0.0)]


def _grad_part(name: str) -> str:
    return "layer_grads" if name.removesuffix(CKPT) in BACKWARD_LAYER else "root_grads"


class Walk:
    """Runs segments with their boundary events over an overlay state, keeping the highest total seen.
    ``grad_part``: the state part a segment's own gradients accumulate in."""

    def __init__(self, b: int, s: int, grad_part: Callable[[str], str] = _grad_part,
                 in_flight_grad_bytes: float | None = None) -> None:
        self.b, self.s = b, s
        self.grad_part = grad_part
        # set: each gradient is added into one already held as soon as autograd makes it, so at most this much
        # of the segment's own gradients is ever alive (and none at its end)
        self.in_flight = in_flight_grad_bytes
        self.best: tuple[float, float, dict, str] = (float("-inf"), 0.0, {}, "prefix")

    def consider(self, act: float, state: dict, name: str) -> None:
        total = act + sum(state.values())
        if total > self.best[0]:
            self.best = (total, act, dict(state), name)

    def segment(self, name: str, seg: dict, events: list[Event], act: float, state: dict,
                experts: ExpertsUnit | None = None, micro: str = FIRST, prefetched_gather_bytes: float = 0.0
                ) -> tuple[float, dict]:
        """Run one segment instance from (act, state); return the state at its end. ``experts``: a backward layer
        segment's experts unit under EP (``ExpertsUnit``); ``prefetched_gather_bytes``: the previous layer's
        all-gather, which a router unit defers to the router's pre-backward (``LayerGroup.router_gather_bytes``,
        the segment's ``router``)."""
        state = dict(state)
        for event in events:
            if event(state):
                self.consider(act, state, name)
        part = self.grad_part(name)
        held = state[part]
        router = seg.get("router")  # (gradient bytes made before the router's pre-backward, the level there)

        def router_pre_backward(level: float) -> None:  # the previous layer's all-gather, deferred to here
            nonlocal router
            state["gather"] = prefetched_gather_bytes
            self.consider(act + level, state, name)
            router = None

        if experts is None:
            for cand_act, cand_grad in seg["candidates"]:
                if router is not None and cand_grad > router[0]:
                    state[part] = held + (router[0] if self.in_flight is None else min(router[0], self.in_flight))
                    router_pre_backward(router[1])
                state[part] = held + (cand_grad if self.in_flight is None else min(cand_grad, self.in_flight))
                self.consider(act + poly(cand_act, self.b, self.s), state, name)
            state[part] = held + (seg["net_grad"] if self.in_flight is None else 0.0)
            if router is not None:
                router_pre_backward(poly(seg["net_act"], self.b, self.s))
            return act + poly(seg["net_act"], self.b, self.s), state
        # EP. The gradients of the modules after the experts in forward come first (``experts_grad_offset``: a
        # shared expert's, its gate's), then the experts' (the trace made every expert's, this rank makes its own)
        pre = seg.get("experts_grad_offset", 0.0)
        traced, ratio = experts.traced_grad_bytes, (experts.grad_bytes / experts.traced_grad_bytes
                                                    if experts.traced_grad_bytes else 0.0)
        done = False  # the experts' post-backward has run

        def own(g: float) -> float:  # this rank's gradients at a traced level g
            if done:
                return g - traced
            return min(g, pre) + max(g - pre, 0.0) * ratio

        def hold(g: float) -> float:
            return held + (own(g) if self.in_flight is None else min(own(g), self.in_flight))

        # the level at the experts' post-backward (``experts_done_levels``), else the next candidate's; what the
        # EP path saved for the experts' backward (``experts_saved_extra``) is gone from there on
        done_act = seg.get("experts_done_act")
        extra = seg.get("experts_saved_extra", 0.0)
        # the busiest rank's extra rows in the experts' backward (``EpLayout.backward_bumps``)
        first, during, last = seg.get("experts_bw_bumps", (0.0, 0.0, 0.0))
        recompute = seg.get("experts_recompute_act")
        if recompute is not None:  # checkpointing: the recomputed layer's combine, before any of its gradients
            recompute_act, prefetch_after = recompute
            self.consider(act + recompute_act, {**state, "gather": 0.0} if prefetch_after else state, name)
        unpermute_act = seg.get("experts_unpermute_act")
        if unpermute_act is not None:  # the un-permute's backward, just before the experts' first gradient
            state[part] = hold(pre)
            self.consider(act + unpermute_act, state, name)
        for cand_act, cand_grad in seg["candidates"]:
            if not done and cand_grad > pre + traced:
                state[part] = hold(pre + traced)
                level = poly(cand_act, self.b, self.s) if done_act is None else done_act
                self._experts_post_backward(experts, part, state, act + level - extra, name, micro)
                done = True
            if router is not None and cand_grad > router[0]:
                router_pre_backward(router[1] - extra)
            state[part] = hold(cand_grad)
            # during the backward of modules after the experts (a shared expert's), nothing of the experts' yet
            bump = -extra if done else (0.0 if cand_grad < pre else first if cand_grad == pre else
                                        during if cand_grad < pre + traced else last)
            self.consider(act + poly(cand_act, self.b, self.s) + bump, state, name)
        end_act = act + poly(seg["net_act"], self.b, self.s)
        if not done:
            state[part] = hold(pre + traced)
            self._experts_post_backward(experts, part, state,
                                        end_act if done_act is None else act + done_act - extra, name, micro)
            done = True
        if router is not None:
            router_pre_backward(router[1] - extra)
        state[part] = held + (own(seg["net_grad"]) if self.in_flight is None else 0.0)
        return end_act, state

    def _experts_post_backward(self, unit: ExpertsUnit, part: str, state: dict, act: float, name: str,
                               micro: str) -> None:
        """``FSDPParamGroup.post_backward`` of an experts unit (``foreach_reduce``): reshard, the previous
        reduce-scatter input freed and this one allocated, the gradients copied in and freed, the output
        allocated (the division's temporary beside it), which becomes the gradient shards."""
        events = [set_part("layer_params", lambda st: st["layer_params"] - unit.bytes),
                  set_part("reduce_scatter", lambda st: unit.rs_in_bytes),
                  set_part(part, lambda st: st[part] - unit.grad_bytes),
                  set_part("grad_shards", lambda st: st["grad_shards"] + unit.rs_out_bytes),
                  set_part("reduce_scatter", lambda st: unit.rs_in_bytes + unit.divide_bytes),
                  set_part("reduce_scatter", lambda st: unit.rs_in_bytes)]
        if micro == LATER:  # added into the held shards in place
            events.append(set_part("grad_shards", lambda st: st["grad_shards"] - unit.rs_out_bytes))
        for event in events:
            if event(state):
                self.consider(act, state, name)

    def repeat(self, name: str, seg: dict, events: list[Event], act: float, state: dict, repeats: int,
               experts: ExpertsUnit | None = None, micro: str = FIRST, prefetched_gather_bytes: float = 0.0
               ) -> tuple[float, dict]:
        """``repeats`` instances of a segment. Repetitions differ only in what accumulates linearly (activations,
        gradient shards): run the second to get the per-repetition change, then the last one from its
        extrapolated start. None (a 2-layer model's middle layers): nothing happens."""
        if repeats < 1:
            return act, state
        act0, state0 = self.segment(name, seg, events, act, state, experts, micro, prefetched_gather_bytes)
        if repeats < 2:
            return act0, state0
        act, state = self.segment(name, seg, events, act0, state0, experts, micro, prefetched_gather_bytes)
        if repeats > 2:
            k = repeats - 2
            start_act = act0 + k * (act - act0)
            start = {p: state0[p] + k * (state[p] - state0[p]) for p in state}
            act, state = self.segment(name, seg, events, start_act, start, experts, micro,
                                      prefetched_gather_bytes)
        return act, state


def _prefetched_gather_bytes(name: str, sz: FsdpSizes, index: int | None) -> float:
    prefetched = _prefetched_in_backward(name, sz, index) if name in BACKWARD_LAYER else None
    return prefetched.gather_bytes if prefetched is not None else 0.0


def _walk_mixed(walk: Walk, segments: dict, num_layers: int, sizes: FsdpSizes, micro: str, act: float,
                state: dict) -> tuple[float, dict]:
    """A mixed layer sequence (``estimator.methods.long_context.mixed_layers``: every-k checkpointing) walked
    segment by segment: a layer's segments come from the profile of its kind, FSDP2's events at its boundaries are
    the same for both kinds. A checkpointed layer's recomputation runs inside its backward, after the pre-backward
    hook has unsharded it (and prefetched the layer below): FSDP2's pre-forward and post-forward return at once in
    that state (``FSDPState._pre_forward``), so its segment carries the recomputed activations and nothing else
    changes. Segments outside the layers' (``release``: what the checkpoints kept alive) have no events."""
    first = forward_only_layers(segments, num_layers)
    forward, backward = first, 0
    for name, repeats in segments["sequence"]:
        base = name.removesuffix(CKPT)
        for _ in range(repeats):
            index = None
            if base in FORWARD_LAYER:
                index, forward = forward, forward + 1
            elif base in BACKWARD_LAYER:
                index, backward = num_layers - 1 - backward, backward + 1
            known = base in FORWARD_LAYER + BACKWARD_LAYER + ("prefix", "mid_fw", "mid_bw", "suffix")
            events = _boundary_events(base, num_layers, sizes, micro, index, first) if known else []
            experts = sizes.layer(index).experts if base in BACKWARD_LAYER else None
            act, state = walk.segment(name, segments[name], events, act, state, experts, micro,
                                      _prefetched_gather_bytes(base, sizes, index))
    return act, state


def replay_fsdp(segments: dict, num_layers: int, b: int, s: int, sizes: FsdpSizes, accumulating: bool | str = False
                ) -> Replay:
    """Peak of activations + gradients + FSDP2 buffers over one steady step's forward and backward.
    ``accumulating``: which micro-batch (``MICRO_BATCHES``; False / True: FIRST / LATER)."""
    micro = accumulating if isinstance(accumulating, str) else LATER if accumulating else FIRST
    if micro not in MICRO_BATCHES:
        raise ValueError(f"fsdp: unknown micro-batch {micro!r}")
    in_flight = sizes.largest_grad_bytes if micro in (UNSYNCED_LATER, SYNCED_LAST) and not sizes.held_is_copy \
        else None
    walk = Walk(b, s, in_flight_grad_bytes=in_flight)
    act = 0.0
    state = dict.fromkeys(BUFFERS + GRADS, 0.0)
    if micro == LATER:
        state["grad_shards"] = sizes.sum_layers(num_layers, "rs_out_bytes") + sizes.root_rs_out_bytes
    elif micro in (UNSYNCED_LATER, SYNCED_LAST):
        state["held_grads"] = sizes.sum_layers(num_layers, "held_bytes") + sizes.root_held_bytes
    # every-k, or forward-only first layers: each layer's own segments, one instance at a time
    if segments.get("sequence"):
        act, state = _walk_mixed(walk, segments, num_layers, sizes, micro, act, state)
    for name, repeats in () if segments.get("sequence") else segment_sequence(num_layers):
        if not sizes.layers:  # every layer alike: the repetitions extrapolate
            events = _boundary_events(name, num_layers, sizes, micro)
            experts = sizes.layer(None).experts if name in BACKWARD_LAYER else None
            act, state = walk.repeat(name, segments[name], events, act, state, repeats, experts, micro,
                                     _prefetched_gather_bytes(name, sizes, None))
            continue
        for k in range(repeats):
            index = segment_layer(name, k, num_layers)
            events = _boundary_events(name, num_layers, sizes, micro, index)
            experts = sizes.layer(index).experts if name in BACKWARD_LAYER else None
            act, state = walk.segment(name, segments[name], events, act, state, experts, micro,
                                      _prefetched_gather_bytes(name, sizes, index))
    for event in _root_post_backward(sizes, micro):
        if event(state):
            walk.consider(act, state, "suffix")
    total, peak_act, parts, seg = walk.best
    grads = sum(parts[p] for p in GRADS)
    return Replay(peak_bytes=total, peak_act_bytes=peak_act, peak_grad_bytes=grads, peak_segment=seg,
                  end_act_bytes=act, end_grad_bytes=state["grad_shards"],
                  peak_parts={"gathered_params": parts["root_params"] + parts["gather"] + parts["layer_params"],
                              "comm_buffers": parts["reduce_scatter"]})


def experts_levels(events: dict, traced_grad_bytes: dict[str, float], b: int, s: int,
                   offsets: dict[str, float] | None = None) -> dict[str, tuple[float, float]]:
    """Per backward layer segment with experts: two activation levels (above the segment's start) read off the
    profile's event list, (just before the experts' first gradient, when the experts' backward is over). The
    experts' gradients are the layer's first after those of the modules after them in forward (``offsets``: their
    bytes); the next gradient made is the router's, whose backward runs once the experts module has handed back
    its input gradients, the moment its FSDP2 post-backward fires: the level just before that gradient.
    ``traced_grad_bytes``: the experts' traced gradient bytes of each segment's layer."""
    grads = set(events["grads"])
    sizes = [round(poly(p, b, s)) for p in events["polys"]]
    out = {}
    for name, experts in traced_grad_bytes.items():
        codes = events["segments"].get(name)
        if not experts or codes is None:
            continue
        offset = (offsets or {}).get(name, 0.0)
        level = grad = 0.0
        before_first = None
        done = False
        for code in codes:
            alloc, o = (True, code) if code >= 0 else (False, ~code)
            size = sizes[events["size"][o]]
            if o in grads:
                if alloc and done:
                    break  # the router's gradient: the experts' backward is over
                if alloc and before_first is None and grad >= offset:
                    before_first = level
                grad += size if alloc else 0.0
                done = done or grad >= experts + offset
                continue
            level += size if alloc else -size
        out[name] = (level if before_first is None else before_first, level)
    return out


def levels_before_grad(events: dict, offsets: dict[str, float], b: int, s: int) -> dict[str, float]:
    """Per backward layer segment: the activation level (above the segment's start) just before the gradient
    allocated once ``offsets[name]`` gradient bytes have been made (a router unit's pre-backward: its first
    gradient)."""
    grads = set(events["grads"])
    sizes = [round(poly(p, b, s)) for p in events["polys"]]
    out = {}
    for name, offset in offsets.items():
        codes = events["segments"].get(name)
        if codes is None:
            continue
        level = grad = 0.0
        for code in codes:
            alloc, o = (True, code) if code >= 0 else (False, ~code)
            size = sizes[events["size"][o]]
            if o in grads:
                if alloc and grad >= offset:
                    out[name] = level
                    break
                grad += size if alloc else 0.0
                continue
            level += size if alloc else -size
    return out
