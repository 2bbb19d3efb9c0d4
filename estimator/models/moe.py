"""Mixture-of-experts facts for an estimate: how many routed experts each MoE layer has, how many a token visits,
and the experts' share of the parameters (read from the profile's parameter table, so every family's naming of
its expert tensors counts the same way). Pure standard library.

Routing and memory: transformers runs the routed experts dropless (``integrations/moe.py``: grouped_mm over the
tokens x top-k rows sorted by expert; the eager path loops over the experts hit, whose rows also sum to tokens x
top-k). What the step saves for backward therefore has static shapes, whatever the router picks: on one device a
skewed routing changes the per-expert split of those rows, not their bytes. Under expert parallelism a rank's rows
follow the load of the experts it owns: ``estimator.models.moe_ep``.
"""

from __future__ import annotations

from dataclasses import dataclass

from estimator.models.expert_names import is_routed_expert
from estimator.models.params import layer_rows

_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_top_k")
_SHARED_COUNT_KEYS = ("n_shared_experts", "num_shared_experts")


@dataclass(frozen=True)
class MoeFacts:
    experts: int            # routed experts per MoE layer
    top_k: int | None       # experts each token is routed to
    shared: str             # what is always active besides them ("" when nothing)
    moe_layers: int
    num_layers: int
    expert_params: int      # the routed experts' parameters, every layer
    total_params: int

    @property
    def active_params(self) -> int | None:
        """Parameters a token passes through: everything but the experts it is not routed to."""
        if not self.top_k:
            return None
        return self.total_params - self.expert_params + self.expert_params * self.top_k // self.experts


