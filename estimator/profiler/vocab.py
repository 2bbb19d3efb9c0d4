"""A profile for a resized vocabulary (``TrainingSpec.vocab_size``: ``model.resize_token_embeddings(N)``) from the
profile of the model as configured, without a trace: the model code whose profile it is (``model_code``) is kept,
which a trace of the resized config could only reproduce with that transformers release installed.

Every storage of the traced step whose size is proportional to the vocabulary (the embedding and an untied head,
their gradients and optimizer states, the logits, the shifted logits, their fp32 copies and gradients) has a size
polynomial whose every coefficient is a multiple of the configured vocabulary V; no other storage's is, as long as
no dimension of a decoder layer's parameters (times 1, 2, 4 or 8 bytes) is a multiple of V (checked: otherwise
``ValueError``). Those polynomials are re-scaled to the new row count, the parameter table's vocabulary rows with
them, and the segment summaries are worked out again from the re-sized events (``estimator.profiler.summary``, the
rule the trace used). A profile whose summaries cannot be re-derived from its events (technique or expert markers,
a carried-over summary that differs) is refused in one line. Pure Python."""

from __future__ import annotations

import itertools
import json
from fractions import Fraction

from estimator.models.profiles import SUMMARY_RULE
from estimator.profiler.summary import (
    _per_layer_events,
    _segment_summary,
    _sum_polys,
    manual_loop_events,
)

SUMMARY_SEGMENTS = ("prefix", "fw_first", "fw", "fw_last", "mid_fw", "mid_bw", "bw_first", "bw", "bw_last",
                    "suffix")
OUTER_SEGMENTS = ("prefix", "mid_fw", "mid_bw", "suffix")
ELEMENT_BYTES = (1, 2, 4, 8)


def resize_vocab(profile: dict, old_vocab: int, new_vocab: int) -> dict:
    """A copy of ``profile`` (traced with ``old_vocab`` rows) for ``new_vocab`` rows."""
    if new_vocab == old_vocab:
        return profile
    _check_separable(profile["params"], old_vocab)
    profile = json.loads(json.dumps(profile))  # as stored (a profile traced in this process holds tuples)
    resized = {**profile, "params": _resized_params(profile["params"], old_vocab, new_vocab),
               "regimes": [_resized_regime(r, old_vocab, new_vocab) for r in profile["regimes"]],
               "vocab_resized_from": old_vocab}
    return resized


def _check_separable(params: dict, vocab: int) -> None:
    """Refuse where a decoder layer's dimension could make a tensor's size a multiple of ``vocab`` too."""
    for row in params["per_layer"]:
        for dim in [*row["shape"], row["numel"]]:
            if any(dim * elem % vocab == 0 for elem in ELEMENT_BYTES):
                raise ValueError(f"vocab_size: the model's vocabulary ({vocab}) divides a size of its decoder layers "
                                 f"({row['name']}: {dim}), so its vocabulary-sized tensors cannot be told apart in "
                                 "the profile; resizing it is not modelled")


def _vocab_sized(poly: list, vocab: int) -> bool:
    return any(poly) and all(Fraction(x) % vocab == 0 for x in poly)


def _scaled(poly: list, old: int, new: int) -> list:
    return [int(Fraction(x) / old * new) for x in poly]


