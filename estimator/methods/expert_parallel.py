"""Expert parallelism's terms in the step model: the layout of a spec, what each MoE layer's segments carry under
the all-to-all path (saved rows, backward bumps, the experts' post-backward level) and the busiest rank's forward
peak. The layout's arithmetic is ``estimator.models.moe_ep``; this module places it on the profile's segments."""

from __future__ import annotations

from estimator.methods.fsdp_replay import experts_levels
from estimator.methods.layer_trace import grads_before, traced_layer_of
from estimator.methods.state import StepModel
from estimator.methods.timeline import poly
from estimator.models.arch import ModelArch
from estimator.models.moe import EXPERTS_DONE_MARK, experts_entry, is_routed_expert, moe_facts
from estimator.models.moe_ep import EpLayout, ep_layout
from estimator.models.params import param_counts
from estimator.spec import RunSpec, TrainingSpec


def layout_of(spec: RunSpec, arch: ModelArch, profile: dict, table: list) -> EpLayout | None:
    """The expert-parallel layout of ``spec`` (None without EP); ValueError("ep: ...") for one transformers
    refuses (a dense model, experts that do not split evenly)."""
    if spec.parallel.ep == 1:
        return None
    total, _ = param_counts(profile["params"], arch.num_layers)
    facts = moe_facts(arch.config, profile["params"], arch.num_layers, total)
    return ep_layout(arch.config, facts, spec.parallel.world_size, spec.parallel.ep, spec.parallel.moe_imbalance,
                     experts_trainable(table), block_input_saved(table))


def experts_trainable(table: list) -> bool:
    """Whether any routed expert gets a gradient (not under LoRA on other modules)."""
    return any(p.trainable and is_routed_expert(p.name) for p in table)


def block_input_saved(table: list) -> bool:
    """Whether something in a MoE block besides its routed experts trains (the router, a shared expert or its
    gate, their adapters), and so saves the block's input for its gradient. The block is the routed experts'
    parent module (``model.layers.3.mlp.``)."""
    blocks = {p.name.split(".experts.")[0] + "." for p in table if is_routed_expert(p.name)}
    return any(p.trainable and not is_routed_expert(p.name) and p.name.startswith(tuple(blocks)) for p in table)


def grads_before_experts(params: dict, table: list) -> dict[int, float]:
    """Per traced layer, the gradient bytes its backward makes before the routed experts' (a shared expert or its
    gate that runs after the experts in forward)."""
    return grads_before(params, table, lambda _layer, name: is_routed_expert(name))


def recompute_levels(segments: dict, plain_segments: dict, layout: EpLayout, training: TrainingSpec,
                     num_layers: int, b: int, s: int) -> dict[str, tuple[float, bool]]:
    """Checkpointing: per backward layer segment, (the activation level above its start at the recomputed MoE
    layer's highest moment, whether the previous layer's all-gather comes only after it). Where the profile marked
    the experts' entry in the recomputation (``segments``' marks, ``estimator.models.moe.EXPERTS_MARK``), that
    level plus what the all-to-all path holds from there (``EpLayout.recompute_bytes``). When the layer saves
    something after its experts (the recomputation got past them: ``EXPERTS_DONE_MARK``), backward starts on that
    branch and recomputes before it reaches the experts, whose FSDP2 pre-backward prefetches the previous layer:
    no all-gather is in flight at the recomputation. Profiles traced before the marks: the layer's saved activations
    (its segment in the profile without checkpointing, ``plain_segments``; None: not loaded) plus the forward's
    transient, an approximation that counts the layer's output though it is not made yet."""
    a = expert_act_bytes(training)
    forward_of = {index: name for name, index in traced_layer_of(num_layers).items() if name.startswith("fw")}
    levels = {}
    for name, index in traced_layer_of(num_layers).items():
        if not name.startswith("bw"):
            continue
        entry = experts_entry(segments[name].get("marks", {}))
        if entry is not None:
            weights_bytes, (entry_act, _grad) = entry
            continues = EXPERTS_DONE_MARK in segments[name]["marks"]
            levels[name] = (poly(entry_act, b, s) + layout.recompute_bytes(b * s, a, weights_bytes, continues),
                            continues)
        elif plain_segments is not None:
            transient = layout.forward_transient_bytes(b * s, a) + layout.layer_saved_bytes(b * s, a)
            levels[name] = (poly(plain_segments[forward_of[index]]["net_act"], b, s) + transient, False)
    return levels


def needs_plain_profile(segments: dict, num_layers: int) -> bool:
    """Whether ``recompute_levels`` falls back to the profile without checkpointing (no experts marks)."""
    return any(experts_entry(segments[name].get("marks", {})) is None
               for name in traced_layer_of(num_layers) if name.startswith("bw"))


