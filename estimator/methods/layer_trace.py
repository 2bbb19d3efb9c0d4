"""Reading the profile's 3-layer trace per decoder layer: which traced layer stands behind each segment, and how
many gradient bytes a layer's backward makes before a given parameter's (the profile's gradient hook order)."""

from __future__ import annotations

from collections.abc import Callable

from estimator.models.params import ParamInfo


def traced_layer_of(num_layers: int) -> dict[str, int]:
    """The traced layer of each layer segment; layer kinds follow the first layers (a dense first layer)."""
    return {"fw_first": 0, "fw": min(1, num_layers - 1), "fw_last": min(2, num_layers - 1),
            "bw_first": min(2, num_layers - 1), "bw": min(1, num_layers - 1), "bw_last": 0}


def grads_before(params: dict, table: list[ParamInfo], is_target: Callable[[int, str], bool]) -> dict[int, float]:
    """Per traced layer with a target parameter (``is_target(layer, name within the layer)``): the gradient bytes
    its backward makes before the first target's."""
    # the table names parameters in full ("model.layers.2.mlp.experts.gate_up_proj"), the order within the layer
    nbytes = {(p.layer, p.name.split(f".{p.layer}.", 1)[-1]): p.nbytes for p in table if p.trainable}
    out: dict[int, float] = {}
    started: set[int] = set()
    for layer, name in params.get("grad_order", ()):
        if layer is None or layer in started:
            continue
        if is_target(layer, name):
            started.add(layer)
        else:
            out[layer] = out.get(layer, 0.0) + nbytes.get((layer, name), 0.0)
    return {layer: out.get(layer, 0.0) for layer in started}
