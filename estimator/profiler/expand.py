"""A profile's compact event list (``estimator.profiler.events``) expanded to the full depth: one training step
of L decoder layers as an ordered list of allocations and frees, each tensor with its own identity.

The profile was traced on 3 layers: segments ``fw_first``, ``fw``, ``fw_last`` are layers 0, 1, 2 forward and
``bw_first``, ``bw``, ``bw_last`` layers 2, 1, 0 backward; the generic ``fw``/``bw`` are repeated L - 2 times.
Identity: a tensor allocated in a layer segment is named (stack, j, layer) — j its place among that segment's
allocations, the same in the first, generic and last layer's segment (checked: equal sizes). An event in
layer ``c`` that touches a tensor allocated in the 3-layer trace's layer ``a`` touches the one of layer
``c + (a - c3)`` (``c3`` the event's own 3-layer layer) when ``|a - c3| <= 1`` (the previous layer's output, the
same layer's saved activations, the next layer's gradient), else the first or last layer's. A first layer of
another kind (a dense MLP before mixture-of-experts layers: its forward or backward allocates another number of
tensors) has identities of its own: a tensor of it that the generic layer touches (its output, freed as the next
layer's replaces it) stands, for a generic layer after another generic one, for that layer's counterpart: the
generic segment's allocation at the same place counted from the segment's end (the layer's output is its last),
of the same size (``_Layout.counterparts``). Outside the layer
segments (prefix, middle, suffix, optimizer step) an event belongs to the layer of the tensor it touches
(gradients, optimizer states and temporaries carry their parameter's layer): a run of events of the generic
layer is repeated for every generic layer, in the order its neighbours give (layer 0's run before it:
ascending). Tensors of no layer have one identity. ``check_step`` verifies that every free finds its tensor
alive and nothing leaks; ``estimator.profiler.profile._check_depth`` compares the expansion with a real deeper
trace, event by event.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter

LAYER_SEGMENTS = {"fw_first": ("fw", 0), "fw": ("fw", 1), "fw_last": ("fw", 2),
                  "bw_first": ("bw", 2), "bw": ("bw", 1), "bw_last": ("bw", 0)}
OUTER = ("prefix", "mid_fw", "mid_bw", "suffix", "optimizer_pre", "optimizer")
# every-k checkpointing's merged event list (``estimator.reserved.every_k``): a checkpointed layer's segments are
# named ``fw+ckpt``, ...; the lowest checkpointed layer's backward ``bw+ckpt+release`` (the same tensors)
CKPT, RELEASE = "+ckpt", "+release"

ALLOC, FREE, FREE_PREVIOUS = 0, 1, 2
_ON_STREAM = 8  # kind 8 + s: allocate on side stream s >= 1 (its own pools: ``estimator.reserved.fsdp``)


def alloc_on(stream: int) -> int:
    """The op kind of an allocation on side stream ``stream`` (>= 1)."""
    return _ON_STREAM + stream


def stream_of(kind: int) -> int | None:
    """The stream of an allocation kind (0: ALLOC), None for a free."""
    return 0 if kind == ALLOC else kind - _ON_STREAM if kind > _ON_STREAM else None


class ExpansionError(ValueError):
    """The event list cannot be repeated for another depth (a layer that is not generic)."""


@dataclass(frozen=True)
class StepEvents:
    """One step at full depth. ``ops``: (kind, key, poly) with kind ALLOC, FREE or FREE_PREVIOUS (the previous
    step's tensor of that key: a manual loop's output object); ``keys``: how many identities a step uses."""

    ops: list[tuple[int, int, int]]
    keys: int


@dataclass(frozen=True)
class Expansion:
    first: StepEvents    # the first step: Adam creates its states in the optimizer step
    steady: StepEvents   # every later step
    workspace_at: tuple[int, int]  # op index in ``first`` of the first forward and first backward matmul segment
    # op index where the traced optimizer step begins in ``first`` (after freeing the loss) and in ``steady``
    optimizer_at: tuple[int, int]
    persistent_keys: frozenset[int]  # keys the first step leaves allocated on purpose (optimizer states)
    # fp32 copies of the held outputs (``outputs_fp32``): size index len(polys) + j is twice copy_of[j]'s bytes
    copy_of: tuple[int, ...] = ()
    # keys of the parameter gradients the backward allocates (the same in both steps: made before the optimizer);
    # FSDP2's: the reduce-scatter outputs its sharded gradients view (``reserved.fsdp``)
    grad_keys: frozenset[int] = frozenset()
    # keys the trace never frees that the expansion frees just before the loss (``_free_with_the_loss``)
    freed_with_loss: frozenset[int] = frozenset()
    # where each segment instance starts: (segment, concrete layer or None, op index), in step order, for the
    # first and the steady step (a method that adds its own events at the boundaries, ``reserved.fsdp``)
    marks: tuple[tuple, tuple] = ((), ())
    # the concrete layer (None: no layer) of each parameter gradient's key
    grad_layers: tuple[tuple[int, int | None], ...] = ()
    # a method whose gradients do not accumulate as autograd's do builds its own micro-steps
    # (``estimator.reserved.accumulate.MicroSteps``; DeepSpeed ZeRO-2, ``reserved.zero``)
    micro: object | None = None


def _decode(code: int) -> tuple[bool, int]:
    return (True, code) if code >= 0 else (False, ~code)


def _base(name: str) -> str:
    """A segment's name without the every-k suffixes (``bw+ckpt+release`` -> ``bw``)."""
    return name.split("+", 1)[0]


