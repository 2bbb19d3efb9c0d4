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
    # Expert parallelism: the layer's unit without its experts, which are a unit of their own (see LayerGroup)
    layer_prefetch_gather_bytes: float | None = None

    def layer(self, index: int | None) -> LayerGroup:
        """Layer ``index``'s group (None, or every layer alike: the one layer described above)."""
        if self.layers and index is not None:
            return self.layers[index]
        return LayerGroup(self.layer_bytes, self.layer_gather_bytes, self.layer_rs_in_bytes,
                          self.layer_rs_out_bytes, self.layer_held_bytes, self.layer_prefetch_gather_bytes)

    def sum_layers(self, num_layers: int, field: str) -> float:
        if self.layers:
            return sum(getattr(group, field) for group in self.layers)
        return num_layers * getattr(self.layer(None), field)


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """One decoder layer's FSDP2 group (the fields of ``FsdpSizes`` named ``layer_*``)."""
    bytes: float
    gather_bytes: float
    rs_in_bytes: float
    rs_out_bytes: float
    held_bytes: float = 0.0
    # What backward prefetches of this layer while the next one runs, where it is not the whole layer: under
    # expert parallelism each experts module is an FSDP2 unit of its own (transformers'
    # ``apply_fully_sharded_data_parallelism``), and backward prefetches one unit ahead in reverse post-forward
    # order (layer L, experts L, layer L-1, experts L-1, ...): layer L-1's unit without its experts.
    prefetch_gather_bytes: float | None = None

    @property
    def prefetched_bytes(self) -> float:
        return self.gather_bytes if self.prefetch_gather_bytes is None else self.prefetch_gather_bytes


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
    if prefetched is not None:
        events.append(set_part("gather", lambda st: prefetched.prefetched_bytes))
    return events


def segment_layer(name: str, k: int, num_layers: int) -> int | None:
    """The decoder layer of the ``k``-th instance of a profile segment (None: outside the layers)."""
    return {"fw_first": 0, "fw": 1 + k, "fw_last": num_layers - 1, "bw_first": num_layers - 1,
            "bw": num_layers - 2 - k, "bw_last": 0}.get(name)


def _boundary_events(name: str, num_layers: int, sz: FsdpSizes, micro: str, index: int | None = None
                     ) -> list[Event]:
    """FSDP2 events at the start of a profile segment (its layer's pre-hook, or the previous one's post-hook);
    ``index``: the segment's layer (None: the generic layer, every layer alike)."""
    def near(offset: int) -> LayerGroup:  # the layer ``offset`` away from this one
        return sz.layer(None if index is None else index + offset)

    here = sz.layer(index)
    if name == "prefix":
        return [set_part("gather", lambda st: sz.root_gather_bytes), set_part("root_params", lambda st: sz.root_bytes)]
    if name == "fw_first":
        return [set_part("gather", lambda st: sz.root_gather_bytes + here.gather_bytes),
                set_part("layer_params", lambda st: here.bytes),
                set_part("gather", lambda st: here.gather_bytes)]
    if name in FORWARD_LAYER:
        previous = near(-1)
        # under EP the experts' unit gathers inside the layer, after the layer's own unit (prefetched_bytes)
        return [set_part("layer_params", lambda st: 0.0),
                set_part("gather", lambda st: previous.prefetched_bytes + here.prefetched_bytes),
                set_part("layer_params", lambda st: here.bytes),
                set_part("gather", lambda st: here.prefetched_bytes)]
    if name == "mid_fw":
        return [set_part("layer_params", lambda st: 0.0)]
    if name == "mid_bw":  # root post-forward frees the last gather; backward's first prefetch re-gathers it
        last = sz.layer(num_layers - 1)
        return [set_part("gather", lambda st: 0.0), set_part("gather", lambda st: last.prefetched_bytes)]
    if name in BACKWARD_LAYER:
        first = name == "bw_first" or num_layers == 1
        prefetched = near(-1) if name != "bw_last" else None
        return ([] if first else _post_backward(near(+1), micro)) + _pre_backward(here, prefetched)
    if name == "suffix":
        return _post_backward(sz.layer(0), micro)
    raise ValueError(f"fsdp: unknown profile segment {name!r}")


def _root_post_backward(sz: FsdpSizes, micro: str) -> list[Event]:
    return [set_part("root_params", lambda st: 0.0),
            *_group_post_backward(sz.root_rs_in_bytes, sz.root_rs_out_bytes, sz.root_held_bytes, "root_grads",
                                  micro),
            set_part("reduce_scatter", lambda st: 0.0)]


def _grad_part(name: str) -> str:
    return "layer_grads" if name in BACKWARD_LAYER else "root_grads"


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

    def segment(self, name: str, seg: dict, events: list[Event], act: float, state: dict) -> tuple[float, dict]:
        """Run one segment instance from (act, state); return the state at its end."""
        state = dict(state)
        for event in events:
            if event(state):
                self.consider(act, state, name)
        part = self.grad_part(name)
        held = state[part]
        for cand_act, cand_grad in seg["candidates"]:
            state[part] = held + (cand_grad if self.in_flight is None else min(cand_grad, self.in_flight))
            self.consider(act + poly(cand_act, self.b, self.s), state, name)
        state[part] = held + (seg["net_grad"] if self.in_flight is None else 0.0)
        return act + poly(seg["net_act"], self.b, self.s), state

    def repeat(self, name: str, seg: dict, events: list[Event], act: float, state: dict, repeats: int
               ) -> tuple[float, dict]:
        """``repeats`` instances of a segment. Repetitions differ only in what accumulates linearly (activations,
        gradient shards): run the second to get the per-repetition change, then the last one from its
        extrapolated start. None (a 2-layer model's middle layers): nothing happens."""
        if repeats < 1:
            return act, state
        act0, state0 = self.segment(name, seg, events, act, state)
        if repeats < 2:
            return act0, state0
        act, state = self.segment(name, seg, events, act0, state0)
        if repeats > 2:
            k = repeats - 2
            start_act = act0 + k * (act - act0)
            start = {p: state0[p] + k * (state[p] - state0[p]) for p in state}
            act, state = self.segment(name, seg, events, start_act, start)
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
    for name, repeats in segment_sequence(num_layers):
        if not sizes.layers:  # every layer alike: the repetitions extrapolate
            events = _boundary_events(name, num_layers, sizes, micro)
            act, state = walk.repeat(name, segments[name], events, act, state, repeats)
            continue
        for k in range(repeats):
            events = _boundary_events(name, num_layers, sizes, micro, segment_layer(name, k, num_layers))
            act, state = walk.segment(name, segments[name], events, act, state)
    for event in _root_post_backward(sizes, micro):
        if event(state):
            walk.consider(act, state, "suffix")
    total, peak_act, parts, seg = walk.best
    grads = sum(parts[p] for p in GRADS)
    return Replay(peak_bytes=total, peak_act_bytes=peak_act, peak_grad_bytes=grads, peak_segment=seg,
                  end_act_bytes=act, end_grad_bytes=state["grad_shards"],
                  peak_parts={"gathered_params": parts["root_params"] + parts["gather"] + parts["layer_params"],
                              "comm_buffers": parts["reduce_scatter"]})
