"""every-k checkpointing's event list: the plain and the checkpointed profile's event lists merged into one, each
decoder layer's forward and backward from the profile of its kind (layers K-1, 2K-1, ... checkpointed), as
``estimator.methods.long_context.mixed_layers`` mixes their segment summaries.

The merged list keeps the plain profile's ordinals, outer segments (prefix, middle, suffix, optimizer step) and
held outputs; the checkpointed profile's layer segments come in as ``fw+ckpt``, ``bw+ckpt``, ... with ordinals
of their own (after the plain ones). Where the two kinds meet, a tensor crosses layers: a layer's output (freed by
the next layer's backward), the gradient of its input (freed by the layer below) and the parameter gradients
(freed by the optimizer step). Those a layer segment exports (touched from another layer or an outer segment)
are matched between the two profiles in allocation order, the same sizes required, and a checkpointed layer's
export takes the plain one's identity (``ckpt_alias``), so either kind's neighbour finds it. Tensors of no layer
that a checkpointed layer touches are the plain profile's of the same place among the outer allocations.

What the checkpoint keeps of every layer's call (the rotary tables, the position ids, the mask: keyword
arguments a checkpoint's frame holds) the plain profile frees at the forward's end, the checkpointed one in its
lowest layer's backward: in the merge they go in the lowest checkpointed layer's backward (``+release``), at the
place the checkpointed profile's layer 0 frees them. Anything else that differs between the two profiles'
outer segments is an ExpansionError: the prior stays.

A first layer of another kind (a dense MLP before expert layers) runs plain for every K > 1, but the checkpointed
layer above it touches its output: its crossing tensors, numbered among its own segments' allocations, are
paired apart from the generic layer's (``ckpt_alias_first``), and the shared tensors' frees go into the lowest
checkpointed layer's backward at their place counted from the end of the first layer's backward (where the
checkpoint's frame lets them go, after an MLP of either kind).
"""

from __future__ import annotations

from estimator.methods.long_context import checkpointed
from estimator.profiler.expand import CKPT, LAYER_SEGMENTS, RELEASE, ExpansionError, _decode, _Layout
from estimator.spec import ckpt_every

_BEFORE_BACKWARD = ("prefix", "mid_fw", "mid_bw")
_MERGED: dict[tuple, tuple] = {}


def _layer_segments(events: dict) -> dict[str, list[int]]:
    return {name: codes for name, codes in events["segments"].items() if name in LAYER_SEGMENTS}


def _exports(events: dict, layout: _Layout, first: bool | None = None) -> dict[str, list[int]]:
    """Per stack, the places j of the layer tensors touched from another layer or from outside the layers.
    ``first``: only the first layer's tensors (True) or only the others' (False), for a first layer of another
    kind, whose places j count its own segments' allocations; None: every layer's (all alike)."""
    found: dict[str, set[int]] = {"fw": set(), "bw": set()}
    for name, codes in events["segments"].items():
        context = LAYER_SEGMENTS[name][1] if name in LAYER_SEGMENTS else None
        for code in codes:
            o = _decode(code)[1]
            ident, layer = layout.ident.get(o), layout.layer.get(o)
            if first is not None and (layer == 0) != first:
                continue
            if ident is not None and ident[0] in found and layer != context:
                found[ident[0]].add(ident[1])
    return {stack: sorted(js) for stack, js in found.items()}


def _ordinal_of(layout: _Layout, layer: int = 1) -> dict[tuple, int]:
    """A representative ordinal (layer ``layer``'s: the generic one by default) of each layer identity, for its
    size."""
    return {ident: o for o, ident in layout.ident.items() if ident[0] != "o" and layout.layer[o] == layer}


def _alias(plain: dict, ckpt: dict, plain_layout: _Layout, ckpt_layout: _Layout, first: bool | None = None
           ) -> dict[str, dict[int, int]]:
    """The checkpointed layer's exports -> the plain layer's, in allocation order, the same sizes. ``first``: as
    ``_exports`` (a first layer of another kind has places of its own, matched on their own)."""
    mine, theirs = _exports(plain, plain_layout, first), _exports(ckpt, ckpt_layout, first)
    layer = 0 if first else 1
    plain_o, ckpt_o = _ordinal_of(plain_layout, layer), _ordinal_of(ckpt_layout, layer)
    which = "first " if first else ""
    alias: dict[str, dict[int, int]] = {}
    for stack in ("fw", "bw"):
        if len(mine[stack]) != len(theirs[stack]):
            raise ExpansionError(f"every-k: the plain {which}layer exports {len(mine[stack])} {stack} tensors, the "
                                 f"checkpointed one {len(theirs[stack])}")
        for j_plain, j_ckpt in zip(mine[stack], theirs[stack]):
            size_plain = plain["polys"][plain["size"][plain_o[stack, j_plain]]]
            size_ckpt = ckpt["polys"][ckpt["size"][ckpt_o[stack, j_ckpt]]]
            if list(size_plain) != list(size_ckpt):
                raise ExpansionError(f"every-k: a crossing {stack} tensor differs in size between the profiles")
        alias[stack] = dict(zip(theirs[stack], mine[stack]))
    return alias


