"""An expert-parallel (EP) FSDP2 rank's step as the caching allocator sees it: FSDP2's timeline
(``estimator.reserved.fsdp``) with each decoder layer's routed experts as an FSDP2 unit of their own and the
all-to-all path's tensors, as transformers 5.24 runs ``DistributedConfig(fsdp_size=world, ep_size=ep)``
(``estimator.models.moe_ep``, whose arithmetic this module places on the profile's event list).

Covered: balanced and skewed routing (the busiest rank), no checkpointing, bf16, fp32 and mixed precision, any ep
dividing the world. The
boundaries are those of the analytic EP replay (``estimator.methods.fsdp_replay``, whose requested peak this replay
reproduces):

* the experts' unit: this rank's num_experts / ep experts, sharded over the world / ep ranks holding them (the
  efsdp mesh), gathered and unsharded with the layer's unit at its pre-forward and pre-backward, resharded with it
  after forward; forward keeps their all-gather output until the next layer's copy-out (FSDP2's implicit
  prefetch); their post-backward reduce-scatters over the efsdp mesh (transformers forces a sum there and
  divides the output in place: no allocation). On a one-rank mesh (ep == world) FSDP2 copies the shard into the
  unsharded tensors (no all-gather output; under mixed precision each after its shard's cast to the compute
  dtype, freed once the next cast is made) and, in the post-backward, divides a copy of the gradients instead of
  reduce-scattering them (``ExpertsUnit.divide_bytes``);
* the experts' gradients: the one-device trace made every expert's; this rank makes its own (1 / ep of each);
  their post-backward runs once they are made, just before the layer's next gradient (the router's): the
  moment ``fsdp_replay.experts_levels`` reads off the same event list;
* what the all-to-all path keeps per MoE layer from its forward to its experts' post-backward (the int64 sort
  order and the bool sentinel mask of the T x top_k rows: ``EpLayout.layer_saved_bytes``), allocated at the
  layer's forward end;
* the forward's transient at the layer's end (``EpLayout.forward_transient_bytes``: the un-permuted rows or the
  combine's returned rows, whichever is more), freed at once;
* the un-permute's backward just before the experts' first gradient (``EpLayout.unpermute_bump``);
* a module a 16-bit model keeps in fp32 (DeepSeek's router): in backward a unit of its own, whose all-gather the
  layer's pre-backward prefetches instead of the previous layer's, issued at the router's pre-backward (just
  before its gradient), as the analytic replay has it (``LayerGroup.router_gather_bytes``);
* under skewed routing, the busiest rank's extra rows (``EpLayout.backward_bumps``): their indices and unit
  weights (part of the saved bytes) released as the experts' backward starts, what it holds for their gradients
  from the experts' first gradient to their last.

The all-to-all's own buffers are the default stream's: transformers' ``all_to_all_single_autograd`` runs the
functional collective on the current stream (no side stream, no ``record_stream``), so they are part of the
transients above. Three differences from the analytic replay, where the analytic one works on levels: its
forward layer keeps the layer unit's all-gather output through the layer (here freed as the experts' copy-out
frees it, FSDP2's ``wait_for_unshard`` of the next unit); it lowers the trace's highest moment before the
experts' first gradient by the S rows the one-device experts still hold there (``EpLayout.backward_bumps``'
first term, no tensor of its own in the event list); on an efsdp mesh of more than one rank it never holds the
experts' all-gather output while their copy-out makes the unsharded experts, which a copy-out cannot avoid (here,
at the layer's boundary in backward).
"""

from __future__ import annotations

import dataclasses

from estimator.methods.state import fp32_kept_params
from estimator.models.moe import is_routed_expert
from estimator.models.params import ParamInfo
from estimator.profiler.expand import ALLOC, FREE, Expansion, ExpansionError
from estimator.reserved.fsdp import (
    ALL_GATHER,
    FP32,
    OPTIMIZERS,
    REDUCE_SCATTER,
    FsdpStep,
    Tensor,
    _boundary,
    _Builder,
    _group,
    _Step,
    boundary_marks,
    finish_step,
    method_expansion,
    shard_numel,
)
from estimator.reserved.timeline import Setup, model_order

EXPERTS = "experts"