def _segment_order(num_layers: int, every_k: tuple[int, int] | None = None) -> list[tuple[str, int | None]]:
    """(segment, concrete layer) in step order; outer segments have no layer. ``every_k``: (K, the lowest
    checkpointed layer) of a merged event list: layers K-1, 2K-1, ... run the checkpointed segments."""
    last = num_layers - 1

    def named(name: str, layer: int) -> tuple[str, int]:
        if every_k is None or (layer + 1) % every_k[0]:
            return name, layer
        return name + CKPT + (RELEASE if name.startswith("bw") and layer == every_k[1] else ""), layer

    order = [("prefix", None), named("fw_first", 0)]
    order += [named("fw", layer) for layer in range(1, last)]
    order += [named("fw_last", last), ("mid_fw", None), ("mid_bw", None), named("bw_first", last)]
    order += [named("bw", layer) for layer in range(last - 1, 0, -1)]
    order += [named("bw_last", 0), ("suffix", None), ("optimizer_pre", None), ("optimizer", None)]
    return order


class _Namer:
    """Dense integer keys for (identity, layer) pairs, numbered in the order they are first asked for."""

    def __init__(self, num_layers: int) -> None:
        self.keys: dict[int, int] = {}  # identity number x (num_layers + 1) + (layer + 1, 0 for none) -> key
        self.ident_ids: dict[tuple, int] = {}
        self.stride = num_layers + 1

    def ident_id(self, ident: tuple) -> int:
        return self.ident_ids.setdefault(ident, len(self.ident_ids))

    def __call__(self, ident: tuple, layer: int | None) -> int:
        pair = self.ident_id(ident) * self.stride + (0 if layer is None else layer + 1)
        return self.keys.setdefault(pair, len(self.keys))


