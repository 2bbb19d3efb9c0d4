"""The compact event list of a profiled step, kept beside the segment summaries (profile regime key ``events``).

One steady-state step of the shrunken model, forward to ``zero_grad``, as storage allocations and frees by
ordinal (first appearance in the step), split at the layer markers into the segments of
``estimator.profiler.profile.SEGMENTS`` plus ``optimizer`` (``optimizer.step()`` and ``zero_grad``), and the
first step's optimizer step (``first_optimizer``: where Adam creates its states). Encoding, JSON-friendly:

* ``polys``: the distinct size polynomials (coefficients over ``MONOMIALS``); ``size``: each ordinal's index
  into ``polys``;
* ``segments``: name -> list of ints, ``o`` allocates ordinal ``o``, ``~o`` (``-o - 1``) frees it;
* ``grads``: the ordinals that are parameter gradients; ``layer_of``: ``[ordinal, layer]`` for storages that
  belong to a decoder layer's parameter (gradients, optimizer temporaries and states, fp32 master gradients);
* ``held``: ``[ordinal, saved]`` of the output object's storages besides the loss (what a manual loop keeps
  bound until the next forward).

``estimator.profiler.expand`` turns it into the full-depth request list.
"""

from __future__ import annotations

from fractions import Fraction

from estimator.models.profiles import MONOMIALS

EVENT_SEGMENTS = ("prefix", "fw_first", "fw", "fw_last", "mid_fw", "mid_bw", "bw_first", "bw", "bw_last",
                  "suffix", "optimizer")


def _code(event: tuple) -> int:
    return event[1] if event[0] == "a" else ~event[1]


def _number(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


def first_optimizer_events(window: list[tuple], timeline, grad_ordinal: dict[str, int], first_new: int
                           ) -> tuple[list[int], list[int], dict[int, int]]:
    """The first step's optimizer window in the steady step's ordinals: its gradients are the same parameters'
    (matched by name); every other storage (Adam's states, the step's temporaries) gets a new ordinal from
    ``first_new`` on. Returns (codes, sizes of the new ordinals, layer of the new ordinals that have one)."""
    ordinal: dict[int, int] = {}
    sizes: list[int] = []
    layers: dict[int, int] = {}
    codes: list[int] = []
    for event in window:
        if event[0] == "m":
            continue
        sid = event[1]
        if sid not in ordinal:
            name = timeline.grad_names.get(sid)
            if name is not None and name in grad_ordinal:
                ordinal[sid] = grad_ordinal[name]
            elif event[0] == "a":
                ordinal[sid] = first_new + len(sizes)
                sizes.append(timeline.sizes[sid])
                if sid in timeline.layer_of:
                    layers[ordinal[sid]] = timeline.layer_of[sid]
            else:
                raise RuntimeError("profile: the first optimizer step frees a storage it did not create and that "
                                   "is no gradient")
        codes.append(_code((event[0], ordinal[sid])))
    return codes, sizes, layers


def compact_events(signature: list[tuple], bounds: dict[str, tuple[int, int]], coeffs: list[list[Fraction]],
                   grads: list[str | None], layers: list[int | None], held: tuple,
                   first: tuple[list[int], list[int], dict[int, int]]) -> dict:
    """The regime's ``events`` entry. ``bounds``: the summary segments' (start, end) in ``signature`` (the whole
    step); ``optimizer`` runs from the end of ``suffix`` to the end of the step."""
    first_codes, first_sizes, first_layers = first
    all_coeffs = list(coeffs) + [[Fraction(size)] + [Fraction(0)] * (len(MONOMIALS) - 1) for size in first_sizes]
    polys: dict[tuple, int] = {}
    size = []
    for c in all_coeffs:
        key = tuple(c)
        size.append(polys.setdefault(key, len(polys)))
    spans = {**bounds, "optimizer": (bounds["suffix"][1], len(signature))}
    segments = {name: [_code(e) for e in signature[lo:hi] if e[0] != "m"] for name, (lo, hi) in spans.items()}
    layer_of = [[o, layer] for o, layer in enumerate(layers) if layer is not None]
    layer_of += [[o, layer] for o, layer in sorted(first_layers.items())]
    return {"polys": [[_number(x) for x in key] for key in polys], "size": size,
            "grads": [o for o, name in enumerate(grads) if name is not None],
            "layer_of": layer_of, "held": [[o, saved] for o, saved in held],
            "segments": segments, "first_optimizer": first_codes}
