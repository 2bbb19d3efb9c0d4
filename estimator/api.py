"""``estimate(spec)``: per-rank peak allocated / reserved / device memory of one fine-tuning configuration."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from estimator.hardware import residuals
from estimator.hardware.gpus import get_gpu
from estimator.hardware.memory_cap import cap_notes, capacity_under_cap_bytes
from estimator.methods import expert_parallel
from estimator.methods import state as methods
from estimator.methods.context_parallel import (
    Ring,
    cp_notes,
    local_seq_len,
    output_projection_saves_input,
    ring_of,
)
from estimator.methods.fsdp1 import check_fsdp1, fsdp1
from estimator.methods.long_context import (
    ACT_BYTES,
    LIGER_MARK,
    checkpointed,
    head_shape,
    liger_chunk_rows,
    liger_transient_bytes,
    mixed_layers,
    with_transient,
)
from estimator.methods.pipeline_rank import (
    check_pipeline,
    every_k_segments,
    pipeline_notes,
    pipeline_rank,
    reported_pp_ranks,
    with_accumulating_candidates,
)
from estimator.methods.router_unit import router_segments
from estimator.methods.timeline import Replay, at_depth, loop_segments, poly, replay, replayed_depth
from estimator.models.arch import ModelArch, spec_arch
from estimator.models.memo import memo_by_owner
from estimator.models.moe import (
    check_forward_only_layers,
    check_forward_only_layers_before_trace,
    experts_breakdown,
    moe_facts,
    moe_notes,
    qlora_experts_note,
)
from estimator.models.moe_ep import EpLayout, ep_notes
from estimator.models.params import buffer_bytes, expand_params, param_counts
from estimator.models.profiles import adapters_in_16bit, run_adapters_in_16bit, traced_release, versions_note
from estimator.models.tp_plans import check_tp
from estimator.models.zero3_leaf import table_leaves
from estimator.profiler.cache import load_model_profile, load_plain_and_checkpointed
from estimator.spec import FSDP_METHODS, ParallelSpec, RunSpec, TrainingSpec, ckpt_every

GIB = 1024**3
COMPONENTS = ("weights", "buffers", "gradients", "optimizer_states", "master_weights", "activations", "outputs_held",
              "comm_buffers", "gathered_params", "temporaries", "cublas_workspace", "allocator_rounding")
# Allocated bytes only a GPU holds: cuBLAS workspaces, and the remainders (< 1 MiB each) the caching allocator
# leaves inside the blocks it hands out, which torch.cuda.max_memory_allocated counts.
GPU_ONLY_COMPONENTS = ("cublas_workspace", "allocator_rounding")


@dataclass(frozen=True)
class RankEstimate:
    rank: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_device_bytes: int
    breakdown: dict[str, int]
    phase: str
    # Where peak_reserved_bytes comes from: "replayed" (this rank's timeline through the caching-allocator model,
    # estimator.reserved) or "prior" (allocated x (1 + reserved_slack_ratio) + reserved_slack_bytes).
    reserved_source: str = "prior"
    fragmentation_bytes: int | None = None     # replayed: reserved - allocated at the reserved peak
    # replayed: cache flushes and retries under the allowance (the GPU's memory less the context, or the allocator
    # cap ``training.memory_cap_bytes`` where smaller)
    num_alloc_retries: int | None = None
    # replayed under a memory fraction with ``garbage_collection_threshold``: cached blocks its collection freed
    gc_released_bytes: int = 0
    allocator_oom: bool = False                # replayed: the allocator runs out of memory under that allowance
    replayed_steps: int | None = None          # replayed: steps until the cache repeated
    # replayed with decide_fit: stopped once the reserved level proved the spec does not fit, so the reserved and
    # device levels are lower bounds (what the rank had reserved by then)
    reserved_lower_bound: bool = False
    # The device level the training steps hold (replayed: from ReservedReplay.held_reserved_bytes). Equal to
    # peak_device_bytes unless the replay reached the capacity and retried after freeing the cache: then the
    # peak above it lasts until the retry, and every later step holds this level (what a once-a-second sampler
    # of nvidia-smi reads through a run; the peak is what must fit). None: same as peak_device_bytes.
    held_device_bytes: int | None = None

    @property
    def traced_allocated_bytes(self) -> int:
        """The allocated peak less what only a GPU holds (GPU_ONLY_COMPONENTS): what a CPU trace of the same
        program, or a CPU run counting its live storages, measures."""
        return self.peak_allocated_bytes - sum(self.breakdown.get(k, 0) for k in GPU_ONLY_COMPONENTS)


@dataclass(frozen=True)
class Estimate:
    spec: RunSpec
    ranks: list[RankEstimate]
    worst_rank: int
    capacity_bytes: int
    upper_bound_bytes: int
    host_ram_bytes: int
    calibrated: bool
    gpu_key: str
    params: int
    trainable_params: int
    notes: list[str] = field(default_factory=list)
    alloc_conf: str = ""
    # The transformers release (major.minor) whose model code the profile traced ("" when it does not say).
    model_code: str = ""
    # A mixture-of-experts model: the routed experts' part of the worst rank's weights, gradients and optimizer
    # states (``estimator.models.moe.experts_breakdown``); empty for a dense model.
    experts_breakdown: dict[str, int] = field(default_factory=dict)

    def _worst(self) -> RankEstimate:
        return next(r for r in self.ranks if r.rank == self.worst_rank)

    @property
    def peak_allocated_bytes(self) -> int:
        return self._worst().peak_allocated_bytes

    @property
    def peak_reserved_bytes(self) -> int:
        return self._worst().peak_reserved_bytes

    @property
    def peak_device_bytes(self) -> int:
        return self._worst().peak_device_bytes

    @property
    def held_device_bytes(self) -> int:
        """The worst rank's device level held through the steps (RankEstimate.held_device_bytes)."""
        worst = self._worst()
        return worst.peak_device_bytes if worst.held_device_bytes is None else worst.held_device_bytes

    @property
    def breakdown(self) -> dict[str, int]:
        return self._worst().breakdown

    @property
    def traced_allocated_bytes(self) -> int:
        return self._worst().traced_allocated_bytes

    @property
    def phase(self) -> str:
        return self._worst().phase

    @property
    def reserved_source(self) -> str:
        return self._worst().reserved_source

    @property
    def memory_cap_bytes(self) -> int | None:
        """The allocator cap the spec sets (``training.memory_cap_bytes``), None without one."""
        return self.spec.training.memory_cap_bytes or None

    @property
    def fits(self) -> bool:
        return self.upper_bound_bytes <= self.capacity_bytes and not any(r.allocator_oom for r in self.ranks)

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.peak_device_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.spec.model, "method": self.spec.parallel.method,
            "world_size": self.spec.parallel.world_size, "tp": self.spec.parallel.tp, "gpu": self.gpu_key,
            "peak_allocated_bytes": self.peak_allocated_bytes, "peak_reserved_bytes": self.peak_reserved_bytes,
            "peak_device_bytes": self.peak_device_bytes, "upper_bound_bytes": self.upper_bound_bytes,
            "traced_allocated_bytes": self.traced_allocated_bytes,
            "reserved_source": self.reserved_source, "alloc_conf": self.alloc_conf,
            "capacity_bytes": self.capacity_bytes, "memory_cap_bytes": self.memory_cap_bytes,
            "fits": self.fits, "headroom_bytes": self.headroom_bytes,
            "host_ram_bytes": self.host_ram_bytes, "phase": self.phase, "worst_rank": self.worst_rank,
            "breakdown": self.breakdown, "experts_breakdown": self.experts_breakdown,
            "ranks": [asdict(r) for r in self.ranks],
            "params": self.params, "trainable_params": self.trainable_params,
            "calibrated": self.calibrated, "model_code": self.model_code, "notes": list(self.notes),
            "spec": self.spec.to_dict(),
        }