class _Layout:
    """Where each ordinal of the 3-layer trace is allocated, its identity and its layer."""

    def __init__(self, events: dict, segments: dict[str, list[int]]) -> None:
        self.size = events["size"]
        labels = {o: layer for o, layer in events["layer_of"]}
        alias = events.get("ckpt_alias", {})
        # every-k under a first layer of another kind: its crossing tensors' pairing (``reserved.every_k``)
        alias_first = events.get("ckpt_alias_first", alias)
        self.ident: dict[int, tuple] = {}
        self.layer: dict[int, int | None] = {}
        for name, codes in segments.items():
            if name.endswith(RELEASE):  # the same tensors as its segment's
                continue
            j = 0
            for code in codes:
                alloc, o = _decode(code)
                if not alloc:
                    continue
                if o in self.ident:
                    raise ExpansionError(f"events: ordinal {o} allocated twice")
                if _base(name) in LAYER_SEGMENTS:
                    stack, layer = LAYER_SEGMENTS[_base(name)]
                    if name == _base(name):
                        self.ident[o] = (stack, j)
                    elif j in (alias_first if layer == 0 else alias).get(stack, {}):
                        # a checkpointed layer's crossing tensor: the plain one's
                        self.ident[o] = (stack, (alias_first if layer == 0 else alias)[stack][j])
                    else:
                        self.ident[o] = (stack + CKPT, j)
                    self.layer[o] = layer
                    j += 1
                else:
                    self.ident[o] = ("o", o)
                    self.layer[o] = labels.get(o)
        self.counterpart = self.counterparts(segments)

    def counterparts(self, segments: dict[str, list[int]]) -> dict[int, tuple | None] | None:
        """For a first layer of another kind (its forward or backward allocates another number of tensors than the
        generic layer's): each of its ordinals -> the generic layer's identity at the same place counted from the
        segment's end, None where the sizes differ (no counterpart). None when the first layer is like the others."""
        def pairs(suffix: str) -> list[tuple[list[int], list[int]]]:
            return [(self._allocs(segments.get(first + suffix, ())), self._allocs(segments.get(generic + suffix, ())))
                    for first, generic in (("fw_first", "fw"), ("bw_last", "bw"))]

        if all(len(first) == len(generic) for first, generic in pairs("")):
            return None
        out: dict[int, tuple | None] = {}
        # every-k's merged list: a checkpointed layer above a plain generic one touches that layer's output
        # through the checkpointed profile's first layer, whose counterpart is the checkpointed generic layer's
        for first, generic in pairs("") + (pairs(CKPT) if "fw" + CKPT in segments else []):
            for o, g in zip(reversed(first), reversed(generic)):
                out[o] = self.ident[g] if self.size[o] == self.size[g] else None
            for o in first[:max(0, len(first) - len(generic))]:
                out[o] = None
        return out

    @staticmethod
    def _allocs(codes) -> list[int]:
        return [o for alloc, o in map(_decode, codes) if alloc]


def _held_layers(layout: _Layout, o: int, num_layers: int) -> list[int | None]:
    """The concrete layers whose copy of held output ``o`` the next step frees: none for a tensor made outside
    the layers (the logits); every layer the forward segment that made it stands for when a decoder layer made
    it (the key/value cache a model keeps with ``use_cache``: one per layer)."""
    if layout.ident[o][0] != "fw":
        return [None]
    last = num_layers - 1
    return {0: [0], 2: [last]}.get(layout.layer[o], list(range(1, last)))


def _outer_runs(codes: list[int], layout: _Layout) -> list[tuple[int | None, list[int]]]:
    runs: list[tuple[int | None, list[int]]] = []
    for code in codes:
        layer = layout.layer.get(_decode(code)[1])
        if runs and runs[-1][0] == layer:
            runs[-1][1].append(code)
        else:
            runs.append((layer, [code]))
    return runs


def _repeated(runs: list, index: int, first_differs: bool = False) -> bool:
    """A run of the generic layer's events stands for every generic layer when the first and the last layer's
    runs flank it (the optimizer step and ``zero_grad`` walk the parameters in order). Under a first layer of
    another kind a walk over tensors it does not have (a foreach group of fp32 router weights, in the expert
    layers only) has the last layer's run on one side and none of a layer on the other."""
    before = runs[index - 1][0] if index > 0 else None
    after = runs[index + 1][0] if index < len(runs) - 1 else None
    if 0 < index < len(runs) - 1 and {before, after} == {0, 2}:
        return True
    return first_differs and {before, after} == {None, 2}


