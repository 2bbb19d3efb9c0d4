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


def liger_transient_bytes(precision: str, tokens: int, vocab: int, hidden: int) -> int:
    """What Liger's chunk loop holds above its start: the logits buffer ``(chunk, V)`` in the hidden states' dtype
    (CUDA's ``use_mm_out`` path: allocated once, reused by every chunk; the cross-entropy kernel writes the
    gradient over it in place and the two projections write into ``grad_input`` / ``grad_weight`` with ``out=``),
    plus, for an fp32 weight, the fallback's ``mm(grad_logits.T, input)`` of the weight's size per chunk (the
    in-place ``addmm`` paths are for 16-bit accumulators and fp32 accumulators of 16-bit logits)."""
    elem = ACT_BYTES[precision]
    buffer = liger_chunk_rows(tokens, vocab, hidden) * vocab * elem
    return buffer + (vocab * hidden * 4 if elem == 4 else 0)


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
    it is tied to)."""
    rows = params["non_layer"]
    for row in rows:
        if row["name"].endswith("lm_head.weight") or "lm_head.weight" in row.get("tied", ()):
            return int(row["shape"][0]), int(row["shape"][1])
    raise ValueError("ce: the profile names no output projection (lm_head) to fuse with the loss")


# ------------------------------------------------------------------------------------------------ every-k layers

LAYER_SEGMENTS = {"fw_first": 0, "fw": None, "fw_last": -1, "bw_first": -1, "bw": None, "bw_last": 0}
CKPT = "+ckpt"  # the suffix of a checkpointed layer's segment in a mixed set


def checkpointed(num_layers: int, every: int) -> list[bool]:
    """every-k:K checkpoints layers K-1, 2K-1, ... (torchtitan's and torchtune's count starts at the first
    layer; ``estimator.profiler.techniques.checkpointed_layers`` applies the same rule)."""
    return [(i + 1) % every == 0 for i in range(num_layers)]


def mixed_layers(plain: dict, ckpt: dict, num_layers: int, every: int) -> dict:
    """One segment set replaying every-k: the plain profile's prefix, middle and suffix, each decoder layer's
    forward and backward from the profile of its kind (``sequence``: (segment, repetitions) in step order, for
    ``estimator.methods.timeline.replay``). Each layer's segments hand its input and its gradient over to the
    next as both profiles do (the layer that consumes a tensor frees it), so they compose."""
    kinds = checkpointed(num_layers, every)
    out = dict(plain)
    out.update({name + CKPT: ckpt[name] for name in LAYER_SEGMENTS})
    if num_layers < 2:
        raise ValueError("ckpt_policy: every-k needs at least 2 decoder layers")

    def layer(name: str, i: int) -> tuple[str, int]:
        return (name + CKPT if kinds[i] else name, 1)

    forward = [layer("fw_first", 0)] + [layer("fw", i) for i in range(1, num_layers - 1)] \
        + [layer("fw_last", num_layers - 1)]
    backward = [layer("bw_first", num_layers - 1)] + [layer("bw", i) for i in range(num_layers - 2, 0, -1)] \
        + [layer("bw_last", 0)]
    out["sequence"] = [("prefix", 1)] + forward + [("mid_fw", 1), ("mid_bw", 1)] + backward + [("suffix", 1)]
    return out
