"""The long-context techniques a traced profile cannot hold by itself (pure arithmetic over segments).

* Liger's fused linear cross-entropy (``TrainingSpec.ce == "fused_linear"``): its chunk of the logits is
  ``liger_chunk_rows`` tokens, a power of two picked from the token count, the vocabulary and the hidden size, so
  its size is no polynomial in (b, s) and the profile cannot fit it. The profile is traced with the chunk loop
  left out and a marker where it starts (``LIGER_MARK``: the state with ``grad_input``, ``grad_weight``, the
  per-token losses and the target mask allocated); the loop's transient (the reused logits buffer, and under fp32
  weights Liger's fallback ``mm`` of the weight's size) is added here as one more peak candidate of that segment.
* ``ckpt_policy`` every-k:K: checkpointed and plain layers alternate, so each layer's segments come from the
  checkpointed or the plain profile (``mixed_layers``); the step is replayed layer by layer.
"""

from __future__ import annotations

LIGER_MARK = "liger_chunk_loop"
# Bytes per element of the hidden states (and Liger's logits buffer) and of the head's weight, by precision.
ACT_BYTES = {"fp32": 4, "bf16": 2, "mixed_bf16": 2, "mixed_fp16": 2}


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def liger_chunk_rows(tokens: int, vocab: int, hidden: int) -> int:
    """Liger's chunk (``fused_linear_cross_entropy_forward``, ``chunk_mem_const`` 1): the transient logits bounded
    by about tokens x hidden elements: ``inc_factor = cdiv(V, H)``, ``next_power_of_2(cdiv(BT, inc_factor))``,
    at most BT."""
    inc_factor = -(-vocab // hidden)
    return min(_next_power_of_2(-(-tokens // inc_factor)), tokens)


def liger_transient_bytes(precision: str, tokens: int, vocab: int, hidden: int, head_trains: bool = True) -> int:
    """What Liger's chunk loop holds above its start: the logits buffer ``(chunk, V)`` in the hidden states' dtype
    (CUDA's ``use_mm_out`` path: allocated once, reused by every chunk; the cross-entropy kernel writes the
    gradient over it in place and the two projections write into ``grad_input`` / ``grad_weight`` with ``out=``),
    plus, for an fp32 weight that trains, the fallback's ``mm(grad_logits.T, input)`` of the weight's size per
    chunk (the in-place ``addmm`` paths are for 16-bit accumulators and fp32 accumulators of 16-bit logits). A
    frozen head (LoRA: peft freezes every base weight) has no ``grad_weight``: Liger skips that projection."""
    elem = ACT_BYTES[precision]
    buffer = liger_chunk_rows(tokens, vocab, hidden) * vocab * elem
    return buffer + (vocab * hidden * 4 if elem == 4 and head_trains else 0)


def with_transient(segments: dict, mark: str, transient_bytes: float) -> dict:
    """The segments with one more candidate wherever ``mark`` was traced: the marked state plus the transient."""
    out = {}
    for name, seg in segments.items():
        marked = seg.get("marks", {}).get(mark) if isinstance(seg, dict) else None
        if marked is None:
            out[name] = seg
            continue
        act, grad = marked
        extra = ([act[0] + transient_bytes] + list(act[1:]), grad)
        out[name] = {**seg, "candidates": list(seg["candidates"]) + [extra]}
    return out


def head_shape(params: dict) -> tuple[int, int]:
    """(vocab, hidden) of the output projection, from the profile's parameter table (the head, or the embedding
    it is tied to; names as the traced model spells them, peft's ``base_model.model.`` prefix included)."""
    rows = params["non_layer"]
    for row in rows:
        if any(name.endswith("lm_head.weight") for name in (row["name"], *row.get("tied", ()))):
            return int(row["shape"][0]), int(row["shape"][1])
    raise ValueError("ce: the profile names no output projection (lm_head) to fuse with the loss")


# ------------------------------------------------------------------------------------------------ every-k layers

LAYER_SEGMENTS = {"fw_first": 0, "fw": None, "fw_last": -1, "bw_first": -1, "bw": None, "bw_last": 0}
CKPT = "+ckpt"  # the suffix of a checkpointed layer's segment in a mixed set


def checkpointed(num_layers: int, every: int) -> list[bool]:
    """every-k:K checkpoints layers K-1, 2K-1, ... (torchtitan's and torchtune's count starts at the first
    layer; ``estimator.profiler.techniques.checkpointed_layers`` applies the same rule)."""
    return [(i + 1) % every == 0 for i in range(num_layers)]


def _shifted(seg: dict, poly: list[float], sign: float) -> dict:
    """A segment holding ``sign * poly`` more at every moment (its net and each candidate)."""
    def add(coeffs: list[float]) -> list[float]:
        return [a + sign * x for a, x in zip(coeffs, poly)]
    return {**seg, "net_act": add(seg["net_act"]), "candidates": [(add(a), g) for a, g in seg["candidates"]]}


def mixed_layers(plain: dict, ckpt: dict, num_layers: int, every: int, first_layer: int = 0) -> dict:
    """One segment set replaying every-k: each decoder layer's forward and backward from the profile of its kind
    (``sequence``: (segment, repetitions) in step order, for ``estimator.methods.timeline.replay``). A generic
    layer frees its own input in its segment when it is not checkpointed and keeps it when it is, so the layers
    compose; what does not is read off the two profiles' differences:

    * what the first and the last layer's forward segments keep that a generic one frees (``fw_first`` /
      ``fw_last`` less ``fw``: the embedding output a model keeps bound, the last layer's input freed after its
      hook) goes at the forward's end (``mid_fw``) as the profile of that layer's kind frees it there;
    * the rest of the two middles' difference is what every layer's call shares (rotary tables, position ids,
      the attention mask: keyword arguments a checkpoint keeps alive): kept from the forward's end to the backward
      of the lowest checkpointed layer (K-1), where the checkpointed profile lets it go only at the first layer.

    ``first_layer``: the model's layers before it are in both profiles' prefix and suffix (``frozen_layers``:
    layers before the first adapter), so ``num_layers`` are the layers after them, each checkpointed or not by its
    index in the model; those first layers are the plain profile's (every-k leaves them unchecked).

    Checked against both oracles on two families (docs/error_matrix/README.md)."""
    if num_layers < 2:
        raise ValueError("ckpt_policy: every-k needs at least 2 decoder layers")
    every_layer = checkpointed(first_layer + num_layers, every)
    if all(every_layer):
        return dict(ckpt)
    if any(every_layer[:first_layer]):
        raise ValueError(f"ckpt_policy: every-k:{every} checkpoints one of the first {first_layer} decoder layers, "
                         "which have no adapter (LoRA on the experts past dense layers): not modelled; use full "
                         "checkpointing (no --ckpt-policy) or a K above that count")
    kinds = every_layer[first_layer:]
    if not any(kinds):
        return dict(plain)

    def kept(profile: dict, end: str) -> list[float]:
        return [a - b for a, b in zip(profile[end]["net_act"], profile["fw"]["net_act"])]

    first = [n - c for n, c in zip(kept(plain, "fw_first"), kept(ckpt, "fw_first"))]
    last = [n - c for n, c in zip(kept(plain, "fw_last"), kept(ckpt, "fw_last"))]
    shared = [c - p - f - la for c, p, f, la in zip(ckpt["mid_fw"]["net_act"], plain["mid_fw"]["net_act"], first,
                                                  last)]
    out = dict(plain)
    out.update({name + CKPT: ckpt[name] for name in LAYER_SEGMENTS})
    # the checkpointed profile's middle, less what a plain first and a plain last layer leave to it to free
    out["mid_fw"] = _shifted(ckpt["mid_fw"], [(0.0 if kinds[0] else f) + (0.0 if kinds[-1] else la)
                                              for f, la in zip(first, last)], -1.0)
    out["release"] = {"net_act": [-x for x in shared], "net_grad": 0.0, "candidates": []}

    def layer(name: str, i: int) -> list[tuple[str, int]]:
        step = [(name + CKPT if kinds[i] else name, 1)]
        if name.startswith("bw") and i == kinds.index(True):  # the lowest checkpointed layer's backward ends
            step.append(("release", 1))
        return step

    forward = layer("fw_first", 0) + [s for i in range(1, num_layers - 1) for s in layer("fw", i)] \
        + layer("fw_last", num_layers - 1)
    backward = layer("bw_first", num_layers - 1) \
        + [s for i in range(num_layers - 2, 0, -1) for s in layer("bw", i)] + layer("bw_last", 0)
    out["sequence"] = [("prefix", 1)] + forward + [("mid_fw", 1), ("mid_bw", 1)] + backward + [("suffix", 1)]
    return out


def technique_name(training) -> str:
    """The label of the long-context techniques a training spec runs, "" for none ("chunked cross-entropy (8 chunks)
    + activation offload + ckpt every-k:2"): the estimate's header and the plan say it the same way."""
    parts = []
    if training.ce == "chunked":
        parts.append(f"chunked cross-entropy ({training.ce_chunks} chunks)")
    elif training.ce == "fused_linear":
        parts.append("Liger's fused linear cross-entropy")
    if training.activation_offload:
        parts.append("activation offload")
    if training.ckpt_policy:
        parts.append(f"ckpt {training.ckpt_policy}")
    return " + ".join(parts)