def _outer_contexts(segment: str, runs: list, index: int, num_layers: int, first_differs: bool = False
                    ) -> list[tuple[int | None, int | None]]:
    """(concrete layer, 3-layer layer) for each copy of an outer segment's run. A generic-layer run flanked by
    the first and last layer's (``_repeated``) is copied for every generic layer, ascending when the first
    layer's run comes before it; otherwise it is the layer next to the segment's end of the stack: layer 1
    before and after the stack (``prefix``, ``suffix``), layer L - 2 between forward and backward."""
    label = runs[index][0]
    last = num_layers - 1
    if label is None:
        return [(None, None)]
    if label == 1 and _repeated(runs, index, first_differs):
        layers = list(range(1, last))
        ascending = (index > 0 and runs[index - 1][0] == 0) or (index < len(runs) - 1 and runs[index + 1][0] == 2)
        return [(layer, 1) for layer in (layers if ascending else layers[::-1])]
    if label == 1:
        return [(1 if segment in ("prefix", "suffix", "optimizer") else last - 1, 1)]
    return [(0 if label == 0 else last, label)]


def _resolve(layout: _Layout, namer: _Namer, codes: list[int], context3: int | None, skip_free: set[int]
             ) -> list[tuple]:
    """What the events of ``codes`` touch, independent of the concrete layer they run as: (kind, ordinal,
    identity number, bytes, the tensor's 3-layer layer, its offset from ``context3``, the identity number it has
    in a layer of the other kind: first layer vs the rest, -1 for none) — worked out once per segment or run,
    then emitted for every layer it stands for."""
    resolved = []
    for code in codes:
        alloc, o = _decode(code)
        if not alloc and o in skip_free:
            continue
        a = layout.layer.get(o)
        delta = None if a is None or context3 is None else a - context3
        ident = layout.ident.get(o)
        number = None if ident is None else namer.ident_id(ident)
        resolved.append((ALLOC if alloc else FREE, o, number, layout.size[o], a, delta,
                         _other_kind(layout, namer, o, a, number)))
    return resolved


def _other_kind(layout: _Layout, namer: _Namer, o: int, layer3: int | None, number: int | None) -> int | None:
    """The identity number tensor ``o`` (of 3-layer layer ``layer3``) takes when an event maps it onto a layer of
    the other kind (a first-layer tensor onto a generic layer, or back): itself when the first layer is like
    the others, the first layer's counterpart (``_Layout.counterparts``), -1 when there is none."""
    if layout.counterpart is None or layer3 is None or number is None:
        return number
    if layer3 != 0:
        return -1  # a generic tensor onto the first layer: only a 2-layer stack's last layer does that
    ident = layout.counterpart.get(o)
    return -1 if ident is None else namer.ident_id(ident)


def _frees_shared(event: tuple) -> bool:
    """A free of a tensor of no layer (made before the stack, e.g. rotary cos/sin) inside a layer segment: that
    layer was the tensor's last user in its stack's order. In the generic segment it happens once, as the last
    generic layer runs (the layer beyond did not use it in the trace, e.g. layer 0 whose frozen attention saves
    nothing when only the MLP has LoRA), not once per generic layer."""
    kind, _o, _ident, _nbytes, layer, _delta, _other = event
    return kind == FREE and layer is None


