"""A profile's recorded module trace (``estimator.profiler.modules``) at a model's full depth: the order in which
DeepSpeed ZeRO-3's hooks fetch modules (``estimator.reserved.zero3_gathers.modules_of``)."""

from __future__ import annotations


def _stretched(entries: list[list], layer_prefix: str, num_layers: int, generic: int, params: bool
               ) -> list[tuple] | None:
    """One recorded list at ``num_layers`` layers (``module_trace_at_depth``); None where it cannot be."""
    at_layers = [k for k, e in enumerate(entries) if e[0] is not None]
    if not at_layers:
        return None
    first, last = at_layers[0], at_layers[-1]
    if any(e[0] is None for e in entries[first:last + 1]):
        return None
    per_layer: dict[int, list] = {}
    for e in entries[first:last + 1]:
        if per_layer and e[0] != list(per_layer)[-1] and e[0] in per_layer:
            return None  # a layer's modules not together
        per_layer.setdefault(e[0], []).append(tuple(_hashable(v) for v in e[1:]))
    order = list(per_layer)
    if order not in (sorted(order), sorted(order, reverse=True)) or generic not in per_layer:
        return None
    template = per_layer[generic]
    if any(rows != template for layer, rows in per_layer.items() if layer != 0):
        return None
    first_rows = per_layer.get(0, template)
    if not _runs_apart_alike(first_rows, template, params):
        return None

    def full(layer: int, name: str) -> str:
        return f"{layer_prefix}.{layer}" + (f".{name}" if name else "")

    def entry(layer: int | None, row: tuple) -> tuple:
        name = row[0] if layer is None else full(layer, row[0])
        if not params:
            return (name, ())
        return (name, tuple(row[1]) if layer is None else tuple(full(layer, n) for n in row[1]), row[2])

    layers = range(num_layers) if order == sorted(order) else range(num_layers - 1, -1, -1)
    return ([entry(None, tuple(e[1:])) for e in entries[:first]]
            + [entry(i, row) for i in layers for row in (first_rows if i == 0 else template)]
            + [entry(None, tuple(e[1:])) for e in entries[last + 1:]])


def _runs_apart_alike(first: list[tuple], template: list[tuple], params: bool) -> bool:
    """Whether the first layer's rows are the generic layer's but for what LoRA changes there (its input needs no
    gradient): in forward the same modules and parameters, only the counts of inputs needing a gradient lower;
    in backward a subsequence of the generic layer's modules (a layer of another kind, such as a dense layer
    before MoE ones, is not)."""
    if params:
        return (len(first) == len(template)
                and all(a[:2] == b[:2] and a[2] <= b[2] for a, b in zip(first, template)))
    rest = iter(template)
    return all(row in rest for row in first)


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


def module_trace_at_depth(trace: dict, layer_prefix: str, num_layers: int, generic: int = 1
                          ) -> tuple[list[tuple[str, tuple[str, ...], int]], list[str]] | None:
    """(forward: (module, its direct parameters, its positional inputs that need a gradient) in pre-forward
    order; backward: modules in pre-backward order)
    of the recorded trace for a model of ``num_layers`` decoder layers: the modules before the traced layers,
    the ``generic`` traced layer's modules once per layer, the modules after them; full names. None where the
    traced layers do not run alike one after another (a module outside them between two, or layers that
    differ): the trace cannot be stretched. The first layer may differ from the generic one (under LoRA its input
    needs no gradient: its modules count none, and backward reaches fewer of them); it is kept as recorded."""
    forward = _stretched(trace["forward"], layer_prefix, num_layers, generic, True)
    backward = _stretched(trace["backward"], layer_prefix, num_layers, generic, False)
    if forward is None or backward is None:
        return None
    return forward, [name for name, _ in backward]
