"""The memory of one pipeline rank (``estimator.methods.pipeline``): its stages' parameters, gradients and
optimizer states, and its schedule's actions replayed over the profile's segments.

What torch's ``PipelineStage`` holds besides the model's own tensors (torch 2.13 ``stage.py``), each counted here:
- a receive buffer per micro-batch for the stage's input activations (every stage but the first) and one for the
  gradient of its output (every stage but the last), allocated once and kept across steps;
- the gradient of each received input, which it sends back: held by its send work, which GPipe and the
  interleaved runtime wait for only when the schedule returns (1F1B: before its next forward);
- the stage output in ``fwd_cache`` until the micro-batch's backward (the last stage's: its logits, which the loss
  reads and the unsplit model's trainer loop would drop), then as long as the schedule's loop variable or a send
  work holds it;
- the step's whole batch of input ids, on every rank: the training loop makes (or loads) it on each pipeline rank,
  and a rank whose stages neither embed nor score holds it through the schedule as well (torchtitan moves the
  batch to the device on every rank; the harness's trainer and ``benchmarks/pipeline_table.py`` repeat it there);
- under 1F1B, the output of the warmup's last fired forward send (micro-batch w - 2 of w warmup forwards): the
  schedule waits its ``send_work`` list without dropping it and gloo's send work holds its tensor, so the output
  outlives its backward until the 1B1F loop ends (``warmup_send_kept``).
From a stage's second micro-batch on its backward accumulates into the gradients the first one left: autograd's
``AccumulateGrad`` adds each new gradient in place and drops it right after the node that made it returns, so only
that node's other outputs sit beside it (``accumulating_candidates``, from the profile's event list), not the
moments after it that the first backward's candidates record with the gradient kept.
FSDP2 over the dp ranks of a stage (method ``fsdp``): torch's stage turns off resharding and gradient reduction until
the last micro-batch's backward (``backward_maybe_with_nosync``, ``perform_reduce_grad``), and torchtitan shards
with ``reshard_after_forward=False`` under pp: from its first forward on, a stage's parameters stay unsharded, and
from its first backward on its gradients too, until the stage's reduce-scatter. The interleaved schedule runs torch's
multi-stage runtime, which adds FSDP actions of its own (``_add_unshard_reshard``, ``_add_reduce_grad``): before each
compute action the next ``MAX_ACTIVE_STAGES`` stages the rank computes are unsharded (the others resharded), and a
stage's gradients are reduce-scattered right after its last backward, not when the schedule ends. A stage's first
forward of the step gathers its parameters: under GPipe and 1F1B at each FSDP2 group's pre-forward, where a group's
all-gather output lives until the next group's copy-out (the last one's until the stage module's post-forward), so at
a layer's copy-out two outputs and the layer's new unsharded parameters sit on the activations so far (the peak of
1F1B's first rank under LoRA with checkpointing, where little else is held); the multi-stage runtime issues a stage's
all-gathers in its UNSHARD action and frees each output right after its copy-out (``_gathering_forward_lifts``).
FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (precision ``mixed_bf16``): fp32 shards are
the master weights (Adam steps them: no separate masters), the unsharded parameters are their 16-bit all-gathers, and
without gradient sync each parameter group's post-backward hook upcasts its fresh 16-bit gradients to fp32
accumulators (``FSDPParam.to_accumulated_grad_if_needed``), into which every later micro-batch's 16-bit gradients of
the group are added and dropped (``accumulate_unsharded_grad_if_needed``). The stage module's own group (embedding,
or final norm and head) runs its hook when the stage's backward ends (FSDP2's final callback).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from estimator.methods import state as methods
from estimator.methods.long_context import CKPT
from estimator.methods.pipeline import Action, rank_actions, stage_layers, stages_of_rank
from estimator.methods.timeline import event_walk, poly
from estimator.models.params import ParamInfo
from estimator.spec import RunSpec, ckpt_every

INT64 = 8
FP32 = 4
MAX_ACTIVE_STAGES = 3  # torch's _add_unshard_reshard: the stages the multi-stage runtime keeps unsharded
LAYER_SEGMENTS = ("fw_first", "fw", "fw_last", "bw_first", "bw", "bw_last")


@dataclass(frozen=True)
class PipelineRank:
    pp_rank: int
    stages: tuple[int, ...]
    parts: dict[str, float]      # components at the peak
    peak_bytes: float
    phase: str
    in_flight: int               # micro-batches whose backward had not run at the peak


def stage_params(table: list[ParamInfo], stage: int, num_stages: int, layers: range) -> list[ParamInfo]:
    """The parameters a stage holds: its decoder layers; the embedding on the first stage, every other non-layer
    tensor (final norm, LM head) on the last."""
    out = []
    for p in table:
        if p.layer is not None:
            if p.layer in layers:
                out.append(p)
        elif p.module_kind == "embedding":
            if stage == 0:
                out.append(p)
        elif stage == num_stages - 1:
            out.append(p)
    return out


EMBEDDING_RELEASE = "embedding_release"  # a pseudo-segment: the first stage lets its embedding output go (LoRA)


def _forward_segments(first: bool, last: bool, layers: range, num_layers: int,
                      frozen_input: bool = False, kinds: list[bool] | None = None,
                      merge: bool = True) -> list[tuple[str, int]]:
    # The unsplit model's first-layer segment holds a hidden-sized tensor more than a generic layer's; the first
    # stage's forward, counted, is the prefix (embedding, rotary) and generic layers (benchmarks/pipeline_table.py
    # --trace), so layer 0 takes the generic segment here. Under LoRA (``frozen_input``) layer 0's input needs no
    # gradient, so nothing in it saves its input the way a generic layer does: it takes its own segment, and the
    # embedding output, which the unsplit model keeps bound to the forward's end, goes when the stage rebinds it.
    seq = [("prefix", 1)] if first else []
    for i in layers:
        seq.extend([("fw_first", 1), (EMBEDDING_RELEASE, 1)] if frozen_input and first and i == 0
                   else [(_kind("fw", i, kinds), 1)])
    # the last layer's segment holds the same tensor more (``received_extra`` below): generic here too
    if last:
        seq.append(("mid_fw", 1))
    return _merge(seq) if merge else seq


def _backward_segments(first: bool, last: bool, layers: range, num_layers: int,
                       kinds: list[bool] | None = None) -> list[tuple[str, int]]:
    seq = [("mid_bw", 1)] if last else []
    for i in reversed(layers):
        seq.append((_kind("bw_first" if i == num_layers - 1 else "bw_last" if i == 0 else "bw", i, kinds), 1))
    if first:
        seq.append(("suffix", 1))
    return _merge(seq)


def _kind(name: str, layer: int, kinds: list[bool] | None) -> str:
    """A layer segment's name in the every-k set: the checkpointed profile's (``+ckpt``) for a checkpointed layer."""
    return name + CKPT if kinds is not None and kinds[layer] else name


def every_k_segments(plain: dict, ckpt: dict, kinds: list[bool]) -> dict:
    """The segments of a pipeline under every-k checkpointing: each decoder layer's from the profile of its kind
    (``kinds``: checkpointed, by global layer index), named as ``long_context.mixed_layers`` names them; the
    prefix and suffix from layer 0's kind (its stage runs them around it), the final norm, head and loss (``mid_fw``,
    ``mid_bw``) from the last layer's. Unlike the unsplit model's mixed set no term moves between layers: each stage
    computes its own rotary tables and feeds its first layer its own input."""
    outer_first = ckpt if kinds[0] else plain
    outer_last = ckpt if kinds[-1] else plain
    out = {name: plain[name] for name in LAYER_SEGMENTS}
    out.update({name + CKPT: ckpt[name] for name in LAYER_SEGMENTS})
    out.update(prefix=outer_first["prefix"], suffix=outer_first["suffix"], mid_fw=outer_last["mid_fw"],
               mid_bw=outer_last["mid_bw"])
    return out


BACKWARD_SEGMENTS = ("mid_bw", "bw_first", "bw", "bw_last", "suffix")
ACCUMULATING = "accumulating"  # a backward segment's candidates when its parameters' gradients already exist


def with_accumulating_candidates(segments: dict, regime: dict) -> dict:
    """``segments`` with each backward segment's ``accumulating`` candidates, re-walked from the regime's event
    list (``accumulating_candidates``); a profile without events, or a segment whose candidates the depth changes
    (``per_layer_act``), keeps none (``pipeline_rank`` then bounds the gradient in flight by the largest one)."""
    events = regime.get("events")
    if not events:
        return segments
    out = dict(segments)
    for name in BACKWARD_SEGMENTS:
        if name in segments and name in events["segments"] and "per_layer_act" not in segments[name]:
            out[name] = {**segments[name], ACCUMULATING: accumulating_candidates(events["segments"][name], events)}
    return out


def accumulating_candidates(codes: list[int], events: dict) -> list[tuple[list[float], float]]:
    """The peak candidates ``(activation polynomial, gradient bytes in flight)`` of a backward segment run again
    on parameters whose gradients exist (a stage's later micro-batches: torch's pipelining accumulates them, no
    reduction until the last). The profile traced the first backward, where autograd's ``AccumulateGrad`` steals
    each new gradient as the parameter's ``.grad``; from the second on it adds the new one in place
    (``variable_grad += new_grad``) and drops it. The engine runs an ``AccumulateGrad`` node before any other
    ready node (its sequence number is the largest) and so right after the node that made the gradient returns:
    a new gradient is in flight only at the end of the run of allocations that made it (that node's outputs:
    the weight's gradient beside the input's, ``_segment_summary``'s hook moment) and gone before the next
    allocation. Counted on a real gloo pipeline (``benchmarks/pipeline_table.py --trace --ops``): a Llama
    layer's accumulating backward peaks at ``down_proj``'s two matmuls (its 64 KiB weight gradient and its
    32 KiB input gradient), not, as the first backward does, at the ``mul`` backward after them, where that
    gradient is already added."""
    act = [0.0] * 6
    fresh = 0.0
    found: list[tuple[list[float], float]] = []
    for _i, is_grad, signed, run_ends in event_walk(codes, events):
        if is_grad:
            fresh += signed[0]
        else:
            act = [a + x for a, x in zip(act, signed)]
        if run_ends:  # the end of a run of allocations: the node has returned
            found.append((list(act), max(fresh, 0.0)))
            fresh = 0.0  # its AccumulateGrad adds each new gradient in place and drops it
    found.append((list(act), 0.0))
    # every monomial is positive, so a candidate with no larger coefficient nor gradient than another is dropped
    return [c for k, c in enumerate(found)
            if not any(j != k and o[1] >= c[1] and all(x >= y for x, y in zip(o[0], c[0])) and (o != c or j < k)
                       for j, o in enumerate(found))]


def _hidden_coeffs(bytes_per_token: float) -> list[float]:
    """The polynomial (``timeline.poly``'s monomials) of a tensor of ``bytes_per_token`` per token: b x s x that."""
    return [0.0, 0.0, 0.0, 0.0, float(bytes_per_token), 0.0]


def _merge(seq: list[tuple[str, int]]) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for name, n in seq:
        if out and out[-1][0] == name:
            out[-1] = (name, out[-1][1] + n)
        else:
            out.append((name, n))
    return out


def pipeline_rank(spec: RunSpec, segments: dict, table: list[ParamInfo], num_layers: int, hidden: int,
                  act_bytes: int, pp_rank: int, vocab: int, kinds: list[bool] | None = None,
                  events: list | None = None) -> PipelineRank:
    """The peak of ``pp_rank`` over its schedule's actions and the optimizer step. ``kinds``: every-k checkpointing,
    whether each decoder layer is checkpointed (``segments`` from ``every_k_segments``). ``events``: appended with
    ``[kind, stage, micro-batch, bytes before, peak within, bytes after]`` per action, the shape of
    ``benchmarks/pipeline_table.py --trace``'s (the level: resident, gathered, activations, gradients)."""
    par, training = spec.parallel, spec.training
    b, s = training.micro_batch_size, training.seq_len
    pp, virtual, m = par.pp, par.virtual_stages, par.microbatches
    num_stages = pp * virtual
    splits = stage_layers(num_layers, num_stages)
    mine = stages_of_rank(pp_rank, pp, virtual)
    params = {st: stage_params(table, st, num_stages, splits[st]) for st in mine}
    rank_table = [p for st in mine for p in params[st]]
    dp = par.dp
    boundary = b * s * hidden * act_bytes  # one micro-batch's hidden states at a stage boundary
    logits = b * s * vocab * act_bytes
    # What the unsplit backward's final segment frees beyond what its forward's final segment allocated: tensors
    # the unsplit trace allocated inside its first and last layers' segments (a 16-bit model's final RMSNorm keeps
    # its fp32 upcast of the last hidden states), which a stage's generic layer segments leave out. Under
    # checkpointing the final segments balance: the recomputed layers keep nothing of the final norm's.
    final_unmatched = -(poly(segments["mid_fw"]["net_act"], b, s) + poly(segments["mid_bw"]["net_act"], b, s))
    # GPipe (fwd_sends_to_wait, bwd_sends_to_wait) and the interleaved runtime (send_ops) wait for their sends only
    # when the schedule returns, so every sent output and input gradient lives until then; 1F1B waits each one
    # before its next forward
    sends_held = par.pp_schedule != "1f1b"
    rotary = poly(segments["prefix"]["net_act"], b, s) - boundary
    # The stage module's position ids (``harness.pipeline.HfStage``: ``torch.arange(s)[None]``, one int64 per
    # position whatever b) are a local of its forward: the rotary tables are computed from them and nothing saves
    # them, so they go when the stage's forward returns (as a DeepSpeed pipeline layer's do, ``ds_pipeline``); the
    # unsplit profile's prefix holds them (its model frees them only when its whole forward returns). A checkpointed
    # layer keeps them among its inputs for its recomputation (non-reentrant checkpointing holds its arguments to its
    # backward). Counted (--trace): each stage forward of the interleaved pp 4 M 4 run at (1, 64) rose 536 B less
    # than estimated (512 B of them these; 24 B a flash call's philox state, a GPU's), released by its backward:
    # 7 in flight at the middle rank's peak
    def positions_freed(stage: int) -> float:
        checkpointed = training.grad_ckpt if kinds is None else any(kinds[i] for i in splits[stage])
        return 0.0 if checkpointed else float(s * INT64)
    # Counted (benchmarks/pipeline_table.py --trace): a stage fed by received activations holds one hidden-sized
    # tensor per micro-batch more than its layers' generic segments, the one the unsplit profile's first-layer
    # segment holds above a generic layer's (a first stage, fed by its embedding, does not).
    def received_extra_of(stage: int) -> float:  # from the profile of the kind of the stage's first layer
        first_layer = splits[stage][0]
        return (poly(segments[_kind("fw_first", first_layer, kinds)]["net_act"], b, s)
                - poly(segments[_kind("fw", first_layer, kinds)]["net_act"], b, s))
    # Under checkpointing peft makes the embedding output require a gradient (``enable_input_require_grads``: a
    # leaf), so layer 0's input is saved by its checkpoint and gets a gradient as a received input does
    input_leaf = training.lora and training.grad_ckpt
    frozen_input = training.lora and not input_leaf  # the first layer gets an input without gradient
    if frozen_input:  # a received input does require one (torch's stage marks its receive buffers): saved as under
        # full fine-tuning, one hidden-sized tensor per micro-batch above the generic segments (counted, --trace)
        def received_extra_of(stage: int) -> float:
            return boundary
        segments = {**segments, EMBEDDING_RELEASE: {"net_act": _hidden_coeffs(-hidden * act_bytes),
                                                    "net_grad": 0.0, "candidates": []}}
    # resident: weights and optimizer states (FSDP2: this rank's shards), the receive buffers, the step's batch
    shard = 1.0 / dp if fsdp2_stages(par) else 1.0
    mixed = training.precision.startswith("mixed_")  # FSDP2's MixedPrecisionPolicy (check_pipeline)
    model = _state_model(spec, rank_table, mixed)
    resident = {k: v * shard for k, v in model.resident.items()}
    recv = sum(m * boundary * ((st != 0) + (st != num_stages - 1)) for st in mine)
    # the step's batch (one int64 id per token of every micro-batch) on every rank, the middle ones too (counted,
    # --trace: before the first action a middle rank of pp 4 held M·b·s·8 B more than estimated, the loop's ids)
    batch = m * b * s * INT64
    resident["comm_buffers"] = recv
    resident["activations"] = float(batch)
    base = sum(resident.values())
    weights_of = {st: float(sum(p.nbytes for p in params[st])) for st in mine}
    largest_layer = {st: float(max((p.nbytes for p in params[st] if p.trainable and p.layer is not None),
                                   default=0)) for st in mine}
    largest_other = {st: float(max((p.nbytes for p in params[st] if p.trainable and p.layer is None), default=0))
                     for st in mine}
    # mixed: the 16-bit gradient a group's upcast holds last, beside every fp32 accumulator of the group
    last_layer_param = {st: float(next((p.nbytes for p in reversed(params[st]) if p.trainable
                                        and p.layer is not None), 0)) for st in mine}
    fsdp = fsdp2_stages(par)
    act = 0.0           # activations above the resident ones
    grads = 0.0         # gradients held (unsharded under FSDP2 until the end; mixed: the fp32 accumulators)
    pending = 0.0       # mixed: the stage module's own 16-bit gradients, upcast when the stage's backward ends
    gathered = 0.0      # FSDP2: unsharded parameters held
    started: set[int] = set()     # stages whose first backward has run
    unsharded: set[int] = set()   # FSDP2: stages whose parameters were gathered
    computed: set[int] = set()    # stages that ran an action
    backwards = dict.fromkeys(mine, 0)   # each stage's backwards so far (its reduce follows the last)
    reduce_bytes = FP32 if mixed else None  # the reduce dtype (None: the parameter's own)
    actions = rank_actions(par.pp_schedule, pp_rank, pp, m, virtual)
    multi_stage = par.pp_schedule == "interleaved_1f1b"  # torch's _PipelineScheduleRuntime
    live = 0
    best = (base, "setup", 0, {})

    action_peak = 0.0

    def consider(total: float, phase: str, parts: dict) -> None:
        nonlocal best, action_peak
        action_peak = max(action_peak, total)
        if total > best[0]:
            best = (total, phase, live, parts)

    # The schedule's loop keeps the latest forward's output bound (``output = stage.forward_one_chunk(...)``) until
    # the next forward returns: an output whose backward has run lives on while it is that one.
    held: tuple[int, int] | None = None   # (stage, micro-batch) of the output the loop variable holds
    popped: set[tuple[int, int]] = set()
    grad_sent = False  # 1F1B: an input gradient's send work is pending
    # 1F1B's warmup fires each forward's send but its last into ``send_work`` and waits that list before the
    # next forward without dropping it; gloo's send work keeps the tensor it sends, so the list keeps the output
    # of micro-batch w - 2 (w: the stage's warmup forwards) past its backward, until the 1B1F loop ends (after
    # micro-batch M - w's backward) and the first send of the cooldown rebinds ``send_work``
    # (``warmup_send_kept``; counted: clearing each waited list takes exactly that tensor off, below)
    kept_from, kept_until = warmup_send_kept(par.pp_schedule, mine[0], num_stages, m)
    for index, action in enumerate(actions):
        before = base + gathered + act + grads + pending
        action_peak = before
        st = action.stage
        first, last = st == 0, st == num_stages - 1
        out_bytes = logits if last else boundary
        # FSDP2 gathers a stage's parameters in its first forward of the step (gpipe, 1F1B: at each group's
        # pre-forward; the multi-stage runtime: its UNSHARD action's all-gathers, waited for group by group here)
        gathering = fsdp and action.kind == "F" and st not in (computed if multi_stage else unsharded)
        computed.add(st)
        if fsdp:
            unsharded = set(_next_stages(actions[index:], MAX_ACTIVE_STAGES)) if multi_stage else unsharded | {st}
            gathered = sum(weights_of[x] for x in unsharded)
        lifts = None  # FSDP2's all-gather outputs per forward segment (``_gathering_forward_lifts``)
        if action.kind == "F":
            live += 1
            seq = _forward_segments(first, last, splits[st], num_layers, frozen_input, kinds,
                                    merge=not (gathering and not multi_stage))
            if gathering and not multi_stage:
                lifts = _gathering_forward_lifts(seq, params[st], dp)
            elif gathering:  # outside the forward state each group's output goes right after its copy-out, while
                # the issued outputs of the later groups stand where their unsharded parameters will be
                consider(base + gathered + act + grads + pending + _largest_gather(params[st], dp), phase_of(action),
                         {"activations": act, "gradients": grads + pending, "gathered_params": gathered})
            if not first:  # every stage computes its own rotary cos/sin and positions (the prefix less the embedding),
                act += rotary + received_extra_of(st)  # and holds one hidden-sized tensor more than its generic layers
        else:
            seq = _backward_segments(first, last, splits[st], num_layers, kinds)
        accumulating = action.kind == "B" and st in started
        phase = phase_of(action)
        # A stage's first backward layer leaves its output's gradient alone (the receive buffer, resident), which
        # the unsplit profile's segment frees: every later level of the backward holds it, to the stage module's
        # own hooks at its end (counted, --trace, checkpointed under LoRA; plain: GPipe pp 2 M 2 stage 0's levels
        # after each layer's backward read 15,472 to 15,520 B above the segments' without it, its embedding
        # backward 16,480 B, docs/error_matrix/README.md "The receive buffer through the backward")
        incoming = boundary if action.kind == "B" and not last else 0.0
        for seg_index, (name, reps) in enumerate(seq):
            seg = segments[name]
            net = poly(seg["net_act"], b, s)
            at_start, within = lifts[seg_index] if lifts else (0.0, 0.0)
            if at_start:  # a layer group's copy-out, before the layer runs
                consider(base + gathered + act + grads + pending + at_start, phase,
                         {"activations": act, "gradients": grads + pending, "gathered_params": gathered + at_start})
            layer_seg = name.removesuffix(CKPT) in LAYER_SEGMENTS
            # under accumulation one gradient at a time is in flight before autograd adds it in place
            transient = largest_layer[st] if layer_seg else largest_other[st]
            # mixed: a layer's gradients done in an earlier repetition are its fp32 accumulators (first backward)
            done_grad = seg["net_grad"] * (FP32 / act_bytes if mixed and layer_seg else 1)
            for k in {0, min(1, reps - 1), reps - 1}:  # levels are linear in k but for the lift after k = 0
                lift = incoming if seg_index == 0 and k else 0.0  # later segments: in ``act``
                for cand_act, cand_grad, fresh_grad in _candidates(seg, accumulating and not mixed):
                    if mixed:  # every 16-bit gradient of the group stays until its hook: none added in place
                        g = grads + pending + (0 if accumulating else k * done_grad) + cand_grad
                    elif accumulating and ACCUMULATING in seg:  # the gradient the node just made, before
                        g = grads + fresh_grad  # AccumulateGrad adds it in place (``accumulating_candidates``)
                    else:
                        g = grads + (min(fresh_grad, transient) if accumulating else k * done_grad + cand_grad)
                    consider(base + gathered + within + act + lift + k * net + poly(cand_act, b, s) + g, phase,
                             {"activations": act + lift + k * net + poly(cand_act, b, s), "gradients": g,
                              "gathered_params": gathered + within})
            act += reps * net + (incoming if seg_index == 0 else 0.0)
            if mixed and not layer_seg:
                pending += reps * seg["net_grad"]
            elif not accumulating:
                if mixed:  # the layer's hook upcasts: its fp32 accumulators beside its last 16-bit gradient
                    consider(base + gathered + act + grads + pending + reps * done_grad + last_layer_param[st],
                             phase, {"activations": act, "gradients": grads + pending + reps * done_grad
                                     + last_layer_param[st], "gathered_params": gathered})
                grads += reps * done_grad
        if mixed and action.kind == "B" and pending:  # the stage module's hook, when the stage's backward ends
            if not accumulating:
                upcast = pending * FP32 / act_bytes
                consider(base + gathered + act + grads + upcast + largest_other[st], phase,
                         {"activations": act, "gradients": grads + upcast + largest_other[st],
                          "gathered_params": gathered})
                grads += upcast
            pending = 0.0
        act -= incoming
        if input_leaf and action.kind == "B" and first and backwards[st] < m - 1:
            act -= 2 * boundary  # the embedding output (a leaf) and its gradient go; the last backward's stay
        if action.kind == "F":
            act -= positions_freed(st)  # the stage's forward returns: its position ids go
            if last:  # the stage output (logits) stays in fwd_cache until this backward, and what the final
                # segment's backward frees beyond its forward's allocation is held until then
                act += logits + final_unmatched
            if held is not None and held in popped and not (sends_held and held[0] != num_stages - 1):
                # the loop variable lets the previous output go (unless a send work still holds it)
                act -= logits if held[0] == num_stages - 1 else boundary
            held = (st, action.microbatch)
        else:
            popped.add((st, action.microbatch))
            if last and held != (st, action.microbatch):  # the logits popped from fwd_cache stay bound in
                act -= logits  # backward_one_chunk (its stage_output local) until it returns
            if not first:  # the rotary cos/sin go with the graph; the gradient of the received input is sent back,
                # held by its send work: to the schedule's end, or (1F1B) until the next backward's send replaces it
                act += boundary - (rotary - positions_freed(st)) - received_extra_of(st)
                if not sends_held and grad_sent:
                    act -= boundary
                grad_sent = True
            if (held == (st, action.microbatch) or sends_held) and not last:
                # still bound: by the loop variable, or by its send work
                act += out_bytes
            if action.microbatch == kept_from:  # its output stays in the warmup's send work
                act += boundary
            if action.microbatch == kept_until:  # the 1B1F loop ends: ``send_work`` is rebound
                act -= boundary
            live -= 1
            started.add(st)
        if events is not None:
            after = base + gathered + act + grads + pending
            events.append([action.kind, st, action.microbatch, round(before), round(max(action_peak, after)),
                           round(after)])
        if action.kind == "B":
            backwards[st] += 1
            if fsdp and backwards[st] == m:  # the stage's reduce-scatter (perform_reduce_grad), group by group in
                # FSDP2's state order (the stage module's own group, then each layer's): a reduce-scatter input of the
                # group's unsharded gradients, then its gradients become shards. Counted (--trace's P events): the
                # stage module's own group puts its input on top of the whole level after the last backward, its
                # parameters still gathered; a layer group's parameters are resharded first (post_backward)
                for own, group in _fsdp_groups(params[st]):
                    unsharded_grad = float(sum(p.numel * (reduce_bytes or p.elem_bytes) for p in group
                                               if p.trainable))
                    if not own:
                        gathered -= float(sum(p.nbytes for p in group))
                    consider(base + gathered + act + grads + unsharded_grad, f"gradient reduce-scatter of stage {st}",
                             {"activations": act, "gradients": grads, "gathered_params": gathered,
                              "comm_buffers": unsharded_grad})
                    grads += unsharded_grad * shard - unsharded_grad
                    if own:
                        gathered -= float(sum(p.nbytes for p in group))
    # the schedule returns: its loop variable goes, and the send works with every output and gradient they kept
    if sends_held:
        act -= boundary * m * sum((st != num_stages - 1) + (st != 0) for st in mine)
        act -= logits if held and held[0] == num_stages - 1 else 0.0
    else:
        if held is not None:
            act -= logits if held[0] == num_stages - 1 else boundary
        act -= boundary if grad_sent else 0.0
    # the optimizer step: gradients (FSDP2: reduce-scattered to shards, parameters resharded), leftovers
    step_grads = (model.step_grads * shard) if fsdp else model.step_grads
    step_total = base + act + step_grads + model.step_temp * shard
    if step_total > best[0]:
        best = (step_total, "optimizer_step", 0, {"activations": act, "gradients": step_grads,
                                                   "temporaries": model.step_temp * shard})
    total, phase, in_flight, parts = best
    out = dict(resident)
    out["activations"] = resident["activations"] + parts.get("activations", 0.0)
    for key in ("gradients", "gathered_params", "temporaries", "comm_buffers"):
        if parts.get(key):
            out[key] = out.get(key, 0.0) + parts[key]
    return PipelineRank(pp_rank=pp_rank, stages=tuple(mine), parts=out, peak_bytes=total, phase=phase,
                        in_flight=in_flight)


def warmup_send_kept(schedule: str, stage: int, num_stages: int, m: int) -> tuple[int | None, int | None]:
    """The micro-batches after whose backward a 1F1B stage's warmup send work starts and stops being the last
    holder of a stage output: torch's ``Schedule1F1B._step_microbatches`` fires the send of each warmup forward
    but the last (``send_work = _batch_p2p(fwd_sends)``), waits it before the next forward and keeps the list
    (``_wait_batch_p2p`` drops nothing), and a gloo send work holds its tensor: the output of micro-batch w - 2
    (w = min(M, stages - stage) warmup forwards) lives on after its backward pops it from ``fwd_cache``, until
    the 1B1F loop breaks after micro-batch M - w's backward and ``send_work`` is rebound to the cooldown's first
    gradient send. (None, None) where no output outlives its backward so: other schedules (GPipe and the
    interleaved runtime hold every send to the end, counted apart), the last stage (one warmup forward, never
    fired), and a stage whose loop ends by then (w - 2 >= M - w)."""
    if schedule != "1f1b":
        return None, None
    warmup = min(m, num_stages - stage)
    if warmup < 2 or warmup - 2 >= m - warmup:
        return None, None
    return warmup - 2, m - warmup


def _candidates(seg: dict, accumulating: bool) -> list[tuple]:
    """A segment's candidates ``(activations, gradients, gradient in flight under accumulation)``: the
    ``accumulating`` ones where the segment has them and its gradients are accumulated, else
    ``_with_fresh_grads``'s bound."""
    if accumulating and ACCUMULATING in seg:
        return [(cand_act, 0.0, fresh) for cand_act, fresh in seg[ACCUMULATING]]
    return _with_fresh_grads(seg["candidates"])


def _with_fresh_grads(candidates: list) -> list[tuple]:
    """Each backward candidate ``(activations, gradients)`` with the gradients made since the one before (in time
    order): under accumulation the only gradient that can be in flight at a candidate, before autograd adds it in
    place, is one made since the previous candidate (a candidate after a layer norm's gradient holds no weight
    gradient in flight; counted, --trace: pp x tp's checkpointed middle rank read one 32 KiB gradient over)."""
    out, before = [], 0.0
    for cand_act, cand_grad in candidates:
        out.append((cand_act, cand_grad, max(0.0, cand_grad - before)))
        before = cand_grad
    return out


def _fsdp_groups(stage: list[ParamInfo]) -> list[tuple[bool, list[ParamInfo]]]:
    """A stage's FSDP2 parameter groups in the order its state context lists them, each with whether it is the
    stage module's own (embedding, or final norm and head; none on a middle stage), then each decoder layer's."""
    layers: dict[int, list[ParamInfo]] = {}
    for p in stage:
        if p.layer is not None:
            layers.setdefault(p.layer, []).append(p)
    own = [p for p in stage if p.layer is None]
    return ([(True, own)] if own else []) + [(False, layers[i]) for i in sorted(layers)]


def _gathering_forward_lifts(seq: list[tuple[str, int]], stage: list[ParamInfo], dp: int
                              ) -> list[tuple[float, float]]:
    """What FSDP2's all-gathers add, per segment of a stage's forward that gathers its parameters (``seq``
    unmerged, one entry per layer), to a level that counts the whole stage gathered from the start: ``(at the
    segment's start, within it)``. Torch 2.13 (``FSDPParamGroup.unshard`` / ``wait_for_unshard``, forward state):
    the stage module's own group is gathered at its pre-forward, each layer's at its own; a group's all-gather
    output (padded, ``_fsdp_group_sizes``) outlives its copy-out until the next group's copy-out, the last one's
    until the stage module's post-forward (after the head, on the last stage). So at layer j's copy-out the
    previous group's output, layer j's output and its unsharded parameters are live, the later layers' not yet."""
    groups = _fsdp_groups(stage)
    gather = [methods._fsdp_group_sizes(group, dp, lambda p: p.elem_bytes)[1] for _, group in groups]
    own = gather[0] if groups and groups[0][0] else 0.0
    layer_gathers = gather[1:] if own else gather
    out: list[tuple[float, float]] = []
    j = -1  # the layer the walk is in
    for name, _ in seq:
        if name.removesuffix(CKPT) in LAYER_SEGMENTS:
            j += 1
            later = sum(layer_gathers[j + 1:])
            previous = layer_gathers[j - 1] if j else own
            out.append((previous + layer_gathers[j] - later, layer_gathers[j] - later))
        elif name == "mid_fw":  # the last layer's output is freed at the stage module's post-forward
            out.append((0.0, layer_gathers[-1] if layer_gathers else own))
        elif j < 0:  # the prefix: only the stage module's own group gathered (its output held)
            out.append((0.0, own - sum(layer_gathers)))
        else:  # within layer j (the embedding release)
            out.append((0.0, layer_gathers[j] - sum(layer_gathers[j + 1:])))
    return out


def phase_of(action: Action) -> str:
    return f"{'forward' if action.kind == 'F' else 'backward'} of stage {action.stage}, micro-batch {action.microbatch}"


def _largest_gather(stage: list[ParamInfo], dp: int) -> float:
    """The largest all-gather output among a stage's FSDP2 groups (padded)."""
    return max((methods._fsdp_group_sizes(group, dp, lambda p: p.elem_bytes)[1] for _, group in _fsdp_groups(stage)),
               default=0.0)


def _next_stages(actions: list[Action], count: int) -> list[int]:
    """The first ``count`` distinct stages the actions compute (torch's ``next_stage_indices``)."""
    out: list[int] = []
    for action in actions:
        if action.stage not in out:
            out.append(action.stage)
            if len(out) == count:
                break
    return out


def _state_model(spec: RunSpec, rank_table: list[ParamInfo], mixed: bool) -> methods.StepModel:
    """The weights, optimizer states and step of the rank's parameters on one device (the caller shards them under
    FSDP2). Mixed precision under FSDP2: the fp32 shards are the weights Adam steps, so the fp32 model's state."""
    if mixed:
        rank_table = [dataclasses.replace(p, elem_bytes=FP32) for p in rank_table]
        spec = spec.replace(**{"training.precision": "fp32"})
    return methods.single(spec.replace(**{"parallel.method": "single", "parallel.world_size": 1, "parallel.pp": 1,
                                          "parallel.tp": 1,
                                          "parallel.pp_schedule": "1f1b", "parallel.pp_microbatches": 0,
                                          "parallel.pp_virtual": 0}), rank_table)


def fsdp2_stages(par) -> bool:
    """Whether FSDP2 shards each stage over its dp ranks: pp x fsdp, and pp x dp x tp (method ``dp_tp``, torchtitan's
    mesh (pp, dp, tp): FSDP2 over dp of the TP-local shards, so the TP profile's table sharded dp ways)."""
    return par.method in ("fsdp", "dp_tp") and par.dp > 1


def reported_pp_ranks(pp: int) -> list[int]:
    """First, middle and last pipeline rank."""
    return sorted({0, pp // 2, pp - 1})


# Settings the pipeline estimate covers; the others are refused with their reason (``check_pipeline``).
PIPELINE_PRECISIONS = ("bf16", "fp32")
PIPELINE_MIXED = "mixed_bf16"  # FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) only
PIPELINE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def check_pipeline(spec: RunSpec, model_type: str, tied: bool) -> None:
    """ValueError("pp: ...") for what the pipeline estimate does not model (one line each)."""
    training = spec.training
    if spec.parallel.pp == 1:
        return
    check_pp_dp_tp(spec)
    fsdp2 = fsdp2_stages(spec.parallel)
    if training.precision == PIPELINE_MIXED and not fsdp2:
        raise ValueError(f"pp: precision {PIPELINE_MIXED} is modelled as FSDP2's MixedPrecisionPolicy over the dp "
                         "ranks of each stage (method fsdp, more GPUs than pp); use bf16 or fp32 without FSDP2")
    if training.precision not in PIPELINE_PRECISIONS + (PIPELINE_MIXED,):
        raise ValueError(f"pp: precision {training.precision} is not modelled under pipelining; use "
                         f"{', '.join(PIPELINE_PRECISIONS)} or {PIPELINE_MIXED} (with FSDP2)")
    if model_type not in PIPELINE_MODEL_TYPES:
        raise ValueError(f"pp: the stage split is modelled for {', '.join(PIPELINE_MODEL_TYPES)} decoders "
                         f"(model.layers, embed_tokens, norm, lm_head), not {model_type}")
    if tied:
        raise ValueError("pp: tied input and output embeddings (tie_word_embeddings) would sit on the first and the "
                         "last stage; torch's pipelining does not tie them across stages")
    if training.lora and training.precision != "bf16":
        raise ValueError(f"pp: LoRA under pipelining is checked in bf16 only; precision {training.precision} is not "
                         "checked yet")
    for name, on in (("ckpt_policy", training.ckpt_policy == "selective-ops"), ("qlora", training.qlora),
                     ("lora_dropout", bool(training.lora_dropout)),
                     ("grad_accum_steps", training.grad_accum_steps > 1), ("loop", training.loop != "trainer"),
                     ("ce", training.ce != "standard"), ("activation_offload", training.activation_offload),
                     ("outputs_fp32", training.outputs_fp32), ("use_cache", training.use_cache),
                     ("batch", training.batch != "full")):
        if on:
            raise ValueError(f"pp: {name} is not modelled under pipelining (micro-batches are the pipeline's: "
                             "pp_microbatches)" if name == "grad_accum_steps" else
                             f"pp: {name} is not modelled under pipelining yet")


def check_pp_dp_tp(spec: RunSpec) -> None:
    """ValueError("pp: ...") for what pp x dp x tp (method dp_tp under pp) has not been checked with against torch's
    run (``docs/error_matrix/pipeline_dp_tp*.csv``): FSDP2's mixed precision over TP shards is checked without
    checkpointing and with every decoder layer checkpointed, not with every-k (LoRA, LoRA with checkpointing and
    every-k are checked in bf16; LoRA with every-k is refused everywhere)."""
    training = spec.training
    if spec.parallel.method == "dp_tp" and training.precision == PIPELINE_MIXED and training.ckpt_policy:
        raise ValueError(f"pp: pp x dp x tp with precision {PIPELINE_MIXED} and ckpt_policy {training.ckpt_policy} is "
                         f"not checked yet; use {PIPELINE_MIXED} with every decoder layer checkpointed, or bf16 with it")


def pipeline_notes(spec: RunSpec, num_layers: int) -> list[str]:
    par = spec.parallel
    stages = par.pp * par.virtual_stages
    sizes = sorted({len(r) for r in stage_layers(num_layers, stages)})
    dp = f"; FSDP2 over {par.dp} ranks per stage (reshard_after_forward off, gradients reduced after the last " \
         "micro-batch)" if par.method == "fsdp" and par.dp > 1 else ""
    mixed = " with MixedPrecisionPolicy(param bf16, reduce fp32): fp32 shards stepped by Adam, bf16 all-gathers, " \
            "each layer's gradients accumulated in fp32 across the micro-batches" \
        if spec.training.precision == PIPELINE_MIXED else ""
    dp += mixed if dp else ""
    every = ckpt_every(spec.training.ckpt_policy)
    ckpt = "; every decoder layer of each stage checkpointed (a micro-batch's forward keeps each layer's input, " \
           "its backward recomputes the layer)" if spec.training.grad_ckpt and every is None else ""
    if every is not None:
        ckpt = (f"; ckpt {spec.training.ckpt_policy}: decoder layers {every - 1}, {2 * every - 1}, ... (by their "
                "index in the whole model) checkpointed in whichever stage holds them, the others keep their "
                "activations")
    if par.tp > 1:
        dp = (f"; TP over {par.tp} ranks inside each stage (torch's parallelize_module on each decoder layer: its "
              "linears split as the traced TP rank holds them; embedding, norms and head replicated, so each rank of "
              "the last stage holds the full logits; the hidden states sent between stages replicated)")
        if fsdp2_stages(par):
            dp += (f", and FSDP2 over {par.dp} ranks per stage (mesh (pp {par.pp}, dp {par.dp}, tp {par.tp}): each "
                   "TP-local shard sharded dp ways; reshard_after_forward off, gradients reduced after the last "
                   f"micro-batch){mixed}")
    if spec.training.lora:
        ckpt += (f"; LoRA r{spec.training.lora_rank}: each stage's frozen base weights, its adapters' gradients and "
                 "Adam states")
    return [f"pp: {par.pp} pipeline ranks, {stages} stages of {'/'.join(map(str, sizes))} decoder layers "
            f"(embedding on the first, norm + head + loss on the last), schedule {par.pp_schedule}, "
            f"{par.microbatches} micro-batches of {spec.training.micro_batch_size} rows per step{dp}{ckpt}; "
            "torch's receive buffers, the received inputs' gradients and each stage's cached output counted; "
            "step(return_outputs=False) as torchtitan"]