def ep_segments(segments: dict, regime: dict, table: list, layout: EpLayout, training: TrainingSpec,
                num_layers: int, b: int, s: int, profile_params: dict,
                recompute: dict[str, float] | None = None) -> dict:
    """The profile's layer segments as an EP rank runs them at (b, s): each MoE layer keeps what the all-to-all
    path adds (``EpLayout.layer_saved_bytes``) from its forward to its experts' backward, and each backward MoE
    segment gets, where the profile has an event list (``fsdp_replay.experts_levels``), the activation level at
    which the experts' FSDP2 post-backward runs and the level of the un-permute's backward, just before the
    experts' first gradient (``EpLayout.unpermute_bump``). Frozen experts (LoRA elsewhere: no expert gradient to
    place the stages by) keep their extra until the layer's first gradient, and its backward's highest moment before
    that gradient holds the extra rows' backward (``EpLayout.backward_bumps``); not under checkpointing, where the
    trace's recomputation is kept as it is."""
    traced: dict[int, float] = {}
    for p in table:
        if p.layer is not None and is_routed_expert(p.name):  # frozen experts (LoRA elsewhere): 0 bytes
            traced[p.layer] = traced.get(p.layer, 0.0) + (p.nbytes if p.trainable else 0.0)
    if training.grad_ckpt:  # frozen experts' recomputation in backward: not modelled beyond the trace
        traced = {layer: nbytes for layer, nbytes in traced.items() if nbytes}
    before = grads_before_experts(profile_params, table)
    extra = layout.layer_saved_bytes(b * s, expert_act_bytes(training))
    bumps = layout.backward_bumps(b * s, expert_act_bytes(training))
    layer_of = traced_layer_of(num_layers)
    out = dict(segments)
    for name, index in layer_of.items():
        if index not in traced:
            continue
        seg = dict(segments[name])
        if name.startswith("bw"):
            seg["experts_grad_offset"] = before.get(index, 0.0)
        if training.grad_ckpt:  # nothing saved in forward: the recompute in backward saves it, until the experts'
            if name.startswith("bw"):  # backward is over
                seg["experts_bw_bumps"] = tuple(extra + bump for bump in bumps)
                if recompute is not None and name in recompute:
                    seg["experts_recompute_act"] = recompute[name]
        elif name.startswith("fw"):
            seg["net_act"] = [seg["net_act"][0] + extra, *seg["net_act"][1:]]
        else:
            seg["net_act"] = [seg["net_act"][0] - extra, *seg["net_act"][1:]]
            seg["experts_saved_extra"] = extra
            seg["experts_bw_bumps"] = bumps
        out[name] = seg
    events = regime.get("events")
    if events is not None:
        bw = {n: i for n, i in layer_of.items() if n.startswith("bw")}
        levels = experts_levels(events, {n: traced.get(i, 0.0) for n, i in bw.items()}, b, s,
                                {n: before.get(i, 0.0) for n, i in bw.items()})
        unpermute = layout.unpermute_bump(b * s, expert_act_bytes(training)) + (extra if training.grad_ckpt else 0.0)
        for name, (first_grad_level, done_level) in levels.items():
            out[name] = {**out[name], "experts_done_act": done_level,
                         "experts_unpermute_act": first_grad_level + unpermute}
    return out


def expert_act_bytes(training: TrainingSpec) -> int:
    """The experts' activation dtype: ``grouped_mm`` runs in the weights' dtype (not autocast), so fp32 and amp_*
    weights keep fp32 rows."""
    return 2 if training.precision in ("bf16", "mixed_bf16", "mixed_fp16") else 4


def saved_activation_bytes(spec: RunSpec, layout: EpLayout | None) -> float:
    """What the all-to-all path keeps through backward beyond the one-device experts the profile traced (the sort
    order and sentinel mask; under skewed routing the busiest rank's extra rows), every MoE layer."""
    if layout is None:
        return 0.0
    tokens = spec.training.micro_batch_size * spec.training.seq_len
    return layout.dispatch_bytes(tokens) + layout.skew_bytes(tokens, expert_act_bytes(spec.training))


def forward_peak(spec: RunSpec, arch: ModelArch, table: list, regime: dict, model: StepModel,
                     layout: EpLayout | None, b: int, s: int) -> tuple[float, float] | None:
    """EP: (bytes above the resident states, activations among them) at the busiest rank's last MoE layer's
    experts forward, where its received rows are most (``EpLayout.forward_transient_bytes``): every layer's
    activations (the trace's, plus what the all-to-all path and the extra rows keep), the root and the last layer
    gathered. None without EP, or when the last layer has no experts."""
    if layout is None or not any(p.layer == arch.num_layers - 1 and is_routed_expert(p.name) for p in table):
        return None
    segments = regime["segments"]
    layers = poly(segments["prefix"]["net_act"], b, s)
    for name, reps in (("fw_first", 1), ("fw", max(arch.num_layers - 2, 0)), ("fw_last", 1)):
        layers += reps * poly(segments[name]["net_act"], b, s)
    saved = 0.0 if spec.training.grad_ckpt else saved_activation_bytes(spec, layout)  # checkpointed: none kept
    acts = layers + saved + layout.forward_transient_bytes(b * s, expert_act_bytes(spec.training))
    return acts + model.forward_gathered_bytes, acts
