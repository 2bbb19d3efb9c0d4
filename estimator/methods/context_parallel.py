"""Context parallelism: torch's ring attention (``torch.distributed.tensor.experimental.context_parallel``, torch
2.13) on each of ``cp`` ranks, under FSDP2 over all dp x cp ranks (torchtitan's ``dp_shard_cp`` mesh).

What a rank holds, read off torch's source (``_context_parallel/_attention.py``):

* ``context_parallel(mesh, buffers=[input_ids, labels, position_ids], buffer_seq_dims=[1, 1, 1])`` reorders the
  sequence with the head-tail load balancer (``seq_len % (2 cp) == 0``: rank r keeps chunks r and 2cp-1-r of
  2cp) and shards it: every activation outside attention is the single-rank one at ``seq_len / cp`` tokens.
* ``F.scaled_dot_product_attention`` is patched to wrap q, k, v as sequence-sharded DTensors; the DTensor handler
  runs ``_templated_ring_attention`` below autograd, so autograd saves what a flash call at ``seq_len / cp`` saves
  (q, k, v, the merged output, the fp32 logsumexp). The op's own transients are not in a single-rank trace:
  ``ring_forward_extra`` / ``ring_backward_extra`` replay them, allocation by allocation, for the default rotate
  method (``allgather``: one all-gather of every rank's k|v per call, ``cat`` of k|v at every step; backward's
  dk|dv rotate all-to-all in fp32), the fp32 merge of the per-step outputs (``_SDPAMerger``), and the round-robin
  steps (step 0 whole; step i <= rank: the first half of the received k/v; step i > rank: the second half of q,
  merged into half the state by ``_partial_update``'s ``cat``).
* Only the flash, memory-efficient and cuDNN kernels are dispatched (``_sdpa_handler``); the CPU's
  ``_scaled_dot_product_flash_attention_for_cpu`` has no handler nor DTensor sharding rule, so CP does not run on
  CPU tensors ("does not have a sharding strategy registered"). This module models the flash kernel (16-bit
  attention; cuDNN saves the same bytes).

Parameters, gradients and optimizer states are FSDP2's over ``world_size`` ranks (dp x cp), as without cp.

cp x tp (method dp_tp, torchtitan's (dp_shard, cp, tp) mesh, TP innermost): the rank is the TP rank's profile at
``seq_len / cp`` tokens (its ``heads / tp`` query and ``kv_heads / tp`` key/value heads; what TP replicates, the
embeddings, norms and full logits, whole at the local length), the ring replayed with that head split, FSDP2 over
the ``world_size / tp`` dp x cp ranks of each TP position (``Ring.tp``, ``cp_rank``).
"""

from __future__ import annotations

from dataclasses import dataclass

from estimator.methods.timeline import event_walk, poly
from estimator.models.memo import memo_by_owner

FP32 = 4


def local_seq_len(seq_len: int, cp: int) -> int:
    """Tokens per rank: two of the 2 cp head-tail chunks."""
    return seq_len // cp


def rank_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2 cp) of the sequence rank ``rank`` keeps (``_HeadTailLoadBalancer``)."""
    return rank, 2 * cp - 1 - rank


@dataclass(frozen=True)
class AttentionShape:
    """One rank's attention call: elements of q (b, h, S, d) and of k = v (b, h_kv, S, d), of the logsumexp
    (b, h, S), S the local sequence; ``act_bytes`` the 16-bit element size; ``kv_strided``: k and v reach the op
    non-contiguous (transposed projections), so the ring's ``.contiguous()`` copies them."""

    q: int
    kv: int
    lse: int
    act_bytes: int = 2
    kv_strided: bool = True


def attention_shape(b: int, s_local: int, heads: int, kv_heads: int, head_dim: int, act_bytes: int = 2
                    ) -> AttentionShape:
    return AttentionShape(q=b * heads * s_local * head_dim, kv=b * kv_heads * s_local * head_dim,
                          lse=b * heads * s_local, act_bytes=act_bytes)