def _first_int(config: dict, keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def routed_experts(config: dict) -> int | None:
    """Routed experts per MoE layer named by the config (None for a dense one)."""
    experts = _first_int(config, _EXPERT_COUNT_KEYS)
    return experts if experts and experts >= 2 else None


# Marks the profiler leaves at the routed experts module's forward (checkpoint recomputation included): its entry,
# labelled with the routing weights' element size (``experts_entry_mark``), and its exit. Read by
# ``estimator.methods.expert_parallel.recompute_levels``.
EXPERTS_MARK = "moe_experts"
EXPERTS_DONE_MARK = "moe_experts_done"


def experts_entry_mark(weights_bytes: int) -> str:
    return f"{EXPERTS_MARK}:w{weights_bytes}"


def is_experts_mark(label: str) -> bool:
    return label == EXPERTS_DONE_MARK or label.startswith(f"{EXPERTS_MARK}:w")


def experts_entry(marks: dict) -> tuple[int, object] | None:
    """(routing weights' element size, the mark's state) of the experts' entry among a segment's marks."""
    for label, state in marks.items():
        if label.startswith(f"{EXPERTS_MARK}:w"):
            return int(label.removeprefix(f"{EXPERTS_MARK}:w")), state
    return None


def _shared(config: dict) -> str:
    count = _first_int(config, _SHARED_COUNT_KEYS)
    if count:
        return f"{count} shared expert{'s' if count > 1 else ''}"
    if config.get("shared_expert_intermediate_size"):
        return "a shared expert"
    return ""


def moe_facts(config: dict, params: dict, num_layers: int, total_params: int) -> MoeFacts | None:
    """None for a dense model (no routed experts in the config or the parameter table)."""
    experts = _first_int(config, _EXPERT_COUNT_KEYS)
    if not experts or experts < 2:
        return None
    rows = layer_rows(params, num_layers)
    per_layer = [sum(r["numel"] for r in layer if is_routed_expert(r["name"])) for layer in rows]
    if not any(per_layer):
        return None
    return MoeFacts(experts=experts, top_k=_first_int(config, _TOP_K_KEYS), shared=_shared(config),
                    moe_layers=sum(1 for n in per_layer if n), num_layers=num_layers,
                    expert_params=sum(per_layer), total_params=total_params)


def moe_notes(facts: MoeFacts | None) -> list[str]:
    if facts is None:
        return []
    visits = f", {facts.top_k} per token" if facts.top_k else ""
    shared = f", plus {facts.shared}" if facts.shared else ""
    active = (f"; a token passes through {facts.active_params / 1e9:.2f} B"
              if facts.active_params is not None else "")
    return [f"moe: {facts.experts} routed experts in {facts.moe_layers} of {facts.num_layers} layers{visits}{shared}; "
            f"they hold {facts.expert_params / 1e9:.2f} B of the {facts.total_params / 1e9:.2f} B parameters "
            f"({100 * facts.expert_params / facts.total_params:.1f} %, stored, gradients and optimizer states alike "
            f"for full fine-tuning){active}",
            "moe routing: dropless, as transformers runs the experts (every token's top-k rows, sorted by expert): "
            "what backward keeps has the same bytes however balanced the router is, so this estimate holds for "
            "balanced and skewed routing on one device; under expert parallelism (--ep) a rank's rows follow the "
            "load of the experts it owns (--moe-imbalance)"]


def qlora_experts_note(table: list) -> list[str]:
    """What QLoRA does to fused routed experts (``ParamInfo`` rows of a QLoRA profile's table): transformers holds
    them as 3-D parameters, bitsandbytes swaps only ``nn.Linear`` modules for 4-bit ones, and peft's
    ``prepare_model_for_kbit_training`` casts every other 16-bit parameter to fp32 (``peft/utils/other.py``), so
    the experts, most of an MoE's weights, stay unquantized at 4 bytes a parameter."""
    fp32 = sum(p.numel * p.elem_bytes for p in table if is_routed_expert(p.name) and p.elem_bytes == 4)
    if not fp32:
        return []
    return [f"qlora on moe: the routed experts ({fp32 / 1024**3:.2f} GiB) stay unquantized, in fp32: transformers "
            "holds them as fused 3-D parameters, which bitsandbytes does not quantize (it swaps nn.Linear modules "
            "only), and peft's prepare_model_for_kbit_training casts every other 16-bit parameter to fp32"]


def experts_breakdown(table: list, breakdown: dict[str, int]) -> dict[str, int]:
    """The routed experts' part of a rank's weights, gradients and optimizer states (``ParamInfo`` rows of the
    profile's table; ``breakdown``: the rank's at its peak), in proportion to their bytes: what every rank holds of
    the experts and of the rest shrinks by the same factor under FSDP2, FSDP1 and ZeRO-3 (1 / world) and under
    expert parallelism (each rank E / ep experts, FSDP-sharded over world / ep: again 1 / world); ZeRO-1/2's flat
    partitions hold that share only on average over the ranks. Empty for a dense model. Gradients and optimizer
    states follow the trainable parameters (LoRA: the experts' adapters, if any)."""
    def stored(rows) -> float:
        return sum(p.numel * (p.stored_bytes_per_elem or p.elem_bytes) for p in rows)

    experts = [p for p in table if is_routed_expert(p.name)]
    if not experts or not stored(table):
        return {}
    out = {"weights": breakdown.get("weights", 0) * stored(experts) / stored(table)}
    trainable = stored(p for p in table if p.trainable)
    if trainable:
        share = stored(p for p in experts if p.trainable) / trainable
        out.update((k, breakdown.get(k, 0) * share) for k in ("gradients", "optimizer_states"))
    return {k: int(round(v)) for k, v in out.items() if v >= 0.5}


# The methods whose replays split the decoder layers at forward-only first ones (``frozen_layers``), each checked
# against the CPU oracle on Qwen3-MoE and DeepSeek-V2 (docs/error_matrix/moe_methods.csv, ``METHOD+lora-experts``).
FORWARD_ONLY_METHODS = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp")
# Families whose routed experts peft (>= 0.18, transformers 5) targets by the per-expert projection names: it
# turns those names into ``target_parameters`` on the fused experts and drops them from ``target_modules``, so a
# dense layer's MLP of the same names gets no adapter (``peft.utils.transformers_weight_conversion``).
_EXPERT_NAME_FAMILIES = ("deepseek_v2", "deepseek_v3", "qwen2_moe", "qwen3_moe", "glm4_moe")
_EXPERT_PROJECTIONS = {"gate_proj", "up_proj", "down_proj", "gate"}


def dense_leading_layers(config: dict) -> int | None:
    """Decoder layers before the first mixture-of-experts layer, as the config states them (transformers picks a
    layer's kind from its index): DeepSeek's ``first_k_dense_replace`` and ``moe_layer_freq``, Qwen2/3-MoE's
    ``mlp_only_layers`` and ``decoder_sparse_step``. None where the config names neither (or no experts)."""
    if routed_experts(config) is None:
        return None
    layers = config.get("num_hidden_layers", 0)
    if isinstance(config.get("first_k_dense_replace"), int):
        first, every = config["first_k_dense_replace"], config.get("moe_layer_freq") or 1
        is_moe = lambda i: i >= first and i % every == 0  # noqa: E731
    elif "mlp_only_layers" in config or "decoder_sparse_step" in config:
        dense, step = set(config.get("mlp_only_layers") or ()), config.get("decoder_sparse_step") or 1
        is_moe = lambda i: i not in dense and (i + 1) % step == 0  # noqa: E731
    else:
        return None
    return next((i for i in range(layers) if is_moe(i)), layers)


def predicted_forward_only_layers(training, config: dict) -> int:
    """Forward-only first layers (``frozen_layers``) read off the config, before any trace: LoRA whose targets
    are the experts' projection names only, on a family peft turns them into the fused experts'
    ``target_parameters`` for, past dense first layers the config states. 0 where it cannot say (the trace then
    finds them: ``estimator.profiler.profile.frozen_leading_layers``)."""
    if not training.lora or config.get("model_type") not in _EXPERT_NAME_FAMILIES:
        return 0
    targets = {t.strip() for t in training.lora_targets.split(",") if t.strip()}
    if not targets or not targets <= _EXPERT_PROJECTIONS:
        return 0
    return dense_leading_layers(config) or 0


def forward_only_refusal(spec, frozen: int) -> str | None:
    """Why forward-only first layers are not modelled under this spec's parallelism (None: they are)."""
    parallel = spec.parallel
    if not frozen:
        return None
    if parallel.method in FORWARD_ONLY_METHODS and parallel.pp == 1 and parallel.ep == 1 and parallel.cp == 1 \
            and parallel.tp == 1:
        return None
    return (f"lora_targets: backward never reaches the first {frozen} decoder layer(s) (no adapter there: dense "
            f"layers before the experts); modelled for methods {', '.join(FORWARD_ONLY_METHODS)} without tp, pp, "
            "cp or ep, add a target those layers have (e.g. attention) for other layouts")


# The per-expert projection names peft (>= 0.18, transformers 5) turns into ``target_parameters`` on each family's
# fused routed experts (``peft.utils.transformers_weight_conversion``; Qwen2-MoE's names also match its shared
# expert's Linear modules, so the trace decides there). Read before a trace; after one, the parameter table says.
_FUSED_EXPERT_NAMES = {"mixtral": {"w1", "w2", "w3"},
                       **{family: {"gate_proj", "up_proj", "down_proj"}
                          for family in ("deepseek_v2", "deepseek_v3", "qwen3_moe", "glm4_moe")}}


# DeepSpeed (0.19) makes Mixtral's, Qwen2-MoE's and Qwen3-MoE's MoE blocks ZeRO-3 leaf modules by default
# (``zero_optimization.leaf_module``, ``estimator.spec.DEFAULT_LEAF_MODULE_CLASSES``): no hooks inside, every
# parameter under the block gathered at its pre-forward and released once its input gradients are done. DeepSeek's
# block is not one. A run's own leaf modules (``ZeroSpec.leaf_*``) are found by ``estimator.models.zero3_leaf``.


def fused_expert_adapters_refusal(spec, adapted: bool, family: str = "", in_leaf: bool | None = None) -> str | None:
    """Why LoRA on the fused routed experts (peft's ``ParamWrapper``: it reads its ``lora_A`` / ``lora_B`` weights
    directly and adds their product, one delta per expert of the whole layer, to the experts' 3-D tensor while
    they run) cannot run under this spec's parallelism, found by running it (docs/error_matrix/README.md, helper
    moe28); None where it runs or ``adapted`` is false. ``in_leaf``: whether a ZeRO-3 leaf module holds the
    adapted experts (None: by the spec's leaf classes alone, ``zero3_leaf.experts_in_leaf_by_class``)."""
    if not adapted:
        return None
    what = "lora_targets: LoRA on the fused routed experts (peft's target_parameters) "
    if spec.parallel.ep > 1:
        return (what + "cannot run under expert parallelism with transformers 5.24 and peft 0.18: peft adds one delta "
                "for all of a layer's experts to a rank's share of them, a DTensor (baddbmm: mixed Tensor and "
                "DTensor), and applied before the sharding its renamed experts match no ep_plan rule (nothing is "
                "split); use ep 1, or adapters on attention only")
    if in_leaf is None:
        from estimator.models.zero3_leaf import experts_in_leaf_by_class

        in_leaf = experts_in_leaf_by_class(spec.parallel.zero, family)
    if spec.parallel.method == "zero3" and in_leaf:
        return (what + f"cannot run under zero3 on {family or 'this model'}: the experts sit in a ZeRO-3 leaf "
                "module (DeepSpeed's default for this family's MoE block, or zero.leaf_*), released once its input "
                "gradients are done, and the adapters' gradients, which come through peft's parametrized expert "
                "weights, arrive after that (AccumulateGrad meets an empty partition); use zero2 or fsdp, "
                "adapters on attention only, or zero.leaf_classes without the block (DeepSpeed's "
                "zero_optimization.leaf_module.classes: [])")
    if spec.parallel.method == "fsdp1":
        return (what + "cannot run under fsdp1: peft's fsdp_auto_wrap_policy makes each adapter Linear an FSDP1 "
                "unit, gathered only when it is called, and the experts' wrapper reads those weights without "
                "calling them (it gets the flat shard: shape '[E, -1, N]' is invalid); use fsdp (FSDP2)")
    return None


def predicted_fused_expert_adapters(training, config: dict) -> bool:
    """Whether LoRA's targets name the routed experts' projections of a family peft fuses them for (before a
    trace; False where it cannot say)."""
    names = _FUSED_EXPERT_NAMES.get(config.get("model_type"), set())
    targets = {t.strip() for t in training.lora_targets.split(",")}
    return bool(training.lora and names & targets)


def adapts_fused_experts(profile: dict) -> bool:
    """Whether the traced parameter table has trainable routed-expert tensors in a LoRA profile (peft's adapters
    on the fused experts: ``mlp.experts.lora_A.default.weight``)."""
    params = profile["params"]
    kinds = params.get("layer_kinds", {}).get("rows", [])  # each kind of layer's rows (a dense first one)
    rows = [*params.get("per_layer", ()), *(r for kind in kinds for r in kind)]
    return any(r.get("trainable") and "lora_" in r["name"] and is_routed_expert(r["name"]) for r in rows)


def check_forward_only_layers(spec, profile: dict, family: str = "") -> None:
    """Forward-only first layers (``frozen_layers``, as the profile traced them) under a layout whose replay does
    not split the layers there, and adapters on the fused experts where they cannot run: refused in one line.
    (every-k over such layers is estimated for method single: docs/error_matrix/moe_methods.csv's
    ``lora-experts-every2`` rows.)"""
    adapted = spec.training.lora and adapts_fused_experts(profile)
    in_leaf = None
    if adapted and spec.parallel.method == "zero3":
        from estimator.models.zero3_leaf import leaf_holds_adapted_experts

        params = profile["params"]
        kinds = params.get("layer_kinds", {}).get("rows", [])
        rows = [*params.get("per_layer", ()), *(r for kind in kinds for r in kind)]
        in_leaf = leaf_holds_adapted_experts(spec.parallel.zero, family, params["layer_prefix"], [
            r["name"] for r in rows if r.get("trainable") and is_routed_expert(r["name"])])
    reason = fused_expert_adapters_refusal(spec, adapted, family, in_leaf) \
        or forward_only_refusal(spec, profile["params"].get("frozen_layers", 0))
    if reason:
        raise ValueError(reason)


def check_forward_only_layers_before_trace(spec, config: dict) -> None:
    """The same refusals where the config and the targets state them, before a profile is loaded or traced."""
    reason = fused_expert_adapters_refusal(spec, predicted_fused_expert_adapters(spec.training, config),
                                           config.get("model_type", "")) \
        or forward_only_refusal(spec, predicted_forward_only_layers(spec.training, config))
    if reason:
        raise ValueError(reason)
