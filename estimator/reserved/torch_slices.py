"""Torch 2.4's full-range slices in the causal-LM loss's backward (``TrainingSpec.full_range_slices``).

Python indexing applies a basic index one dimension at a time (``applySlicing``), and each slice that is not
elided is an autograd ``SliceBackward``, whose backward zero-fills a gradient of its input's size and copies the
incoming one into it. Torch 2.4's ``applySlice`` elides a slice only when its stop equals the dimension; a ``:``
passes INT64_MAX, so it is recorded (torch 2.11 and 2.13 elide any stop at or past the dimension, and the traced
profiles have no such node). The loss of transformers 4.x (``ForCausalLMLoss``; 4.45's Llama / Mistral forward)
shifts the logits with ``logits[..., :-1, :]``: under 2.4 the vocabulary dimension's ``:`` adds a node, and its
backward runs first: a b x (s-1) x V fp32 zero-fill, then the incoming gradient is freed, then the sequence
slice's b x s x V zero-fill, then the first is freed (``benchmarks/loss_slice_order.py`` records that order under
torch 2.4.1 / transformers 4.45.2). Where the traced order makes the sequence slice's gradient while the incoming
one still holds the largest free block, 2.4's order frees it first: at 32,001 vocabulary rows this is the
difference of one logits-sized segment (``benchmarks/fms_lora_loss_segments.py``).

In the event list the sequence slice's backward is an allocation of c x b x s bytes followed at once by the free
of a c x b x s - c x b storage (the shifted logits' gradient); the vocabulary slice's node is inserted there. The
head input's full slices (4.45's ``hidden_states[:, -num_logits_to_keep:, :]``, 4.48's ``slice_indices``) add
three b x s x hidden zero-fills after the head's backward matmul; they are not modelled (with them the fms
Mistral-7B rows' reserved peaks are the same, ``fms_lora_loss_segments.with_full_range_slices``).
"""

from __future__ import annotations

from estimator.models.profiles import MONOMIALS

_BS, _B = MONOMIALS.index("b*s"), MONOMIALS.index("b")
_SLICED: dict[int, tuple[dict, dict]] = {}


def _sequence_slice_gradient(full: list, shifted: list) -> bool:
    """``full`` is c x b x s and ``shifted`` c x b x s - c x b (c > 0), nothing else."""
    c = full[_BS]
    return (c > 0 and all(x == 0 for i, x in enumerate(full) if i != _BS)
            and shifted[_BS] == c and shifted[_B] == -c
            and all(x == 0 for i, x in enumerate(shifted) if i not in (_BS, _B)))


def with_full_range_slices(events: dict) -> dict:
    """``events`` with the vocabulary slice's ``SliceBackward`` before every sequence slice's: a new storage of
    the shifted gradient's size, allocated before that gradient's free and freed after the full-size zero-fill.
    Memoized on the events object (the expansion cache keys on it)."""
    hit = _SLICED.get(id(events))
    if hit is not None and hit[0] is events:
        return hit[1]
    polys, size = events["polys"], list(events["size"])
    segments = {}
    for name, codes in events["segments"].items():
        out, index = [], 0
        while index < len(codes):
            code = codes[index]
            after = codes[index + 1] if index + 1 < len(codes) else 0
            if code >= 0 and after < 0 and _sequence_slice_gradient(polys[size[code]], polys[size[~after]]):
                new = len(size)
                size.append(size[~after])
                out += [new, after, code, ~new]
                index += 2
                continue
            out.append(code)
            index += 1
        segments[name] = out
    sliced = {**events, "size": size, "segments": segments}
    if len(_SLICED) > 64:
        _SLICED.clear()
    _SLICED[id(events)] = (events, sliced)
    return sliced