@dataclass(frozen=True)
class StepSequence:
    """The shapes of the steps a rank runs, in order, for the reserved replay (``estimator.batching``: an
    epoch's batches); ``empty_cache_every``: the loop calls ``torch.cuda.empty_cache()`` every that many steps
    (HF Trainer's ``torch_empty_cache_steps``)."""

    shapes: tuple[tuple[int, int], ...]
    empty_cache_every: int | None = None


# Methods whose replay takes a mixed layer sequence (every-k): ``methods.timeline.replay`` walks it segment by
# segment (ZeRO-3's gathers by each layer's place: ``extra_bytes``), FSDP2's and FSDP1's replays layer by layer with
# their events at each boundary (``methods.fsdp_replay._walk_mixed``, ``methods.fsdp1._mixed_schedule``); dp_tp
# (FSDP2 over a TP-local model) as fsdp on the TP profile, checked by its reserved replay, whose requested peak is
# this estimate's and whose request stream a real 2 x 2 CPU run's (``tests/estimator/test_reserved_fsdp.py``).
MIXED_LAYER_METHODS = ("single", "ddp", "tp", "zero1", "zero2", "zero_offload", "fsdp", "dp_tp", "fsdp1", "zero3")


def check_spec(spec: RunSpec, arch: ModelArch) -> None:
    """Model-dependent validation (the spec validates itself on construction)."""
    training, parallel = spec.training, spec.parallel
    if ckpt_every(training.ckpt_policy) is not None and parallel.method not in MIXED_LAYER_METHODS:
        raise ValueError(f"ckpt_policy: every-k is replayed for {', '.join(MIXED_LAYER_METHODS)}; "
                         f"{parallel.method} is not checked against an oracle with it yet")
    if ckpt_every(training.ckpt_policy) is not None and parallel.ep > 1:
        raise ValueError("ckpt_policy: every-k with expert parallelism is not modelled (the experts' units read "
                         "the profile's event list, which a mixed profile does not have)")
    if training.ce == "fused_linear" and training.precision not in ACT_BYTES:
        raise ValueError(f"ce: Liger's fused loss under autocast ({training.precision}) is not modelled; use "
                         f"{', '.join(ACT_BYTES)}")
    if arch.max_positions and training.seq_len > arch.max_positions:
        raise ValueError(f"seq_len: {training.seq_len} exceeds the model's {arch.max_positions} positions")
    if parallel.tp > 1:
        check_tp(arch, parallel.tp)  # "tp: ..." for a family without a plan or a split that does not divide


def _regime(profile: dict, b: int, s: int) -> dict:
    for regime in profile["regimes"]:
        if (regime["b_min"] <= b and (regime["b_max"] is None or b <= regime["b_max"])
                and regime["s_min"] <= s and (regime["s_max"] is None or s <= regime["s_max"])):
            return regime
    raise ValueError(f"seq_len: no profiled regime covers micro-batch {b}, sequence {s}")


def held_outputs_bytes(regime: dict, loop: str, b: int, s: int) -> float:
    """What a manual loop keeps bound besides the loss at every moment of the step: the model's output object
    (logits, and any other tensor the model returns)."""
    if loop != "manual":
        return 0.0
    return sum(poly(coeffs, b, s) for coeffs in regime["outputs_held"].values())


def fp32_outputs_extra_bytes(regime: dict, training: TrainingSpec, b: int, s: int) -> float:
    """What ``outputs_fp32`` (accelerate's mixed-precision forward wrapper) adds to a manual loop's held output
    object: each 16-bit tensor is held as an fp32 copy, twice its bytes, at every moment of the step. The 16-bit
    original goes unless the graph saved it (then both stay until backward frees it: counted over the whole
    step, an upper bound). The trainer loop drops the copies with the object: not counted (the copy's moment at
    the forward's end is not modelled; it was not the peak where measured, docs/LOG.md 2026-11-25)."""
    if training.loop != "manual" or not training.outputs_fp32:
        return 0.0
    sixteen = regime["outputs_held_16bit"]
    return poly(sixteen["dropped"], b, s) + 2 * poly(sixteen["saved"], b, s)


_STEP_MODELS: dict[tuple, tuple[list, methods.StepModel]] = {}


def _step_model(spec: RunSpec, table, rank: int = 0, path: methods.Zero12Rank | None = None,
                attention_view: bool = True, leaves: tuple[str, ...] = ()) -> methods.StepModel:
    """The method's step model, memoized per table: it depends on the layout, the precision and the optimizer,
    not on the micro-batch or the sequence (a plan's search asks for the same one at every micro-batch)."""
    training = spec.training  # checkpointing's flavour and the model code: what FSDP1 keeps of the layer inputs
    key = (spec.parallel, training.precision, training.optimizer, id(table), rank, path,
           (training.grad_ckpt, training.ckpt_reentrant, training.model_code) if spec.parallel.method == "fsdp1"
           # ZeRO-3's frozen Linear inputs: which are saved, and for how long
           else (training.lora_dropout, training.grad_ckpt, training.ckpt_policy, training.ce, training.qlora)
           if spec.parallel.zero_stage == 3 else None, attention_view, leaves)
    return memo_by_owner(_STEP_MODELS, key, table,
                         lambda: _new_step_model(spec, table, rank, path, attention_view, leaves), limit=1024)


def _new_step_model(spec: RunSpec, table, rank: int, path: methods.Zero12Rank | None,
                    attention_view: bool = True, leaves: tuple[str, ...] = ()) -> methods.StepModel:
    method = spec.parallel.method
    if method in ("single", "tp"):
        return methods.single(spec, table)
    if method == "ddp":
        return methods.ddp(spec, table)
    if method == "fsdp1":
        return fsdp1(spec, table, rank)
    if method in ("fsdp", "dp_tp"):
        # dp_tp: FSDP2 over the dp axis of a TP-local model.
        sharded = spec if method == "fsdp" else spec.replace(parallel=ParallelSpec(method="fsdp",
                                                                                   world_size=spec.parallel.dp))
        return methods.fsdp(sharded, table)
    return methods.zero(spec, table, rank, path, attention_view, leaves)