class _Ring:
    """Python's reference counting over the op's own buffers: ``bind`` points a variable at a buffer (a view binds
    to its base), and a buffer no variable, list or pending collective holds is freed at once, as the caching
    allocator sees the free. ``peak`` is the running maximum of the live bytes."""

    def __init__(self) -> None:
        self.size: dict[str, float] = {}
        self.refs: dict[str, int] = {}
        self.vars: dict[str, str] = {}
        self.peak = 0.0
        self._n = 0

    @property
    def now(self) -> float:
        return sum(self.size.values())

    def new(self, nbytes: float) -> str:
        self._n += 1
        name = f"b{self._n}"
        self.size[name], self.refs[name] = nbytes, 0
        self.peak = max(self.peak, self.now)
        return name

    def hold(self, buf: str | None) -> None:
        if buf in self.refs:
            self.refs[buf] += 1

    def drop(self, buf: str | None) -> None:
        if buf in self.refs:
            self.refs[buf] -= 1
            if self.refs[buf] <= 0:
                del self.refs[buf], self.size[buf]

    def bind(self, var: str, buf: str | None) -> None:
        self.hold(buf)
        self.drop(self.vars.get(var))
        self.vars[var] = buf  # type: ignore[assignment]

    def temp(self, nbytes: float) -> str:
        """A buffer bound to nothing yet (freed by ``drop`` unless bound)."""
        buf = self.new(nbytes)
        self.refs[buf] = 1
        return buf

    def assign(self, var: str, buf: str) -> None:
        """``var = <a new temporary>``: the temporary's own reference passes to the variable."""
        self.bind(var, buf)
        self.drop(buf)



