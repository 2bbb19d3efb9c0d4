"""The full model's parameter tensors, expanded from a profile (non-layer tensors + one generic layer × L)."""

from __future__ import annotations

from dataclasses import dataclass

from estimator.models.arch import ModelArch


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    numel: int
    elem_bytes: int
    trainable: bool
    module_kind: str           # embedding | linear | norm | other
    layer: int | None
    tied_names: tuple[str, ...] = ()
    opt_group: int = 0         # which optimizer steps it, in step order (tp: 0 = DTensor params, 1 = plain ones)
    stored_bytes_per_elem: float | None = None  # quantized storage (QLoRA 4-bit), else elem_bytes
    # Where the tensor sits in ``model.parameters()`` (DeepSpeed's flat order): non-layer tensors registered before
    # the decoder layers (embeddings; OPT's final norm too). None: a profile that does not say.
    before_layers: bool | None = None
    # Position of its gradient hook in backward (0 = first finished); None: frozen, or a profile that does not say.
    backward_index: int | None = None

    @property
    def is_bias(self) -> bool:
        return self.name.endswith("bias")

    @property
    def nbytes(self) -> int:
        if self.stored_bytes_per_elem is not None:
            return int(round(self.numel * self.stored_bytes_per_elem))
        return self.numel * self.elem_bytes


def _info(row: dict, name: str, layer: int | None, tp: bool = False, before_layers: bool | None = None,
          backward_index: int | None = None) -> ParamInfo:
    return ParamInfo(name=name, shape=tuple(row["shape"]), numel=row["numel"], elem_bytes=row["elem_bytes"],
                     trainable=row["trainable"], module_kind=row["kind"], layer=layer,
                     tied_names=tuple(row.get("tied", ())), opt_group=1 if tp and not row.get("dtensor") else 0,
                     stored_bytes_per_elem=row["stored_bytes"] / row["numel"] if "stored_bytes" in row else None,
                     before_layers=before_layers, backward_index=backward_index)


def is_tp_table(params: dict) -> bool:
    """A TP profile's table: rows of DTensor params carry their local shard (``dtensor``, ``global_numel``)."""
    return any(row.get("dtensor") for row in params["non_layer"] + params["per_layer"])


class ParamTable(list):
    """The expanded parameter table (a list of ``ParamInfo``) with, where the profile recorded it, the model's
    module trace at full depth (``estimator.models.modules.module_trace_at_depth``: the order DeepSpeed
    ZeRO-3's hooks fetch modules in; None otherwise)."""

    module_trace: tuple | None = None
    model_type: str = ""  # the profile's (which classes DeepSpeed's ZeRO-3 leaf module list matches)


def expand_params(params: dict, num_layers: int) -> list[ParamInfo]:
    """Non-layer tensors in profile order, then every decoder layer's tensors (a TP profile: as one rank holds
    them, local shards, with the DTensor / plain optimizer split in ``opt_group``). Profiles that record them also
    give each tensor its place in ``model.parameters()`` (``before_layers``) and its gradient's place in backward
    (``backward_index``)."""
    prefix = params["layer_prefix"]
    tp = is_tp_table(params)
    layers_at = params.get("layers_at")
    order = backward_order(params, num_layers)
    table = [_info(row, row["name"], None, tp, None if layers_at is None else i < layers_at,
                   order.get((None, row["name"]))) for i, row in enumerate(params["non_layer"])]
    for layer, rows in enumerate(layer_rows(params, num_layers)):
        table.extend(_info(row, f"{prefix}.{layer}.{row['name']}", layer, tp,
                           backward_index=order.get((layer, row["name"]))) for row in rows)
    out = ParamTable(table)
    if "module_trace" in params:
        from estimator.models.modules import module_trace_at_depth

        out.module_trace = module_trace_at_depth(params["module_trace"], prefix, num_layers)
    return out