def _outer_map(plain: dict, ckpt: dict) -> dict[int, int]:
    """The checkpointed profile's tensors of no layer made before the backward -> the plain profile's."""
    out: dict[int, int] = {}
    for name in _BEFORE_BACKWARD:
        mine = [c for c in plain["segments"][name] if c >= 0]
        theirs = [c for c in ckpt["segments"][name] if c >= 0]
        if len(mine) != len(theirs) or any(plain["polys"][plain["size"][a]] != ckpt["polys"][ckpt["size"][b]]
                                           for a, b in zip(mine, theirs)):
            raise ExpansionError(f"every-k: the two profiles' {name} allocate differently")
        out.update(zip(theirs, mine))
    return out


def _frees_no_layer(codes: list[int], layout: _Layout) -> set[int]:
    return {_decode(c)[1] for c in codes if c < 0 and layout.ident.get(_decode(c)[1], ("o",))[0] == "o"}


def _first_inputs(ckpt: dict, ckpt_layout: _Layout) -> set[int]:
    """The checkpointed layer 0's input (the embedding output: no layer's), as its backward frees it where a
    generic layer's frees the layer below's output: the last of its frees of tensors of no layer of that size."""
    sizes = [ckpt["polys"][ckpt["size"][~c]] for c in ckpt["segments"]["bw"]
             if c < 0 and ckpt_layout.ident[~c][0] == "fw" and ckpt_layout.layer[~c] == 0]
    frees = [~c for c in ckpt["segments"]["bw_last"] if c < 0 and ckpt_layout.ident[~c][0] == "o"]
    found: set[int] = set()
    for size in sizes:
        match = [o for o in frees if ckpt["polys"][ckpt["size"][o]] == size and o not in found]
        if not match:
            raise ExpansionError("every-k: the checkpointed layer 0's input is not among its backward's frees")
        found.add(match[-1])
    return found


def _shared(plain: dict, ckpt: dict, plain_layout: _Layout, ckpt_layout: _Layout, outer: dict[int, int]
            ) -> set[int]:
    """Tensors of no layer the plain profile frees before the backward and the checkpointed one in a layer's
    backward (what a checkpoint's frame keeps of every layer's call), as plain ordinals; not layer 0's input,
    which goes as layer 0's kind (plain, K > 1) lets it go."""
    early = set().union(*(_frees_no_layer(plain["segments"][n], plain_layout) for n in ("prefix", "mid_fw")))
    late = set().union(*(_frees_no_layer(codes, ckpt_layout) for name, codes in _layer_segments(ckpt).items()
                         if LAYER_SEGMENTS[name][0] == "bw")) - _first_inputs(ckpt, ckpt_layout)
    return {outer[o] for o in late if o in outer and outer[o] in early}


def _last_inputs(plain: dict, ckpt: dict, plain_layout: _Layout, ckpt_layout: _Layout, name: str) -> set[int]:
    """Frees in the outer segment ``name`` of the plain profile of a generic layer's forward tensors (the last
    layer's input, freed after its hook) that the checkpointed profile has not there (its checkpoint keeps it)."""
    def frees(events: dict, layout: _Layout) -> set[tuple]:
        return {layout.ident[~c] for c in events["segments"][name]
                if c < 0 and layout.ident[~c][0] == "fw" and layout.layer[~c] == 1}

    theirs = frees(ckpt, ckpt_layout)
    return {~c for c in plain["segments"][name]
            if c < 0 and plain_layout.ident[~c][0] == "fw" and plain_layout.layer[~c] == 1
            and plain_layout.ident[~c] not in theirs}