def ring_forward_extra(shape: AttentionShape, rank: int, cp: int, held_until_wait: bool = True
                       ) -> tuple[float, float]:
    """(peak bytes the ring's forward holds above its inputs, bytes of the outputs it returns), statement by
    statement of ``_templated_ring_attention`` with the all-gather rotater and load balancing.
    ``held_until_wait``: a functional collective's input stays alive until its ``wait_tensor`` (eager on the
    GPU: the work stashes its tensors until waited, one ring step later); False: it goes at once (a trace on
    fake tensors waits immediately)."""
    e, q, kv, lse = shape.act_bytes, shape.q, shape.kv, shape.lse
    m = _Ring()
    if shape.kv_strided:
        m.assign("key", m.temp(kv * e))
        m.assign("value", m.temp(kv * e))
    gathered = held = None
    for i in range(cp):
        if i > 0:
            if held:
                m.drop(held)  # wait: the work lets its input go
                held = None
            m.bind("key", gathered)
            m.bind("value", gathered)
        if i < cp - 1:
            m.assign("next_kv", m.temp(2 * kv * e))
            if gathered is None:
                if held_until_wait:
                    held = m.vars["next_kv"]
                    m.hold(held)
                gathered = m.temp(cp * 2 * kv * e)
                m.assign("rotater", gathered)
            m.bind("next_kv", None)  # exchange_buffers returns None
        partial = i > rank  # (i > rank implies i > 0)
        m.bind("k", m.vars.get("key"))  # ``q, k, v, partial = ...``: the previous step's k, v go only now
        m.bind("v", m.vars.get("value"))
        out_n, lse_n = (q // 2, lse // 2) if partial else (q, lse)
        out_i, lse_i = m.temp(out_n * e), m.temp(lse_n * FP32)
        m.assign("out", out_i)
        m.assign("logsumexp", lse_i)
        block_out = m.temp(out_n * FP32)  # _SDPAMerger.step: out.to(float32); the lse is fp32 already
        if i == 0:
            m.bind("state_lse", lse_i)
            m.assign("state_out", block_out)
            continue
        t1 = m.temp(lse_n * FP32)
        t2 = m.temp(lse_n * FP32)
        m.drop(t1)
        t3 = m.temp(out_n * FP32)
        t4 = m.temp(out_n * FP32)
        m.drop(t2)
        m.drop(t3)
        new_out = m.temp(out_n * FP32)
        m.drop(t4)
        u1 = m.temp(lse_n * FP32)
        u2 = m.temp(lse_n * FP32)
        m.drop(u1)
        new_lse = m.temp(lse_n * FP32)
        m.drop(u2)
        if partial:  # _partial_update: cat of the kept half and the new one, a whole new state
            m.assign("state_lse", m.temp(lse * FP32))
            m.assign("state_out", m.temp(q * FP32))
            m.drop(new_lse)
            m.drop(new_out)
        else:
            m.assign("state_lse", new_lse)
            m.assign("state_out", new_out)
        m.drop(block_out)
    result = m.temp(q * e)  # results(): the merged output in the input dtype; the fp32 lse returned as it is
    m.bind("result_lse", m.vars["state_lse"])
    m.assign("result", result)
    for var in [v for v in m.vars if not v.startswith("result")]:
        m.bind(var, None)
    if held:
        m.drop(held)
    return m.peak, m.now


def ring_backward_extra(shape: AttentionShape, rank: int, cp: int, held_until_wait: bool = True
                        ) -> tuple[float, float]:
    """(peak bytes the ring's backward holds above its inputs, bytes of the gradients it returns), statement by
    statement of ``_templated_ring_attention_backward``: fp32 accumulators, k|v all-gathered once, dk|dv rotated
    all-to-all in fp32."""
    e, q, kv, lse = shape.act_bytes, shape.q, shape.kv, shape.lse
    m = _Ring()
    m.assign("grad_query", m.temp(q * FP32))
    m.assign("grad_key", m.temp(kv * FP32))  # zeros_like keeps the key's strides: a strided accumulator
    m.assign("grad_value", m.temp(kv * FP32))
    if shape.kv_strided:
        m.assign("key", m.temp(kv * e))
        m.assign("value", m.temp(kv * e))
    gathered = held_kv = held_dkv = None
    for i in range(cp):
        if i > 0:
            if held_kv:
                m.drop(held_kv)
                held_kv = None
            m.bind("key", gathered)
            m.bind("value", gathered)
        if i != cp - 1:
            m.assign("next_kv", m.temp(2 * kv * e))
            if gathered is None:
                if held_until_wait:
                    held_kv = m.vars["next_kv"]
                    m.hold(held_kv)
                gathered = m.temp(cp * 2 * kv * e)
                m.assign("kv_rotater", gathered)
        partial_q = i > rank  # (i > rank implies i > 0)
        half_kv = 0 < i <= rank
        if partial_q:
            lse_c = m.temp(lse // 2 * FP32)  # logsumexp.chunk(2)[1].contiguous()
            m.assign("lse", lse_c)
        else:
            m.bind("lse", None)
        m.bind("k", m.vars.get("key"))
        m.bind("v", m.vars.get("value"))
        dq, dkv = (q // 2 if partial_q else q), (kv // 2 if half_kv else kv)
        grads = m.temp(dq * e), m.temp(dkv * e), m.temp(dkv * e)  # the op returns all three, then they rebind
        for var, buf in zip(("grad_query_", "grad_key_", "grad_value_"), grads):
            m.assign(var, buf)
        if i > 0:
            if held_dkv:
                m.drop(held_dkv)
                held_dkv = None
            m.bind("next_grad_kv", m.vars["dkv_rotater"])
            m.bind("grad_key", m.vars["dkv_rotater"])
            m.bind("grad_value", m.vars["dkv_rotater"])
            if i <= rank:  # _partial_update(add=True): in place on the received view, then a whole new cat
                m.assign("grad_key", m.temp(kv * FP32))
                m.assign("grad_value", m.temp(kv * FP32))
        flat = []
        if i == 0 and shape.kv_strided:  # flatten() of the strided fp32 accumulators copies them
            flat = [m.temp(kv * FP32), m.temp(kv * FP32)]
        send = m.temp(2 * kv * FP32)
        for buf in flat:
            m.drop(buf)
        m.assign("next_grad_kv", send)
        if held_until_wait:
            held_dkv = send
            m.hold(send)
        m.assign("dkv_rotater", m.temp(2 * kv * FP32))
        if partial_q:  # _partial_update of grad_query: a whole new fp32 accumulator
            m.assign("grad_query", m.temp(q * FP32))
    m.assign("grad_query", m.temp(q * e))  # .to(query.dtype)
    if held_dkv:
        m.drop(held_dkv)
    m.assign("next_grad_kv", m.temp(2 * kv * e))  # dkv_rotater.next_buffer().to(key.dtype)
    m.bind("grad_key", m.vars["next_grad_kv"])
    m.bind("grad_value", m.vars["next_grad_kv"])
    for var in [v for v in m.vars if v not in ("grad_query", "grad_key", "grad_value")]:
        m.bind(var, None)
    return m.peak, m.now


# ------------------------------------------------------------------------------------------- placing the ring op

# The flash kernel's philox seed and offset, as its meta kernel allocates them (16 and 8 B): the bound that tells them
# from any activation.
PHILOX_MAX_BYTES = 64
LAYER_SEGMENTS = ("fw_first", "fw", "fw_last", "bw_first", "bw", "bw_last")


def _attention_moments(codes: list[int], events: dict, shape: AttentionShape, b: int, s: int
                       ) -> list[tuple[int, str]]:
    """Where a traced generic layer segment calls flash attention: (index of the call's first allocation in
    ``codes``, "forward" | "backward"). A flash forward allocates its output (b, s, h d) in the
    activation dtype, then its fp32 logsumexp (b, h, s); a flash backward allocates dq (b, s, h d), then dk and dv
    (b, s, h_kv d). Sizes are compared at this (b, s): the profile's polynomials are exact there."""

    polys, size = events["polys"], events["size"]
    e = shape.act_bytes
    out_b, lse_b, kv_b = shape.q * e, shape.lse * FP32, shape.kv * e
    made = [poly(polys[size[code]], b, s) if code >= 0 else None for code in codes]  # allocation bytes

    def _frees_lse(j: int) -> bool:
        """The node then releases what it saved, the fp32 logsumexp among it (the q/k/v projections of a forward
        allocate alike but free no logsumexp)."""
        while j < len(codes) and codes[j] < 0:
            if polys_bytes(codes[j]) == lse_b:
                return True
            j += 1
        return False

    def polys_bytes(code: int) -> float:
        return poly(polys[size[~code if code < 0 else code]], b, s)

    def _then_philox(j: int) -> bool:
        """The call's philox seed and offset follow its logsumexp (a few bytes each on the meta kernel)."""
        return j < len(codes) and made[j] is not None and made[j] < PHILOX_MAX_BYTES

    forwards = [i for i in range(len(codes) - 2) if made[i] == out_b and made[i + 1] == lse_b]
    if len(forwards) > 1 and any(_then_philox(i + 2) for i in forwards):
        # an allocation pair of the same sizes elsewhere in the layer (LoRA's fp32 cast of a (b, s, hidden / 2)
        # input, then its (b, s, r) fp32 lora_A output with r = heads): the philox pair tells the flash call
        forwards = [i for i in forwards if _then_philox(i + 2)]
    moments = []
    for i in range(len(codes) - 2):
        if i in forwards:
            moments.append((i, "forward"))
        elif made[i] == out_b and made[i + 1] == kv_b and made[i + 2] == kv_b and _frees_lse(i + 3):
            moments.append((i, "backward"))
    return moments


def output_copied(rank: int, cp: int) -> bool:
    """Whether this cp rank's merged output comes back (b, h, s, d)-contiguous: its last ring step is a half step
    (``i = cp - 1 > rank``), whose ``_partial_update`` ``cat`` lays the state out in that order, while flash (and
    an unmerged state, which keeps flash's strides) leaves it (b, s, h, d) in memory. The model's
    ``attn_output.transpose(1, 2).contiguous()`` (transformers' ``sdpa_attention_forward``, torchtitan alike) then
    copies it, and the output projection saves the copy for backward: one more attention output per layer."""
    return rank < cp - 1


# The attention's output projection, by family (Llama/Qwen/Mistral, OPT/BART, Phi, GPT-2), under a module whose
# name says attention.
OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "dense", "c_proj")


def output_projection_saves_input(params: list, precision: str, lora_dropout: float) -> bool:
    """Whether the output projection keeps the tensor it reads (the attention output ``output_copied`` copies)
    for backward, judged from the parameter table (``ParamInfo``: name, trainable, element bytes). A trainable
    weight saves it (its gradient needs it). Under LoRA the frozen base weight saves nothing (``mm`` keeps its
    input only for the weight's gradient); peft's adapter reads ``_cast_input_dtype(x, lora_A.weight.dtype)``
    then ``lora_dropout(x)``: ``lora_A`` saves the copy itself only when the cast is a no-op (adapters computed
    in the 16-bit activation dtype: FSDP2's mixed-precision ``param_dtype``, or 16-bit adapters) and there is no
    dropout; fp32 adapters on a 16-bit model save their fp32 cast, and the copy goes after the projection."""
    adapters = []
    for param in params:
        parts = param.name.split(".")
        at = [i for i, part in enumerate(parts) if part in OUTPUT_PROJECTIONS and i and "att" in parts[i - 1]]
        if not at or not param.trainable:
            continue
        tail = parts[at[0] + 1:]
        if tail == ["weight"]:
            return True
        if tail[:1] == ["lora_A"]:
            adapters.append(param)
    compute_bytes = [2 if precision.startswith("mixed_") else p.elem_bytes for p in adapters]
    return not lora_dropout and any(nbytes == 2 for nbytes in compute_bytes)


def _layer_segment(codes: list[int], events: dict, at: dict[int, str], extra: dict[str, float], copy_bytes: float,
                   *, copy_live: bool, copy_in_net: bool) -> dict:
    """A generic layer segment re-walked from its events (``_segment_summary``'s rule: a candidate after every
    run of allocations), with the ring's transient at each flash call (the state before the call plus the ring's
    peak above its inputs) and the output copy (``copy_bytes``, ``output_copied``) from the forward call's end
    until the backward call (the output projection's backward, just before it, releases it). ``copy_live``: the
    segment starts with its layer's copy saved (a backward segment without checkpointing); ``copy_in_net``: a
    copy made here stays in the segment's net change (a forward segment without checkpointing)."""
    act = [0.0] * 6
    grad = 0.0
    shift = 0.0  # the copy, relative to the segment's start

    def state(plus: float = 0.0) -> list[float]:
        return [act[0] + shift + plus] + act[1:]

    candidates: list[tuple[list[float], float]] = []
    for i, is_grad, signed, run_ends in event_walk(codes, events):
        kind = at.get(i)
        if kind == "backward" and copy_live:
            shift -= copy_bytes
            copy_live = False
        if kind:
            candidates.append((state(extra[kind]), grad))
        if is_grad:
            grad += signed[0]
        else:
            act = [a + x for a, x in zip(act, signed)]
        if at.get(i - 1) == "forward":  # this was the call's logsumexp: the output exists and is copied
            shift += copy_bytes
            copy_live = True
        if run_ends:
            candidates.append((state(), grad))
    candidates.append((state(), grad))
    net = state(-copy_bytes if copy_live and not copy_in_net else 0.0)
    return {"net_act": net, "net_grad": grad, "candidates": candidates}


def cp_segments(segments: dict, regime: dict, rank: int, cp: int, b: int, s_local: int, heads: int,
                kv_heads: int, head_dim: int, act_bytes: int, output_saved: bool = True) -> dict:
    """The segments of one cp rank (traced at ``s_local`` tokens): every decoder-layer segment re-walked from its
    events with the ring attention's transients at each flash call (forward, and backward with its checkpointed
    recomputation: the state before the call plus what the ring holds at its peak) and the output copy of
    ``output_copied`` when the output projection saves it (``output_saved``: ``output_projection_saves_input``).
    ValueError("cp: ...") when the trace shows no flash call (another kernel ran)."""
    names = tuple(name for name in LAYER_SEGMENTS if name in segments)
    key = (id(regime), names, rank, cp, b, s_local, heads, kv_heads, head_dim, act_bytes, output_saved)
    # a plan asks the same rank's segments at one (b, s) for its floor, prior and replayed estimates
    rewalked = memo_by_owner(_CP_LAYERS, key, regime, lambda: _cp_layer_segments(
        names, regime, rank, cp, b, s_local, heads, kv_heads, head_dim, act_bytes, output_saved))
    return {**segments, **rewalked}


_CP_LAYERS: dict[tuple, tuple] = {}


def _cp_layer_segments(names: tuple[str, ...], regime: dict, rank: int, cp: int, b: int, s_local: int, heads: int,
                       kv_heads: int, head_dim: int, act_bytes: int, output_saved: bool) -> dict:
    """``cp_segments``' re-walked layer segments (``names``: the layer segments the step has)."""
    events = regime.get("events")
    if not events:
        raise ValueError("cp: the profile has no event list to place the ring attention in (re-trace it)")
    shape = attention_shape(b, s_local, heads, kv_heads, head_dim, act_bytes)
    extra = {"forward": ring_forward_extra(shape, rank, cp)[0], "backward": ring_backward_extra(shape, rank, cp)[0]}
    copy_bytes = float(shape.q * shape.act_bytes) if output_saved and output_copied(rank, cp) else 0.0
    found = {name: _attention_moments(events["segments"][name], events, shape, b, s_local)
             for name in names if name in events["segments"]}
    if not any(found.values()):
        raise ValueError("cp: no flash attention call in the traced layers (ring attention runs over flash, "
                         "memory-efficient or cuDNN SDPA; use 16-bit sdpa attention)")
    recomputed = any(kind == "forward" for name in ("bw_first", "bw", "bw_last") for _, kind in found.get(name, ()))
    out = {}
    for name, moments in found.items():
        backward = name.startswith("bw")
        # checkpointed: the forward's copy is not saved (only the recomputation's is, until the backward call);
        # otherwise the forward keeps it until this layer's backward
        out[name] = _layer_segment(events["segments"][name], events, dict(moments), extra, copy_bytes,
                                   copy_live=backward and not recomputed, copy_in_net=not recomputed)
    return out


def cp_notes(cp: int, world_size: int, seq_len: int, tp: int = 1) -> list[str]:
    if cp == 1:
        return []
    heads = (f"; tp {tp} splits the heads: each rank's ring carries 1/{tp} of the heads' k|v, while what TP "
             f"replicates (embeddings, norms, the full logits) stays whole at {seq_len // cp} tokens" if tp > 1 else "")
    return [f"cp: torch's ring attention (context_parallel, all-gather rotation, head-tail load balancing) over "
            f"{cp} ranks: each rank's activations are those of {seq_len // cp} tokens, plus the ring's all-gathered "
            f"k|v, fp32 merge state and fp32 gradient accumulators at each attention call{heads}; parameters, "
            f"gradients and optimizer states FSDP2-sharded over all {world_size // tp} (dp x cp) ranks"
            f"{' of each TP position' if tp > 1 else ''}; reserved level: the prior (the allocator replay has no "
            f"ring events)"]


@dataclass(frozen=True)
class Ring:
    """One run's ring attention: the cp degree and one rank's attention call shape (per token): under tp the
    rank's own heads (``heads / tp``, ``kv_heads / tp``)."""

    cp: int
    heads: int
    kv_heads: int
    head_dim: int
    act_bytes: int = 2
    # whether the output projection keeps the attention output it reads (``output_projection_saves_input``)
    output_saved: bool = True
    tp: int = 1

    def cp_rank(self, rank: int) -> int:
        """torchtitan's mesh (dp_shard, cp, tp), TP innermost: the tp ranks of one cp position are consecutive,
        and one cp group is every tp-th rank of a block of cp x tp."""
        return rank // self.tp % self.cp

    def segments(self, segments: dict, regime: dict, rank: int, b: int, s_local: int) -> dict:
        return cp_segments(segments, regime, self.cp_rank(rank), self.cp, b, s_local, self.heads, self.kv_heads,
                           self.head_dim, self.act_bytes, self.output_saved)

    def reported_ranks(self, world_size: int) -> list[int]:
        """Global ranks of cp rank 0, a middle one and the last of the first cp group (they differ in the ring's
        half steps), and the last global rank."""
        return sorted({0, self.cp // 2 * self.tp, (self.cp - 1) * self.tp, world_size - 1})


def ring_of(cp: int, heads: int, kv_heads: int, head_dim: int, tp: int = 1) -> Ring | None:
    """The ring of a cp run; under tp each rank's attention runs its ``heads / tp`` query and ``kv_heads / tp``
    key/value heads (``check_tp`` requires both to divide)."""
    return Ring(cp, heads // tp, kv_heads // tp, head_dim, tp=tp) if cp > 1 else None
