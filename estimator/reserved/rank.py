"""The reserved peak of one rank from its replayed timeline, or the reason there is none (the prior then
stands). Expansions and setups are memoized per loaded profile, so a plan's many (b, s) points only rescale
sizes and replay."""

from __future__ import annotations

import dataclasses

from estimator.allocator import parse_alloc_conf
from estimator.methods.fsdp1 import fsdp1_sizes
from estimator.methods.state import attention_output_saved, zero3_saved_linear_input_tensors
from estimator.models.params import ParamInfo
from estimator.profiler.expand import Expansion, ExpansionError, expand, step_sizes
from estimator.reserved.ep import ep_method_step, ep_setup, why_not_ep
from estimator.reserved.every_k import mixed_events
from estimator.reserved.fsdp import fsdp_setup, fsdp_step
from estimator.reserved.fsdp1 import fsdp1_setup, fsdp1_step, why_not_fsdp1
from estimator.reserved.replay import ReservedReplay, replay_rank, replay_sequence
from estimator.reserved.timeline import INT64, Setup, StepPlan, setup_allocations
from estimator.reserved.torch_slices import with_full_range_slices
from estimator.reserved.zero import offloads_optimizer, why_not_zero, zero_setup, zero_step
from estimator.reserved.zero3 import (
    master_elem_bytes,
    recomputed_layers,
    why_not_zero3,
    zero3_setup,
    zero3_step,
)
from estimator.spec import ckpt_every

# Each with gradient accumulation (estimator.reserved.accumulate): DDP under no_sync accumulates as one GPU does,
# the buckets copied into only at the synchronising micro-step (no allocation); FSDP2 reduce-scatters every
# micro-step, a later micro-step's output added into the sharded gradients and freed.
# dp_tp: FSDP2 over the dp axis of the TP-local model (harness.fake.wrap), replayed as fsdp on dp ranks.
# fsdp1: the default prefetching, LoRA's adapter units, accumulation (reducing every micro-batch; under no_sync with
# use_orig_params only), CPU offload under FULL_SHARD / HYBRID_SHARD (estimator.reserved.fsdp1).
# zero1 / zero2: DeepSpeed's flat buffers, IPG bucket and partition step (estimator.reserved.zero), default stream.
# zero3: the same on three streams, with the parameter coordinator's gathers (estimator.reserved.zero3).
METHODS = ("single", "ddp", "tp", "fsdp", "dp_tp", "fsdp1", "zero1", "zero2", "zero3", "zero_offload")
ZERO = ("zero1", "zero2", "zero_offload")
# every-k checkpointing: the methods whose allocated estimate mixes the two profiles' layers (estimator.api
# MIXED_LAYER_METHODS; zero_offload is replayed without every-k: no run checks
# it). FSDP2 (and dp_tp) and FSDP1 add their buffers at the
# merged list's segment boundaries as at any other's: a checkpointed layer's recomputation runs inside its backward
# segment, after the layer's unshard, so no unit event moves. zero3's gathers are on a stream of their own, placed
# apart from the merged list (``zero3_gathers.with_recomputation``: the checkpointed layers' recomputation).
EVERY_K = ("single", "ddp", "tp", "zero1", "zero2", "fsdp", "dp_tp", "fsdp1", "zero3")
SHARDED = ("fsdp", "dp_tp")
_EXPANSIONS: dict[tuple, tuple] = {}
_FSDP_STEPS: dict[tuple, tuple] = {}
_SETUPS: dict[tuple, tuple] = {}
_CONFS: dict[str, object] = {}