def why_not_ep(spec, table: list[ParamInfo] | None) -> str | None:
    """Why an EP spec is not replayed (None: it is)."""
    parallel, training = spec.parallel, spec.training
    if parallel.method != "fsdp":
        return f"expert parallelism under {parallel.method}: only fsdp + ep is replayed"
    if training.grad_ckpt:
        return "expert parallelism with checkpointing: the recomputed dispatch and combine are not in the replay yet"
    if training.grad_accum_steps > 1:
        return "expert parallelism with gradient accumulation: not in the replay yet"
    if training.lora or training.qlora:
        return "expert parallelism with LoRA: not in the replay yet"
    return None


def local_table(table: list[ParamInfo], ep: int) -> list[ParamInfo]:
    """Each routed expert tensor as this rank holds it: num_experts / ep experts along dim 0."""
    return [dataclasses.replace(p, shape=(p.shape[0] // ep, *p.shape[1:]), numel=p.numel // ep)
            if is_routed_expert(p.name) else p for p in table]


def group_of(p: ParamInfo):
    """The FSDP2 unit of a parameter: the root, a decoder layer, or a layer's routed experts."""
    if p.layer is None:
        return "root"
    return (EXPERTS, p.layer) if is_routed_expert(p.name) else p.layer


def unit_world(g, world: int, ep: int) -> int:
    return world // ep if isinstance(g, tuple) else world


def ep_setup(table: list[ParamInfo], buffers: tuple[int, int], num_layers: int, world: int, ep: int, mixed: bool
             ) -> Setup:
    """``fsdp_setup`` with the experts' shards: this rank's experts, sharded over the ranks holding them."""
    local = local_table(table, ep)
    allocations = [(p.name, shard_numel(p, unit_world(group_of(p), world, ep)) * (FP32 if mixed else p.elem_bytes))
                   for p in model_order(local)]
    non_layer, per_layer = buffers
    if per_layer:
        allocations.extend((f"buffers.{layer}", per_layer) for layer in range(num_layers))
    if non_layer:
        allocations.append(("buffers", non_layer))
    return Setup(allocations, [], [])


@dataclasses.dataclass(frozen=True)
class EpBytes:
    """The all-to-all path's bytes at one (b, s), per MoE layer (``estimator.models.moe_ep.EpLayout``)."""
    saved: int        # kept from the layer's forward to its experts' post-backward
    transient: int    # the forward's highest moment above the layer's end
    unpermute: int    # the un-permute's backward above the level before the experts' first gradient
    # skewed routing, the busiest rank's extra rows (``EpLayout.backward_bumps``): of ``saved``, their indices and
    # unit weights, released as the experts' backward starts; what that backward holds for them until their last
    # gradient (the down projection's or the product's gradients)
    released: int = 0
    during: int = 0


def ep_bytes(layout, tokens: int, act_bytes: int) -> EpBytes:
    _first, during, last = layout.backward_bumps(tokens, act_bytes)
    return EpBytes(saved=round(layout.layer_saved_bytes(tokens, act_bytes)),
                   transient=round(layout.forward_transient_bytes(tokens, act_bytes)),
                   unpermute=round(layout.unpermute_bump(tokens, act_bytes)),
                   released=round(-last), during=round(during - last))


class _EpStep(_Step):
    """FSDP2's step tensors with units of their own world (the experts' one-rank mesh)."""

    def __init__(self, build: _Builder, groups: dict, worlds: dict, grads: dict, first: bool, optimizer: str,
                 mixed: bool, per_layer: EpBytes) -> None:
        super().__init__(build, groups, 0, grads, first, optimizer, mixed)
        self.worlds, self.per_layer = worlds, per_layer
        self.saved: dict[int, list[Tensor]] = {}   # layer -> what the all-to-all path keeps for its backward
        self.during: dict[int, list[Tensor]] = {}  # layer -> what the experts' backward holds for the extra rows
        self.router_gather: dict[int, int] = {}  # layer -> its fp32 router unit's all-gather output bytes
        self.routers: dict[int, Tensor] = {}  # layer -> that output, prefetched by the layer's pre-backward

    def alloc_if(self, out: list, nbytes: int) -> list[Tensor]:
        return [self._alloc(out, nbytes)] if nbytes else []

    def copy_out(self, out: list, g) -> None:
        world = self.worlds[g]
        if world > 1 or not self.mixed:
            self.unsharded[g] = [self._alloc(out, world * shard_numel(p, world) * p.elem_bytes)
                                 for p in self.groups[g].params]
            return
        # a one-rank mesh under mixed precision (``wait_for_unshard``): each fp32 shard cast to the compute dtype
        # (``all_gather_inputs``), then its unsharded tensor; a cast lives until the next one is bound, the last
        # until the loop is over
        self.unsharded[g] = []
        cast = None
        for p in self.groups[g].params:
            nbytes = shard_numel(p, world) * p.elem_bytes
            previous, cast = cast, self._alloc(out, nbytes)
            if previous is not None:
                self._free(out, previous)
            self.unsharded[g].append(self._alloc(out, nbytes))
        if cast is not None:
            self._free(out, cast)

    def all_gather(self, out: list, g) -> None:
        if self.worlds[g] > 1:
            super().all_gather(out, g)

    def free_gathered(self, out: list, g) -> None:
        if g in self.gathered:  # a layer's own is freed earlier by its experts' copy-out
            super().free_gathered(out, g)

    def post_backward(self, out: list, g) -> None:
        world = self.worlds[g]
        if world > 1:
            self.world = world
            super().post_backward(out, g)
            return
        # a one-rank mesh (the experts on ep == world): the gradients copied into the reduce dtype's input and all
        # freed (``foreach_reduce`` keeps a loop variable on the last one only for world > 1), the output
        # allocated and the input divided into a temporary copied into it, which becomes the gradient shards
        self.reshard(out, g)
        if self.reduce_in is not None:
            self._free(out, self.reduce_in)
            self.reduce_in = None
        group = self.groups[g]
        if not group.trainable:
            return
        self.reduce_in = self._alloc(out, group.reduce_in_bytes)
        grads = self.grads.get(g, [])
        for key, size_index in grads[::-1]:
            out.append((FREE, key, size_index))
        self.reduce_out[g] = self._alloc(out, group.reduce_in_bytes, REDUCE_SCATTER)
        self.reduce_out_keys.add(self.reduce_out[g].key)
        divided = self._alloc(out, group.reduce_in_bytes, REDUCE_SCATTER)
        self._free(out, divided)

    def optimizer_step(self, out: list, order: list[ParamInfo]) -> None:
        elem = (lambda p: FP32) if self.mixed else (lambda p: p.elem_bytes)
        self.adamw(out, [shard_numel(p, self.worlds[group_of(p)]) * elem(p) for p in order if p.trainable],
                   self.first, self.optimizer)


def _experts_grads(grads: dict, table: list[ParamInfo], polys: list, routers: frozenset[str] = frozenset()
                   ) -> tuple[dict, dict[int, int]]:
    """Split each layer's gradient keys (``fsdp._grads_by_group``, in parameter order) into the layer's unit and
    its experts'; and the keys of the ``routers``' gradients (parameter names) with their layer."""
    trainable: dict = {}
    for p in table:
        if p.trainable and p.layer is not None:
            trainable.setdefault(p.layer, []).append(p)
    out: dict = {}
    router_keys: dict[int, int] = {}
    for g, keys in grads.items():
        if g == "root":
            out[g] = keys
            continue
        params = trainable[g]
        if any(p.backward_index is None for p in params):
            keys = _by_size(params, keys, polys)
        for p, key in zip(params, keys):
            out.setdefault(group_of(p), []).append(key)
            if p.name in routers:
                router_keys[key[0]] = g
    return out, router_keys


def _by_size(params: list[ParamInfo], made: list, polys: list) -> list:
    """Gradient keys taken as made (a profile without the parameters' backward order) put in parameter order:
    each to the parameter of its bytes that comes latest in forward (backward runs it first)."""
    free = list(reversed(range(len(params))))
    out: list = [None] * len(params)
    for key in made:
        poly = polys[key[1]]
        i = next((i for i in free if params[i].nbytes == poly[0] and not any(poly[1:])), None)
        if i is None:
            raise ExpansionError("ep: a gradient of no parameter's bytes")
        free.remove(i)
        out[i] = key
    return out


def _ep_step_ops(expansion: Expansion, ops: list, marks: tuple, build: _Builder, groups: dict, worlds: dict,
                 table: list[ParamInfo], optimizer: str, mixed: bool, first: bool, num_layers: int,
                 scalar: set[int], per_layer: EpBytes, moe_layers: set[int], grads: dict, local_size: dict,
                 router_gather: dict[int, int], router_keys: dict[int, int]
                 ) -> tuple[list, dict[int, int], int, int, set[int]]:
    """``fsdp._step_ops`` with the experts' units and the all-to-all path's tensors (the module docstring)."""
    step = _EpStep(build, groups, worlds, grads, first, optimizer, mixed, per_layer)
    step.router_gather = router_gather
    grad_keys = expansion.grad_keys
    cut, at_mark, seed = boundary_marks(ops, marks, scalar)
    expert_keys = {key: g[1] for g, keys in grads.items() if isinstance(g, tuple) for key, _ in keys}
    # forward: each MoE layer's end (the next segment instance's start); backward: the experts' first gradient
    # and the next gradient after their last (their post-backward)
    forward_end: dict[int, int] = {}
    instances = sorted(marks, key=lambda m: m[2])
    for (name, layer, _at), (_n, _l, next_at) in zip(instances, instances[1:]):
        if name in ("fw_first", "fw", "fw_last") and layer in moe_layers:
            forward_end[next_at] = layer
    made: dict[int, int] = {}   # MoE layer -> its experts' gradients made so far

    def experts_done(out: list) -> None:  # their post-backward, then what the all-to-all path kept goes
        for layer in [m for m, count in made.items() if count == len(grads[(EXPERTS, m)])]:
            for tensor in step.saved.pop(layer):  # freed by the experts' own backward, before their hook
                step._free(out, tensor)
            step.post_backward(out, (EXPERTS, layer))
            del made[layer]

    out: list = []
    moved: dict[int, int] = {}
    seed_free = None
    for index, op in enumerate(ops[:cut]):
        if index in forward_end:  # the layer's end: what its all-to-all path keeps, then its forward's transient
            layer = forward_end[index]
            step.saved[layer] = step.alloc_if(out, per_layer.saved - per_layer.released) + step.alloc_if(
                out, per_layer.released)
            step._free(out, step._alloc(out, per_layer.transient))
        if index in at_mark:
            experts_done(out)
        for name, layer in at_mark.get(index, ()):
            _ep_boundary(step, out, name, layer, num_layers, moe_layers)
        if op[0] == ALLOC and op[1] in grad_keys:
            layer = expert_keys.get(op[1])
            if layer is None:
                experts_done(out)  # the layer's next gradient (the router's): the experts' backward is over
                router = router_keys.get(op[1])
                if router is not None and router in step.routers:  # the router unit's pre-backward: the previous
                    step._free(out, step.routers.pop(router))      # layer's all-gather, deferred to here
                    if router > 0:
                        step.all_gather(out, router - 1)
            else:
                if layer not in made:  # the un-permute's backward, just before the experts' first gradient
                    step._free(out, step._alloc(out, per_layer.unpermute))
                    if per_layer.released:  # the extra rows' indices and unit weights go, their gradients come
                        step._free(out, step.saved[layer].pop())
                    step.during[layer] = step.alloc_if(out, per_layer.during)
                made[layer] = made.get(layer, 0) + 1
                if made[layer] == len(grads[(EXPERTS, layer)]):  # the last: the extra rows' gradients are gone
                    for tensor in step.during.pop(layer):
                        step._free(out, tensor)
        moved[index] = len(out)
        if op[0] == FREE and op[1] in grad_keys:
            continue
        if seed is not None and op[0] == FREE and op[1] == seed[1]:
            seed_free = op
            continue
        out.append((op[0], op[1], local_size.get(op[1], op[2])))
    experts_done(out)
    for name, layer in at_mark.get(cut, ()):
        _ep_boundary(step, out, name, layer, num_layers, moe_layers)
    if step.saved:
        raise ExpansionError("ep: an experts unit's post-backward was not found in the event list")
    step.post_backward(out, "root")
    return finish_step(step, out, ops, cut, moved, seed_free, grad_keys, table, group_of, "ep")


def _ep_boundary(step: _EpStep, out: list, name: str, layer: int | None, num_layers: int, moe_layers: set[int]
                 ) -> None:
    """``fsdp._boundary`` with the experts' unit unsharded beside its layer's and resharded with it after
    forward (its post-backward runs inside the layer's backward segment)."""
    experts = layer is not None and layer in moe_layers
    if name in ("fw_first", "fw", "fw_last"):
        if layer and layer - 1 in moe_layers:
            step.reshard(out, (EXPERTS, layer - 1))
        _boundary(step, out, name, layer, num_layers, True)
        if layer:  # the previous layer's experts' all-gather output, held to this copy-out (implicit prefetch)
            step.free_gathered(out, (EXPERTS, layer - 1))
        if experts:  # the experts' copy-out frees the layer's all-gather output (the next unit's wait_for_unshard)
            step.all_gather(out, (EXPERTS, layer))
            step.copy_out(out, (EXPERTS, layer))
            step.free_gathered(out, layer)
        return
    if name in ("bw_first", "bw", "bw_last"):
        if layer != num_layers - 1:
            step.post_backward(out, layer + 1)
        step.copy_out(out, layer)
        step.free_gathered(out, layer)
        if experts:  # prefetched by the layer's pre-backward, unsharded at the experts' own
            step.all_gather(out, (EXPERTS, layer))
            step.copy_out(out, (EXPERTS, layer))
            step.free_gathered(out, (EXPERTS, layer))
        if layer in step.router_gather:  # the router unit comes before the previous layer (``LayerGroup``)
            step.routers[layer] = step._alloc(out, step.router_gather[layer], ALL_GATHER)
        elif layer > 0:
            step.all_gather(out, layer - 1)
        return
    if name == "mid_fw" and num_layers - 1 in moe_layers:
        step.reshard(out, (EXPERTS, num_layers - 1))
    if name == "mid_bw":  # the root's post-forward frees the last all-gather output held
        step.free_gathered(out, (EXPERTS, num_layers - 1))
    _boundary(step, out, name, layer, num_layers, True)


def ep_step(expansion: Expansion, table: list[ParamInfo], world: int, ep: int, precision: str, optimizer: str,
            base_size_index: int, num_layers: int, polys: list, per_layer: EpBytes) -> FsdpStep:
    """The EP rank's step (the module docstring); the new tensors' sizes take indices from ``base_size_index`` on.
    ``table``: the whole model's parameters (every expert)."""
    from estimator.reserved.fsdp import _grads_by_group

    if optimizer not in OPTIMIZERS:
        raise ExpansionError(f"ep: the {optimizer} optimizer's step over shards is not modelled")
    mixed = precision.startswith("mixed_")
    local = local_table(table, ep)
    params: dict = {}
    for p in model_order(local):
        params.setdefault(group_of(p), []).append(p)
    if any(layer not in params for layer in range(num_layers)) or "root" not in params:
        raise ExpansionError("ep: a decoder layer or the root holds no parameters")
    worlds = {g: unit_world(g, world, ep) for g in params}
    groups = {g: _group(ps, worlds[g], mixed) for g, ps in params.items()}
    moe_layers = {g[1] for g in params if isinstance(g, tuple)}
    build = _Builder(expansion.steady.keys, base_size_index)
    first_marks, steady_marks = expansion.marks
    scalar = {i for i, poly in enumerate(polys) if 0 < poly[0] <= 8 and not any(poly[1:])}
    # a module a 16-bit model keeps in fp32 (DeepSeek's router): a unit of its own in backward, as the analytic
    # replay has it (``fsdp_replay.LayerGroup.router_gather_bytes``); forward gathers it with its layer
    router_params = [p for layer in range(num_layers) for p in fp32_kept_params(params[layer], precision)]
    routers = frozenset(p.name for p in router_params)
    router_gather: dict[int, int] = {}
    for p in router_params:
        router_gather[p.layer] = router_gather.get(p.layer, 0) + world * shard_numel(p, world) * p.elem_bytes
    common = dict(build=build, groups=groups, worlds=worlds, table=local, optimizer=optimizer, mixed=mixed,
                  num_layers=num_layers, scalar=scalar, per_layer=per_layer, moe_layers=moe_layers,
                  router_gather=router_gather)
    results = []
    first_start = build.next_key
    next_keys = []
    for ops, marks, first in ((expansion.first.ops, first_marks, True), (expansion.steady.ops, steady_marks, False)):
        build.next_key = first_start  # the steady step's tensors reuse the first step's key range
        grads, router_keys = _experts_grads(_grads_by_group(expansion, ops, table), table, polys, routers)
        local_size = _local_grad_sizes(grads, polys, ep, build)
        results.append(_ep_step_ops(expansion, ops, marks, first=first, grads=_resized(grads, local_size),
                                    local_size=local_size, router_keys=router_keys, **common))
        next_keys.append(build.next_key)
    (first_ops, first_moved, _o, first_loss_freed, first_outputs), (steady_ops, _m, steady_optimizer, _l,
                                                                    steady_outputs) = results
    return FsdpStep(expansion=method_expansion(
        "ep", expansion, first_ops, steady_ops, max(next_keys), first_moved, (first_loss_freed, steady_optimizer),
        grad_keys=frozenset(first_outputs | steady_outputs)), sizes=build.sizes)


def _local_grad_sizes(grads: dict, polys: list, ep: int, build: _Builder) -> dict[int, int]:
    """Key -> size index of this rank's expert gradients: the trace's (every expert) over ep."""
    out = {}
    for g, keys in grads.items():
        if not isinstance(g, tuple):
            continue
        for key, poly_index in keys:
            poly = polys[poly_index]
            if any(poly[1:]) or poly[0] % ep:
                raise ExpansionError("ep: an expert gradient whose bytes do not split over the ep ranks")
            out[key] = build.tensor(poly[0] // ep).size_index
            build.next_key -= 1  # a size only, no tensor of its own
    return out


def _resized(grads: dict, local_size: dict[int, int]) -> dict:
    return {g: [(key, local_size.get(key, poly)) for key, poly in keys] for g, keys in grads.items()}


_STEPS: dict[tuple, tuple] = {}


def spec_ep_bytes(spec, table: list[ParamInfo], b: int, s: int) -> EpBytes:
    """The all-to-all path's bytes of ``spec`` at (b, s), its layout from the model's config
    (``estimator.models.moe_ep.ep_layout``) and the table's MoE layers."""
    from estimator.methods.expert_parallel import expert_act_bytes, experts_trainable
    from estimator.models.arch import spec_arch
    from estimator.models.moe import _EXPERT_COUNT_KEYS, _TOP_K_KEYS, MoeFacts, _first_int
    from estimator.models.moe_ep import ep_layout

    config = spec_arch(spec.model, spec.training.vocab_size).config
    experts, top_k = _first_int(config, _EXPERT_COUNT_KEYS), _first_int(config, _TOP_K_KEYS)
    moe_layers = len({p.layer for p in table if p.layer is not None and is_routed_expert(p.name)})
    facts = MoeFacts(experts=experts, top_k=top_k, shared="", moe_layers=moe_layers, num_layers=0,
                     expert_params=0, total_params=0)
    layout = ep_layout(config, facts, spec.parallel.world_size, spec.parallel.ep, spec.parallel.moe_imbalance,
                       experts_trainable(table))
    return ep_bytes(layout, b * s, expert_act_bytes(spec.training))


def ep_method_step(spec, events: dict, expansion: Expansion, table: list[ParamInfo], num_layers: int,
                   base_size_index: int, b: int, s: int) -> tuple[Expansion, list[int]]:
    """``rank._method_step`` for an EP rank (memoized per shape: the all-to-all path's bytes follow (b, s))."""
    training, parallel = spec.training, spec.parallel
    per_layer = spec_ep_bytes(spec, table, b, s)
    key = (id(expansion), id(table), parallel.world_size, parallel.ep, training.precision, training.optimizer,
           base_size_index, per_layer)
    hit = _STEPS.get(key)
    if hit is None or hit[0] is not expansion or hit[1] is not table:
        if len(_STEPS) > 256:
            _STEPS.clear()
        try:
            built = ep_step(expansion, table, parallel.world_size, parallel.ep, training.precision,
                            training.optimizer, base_size_index, num_layers, events["polys"], per_layer)
            hit = (expansion, table, (built.expansion, built.sizes))
        except ExpansionError as err:
            hit = (expansion, table, err)
        _STEPS[key] = hit
    if isinstance(hit[2], ExpansionError):
        raise hit[2]
    return hit[2]
