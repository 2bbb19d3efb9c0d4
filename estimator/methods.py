"""Per-rank model-state accounting for each distributed method (pure arithmetic over the parameter table).

Each method returns a ``StepModel``: what stays resident through the step, how parameter gradients are held
while backward runs (as a function of what has been produced so far), per-segment transients (gathered
parameters), and what the optimizer step adds. The activation timeline itself comes from the profile.
Semantics follow what the harness runs (``estimator/profiler/build.py`` and ``harness/methods``) and, for
ZeRO, DeepSpeed's documented defaults (bucket sizes in elements, see ``ZeroSpec``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from estimator.model_params import ParamInfo
from estimator.spec import RunSpec, ZeroSpec

FP32 = 4


@dataclass
class StepModel:
    resident: dict[str, float]                       # present for the whole step
    grad_policy: Callable[[float, float], float]     # (grads of finished segments, grads so far in segment)
    segment_extra: Callable[[str], float] | None     # transient bytes per timeline segment (gathered params)
    step_grads: float                                 # gradient bytes held when the optimizer step runs
    step_temp: float                                  # optimizer-step temporaries at their peak
    host_bytes: float = 0.0                           # CPU RAM (offload)
    notes: list[str] = field(default_factory=list)
    # A method that changes the step's event sequence replays it itself:
    # (segments, layers, b, s, accumulating) -> Replay.
    replay: Callable | None = None
    # Gradient accumulation, micro-batches after the first: gradients already held, and the largest one
    # that can be in flight before autograd adds it in place.
    accumulated_grad_bytes: float = 0.0
    largest_grad_bytes: float = 0.0


def _trainable(table: list[ParamInfo]) -> list[ParamInfo]:
    return [p for p in table if p.trainable]


def weights_bytes(table: list[ParamInfo]) -> float:
    return float(sum(p.nbytes for p in table))


def grad_bytes(table: list[ParamInfo]) -> float:
    return float(sum(p.nbytes for p in _trainable(table)))


def state_elems_per_param(optimizer: str) -> int:
    return {"adamw": 2, "adamw_fused": 2, "sgd": 0, "adamw_8bit": 2}[optimizer]


def optimizer_state_bytes(table: list[ParamInfo], optimizer: str, master_fp32: bool, shard: float = 1.0) -> float:
    """Adam m and v in the dtype of the parameter they update (fp32 masters under mixed precision)."""
    total = 0.0
    for p in _trainable(table):
        if optimizer == "adamw_8bit":
            # bitsandbytes: 1 byte per state for tensors of >= 4096 elements plus an fp32 absmax per 256-block.
            total += 2 * (p.numel + 4 * math.ceil(p.numel / 256)) if p.numel >= 4096 else 2 * FP32 * p.numel
        else:
            elem = FP32 if master_fp32 else p.elem_bytes
            total += state_elems_per_param(optimizer) * elem * p.numel
    return total * shard


def master_bytes(table: list[ParamInfo], shard: float = 1.0) -> float:
    """fp32 master copies; a parameter already in fp32 (e.g. LoRA adapters) is its own master."""
    return shard * sum(FP32 * p.numel for p in _trainable(table) if p.elem_bytes < FP32)


def step_temp_bytes(table: list[ParamInfo], optimizer: str, master_fp32: bool, shard: float = 1.0) -> float:
    """torch foreach AdamW allocates exp_avg_sq.sqrt() for every parameter of a dtype group at once."""
    if optimizer != "adamw":
        return 0.0
    groups: dict[int, float] = {}
    for p in _trainable(table):
        elem = FP32 if master_fp32 else p.elem_bytes
        groups[elem] = groups.get(elem, 0.0) + elem * p.numel
    return shard * max(groups.values(), default=0.0)


def _full(prev: float, within: float) -> float:
    return prev + within


def _optimizer_groups(table: list[ParamInfo]) -> list[list[ParamInfo]]:
    """Trainable params per optimizer, in step order: one group, except on a ``tp`` rank, where DTensor params
    and plain (replicated) ones have one optimizer each, stepped in that order (``ParamInfo.opt_group``;
    ``estimator.profiler.tp.build_tp_optimizer``)."""
    groups: dict[int, list[ParamInfo]] = {}
    for p in _trainable(table):
        groups.setdefault(p.opt_group, []).append(p)
    return [groups[k] for k in sorted(groups)]


def single(spec: RunSpec, table: list[ParamInfo]) -> StepModel:
    """One GPU, or any replicated-model rank (a ``tp`` rank: its local shards). Mixed precision:
    MasterWeightOptimizer (build.py), one per optimizer group."""
    training = spec.training
    mixed = training.precision.startswith("mixed_")
    grads = grad_bytes(table)
    resident = {"weights": weights_bytes(table),
                "optimizer_states": optimizer_state_bytes(table, training.optimizer, mixed)}
    groups = _optimizer_groups(table)
    if mixed:
        resident["master_weights"] = master_bytes(table)
        # Each optimizer in turn converts its grads to fp32 one tensor at a time (the 16-bit one freed at once),
        # steps, and drops its fp32 grads; later optimizers' grads are still 16-bit meanwhile.
        phases = [(0.0, 0.0)]
        for k, group in enumerate(groups):
            last = group[-1]
            fp32_grads = sum(FP32 * p.numel for p in group)
            later16 = sum(p.nbytes for g in groups[k + 1:] for p in g)
            convert_peak = last.nbytes if last.elem_bytes < FP32 else 0.0
            phases.append((float(fp32_grads + later16),
                           max(convert_peak, step_temp_bytes(group, training.optimizer, True))))
        step_grads, step_temp = max(phases, key=sum)
    else:
        # Every grad is held until zero_grad; each optimizer's foreach temporaries are freed before the next's.
        step_grads = grads
        step_temp = max((step_temp_bytes(group, training.optimizer, False) for group in groups), default=0.0)
    return StepModel(resident=resident, grad_policy=_full, segment_extra=None,
                     step_grads=step_grads, step_temp=step_temp, accumulated_grad_bytes=grads,
                     largest_grad_bytes=_largest_grad(table))


def _largest_grad(table: list[ParamInfo]) -> float:
    return float(max((p.nbytes for p in _trainable(table)), default=0))


def ddp(spec: RunSpec, table: list[ParamInfo]) -> StepModel:
    """DDP keeps flat gradient buckets the size of all gradients (gradient_as_bucket_view=False, the default)."""
    model = single(spec, table)
    model.resident["comm_buffers"] = grad_bytes(table)
    return model


def _shard_rows(p: ParamInfo, world: int) -> int:
    """FSDP2 shards dim 0 into equal padded chunks: every rank stores ceil(d0 / N) rows."""
    rows = p.shape[0] if p.shape else 1
    return math.ceil(rows / world) * (p.numel // rows if rows else 0)


def _fsdp_group_sizes(params: list[ParamInfo], world: int, reduce_elem: Callable[[ParamInfo], int]
                      ) -> tuple[float, float, float]:
    """(unsharded bytes, all-gather buffer bytes, reduce-scatter input bytes) of one FSDP2 group."""
    unsharded = sum(p.nbytes for p in params)
    gather = world * sum(_shard_rows(p, world) * p.elem_bytes for p in params)
    rs_in = world * sum(_shard_rows(p, world) * reduce_elem(p) for p in _trainable(params))
    return float(unsharded), float(gather), float(rs_in)


def fsdp(spec: RunSpec, table: list[ParamInfo]) -> StepModel:
    """FSDP2 ``fully_shard`` per decoder layer then root; mixed_*: fp32 sharded params, 16-bit compute,
    fp32 gradient reduction (MixedPrecisionPolicy(param_dtype=16-bit, reduce_dtype=fp32)). The step's
    buffers are replayed event by event (``estimator.fsdp``)."""
    from estimator.fsdp import FsdpSizes, replay_fsdp

    training = spec.training
    world = spec.parallel.world_size
    mixed = training.precision.startswith("mixed_")

    def shard_elem(p: ParamInfo) -> int:
        return FP32 if mixed else p.elem_bytes

    trainable_shard = [ParamInfo(p.name, p.shape, _shard_rows(p, world), shard_elem(p), True,
                                 p.module_kind, p.layer) for p in _trainable(table)]
    root = [p for p in table if p.layer is None]
    first_layer = min((p.layer for p in table if p.layer is not None), default=None)
    layer = [p for p in table if p.layer is not None and p.layer == first_layer]
    root_bytes, root_gather, root_rs = _fsdp_group_sizes(root, world, shard_elem)
    layer_bytes, layer_gather, layer_rs = _fsdp_group_sizes(layer, world, shard_elem)
    sizes = FsdpSizes(root_bytes=root_bytes, root_gather_bytes=root_gather, layer_bytes=layer_bytes,
                      layer_gather_bytes=layer_gather, layer_rs_in_bytes=layer_rs,
                      layer_rs_out_bytes=layer_rs / world, root_rs_in_bytes=root_rs,
                      root_rs_out_bytes=root_rs / world)
    resident = {"weights": float(sum(_shard_rows(p, world) * shard_elem(p) for p in table)),
                "optimizer_states": optimizer_state_bytes(trainable_shard, training.optimizer, False)}
    return StepModel(resident=resident, grad_policy=_full, segment_extra=None,
                     step_grads=float(sum(p.nbytes for p in trainable_shard)),
                     step_temp=step_temp_bytes(trainable_shard, training.optimizer, False),
                     replay=lambda segments, num_layers, b, s, accumulating=False: replay_fsdp(
                         segments, num_layers, b, s, sizes, accumulating=accumulating))


def _zero_buffers(zero: ZeroSpec, stage: int, elem: int, grads_total: float) -> float:
    """IPG gradient buckets: reduce_bucket_size elements, doubled when overlap_comm (DeepSpeed)."""
    if stage == 0:
        return 0.0
    bucket = min(zero.reduce_bucket_size * elem, grads_total)
    return bucket * (2 if zero.overlap_comm_for(stage) else 1)


def zero(spec: RunSpec, table: list[ParamInfo]) -> StepModel:
    """DeepSpeed ZeRO-1/2/3 (and ZeRO-Offload), 16-bit weights with fp32 master partitions for mixed_*,
    fp32 everything for fp32, torch AdamW (``torch_adam: true``) on the partitions."""
    training, parallel = spec.training, spec.parallel
    zcfg = parallel.zero
    world = parallel.world_size
    stage = parallel.zero_stage
    offload_opt = parallel.method == "zero_offload" or zcfg.offload_optimizer
    # DeepSpeed offloads parameters only under stage 3 (ZeRO-Infinity); below it offload_param is ignored.
    offload_param = zcfg.offload_param and stage == 3
    mixed = training.precision.startswith("mixed_") or training.precision == "bf16"
    elem16 = min(p.elem_bytes for p in table)
    trainable = _trainable(table)
    n_train = sum(p.numel for p in trainable)
    weights = weights_bytes(table)
    grads16 = grad_bytes(table)
    part = 1.0 / world
    master = (FP32 * n_train * part) if mixed else 0.0
    states = optimizer_state_bytes(trainable, training.optimizer, True, shard=part)
    fp32_grads = FP32 * n_train * part
    temp = step_temp_bytes(trainable, training.optimizer, True, shard=part)
    if stage == 3:
        temp = min(temp, FP32 * zcfg.sub_group_size)
    buckets = _zero_buffers(zcfg, stage, elem16, grads16)
    notes = ["ZeRO accounting follows DeepSpeed's documented buffers; uncalibrated until GPU data lands"]
    host = 0.0
    if offload_opt:
        host = master + states + fp32_grads
        master = states = fp32_grads = temp = 0.0
    resident: dict[str, float] = {}
    if stage == 3:
        persistent = sum(p.nbytes for p in table if p.numel <= zcfg.stage3_param_persistence_threshold)
        resident["weights"] = 0.0 if offload_param else weights * part + persistent
        if offload_param:
            host += weights * part  # each rank offloads its own partition
        live = min(zcfg.stage3_prefetch_bucket_size * elem16 + max(p.nbytes for p in table),
                   zcfg.stage3_max_live_parameters * elem16)
        layer_bytes: dict[int | None, float] = {}
        for p in table:
            layer_bytes[p.layer] = layer_bytes.get(p.layer, 0.0) + p.nbytes
        one_layer = max((v for k, v in layer_bytes.items() if k is not None), default=0.0)
        gathered = min(max(one_layer, live), weights)

        def extra(segment: str) -> float:
            return gathered + (layer_bytes.get(None, 0.0) if segment in ("prefix", "mid_fw", "mid_bw", "suffix")
                               else 0.0)
        held_partition = grads16 * part
        step_grads = held_partition + fp32_grads
    else:
        resident["weights"] = weights
        extra = None
        held_partition = grads16 * part if stage == 2 else grads16
        step_grads = held_partition + fp32_grads
    resident["master_weights"] = master
    resident["optimizer_states"] = states
    resident["comm_buffers"] = buckets

    def held(prev: float, within: float) -> float:
        if stage == 1:
            return prev + within
        # Gradients leave through the IPG buckets: partitions of finished layers, current layer in flight.
        return prev * part + within

    return StepModel(resident=resident, grad_policy=held, segment_extra=extra, step_grads=step_grads,
                     step_temp=temp, host_bytes=host, notes=notes, accumulated_grad_bytes=held_partition,
                     largest_grad_bytes=_largest_grad(table))