def _activation_split(segments: dict, peak: Replay, num_layers: int, b: int, s: int) -> tuple[float, float]:
    """(layer activations, logits/loss and the rest) of the activation bytes at the peak, for display."""
    layers = poly(segments["prefix"]["net_act"], b, s)
    for name, reps in (("fw_first", 1), ("fw", max(num_layers - 2, 0)), ("fw_last", 1)):
        layers += reps * poly(segments[name]["net_act"], b, s)
    layer_part = min(max(layers, 0.0), peak.peak_act_bytes)
    return layer_part, peak.peak_act_bytes - layer_part


_TABLES: dict[tuple, tuple[dict, list]] = {}


def technique_segments(segments: dict, profile: dict, training: TrainingSpec) -> dict:
    """The segments with what a traced profile leaves out of a technique: Liger's chunk loop (``fused_linear``),
    sized for this micro-batch (``methods.long_context``)."""
    if training.ce != "fused_linear":
        return segments
    vocab, hidden = head_shape(profile["params"])
    tokens = training.micro_batch_size * training.seq_len
    return with_transient(segments, LIGER_MARK, liger_transient_bytes(training.precision, tokens, vocab, hidden,
                                                                      head_trains=not training.lora))


def every_k_profile(model: str, training: TrainingSpec, tp: int, every: int, *, allow_build: bool = True,
                    adapters_16bit: bool = False) -> tuple[ModelArch, dict]:
    """The profile of every-k checkpointing: each regime's segments mixed layer by layer from the checkpointed
    and the plain profile (``methods.long_context.mixed_layers``). Without an event list: the reserved level
    keeps the prior (``why_not``)."""
    arch, plain, ckpt = load_plain_and_checkpointed(model, training, tp, allow_build=allow_build,
                                                    adapters_16bit=adapters_16bit)
    regimes = []
    for mine, theirs in zip(plain["regimes"], ckpt["regimes"]):
        mixed = {k: v for k, v in mine.items() if k != "events"}
        frozen = theirs.get("frozen_layers", 0)  # layers before the first adapter: the prefix's and suffix's
        if mine.get("frozen_layers", 0) != frozen:
            raise ValueError(f"ckpt_policy: every-k: the plain and the checkpointed profile disagree on the layers "
                             f"before the first adapter ({mine.get('frozen_layers', 0)} and {frozen})")
        for key in ("segments", "segments_manual"):
            mixed[key] = mixed_layers(mine[key], theirs[key], replayed_depth(theirs, arch.num_layers), every,
                                      frozen)
        regimes.append(mixed)
    return arch, {**plain, "regimes": regimes, "mixed_layers": f"every-k:{every}"}


def _technique_notes(training: TrainingSpec, profile: dict, num_layers: int) -> list[str]:
    """What each long-context technique was taken to be."""
    notes = []
    if training.ce == "chunked":
        notes.append(f"ce: chunked — torchtune's LinearCrossEntropyLoss, {training.ce_chunks} sequence chunks, "
                     "eager (torchtune leaves its compile off): the head and the fp32 cross-entropy one chunk at a "
                     "time; each chunk's fp32 log-softmax stays saved for backward; every position counted as "
                     "trained (it projects the trained ones only: with prompt-masked rows this is an upper bound)")
    elif training.ce == "fused_linear":
        vocab, hidden = head_shape(profile["params"])
        tokens = training.micro_batch_size * training.seq_len
        rows = liger_chunk_rows(tokens, vocab, hidden)
        buffer = liger_transient_bytes(training.precision, tokens, vocab, hidden, head_trains=not training.lora)
        notes.append(f"ce: fused_linear — Liger's fused linear cross-entropy on its CUDA path (modelled from its "
                     f"source; Triton does not run here): chunks of {rows} tokens, a {buffer / GIB:.2f} GiB "
                     "transient; the hidden states' and the head's gradients made in the forward and held until "
                     "backward")
    if training.activation_offload:
        notes.append("activation offload: save_on_cpu(pin_memory=True) around the forward — every tensor saved "
                     "for backward (weights included) waits in pinned host memory (not counted here) and returns "
                     "to the GPU when its node's backward unpacks it")
    every = ckpt_every(training.ckpt_policy)
    if every is not None:
        layers = sum(checkpointed(num_layers, every))
        notes.append(f"ckpt_policy: every-k:{every} — {layers} of {num_layers} decoder layers checkpointed "
                     f"(layers {every - 1}, {2 * every - 1}, ...: torchtitan's and torchtune's count), the others "
                     "keep their activations; each layer replayed from the checkpointed or the plain profile")
    elif training.ckpt_policy == "selective-ops":
        notes.append("ckpt_policy: selective-ops — torchtitan's op policy in every layer: matmul outputs saved "
                     "but every second one (counted per checkpointed call), attention outputs saved, the rest "
                     "recomputed")
    return notes


def _param_table(profile: dict, num_layers: int) -> list:
    """The expanded parameter table, memoized per loaded profile (a plan asks for it ~100 times)."""
    def table() -> list:
        out = expand_params(profile["params"], num_layers)
        out.model_type = profile.get("model_type", "")
        return out
    return memo_by_owner(_TABLES, (id(profile), num_layers), profile, table)


def _replay(model: methods.StepModel, segments: dict, num_layers: int, b: int, s: int, *, accumulating: bool
            ) -> Replay:
    if model.replay is not None:
        return model.replay(segments, num_layers, b, s, accumulating)
    policy = model.grad_policy
    if accumulating:
        held, in_flight = model.accumulated_grad_bytes, model.largest_grad_bytes

        def policy(prev: float, within: float) -> float:
            return held + min(within, in_flight)
    return replay(segments, num_layers, b, s, grad_policy=policy, extra_bytes=model.segment_extra,
                  saved_per_token=model.segment_saved_per_token)


def _grad_sync_note(spec: RunSpec) -> list[str]:
    if spec.training.grad_accum_steps == 1 or spec.parallel.method not in FSDP_METHODS:
        return []
    if spec.training.grad_sync == "last":
        return ["grad_sync: last — every micro-batch but the last runs under no_sync (the HF Trainer, accelerate's "
                "accumulate()): the unsharded gradients are held between micro-batches"]
    return ["grad_sync: every — the gradients are reduce-scattered on every micro-batch (torchtitan, accelerate's "
            "sync_each_batch=True); the HF Trainer's default holds them unsharded in between: --grad-sync last"]