def why_not(spec, regime: dict, num_layers: int, table: list[ParamInfo] | None = None) -> str | None:
    """Why this spec's reserved peak cannot be replayed (None: it can). ``table``: the parameter table, for what
    depends on the model's tensors (ZeRO-3's module structure)."""
    training = spec.training
    if regime.get("frozen_layers") and spec.parallel.method != "single":
        return (f"forward-only first decoder layers (LoRA past dense first layers) under {spec.parallel.method}: "
                "replayed for method single only")
    if regime.get("frozen_layers") and ckpt_every(training.ckpt_policy) is not None:
        # the merged event list (``every_k.mixed_events``) maps layers at the model's depth, not past the prefix's
        return "every-k checkpointing past forward-only first decoder layers: the merged event list is not replayed"
    if spec.parallel.method.startswith("zero"):
        reason = why_not_zero3(spec, table) if spec.parallel.method == "zero3" else why_not_zero(spec)
        if reason is not None:
            return reason
    elif spec.parallel.method not in METHODS:
        return (f"{spec.parallel.method}: its communication buffers run on their own streams with delayed frees, "
                "not modelled yet")
    if getattr(spec.parallel, "ep", 1) > 1:
        reason = why_not_ep(spec, table)  # fsdp + ep without checkpointing: estimator.reserved.ep
        if reason is not None:
            return reason
    if ckpt_every(training.ckpt_policy) is not None and spec.parallel.method not in EVERY_K:
        return f"every-k checkpointing under {spec.parallel.method}: the merged event list is replayed for " \
            f"{', '.join(EVERY_K)} only"
    if training.ce == "fused_linear":
        return "Liger's chunk buffer is added to the allocated peak, not to the event list"
    reason = None if table is None else why_not_layer_kinds(table, ckpt_every(training.ckpt_policy) is not None)
    if reason is not None:
        return reason
    try:
        events = _events(spec, regime, num_layers)
    except ExpansionError as err:
        return str(err)
    if events is None:
        return "the profile has no event list (traced before event lists were kept)"
    if events.get("optimizer") != training.optimizer:
        return f"the profile's optimizer step was traced with {events.get('optimizer')}, not {training.optimizer}"
    if spec.parallel.method in ("fsdp", "fsdp1") and spec.parallel.world_size < 2:
        return f"{spec.parallel.method} on one GPU: no collectives"
    if spec.parallel.method == "fsdp1":
        reason = why_not_fsdp1(spec.parallel.fsdp1)
        if (reason is None and training.grad_accum_steps > 1
                and spec.parallel.fsdp1.sharding_strategy == "NO_SHARD"):
            reason = "fsdp1 NO_SHARD with gradient accumulation: its kept whole gradients are not in the replay yet"
        if (reason is None and training.grad_accum_steps > 1 and training.grad_sync == "last"
                and spec.parallel.fsdp1.sharding_strategy == "SHARD_GRAD_OP"):
            reason = ("fsdp1 SHARD_GRAD_OP under no_sync (grad_sync last): the layers kept unsharded between "
                      "micro-batches are not in the replay yet")
        if (reason is None and training.grad_accum_steps > 1 and training.grad_sync == "last"
                and not spec.parallel.fsdp1.use_orig_params):
            reason = ("fsdp1 without use_orig_params under no_sync (grad_sync last): the flat gradients held between "
                      "micro-batches are not in the replay yet")
        if reason is None and spec.parallel.fsdp1.cpu_offload and training.grad_accum_steps > 1:
            reason = "fsdp1 with CPU offload under gradient accumulation: not in the replay yet"
        if (reason is None and spec.parallel.fsdp1.forward_prefetch
                and (training.grad_accum_steps > 1 or training.lora_rank)):
            reason = ("fsdp1 forward prefetch under gradient accumulation or with LoRA: not in the replay yet (checked "
                      "against a real run without either)")
        if (reason is None and spec.parallel.fsdp1.cpu_offload and training.grad_ckpt
                and training.precision.startswith("mixed_")):
            reason = ("fsdp1 with CPU offload, mixed precision and checkpointing: the recompute's 16-bit shard "
                      "copies (its pre-forward's pre_unshard) are not in the replay yet")
        if reason is None and training.qlora and spec.parallel.fsdp1.use_orig_params:
            # the packed units' stream is checked as fsdp_qlora runs them (tests/estimator/test_reserved_fsdp1.py)
            reason = ("fsdp1 with QLoRA and use_orig_params: the replay is checked against a real run with flat "
                      "parameters (fsdp_qlora's use_orig_params false) only")
        if reason is None and table is not None and fsdp1_sizes(spec, table).kept_input_bytes_per_token:
            reason = ("fsdp1 with reentrant checkpointing around frozen units (ckpt_reentrant, model code before "
                      "4.52): the layer inputs and gradients kept to the end of backward are not in the replay yet")
        if reason is None and training.lora and spec.parallel.fsdp1.sharding_strategy not in ("FULL_SHARD",
                                                                                              "HYBRID_SHARD"):
            reason = (f"fsdp1 with LoRA under {spec.parallel.fsdp1.sharding_strategy}: the adapters' units are "
                      "replayed resharding after forward (FULL_SHARD, HYBRID_SHARD) only")
        if reason is not None:
            return reason
    if event_layers(regime, num_layers) < 2:
        return "a 1-layer model has no generic layer to repeat"
    if _fp32_copies(training, regime) is None:
        return "outputs_fp32 with an output object of 16-bit and other tensors: not in the event list"
    try:  # the expansion's own reason (memoized: the replay uses the same one)
        _expansion(events, event_layers(regime, num_layers), training.loop, bool(_fp32_copies(training, regime)),
                   head_grad_bytes(table, 2 if training.forward_autocast else None))
    except ExpansionError as err:
        return str(err)
    return None


