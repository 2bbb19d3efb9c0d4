"""Apply the tensor-parallel plans of ``estimator.models.tp_plans`` to a built Hugging Face causal LM.

``apply_tp(model, mesh, arch_config)`` works the same on a fake process group under FakeTensorMode (the
estimator's TP profiles, ``estimator.profiler.profile``, and the CPU oracle, ``harness.fake``) and on real gloo /
NCCL process groups (the harness worker; ``harness.tp`` re-exports this module). Call it after
``estimator.profiler.build.build_model`` (LoRA already applied, gradient checkpointing already enabled) and
before building the optimizer; every rank must hold the same full weights before the call (same seed), since
``distribute_tensor`` scatters from TP rank 0.

What it does, per decoder layer (the ModuleList named by ``tp_layers_path``):

1. family-specific weight permutation (CodeGen, see ``estimator.models.tp_plans``), on the full weights;
2. ``parallelize_module(layer, tp_mesh, {name: ColwiseParallel() | RowwiseParallel()})`` with
   ``use_local_output=True``: colwise outputs are the rank's local ``(b, s, out/tp)`` tensors, rowwise outputs
   are all-reduced full ``(b, s, hidden)`` tensors; parameters become DTensors (colwise ``Shard(0)``, rowwise
   weight ``Shard(1)`` and bias ``Replicate()``); peft LoRA targets are mapped onto their ``base_layer`` /
   ``lora_A`` / ``lora_B`` as the module docstring of ``estimator.models.tp_plans`` says;
3. head-count attributes divided by tp (``tp_attr_patches``) and BLOOM's ALiBi slicing hook.

Embeddings, norms and ``lm_head`` stay plain (replicated) tensors on every rank.

The optimizer of a TP model (``build_tp_optimizer``): torch's foreach AdamW refuses one list that mixes
DTensors (the split layers, and the replicated rowwise biases, which are ``Replicate()`` DTensors) and plain
tensors (embeddings, norms, lm_head): "got mixed torch.Tensor and DTensor". So a TP rank runs one optimizer
per kind, DTensor params first, then plain ones, stepped in that order (``OptimizerChain``): each one's foreach
temporaries and, under ``mixed_*``, its 16-to-fp32 gradient conversion happen while the other's are not live.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from estimator.models import tp_plans


def _get(module: nn.Module, path: str) -> Any:
    obj: Any = module
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _set(module: nn.Module, path: str, value: Any) -> None:
    head, _, attr = path.rpartition(".")
    setattr(_get(module, head) if head else module, attr, value)


def _base(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_layers(model: nn.Module, model_type: str) -> list[nn.Module]:
    """The decoder layers of a (possibly peft-wrapped) causal LM, in order. For a family without a TP plan:
    the ModuleList holding the most parameters."""
    base = _base(model)
    if model_type in tp_plans.supported_model_types():
        return list(_get(base, tp_plans.tp_layers_path(model_type)))
    lists = [m for m in base.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"model: cannot find the decoder layers of {model_type!r} (no ModuleList)")
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def _model_type(arch_config: Any) -> str:
    if isinstance(arch_config, dict):
        return arch_config["model_type"]
    return arch_config.model_type


def _layer_plan(layer: nn.Module, model_type: str) -> dict[str, Any]:
    """Plan for one layer in ParallelStyle objects, with peft LoRA wrappers mapped onto their parts."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for name, style in tp_plans.tp_plan(model_type).items():
        module = _get(layer, name)
        make = ColwiseParallel if style == tp_plans.COLWISE else RowwiseParallel
        if isinstance(module, nn.Linear):
            plan[name] = make(use_local_output=True)
            continue
        base = getattr(module, "base_layer", None)
        if not isinstance(base, nn.Linear):
            raise ValueError(f"tp: {model_type} layer module {name!r} is {type(module).__name__}, "
                             f"not a Linear; cannot split it")
        plan[f"{name}.base_layer"] = make(use_local_output=True)
        lora_side = "lora_B" if style == tp_plans.COLWISE else "lora_A"
        for adapter in getattr(module, lora_side, {}):
            plan[f"{name}.{lora_side}.{adapter}"] = make(use_local_output=True)
    return plan


def _linear_parts(module: nn.Module) -> tuple[nn.Linear, list[nn.Linear], list[nn.Linear]]:
    """(base linear, lora_A linears, lora_B linears) of a Linear or a peft LoRA Linear."""
    if isinstance(module, nn.Linear):
        return module, [], []
    lora_a = list(getattr(module, "lora_A", {}).values())
    lora_b = list(getattr(module, "lora_B", {}).values())
    return module.base_layer, lora_a, lora_b


@torch.no_grad()
def _permute_param(linear: nn.Linear, name: str, index: torch.Tensor, dim: int) -> None:
    param = getattr(linear, name)
    if param is None:
        return
    new = torch.index_select(param.detach(), dim, index.to(param.device))
    linear.register_parameter(name, nn.Parameter(new, requires_grad=param.requires_grad))