def _micro_batches(spec: RunSpec) -> tuple:
    """The kinds of micro-batch whose forward and backward can set the peak (``methods.fsdp_replay``)."""
    k = spec.training.grad_accum_steps
    if k == 1:
        return (False,)
    if spec.training.grad_sync == "last" and spec.parallel.method in FSDP_METHODS:
        from estimator.methods.fsdp_replay import SYNCED_LAST, UNSYNCED_FIRST, UNSYNCED_LATER

        return (UNSYNCED_FIRST, UNSYNCED_LATER, SYNCED_LAST) if k > 2 else (UNSYNCED_FIRST, SYNCED_LAST)
    return (False, True)


def _rank_estimate(spec: RunSpec, arch: ModelArch, profile: dict, table: list, coeffs, rank: int,
                   path: methods.Zero12Rank | None = None, alloc_conf: str | None = None,
                   sequence: StepSequence | None = None, decide_fit: bool = False, layout: EpLayout | None = None,
                   ring: Ring | None = None, ep_recompute: dict[str, float] | None = None
                   ) -> tuple[RankEstimate, methods.StepModel]:
    training = spec.training
    b, s = training.micro_batch_size, training.seq_len
    leaves = table_leaves(spec.parallel.zero, table) if spec.parallel.zero_stage == 3 else ()
    model = _step_model(spec, table, rank, path, attention_view=methods.attention_output_saved(profile),
                        leaves=leaves)
    regime = _regime(profile, b, s)
    segments = technique_segments(loop_segments(regime, training.loop, arch.num_layers), profile, training)
    if ring is not None:  # the ring attention's transients at each flash call (spec: this rank's local sequence)
        segments = ring.segments(segments, regime, rank, b, s)
    if layout is not None:
        segments = expert_parallel.ep_segments(segments, regime, table, layout, training, arch.num_layers, b, s,
                                               profile["params"], ep_recompute)
    if spec.parallel.method == "fsdp":  # a module kept in fp32 is an FSDP2 unit of its own (DeepSeek's router)
        segments = router_segments(segments, regime, table, profile["params"], training.precision,
                                   arch.num_layers, b, s)
    fb = None
    for micro in _micro_batches(spec):  # a later micro-batch starts with gradients held
        candidate = _replay(model, segments, arch.num_layers, b, s, accumulating=micro)
        if fb is None or candidate.peak_bytes > fb.peak_bytes:
            fb = candidate
    buffers = buffer_bytes(profile["params"], arch.num_layers)  # module buffers: every rank, never sharded
    resident = sum(model.resident.values()) + buffers
    workspace = residuals.cublas_workspace_bytes(coeffs)
    fp32_copies = fp32_outputs_extra_bytes(regime, training, b, s)  # held at every moment of a manual loop's step
    fb_total = resident + fb.peak_bytes + fp32_copies
    step_total = resident + max(fb.end_act_bytes, 0.0) + model.step_grads + model.step_temp + fp32_copies
    held = held_outputs_bytes(regime, training.loop, b, s)
    ep_forward = expert_parallel.forward_peak(spec, arch, table, regime, model, layout, b, s)
    if ep_forward is not None and resident + ep_forward[0] > max(fb_total, step_total):
        fb_total = resident + ep_forward[0] + fp32_copies
        parts = {**model.resident, "activations": ep_forward[1], "gathered_params": model.forward_gathered_bytes}
        phase = "forward"
    elif fb_total >= step_total:
        depth = replayed_depth(regime, arch.num_layers)
        layer_act, other_act = _activation_split(at_depth(regime["segments"], depth), fb, depth, b, s) \
            if "sequence" not in segments or depth != arch.num_layers else (0.0, fb.peak_act_bytes)
        parts = {**model.resident, "gradients": model.resident.get("gradients", 0.0) + fb.peak_grad_bytes,
                 "activations": layer_act + other_act - held}
        for key, value in fb.peak_parts.items():
            parts[key] = parts.get(key, 0.0) + value
        phase = fb.phase
    else:
        parts = {**model.resident, "gradients": model.resident.get("gradients", 0.0) + model.step_grads,
                 "activations": max(fb.end_act_bytes, 0.0) - held,
                 "temporaries": model.step_temp}
        phase = "optimizer_step"
    parts["outputs_held"] = held + fp32_copies
    parts["buffers"] = buffers
    parts["cublas_workspace"] = workspace
    communicators = _communicators(spec)
    replayed = _replayed(spec, arch, profile, table, coeffs, regime, communicators, alloc_conf, sequence, rank,
                         decide_fit)
    flush = 0.0
    if replayed is not None:  # the replay hands out the blocks the GPU would: their unsplit remainders count
        parts["allocator_rounding"] = max(0, replayed.peak_allocated_bytes - replayed.peak_requested_bytes)
        flush = _zero_flush_bytes(spec, replayed, max(fb_total, step_total) + workspace)
        parts["comm_buffers"] = parts.get("comm_buffers", 0.0) + flush
    breakdown = {k: int(round(parts.get(k, 0.0))) for k in COMPONENTS if parts.get(k)}
    allocated = int(round(max(fb_total, step_total) + workspace + flush + parts.get("allocator_rounding", 0)))
    if replayed is None:
        reserved = residuals.reserved_from_allocated(allocated, coeffs)
        allocator_fields = {}
    else:
        reserved = replayed.peak_reserved_bytes
        allocator_fields = {"reserved_source": "replayed", "fragmentation_bytes": replayed.fragmentation_bytes,
                            "num_alloc_retries": replayed.num_alloc_retries, "allocator_oom": replayed.oom,
                            "replayed_steps": replayed.steps, "reserved_lower_bound": replayed.stopped_above,
                            "gc_released_bytes": replayed.gc_released_bytes}
        if replayed.held_reserved_bytes is not None and replayed.held_reserved_bytes < reserved:
            allocator_fields["held_device_bytes"] = residuals.device_from_reserved(
                replayed.held_reserved_bytes, coeffs, communicators)
    device = residuals.device_from_reserved(reserved, coeffs, communicators)
    return RankEstimate(rank=rank, peak_allocated_bytes=allocated, peak_reserved_bytes=reserved,
                        peak_device_bytes=device, breakdown=breakdown, phase=f"{phase} (steady step)",
                        **allocator_fields), model


def _zero_flush_bytes(spec: RunSpec, replayed, step_model_bytes: float) -> float:
    """ZeRO-1/2: what the replay's requested peak holds above the step model's, at an IPG flush: DeepSpeed
    concatenates the bucket's slices of several partitions into one buffer for the reduction (up to
    ``reduce_bucket_size`` elements; ``estimator.reserved.zero``), an instant the step model's segment candidates
    do not place. The replay also holds the input batch, which the step model leaves out."""
    if spec.parallel.method not in ("zero1", "zero2"):
        return 0.0
    from estimator.reserved.timeline import BATCH_TENSORS, INT64

    batch = BATCH_TENSORS * INT64 * spec.training.micro_batch_size * spec.training.seq_len
    return max(0.0, replayed.peak_requested_bytes - batch - step_model_bytes)