def why_not_layer_kinds(table: list[ParamInfo], every_k: bool = False) -> str | None:
    """The expansion repeats the trace's generic layer (its layer 1) for every layer after the first, whose own
    events come from the traced layer 0: a stack whose layers after the first are not all of one kind (more than
    one dense layer first, dense and expert layers alternating) has layers no traced segment stands for.
    ``every_k``: every-k checkpointing over a first layer of another kind stays on the prior. Its merged event
    list is built (``reserved.every_k`` pairs the first layer's crossing tensors apart from the generic layer's)
    and its requested peak is the real run's, its largest requests come and go as the GPU's
    (tests/estimator/test_reserved_every_k.py), but the reserved level is not: on the H200 the level turns on
    single 32 MiB requests of the first step that the trace lacks (cuDNN attention for MLA's unequal head dims
    with the copy of its output; the expert layers' CUDA-side scratch), which decide where the persistent
    gradients go and so whether the next step's logits find free segments (docs/allocator.md, "every-k")."""
    kinds: dict[int, list] = {}
    for p in table:
        if p.layer is not None:
            kinds.setdefault(p.layer, []).append((p.name.split(f".{p.layer}.", 1)[-1], p.shape, p.elem_bytes,
                                                  p.trainable))
    layers = sorted(kinds)
    odd = next((layer for layer in layers[2:] if kinds[layer] != kinds[layers[1]]), None)
    if odd is not None:
        return (f"layers: layer {odd} is of another kind than layer 1; the event list's generic layer stands for "
                "every layer after the first, which the replay needs all alike")
    if every_k and len(layers) > 1 and kinds[layers[0]] != kinds[layers[1]]:
        return ("every-k checkpointing with a first layer of another kind (a dense layer before expert layers): "
                "the merged event list's requested peak is right, but its reserved level turns on single 32 MiB "
                "requests of CUDA kernels the trace does not run (cuDNN attention, the experts' scratch)")
    return None


def event_layers(regime: dict, num_layers: int) -> int:
    """The decoder layers the event list's layer segments repeat for: all but forward-only first ones
    (``frozen_layers``: LoRA past dense first layers, whose forward is in the prefix's events). The setup's
    weights still count every layer."""
    return num_layers - regime.get("frozen_layers", 0)


def _events(spec, regime: dict, num_layers: int) -> dict | None:
    """The regime's event list; every-k's: the plain and the checkpointed profile's merged
    (``estimator.reserved.every_k``; ExpansionError when they cannot be); with torch 2.4's full-range slices in
    the loss's backward where the run's torch records them (``estimator.reserved.torch_slices``)."""
    if ckpt_every(spec.training.ckpt_policy) is None or num_layers < 2:
        events = regime.get("events")
    else:
        events = mixed_events(spec, regime, num_layers)
    if events is not None and spec.training.full_range_slices:
        events = with_full_range_slices(events)
    return events


