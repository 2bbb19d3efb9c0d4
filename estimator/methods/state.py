"""Per-rank model-state accounting for each distributed method (pure arithmetic over the parameter table).

Each method returns a ``StepModel``: what stays resident through the step, how parameter gradients are held
while backward runs (as a function of what has been produced so far), per-segment transients (gathered
parameters), and what the optimizer step adds. The activation timeline itself comes from the profile.
Semantics follow what the harness runs (``estimator/profiler/build.py`` and ``harness/methods``) and, for
ZeRO, DeepSpeed's documented defaults (bucket sizes in elements, see ``ZeroSpec``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from estimator.methods.timeline import ExtraBytes
from estimator.models.memo import memo_by_owner
from estimator.models.moe import is_routed_expert
from estimator.models.params import ParamInfo, forward_only_layers, largest_layer
from estimator.models.zero3_leaf import leaf_of
from estimator.spec import RunSpec, ZeroSpec

FP32 = 4


@dataclass
class StepModel:
    resident: dict[str, float]                       # present for the whole step
    grad_policy: Callable[[float, float], float]     # (grads of finished segments, grads so far in segment)
    segment_extra: ExtraBytes | None                  # transient bytes per (segment, repetition): gathered params
    step_grads: float                                 # gradient bytes held when the optimizer step runs
    step_temp: float                                  # optimizer-step temporaries at their peak
    host_bytes: float = 0.0                           # CPU RAM (offload)
    notes: list[str] = field(default_factory=list)
    # FSDP2: the unsharded parameters held while the last decoder layer runs forward (root and that layer; under
    # EP its experts too, and their all-gather output, which forward keeps until the next unit's copy-out)
    forward_gathered_bytes: float = 0.0
    # Bytes per token held per (segment, repetition) on top of the profile's activations: what a method's own
    # autograd functions save that the traced step does not (ZeRO-3's frozen Linear inputs)
    segment_saved_per_token: ExtraBytes | None = None
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


def _fsdp_group_sizes(params: list[ParamInfo], world: int, reduce_elem: Callable[[ParamInfo], int],
                      world_of: Callable[[ParamInfo], int] | None = None) -> tuple[float, float, float]:
    """(unsharded bytes, all-gather buffer bytes, reduce-scatter input bytes) of one FSDP2 group. Each unsharded
    tensor is allocated padded, N x its padded shard (``FSDPParam.init_all_gather_outputs``), the parameter a
    view of its first elements. ``world_of``: the ranks a parameter is sharded over, where not all alike (expert
    shards under expert parallelism)."""
    def n(p: ParamInfo) -> int:
        return world_of(p) if world_of else world

    gather = sum(n(p) * _shard_rows(p, n(p)) * p.elem_bytes for p in params)
    unsharded = gather
    rs_in = sum(n(p) * _shard_rows(p, n(p)) * reduce_elem(p) for p in _trainable(params))
    return float(unsharded), float(gather), float(rs_in)


def _expert_shard(p: ParamInfo, ep: int) -> ParamInfo:
    """A routed expert tensor as one expert-parallel rank holds it: num_experts / ep experts along dim 0
    (transformers' ``MoEParamShard``)."""
    rows = p.shape[0] // ep
    return ParamInfo(p.name, (rows, *p.shape[1:]), p.numel // ep, p.elem_bytes, p.trainable, p.module_kind, p.layer)


def fp32_kept_params(params: list[ParamInfo], precision: str) -> list[ParamInfo]:
    """The parameters of a layer's modules that a 16-bit model keeps in fp32 (``_keep_in_fp32_modules_strict``:
    DeepSeek's router): under transformers' FSDP2 plan and the harness's each such module is a unit of its own
    (FSDP2: one dtype among a group's trainable parameters). None in an fp32 or mixed-precision model (fp32
    weights), nor where the 16-bit parameters are frozen (LoRA's fp32 adapters)."""
    if precision not in ("bf16", "fp16") or not any(p.trainable and p.elem_bytes < FP32 for p in params):
        return []
    modules = {p.name.rpartition(".")[0] for p in params
               if p.trainable and p.elem_bytes == FP32 and not is_routed_expert(p.name)}
    return [p for p in params if p.name.rpartition(".")[0] in modules]


def fsdp(spec: RunSpec, table: list[ParamInfo]) -> StepModel:
    """FSDP2 ``fully_shard`` per decoder layer then root; mixed_*: fp32 sharded params, 16-bit compute,
    fp32 gradient reduction (MixedPrecisionPolicy(param_dtype=16-bit, reduce_dtype=fp32)). The step's
    buffers are replayed event by event (``estimator.methods.fsdp_replay``)."""
    from estimator.methods.fsdp_replay import ExpertsUnit, FsdpSizes, LayerGroup, replay_fsdp

    training = spec.training
    world = spec.parallel.world_size
    ep = spec.parallel.ep
    mixed = training.precision.startswith("mixed_")
    full = table
    if ep > 1:  # each rank holds num_experts / ep experts, FSDP-sharded over the world / ep ranks holding the same
        table = [_expert_shard(p, ep) if is_routed_expert(p.name) else p for p in table]

    def world_of(p: ParamInfo) -> int:
        return world // ep if ep > 1 and is_routed_expert(p.name) else world

    def shard_elem(p: ParamInfo) -> int:
        return FP32 if mixed else p.elem_bytes

    def own_unit(params: list[ParamInfo]) -> list[ParamInfo]:  # EP: the experts are a unit of their own
        return [p for p in params if not (ep > 1 and is_routed_expert(p.name))]

    trainable_shard = [ParamInfo(p.name, p.shape, _shard_rows(p, world_of(p)), shard_elem(p), True,
                                 p.module_kind, p.layer) for p in _trainable(table)]
    root = [p for p in table if p.layer is None]
    unit_layer = largest_layer(table)
    root_bytes, root_gather, root_rs = _fsdp_group_sizes(root, world, shard_elem)

    def held(params: list[ParamInfo]) -> float:  # unsharded, unpadded, in the reduce dtype
        return float(sum(p.numel * shard_elem(p) for p in _trainable(params)))

    def experts_unit(index: int, params: list[ParamInfo]) -> ExpertsUnit | None:
        experts = [p for p in params if is_routed_expert(p.name)]
        if ep == 1 or not experts:
            return None
        unsharded, _, rs_in = _fsdp_group_sizes(experts, world, shard_elem, world_of)
        traced = float(sum(p.nbytes for p in _trainable(full) if p.layer == index and is_routed_expert(p.name)))
        return ExpertsUnit(bytes=unsharded, traced_grad_bytes=traced, grad_bytes=traced / ep, rs_in_bytes=rs_in,
                           rs_out_bytes=float(sum(_shard_rows(p, world // ep) * shard_elem(p)
                                                  for p in _trainable(experts))),
                           divide_bytes=rs_in if world == ep else 0.0,
                           deferred_gather_bytes=0.0 if world == ep else unsharded)

    def group(index: int, params: list[ParamInfo]) -> LayerGroup:
        unit = own_unit(params)
        experts = experts_unit(index, params)
        _, gather, rs_in = _fsdp_group_sizes(unit, world, shard_elem)
        unsharded = _fsdp_group_sizes(params, world, shard_elem, world_of)[0]  # the layer's backward: both units
        rs_out = float(sum(_shard_rows(p, world) * shard_elem(p) for p in _trainable(unit)))
        router = fp32_kept_params(params, training.precision)
        return LayerGroup(unsharded, gather, rs_in, rs_out, held(unit), experts=experts,
                          router_gather_bytes=_fsdp_group_sizes(router, world, shard_elem)[1] if router else None)

    by_layer: dict[int, list[ParamInfo]] = {}
    for p in table:
        if p.layer is not None:
            by_layer.setdefault(p.layer, []).append(p)
    groups = tuple(group(i, by_layer[i]) for i in sorted(by_layer))
    one = group(unit_layer, by_layer[unit_layer])
    sizes = FsdpSizes(root_bytes=root_bytes, root_gather_bytes=root_gather, layer_bytes=one.bytes,
                      layer_gather_bytes=one.gather_bytes, layer_rs_in_bytes=one.rs_in_bytes,
                      layer_rs_out_bytes=one.rs_out_bytes, root_rs_in_bytes=root_rs,
                      root_rs_out_bytes=root_rs / world, layer_held_bytes=one.held_bytes,
                      root_held_bytes=held(root), held_is_copy=mixed,
                      largest_grad_bytes=float(max((p.nbytes for p in _trainable(table)), default=0)),
                      layers=groups if len(set(groups)) > 1 else (), layer_experts=one.experts)
    resident = {"weights": float(sum(_shard_rows(p, world_of(p)) * shard_elem(p) for p in table)),
                "optimizer_states": optimizer_state_bytes(trainable_shard, training.optimizer, False)}
    last = groups[-1] if groups else one
    return StepModel(resident=resident, grad_policy=_full, segment_extra=None,
                     step_grads=float(sum(p.nbytes for p in trainable_shard)),
                     step_temp=step_temp_bytes(trainable_shard, training.optimizer, False),
                     forward_gathered_bytes=root_bytes + last.bytes + (last.experts.deferred_gather_bytes
                                                                       if last.experts else 0.0),
                     replay=lambda segments, num_layers, b, s, accumulating=False: replay_fsdp(
                         segments, num_layers, b, s, sizes, accumulating=accumulating))


def _zero_layout(table: list[ParamInfo], num_layers: int) -> tuple[float, list[float], float]:
    """(pre-layer numel, each of the ``num_layers`` decoder layers' numel, post-layer numel) for ZeRO-3's gather
    schedule: embeddings come before the layers, the rest (final norm, head) after."""
    layers: dict[int, float] = {}
    pre = post = 0.0
    for p in table:
        if p.layer is not None:
            layers[p.layer] = layers.get(p.layer, 0.0) + p.numel
        elif p.module_kind == "embedding":
            pre += p.numel
        else:
            post += p.numel
    return pre, [layers.get(i, 0.0) for i in range(num_layers)], post


def _zero3_layer_of(segment: str, k: int, num_layers: int, first: int = 0) -> int:
    """The decoder layer (1-based) a layer segment's repetition ``k`` runs. ``first``: forward-only first layers
    (``forward_only_layers``), which run inside the prefix: the layer segments stand for the layers after them."""
    replayed = num_layers - first
    return first + {"fw_first": 1, "fw": 2 + k, "fw_last": replayed, "bw_first": replayed,
                    "bw": replayed - 1 - k, "bw_last": 1}[segment]


# Linear layers of one module that read the same input tensor (one saved copy serves them all); any other Linear
# reads an input of its own (o_proj: the attention's reshaped output, down_proj: the gated product)
_SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up",
                 # DeepSeek's multi-head latent attention: the query and the compressed key/value read one input
                 "q_a_proj": "qkv", "kv_a_proj_with_mqa": "qkv",
                 "w1": "w13", "w3": "w13", "query": "qkv", "key": "qkv", "value": "qkv"}
# The attention's output projection: its input is the attention output reshaped, a view of the tensor SDPA's
# flash and memory-efficient kernels (and flash-attn) save themselves; eager and math attention make it a copy
_ATTENTION_OUTPUT = ("o_proj", "out_proj", "wo")
_LORA_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_", ".lora_magnitude_vector")


def _linear_input_key(name: str) -> tuple[str, str]:
    """(parent module, input) of a Linear weight's module, peft's ``base_layer`` wrapper looked through."""
    module = name.rsplit(".", 1)[0].removesuffix(".base_layer")
    parent, _, leaf = module.rpartition(".")
    return parent, _SHARED_INPUT.get(leaf, leaf)


@dataclass
class _InputGroup:
    """The Linear layers of one module that read one input tensor, in registration (forward) order."""
    weights: list[ParamInfo] = field(default_factory=list)
    adapters: list[ParamInfo] = field(default_factory=list)   # peft's lora_A of those layers

    def saved_plainly(self, lora_dropout: float) -> bool:
        """The input is saved by plain autograd already: a trainable layer reads it, or an adapter's lora_A reads
        the tensor itself (dropout 0 and an adapter of the input's dtype; peft feeds fp32 adapters a cast copy)."""
        if any(p.trainable for p in self.weights):
            return True
        return lora_dropout == 0 and any(a.elem_bytes == self.weights[0].elem_bytes for a in self.adapters)

    @property
    def trainable(self) -> bool:
        return bool(self.adapters) or any(p.trainable for p in self.weights)


def _is_router(p: ParamInfo) -> bool:
    """A router that is no ``nn.Linear`` but calls ``F.linear`` on its input cast to its own dtype (DeepSeek's
    ``mlp.gate``, kept in fp32): an input of its own, saved in the weight's dtype."""
    return p.module_kind == "other" and p.name.endswith(".gate.weight")


def _input_groups(table: list[ParamInfo]) -> dict[tuple[int | None, str, str], _InputGroup]:
    groups: dict[tuple[int | None, str, str], _InputGroup] = {}
    for p in table:
        if not (p.module_kind == "linear" or _is_router(p)) or len(p.shape) != 2 or is_routed_expert(p.name):
            continue
        if any(part in p.name for part in _LORA_PARTS):  # an adapter belongs to its wrapper's group
            if ".lora_A." in p.name:
                key = (p.layer, *_linear_input_key(p.name.split(".lora_")[0] + ".weight"))
                groups.setdefault(key, _InputGroup()).adapters.append(p)
            continue
        groups.setdefault((p.layer, *_linear_input_key(p.name)), _InputGroup()).weights.append(p)
    return {key: group for key, group in groups.items() if group.weights}


def zero3_saved_linear_inputs(table: list[ParamInfo], lora_dropout: float, head: bool, attention_view: bool
                              ) -> tuple[list[float], float]:
    """Bytes per token that DeepSpeed ZeRO-3's ``LinearFunctionForZeroStage3`` saves beyond plain autograd: each
    decoder layer's, and the output head's.

    ``zero.Init`` (transformers builds a ZeRO-3 model under it) replaces ``torch.nn.functional.linear`` with
    ``zero3_linear_wrap`` for good (``memory_efficient_linear``, default true; never restored), whose
    ``setup_context`` saves ``(input, weight, bias)`` whenever one of them needs a gradient. A trainable Linear
    saves its input anyway; a frozen one (LoRA's base model) under plain autograd saves only its weight, so its
    input is now held to its backward as well, once per input tensor (q/k/v, gate/up share one), unless that
    tensor is saved already (``_InputGroup.saved_plainly``; ``attention_view``: the attention output
    projection's input is the attention kernel's own saved output). Nothing is recorded where neither the input
    nor a parameter needs a gradient: the first layer's modules up to the first trainable one read activations
    of the frozen embedding, and where the first layers run forward only (``forward_only_layers``: LoRA on the
    routed experts past dense first layers) every module of theirs and of the first layer backward reaches up to
    its first trainable one (its routed experts, not ``F.linear``). Routed experts are left out. ``head``: the output head is one
    ``F.linear`` (the standard cross-entropy)."""
    layers = 1 + max((p.layer for p in table if p.layer is not None), default=-1)
    per_layer = [0.0] * layers
    head_bytes = 0.0
    for layer, saved in zero3_saved_linear_input_tensors(table, lora_dropout, head, attention_view):
        if layer is not None:
            per_layer[layer] += saved
        else:
            head_bytes += saved
    return per_layer, head_bytes


def zero3_saved_linear_input_tensors(table: list[ParamInfo], lora_dropout: float, head: bool, attention_view: bool
                                     ) -> list[tuple[int | None, float]]:
    """``zero3_saved_linear_inputs`` tensor by tensor, in forward order: (decoder layer, None for the head;
    bytes per token) of each input the wrapper holds beyond plain autograd (the reserved replay holds each as
    a tensor of its own: ``estimator.reserved.zero3``)."""
    out: list[tuple[int | None, float]] = []
    needs_grad = any(p.trainable for p in table if p.layer is None and p.module_kind == "embedding")
    reached = forward_only_layers(table)  # the first layer backward reaches (routed experts may be its only one)
    for (layer, _, leaf), group in _input_groups(table).items():
        first = layer is not None and layer <= reached and not needs_grad
        if first:
            needs_grad = group.trainable  # from here on the activations carry a gradient
            continue
        if group.saved_plainly(lora_dropout) or (attention_view and leaf in _ATTENTION_OUTPUT):
            continue
        saved = group.weights[0].elem_bytes * group.weights[0].shape[1]
        if layer is not None or head:
            out.append((layer, saved))
    for p in table:  # a head tied to the input embedding is that embedding's weight, called through F.linear
        if head and not p.trainable and any(t.endswith("lm_head.weight") for t in p.tied_names):
            out.append((None, p.elem_bytes * p.shape[1]))
    return out


def _zero3_saved_inputs(table: list[ParamInfo], lora_dropout: float, head: bool, checkpointed: bool,
                        attention_view: bool) -> ExtraBytes | None:
    """Bytes per token of ``zero3_saved_linear_inputs`` held per (segment, repetition): the layers run so far
    (the current one counted whole: an upper bound inside it); with checkpointing, only the layer whose
    recompute runs in backward (its forward under checkpoint saves nothing); the head's from its forward to its
    backward (the loss in between)."""
    per_layer, head_bytes = zero3_saved_linear_inputs(table, lora_dropout, head, attention_view)
    if not any(per_layer) and not head_bytes:
        return None
    num_layers = len(per_layer)
    first = forward_only_layers(table)
    upto = [sum(per_layer[:i]) for i in range(num_layers + 1)]

    def saved(segment: str, k: int) -> float:
        if segment in ("prefix", "suffix"):
            return 0.0
        if segment in ("mid_fw", "mid_bw"):
            return head_bytes + (0.0 if checkpointed else upto[-1])
        i = _zero3_layer_of(segment, k, num_layers, first)
        if checkpointed:
            return per_layer[i - 1] if segment.startswith("bw") else 0.0
        return upto[i]
    return saved


def _reached_in_first_layer(big: list[ParamInfo], layer: int, numel: float) -> float:
    """The elements of the first layer backward reaches that its backward uses, where nothing before it needs a
    gradient: with trainable parameters in its routed experts only (LoRA on the experts), its input carries no
    gradient, so its frozen attention, router and shared experts (they read that input) run forward only; only
    the experts' modules run backward. Otherwise the whole layer (``numel``)."""
    rows = [p for p in big if p.layer == layer]
    if not any(p.trainable for p in rows) or any(p.trainable and not is_routed_expert(p.name) for p in rows):
        return numel
    return float(sum(p.numel for p in rows if is_routed_expert(p.name)))


def _zero3_gathered(zcfg: ZeroSpec, table: list[ParamInfo], elem: int, checkpointed: bool = False) -> ExtraBytes:
    """Bytes of gathered (unpartitioned) parameters per (segment, repetition) under DeepSpeed ZeRO-3.

    As measured on DeepSpeed 0.19 (``benchmarks/zero_cpu_check.py``, docs/LOG.md 2026-11-22): from the second
    step on, the parameter coordinator's prefetcher runs ahead through the recorded trace and marks parameters
    it finds already gathered as needed again at their backward use, so a layer gathered in forward stays
    gathered until its backward (``stage3_max_reuse_distance`` 0, 2e6 and 1e9 gave identical peaks). What
    bounds it is ``stage3_max_live_parameters``: prefetching, and with it the marking, stops once that many
    elements are gathered. On top: the module in use and up to ``stage3_prefetch_bucket_size`` elements of the
    modules ahead. Not modelled: the flat buffer of a coalesced gather, which briefly doubles what one gather
    brings in. Persistent parameters (<= ``stage3_param_persistence_threshold`` elements) are resident and not
    counted here. Each layer counts its own tensors (a dense first layer before expert layers is smaller).
    Modules backward never runs are not marked again: forward-only first layers (``forward_only_layers``: LoRA on
    the routed experts past dense first layers) are gathered in the prefix, one at a time, and released; so is a
    frozen, untied input embedding (not under checkpointing: ``checkpointed``), and, in the first layer backward
    reaches, what runs forward only (``_reached_in_first_layer``)."""
    big = [p for p in table if p.numel > zcfg.stage3_param_persistence_threshold]
    num_layers = len({p.layer for p in table if p.layer is not None})
    pre, layers, post = _zero_layout(big, num_layers)  # a layer of persistent tensors only gathers nothing
    before = [sum(layers[:i]) for i in range(num_layers + 1)]  # numel of the layers ahead of layer i
    bucket = zcfg.stage3_prefetch_bucket_size
    live = zcfg.stage3_max_live_parameters
    first = forward_only_layers(table)
    # the input embedding is gathered again in backward only where backward reaches it (trainable) or it is also
    # the output head (tied); a frozen untied one (LoRA) is released after its forward like any module whose
    # parameters the step's trace never uses again (docs/error_matrix/zero_cpu_lora.csv: +0.2 % -> 0.01 %). With
    # checkpointing the measured peak still holds it (the checkpointed row: -0.19 % when released): likely because
    # peft's enable_input_require_grads, on under checkpointing, gives the embedding's output a gradient, so
    # DeepSpeed's module backward hooks gather it again (not confirmed)
    reused = checkpointed or any(p.trainable or p.tied_names for p in big
                                 if p.layer is None and p.module_kind == "embedding")
    kept_pre = pre if reused else 0.0
    kept = list(layers)  # what of each layer backward gathers again (is held from its forward to its backward)
    if not reused:
        kept[first] = _reached_in_first_layer(big, first, layers[first])
    kept_before = [sum(kept[first:i]) for i in range(num_layers + 1)]

    def held_before(i: int) -> float:
        """Gathered layers kept to their backward when layer i runs: those backward reaches. A forward-only
        first layer's modules never come again in the step's trace, so each is released after its forward."""
        return kept_before[i - 1] if i > first else 0.0

    def in_layer(i: int, forward: bool) -> float:
        ahead = before[-1] - before[i] + post if forward else 0.0  # backward: all held
        return min(kept_pre + held_before(i), live) + (layers if forward else kept)[i - 1] + min(bucket, ahead)

    def gathered(segment: str, k: int) -> float:
        if segment == "prefix":  # the embedding, then each forward-only layer in turn
            numel = max([pre + min(bucket, before[-1] + post)] + [in_layer(i, True) for i in range(1, first + 1)])
        elif segment == "suffix":
            numel = kept_pre
        elif segment in ("mid_fw", "mid_bw"):
            numel = min(kept_pre + held_before(num_layers + 1), live) + post
        else:
            i = _zero3_layer_of(segment, k, num_layers, first)
            numel = in_layer(i, segment.startswith("fw"))
        return elem * numel
    return gathered


def _zero3_linear_saves(spec: RunSpec, table: list[ParamInfo], attention_view: bool) -> ExtraBytes | None:
    """``_zero3_saved_inputs`` for a ZeRO-3 run built under ``zero.Init`` (the harness and the Hugging Face
    Trainer; not QLoRA, which transformers builds without it). Autocast precisions are left out: there the
    wrapper saves the fp32 input where plain autograd saved its 16-bit cast, not modelled (no run checks it)."""
    training = spec.training
    if training.qlora or training.precision.startswith("amp") or training.ckpt_policy:
        return None
    return _zero3_saved_inputs(table, training.lora_dropout, training.ce == "standard", training.grad_ckpt,
                               attention_view)


def _zero_flat_order(trainable: list[ParamInfo]) -> list[ParamInfo]:
    """DeepSpeed ZeRO-1/2 flattens the trainable tensors in ``model.parameters()`` order (one parameter group,
    ``round_robin_gradients`` off): the non-layer tensors registered before the decoder layers, the layers, the
    rest. A profile that does not record the layers' place: embeddings and tied tensors first."""
    def before(p: ParamInfo) -> bool:
        return p.before_layers if p.before_layers is not None else (p.module_kind == "embedding" or bool(p.tied_names))
    outer = [p for p in trainable if p.layer is None]
    return ([p for p in outer if before(p)] + [p for p in trainable if p.layer is not None]
            + [p for p in outer if not before(p)])


def _zero_backward_order(trainable: list[ParamInfo], flat: list[ParamInfo]) -> list[ParamInfo]:
    """The order backward finishes the gradients, whose hooks feed DeepSpeed's buckets: recorded by the profiler
    (``ParamInfo.backward_index``; a trainable tensor it never saw finished gets no gradient and is left out),
    else the flat order reversed with tied tensors last (finished at their last use's gradient)."""
    if any(p.backward_index is not None for p in trainable):
        return sorted((p for p in trainable if p.backward_index is not None), key=lambda p: p.backward_index)
    reverse = flat[::-1]
    return [p for p in reverse if not p.tied_names] + [p for p in reverse if p.tied_names]


def _ipg_flushes(sequence: list[ParamInfo], bucket: float):
    """DeepSpeed's IPG bucketing of gradients arriving in ``sequence``
    (``reduce_independent_p_g_buckets_and_remove_grads``): a gradient that would overflow the bucket first
    flushes it. Yields (index of the gradient whose arrival flushes, or ``len(sequence)`` for the flush after
    backward; the tensors flushed)."""
    pending: list[ParamInfo] = []
    elements = 0
    for i, p in enumerate(sequence):
        if pending and elements + p.numel > bucket:
            yield i, pending
            pending, elements = [], 0
        pending.append(p)
        elements += p.numel
    if pending:
        yield len(sequence), pending


@dataclass(frozen=True)
class Zero12Rank:
    """One rank's gradient path under DeepSpeed 0.19 ZeRO-1/2 (``deepspeed/runtime/zero/stage_1_and_2.py``)."""

    partition_numel: int   # elements of each rank's flat partition (the flat buffer padded to 2 x world)
    buffer_numel: int      # grads_in_partition: every tensor that overlaps the partition, in full
    largest_piece: int     # the largest gradient piece inside the partition (its fp64 norm in the step)
    appears_at: float      # stage 2: gradient bytes produced in backward when grads_in_partition is allocated
    reduction_held: float  # stage 1: gradients + grads_in_partition at the worst moment of the reduction after
    #                        backward (IPG buckets not included)
    # stage 2, per number i of gradients produced (``produced[i]`` bytes): the gradient bytes alive when the i-th
    # arrives (before its hook) and once its hook ran (``_stage2_held``); empty: not computed
    produced: tuple[float, ...] = ()
    arrival_held: tuple[float, ...] = ()
    after_held: tuple[float, ...] = ()


_ZERO12_RANKS: dict[tuple, tuple[list, list]] = {}


def zero12_ranks(table: list[ParamInfo], world: int, bucket: float) -> list[Zero12Rank]:
    """Every rank's ``Zero12Rank``, from the parameter table alone; memoized per table (a plan asks for the same
    table's ranks at every micro-batch it tries)."""
    return memo_by_owner(_ZERO12_RANKS, (id(table), world, bucket), table,
                         lambda: _zero12_ranks(table, world, bucket))


@dataclass(frozen=True)
class ZeroLayout:
    """DeepSpeed ZeRO-1/2's flat buffer: its tensors' order and the ranks' partitions of it."""

    flat: list[ParamInfo]              # trainable tensors in flat order (``_zero_flat_order``)
    offsets: list[int]                 # each tensor's first element in the flat buffer
    partition_numel: int               # elements per rank (the buffer padded to 2 x world, divided)
    world: int

    def ranks_of(self, k: int) -> range:
        """The partitions flat tensor ``k`` overlaps (``get_partition_info``: it starts inside, or the start cuts
        it)."""
        size, p = self.partition_numel, self.flat[k]
        if p.numel == 0:
            return range(0)
        return range(self.offsets[k] // size, min((self.offsets[k] + p.numel - 1) // size, self.world - 1) + 1)

    def pieces(self, k: int) -> list[tuple[int, int]]:
        """(partition, elements) of flat tensor ``k``, in flat order."""
        size, start, end = self.partition_numel, self.offsets[k], self.offsets[k] + self.flat[k].numel
        return [(r, min(end, (r + 1) * size) - max(start, r * size)) for r in self.ranks_of(k)]


def zero_layout(table: list[ParamInfo], world: int) -> ZeroLayout:
    flat = _zero_flat_order(_trainable(table))
    offsets, total = [], 0
    for p in flat:
        offsets.append(total)
        total += p.numel
    align = 2 * world  # nccl_start_alignment_factor x world
    return ZeroLayout(flat=flat, offsets=offsets, partition_numel=max(1, -(-total // align) * align // world),
                      world=world)


def _stage2_held(order: list[ParamInfo], bucket: float) -> tuple[list[float], list[float]]:
    """Gradient bytes a ZeRO-2 rank holds in backward, per number i of gradients produced in ``order``.

    A gradient that fits the bucket is copied into it by its own hook, and its storage freed. An extra-large one
    (above ``reduce_bucket_size``) is kept as it is (``extra_large_param_to_reduce``) until the next gradient's
    hook flushes the bucket (``reduce_ipg_grads``) and copies it into ``grads_in_partition`` or drops it. So when
    the i-th gradient arrives, before its hook, it is alive with the extra-large (i-1)-th one; once its hook ran,
    only itself if it is extra-large. (arrival, after) per i, i = 0 included."""
    def size(k: int) -> float:
        return float(order[k].numel * order[k].elem_bytes) if 0 <= k < len(order) else 0.0

    def extra_large(k: int) -> float:
        return size(k) if 0 <= k < len(order) and order[k].numel > bucket else 0.0
    arrival = [size(i - 1) + extra_large(i - 2) for i in range(len(order) + 1)]
    after = [extra_large(i - 1) for i in range(len(order) + 1)]
    return arrival, after


def _zero12_ranks(table: list[ParamInfo], world: int, bucket: float) -> list[Zero12Rank]:
    """``zero12_ranks`` computed: one pass over the tensors and the ranks."""
    trainable = _trainable(table)
    elem = min((p.elem_bytes for p in table), default=2)
    layout = zero_layout(table, world)
    flat, size, ranks_of = layout.flat, layout.partition_numel, layout.ranks_of
    buffer = [0] * world
    largest = [0] * world
    for k, p in enumerate(flat):
        for r, numel in layout.pieces(k):
            buffer[r] += p.numel
            largest[r] = max(largest[r], numel)
    index = {id(p): k for k, p in enumerate(flat)}

    def grad(p: ParamInfo) -> float:
        return float(p.numel * p.elem_bytes)

    # Stage 2 reduces in backward: grads_in_partition is allocated by the first flush that holds a gradient of
    # the partition, in the hook of the gradient that triggers the flush (after that gradient was produced).
    order = _zero_backward_order(trainable, flat)
    produced = [0.0]
    for p in order:
        produced.append(produced[-1] + grad(p))
    appears = [produced[-1]] * world
    seen = [False] * world
    for i, flushed in _ipg_flushes(order, bucket):
        for q in flushed:
            for r in ranks_of(index[id(q)]):
                if not seen[r]:
                    seen[r] = True
                    appears[r] = produced[min(i + 1, len(order))]
    # Stage 1 holds every gradient to the end of backward, then reduces them in flat order
    # (``reduce_gradients``): a gradient that fits the bucket is copied into it and its own storage freed; an
    # oversized one keeps its storage until it is copied into its own rank's buffer (the other ranks keep it to
    # the end of the reduction). grads_in_partition appears at the first flush holding the partition; from there
    # on the rank only frees.
    arrives = {id(p) for p in order}
    reduced = [p for p in flat if id(p) in arrives]  # tensors without a gradient are skipped
    held_all = produced[-1]
    reduction = [held_all] * world
    seen = [False] * world
    flushes = dict(_ipg_flushes(reduced, bucket))
    freed = 0.0
    for i in range(len(reduced) + 1):
        for q in flushes.get(i, ()):
            for r in ranks_of(index[id(q)]):
                if not seen[r]:
                    seen[r] = True
                    reduction[r] = max(held_all, held_all - freed + elem * buffer[r])
        if i < len(reduced) and reduced[i].numel <= bucket:
            freed += grad(reduced[i])
    arrival, after = _stage2_held(order, bucket)
    return [Zero12Rank(partition_numel=size, buffer_numel=buffer[r], largest_piece=largest[r],
                       appears_at=appears[r], reduction_held=reduction[r], produced=tuple(produced),
                       arrival_held=tuple(arrival), after_held=tuple(after)) for r in range(world)]


def _grads_alive(produced: tuple[float, ...], arrival: tuple[float, ...], after: tuple[float, ...]
                 ) -> Callable[..., float]:
    """Gradient bytes alive at a profile candidate of a ZeRO backward (``_stage2_held``'s per-gradient bytes), given
    (bytes produced before its segment, bytes produced in it so far, bytes produced in it at the segment's
    previous candidate). The profile keeps a candidate only where no later one holds as much activation and as many
    gradient bytes, so each gradient produced since the previous candidate may have arrived at a dropped moment
    with no more activation than this one: the worst of those arrivals (before the hook, with the extra-large
    gradient still pending). A candidate that produced nothing since the previous one comes after the last hook
    (the engine runs a gradient's hook as it finishes it, before any other allocation). A profile that records
    its hook moments (``hooks``) keeps every one of them, so the worst arrival is the candidate's own."""
    def index(num_bytes: float) -> int:
        return bisect.bisect_right(produced, num_bytes + 0.5) - 1

    def alive(prev: float, within: float, since: float = 0.0, hook: bool | None = None) -> float:
        first, last = index(prev + since), index(prev + within)
        if last == first:
            # a hook moment after a moment with the same gradients (its gradient's allocation): the hook runs
            # with that gradient and the pending one alive
            return arrival[last] if hook and last > 0 else after[last]
        return max(arrival[first + 1:last + 1])
    return alive


def _stage2_grads_alive(path: Zero12Rank, in_flight: float) -> Callable[..., float]:
    """``_grads_alive`` on a rank's path; without the per-gradient path: the largest gradient, at most what the
    segment produced."""
    if not path.produced:
        return lambda prev, within, since=0.0, hook=None: min(within, in_flight)
    return _grads_alive(path.produced, path.arrival_held, path.after_held)


def _stage3_grads_alive(trainable: list[ParamInfo], bucket: float, leaves: tuple[str, ...] = ()
                        ) -> Callable[..., float]:
    """ZeRO-3's gradients in backward (``__add_grad_to_ipg_bucket``): one that fits the bucket is copied into it
    and its storage freed; a larger one stays as it is until the next gradient's hook flushes the bucket
    (``__reduce_and_partition_ipg_grads``), as under ZeRO-2. The gradients of a leaf module's parameters
    (``leaves``: ``estimator.models.zero3_leaf``) get no hook of their own: they stay until the module's
    backward is done (``_leaf_held``)."""
    order = _zero_backward_order(trainable, _zero_flat_order(trainable))
    produced = [0.0]
    for p in order:
        produced.append(produced[-1] + p.numel * p.elem_bytes)
    arrival, after = _leaf_held(order, bucket, leaves) if leaves else _stage2_held(order, bucket)
    return _grads_alive(tuple(produced), tuple(arrival), tuple(after))


def _leaf_held(order: list[ParamInfo], bucket: float, leaves: tuple[str, ...]) -> tuple[list[float], list[float]]:
    """``_stage2_held`` where some gradients belong to ZeRO-3 leaf modules: DeepSpeed hooks no parameter of a leaf
    (``create_reduce_and_remove_grad_hooks`` skips ``z3_leaf_parameter``s) and reduces them all in the module's
    full backward hook (``reduce_leaf_module_grads``), taken here as at the hook of its last gradient in
    ``order``: each of them is alive from its arrival to then. The others as ``_stage2_held``: a gradient that
    fits the bucket is freed by its own hook, an extra-large one kept to the next hook."""
    def size(k: int) -> float:
        return float(order[k].numel * order[k].elem_bytes) if 0 <= k < len(order) else 0.0

    leaf = [leaf_of(p.name, leaves) for p in order]
    done = {name: k for k, name in enumerate(leaf) if name is not None}  # the last gradient of each leaf

    total: dict[str, float] = {}
    for k, name in enumerate(leaf):
        if name is not None:
            total[name] = total.get(name, 0.0) + size(k)
    pending = [0.0]  # pending[u]: leaf gradients among the first u whose module's backward is not done by then
    for k, name in enumerate(leaf):
        pending.append(pending[-1] + (size(k) if name is not None else 0.0)
                       - (total[name] if name is not None and done[name] == k else 0.0))

    def extra_large(k: int) -> float:  # a hooked gradient above the bucket, kept to the next hook
        return size(k) if 0 <= k < len(order) and order[k].numel > bucket and (
            leaf[k] is None or done[leaf[k]] == k) else 0.0
    arrival = [0.0] + [size(i - 1) + extra_large(i - 2) + pending[i - 1] for i in range(1, len(order) + 1)]
    after = [0.0] + [extra_large(i - 1) + pending[i] for i in range(1, len(order) + 1)]
    return arrival, after


def zero(spec: RunSpec, table: list[ParamInfo], rank: int = 0, path: Zero12Rank | None = None,
         attention_view: bool = True, leaves: tuple[str, ...] = ()) -> StepModel:
    """DeepSpeed ZeRO-1/2/3 and ZeRO-Offload as DeepSpeed 0.19 allocates (``harness/methods/deepspeed.py``
    config: torch AdamW on the partitions), checked against real DeepSpeed runs on CPU with every storage
    counted (``benchmarks/zero_cpu_check.py``).

    Stages 1/2: the 16-bit (or fp32) weights flattened in full; an fp32 master partition, cloned even for fp32
    weights; Adam states on the partition. Gradients go through IPG buckets of ``reduce_bucket_size`` elements,
    allocated in full at the first gradient of backward (two with ``overlap_comm``) and freed after it, into a
    16-bit partition buffer (``grads_in_partition``) holding every tensor that overlaps the rank's partition of
    the flat buffer (``model.parameters()`` order, so OPT's final norm sits with the embeddings in rank 0's).
    Stage 2 reduces during backward, the buckets filled in the order backward finishes the gradients (recorded
    by the profiler; a tied embedding is finished last): the buffer appears at the first flush that holds a
    gradient of the partition. A gradient larger than the bucket stays alive until the next gradient's hook
    (stages 2 and 3, ``_stage2_held``). Stage 1 holds every gradient until backward ends and reduces them then, in flat
    order, freeing each gradient that fits the bucket as it goes. Both are per rank (``zero12_ranks``). The step
    flattens the partition, casts it to fp32, computes the norm in fp64 per gradient piece, and runs Adam.
    Stage 3: the weight partition, an IPG bucket and the gradient partition buffer live from initialization;
    gathered parameters follow ``_zero3_gathered``; ``leaves``: the ZeRO-3 leaf modules
    (``estimator.models.zero3_leaf.leaf_modules``), whose gradients wait for the module's backward."""
    training, parallel = spec.training, spec.parallel
    zcfg = parallel.zero
    world = parallel.world_size
    stage = parallel.zero_stage
    offload_opt = parallel.method == "zero_offload" or zcfg.offload_optimizer
    # DeepSpeed offloads parameters only under stage 3 (ZeRO-Infinity); below it offload_param is ignored.
    offload_param = zcfg.offload_param and stage == 3
    elem16 = min(p.elem_bytes for p in table)
    trainable = _trainable(table)
    n_train = sum(p.numel for p in trainable)
    part = 1.0 / world
    weights = weights_bytes(table)
    # pure bf16 runs DeepSpeed's bf16_master_weights_and_grads + bf16_optimizer_states (harness/methods/deepspeed.py):
    # the master partition, its gradient and Adam's states in bf16, laid out as fp32 training lays out fp32 ones
    master_elem = elem16 if training.precision == "bf16" else FP32
    master = master_elem * n_train * part
    states = optimizer_state_bytes(trainable, training.optimizer, master_elem == FP32, shard=part)
    fp32_grads = master_elem * n_train * part
    partition16 = elem16 * n_train * part  # the 16-bit gradient partition buffer
    cast32 = fp32_grads if elem16 != master_elem else 0.0  # .to(dtype) of a tensor of that dtype is the tensor
    adam_temp = step_temp_bytes(trainable, training.optimizer, master_elem == FP32, shard=part)
    if stage == 3:
        adam_temp = min(adam_temp, FP32 * zcfg.sub_group_size)
    largest = max((p.numel for p in trainable), default=0)
    norm_temp = 8.0 * min(largest, n_train * part)  # one gradient (piece) of the partition in fp64
    ipg = zcfg.reduce_bucket_size * elem16 if zcfg.contiguous_gradients else 0.0
    in_flight = float(largest * elem16)
    notes = ["ZeRO accounting follows DeepSpeed 0.19's allocations (checked on real DeepSpeed CPU runs and on "
             "emulated ranks of an H200, docs/error_matrix/README.md)"]
    host = 0.0
    if offload_opt:  # masters, states and fp32 gradients live in host RAM and the step runs there
        host = master + states + fp32_grads
        master = states = partition16 = cast32 = adam_temp = norm_temp = 0.0
    resident: dict[str, float] = {}
    extra = saved_per_token = None
    if stage == 3:
        persistent = sum(p.nbytes for p in table if p.numel <= zcfg.stage3_param_persistence_threshold)
        resident["weights"] = 0.0 if offload_param else weights * part + persistent
        if offload_param:
            host += weights * part  # each rank offloads its own partition
        resident["comm_buffers"] = ipg
        resident["gradients"] = partition16
        extra = _zero3_gathered(zcfg, table, elem16, training.grad_ckpt)
        saved_per_token = _zero3_linear_saves(spec, table, attention_view)
        if saved_per_token is not None:
            notes.append("zero3: zero.Init's memory-efficient linear (LinearFunctionForZeroStage3) saves each frozen "
                         "Linear's input for backward, which plain autograd does not: counted with the activations")

        grads_alive = _stage3_grads_alive(trainable, zcfg.reduce_bucket_size, leaves)
        if leaves:
            notes.append(f"zero3 leaf modules (zero_optimization.leaf_module): {len(leaves)}, e.g. {leaves[0]}; each "
                         "is gathered whole when entered and its gradients are reduced once its backward is done")

        def held(prev: float, within: float, since: float = 0.0, hook: bool | None = None) -> float:
            return grads_alive(prev, within, since, hook)
        held.since_previous = True
        held.hook_aware = True
        # The gradient partition buffer stays: the fp64 norm of one gradient, or the fp32 gradients + Adam.
        step_grads = accumulated = 0.0
        step_candidates = [norm_temp, cast32 + adam_temp]
    else:
        resident["weights"] = weights
        buckets = ipg * (2 if zcfg.overlap_comm_for(stage) else 1)
        path = path or zero12_ranks(table, world, zcfg.reduce_bucket_size)[rank]
        if offload_opt:
            # cpu_offload's temp_grad_buffer_for_gpu_offload: largest_param_numel 16-bit elements on the GPU for
            # the run; the last flush casts each piece of the partition to fp64 (the norm) while the bucket lives
            resident["comm_buffers"] = float(largest * elem16)
            norm_temp = buckets + 8.0 * path.largest_piece
        if not offload_opt:  # the master partition and the flat partitions of the step are P elements each
            master = master_elem * path.partition_numel
            partition16 = elem16 * path.partition_numel
            cast32 = master_elem * path.partition_numel if elem16 != master_elem else 0.0
            norm_temp = 8.0 * path.largest_piece
        in_partition = 0.0 if offload_opt else float(elem16 * path.buffer_numel)
        # Above that buffer: the fp64 norm of one gradient piece; the flattened partition + its fp32 cast; then
        # (the 16-bit buffers freed) the fp32 gradient + Adam's temporaries.
        step_candidates = [norm_temp, partition16 + cast32, max(cast32, partition16) + adam_temp - in_partition]
        if stage == 1:
            if not zcfg.overlap_comm_for(stage) and not offload_opt:
                # Every gradient is held to the end of backward; the reduction after it (activations gone but the
                # loss) frees them as it goes, in flat order, and allocates this rank's buffer (``zero12_ranks``).
                step_candidates.append(path.reduction_held + buckets - in_partition)
            else:
                # overlap_comm (or offload) reduces in backward, but keeps the other partitions' oversized
                # gradients: counted as every gradient held, plus the buffer after backward (an upper bound).
                step_candidates.append(grad_bytes(table) + buckets)

            def held(prev: float, within: float) -> float:
                return prev + within + (buckets if prev + within > 0 else 0.0)
        else:
            appears = path.appears_at
            grads_alive = _stage2_grads_alive(path, in_flight)

            def held(prev: float, within: float, since: float = 0.0, hook: bool | None = None) -> float:
                # the buckets and the partition buffer appear in a gradient's hook: at a moment before the hook
                # of the gradients produced since the previous candidate (known only where the profile records
                # its hook moments), only those hooked before count
                hooked = prev + (since if hook is False and since < within else within)
                return (grads_alive(prev, within, since, hook) + (buckets if hooked > 0 else 0.0)
                        + (in_partition if hooked >= appears - 0.5 else 0.0))
            held.breakpoints = (appears,)
            held.since_previous = True
            held.hook_aware = True
        step_grads = in_partition
        accumulated = grad_bytes(table) if stage == 1 else in_partition
    resident["master_weights"] = master
    resident["optimizer_states"] = states
    return StepModel(resident=resident, grad_policy=held, segment_extra=extra, step_grads=step_grads,
                     step_temp=max(step_candidates), host_bytes=host, notes=notes,
                     accumulated_grad_bytes=accumulated, largest_grad_bytes=in_flight,
                     segment_saved_per_token=saved_per_token)


def attention_output_saved(profile: dict) -> bool:
    """Whether the attention's output, as the output projection reads it, is a tensor the attention kernel saves
    itself: SDPA's flash and memory-efficient kernels and flash-attn lay it out as (b, s, heads, dim), so the
    reshape is a view; eager attention and SDPA's math kernel return (b, heads, s, dim) and the reshape copies."""
    return profile.get("attn_effective") in ("sdpa", "flash") and "math" not in profile.get("sdpa_backends", ())