def _emit(out: list, namer: _Namer, resolved: list[tuple], context: int | None, num_layers: int,
          grads: frozenset[int] = frozenset(), grad_keys: dict[int, int | None] | None = None) -> None:
    """Append ``resolved`` events running as layer ``context`` (None: outside the layers). A touched tensor's
    layer: ``context`` + its offset when within one layer, else the first or last layer (the module docstring).
    The keys of the parameter gradients (ordinals ``grads``) allocated go into ``grad_keys``, with their layer."""
    last, keys, stride = num_layers - 1, namer.keys, namer.stride
    for kind, o, ident, nbytes, a, delta, other in resolved:
        if a is None:
            target = -1
        elif context is None:
            raise ExpansionError(f"events: ordinal {o} of a layer touched outside any layer")
        elif -1 <= delta <= 1:
            target = context + delta
            if not 0 <= target < num_layers:
                raise ExpansionError(f"events: ordinal {o} maps to layer {target} of {num_layers}")
        else:
            target = 0 if a == 0 else last
        if ident is None:
            raise ExpansionError(f"events: ordinal {o} freed but never allocated in the step")
        if target >= 0 and (a == 0) != (target == 0):  # traced in layer 0, run as a generic layer, or back
            ident = other
            if ident < 0:
                raise ExpansionError(f"events: ordinal {o} of the {'first' if a == 0 else 'generic'} layer, of "
                                     f"another kind, has no counterpart in the {'generic' if a == 0 else 'first'}"
                                     " layer")
        key = keys.setdefault(ident * stride + target + 1, len(keys))
        out.append((kind, key, nbytes))
        if kind == ALLOC and o in grads:
            grad_keys[key] = None if target < 0 else target


def _expand_segments(events: dict, segments: dict, num_layers: int, held: list[int], manual: bool,
                     fp32_copies: bool = False, grad_keys: dict[int, int | None] | None = None
                     ) -> tuple[list, _Namer, dict[str, int], list[tuple]]:
    """``fp32_copies``: the forward returns fp32 copies of the held outputs (accelerate's wrapper): the manual
    loop holds the copies, made as the forward returns; the originals go as the trainer loop drops them."""
    layout = _Layout(events, segments)
    namer = _Namer(num_layers)
    grads = frozenset(events.get("grads", ()))
    grad_keys = {} if grad_keys is None else grad_keys
    out: list = []
    skip_free = set(held) if manual and not fp32_copies else set()
    starts = {}
    marks = []
    resolved: dict[str, list[tuple]] = {}
    copies_at = len(events["polys"])
    every_k = events.get("every_k")
    for name, layer in _segment_order(num_layers, every_k):
        base = _base(name)
        starts.setdefault(base, len(out))
        marks.append((base, layer, len(out)))
        if name == "mid_bw" and manual and fp32_copies:
            copies = [(namer(("fp32 copy", o), None), copies_at + j) for j, o in enumerate(held)]
            out.extend((ALLOC, key, poly) for key, poly in copies)
            out.extend((FREE_PREVIOUS, key, poly) for key, poly in copies)
        elif name == "mid_bw" and manual:
            out.extend((FREE_PREVIOUS, namer(layout.ident[o], layer), layout.size[o])
                       for o in held for layer in _held_layers(layout, o, num_layers))
        if base in LAYER_SEGMENTS:
            if name not in resolved:
                resolved[name] = _resolve(layout, namer, segments[name], LAYER_SEGMENTS[base][1], skip_free)
                resolved[name + " not last"] = [event for event in resolved[name] if not _frees_shared(event)]
                if (every_k and base in ("fw", "bw") and not name.endswith(RELEASE)
                        and resolved[name] != resolved[name + " not last"]):
                    raise ExpansionError("every-k: a generic layer frees a tensor the layers share")
            # the lowest checkpointed layer's backward frees what the checkpoints kept (``reserved.every_k``)
            last_generic = (base not in ("fw", "bw") or name.endswith(RELEASE)
                            or layer == (num_layers - 2 if base == "fw" else 1))
            _emit(out, namer, resolved[name if last_generic else name + " not last"], layer, num_layers, grads,
                  grad_keys)
            continue
        runs = _outer_runs(segments[name], layout)
        for index, (label, codes) in enumerate(runs):
            run = _resolve(layout, namer, codes, label, skip_free)
            for context, _context3 in _outer_contexts(name, runs, index, num_layers, layout.counterpart is not None):
                _emit(out, namer, run, context, num_layers, grads, grad_keys)
    return out, namer, starts, marks