def _fp32_copies(training, regime: dict) -> bool | None:
    """Whether the replay holds fp32 copies of the output object (``outputs_fp32``, manual loop): every held
    tensor 16-bit (True) or none (False); None for a mix, which the event list cannot say apart."""
    if not training.outputs_fp32 or training.loop != "manual":
        return False
    sixteen, held = regime["outputs_held_16bit"], regime["outputs_held"]
    if sixteen == held:
        return True
    return False if not any(any(poly) for poly in sixteen.values()) else None


def _shard_world(spec) -> int:
    """The ranks FSDP2 shards over: all of them, or dp_tp's dp axis."""
    return spec.parallel.dp if spec.parallel.method == "dp_tp" else spec.parallel.world_size


def alloc_conf(text: str | None):
    """The parsed ``PYTORCH_CUDA_ALLOC_CONF`` string (memoized; ``ValueError`` naming a bad option)."""
    key = text or ""
    if key not in _CONFS:
        _CONFS[key] = parse_alloc_conf(key)
    return _CONFS[key]


def head_grad_bytes(table: list[ParamInfo] | None, autocast_elem_bytes: int | None = None) -> int | None:
    """The bytes of the LM head weight's gradient as its matmul makes it (the head, or the embedding it is tied to),
    if it trains: the backward's first matmul output (``expand._backward_workspace_at``). Under autocast the matmul
    runs in the 16-bit dtype, so its gradient output is 16-bit before it is cast to the fp32 weight's dtype."""
    for p in table or ():
        if p.trainable and p.layer is None and any(name.endswith("lm_head.weight") for name in (p.name, *p.tied_names)):
            return p.numel * (autocast_elem_bytes or p.elem_bytes)
    return None


def _expansion(events: dict, num_layers: int, loop: str, fp32_copies: bool = False,
               head_bytes: int | None = None):
    key = (id(events), num_layers, loop, fp32_copies, head_bytes)
    hit = _EXPANSIONS.get(key)
    if hit is None or hit[0] is not events:
        if len(_EXPANSIONS) > 256:
            _EXPANSIONS.clear()
        try:
            hit = (events, expand(events, num_layers, loop, fp32_copies, head_bytes))
        except ExpansionError as err:
            hit = (events, err)
        _EXPANSIONS[key] = hit
    if isinstance(hit[1], ExpansionError):
        raise hit[1]
    return hit[1]


def _setup(profile: dict, table: list[ParamInfo], num_layers: int, method: str, mixed: bool, world: int = 1,
           spec=None, rank: int = 0) -> Setup:
    """``spec``: needed for fsdp1 (its unit sizes) and zero3 (its bucket and persistence threshold); ``rank``:
    fsdp1 without use_orig_params, whose short last chunks are padded at setup."""
    method_options = ((spec.parallel.fsdp1, spec.training.precision) if method == "fsdp1"
                      else (spec.parallel.zero, master_elem_bytes(spec.training)) if method == "zero3"
                      else spec.parallel.ep if spec is not None else None)
    if method in ZERO and spec is not None:  # the offloaded optimizer's setup differs
        method_options = (method_options, offloads_optimizer(spec.parallel))
    rank = rank if method == "fsdp1" and not spec.parallel.fsdp1.use_orig_params else 0
    key = (id(profile), id(table), num_layers, method, mixed, world, method_options, rank)
    hit = _SETUPS.get(key)
    if hit is None or hit[0] is not table:
        if len(_SETUPS) > 256:
            _SETUPS.clear()
        buffers = profile["params"].get("buffers") or {}
        buffer_bytes = (buffers.get("non_layer", 0), buffers.get("per_layer", 0))
        if spec is not None and spec.parallel.ep > 1:
            setup = ep_setup(table, buffer_bytes, num_layers, world, spec.parallel.ep, mixed)
        elif method in SHARDED:
            setup = fsdp_setup(table, buffer_bytes, num_layers, world, mixed)
        elif method in ZERO:
            setup = zero_setup(table, buffer_bytes, num_layers, world, _elem16(table),
                               offloads_optimizer(spec.parallel))
        elif method == "zero3":
            zcfg = spec.parallel.zero
            setup = zero3_setup(table, world, _elem16(table), zcfg.reduce_bucket_size,
                                zcfg.stage3_param_persistence_threshold, zcfg.offload_optimizer,
                                master_elem_bytes(spec.training))
        elif method == "fsdp1":
            setup = fsdp1_setup(table, buffer_bytes, num_layers, fsdp1_sizes(spec, table, rank), rank)
        else:
            setup = setup_allocations(table, buffer_bytes, num_layers, method, mixed)
        hit = (table, setup)
        _SETUPS[key] = hit
    return hit[1]


