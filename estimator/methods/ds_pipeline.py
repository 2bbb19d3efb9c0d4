"""Pipeline parallelism as DeepSpeed's pipeline engine runs it (``deepspeed.pipe.PipelineModule`` +
``PipelineEngine``, DeepSpeed 0.19), where its memory differs from torch's pipelining (``methods.pipeline_rank``):

- Layers and stages: the model is a flat list of layers (embedding, one per decoder layer, final norm + head), split
  by ``partition_method="parameters"`` (DeepSpeed's default): ``partition_balanced`` over the trainable parameter
  count of each layer, so a large vocabulary's embedding and head take the place of decoder layers on the first and
  last stage (``ds_stage_bounds``, a port of ``deepspeed.runtime.utils.partition_balanced``). Each decoder layer
  computes the rotary tables of its own input (a layer gets only what the one before returned), so every layer
  keeps its own cos/sin.
- Schedule: ``TrainSchedule``, 1F1B with min(stages - stage, M) micro-batches in flight (ported in
  ``train_schedule_actions``; its order is torch's 1F1B order, and it also runs M < stages).
- Buffers (``engine.py``): one boundary-sized receive buffer shared by received activations and received
  gradients (``_allocate_or_extend_buffers(0, ...)``), kept across steps; each received activation cloned into the
  micro-batch's input buffer, cloned again for the forward, its gradient sent back (``SendGrad``, at the next
  forward step) before the input buffer is let go; the first stage keeps its ``num_pipe_buffers`` = max(2,
  min(stages - stage, M)) input-id clones across steps. The last stage's backward is ``engine.backward(loss)``,
  which never clears ``pipe_buffers['outputs']``: each of its buffers keeps its last logits across steps, and with
  them (through their autograd graph's ``AccumulateGrad`` node) the received input and its gradient, until the
  buffer's next forward replaces them.
- Gradient reduction (``ReduceGrads``, at the step's end, even with one data-parallel rank):
  ``buffered_allreduce_fallback`` flattens the gradients into buckets of 500 M elements
  (``MEMORY_OPT_ALLREDUCE_SIZE``) and casts each bucket to the communication dtype (fp32 unless DeepSpeed's
  fp16/bf16 modes are on): a 16-bit model holds, per bucket, its flat copy and an fp32 copy beside every gradient.
- The optimizer: with ZeRO stage 0 and no fp16/bf16 section DeepSpeed steps the client optimizer itself (no
  wrapper): the ``single`` state model of the stage's parameters. ``zero_grad`` sets the gradients to None.
- Data parallelism (method ddp, world = pp x dp; ``PipeDataParallelTopology``: global rank = stage x dp + dp rank):
  at ZeRO stage 0 every rank of a stage holds what a lone stage holds (``buffered_allreduce_fallback`` runs the same
  buckets with one rank or several), except in bf16 mode, whose ``BF16_Optimizer`` cuts the flat group into dp
  partitions and keeps fp32 masters and optimizer states of its own partition only.

Checked against real CPU runs of the engine on gloo ranks with every storage counted
(``benchmarks/ds_pipeline_table.py``). Pure standard library: the predict path imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from estimator.methods import state as methods
from estimator.methods.pipeline import Action
from estimator.methods.pipeline_rank import PipelineRank
from estimator.methods.timeline import poly
from estimator.models.params import ParamInfo
from estimator.spec import ParallelSpec, RunSpec

INT64 = 8
FP32 = 4
ALLREDUCE_BUCKET_NUMEL = 500_000_000  # deepspeed.runtime.engine.MEMORY_OPT_ALLREDUCE_SIZE
LAYER_BW = ("bw_first", "bw", "bw_last")


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """``deepspeed.runtime.utils.partition_uniform``: stage bounds of ``num_items`` layers, the first ``residual``
    stages one more."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    parts = [p * chunk for p in range(num_parts + 1)]
    for i in range(residual):
        for j in range(i + 1, num_parts + 1):
            parts[j] += 1
    return parts