def _communicators(spec: RunSpec) -> int:
    """NCCL communicators whose buffers a rank holds outside the allocator (dp_tp: the dp and the tp group)."""
    return 0 if spec.parallel.world_size == 1 else (2 if spec.parallel.method == "dp_tp" else 1)


def _replayed(spec: RunSpec, arch: ModelArch, profile: dict, table: list, coeffs, regime: dict,
              communicators: int, alloc_conf: str | None, sequence: StepSequence | None = None, rank: int = 0,
              decide_fit: bool = False):
    """This rank's reserved peak replayed through the caching-allocator model, or None where the prior stands
    (``estimator.reserved.rank.why_not``). The allocator may use the GPU's memory less the CUDA context and the
    NCCL buffers. ``sequence``: the steps' shapes in order (an epoch of mixed batch shapes), not identical
    steps of the spec's shape. ``decide_fit``: stop once the reserved level proves the spec does not fit."""
    from estimator.profiler.expand import ExpansionError
    from estimator.reserved.rank import replay_reserved, replay_reserved_sequence, why_not

    if alloc_conf is None or why_not(spec, regime, arch.num_layers, table) is not None:
        return None
    capacity = get_gpu(spec.gpu).capacity_bytes
    allowed = capacity - coeffs.cuda_context_bytes - communicators * coeffs.nccl_bytes_per_communicator
    # set_per_process_memory_fraction: the allocator stops at its cap, and only then runs its garbage collection
    # (garbage_collection_threshold x the cap), whether or not the GPU would stop it first
    fraction_cap = spec.training.memory_cap_bytes or None
    if fraction_cap and fraction_cap < allowed:
        capacity = residuals.device_from_reserved(fraction_cap, coeffs, communicators)
    stop = residuals.reserved_fit_limit_bytes(capacity, coeffs, communicators) if decide_fit else None
    options = dict(workspace_bytes=coeffs.cublas_workspace_bytes, workspaces=coeffs.cublas_workspaces,
                   allowed_bytes=max(allowed, 0), conf_text=alloc_conf, rank=rank, stop_above_bytes=stop,
                   fraction_cap_bytes=fraction_cap)
    try:
        if sequence is not None:
            return replay_reserved_sequence(spec, profile, regime, table, arch.num_layers, list(sequence.shapes),
                                            empty_cache_every=sequence.empty_cache_every, **options)
        return replay_reserved(spec, profile, regime, table, arch.num_layers, **options)
    except ExpansionError:
        return None


def _reserved_note(spec: RunSpec, profile: dict, worst: RankEstimate, alloc_conf: str | None,
                   num_layers: int, sequence: StepSequence | None = None) -> str:
    if worst.reserved_source == "replayed":
        limit = "the allocator cap" if spec.training.memory_cap_bytes else "the GPU's capacity"
        oom = f"; the allocator runs OUT OF MEMORY under {limit}" if worst.allocator_oom else ""
        steps = f"{worst.replayed_steps} steps until the cache repeats"
        if worst.reserved_lower_bound:
            where = f"step {worst.replayed_steps}" if worst.replayed_steps else "the setup"
            steps = (f"stopped after {where}, in which the reserved level proved that the run does not fit: "
                     "reserved and device levels are lower bounds")
        elif sequence is not None:
            emptied = f", empty_cache() every {sequence.empty_cache_every}" if sequence.empty_cache_every else ""
            steps = (f"the {worst.replayed_steps} steps of {len(set(sequence.shapes))} batch shapes in their "
                     f"order{emptied}")
        from estimator.reserved.zero3 import record_stream_caveat

        caveat = record_stream_caveat(spec)
        return (f"reserved: replayed through the caching-allocator model (setup + {steps}; "
                f"PYTORCH_CUDA_ALLOC_CONF={alloc_conf or '(defaults)'}; fragmentation "
                f"at the reserved peak {worst.fragmentation_bytes / GIB:.2f} GiB; "
                f"{worst.num_alloc_retries} alloc retries{oom}){f'; {caveat}' if caveat else ''}")
    from estimator.reserved.rank import why_not

    regime = _regime(profile, spec.training.micro_batch_size, spec.training.seq_len)
    reason = why_not(spec, regime, num_layers, _param_table(profile, num_layers)) if alloc_conf is not None \
        else "replay off"
    return f"reserved: prior allocated x (1 + slack ratio) + slack bytes ({reason or 'the event list cannot be repeated for this depth'})"


def _layers_note(profile: dict) -> list[str]:
    """Decoder layers that are not all alike (e.g. a dense first layer before mixture-of-experts ones)."""
    params = profile["params"]
    if not params.get("layers_differ"):
        return []
    depth = profile.get("provenance", {}).get("profile_layers", 3)
    frozen = params.get("frozen_layers", 0)
    traced = (f"its first {frozen} layer(s) forward only, as backward never reaches them (no adapter there), then "
              "the first, generic and last layer backward reaches") if frozen else "its first, generic and last layer"
    if params.get("layer_kinds"):
        return [f"layers: {len(params['layer_kinds']['rows'])} kinds of decoder layer; weights, gradients and "
                f"optimizer states counted layer by layer, activations from the {depth}-layer trace ({traced})"]
    return [f"layers: decoder layer(s) {params['layers_differ']} of the {depth}-layer trace hold other parameters "
            "than layer 1 (e.g. a dense first layer before mixture-of-experts ones); weights, gradients and "
            "optimizer states count every layer as layer 1"]


def _batch_note(training: TrainingSpec, profile: dict) -> list[str]:
    """Which batch the SDPA estimate assumed: padding makes transformers build the 4-D attention mask."""
    if profile.get("attn_effective") != "sdpa" or training.attn != "sdpa":
        return []
    if training.batch == "padded":
        return ["batch: padded — transformers builds the 4-D attention mask; SDPA keeps it per layer and repeats "
                "grouped key/value heads"]
    return ["batch: full — every row full length (or packed): no attention mask; padded rows (--batch padded, "
            "or --lengths) take the mask path, which keeps more per layer"]


DEPTH_CHECK_TOLERANCE = 0.002


def _depth_note(regime: dict) -> list[str]:
    """The profile's own check (``layer_check``: its 3 traced layers replayed at 4 against a 4-layer trace): a
    miss means the layers are not all alike (e.g. alternating sliding and full attention) and the estimate is
    off by about that much per extra layer."""
    check = regime.get("layer_check") or {}
    error = check.get("rel_error")
    if error is None or abs(error) <= DEPTH_CHECK_TOLERANCE:
        return []
    side = "under" if error > 0 else "over"  # rel_error = (traced - replayed) / traced
    return [f"depth check: this architecture's layers are not all alike (e.g. alternating attention types); the "
            f"profile replayed at 4 layers is {side} a 4-layer trace by {abs(100 * error):.1f} %: expect an error "
            "of that order at other depths"]