def _method_step(spec, events: dict, expansion: Expansion, table: list[ParamInfo], num_layers: int,
                 base_size_index: int, rank: int = 0, attention_view: bool = True) -> tuple[Expansion, list[int]]:
    """The rank's step: the expansion itself, or FSDP2's / FSDP1's (their buffers' sizes after
    ``base_size_index``)."""
    if spec.parallel.method == "fsdp1":
        return _fsdp1_step(spec, events, expansion, table, num_layers, base_size_index, rank)
    if spec.parallel.method in ZERO:
        return _zero_step(spec, events, expansion, table, base_size_index, rank)
    if spec.parallel.method == "zero3":
        training, parallel = spec.training, spec.parallel
        recomputed = recomputed_layers(training, num_layers)
        key = ("zero3", id(expansion), id(table), parallel.world_size, parallel.zero, training.optimizer,
               base_size_index, recomputed, training.grad_accum_steps, master_elem_bytes(training), attention_view,
               training.ckpt_reentrant)
        return _memo_step(key, expansion, table, lambda: zero3_step(
            expansion, table, parallel.world_size, _elem16(table), parallel.zero.reduce_bucket_size,
            training.optimizer, base_size_index, events["polys"], parallel.zero, recomputed,
            accumulate=training.grad_accum_steps, offload_optimizer=parallel.zero.offload_optimizer,
            master_elem=master_elem_bytes(training), saved_inputs=_zero3_held_inputs(spec, table, attention_view),
            reentrant=training.ckpt_reentrant))
    if spec.parallel.method not in SHARDED:
        return expansion, []
    training, world = spec.training, _shard_world(spec)
    no_sync = training.grad_accum_steps > 1 and training.grad_sync == "last"  # unsharded gradients held
    key = (id(expansion), id(table), world, training.precision, training.optimizer, training.grad_ckpt,
           base_size_index, no_sync)
    return _memo_step(key, expansion, table, lambda: fsdp_step(
        expansion, table, world, training.precision, training.optimizer, base_size_index, num_layers,
        events["polys"], training.grad_ckpt, no_sync))


def _zero3_held_inputs(spec, table: list[ParamInfo], attention_view: bool) -> tuple:
    """(layer, bytes per token) of the frozen Linear inputs ZeRO-3's memory-efficient linear holds beyond plain
    autograd (``zero3_saved_linear_input_tensors``; none under full fine-tuning). Only where the allocated level
    counts them too (``state._zero3_linear_saves``); a checkpointed layer's are made by its recomputation
    (``zero3._hold_saved_inputs``)."""
    training = spec.training
    if training.qlora or training.precision.startswith("amp") or training.ckpt_policy:
        return ()
    return tuple(zero3_saved_linear_input_tensors(table, training.lora_dropout, training.ce == "standard",
                                                  attention_view))