def layer_rows(params: dict, num_layers: int) -> list[list[dict]]:
    """Each decoder layer's parameter rows: its own kind's where the profile recorded the whole model's kinds
    (layers not all alike, ``layer_kinds``), else the generic layer's for every layer."""
    kinds = params.get("layer_kinds")
    if kinds and len(kinds["of_layer"]) == num_layers:
        return [kinds["rows"][kind] for kind in kinds["of_layer"]]
    return [params["per_layer"]] * num_layers


def largest_layer(table: list[ParamInfo]) -> int | None:
    """The decoder layer holding the most parameter bytes (the first of equals): the unit whose buffers bound
    every layer's when layers are not all alike (e.g. experts after a dense first layer)."""
    sizes: dict[int, int] = {}
    for p in table:
        if p.layer is not None:
            sizes[p.layer] = sizes.get(p.layer, 0) + p.nbytes
    return min(sizes, key=lambda layer: (-sizes[layer], layer)) if sizes else None


def backward_order(params: dict, num_layers: int) -> dict[tuple[int | None, str], int]:
    """(layer or None, name) -> position of the tensor's gradient hook in backward, for the full depth, from the
    profile's ``grad_order`` (recorded on the shrunken model: the non-layer tensors finished before the layers,
    each layer's order from the last layer to the first, then the rest). A layer takes the order of the recorded
    layer with its tensors (the generic layer where it has them: a dense first layer before expert layers has its
    own). Empty when the profile does not record it or a layer's tensors match no recorded layer's."""
    recorded = params.get("grad_order")
    if not recorded:
        return {}
    first = next((i for i, (layer, _) in enumerate(recorded) if layer is not None), len(recorded))
    head = [name for layer, name in recorded[:first] if layer is None]
    tail = [name for layer, name in recorded[first:] if layer is None]
    traced: dict[int, list[str]] = {}
    for layer, name in recorded:
        if layer is not None:
            traced.setdefault(layer, []).append(name)
    candidates = [traced[i] for i in sorted(traced, key=lambda i: (i != 1, i))]  # the generic layer first
    keys = [(None, name) for name in head]
    for layer, rows in reversed(list(enumerate(layer_rows(params, num_layers)))):
        names = sorted(row["name"] for row in rows if row["trainable"])
        if not names:  # a layer backward never reaches (forward-only first layers): no gradient hook
            continue
        order = next((c for c in candidates if sorted(c) == names), None)
        if order is None:
            return {}
        keys.extend((layer, name) for name in order)
    keys.extend((None, name) for name in tail)
    return {key: i for i, key in enumerate(keys)}


def forward_only_layers(table: list[ParamInfo]) -> int:
    """How many first decoder layers backward never reaches: none of their parameters is trainable, nor any
    before them (the embeddings), while a later layer's is (LoRA on the routed experts past dense first layers:
    ``estimator.profiler.profile.frozen_leading_layers``, read here off the parameter table)."""
    if any(p.trainable for p in table if p.layer is None and p.module_kind == "embedding"):
        return 0
    trainable = sorted({p.layer for p in table if p.layer is not None and p.trainable})
    return trainable[0] if trainable else 0


def buffer_bytes(params: dict, num_layers: int) -> int:
    """Module buffers of the full-depth model (0 for profiles recorded before buffers were)."""
    buffers = params.get("buffers") or {}
    return int(buffers.get("non_layer", 0) + num_layers * buffers.get("per_layer", 0))


def layer_param_bytes(params: dict, trainable_only: bool = False) -> int:
    return sum(r["numel"] * r["elem_bytes"] for r in params["per_layer"] if r["trainable"] or not trainable_only)


def param_counts(params: dict, num_layers: int) -> tuple[int, int]:
    """(total, trainable) parameter counts of the full-depth model; tied tensors counted once. A TP profile's
    table counts the whole (global) parameters, not one rank's shards."""
    def numel(row: dict) -> int:
        return row.get("global_numel", row["numel"])

    rows = params["non_layer"] + [row for layer in layer_rows(params, num_layers) for row in layer]
    return sum(numel(r) for r in rows), sum(numel(r) for r in rows if r["trainable"])


def param_table(arch: ModelArch, profile: dict) -> list[ParamInfo]:
    return expand_params(profile["params"], arch.num_layers)
