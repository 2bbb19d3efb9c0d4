"""A layer's module kept in fp32 (DeepSeek's router) as an FSDP2 unit of its own: where, in each backward layer
segment of the profile, the router's pre-backward fires, at which the previous layer's all-gather is issued
(``fsdp_replay.LayerGroup.router_gather_bytes``). The unit's sizes come from ``methods.state``; this module reads
the moment off the profile's gradient order and event list."""

from __future__ import annotations

from estimator.methods.fsdp_replay import levels_before_grad
from estimator.methods.layer_trace import grads_before, traced_layer_of
from estimator.methods.state import fp32_kept_params
from estimator.models.params import ParamInfo


def router_segments(segments: dict, regime: dict, table: list[ParamInfo], profile_params: dict, precision: str,
                    num_layers: int, b: int, s: int) -> dict:
    """The backward layer segments whose layer has a router unit, each with ``router``: (the trace's gradient
    bytes made before the router's first gradient, the activation level just before it). Unchanged where the
    profile has no event list or no layer keeps a module in fp32."""
    events = regime.get("events")
    if events is None:
        return segments
    by_layer: dict[int, list[ParamInfo]] = {}
    for p in table:
        if p.layer is not None:
            by_layer.setdefault(p.layer, []).append(p)
    kept = {layer: {p.name.split(f".{layer}.", 1)[-1] for p in fp32_kept_params(params, precision)}
            for layer, params in by_layer.items()}
    kept = {layer: names for layer, names in kept.items() if names}
    if not kept:
        return segments
    offsets_by_layer = grads_before(profile_params, table, lambda layer, name: name in kept.get(layer, ()))
    backward = {name: index for name, index in traced_layer_of(num_layers).items()
                if name.startswith("bw") and index in offsets_by_layer}
    offsets = {name: offsets_by_layer[index] for name, index in backward.items()}
    out = dict(segments)
    for name, level in levels_before_grad(events, offsets, b, s).items():
        out[name] = {**out[name], "router": (offsets[name], level)}
    return out