def _shifted(marks: list[tuple], after: int, by: int) -> list[tuple]:
    """Segment marks after op index ``after`` moved by ``by`` ops (ops inserted or dropped there)."""
    return [(name, layer, at + by if at > after else at) for name, layer, at in marks]


def _first_optimizer_pre(events: dict) -> list[int]:
    """What the first step frees before its optimizer step: the steady step frees what the step made before
    its optimizer step (the loss: ``del loss`` comes right after the marker) in its optimizer segment; the first
    step's optimizer segment was traced on the warm-up step, where the loss went before the marker."""
    steady = events["segments"]["optimizer"]
    made_here = {code for code in steady if code >= 0}
    first = events["first_optimizer"]
    freed_first = {~code for code in first if code < 0}
    return [code for code in steady if code < 0 and ~code not in made_here and ~code not in freed_first]


def _free_with_the_loss(orphans: set[int], steady: list, steady_at: int, first: list, first_at: int,
                        grad_keys: set[int]) -> tuple[list, list, int, int]:
    """Tensors of the forward and backward that the traced step never frees, freed as the loss goes (just before
    it). They are
    what only the autograd graph keeps, e.g. the embedding output that ``enable_input_require_grads`` (LoRA with
    checkpointing) turns into a leaf, with the gradient stored on it: in a real run the graph, and with it they,
    die with the loss (a real CPU run frees them there); in the trace a module tracker's backward hooks keep
    them. The loss is the run of frees that opens the steady step's optimizer segment and closes the first
    step's forward and backward (``_first_optimizer_pre``); the steady step's optimizer part then starts at the
    orphans' frees. ExpansionError for anything else never freed."""
    made = {key for kind, key, _ in steady[:steady_at] if kind == ALLOC}
    if not orphans <= made - grad_keys:
        raise ExpansionError(f"events: {len(orphans - made)} tensors of a steady step are never freed")
    end = steady_at
    while end < len(steady) and steady[end][0] == FREE and steady[end][1] in made:
        end += 1
    if end == steady_at:
        raise ExpansionError("events: no loss freed at the steady step's optimizer segment")
    polys = {key: poly for kind, key, poly in steady[:steady_at] if kind == ALLOC}
    # newest first: a leaf's .grad goes before the leaf's own storage, as the leaf is destroyed
    frees = [(FREE, key, polys[key]) for key in sorted(orphans, reverse=True)]
    first_alive = {key for kind, key, _ in first[:first_at] if kind == ALLOC} - \
        {key for kind, key, _ in first[:first_at] if kind == FREE}
    first_frees = [op for op in frees if op[1] in first_alive]
    loss = {key for _, key, _ in steady[steady_at:end]}
    at = first_at
    while at > 0 and first[at - 1][0] == FREE and first[at - 1][1] in loss:
        at -= 1
    # before the loss: the graph's tensors go as the last reference to its root does
    return (steady[:steady_at] + frees + steady[steady_at:], first[:at] + first_frees + first[at:],
            first_at + len(first_frees), at)


def _backward_workspace_at(ops: list, events: dict, mid_bw: int, bw_first: int, head_grad_bytes: int | None
                           ) -> int:
    """Where the backward thread's cuBLAS workspace is made: cuBLAS gets its workspace from the caching allocator
    at the thread's first matmul, after that op allocated its output (``at::cuda::blas`` fetches the handle inside
    the GEMM call). The backward's first matmul is the LM head's (the loss's backward has none), and
    ``MmBackward0`` makes the weight's gradient first: the workspace follows the first allocation in the middle
    segment of the head weight's bytes (a constant size). Seen in the H200 snapshots of session 25 (TP x8,
    dp_tp): after the 501 MiB head gradient, not before the loss's backward. Without a trainable head (LoRA, or no
    ``head_grad_bytes``): at the start of the middle segment, as before."""
    if head_grad_bytes is None:
        return mid_bw
    constant = {i for i, poly in enumerate(events["polys"]) if poly[0] == head_grad_bytes and not any(poly[1:])}
    for at in range(mid_bw, bw_first):
        kind, _key, poly = ops[at]
        if kind == ALLOC and poly in constant:
            return at + 1
    return mid_bw


