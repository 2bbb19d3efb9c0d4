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
    extra_components: dict[str, str] = field(default_factory=dict)


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


def single(spec: RunSpec, table: list[ParamInfo]) -> StepModel:
    """One GPU, or any replicated-model rank. Mixed precision: MasterWeightOptimizer (build.py)."""
    training = spec.training
    mixed = training.precision.startswith("mixed_")
    grads = grad_bytes(table)
    resident = {"weights": weights_bytes(table),
                "optimizer_states": optimizer_state_bytes(table, training.optimizer, mixed)}
    if mixed:
        resident["master_weights"] = master_bytes(table)
        # Grads are converted to fp32 one tensor at a time (the 16-bit one freed at once).
        last = _trainable(table)[-1] if _trainable(table) else None
        fp32_grads = sum(FP32 * p.numel for p in _trainable(table))
        convert_peak = (last.nbytes if last and last.elem_bytes < FP32 else 0.0)
        step_grads = float(fp32_grads)
        step_temp = max(convert_peak, step_temp_bytes(table, training.optimizer, True))
    else:
        step_grads = grads
        step_temp = step_temp_bytes(table, training.optimizer, False)
    return StepModel(resident=resident, grad_policy=_full, segment_extra=None,
                     step_grads=step_grads, step_temp=step_temp)


def ddp(spec: RunSpec, table: list[ParamInfo]) -> StepModel:
    """DDP keeps flat gradient buckets the size of all gradients (gradient_as_bucket_view=False, the default)."""
    model = single(spec, table)
    model.resident["comm_buffers"] = grad_bytes(table)
    return model


def _shard_rows(p: ParamInfo, world: int) -> int:
    """FSDP2 shards dim 0 into equal padded chunks: every rank stores ceil(d0 / N) rows."""
    rows = p.shape[0] if p.shape else 1
    return math.ceil(rows / world) * (p.numel // rows if rows else 0)


def fsdp(spec: RunSpec, table: list[ParamInfo], layer_prefix: str) -> StepModel:
    """FSDP2 ``fully_shard`` per decoder layer then root; mixed_*: fp32 sharded params, 16-bit compute,
    fp32 gradient reduction (MixedPrecisionPolicy(param_dtype=16-bit, reduce_dtype=fp32))."""
    training = spec.training
    world = spec.parallel.world_size
    mixed = training.precision.startswith("mixed_")
    compute_elem = {p.name: p.elem_bytes for p in table}
    shard_elem = {p.name: (FP32 if mixed else p.elem_bytes) for p in table}
    sharded = sum(_shard_rows(p, world) * shard_elem[p.name] for p in table)
    sharded_grads = sum(_shard_rows(p, world) * shard_elem[p.name] for p in _trainable(table))
    trainable_shard = [ParamInfo(p.name, p.shape, _shard_rows(p, world), shard_elem[p.name], True,
                                 p.module_kind, p.layer) for p in _trainable(table)]
    layer_full = {}
    for p in table:
        key = p.layer if p.layer is not None else "root"
        layer_full[key] = layer_full.get(key, 0.0) + p.numel * compute_elem[p.name]
    root_full = layer_full.get("root", 0.0)
    one_layer = max((v for k, v in layer_full.items() if k != "root"), default=0.0)
    grads_total = grad_bytes(table)
    layer_grads = max(grads_total - sum(p.nbytes for p in _trainable(table) if p.layer is None), 0.0)
    num_layers = max((p.layer for p in table if p.layer is not None), default=-1) + 1
    per_layer_grads = layer_grads / max(num_layers, 1)
    shard_ratio = sharded_grads / max(grads_total, 1.0)

    def held_grads(prev: float, within: float) -> float:
        # Finished units are reduce-scattered to shards; the current unit's unsharded grads are live.
        return prev * shard_ratio + within

    def gathered(segment: str) -> float:
        # Root stays unsharded from its pre-forward to its post-backward; one layer unsharded at a time in
        # forward, two in backward (the current one and the prefetched next).
        if segment in ("prefix", "mid_fw", "mid_bw", "suffix"):
            return root_full
        if segment.startswith("fw"):
            return root_full + one_layer
        return root_full + 2 * one_layer + per_layer_grads * (FP32 / 2 if mixed else 1)

    resident = {"weights": float(sharded),
                "optimizer_states": optimizer_state_bytes(trainable_shard, training.optimizer, False)}
    return StepModel(resident=resident, grad_policy=held_grads, segment_extra=gathered,
                     step_grads=float(sharded_grads),
                     step_temp=step_temp_bytes(trainable_shard, training.optimizer, False),
                     extra_components={"segment_extra": "gathered_params"})


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
    offload_param = zcfg.offload_param
    if offload_param:
        stage = 3
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
            host += weights
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
                     step_temp=temp, host_bytes=host, notes=notes)


def tensor_parallel_table(table: list[ParamInfo], shard_dim: Callable[[str], int | None], tp: int
                          ) -> list[ParamInfo]:
    """Parameters as one TP rank holds them (sharded dims divided, others replicated)."""
    out = []
    for p in table:
        dim = shard_dim(p.name)
        if dim is None or not p.shape:
            out.append(p)
            continue
        shape = list(p.shape)
        shape[dim] = math.ceil(shape[dim] / tp)
        out.append(ParamInfo(p.name, tuple(shape), math.prod(shape), p.elem_bytes, p.trainable, p.module_kind,
                             p.layer, p.tied_names))
    return out