def _loop_note(training: TrainingSpec, profile: dict) -> str:
    """Which training loop the estimate assumed, and what the other one would hold besides."""
    b, s = training.micro_batch_size, training.seq_len
    regime = _regime(profile, b, s)
    manual = dataclasses.replace(training, loop="manual")
    held_gib = (held_outputs_bytes(regime, "manual", b, s) + fp32_outputs_extra_bytes(regime, manual, b, s)) / GIB
    copies = " as fp32 copies (outputs_fp32: accelerate's mixed-precision wrapper)" if training.outputs_fp32 else ""
    if training.loop == "manual":
        return (f"loop: manual — the model's output object ({held_gib:.2f} GiB: logits and any other returned "
                f"tensor{copies}) stays bound through backward and the optimizer step, until the next forward "
                "rebinds it")
    return (f"loop: trainer — the output object is dropped before backward (HF Trainer, TRL, torchtune); a loop "
            f"that keeps `outputs` alive (--loop manual) holds {held_gib:.2f} GiB more")


def _undominated(paths: list[methods.Zero12Rank]) -> list[int]:
    """Ranks whose ZeRO-1/2 gradient path no other rank's dominates (a rank with at least as large a buffer,
    norm piece and reduction peak, whose buffer appears no later in backward holds at least as much at every
    moment); the lowest rank of identical ones."""
    def key(r: int) -> tuple:
        p = paths[r]
        return (p.buffer_numel, p.largest_piece, p.reduction_held, -p.appears_at)
    front: list[int] = []
    for r in sorted(range(len(paths)), key=lambda r: (tuple(-x for x in key(r)), r)):
        if not any(all(a >= b for a, b in zip(key(f), key(r))) for f in front):
            front.append(r)
    return sorted(front)


def resolve_alloc_conf(alloc_conf: str | None) -> str:
    """The allocator settings an estimate replays: ``alloc_conf``, else ``PYTORCH_CUDA_ALLOC_CONF``, else
    PyTorch's defaults (""). A bad option: ``ValueError("alloc_conf: ...")``."""
    from estimator.reserved.rank import alloc_conf as parse

    text = alloc_conf if alloc_conf is not None else os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    try:
        parse(text)
    except ValueError as err:
        raise ValueError(f"alloc_conf: {err}") from None
    return text


