"""Replay a profiled training step for any depth, micro-batch and sequence length (pure arithmetic).

A profile's segments each carry their net change and their peak candidates: (activation polynomial in b and s,
parameter-gradient bytes allocated so far in the segment). Repeated per-layer segments are linear in the
repetition index, so only their first and last repetition can hold the maximum, except where the gradient policy
steps (a ZeRO-1/2 rank's gradient buffer appearing mid-stack): the repetitions around the step are evaluated too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

FORWARD_SEGMENTS = ("prefix", "fw_first", "fw", "fw_last", "mid_fw")

# Held gradient bytes given (gradients of finished segments, gradients allocated so far in this segment).
GradPolicy = Callable[[float, float], float]


def poly(coeffs: list[float], b: int, s: int) -> float:
    c0, c1, c2, c3, c4, c5 = coeffs
    return c0 + s * (c1 + c2 * s) + b * (c3 + s * (c4 + c5 * s))


def event_walk(codes: list[int], events: dict) -> Iterator[tuple[int, bool, list[float], bool]]:
    """A segment's event list walked in order (``codes``: tensor ``t``'s allocation is ``t``, its free ``~t``;
    ``events``: the profile's ``polys``, ``size`` and ``grads``): per event ``(index, whether the tensor is a
    parameter gradient, its polynomial signed (+ allocated, - freed), whether it ends a run of allocations)``.
    The end of a run (an allocation followed by a free, or the last event) is ``_segment_summary``'s candidate
    moment: the node that allocated the run has returned."""
    polys, size, grads = events["polys"], events["size"], set(events["grads"])
    for i, code in enumerate(codes):
        alloc = code >= 0
        tid = code if alloc else ~code
        sign = 1 if alloc else -1
        run_ends = alloc and (i + 1 == len(codes) or codes[i + 1] < 0)
        yield i, tid in grads, [sign * x for x in polys[size[tid]]], run_ends


def segment_sequence(num_layers: int) -> list[tuple[str, int]]:
    """(segment, repetitions) for a decoder of num_layers blocks, as profiled on three."""
    if num_layers == 1:  # first and last block are the same block: keep the outer two (approximation)
        return [("prefix", 1), ("fw_first", 1), ("mid_fw", 1), ("mid_bw", 1), ("bw_last", 1), ("suffix", 1)]
    middle = num_layers - 2
    return [("prefix", 1), ("fw_first", 1), ("fw", middle), ("fw_last", 1), ("mid_fw", 1), ("mid_bw", 1),
            ("bw_first", 1), ("bw", middle), ("bw_last", 1), ("suffix", 1)]


# The depth a profile's segments were traced at (``estimator.profiler.profile.PROFILE_LAYERS``).
PROFILED_LAYERS = 3


def at_depth(segments: dict, num_layers: int) -> dict:
    """The segments for a decoder of ``num_layers`` blocks. An outer segment that makes or frees one tensor per
    decoder layer (a key/value cache the output object keeps, freed as the loop drops it) did so for one generic
    layer in the traced step; its ``per_layer_act`` (and each candidate's share, ``candidates_per_layer``) is
    added for every generic layer beyond that one. Segments without them are returned as they are."""
    extra = max(num_layers - 2, 0) - (PROFILED_LAYERS - 2)
    if not extra or not any("per_layer_act" in seg for seg in segments.values()):
        return segments
    out = {}
    for name, seg in segments.items():
        if "per_layer_act" not in seg:
            out[name] = seg
            continue
        out[name] = {**seg, "net_act": [a + extra * p for a, p in zip(seg["net_act"], seg["per_layer_act"])],
                     "candidates": [([a + extra * p for a, p in zip(act, per)], grad) for (act, grad), per
                                    in zip(seg["candidates"], seg["candidates_per_layer"])]}
    return out


@dataclass(frozen=True)
class Replay:
    peak_bytes: float          # activations + held gradients at the peak, above the step's starting state
    peak_act_bytes: float
    peak_grad_bytes: float
    peak_segment: str
    end_act_bytes: float       # still alive when the optimizer step starts (loss, leftovers)
    end_grad_bytes: float      # all parameter gradients produced by backward
    peak_parts: dict[str, float] = field(default_factory=dict)  # method buffers at the peak, by component

    @property
    def phase(self) -> str:
        return "forward" if self.peak_segment.split("+")[0] in FORWARD_SEGMENTS else "backward"


def _full(prev: float, within: float) -> float:
    return prev + within


# Method bytes held during a segment besides activations and gradients (ZeRO-3's gathered parameters), given
# (segment, repetition index k); must be monotonic in k, as only the first and last repetition are evaluated.
ExtraBytes = Callable[[str, int], float]


def _repetitions(repeats: int, produced: float, net_grad: float, breakpoints: tuple[float, ...]) -> set[int]:
    """The repetitions of a repeated segment at which one of its candidates can peak. The candidate is linear in
    the repetition index except where the gradient policy steps (``breakpoints``: gradient bytes produced at which
    it does, e.g. when a ZeRO-2 rank's gradient buffer appears): the first and the last repetition, and the two
    around each step. ``produced``: the candidate's gradient bytes produced at the first repetition."""
    ks = {0, repeats - 1}
    if net_grad > 0:
        for point in breakpoints:
            j = math.ceil((point - produced) / net_grad)  # first repetition at or past the step
            ks.update(k for k in (j - 1, j) if 0 <= k < repeats)
    return ks


def replay(segments: dict, num_layers: int, b: int, s: int, grad_policy: GradPolicy = _full,
           extra_bytes: ExtraBytes | None = None, saved_per_token: ExtraBytes | None = None) -> Replay:
    """``grad_policy`` may carry ``breakpoints``: gradient bytes produced at which what it holds steps.
    ``saved_per_token``: activation bytes per token (b x s) the method saves on top of the profile's."""
    act = 0.0
    grad = 0.0
    best = (float("-inf"), 0.0, 0.0, "prefix", 0.0, 0.0)
    breakpoints = tuple(getattr(grad_policy, "breakpoints", ()))
    # a policy with ``since_previous`` also gets the gradient bytes of the segment's previous candidate: the
    # profile keeps only undominated candidates, so the gradients produced since then may each have arrived at a
    # moment it dropped (a ZeRO-2 rank's held gradients are not monotonic in the bytes produced)
    since_aware = bool(getattr(grad_policy, "since_previous", False))
    # one that is also ``hook_aware`` is told whether the candidate is a gradient's hook moment (True), another
    # moment (False), or not known (None: a profile traced before ``hooks`` were recorded)
    hook_aware = bool(getattr(grad_policy, "hook_aware", False))
    # a mixed set (estimator.methods.long_context.mixed_layers: every-k checkpointing) names its own order, one
    # instance of a layer segment at a time: ``extra_bytes`` gets its kind's generic name and its instance index
    instances: dict[str, int] = {}
    for name, repeats in segments.get("sequence") or segment_sequence(num_layers):
        if repeats == 0:
            continue
        kind = name.split("+")[0]
        first = instances.get(kind, 0)
        instances[kind] = first + repeats
        seg = segments[name]
        net_act = poly(seg["net_act"], b, s)
        net_grad = seg["net_grad"]
        ks: set[int] = set()
        for _, cand_grad in seg["candidates"]:
            ks |= _repetitions(repeats, grad + cand_grad, net_grad, breakpoints)
        for k in sorted(ks):
            base_act = act + k * net_act
            base_grad = grad + k * net_grad
            extra = extra_bytes(kind, first + k) if extra_bytes else 0.0
            saved = b * s * saved_per_token(kind, first + k) if saved_per_token else 0.0
            since = 0.0  # the previous candidate's gradient bytes in this segment (its start: none)
            hooks = set(seg["hooks"]) if "hooks" in seg else None
            for index, (cand_act, cand_grad) in enumerate(seg["candidates"]):
                a = base_act + poly(cand_act, b, s)
                if hook_aware:
                    g = grad_policy(base_grad, cand_grad, since, None if hooks is None else index in hooks)
                elif since_aware:
                    g = grad_policy(base_grad, cand_grad, since)
                else:
                    g = grad_policy(base_grad, cand_grad)
                since = cand_grad
                if a + g + extra + saved > best[0]:
                    best = (a + g + extra + saved, a, g, name, extra, saved)
        act += repeats * net_act
        grad += repeats * net_grad
    return Replay(peak_bytes=best[0], peak_act_bytes=best[1], peak_grad_bytes=best[2], peak_segment=best[3],
                  end_act_bytes=act, end_grad_bytes=grad,
                  peak_parts={**({"gathered_params": best[4]} if extra_bytes else {}),
                              **({"activations": best[5]} if saved_per_token else {})})


def replay_activation_peak(segments: dict, num_layers: int, b: int, s: int) -> int:
    """The activation peak of a profile's (traced-depth) segments at ``num_layers``."""
    return round(replay(at_depth(segments, num_layers), num_layers, b, s).peak_bytes)


def loop_segments(regime: dict, loop: str, num_layers: int) -> dict:
    """The regime's step as the training loop runs it (``TrainingSpec.loop``), at the model's depth. Decoder layers
    that run forward only (``frozen_layers``: LoRA on the routed experts past dense first layers) are in the
    prefix: the layer segments repeat for the others, in an explicit ``sequence``."""
    depth = replayed_depth(regime, num_layers)
    segments = at_depth(regime["segments_manual"] if loop == "manual" else regime["segments"], depth)
    if depth == num_layers or "sequence" in segments:  # every-k's mix has its own (``long_context.mixed_layers``)
        return segments
    return {**segments, "sequence": segment_sequence(depth)}


def replayed_depth(regime: dict, num_layers: int) -> int:
    """The decoder layers the regime's layer segments stand for: all but the forward-only first ones."""
    frozen = regime.get("frozen_layers", 0)
    if frozen and num_layers <= frozen:
        raise ValueError(f"lora_targets: no trainable parameter in any of the model's {num_layers} decoder layers")
    return num_layers - frozen
