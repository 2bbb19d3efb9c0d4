"""A profile's segment summaries from its step's events: the net change and the non-dominated peak candidates of
each segment (``_segment_summary``), the trainer loop's step as a manual loop runs it (``manual_loop_events``).
Pure Python (no torch): ``estimator.profiler.profile`` summarises a trace with it, and
``estimator.profiler.vocab`` re-summarises a profile whose vocabulary-sized tensors it re-sized."""

from __future__ import annotations

from fractions import Fraction

from estimator.methods.long_context import LIGER_MARK
from estimator.models.moe import is_experts_mark
from estimator.models.profiles import MONOMIALS

# Markers a technique leaves where the profile stops tracing it (``estimator.methods.long_context``).
TECHNIQUE_MARKS = (LIGER_MARK,)


def _segment_summary(events: list[tuple], coeffs: list[list[Fraction]], grads: list[str | None],
                     per_layer_at: frozenset[int] = frozenset()) -> dict:
    """Net change and non-dominated local maxima of (activation poly, grad bytes) over one segment.

    ``per_layer_at``: positions in ``events`` where an outer segment allocates or frees a tensor of the generic
    decoder layer that every layer has (a key/value cache the output object keeps, freed as the loop drops it):
    the trace did it for one generic layer; ``per_layer_act`` and ``candidates_per_layer`` say how much, so
    ``estimator.methods.timeline.at_depth`` adds it for every generic layer beyond.

    ``hooks`` (segments that produce gradients): the indices of the candidates that are a gradient's hook moment
    (``_hook_moments``). What a DeepSpeed ZeRO rank holds there differs from the moments around it (the new
    gradient and a pending oversized one, the partition buffer its flush allocates), so a hook moment is never
    dropped for a later moment with as much activation and as many gradient bytes (the fp32 part of the final
    RMSNorm's backward, after ``norm.weight``'s hook); ``_dominated`` says which moments may be."""
    act = [Fraction(0)] * 6
    per_layer = [Fraction(0)] * 6
    grad = Fraction(0)
    candidates: list[tuple[list[Fraction], Fraction, list[Fraction], bool]] = []
    marks: dict[str, tuple[list[float], float]] = {}
    hooks_at = _hook_moments(events, grads)
    for i, event in enumerate(events):
        kind = event[0]
        if kind == "m":
            # the state where a technique's untraced part starts, or where expert parallelism's path differs
            if event[1] in TECHNIQUE_MARKS or is_experts_mark(event[1]):
                marks[event[1]] = ([float(x) for x in act], float(grad))
            continue
        c = coeffs[event[1]]
        sign = 1 if kind == "a" else -1
        if grads[event[1]] is not None:
            grad += sign * c[0]
        else:
            act = [a + sign * x for a, x in zip(act, c)]
            if i in per_layer_at:
                per_layer = [a + sign * x for a, x in zip(per_layer, c)]
        nxt = events[i + 1][0] if i + 1 < len(events) else "end"
        if (kind == "a" and nxt != "a") or i in hooks_at:
            candidates.append((list(act), grad, list(per_layer), i in hooks_at))
    candidates.append((list(act), grad, list(per_layer), len(events) in hooks_at))
    kept, kept_per_layer, hooks = [], [], []
    interval = [0] * len(candidates)  # the hook moments before each candidate
    for k in range(1, len(candidates)):
        interval[k] = interval[k - 1] + candidates[k - 1][3]
    for k, (a_k, g_k, p_k, hook) in enumerate(candidates):
        if not _dominated(candidates, interval, k):
            if hook:
                hooks.append(len(kept))
            kept.append(([float(x) for x in a_k], float(g_k)))
            kept_per_layer.append([float(x) for x in p_k])
    summary = {"net_act": [float(x) for x in act], "net_grad": float(grad), "candidates": kept}
    if any(grads[e[1]] is not None for e in events if e[0] == "a"):
        summary["hooks"] = hooks
    if any(per_layer) or any(any(p) for p in kept_per_layer):
        summary["per_layer_act"] = [float(x) for x in per_layer]
        summary["candidates_per_layer"] = kept_per_layer
    return {**summary, "marks": marks} if marks else summary