def partition_balanced(weights: list[int], num_parts: int) -> list[int]:
    """``deepspeed.runtime.utils.partition_balanced`` (DeepSpeed 0.19): the linear partition that minimizes the
    spread (max - min) of the parts' weights, DeepSpeed's dynamic programme and tie-breaking (``>=``: the last
    split point of equal cost wins) ported as they are."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = float("inf")
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    prefix = [0.0] * (n + 1)
    for i, w in enumerate(weights):
        prefix[i + 1] = prefix[i] + w
    dp_max[0][0] = 0
    dp_cost[0][0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                max_sum = max(dp_max[k][j - 1], part)
                min_sum = min(dp_min[k][j - 1], part)
                cost = max_sum - min_sum
                if dp_cost[i][j] >= cost:
                    dp_cost[i][j] = cost
                    dp_max[i][j] = max_sum
                    dp_min[i][j] = min_sum
                    position[i][j] = k
    parts = [n]
    for i in reversed(range(1, m + 1)):
        parts.append(position[parts[-1]][i])
    parts.reverse()
    return parts


def layer_weights(table: list[ParamInfo], num_layers: int) -> list[int]:
    """Trainable parameters of each DeepSpeed layer: embedding, decoder layers, final norm + head."""
    embed = sum(p.numel for p in table if p.trainable and p.layer is None and p.module_kind == "embedding")
    head = sum(p.numel for p in table if p.trainable and p.layer is None and p.module_kind != "embedding")
    layers = [0] * num_layers
    for p in table:
        if p.trainable and p.layer is not None:
            layers[p.layer] += p.numel
    return [embed, *layers, head]


def ds_stage_bounds(table: list[ParamInfo], num_layers: int, pp: int) -> list[int]:
    """``PipelineModule.parts`` under ``partition_method="parameters"``: stage s runs DeepSpeed layers
    parts[s] .. parts[s + 1] - 1 (0 the embedding, 1 .. L the decoder layers, L + 1 the norm + head)."""
    return partition_balanced(layer_weights(table, num_layers), pp)


@dataclass(frozen=True)
class DsStage:
    stage: int
    first: bool            # holds the embedding
    last: bool             # holds the final norm and head (and computes the loss)
    layers: range          # decoder layers (model indices)


def ds_stage(bounds: list[int], stage: int, num_layers: int) -> DsStage:
    lo, hi = bounds[stage], bounds[stage + 1]
    return DsStage(stage=stage, first=lo == 0, last=hi == num_layers + 2,
                   layers=range(max(lo, 1) - 1, min(hi, num_layers + 1) - 1))


def ds_stage_params(table: list[ParamInfo], st: DsStage) -> list[ParamInfo]:
    out = []
    for p in table:
        if p.layer is not None:
            if p.layer in st.layers:
                out.append(p)
        elif p.module_kind == "embedding":
            if st.first:
                out.append(p)
        elif st.last:
            out.append(p)
    return out


def num_pipe_buffers(stage: int, stages: int, microbatches: int) -> int:
    """``TrainSchedule.num_pipe_buffers``."""
    return max(2, min(stages - stage, microbatches))


def train_schedule_actions(stage: int, stages: int, microbatches: int) -> list[Action]:
    """The forward (F) and backward (B) passes of ``stage`` in ``TrainSchedule.steps()``' order (its
    ``_step_to_micro_batch``, idle steps dropped)."""
    out = []
    for step in range(2 * (microbatches + stages - 1)):
        even_step, even_stage = step % 2 == 0, stage % 2 == 0
        if even_step and even_stage:
            forward, mb = True, step // 2 - stage // 2
        elif not even_step and not even_stage:
            forward, mb = True, (step - 1) // 2 - stage // 2
        elif even_step and not even_stage:
            forward, mb = False, step // 2 - stages + (stage + 1) // 2
        else:
            forward, mb = False, (step - 1) // 2 - stages + 1 + stage // 2
        if 0 <= mb < microbatches:
            out.append(Action("F" if forward else "B", stage, mb))
    return out


def allreduce_bucket_bytes(params: list[ParamInfo], comm_elem_bytes: int = FP32) -> float:
    """The largest transient of ``buffered_allreduce_fallback``: per bucket (tensors in ``parameters()`` order until
    one takes it past 500 M elements), the flat copy in the gradients' dtype and, where it differs, its copy in the
    communication dtype (fp32 without DeepSpeed's fp16/bf16 modes, fp16 in its fp16 mode)."""
    best = 0.0
    bucket_numel, bucket_bytes = 0, 0.0

    def transient(numel: int, nbytes: float) -> float:
        return nbytes + (numel * comm_elem_bytes if nbytes != numel * comm_elem_bytes else 0.0)

    for p in params:
        if not p.trainable:
            continue
        bucket_numel += p.numel
        bucket_bytes += p.nbytes
        if bucket_numel > ALLREDUCE_BUCKET_NUMEL:
            best = max(best, transient(bucket_numel, bucket_bytes))
            bucket_numel, bucket_bytes = 0, 0.0
    if bucket_numel:
        best = max(best, transient(bucket_numel, bucket_bytes))
    return best


BF16_ALIGNMENT_ELEMS = 2  # BF16_Optimizer.nccl_start_alignment_factor (x the stage's data-parallel ranks)


def _padded_numel(params: list[ParamInfo], alignment: int) -> int:
    """Elements of ``BF16_Optimizer``'s flat group: the trainable parameters, padded to ``alignment``."""
    numel = sum(p.numel for p in params if p.trainable)
    return numel + (-numel) % alignment


def _bf16_optimizer_model(spec: RunSpec, params: list[ParamInfo]) -> methods.StepModel:
    """DeepSpeed's bf16 mode (``bf16.enabled``, ZeRO stage 0: ``BF16_Optimizer``, ``runtime/bf16_optimizer.py``).
    The weights are flattened into one 16-bit group (views into it), padded to 2 x dp elements and cut into dp
    equal partitions: the fp32 master copy of this rank's partition is what the client optimizer steps (its states
    in fp32), so masters and states are split over the stage's data-parallel ranks even at ZeRO stage 0; gradients
    are accumulated into a flat buffer of the whole group in the gradient accumulation dtype, bf16 under a pipeline
    (``_do_optimizer_sanity_check``), held across steps. The module's own ``.grad`` tensors accumulate over the
    micro-batches as without the wrapper (``clear_lp_grads`` zeroes them in place) and are let go after the step
    (``zero_grad``). The step casts the buffer's partition to an fp32 gradient of the masters, beside the
    optimizer's temporaries; the updated partitions are all-gathered into the flat weights in place."""
    training, dp = spec.training, spec.parallel.dp
    numel = _padded_numel(params, BF16_ALIGNMENT_ELEMS * dp)
    part = numel // dp
    pad_bytes = (numel - sum(p.numel for p in params if p.trainable)) * 2
    flat = [ParamInfo(name="fp32_groups_flat_partition", shape=(part,), numel=part, elem_bytes=FP32,
                      trainable=True, module_kind="other", layer=None)]
    resident = {"weights": methods.weights_bytes(params) + pad_bytes,
                "master_weights": float(FP32 * part),
                "optimizer_states": methods.optimizer_state_bytes(flat, training.optimizer, True),
                "gradients": float(2 * numel)}   # the flat accumulation buffer (fp32_groups_gradients_flat)
    lp_grads = methods.grad_bytes(params)
    return methods.StepModel(resident=resident, grad_policy=methods._full, segment_extra=None,
                             step_grads=lp_grads + FP32 * part,
                             step_temp=methods.step_temp_bytes(flat, training.optimizer, True),
                             accumulated_grad_bytes=lp_grads, largest_grad_bytes=0.0)


def _fp16_unfused_model(spec: RunSpec, params: list[ParamInfo]) -> methods.StepModel:
    """DeepSpeed's fp16 mode around a client optimizer that is not its FusedAdam (``FP16_UnfusedOptimizer``,
    ``runtime/fp16/unfused_optimizer.py``): an fp32 clone of each trainable tensor is what the client optimizer
    steps, its states made at setup (``initialize_optimizer_states``). The step converts every 16-bit gradient to an
    fp32 one on its master before the client optimizer runs (the 16-bit ones are still held), then drops them."""
    training = spec.training
    trainable = [p for p in params if p.trainable]
    resident = {"weights": methods.weights_bytes(params),
                "optimizer_states": methods.optimizer_state_bytes(params, training.optimizer, True),
                "master_weights": methods.master_bytes(params)}
    lp_grads = methods.grad_bytes(params)
    fp32_grads = float(sum(FP32 * p.numel for p in trainable))
    return methods.StepModel(resident=resident, grad_policy=methods._full, segment_extra=None,
                             step_grads=lp_grads + fp32_grads,
                             step_temp=methods.step_temp_bytes(params, training.optimizer, True),
                             accumulated_grad_bytes=lp_grads, largest_grad_bytes=0.0)


def _state_model(spec: RunSpec, params: list[ParamInfo]) -> methods.StepModel:
    """The stage's weights, optimizer states and step on one device: ZeRO stage 0 without DeepSpeed's fp16/bf16
    modes steps the client optimizer itself, as a single GPU does; DeepSpeed's bf16 mode wraps BF16_Optimizer."""
    if spec.training.precision == "mixed_bf16":
        return _bf16_optimizer_model(spec, params)
    if spec.training.precision == "mixed_fp16":
        return _fp16_unfused_model(spec, params)
    return methods.single(spec.replace(parallel=ParallelSpec()), params)


def _reduce_bytes(spec: RunSpec, params: list[ParamInfo]) -> float:
    """The transient of ``ReduceGrads``. In bf16 mode (``_bf16_reduce_grads``) the one flat accumulation buffer is
    the bucket: flattening a single tensor is a view of it, and the communication dtype is its own (bf16)."""
    if spec.training.precision == "mixed_bf16":
        return 0.0
    return allreduce_bucket_bytes(params, 2 if spec.training.precision == "mixed_fp16" else FP32)


def _backward_segments(st: DsStage, num_layers: int) -> list[str]:
    seq = ["mid_bw"] if st.last else []
    for i in reversed(st.layers):
        seq.append("bw_first" if i == num_layers - 1 else "bw_last" if i == 0 else "bw")
    if st.first:
        seq.append("suffix")
    return seq


@dataclass(frozen=True)
class _StageSizes:
    """Bytes of the tensors one micro-batch moves through a stage."""
    boundary: float            # one hidden state between stages
    logits: float
    ids: float                 # one micro-batch's input ids (int64)
    rotary: float              # one decoder layer's own rotary cos/sin
    fw_layer: float            # what one decoder layer's forward keeps, its rotary tables included
    final_unmatched: float     # what the final segment's backward frees beyond its forward's allocation
    largest_layer: float       # the largest trainable tensor of a decoder layer / of the others on the stage
    largest_other: float
    slot_bytes: float          # what the last stage's buffer keeps across steps: logits, input and its gradient
    forward_net: float         # what one forward leaves allocated
    kept_after_backward: float  # what stays when a micro-batch's backward ends (input gradient, last logits)


def _stage_sizes(spec: RunSpec, segments: dict, st: DsStage, params: list[ParamInfo], hidden: int, act_bytes: int,
                 vocab: int) -> _StageSizes:
    b, s = spec.training.micro_batch_size, spec.training.seq_len
    boundary = b * s * hidden * act_bytes
    logits = b * s * vocab * act_bytes
    ids = b * s * INT64
    # each decoder layer's own rotary cos/sin, saved by its attention (the unsplit model's prefix: the embedding
    # output, the tables once and the position ids, which a DeepSpeed layer lets go)
    rotary = poly(segments["prefix"]["net_act"], b, s) - boundary - s * INT64
    final_unmatched = -(poly(segments["mid_fw"]["net_act"], b, s) + poly(segments["mid_bw"]["net_act"], b, s))
    fw_layer = poly(segments["fw"]["net_act"], b, s) + rotary
    # ids clone + embedding output, or the input clone; the layers; the last stage's head and logits
    forward_net = (ids + boundary if st.first else boundary) + len(st.layers) * fw_layer
    if st.last:
        forward_net += poly(segments["mid_fw"]["net_act"], b, s) + logits + final_unmatched
    return _StageSizes(
        boundary=boundary, logits=logits, ids=ids, rotary=rotary, fw_layer=fw_layer, final_unmatched=final_unmatched,
        largest_layer=float(max((p.nbytes for p in params if p.trainable and p.layer is not None), default=0)),
        largest_other=float(max((p.nbytes for p in params if p.trainable and p.layer is None), default=0)),
        slot_bytes=logits + 2 * boundary, forward_net=forward_net,
        kept_after_backward=(0.0 if st.first else boundary) + (logits if st.last else 0.0))


class _StageWalk:
    """The live bytes of one stage over ``TrainSchedule``'s passes (above the resident ``base``), and their
    peak."""

    def __init__(self, segments: dict, st: DsStage, sizes: _StageSizes, num_layers: int, b: int, s: int,
                 base: float) -> None:
        self.segments, self.st, self.sizes, self.num_layers, self.b, self.s = segments, st, sizes, num_layers, b, s
        self.base = base
        self.act = 0.0          # activations above base
        self.grads = 0.0
        self.live = 0           # micro-batches in flight
        self.pending_send = 0.0  # a received input and its gradient, until SendGrad at the next forward step
        self.started = False    # a backward has run this step: later ones accumulate into .grad
        self.best: tuple[float, str, int, dict] = (base, "setup", 0, {})

    def consider(self, total: float, phase: str, parts: dict) -> None:
        if total > self.best[0]:
            self.best = (total, phase, self.live, parts)

    def _consider_segment(self, name: str, level: float, phase: str) -> None:
        for cand_act, _g in self.segments[name]["candidates"]:
            a = level + poly(cand_act, self.b, self.s)
            self.consider(self.base + a + self.grads, phase, {"activations": a, "gradients": self.grads})

    def run(self, action: Action) -> None:
        # SendGrad of the previous backward: TrainSchedule alternates forward and backward steps, and the forward
        # step after a backward sends its input gradient even when it has no micro-batch left to run (cooldown)
        self.act -= self.pending_send
        self.pending_send = 0.0
        phase = f"{'forward' if action.kind == 'F' else 'backward'} of micro-batch {action.microbatch}"
        if action.kind == "F":
            self.forward(phase)
        else:
            self.backward(phase)

    def forward(self, phase: str) -> None:
        st, z = self.st, self.sizes
        self.live += 1
        if not st.first:
            self.act += z.boundary
        level = self.act + (z.ids + z.boundary if st.first else z.boundary)
        for _layer in st.layers:
            self._consider_segment("fw", level, phase)
            level += z.fw_layer
        if st.last:
            self._consider_segment("mid_fw", level, phase)
        self.act += z.forward_net
        self.consider(self.base + self.act + self.grads, phase, {"activations": self.act, "gradients": self.grads})
        if st.last and not st.first:  # the buffer's previous logits, input and gradient go as it is replaced
            self.act -= z.slot_bytes

    def backward(self, phase: str) -> None:
        st, z, b, s = self.st, self.sizes, self.b, self.s
        accumulating = self.started
        level = self.act
        for name in _backward_segments(st, self.num_layers):
            seg = self.segments[name]
            layer_seg = name in LAYER_BW
            transient = z.largest_layer if layer_seg else z.largest_other
            prev_act, prev_grad = 0.0, 0.0
            for cand_coeffs, cand_grad in seg["candidates"]:
                cand_act = poly(cand_coeffs, b, s)
                # accumulating: a fresh gradient is added into its ``.grad`` in place and let go. At a candidate
                # where the activations rose (an activation peak) the gradient made before it is gone (counted,
                # --trace: a middle stage's later backwards peak one 64 KiB gradient below its first); where they
                # did not, the candidate is that gradient's own allocation (the embedding's dense gradient,
                # beside its accumulator: the first stage's later backwards at pp 4), at most one tensor's
                fresh = min(max(0.0, cand_grad - prev_grad), transient) if cand_act <= prev_act else 0.0
                prev_act, prev_grad = cand_act, cand_grad
                g = self.grads + (fresh if accumulating else cand_grad)
                self.consider(self.base + level + cand_act + g, phase,
                              {"activations": level + cand_act, "gradients": g})
            level += poly(seg["net_act"], b, s) - (z.rotary if layer_seg else 0.0)
            if not accumulating:
                self.grads += seg["net_grad"]
        self.act += z.kept_after_backward - z.forward_net
        if not st.first and not st.last:
            self.pending_send = 2 * z.boundary  # the received input (counted at its receive) and its gradient
        self.live -= 1
        self.started = True
        self.consider(self.base + self.act + self.grads, phase, {"activations": self.act, "gradients": self.grads})

    def finish(self, reduce_bytes: float, model: methods.StepModel) -> None:
        """The step's last SendGrad, the gradient reduction and the optimizer step."""
        self.act -= self.pending_send
        self.pending_send = 0.0
        self.consider(self.base + self.act + self.grads + reduce_bytes, "gradient reduction (ReduceGrads)",
                      {"activations": self.act, "gradients": self.grads, "comm_buffers": reduce_bytes})
        self.consider(self.base + self.act + model.step_grads + model.step_temp, "optimizer_step",
                      {"activations": self.act, "gradients": model.step_grads, "temporaries": model.step_temp})


def _stage_resident(model: methods.StepModel, st: DsStage, sizes: _StageSizes, slots: int) -> dict[str, float]:
    """The stage's weights and optimizer states, the shared receive buffer, the first stage's input-id clones and
    the last stage's buffered logits (with their input and its gradient) kept across steps."""
    resident = dict(model.resident)
    resident["comm_buffers"] = float(sizes.boundary)
    resident["activations"] = float(slots * sizes.ids * (st.first + st.last)
                                    + (slots * sizes.slot_bytes if st.last and not st.first else 0))
    return resident


def ds_pipeline_rank(spec: RunSpec, segments: dict, table: list[ParamInfo], num_layers: int, hidden: int,
                     act_bytes: int, vocab: int, stage: int) -> PipelineRank:
    """The peak of pipeline stage ``stage`` over one steady ``train_batch`` (the buffers of the step before held),
    its gradient reduction and the optimizer step."""
    par, training = spec.parallel, spec.training
    st = ds_stage(ds_stage_bounds(table, num_layers, par.pp), stage, num_layers)
    params = ds_stage_params(table, st)
    model = _state_model(spec, params)
    sizes = _stage_sizes(spec, segments, st, params, hidden, act_bytes, vocab)
    slots = min(num_pipe_buffers(stage, par.pp, par.microbatches), par.microbatches)   # buffers a step fills
    resident = _stage_resident(model, st, sizes, slots)
    walk = _StageWalk(segments, st, sizes, num_layers, training.micro_batch_size, training.seq_len,
                      sum(resident.values()))
    for action in train_schedule_actions(stage, par.pp, par.microbatches):
        walk.run(action)
    walk.finish(_reduce_bytes(spec, params), model)
    total, phase, in_flight, parts = walk.best
    out = dict(resident)
    out["activations"] = resident["activations"] + parts.get("activations", 0.0)
    for key in ("gradients", "temporaries", "comm_buffers"):
        if parts.get(key):
            out[key] = out.get(key, 0.0) + parts[key]
    return PipelineRank(pp_rank=stage, stages=(stage,), parts=out, peak_bytes=total, phase=phase,
                        in_flight=in_flight)


# Settings the DeepSpeed pipeline estimate covers (checked on counted CPU runs); the others are refused in one line.
DS_PIPELINE_PRECISIONS = ("bf16", "fp32", "mixed_bf16", "mixed_fp16")


def check_ds_pipeline(spec: RunSpec) -> None:
    """ValueError("pp_engine: ...") for what the DeepSpeed pipeline estimate does not model (``check_pipeline``,
    run after, refuses tied embeddings, other model families and the long-context techniques)."""
    training = spec.training
    if training.precision not in DS_PIPELINE_PRECISIONS:
        raise ValueError(f"pp_engine: DeepSpeed's pipeline engine is not modelled in precision {training.precision} "
                         f"yet: use {', '.join(DS_PIPELINE_PRECISIONS)} (bf16 / fp32: the client optimizer steps "
                         "the weights; mixed_bf16 / mixed_fp16: DeepSpeed's bf16 / fp16 modes)")
    if training.grad_ckpt or training.ckpt_policy:
        raise ValueError("pp_engine: DeepSpeed's activation checkpointing (pipeline.activation_checkpoint_interval) "
                         "is not modelled yet")
    if training.lora or training.qlora:
        raise ValueError("pp_engine: LoRA under DeepSpeed's pipeline engine is not modelled yet")
    if training.optimizer not in ("adamw", "adamw_fused", "sgd"):
        raise ValueError(f"pp_engine: optimizer {training.optimizer} is not checked under DeepSpeed's pipeline "
                         "engine")


def torch_pipeline_twin(spec: RunSpec) -> RunSpec:
    """The spec ``check_pipeline`` (torch's pipelining) reads for what both engines share (model family, tied
    embeddings, long-context techniques): DeepSpeed's bf16 mode, which ``check_ds_pipeline`` has let through, read as
    the bf16 model it runs."""
    if spec.training.precision in ("mixed_bf16", "mixed_fp16"):
        return spec.replace(**{"training.precision": "bf16"})
    return spec


def _optimizer_words(spec: RunSpec) -> str:
    if spec.training.precision == "mixed_bf16":
        return ("DeepSpeed's bf16 mode (BF16_Optimizer: flat bf16 weights, fp32 masters and optimizer states, a bf16 "
                "gradient accumulation buffer)")
    if spec.training.precision == "mixed_fp16":
        return ("DeepSpeed's fp16 mode (FP16_UnfusedOptimizer around torch's AdamW: fp32 masters and optimizer "
                "states per tensor, dynamic loss scaling)")
    return "the client optimizer"


def _dp_words(spec: RunSpec) -> str:
    dp = spec.parallel.dp
    if dp == 1:
        return ""
    split = (f", its fp32 masters and optimizer states split over the {dp} data-parallel ranks of each stage"
             if spec.training.precision == "mixed_bf16" else "")
    return f", each stage replicated over {dp} data-parallel ranks (its gradients all-reduced at ReduceGrads){split}"


def ds_pipeline_notes(spec: RunSpec, bounds: list[int], num_layers: int) -> list[str]:
    par = spec.parallel
    split = []
    for stage in range(par.pp):
        st = ds_stage(bounds, stage, num_layers)
        what = (["embedding"] if st.first else []) + ([f"{len(st.layers)} decoder layers"] if st.layers else []) \
            + (["norm + head + loss"] if st.last else [])
        split.append(" + ".join(what))
    return [f"pp: DeepSpeed's pipeline engine, {par.pp} stages split by parameter count (partition_method "
            f"'parameters'): {'; '.join(split)}; TrainSchedule (1F1B), {par.microbatches} micro-batches of "
            f"{spec.training.micro_batch_size} rows per train_batch, ZeRO stage 0 with {_optimizer_words(spec)}"
            f"{_dp_words(spec)}; its "
            "shared receive buffer, input clones, the last stage's buffered logits (kept across steps) and the "
            "flattened gradient buckets of ReduceGrads counted"]