def _signature(events: dict, layout: _Layout, name: str, rename, drop: set) -> list[tuple]:
    """The segment's (alloc?, tensor) with the tensors named by ``rename``, less the frees of ``drop``."""
    out = []
    for code in events["segments"][name]:
        alloc, o = _decode(code)
        o = rename(o)
        if not alloc and o in drop:
            continue
        out.append((alloc, o))
    return out


def _check_outer(plain: dict, ckpt: dict, plain_layout: _Layout, ckpt_layout: _Layout, outer: dict[int, int],
                 aliases: tuple[dict, dict], drop: set[int]) -> None:
    """The outer segments before the backward the same in both, up to the frees that follow a layer's kind
    (``drop``, plain ordinals). ``aliases``: the generic and the first layer's (``_alias``)."""
    def plain_name(o):
        ident = plain_layout.ident.get(o)
        return ("L", *ident, plain_layout.layer[o]) if ident and ident[0] != "o" else o

    def ckpt_name(o):
        ident = ckpt_layout.ident.get(o)
        if ident and ident[0] != "o":
            alias = aliases[1] if ckpt_layout.layer[o] == 0 else aliases[0]
            return ("L", ident[0], alias[ident[0]].get(ident[1], -1), ckpt_layout.layer[o])
        return outer.get(o, ("ckpt", o))

    named = {plain_name(o) for o in drop}
    for name in _BEFORE_BACKWARD:
        if (_signature(plain, plain_layout, name, plain_name, named)
                != _signature(ckpt, ckpt_layout, name, ckpt_name, named)):
            raise ExpansionError(f"every-k: the two profiles' {name} differ beyond what a checkpoint keeps")


def _released(ckpt: dict, ckpt_layout: _Layout, target: str, outer: dict[int, int], shared: set[int]
              ) -> list[int]:
    """The checkpointed segment ``target`` (the lowest checkpointed layer's backward) with the shared tensors'
    frees where the checkpointed profile's layer 0 frees them (counted in the events that free no shared tensor
    of no layer), in the checkpointed profile's ordinals. A first layer of another kind (its backward makes
    other events than the generic one's) is matched from the segment's end: the checkpoint's frame lets the
    shared tensors go as the layer's backward finishes, after its expert or dense MLP."""
    def other(code: int, context: int) -> bool:
        """Not a free of a tensor from outside the layer (its input, the gradient from above, a shared one)."""
        o = _decode(code)[1]
        return not (code < 0 and (ckpt_layout.ident[o][0] == "o" or ckpt_layout.layer[o] != context))

    inserts: list[tuple[int, int]] = []
    at = 0
    for code in ckpt["segments"]["bw_last"]:
        if other(code, 0):
            at += 1
        elif outer.get(~code) in shared:
            inserts.append((at, code))
    body, context = ckpt["segments"][target], LAYER_SEGMENTS[target][1]
    count = sum(other(code, context) for code in body)
    if count != at and ckpt_layout.counterpart is None:
        raise ExpansionError("every-k: the checkpointed layer 0's backward is not the generic one's")
    inserts = [(place + count - at, code) for place, code in inserts]  # from the end (the same when alike)
    if any(place < 0 for place, _ in inserts):
        raise ExpansionError("every-k: the checkpointed layer 0 lets the shared tensors go before the generic "
                             "layer's backward begins")
    out, seen = [], 0
    pending = list(inserts)
    for code in body:
        while pending and pending[0][0] == seen:
            out.append(pending.pop(0)[1])
        out.append(code)
        seen += other(code, context)
    out.extend(code for _, code in pending)
    return out