def estimate(spec: RunSpec, coefficients: Any = None, *, allow_build: bool = True, alloc_conf: str | None = None,
             replay_reserved: bool = True, sequence: StepSequence | None = None, decide_fit: bool = False
             ) -> Estimate:
    """Per-rank peak memory of ``spec``. ``coefficients``: a GPU coefficient file path or loaded object.
    ``alloc_conf``: the ``PYTORCH_CUDA_ALLOC_CONF`` string the reserved replay uses (default: the environment's,
    else PyTorch's defaults); ``replay_reserved=False`` keeps the prior for the reserved level. ``sequence``: the
    reserved replay runs these step shapes in order instead of repeating the spec's (whose shape should be the
    sequence's worst: the allocated peak is the spec's). ``decide_fit``: only ``fits`` is wanted (the plan's
    search): a rank's replay stops once its reserved level proves the spec does not fit, and that rank's reserved
    and device levels are then lower bounds (``RankEstimate.reserved_lower_bound``); when rank 0 proves it, the
    other ranks are not estimated (``ranks`` holds rank 0 alone). ``fits`` is exact."""
    conf = resolve_alloc_conf(alloc_conf) if replay_reserved else None

    gpu = get_gpu(spec.gpu)
    if gpu.capacity_bytes is None:
        raise ValueError(f"gpu: {gpu.key!r} has no known capacity; name the GPU type (see --list-gpus)")
    arch = spec_arch(spec.model, spec.training.vocab_size)
    check_spec(spec, arch)
    pipeline_checked = spec
    if spec.parallel.pp > 1 and spec.parallel.pp_engine == "deepspeed":  # before any profile is looked up
        from estimator.methods.ds_pipeline import check_ds_pipeline, torch_pipeline_twin

        check_ds_pipeline(spec)
        pipeline_checked = torch_pipeline_twin(spec)
    check_pipeline(pipeline_checked, arch.model_type, arch.tie_word_embeddings)
    check_fsdp1(spec, arch.config)
    asked, ring = spec, ring_of(spec.parallel.cp, arch.num_heads, arch.num_kv_heads, arch.head_dim, spec.parallel.tp)
    if ring is not None and sequence is not None:
        raise ValueError("cp: an epoch of mixed batch shapes under context parallelism is not modelled (estimate "
                         "its longest batch)")
    if ring is not None:  # a cp rank: FSDP2 over every rank at its local sequence, plus the ring's transients
        spec = spec.replace(**{"parallel.cp": 1, "training.seq_len": local_seq_len(spec.training.seq_len, ring.cp)})
        conf = None  # the allocator replay has no ring events: the reserved prior
    coeffs = coefficients if isinstance(coefficients, residuals.Coefficients) else \
        residuals.load_coefficients(gpu.key, coefficients)
    check_forward_only_layers_before_trace(asked, arch.config)  # the asked layout (a cp rank's spec has cp 1)
    every = ckpt_every(spec.training.ckpt_policy)
    adapters_16bit = run_adapters_in_16bit(spec)
    if every is not None:
        arch, profile = every_k_profile(spec.model, spec.training, spec.parallel.tp, every, allow_build=allow_build,
                                        adapters_16bit=adapters_16bit)
    else:
        arch, profile = load_model_profile(spec.model, spec.training, spec.parallel.tp, allow_build=allow_build,
                                           adapters_16bit=adapters_16bit)
    check_forward_only_layers(asked, profile, arch.model_type)
    last = spec.parallel.world_size - 1
    table = _param_table(profile, arch.num_layers)
    if ring is not None and spec.training.lora:  # a frozen output projection may not keep the ring's output copy
        ring = dataclasses.replace(ring, output_saved=output_projection_saves_input(
            table, spec.training.precision, spec.training.lora_dropout))
    if spec.parallel.pp > 1 and spec.parallel.pp_engine == "deepspeed":
        return _ds_pipeline_estimate(spec, arch, profile, table, coeffs, gpu)
    if spec.parallel.pp > 1:
        return _pipeline_estimate(spec, arch, profile, table, coeffs, gpu, allow_build)
    layout = expert_parallel.layout_of(spec, arch, profile, table)
    ep_recompute = None
    if layout is not None and spec.training.grad_ckpt:  # the recomputed MoE layer's all-to-all path
        b, s = spec.training.micro_batch_size, spec.training.seq_len
        segments, plain = _regime(profile, b, s)["segments"], None
        if expert_parallel.needs_plain_profile(segments, arch.num_layers):  # traced before the experts marks
            _, plain_profile = load_model_profile(spec.model, dataclasses.replace(spec.training, grad_ckpt=False),
                                                  spec.parallel.tp, allow_build=allow_build)
            plain = _regime(plain_profile, b, s)["segments"]
        ep_recompute = expert_parallel.recompute_levels(segments, plain, layout, spec.training, arch.num_layers,
                                                        b, s)
    # Rank 0 and the last rank are reported (FSDP/ZeRO padding and TP layouts put any asymmetry there), and under
    # ZeRO-1/2 a middle rank when it is worse than both. Only ZeRO-1/2's gradient partition buffer depends on the
    # rank (its size, and when backward or the reduction after it reaches the rank's partition), so one
    # computation serves every rank elsewhere.
    def rank_estimate(rank: int, path: methods.Zero12Rank | None = None, sequence: StepSequence | None = None):
        return _rank_estimate(spec, arch, profile, table, coeffs, rank, path, conf, sequence, decide_fit, layout,
                              ring, ep_recompute)

    if last and spec.parallel.zero_stage in (1, 2):
        paths = methods.zero12_ranks(table, spec.parallel.world_size, spec.parallel.zero.reduce_bucket_size)
        first, model = rank_estimate(0, paths[0])
        ranks = [first, rank_estimate(last, paths[last])[0]]
        # A middle rank can hold more (its buffer includes the tensors cut by both of its boundaries): report the
        # worst of those no other rank dominates, when it is worse than both ends.
        middle = [rank_estimate(r, paths[r])[0] for r in _undominated(paths) if 0 < r < last]
        worst_middle = max(middle, key=lambda r: r.peak_device_bytes, default=None)
        if worst_middle is not None and worst_middle.peak_device_bytes > max(r.peak_device_bytes for r in ranks):
            ranks.insert(1, worst_middle)
    elif ring is not None:  # the cp ranks differ in the ring's half steps
        first, model = rank_estimate(0)
        ranks = [first] + [rank_estimate(r)[0] for r in ring.reported_ranks(spec.parallel.world_size)[1:]]
    else:
        first, model = rank_estimate(0, sequence=sequence)
        if first.reserved_lower_bound:  # decide_fit: rank 0 alone proves the spec does not fit
            ranks = [first]
        elif last and spec.parallel.method == "fsdp1":  # the padding of every flat parameter sits in the last shard
            ranks = [first, rank_estimate(last)[0]]
        else:
            ranks = [first] + ([dataclasses.replace(first, rank=last)] if last else [])
    worst = max(ranks, key=lambda r: r.peak_device_bytes)
    total, trainable = param_counts(profile["params"], arch.num_layers)
    notes = list(model.notes) if model else []
    if not coeffs.calibrated:
        notes.append(f"{gpu.key}: uncalibrated GPU — reserved/device terms are documented priors")
    notes += residuals.provenance_notes(coeffs)
    if profile.get("attn_effective") != ("sdpa" if spec.training.attn == "flash" else spec.training.attn):
        notes.append(f"attn: {arch.model_type} has no {spec.training.attn} path; estimated as "
                     f"{profile.get('attn_effective')}, as transformers would run it")
    if spec.parallel.tp > 1:
        notes.append("tp: traced profile of one TP rank (decoder-layer linears split; embeddings, norms and lm_head "
                     "replicated, so every rank holds the full logits)")
    notes.append(_loop_note(spec.training, profile))
    notes.append(versions_note(profile, model_code=spec.training.model_code))
    notes += _grad_sync_note(spec)
    notes += _technique_notes(spec.training, profile, arch.num_layers)
    notes += _batch_note(spec.training, profile)
    notes += _layers_note(profile)
    notes += moe_notes(moe_facts(arch.config, profile["params"], arch.num_layers, total))
    notes += cp_notes(asked.parallel.cp, spec.parallel.world_size, asked.training.seq_len, spec.parallel.tp)
    notes += ep_notes(layout, spec.training.micro_batch_size * spec.training.seq_len, spec.training.grad_ckpt)
    if "math" in profile.get("sdpa_backends", ()):
        notes.append("attention: CUDA runs SDPA's math kernel here (no flash or memory-efficient kernel takes these "
                     "inputs, e.g. fp32 attention with grouped-query heads, as QLoRA's fp32 hidden states give): "
                     "each layer keeps its (b, heads, s, s) probabilities; 16-bit attention inputs or "
                     "--attn flash avoid it")
    notes += _depth_note(_regime(profile, spec.training.micro_batch_size, spec.training.seq_len))
    notes.append(_reserved_note(spec, profile, worst, conf, arch.num_layers,
                                sequence if worst.rank == 0 else None))
    if spec.parallel.method in ("fsdp", "dp_tp") and adapters_in_16bit(spec.training, spec.parallel.method):
        notes.append("lora: FSDP2's mixed precision all-gathers the adapters in 16 bits (param_dtype), so peft casts "
                     "no adapter input to fp32: the profile traced with 16-bit adapters (benchmarks/"
                     "fsdp_lora_mixed_check.py)")
    if spec.training.qlora_kbit_prep:
        notes.append("qlora: traced as transformers + peft run it (bitsandbytes NF4 with double quantization, "
                     "prepare_model_for_kbit_training: other weights and the adapters in fp32)")
    elif spec.training.qlora:
        lightning = spec.training.qlora_quantizer == "lightning"
        adapters = (("adapters bf16, as LitGPT's bf16-true builds them" if lightning else
                     "adapters bf16, as answer.ai fsdp_qlora's train.py") if spec.training.lora_dtype == "model"
                    else "adapters fp32, as peft 0.13 leaves them on a uint8-stored 4-bit base")
        if lightning:
            notes.append("qlora: traced as Lightning's BitsandbytesPrecision('nf4-dq') builds it (LitGPT): NF4 with "
                         "double quantization on every linear, the LM head included, quantized from fp16 (each matmul "
                         "dequantizes to fp16, then casts to bf16); embedding, norms and residual stream bf16; "
                         f"{adapters}")
        else:
            notes.append("qlora: traced without kbit preparation (bitsandbytes NF4 with double quantization on every "
                         f"linear but the head; embedding, norms, head and residual stream bf16; {adapters})")
    if spec.training.qlora_keeps_inputs:
        notes.append(f"qlora: bitsandbytes {spec.training.qlora_bnb or 'as installed'} (before 0.43.2): each 4-bit "
                     "linear's MatMul4Bit keeps its input until the autograd graph is freed (bitsandbytes #1270), "
                     "traced with a copy of 0.41.1's MatMul4Bit")
    if spec.training.qlora:
        notes += qlora_experts_note(table)
    notes += residuals.range_notes(coeffs, spec, gpu_key=gpu.key, params=total, model_family=arch.model_type)
    notes += cap_notes(spec, gpu.capacity_bytes, worst)
    upper = residuals.upper_bound_bytes(worst.peak_device_bytes, coeffs)
    return Estimate(spec=asked, ranks=ranks, worst_rank=worst.rank,
                    capacity_bytes=capacity_under_cap_bytes(spec, gpu.capacity_bytes, worst),
                    upper_bound_bytes=upper, host_ram_bytes=int(model.host_bytes) if model else 0,
                    calibrated=coeffs.calibrated, gpu_key=gpu.key, params=total, trainable_params=trainable,
                    notes=notes, alloc_conf=conf or "", model_code=traced_release(profile) or "",
                    experts_breakdown=experts_breakdown(table, worst.breakdown))