def _hook_moments(events: list[tuple], grads: list[str | None]) -> set[int]:
    """Positions in ``events`` where a gradient's hook is counted. The engine runs the ``AccumulateGrad`` node (and
    DeepSpeed's hook) once the node that made the gradient has returned and released its inputs and saved tensors
    (``evaluate_function``: ``release_variables`` before the outputs are dispatched), before any other node. So
    the hook comes after the run of allocations that holds the gradient (the node's outputs) and the frees that
    follow it (the node's releases): an untied head's gradient is hooked once its node freed the vocabulary-sized
    logits gradient. Where one of those frees is of a tensor allocated in that run, a later node made or freed it
    (a node that releases nothing merges its run with the next node's: small-opt's fc2 ``AddmmBackward`` with the
    ReLU's backward); the hook is then counted at the end of the allocation run, an upper bound by the next
    node's allocations (DeepSeek-V2's and small-opt's real runs show both)."""
    moments: set[int] = set()
    run: set[int] = set()  # ordinals allocated in the current allocation run
    for i, event in enumerate(events):
        if event[0] != "a":
            continue
        run.add(event[1])
        nxt = events[i + 1][0] if i + 1 < len(events) else "end"
        if nxt != "a":
            if any(grads[ordinal] is not None for ordinal in run):
                moments.add(_after_releases(events, i, run))
            run = set()
    return moments


def _after_releases(events: list[tuple], end: int, run: set[int]) -> int:
    """The hook moment of a gradient whose allocation run ends at ``end`` (``_hook_moments``): the last of the
    frees that follow, or ``end`` itself when there are none or one frees a tensor of the run."""
    last = end
    for j in range(end + 1, len(events)):
        if events[j][0] != "f":
            break
        if events[j][1] in run:
            return end
        last = j
    return last


def _dominated(candidates: list[tuple[list, Fraction, list, bool]], interval: list[int], k: int) -> bool:
    """Whether candidate ``k`` can be dropped: another holds as much activation, as many gradient bytes and the
    same per-layer share, and stands for the same gradient state: it lies between the same two hook moments
    (``interval``: the hook moments before each), the later of which may be itself (it holds what ``k`` holds
    and the hooked gradient besides). A hook moment never is."""
    a_k, g_k, p_k, hook_k = candidates[k]
    if hook_k:
        return False
    return any(j != k and interval[j] == interval[k] and g_j >= g_k and all(x >= y for x, y in zip(a_j, a_k))
               and p_j == p_k and (a_j != a_k or g_j != g_k or j < k)
               for j, (a_j, g_j, p_j, _hook) in enumerate(candidates))



def _per_layer_events(events: list[tuple], layer_of: dict[int, int]) -> frozenset[int]:
    """Positions of an outer segment's events on the generic layer's tensors that every layer repeats: a run of
    them flanked by the first and the last layer's (``estimator.profiler.expand._repeated``, the same rule the
    event replay expands by); a generic tensor touched alone (the output of layer L - 2, kept as the last
    layer's input) exists once."""
    runs: list[tuple[int | None, list[int]]] = []
    for i, event in enumerate(events):
        if event[0] == "m":
            continue
        layer = layer_of.get(event[1])
        if runs and runs[-1][0] == layer:
            runs[-1][1].append(i)
        else:
            runs.append((layer, [i]))
    out: set[int] = set()
    for k, (layer, positions) in enumerate(runs):
        if layer == 1 and 0 < k < len(runs) - 1 and {runs[k - 1][0], runs[k + 1][0]} == {0, 2}:
            out.update(positions)
    return frozenset(out)


def _sum_polys(polys: list[list[Fraction]]) -> list[Fraction]:
    return [sum(column, Fraction(0)) for column in zip(*polys)] if polys else [Fraction(0)] * len(MONOMIALS)


def manual_loop_events(signature: list[tuple], coeffs: list, grads: list, held: tuple
                       ) -> tuple[list[tuple], list, list]:
    """The traced (trainer-loop) step as a manual loop runs it. The previous step's output object is alive from
    the window's start until the forward's result is bound to ``outputs``, where the trainer loop dropped its
    own; this step's stays bound to the end (frees of it removed, saved-for-backward ones included)."""
    ordinals = [k for k, _saved in held]
    if not ordinals:
        return signature, coeffs, grads
    previous = list(range(len(coeffs), len(coeffs) + len(ordinals)))
    coeffs = coeffs + [coeffs[k] for k in ordinals]
    grads = grads + [None] * len(ordinals)
    mine = set(ordinals)
    out: list[tuple] = [("a", k) for k in previous]
    for event in signature:
        if event == ("m", "backward"):  # the rebinding: after forward returned, before backward
            out.extend(("f", k) for k in previous)
        if event[0] in ("f", "f_pre") and event[1] in mine:
            continue
        out.append(event)
    return out, coeffs, grads