def merge_events(plain: dict, ckpt: dict, num_layers: int, every: int) -> dict:
    """The merged event list (module docstring); its ``every_k``: (K, lowest checkpointed layer)."""
    kinds = checkpointed(num_layers, every)
    if not any(kinds) or all(kinds):
        return plain if not any(kinds) else ckpt
    if plain.get("optimizer") != ckpt.get("optimizer") or len(plain["held"]) != len(ckpt["held"]):
        raise ExpansionError("every-k: the two profiles' steps differ outside the layers")
    plain_layout = _Layout(plain, plain["segments"])
    ckpt_layout = _Layout(ckpt, ckpt["segments"])
    first_differs = plain_layout.counterpart is not None
    if first_differs != (ckpt_layout.counterpart is not None):
        raise ExpansionError("every-k: the first layer is of another kind in one profile only")
    # a first layer of another kind (dense before expert layers) numbers its tensors on its own: its crossing
    # tensors are paired apart from the generic layer's (it runs plain for every K > 1, but the checkpointed
    # layer above it touches its output)
    alias = _alias(plain, ckpt, plain_layout, ckpt_layout, False if first_differs else None)
    alias_first = _alias(plain, ckpt, plain_layout, ckpt_layout, True) if first_differs else alias
    outer = _outer_map(plain, ckpt)
    shared = _shared(plain, ckpt, plain_layout, ckpt_layout, outer)
    first_in = _first_inputs(ckpt, ckpt_layout)
    last_in = {name: _last_inputs(plain, ckpt, plain_layout, ckpt_layout, name) for name in _BEFORE_BACKWARD}
    _check_outer(plain, ckpt, plain_layout, ckpt_layout, outer, (alias, alias_first),
                 shared | {outer[o] for o in first_in} | set().union(*last_in.values()))
    # what the mixed step frees before the backward: the plain profile's, less what the checkpoints keep and,
    # under a checkpointed last layer, its input
    gone = {name: shared | (last_in[name] if kinds[-1] else set()) for name in _BEFORE_BACKWARD}
    offset = len(plain["size"])
    poly_index = {tuple(p): i for i, p in enumerate(plain["polys"])}
    polys = [list(p) for p in plain["polys"]]
    for p in ckpt["polys"]:
        poly_index.setdefault(tuple(p), len(polys))
        if len(polys) == poly_index[tuple(p)]:
            polys.append(list(p))
    size = list(plain["size"]) + [poly_index[tuple(ckpt["polys"][i])] for i in ckpt["size"]]

    def rename(code: int) -> int:
        alloc, o = _decode(code)
        if ckpt_layout.ident[o][0] == "o":
            if o not in outer:
                raise ExpansionError(f"every-k: a checkpointed layer touches tensor {o} of no layer made after the "
                                     "backward began")
            o = outer[o]
        else:
            o += offset
        return o if alloc else ~o

    segments = {name: [c for c in codes if c >= 0 or ~c not in gone.get(name, ())]
                for name, codes in plain["segments"].items()}
    for name, codes in _layer_segments(ckpt).items():
        segments[name + CKPT] = [rename(c) for c in codes]
    lowest = kinds.index(True)
    target = "bw_first" if lowest == num_layers - 1 else "bw"
    segments[target + CKPT + RELEASE] = [rename(c) for c in
                                         _released(ckpt, ckpt_layout, target, outer, shared)]
    grads = list(plain.get("grads", ())) + [o + offset for o in ckpt.get("grads", ())
                                            if ckpt_layout.ident.get(o, ("o",))[0] != "o"]
    merged = {**plain, "polys": polys, "size": size, "segments": segments, "grads": grads,
              "ckpt_alias": alias, "every_k": [every, lowest]}
    if first_differs:
        merged["ckpt_alias_first"] = alias_first
    return merged


def mixed_events(spec, regime: dict, num_layers: int) -> dict:
    """The merged event list of an every-k spec's (mixed) regime: the plain and the checkpointed profile's event
    lists of the regime with the same bounds, loaded as ``estimator.api.every_k_profile`` loads them (memoized per
    pair). ExpansionError: no replay (the reason)."""
    from estimator.models.profiles import run_adapters_in_16bit
    from estimator.profiler.cache import load_plain_and_checkpointed

    every = ckpt_every(spec.training.ckpt_policy)
    try:
        _, plain, ckpt = load_plain_and_checkpointed(
            spec.model, spec.training, spec.parallel.tp, allow_build=False,
            adapters_16bit=run_adapters_in_16bit(spec))
    except ValueError as err:
        raise ExpansionError(f"every-k: {err}") from None
    pair = []
    for profile in (plain, ckpt):
        bounds = [r for r in profile["regimes"] if all(r[k] == regime[k] for k in ("b_min", "b_max", "s_min", "s_max"))]
        if not bounds or bounds[0].get("events") is None:
            raise ExpansionError("the profile has no event list (traced before event lists were kept)")
        pair.append(bounds[0]["events"])
    key = (id(pair[0]), id(pair[1]), num_layers, every)
    hit = _MERGED.get(key)
    if hit is None or hit[0] is not pair[0] or hit[1] is not pair[1]:
        try:
            merged = merge_events(pair[0], pair[1], num_layers, every)
        except ExpansionError as err:
            merged = err
        if len(_MERGED) > 64:
            _MERGED.clear()
        hit = (pair[0], pair[1], merged)
        _MERGED[key] = hit
    if isinstance(hit[2], ExpansionError):
        raise hit[2]
    return hit[2]