def _fsdp1_step(spec, events: dict, expansion: Expansion, table: list[ParamInfo], num_layers: int,
                base_size_index: int, rank: int) -> tuple[Expansion, list[int]]:
    training = spec.training
    key = ("fsdp1", id(expansion), id(table), spec.parallel.world_size, spec.parallel.fsdp1, training.precision,
           training.optimizer, training.grad_ckpt, training.grad_accum_steps > 1, training.grad_sync,
           training.forward_autocast, base_size_index, rank)
    autocast_elem = 2 if training.forward_autocast else None  # bf16 / fp16
    return _memo_step(key, expansion, table, lambda: fsdp1_step(
        expansion, table, fsdp1_sizes(spec, table, rank), training.optimizer, rank, base_size_index, num_layers,
        events["polys"], training.grad_ckpt, training.grad_accum_steps > 1, autocast_elem, training.grad_sync))


def _elem16(table: list[ParamInfo]) -> int:
    """DeepSpeed's flat-buffer element size: the model's (16-bit under mixed precision)."""
    return min((p.elem_bytes for p in table), default=2)


def _zero_step(spec, events: dict, expansion: Expansion, table: list[ParamInfo], base_size_index: int, rank: int
               ) -> tuple[Expansion, list[int]]:
    training, parallel = spec.training, spec.parallel
    stage, bucket = parallel.zero_stage, parallel.zero.reduce_bucket_size
    overlap, accumulating = parallel.zero.overlap_comm_for(stage), training.grad_accum_steps > 1
    offload = offloads_optimizer(parallel)
    key = ("zero", id(expansion), id(table), parallel.world_size, stage, bucket, overlap, accumulating,
           training.optimizer, base_size_index, rank, offload)
    return _memo_step(key, expansion, table, lambda: zero_step(
        expansion, table, parallel.world_size, rank, stage, _elem16(table), bucket, training.optimizer,
        base_size_index, events["polys"], overlap, accumulating, offload))


def _memo_step(key: tuple, expansion: Expansion, table: list[ParamInfo], build) -> tuple[Expansion, list[int]]:
    """A sharded method's step (``build()``: an FsdpStep, Fsdp1Step or ZeroStep), memoized; ExpansionError is kept too."""
    hit = _FSDP_STEPS.get(key)
    if hit is None or hit[0] is not expansion or hit[1] is not table:
        if len(_FSDP_STEPS) > 256:
            _FSDP_STEPS.clear()
        try:
            built = build()
            hit = (expansion, table, (built.expansion, built.sizes))
        except ExpansionError as err:
            hit = (expansion, table, err)
        _FSDP_STEPS[key] = hit
    if isinstance(hit[2], ExpansionError):
        raise hit[2]
    return hit[2]


def _plan(spec, events: dict, expansion: Expansion, table: list[ParamInfo], num_layers: int, b: int, s: int, *,
          workspace_bytes: int, workspaces: int, rank: int = 0, attention_view: bool = True) -> StepPlan:
    sizes = step_sizes(events["polys"], b, s)
    sizes += [2 * sizes[poly] for poly in expansion.copy_of]  # an fp32 copy of a 16-bit tensor
    step, extra = (ep_method_step(spec, events, expansion, table, num_layers, len(sizes), b, s)
                   if spec.parallel.ep > 1 else _method_step(spec, events, expansion, table, num_layers, len(sizes), rank,
                                                             attention_view))
    return StepPlan(expansion=step, sizes=sizes + extra, batch_bytes=b * s * INT64, workspace_bytes=workspace_bytes,
                    workspaces=workspaces)


def in_regime(regime: dict, b: int, s: int) -> bool:
    return (regime["b_min"] <= b and (regime["b_max"] is None or b <= regime["b_max"])
            and regime["s_min"] <= s and (regime["s_max"] is None or s <= regime["s_max"]))