def expand(events: dict, num_layers: int, loop: str = "trainer", fp32_copies: bool = False,
           head_grad_bytes: int | None = None) -> Expansion:
    """The first and the steady step of ``num_layers`` layers (>= 2); ``fp32_copies``: a manual loop holds fp32
    copies of the output object's tensors (every held one 16-bit: the caller checks); ``head_grad_bytes``: the
    bytes of the trainable LM head's weight gradient (``_backward_workspace_at``). Raises ExpansionError when the
    events cannot be repeated."""
    if num_layers < 2:
        raise ExpansionError("events: a 1-layer model has no generic layer to repeat")
    manual = loop == "manual"
    fp32_copies = fp32_copies and manual
    held = [o for o, _saved in events["held"]]
    if fp32_copies and any(_decode(code)[1] in held for name in LAYER_SEGMENTS
                           for code in events["segments"].get(name, ()) if _decode(code)[0]):
        raise ExpansionError("events: fp32 copies of per-layer outputs (a key/value cache) are not modelled")
    steady_segments = {**events["segments"], "optimizer_pre": []}
    grad_layers: dict[int, int | None] = {}
    steady_ops, steady_names, steady_starts, steady_marks = _expand_segments(
        events, steady_segments, num_layers, held, manual, fp32_copies, grad_layers)
    grad_keys = set(grad_layers)
    first_segments = {**events["segments"], "optimizer_pre": _first_optimizer_pre(events),
                      "optimizer": events["first_optimizer"]}
    first_ops, first_names, starts, first_marks = _expand_segments(events, first_segments, num_layers, held,
                                                                   manual, fp32_copies)
    if manual:  # the first step has no previous outputs: drop their frees, shifting the later segments
        first_ops = [op for op in first_ops if op[0] != FREE_PREVIOUS]
        first_marks = _shifted(first_marks, starts["mid_bw"], -len(held))
        starts = {name: at - len(held) if at > starts["mid_bw"] else at for name, at in starts.items()}
    # Keys are step-local; tensors both steps allocate before the optimizer step (a manual loop's held outputs)
    # get the same key in both, as the segments before it are the same.
    keys = max(len(steady_names.keys), len(first_names.keys))
    previous = {key for kind, key, _ in steady_ops if kind == FREE_PREVIOUS}
    orphans = check_step(steady_ops, previous_alive=previous) - previous
    if orphans:
        steady_at = steady_starts["optimizer"]
        steady_ops, first_ops, first_at, inserted_at = _free_with_the_loss(
            orphans, steady_ops, steady_at, first_ops, starts["optimizer"], grad_keys)
        steady_marks = _shifted(steady_marks, steady_at, len(orphans))
        first_marks = _shifted(first_marks, inserted_at, first_at - starts["optimizer"])
        starts = {**starts, "optimizer": first_at}
    persistent = check_step(first_ops)
    leaked = check_step(steady_ops, previous_alive=previous)
    if leaked - previous:
        raise ExpansionError(f"events: {len(leaked - previous)} tensors of a steady step are never freed")
    fallback = (starts["fw_first"], _backward_workspace_at(first_ops, events, starts["mid_bw"], starts["bw_first"],
                                                           head_grad_bytes))
    workspace_at = _workspace_at(events, first_segments, first_names, first_ops, fallback)
    return Expansion(first=StepEvents(first_ops, keys), steady=StepEvents(steady_ops, keys),
                     workspace_at=workspace_at,
                     optimizer_at=(starts["optimizer"], steady_starts["optimizer"]),
                     persistent_keys=frozenset(persistent - previous),
                     copy_of=tuple(events["size"][o] for o in held) if fp32_copies else (),
                     grad_keys=frozenset(grad_keys), freed_with_loss=frozenset(orphans),
                     marks=(tuple(first_marks), tuple(steady_marks)),
                     grad_layers=tuple(sorted(grad_layers.items())))