def codegen_permutation(num_heads: int, head_dim: int, tp: int) -> tuple[list[int], list[int]]:
    """Row order of CodeGen's ``qkv_proj`` and column order of ``out_proj`` for a ``tp``-way colwise split.

    Original ``qkv_proj`` rows: ``mp_num`` (=4) blocks ``m``, each ``[q | v | k]`` over heads
    ``m*H/4 .. (m+1)*H/4``. New rows: ``tp`` contiguous rank chunks, each again four ``[q | v | k]`` blocks
    ``j`` holding, of original block ``j``, the heads ``r*H/(4tp) .. (r+1)*H/(4tp)``. ``out_proj`` columns follow
    the local merge order (block-major) of the same heads.
    """
    mp = tp_plans.CODEGEN_MP_NUM
    per_block = num_heads // mp          # heads in one original block
    per_sub = per_block // tp            # heads of one rank in one block
    embed = num_heads * head_dim
    rows: list[int] = []
    cols: list[int] = []
    for rank in range(tp):
        for block in range(mp):
            heads = [block * per_block + rank * per_sub + h for h in range(per_sub)]
            for part in range(3):  # q, v, k as laid out by CodeGen
                for head in heads:
                    start = block * (3 * embed // mp) + part * (embed // mp) + (head - block * per_block) * head_dim
                    rows.extend(range(start, start + head_dim))
            for head in heads:
                cols.extend(range(head * head_dim, (head + 1) * head_dim))
    return rows, cols


def _codegen_permute(layer: nn.Module, tp: int) -> None:
    attn = layer.attn
    heads = attn.num_attention_heads
    rows, cols = codegen_permutation(heads, attn.head_dim, tp)
    row_index, col_index = torch.tensor(rows), torch.tensor(cols)
    base, _, lora_b = _linear_parts(attn.qkv_proj)
    _permute_param(base, "weight", row_index, 0)
    _permute_param(base, "bias", row_index, 0)
    for lin in lora_b:
        _permute_param(lin, "weight", row_index, 0)
    base, lora_a, _ = _linear_parts(attn.out_proj)
    _permute_param(base, "weight", col_index, 1)
    for lin in lora_a:
        _permute_param(lin, "weight", col_index, 1)


def _bloom_alibi_hook(tp: int, rank: int):
    """Forward pre-hook for BloomAttention: keep this rank's heads of the all-head ALiBi tensor."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        alibi = kwargs.get("alibi")
        hidden = args[0] if args else kwargs["hidden_states"]
        local = module.num_heads
        batch = hidden.shape[0]
        if alibi is not None and alibi.shape[0] == batch * local * tp:
            full = alibi.view(batch, local * tp, *alibi.shape[1:])
            kwargs["alibi"] = full[:, rank * local:(rank + 1) * local].reshape(batch * local, *alibi.shape[1:])
        return args, kwargs

    return hook


def apply_tp(model: nn.Module, mesh, arch_config: Any) -> nn.Module:
    """Split every decoder layer of ``model`` over the 1-D ``mesh`` (the TP mesh or the "tp" sub-mesh).

    ``arch_config``: the HF config dict (``estimator.models.arch.load_config``) or an ``estimator.models.arch.ModelArch``.
    Raises ``ValueError("tp: ...")`` when the architecture cannot be split ``mesh.size()`` ways.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    tp = mesh.size()
    tp_plans.check_tp(arch_config, tp)
    model_type = _model_type(arch_config)
    if tp == 1:
        return model
    rank = mesh.get_local_rank()
    specials = tp_plans.tp_specials(model_type)
    for layer in decoder_layers(model, model_type):
        if "codegen_mp4" in specials:
            _codegen_permute(layer, tp)
        parallelize_module(layer, mesh, _layer_plan(layer, model_type))
        for attr in tp_plans.tp_attr_patches(model_type):
            value = _get(layer, attr)
            _set(layer, attr, value // tp)
        if "bloom_alibi" in specials:
            layer.self_attention.register_forward_pre_hook(_bloom_alibi_hook(tp, rank), with_kwargs=True)
    return model


class OptimizerChain:
    """Several optimizers stepped in order, as one (what a multi-group optimizer does group by group)."""

    def __init__(self, optimizers: list) -> None:
        self.optimizers = list(optimizers)

    def step(self, closure=None) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    @property
    def masters(self) -> list:
        return [m for opt in self.optimizers for m in getattr(opt, "masters", [])]


def split_params(params) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(DTensor params, plain params) of the trainable ``params``, each in the given order."""
    from torch.distributed.tensor import DTensor

    trainable = [p for p in params if p.requires_grad]
    return ([p for p in trainable if isinstance(p, DTensor)], [p for p in trainable if not isinstance(p, DTensor)])


def build_tp_optimizer(params, training, lr: float = 1e-5):
    """``build.build_optimizer`` for a TP model: one optimizer per kind (DTensor first, then plain) when both
    kinds are trainable, chained; a single optimizer otherwise (e.g. FSDP over TP, where every param is a
    DTensor)."""
    from estimator.profiler.build import build_optimizer

    split, plain = split_params(params)
    if split and plain:
        return OptimizerChain([build_optimizer(split, training, lr), build_optimizer(plain, training, lr)])
    return build_optimizer(split or plain, training, lr)