def replay_reserved_sequence(spec, profile: dict, regime: dict, table: list[ParamInfo], num_layers: int,
                             shapes: list[tuple[int, int]], *, workspace_bytes: int, workspaces: int,
                             allowed_bytes: int | None, conf_text: str | None,
                             empty_cache_every: int | None = None, rank: int = 0,
                             stop_above_bytes: int | None = None,
                             fraction_cap_bytes: int | None = None) -> ReservedReplay:
    """Steps of the (micro-batch, sequence) ``shapes`` in order, each at its own sizes, through one allocator
    (``replay_sequence``). Every step runs the spec's regime's events: shapes of another regime (a micro-batch of
    1 where the spec's has more rows: an epoch's last, short batch) are left out. The run's need is reported
    when the cap is hit, as ``replay_reserved`` does (``_capped_then_needed``). ExpansionError: no replay."""
    training = spec.training
    events = _events(spec, regime, num_layers)
    depth = event_layers(regime, num_layers)
    expansion = _expansion(events, depth, training.loop, bool(_fp32_copies(training, regime)),
                           head_grad_bytes(table, 2 if training.forward_autocast else None))
    plans: dict[tuple[int, int], StepPlan] = {}
    sequence = []
    for b, s in shapes:
        if not in_regime(regime, b, s):
            continue
        if (b, s) not in plans:
            plans[b, s] = _plan(spec, events, expansion, table, depth, b, s, workspace_bytes=workspace_bytes,
                                workspaces=workspaces, rank=rank, attention_view=attention_output_saved(profile))
        sequence.append(plans[b, s])
    if not sequence:
        raise ExpansionError("sequence: no step of the spec's regime")
    setup = _setup(profile, table, num_layers, spec.parallel.method, training.precision.startswith("mixed_"),
                   _shard_world(spec), spec, rank)
    return _capped_then_needed(
        lambda cap, fraction, stop: replay_sequence(setup, sequence, alloc_conf(conf_text), cap, empty_cache_every,
                                                    training.grad_accum_steps, stop, fraction),
        allowed_bytes, stop_above_bytes, fraction_cap_bytes)


def _capped_then_needed(replay, allowed_bytes: int | None, stop_above_bytes: int | None,
                        fraction_cap_bytes: int | None = None) -> ReservedReplay:
    """``replay(cap, fraction_cap, stop)`` under ``allowed_bytes`` and the memory fraction's cap; when it runs out
    there, again without either, so the reserved peak reported is what the run would need (``oom`` stays set).
    With ``stop_above_bytes`` (the question is only whether it fits) an out-of-memory answers it: no second replay,
    the peak stays a lower bound."""
    capped = replay(allowed_bytes, fraction_cap_bytes, stop_above_bytes)
    if not capped.oom:
        return capped
    if stop_above_bytes is not None:
        return dataclasses.replace(capped, stopped_above=True)
    needed = replay(None, None, None)
    return dataclasses.replace(needed, oom=True, num_alloc_retries=capped.num_alloc_retries)


def replay_reserved(spec, profile: dict, regime: dict, table: list[ParamInfo], num_layers: int, *,
                    workspace_bytes: int, workspaces: int, allowed_bytes: int | None, conf_text: str | None,
                    rank: int = 0, stop_above_bytes: int | None = None,
                    fraction_cap_bytes: int | None = None) -> ReservedReplay:
    """Replay the rank under ``allowed_bytes`` and ``fraction_cap_bytes`` (``_capped_then_needed``);
    ``stop_above_bytes``: stop once the reserved peak passes it. ExpansionError: no replay."""
    training = spec.training
    b, s = training.micro_batch_size, training.seq_len
    events = _events(spec, regime, num_layers)
    depth = event_layers(regime, num_layers)
    expansion = _expansion(events, depth, training.loop, bool(_fp32_copies(training, regime)),
                           head_grad_bytes(table, 2 if training.forward_autocast else None))
    plan = _plan(spec, events, expansion, table, depth, b, s, workspace_bytes=workspace_bytes,
                 workspaces=workspaces, rank=rank, attention_view=attention_output_saved(profile))
    setup = _setup(profile, table, num_layers, spec.parallel.method, training.precision.startswith("mixed_"),
                   _shard_world(spec), spec, rank)
    return _capped_then_needed(
        lambda cap, fraction, stop: replay_rank(setup, plan, alloc_conf(conf_text), cap,
                                                accum=training.grad_accum_steps, stop_above_bytes=stop,
                                                fraction_cap_bytes=fraction),
        allowed_bytes, stop_above_bytes, fraction_cap_bytes)
