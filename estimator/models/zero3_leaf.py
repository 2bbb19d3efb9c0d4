"""Which modules DeepSpeed ZeRO-3 treats as leaf modules (``zero_optimization.leaf_module``, DeepSpeed 0.19.8:
``deepspeed/utils/z3_leaf_module.py``, ``apply_zero_leaf_module_config``), found in a parameter table's names.

A leaf module gets no hooks inside (``parameter_offload._register_deepspeed_module`` stops there): entering it
gathers every parameter under it at once, and the gradients of those parameters are not reduced as each is made but
all together in the module's full backward hook (``stage3.py``, ``reduce_leaf_module_grads``), once its input
gradients are done. DeepSpeed matches ``classes`` by the module's class name or its qualified name, ``names``
against ``model.named_modules()`` and ``name_suffixes`` by ``str.endswith``. The table names parameters, not
classes: a class is known here for the mixture-of-experts families whose modules the estimator lays out (the MoE
block, its routed experts, the decoder layer); a class of another family matches nothing in this model, as in
DeepSpeed. DeepSpeed only warns about names that match nothing; here they are a one-line error, as a spelling
mistake would leave the run unlike the estimate. Pure standard library.
"""

from __future__ import annotations

from collections.abc import Iterable

from estimator.models.expert_names import is_routed_expert

# model_type -> (MoE block class, routed experts class, decoder layer class), transformers 5.24's names
# (``models/<family>/modeling_<family>.py``)
_FAMILY_CLASSES = {
    "mixtral": ("MixtralSparseMoeBlock", "MixtralExperts", "MixtralDecoderLayer"),
    "qwen2_moe": ("Qwen2MoeSparseMoeBlock", "Qwen2MoeExperts", "Qwen2MoeDecoderLayer"),
    "qwen3_moe": ("Qwen3MoeSparseMoeBlock", "Qwen3MoeExperts", "Qwen3MoeDecoderLayer"),
    "deepseek_v2": ("DeepseekV2Moe", "DeepseekV2Experts", "DeepseekV2DecoderLayer"),
}
_KINDS = ("block", "experts", "layer")


def _class_kind(cls: str) -> tuple[str, str] | None:
    """(model_type, kind) of a class DeepSpeed may be given, by its name or transformers' qualified name."""
    for family, names in _FAMILY_CLASSES.items():
        for kind, name in zip(_KINDS, names):
            if cls in (name, f"transformers.models.{family}.modeling_{family}.{name}"):
                return family, kind
    return None


def module_names(param_names: Iterable[str]) -> list[str]:
    """Every module holding a parameter somewhere under it (``named_modules``' names less the root's), in the
    order their first parameter comes."""
    out: dict[str, None] = {}
    for name in param_names:
        parts = name.split(".")[:-1]
        for k in range(1, len(parts) + 1):
            out.setdefault(".".join(parts[:k]), None)
    return list(out)


def _modules_of_kind(modules: list[str], param_names: list[str], kind: str) -> list[str]:
    experts = sorted({n.split(".experts.")[0] for n in param_names if is_routed_expert(n) and ".experts." in n})
    if kind == "block":
        return experts
    if kind == "experts":
        return [f"{m}.experts" for m in experts]
    return [m for m in modules if m.rsplit(".", 1)[-1].isdigit() and m.rsplit(".", 2)[-2] == "layers"]


def leaf_modules(zero, param_names: Iterable[str], model_type: str) -> tuple[str, ...]:
    """The outermost leaf modules a ZeRO-3 run of this model has (a leaf inside a leaf changes nothing: no hooks
    reach it), in parameter order. ``zero``: the spec's ``ZeroSpec``. A ``names`` or ``name_suffixes`` entry that
    matches no module holding parameters, or a class not known here (see the module's doc), is a ValueError."""
    params = list(param_names)
    modules = module_names(params)
    chosen: set[str] = set()
    for cls in zero.leaf_classes:
        kind = _class_kind(cls)
        if kind is None:
            known = ", ".join(n for names in _FAMILY_CLASSES.values() for n in names)
            raise ValueError(f"zero.leaf_classes: {cls!r} is not a class the estimator can find in a parameter "
                             f"table (known: {known}); name its modules with leaf_names or leaf_name_suffixes")
        if kind[0] == model_type:
            chosen.update(_modules_of_kind(modules, params, kind[1]))
    known_modules = set(modules)
    for name in zero.leaf_names:
        if name not in known_modules:
            raise ValueError(f"zero.leaf_names: {name!r} names no module of {model_type or 'the model'} that holds "
                             f"parameters (e.g. {modules[len(modules) // 2]!r})")
        chosen.add(name)
    for suffix in zero.leaf_name_suffixes:
        matched = [m for m in modules if m.endswith(suffix)]
        if not matched:
            raise ValueError(f"zero.leaf_name_suffixes: {suffix!r} ends no module name of "
                             f"{model_type or 'the model'} that holds parameters")
        chosen.update(matched)
    outermost = [m for m in modules if m in chosen and not any(m.startswith(f"{o}.") for o in chosen)]
    return tuple(outermost)


def table_leaves(zero, table: list) -> tuple[str, ...]:
    """``leaf_modules`` of a parameter table (``ParamTable.model_type``: the profile's model type)."""
    return leaf_modules(zero, (p.name for p in table), getattr(table, "model_type", ""))


def leaf_of(param_name: str, leaves: Iterable[str]) -> str | None:
    """The leaf module a parameter sits under (None: none)."""
    return next((leaf for leaf in leaves if param_name.startswith(f"{leaf}.")), None)


def experts_in_leaf_by_class(zero, model_type: str) -> bool:
    """Whether the routed experts of a ``model_type`` model sit inside a leaf module by ``leaf_classes`` alone
    (read before a trace, from the config; names and suffixes need the parameter table: ``leaf_modules``)."""
    return any(_class_kind(cls) in ((model_type, "block"), (model_type, "experts"), (model_type, "layer"))
               for cls in zero.leaf_classes)


def leaf_holds_adapted_experts(zero, model_type: str, layer_prefix: str, layer_names: Iterable[str]) -> bool:
    """Whether a leaf module holds LoRA adapters on the routed experts (``layer_names``: the adapters' names inside
    a decoder layer, ``mlp.experts.lora_A.default.weight``; ``layer_prefix``: the decoder layers' module, as the
    profile names them), by class, by a layer's module name (any layer index) or by suffix."""
    if experts_in_leaf_by_class(zero, model_type):
        return True
    inside = [n.rsplit(".", 1)[0] for n in layer_names]
    ancestors = {".".join(m.split(".")[:k]) for m in inside for k in range(1, m.count(".") + 2)}
    for name in zero.leaf_names:
        index, _, rest = name.removeprefix(f"{layer_prefix}.").partition(".")
        if name.startswith(f"{layer_prefix}.") and index.isdigit() and (not rest or rest in ancestors):
            return True
        if name in (layer_prefix, layer_prefix.rsplit(".", 1)[0]) or layer_prefix.startswith(f"{name}."):
            return True
    modules = [f"{layer_prefix}.0.{m}" for m in ancestors] + [f"{layer_prefix}.0", layer_prefix]
    modules += [".".join(layer_prefix.split(".")[:k]) for k in range(1, layer_prefix.count(".") + 1)]
    return any(m.endswith(suffix) for suffix in zero.leaf_name_suffixes for m in modules)