def _workspace_at(events: dict, segments: dict, namer: _Namer, first_ops: list, fallback: tuple[int, int]
                  ) -> tuple[int, int]:
    """Op index in the first step before which each thread's cuBLAS workspace is allocated: right after the
    output of the thread's first cuBLAS op (``blas_first``: the forward's, the backward's; CUDA's
    ``getCurrentCUDABlasHandle`` makes the workspace inside that op, once its output exists). Profiles traced
    before ``blas_first`` existed keep ``fallback``: layer 0's forward start, ``_backward_workspace_at``'s place."""
    found = events.get("blas_first") or [None, None]
    ident = _Layout(events, segments).ident if any(o is not None for o in found) else {}
    stride = namer.stride
    ident_of_key = {key: pair // stride for pair, key in namer.keys.items()}
    at = list(fallback)
    for thread, o in enumerate(found):
        number = namer.ident_ids.get(ident.get(o)) if o is not None else None
        if number is None:
            continue
        index = next((i for i, (kind, key, _) in enumerate(first_ops)
                      if kind == ALLOC and ident_of_key.get(key) == number), None)
        if index is not None:
            at[thread] = index + 1
    return at[0], at[1]


def check_step(ops: list, previous_alive: set[int] = frozenset()) -> set[int]:
    """Every free must find its tensor alive, every allocation a fresh key. Returns the keys still alive at
    the end of the step."""
    state = bytearray(1 + max(map(itemgetter(1), ops), default=0))  # 0 unseen, 1 alive, 2 freed
    for kind, key, _poly in ops:
        if kind == ALLOC or kind > _ON_STREAM:
            if state[key]:
                raise ExpansionError(f"events: tensor {key} allocated twice in one step")
            state[key] = 1
        elif kind == FREE:
            if state[key] != 1:
                raise ExpansionError(f"events: tensor {key} freed while not alive")
            state[key] = 2
        elif key not in previous_alive:
            raise ExpansionError(f"events: the previous step's tensor {key} is not alive")
    return {key for key, alive in enumerate(state) if alive == 1}


def step_sizes(polys: list[list[float]], b: int, s: int) -> list[int]:
    """Requested bytes of each size polynomial at (b, s)."""
    out = []
    for c0, c1, c2, c3, c4, c5 in polys:
        out.append(int(round(c0 + s * (c1 + c2 * s) + b * (c3 + s * (c4 + c5 * s)))))
    return out


def first_mismatch(ops: list, sizes: list[int], traced: list[tuple[bool, object, int]]) -> int | None:
    """Compare expanded ``ops`` (sizes by poly index) with a traced step, event by event: the same kind and
    bytes, and the same tensor freed (a one-to-one map between keys and traced identities, built as tensors
    are first seen). The index of the first difference, or None when they are the same."""
    key_of: dict = {}
    ident_of: dict = {}
    for i, ((kind, key, poly), (alloc, ident, nbytes)) in enumerate(zip(ops, traced)):
        if (kind == ALLOC) != alloc or sizes[poly] != nbytes:
            return i
        if key_of.setdefault(ident, key) != key or ident_of.setdefault(key, ident) != ident:
            return i
        if not alloc:  # a freed tensor's identity may come back as a new one
            del key_of[ident], ident_of[key]
    return None if len(ops) == len(traced) else min(len(ops), len(traced))