def _resized_params(params: dict, old: int, new: int) -> dict:
    rows = []
    for row in params["non_layer"]:
        if row["shape"] and row["shape"][0] == old:
            shape = [new, *row["shape"][1:]]
            row = {**row, "shape": shape, "numel": row["numel"] // old * new}
        rows.append(row)
    return {**params, "non_layer": rows}


def _resized_regime(regime: dict, old: int, new: int) -> dict:
    events = regime["events"]
    polys = [_scaled(p, old, new) if _vocab_sized(p, old) else p for p in events["polys"]]
    resized = {**regime, "events": {**events, "polys": polys}}
    found = summaries_from_events(regime)
    for name in ("segments", "segments_manual", "outputs_held", "outputs_held_16bit"):
        if name in regime and not _rederived(found[name], regime[name], name.startswith("segments")):
            raise ValueError(f"vocab_size: this profile's {name} cannot be re-derived from its events (a technique "
                             "or expert marker, or a carried-over summary); resizing its vocabulary is not modelled")
    sixteen = _sixteen_bit(regime) if "outputs_held_16bit" in regime else None
    resized.update({name: value for name, value in summaries_from_events(resized, sixteen).items()
                    if name in regime})
    return resized


def _rederived(found: dict, stored: dict, segments: bool) -> bool:
    """Whether the summaries worked out from the events are the stored ones: equal, or (a profile summarised
    before hook moments were kept or placed after the node's releases, ``summary._hook_moments``) the same but for
    the hook moments, which change no peak outside ZeRO: then the re-summary is what a trace today gives. A
    stored candidate that is not one of its hook moments is one the re-summary keeps too."""
    if found == stored or not segments:
        return found == stored
    for name, segment in stored.items():
        now = found.get(name, {})
        if segment == now:
            continue
        if {k: v for k, v in now.items() if k not in ("hooks", "candidates")} != \
                {k: v for k, v in segment.items() if k not in ("hooks", "candidates")}:
            return False
        hooks = set(segment.get("hooks", ()))
        if any(candidate not in now["candidates"] for k, candidate in enumerate(segment["candidates"])
               if k not in hooks):
            return False
    return set(found) == set(stored)


def with_hook_moments(profile: dict) -> dict:
    """``profile`` with its backward segments summarised again from its events where they were summarised by an
    older rule for gradients' hook moments (none kept: the shipped profiles; or placed before the node's
    releases), so that ZeRO's gradient hooks fall where ``summary._hook_moments`` places them today. A regime
    whose stored summaries the events do not give back (``_rederived``: a carried-over summary) is kept as it is.
    The profile itself is not changed."""
    regimes = []
    for regime in profile["regimes"]:
        found = summaries_from_events(regime) if "events" in regime and "segments" in regime else None
        if found is not None and all(_rederived(found[name], regime[name], True)
                                     for name in ("segments", "segments_manual") if name in regime):
            regime = {**regime, **{name: found[name] for name in ("segments", "segments_manual") if name in regime}}
        regimes.append(regime)
    return {**profile, "regimes": regimes}


def resummarised(profile: dict) -> dict:
    """``with_hook_moments(profile)`` marked as summarised by today's rule (``SUMMARY_RULE``, beside the schema),
    so that loading it skips the re-summary; every other field as stored. Idempotent."""
    out = {}
    for name, value in with_hook_moments(profile).items():
        if name != "summary_rule":
            out[name] = value
        if name == "schema_version":
            out["summary_rule"] = SUMMARY_RULE
    return out if "summary_rule" in out else {"summary_rule": SUMMARY_RULE, **out}


def _coeffs(events: dict) -> list[list[Fraction]]:
    """Each ordinal's size polynomial."""
    return [[Fraction(x) for x in events["polys"][k]] for k in events["size"]]


def summaries_from_events(regime: dict, sixteen: set[int] | None = None) -> dict:
    """``segments``, ``segments_manual``, ``outputs_held`` and ``outputs_held_16bit`` of ``regime`` worked out from
    its ``events`` as ``estimator.profiler.profile`` works them out from the trace. ``sixteen``: the held storages
    that are 16-bit (default: those whose sums are the regime's ``outputs_held_16bit``)."""
    events = regime["events"]
    coeffs = _coeffs(events)
    grads: list[str | None] = [None] * len(coeffs)
    for ordinal in events["grads"]:
        grads[ordinal] = "grad"
    segments = {name: [("a", c) if c >= 0 else ("f", ~c) for c in events["segments"][name]]
                for name in SUMMARY_SEGMENTS}
    held = [(k, saved) for k, saved in events["held"]]
    out = {"segments": _summaries(segments, coeffs, grads, {}),
           "segments_manual": _summaries(*_manual_segments(segments, coeffs, grads, held)),
           "outputs_held": _held_sums(coeffs, held, {k for k, _ in held})}
    if "outputs_held_16bit" in regime:
        out["outputs_held_16bit"] = _held_sums(coeffs, held, _sixteen_bit(regime) if sixteen is None else sixteen)
    return json.loads(json.dumps(out))  # as a profile stores them (lists, not tuples)


def _summaries(segments: dict, coeffs: list, grads: list, copies_of: dict[int, int]) -> dict:
    """``profile._summarise`` over segments already split."""
    layer_of: dict[int, int] = {}
    for name, layer in (("fw_first", 0), ("fw", 1), ("fw_last", 2)):
        layer_of.update((e[1], layer) for e in segments[name] if e[0] == "a")
    layer_of.update((copy, layer_of[original]) for copy, original in copies_of.items() if original in layer_of)
    return {name: _segment_summary(segments[name], coeffs, grads,
                                   _per_layer_events(segments[name], layer_of) if name in OUTER_SEGMENTS
                                   else frozenset())
            for name in SUMMARY_SEGMENTS}


def _manual_segments(segments: dict, coeffs: list, grads: list, held: list) -> tuple[dict, list, list, dict]:
    """``manual_loop_events`` over the split segments (each behind a boundary marker; the frees it adds at the
    ``backward`` marker, just before ``mid_bw``'s boundary, end ``mid_fw``)."""
    signature = []
    for name in SUMMARY_SEGMENTS:
        signature += ([("m", "backward")] if name == "mid_bw" else []) + [("m", ("segment", name))] + segments[name]
    manual, manual_coeffs, manual_grads = manual_loop_events(signature, coeffs, grads, tuple(held))
    out: dict[str, list] = {"prefix": []}
    current = out["prefix"]  # the previous step's outputs, allocated before the first boundary
    for event in manual:
        if event[0] == "m" and isinstance(event[1], tuple):
            current = out.setdefault(event[1][1], [])
        elif event[0] != "m":
            current.append(event)
    copies = {len(coeffs) + i: k for i, (k, _saved) in enumerate(held)}
    return out, manual_coeffs, manual_grads, copies


def _held_sums(coeffs: list, held: list, kept: set[int]) -> dict[str, list[float]]:
    return {kind: [float(x) for x in _sum_polys([coeffs[k] for k, saved in held if saved == want and k in kept])]
            for kind, want in (("dropped", False), ("saved", True))}


def _sixteen_bit(regime: dict) -> set[int]:
    """The held storages that are 16-bit: a subset whose sums are the regime's ``outputs_held_16bit``."""
    target = regime["outputs_held_16bit"]
    coeffs = _coeffs(regime["events"])
    held = [(k, saved) for k, saved in regime["events"]["held"]]
    ordinals = [k for k, _ in held]
    if len(ordinals) > 16:
        raise ValueError("vocab_size: the output object holds too many storages to tell its 16-bit ones; resizing "
                         "this profile's vocabulary is not modelled")
    matches = [set(subset) for r in range(len(ordinals) + 1) for subset in itertools.combinations(ordinals, r)
               if _held_sums(coeffs, held, set(subset)) == target]
    if not matches:
        raise ValueError("vocab_size: which of the output object's storages are 16-bit is not recoverable from this "
                         "profile; resizing its vocabulary is not modelled")
    return matches[0]  # several only where storages of one size stand for each other