def _pipeline_segments(profile: dict, training: TrainingSpec, arch: ModelArch) -> dict:
    """A profile's segments as a pipeline stage replays them: the training loop's, each backward segment with its
    candidates under gradient accumulation (``pipeline_rank.with_accumulating_candidates``)."""
    regime = _regime(profile, training.micro_batch_size, training.seq_len)
    return with_accumulating_candidates(loop_segments(regime, training.loop, arch.num_layers), regime)


def _pipeline_estimate(spec: RunSpec, arch: ModelArch, profile: dict, table: list, coeffs, gpu,
                       allow_build: bool = True) -> Estimate:
    """Pipeline parallelism (``methods.pipeline_rank``): the first, middle and last pipeline rank, each the lowest
    global rank of its stage's dp group (mesh (pp, dp), row-major). The reserved level is the prior."""
    training = spec.training
    every, kinds = ckpt_every(training.ckpt_policy), None
    if every is not None:  # each stage's layers from the plain or the checkpointed profile by their global index
        kinds = checkpointed(arch.num_layers, every)
        full = dataclasses.replace(training, ckpt_policy="")
        plain, ckpt = (_pipeline_segments(load_model_profile(spec.model, t, spec.parallel.tp,
                                                             allow_build=allow_build)[1], training, arch)
                       for t in (dataclasses.replace(full, grad_ckpt=False), full))
        segments = every_k_segments(plain, ckpt, kinds)
    else:
        segments = _pipeline_segments(profile, training, arch)
    act_bytes = 4 if training.precision == "fp32" else 2
    workspace = residuals.cublas_workspace_bytes(coeffs)
    buffers = buffer_bytes(profile["params"], 0)  # the rotary embedding's, on every stage (llama-style: no per-layer ones)
    communicators = 0 if spec.parallel.world_size == 1 else 1 + (spec.parallel.dp > 1) + (spec.parallel.tp > 1)
    ranks = []
    for pp_rank in reported_pp_ranks(spec.parallel.pp):
        pr = pipeline_rank(spec, segments, table, arch.num_layers, arch.hidden_size, act_bytes, pp_rank,
                           arch.vocab_size, kinds)
        parts = {**pr.parts, "cublas_workspace": workspace, "buffers": buffers}
        allocated = int(round(pr.peak_bytes + workspace + buffers))
        reserved = residuals.reserved_from_allocated(allocated, coeffs)
        ranks.append(RankEstimate(rank=pp_rank * spec.parallel.world_size // spec.parallel.pp,
                                  peak_allocated_bytes=allocated,
                                  peak_reserved_bytes=reserved,
                                  peak_device_bytes=residuals.device_from_reserved(reserved, coeffs, communicators),
                                  breakdown={k: int(round(v)) for k, v in parts.items() if v},
                                  phase=f"{pr.phase} ({pr.in_flight} micro-batches in flight)"))
    return _pipeline_result(spec, ranks, arch, profile, coeffs, gpu, pipeline_notes(spec, arch.num_layers))


def _pipeline_result(spec: RunSpec, ranks: list[RankEstimate], arch: ModelArch, profile: dict, coeffs, gpu,
                     layout_notes: list[str]) -> Estimate:
    """A pipeline's Estimate from its reported ranks (torch's schedules and DeepSpeed's engine alike)."""
    worst = max(ranks, key=lambda r: r.peak_device_bytes)
    total, trainable = param_counts(profile["params"], arch.num_layers)
    notes = layout_notes + [versions_note(profile, model_code=spec.training.model_code),
                            "reserved: prior allocated x (1 + slack ratio) + slack bytes (the allocator replay does "
                            "not cover pipeline schedules)"]
    notes += residuals.provenance_notes(coeffs)
    notes += cap_notes(spec, gpu.capacity_bytes, worst)
    return Estimate(spec=spec, ranks=ranks, worst_rank=worst.rank,
                    capacity_bytes=capacity_under_cap_bytes(spec, gpu.capacity_bytes, worst),
                    upper_bound_bytes=residuals.upper_bound_bytes(worst.peak_device_bytes, coeffs),
                    host_ram_bytes=0, calibrated=coeffs.calibrated, gpu_key=gpu.key, params=total,
                    trainable_params=trainable, notes=notes, model_code=traced_release(profile) or "")


def _ds_pipeline_estimate(spec: RunSpec, arch: ModelArch, profile: dict, table: list, coeffs, gpu) -> Estimate:
    """DeepSpeed's pipeline engine (``methods.ds_pipeline``): the first, middle and last stage (the first of each
    stage's data-parallel ranks). The reserved level is the prior."""
    from estimator.methods import ds_pipeline as dsp

    training = spec.training
    segments = loop_segments(_regime(profile, training.micro_batch_size, training.seq_len), training.loop,
                             arch.num_layers)
    act_bytes = 4 if training.precision == "fp32" else 2
    workspace = residuals.cublas_workspace_bytes(coeffs)
    bounds = dsp.ds_stage_bounds(table, arch.num_layers, spec.parallel.pp)
    ranks = []
    for stage in reported_pp_ranks(spec.parallel.pp):
        pr = dsp.ds_pipeline_rank(spec, segments, table, arch.num_layers, arch.hidden_size, act_bytes,
                                  arch.vocab_size, stage)
        # each DeepSpeed decoder layer holds its own rotary embedding's buffers
        buffers = len(dsp.ds_stage(bounds, stage, arch.num_layers).layers) * buffer_bytes(profile["params"], 0)
        parts = {**pr.parts, "cublas_workspace": workspace, "buffers": buffers}
        allocated = int(round(pr.peak_bytes + workspace + buffers))
        reserved = residuals.reserved_from_allocated(allocated, coeffs)
        # DeepSpeed's PipeDataParallelTopology: global rank = stage x dp + data-parallel rank (the stage's dp ranks
        # hold the same bytes under ZeRO stage 0: each all-reduces its full gradients)
        ranks.append(RankEstimate(rank=stage * spec.parallel.dp, peak_allocated_bytes=allocated, peak_reserved_bytes=reserved,
                                  peak_device_bytes=residuals.device_from_reserved(reserved, coeffs, 1),
                                  breakdown={k: int(round(v)) for k, v in parts.items() if v},
                                  phase=f"{pr.phase} ({pr.in_flight} micro-batches in flight)"))
    return _pipeline_result(spec, ranks, arch, profile, coeffs, gpu,
                            dsp.ds_pipeline_notes(spec, bounds, arch.num_layers))
