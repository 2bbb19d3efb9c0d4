"""The order in which a model's modules run, as DeepSpeed ZeRO-3's hooks see it: every module's forward pre-hook
(the parameter coordinator records it and fetches the module's direct parameters), every module's forward hook
(its post-forward release, and the pre-backward hook it puts on each output tensor), and how many of a module's
output tensors need a gradient (each such tensor's backward runs the module's pre-backward fetch:
``parameter_offload.PreBackwardFunctionForModule``). Recorded from one training step of the profiled (shrunken)
model on fake tensors, and stored in the profile's parameter table (``params["module_trace"]``); the ZeRO-3 replay
expands it to full depth (``estimator.models.modules.module_trace_at_depth``) instead of a per-architecture table
(``estimator.reserved.zero3_gathers.modules_of``). Profiles traced before it: ``estimator.profiler.add_module_trace``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class _Mark(torch.autograd.Function):
    """DeepSpeed's ``PreBackwardFunctionForModule``: an identity over each output tensor (``outputs.detach()``)
    whose backward runs the module's pre-backward fetch; here it records the module."""

    @staticmethod
    def forward(tensor, _entry, _record):
        return tensor.detach()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.entry, ctx.record = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, grad):
        ctx.record.append(ctx.entry)
        return grad, None, None


def _needing_grad(value) -> int:
    """Tensors in ``value`` (tuples, lists, dicts) that need a gradient."""
    if isinstance(value, torch.Tensor):
        return int(value.requires_grad)
    if isinstance(value, (tuple, list)):
        return sum(_needing_grad(v) for v in value)
    if isinstance(value, dict):
        return sum(_needing_grad(v) for v in value.values())
    return 0


def _marked(value, entry: list, record: list):
    """``apply_to_tensors_only``: every tensor in tuples, lists and dicts (in place) through ``_Mark``."""
    if isinstance(value, torch.Tensor):
        return _Mark.apply(value, entry, record)
    if isinstance(value, (tuple, list)):
        items = [_marked(v, entry, record) for v in value]
        return value.__class__(*items) if hasattr(value, "_fields") else value.__class__(items)
    if isinstance(value, dict):
        for key in list(value.keys()):
            value[key] = _marked(value[key], entry, record)
    return value


def record_module_trace(top: torch.nn.Module, table_model: torch.nn.Module, layers: torch.nn.ModuleList,
                        step: Callable[[], None]) -> dict:
    """``{"forward": [[layer, name, [parameter names], grad inputs], ...], "backward": [[layer, name], ...]}``
    over one ``step()``: each module of ``top`` in pre-forward order with its direct parameters (``_parameters``:
    what the coordinator fetches for it) and how many of its positional inputs need a gradient (DeepSpeed's
    post-backward release hangs on those: ``PostBackwardFunctionModule``; with none, as an embedding's, the
    module is not released in backward), then each pre-backward hook as backward runs it (every output tensor of every
    module marked as DeepSpeed marks it, ``_Mark``; one entry per marked tensor backward reaches). ``layer``: the
    traced decoder layer a module sits in (its name and its parameters' relative to the layer; the layer itself
    ``""``), None for the others (named as in ``table_model``, the model the parameter table names; modules above
    it, such as peft's wrappers, ``"<outer>k"``)."""
    prefix = next(name for name, mod in table_model.named_modules() if mod is layers)
    module_names = {id(m): n for n, m in table_model.named_modules(remove_duplicate=False)}
    outer = [m for m in top.modules() if id(m) not in module_names]
    module_names.update({id(m): f"<outer>{k}" for k, m in enumerate(outer)})
    param_names: dict[int, str] = {}
    for name, param in table_model.named_parameters():
        param_names.setdefault(id(param), name)

    def place(name: str) -> tuple[int | None, str]:
        if name == prefix or not name.startswith(f"{prefix}."):
            return None, name
        index, _, rest = name[len(prefix) + 1:].partition(".")
        return int(index), rest

    forward: list[list] = []
    backward: list[list] = []
    recording = [True]

    def pre_hook(module, inputs):
        if recording[0] and not backward:  # a checkpointed layer's recomputation: not the recorded forward
            layer, name = place(module_names[id(module)])
            params = [param_names[id(p)] for p in module._parameters.values() if p is not None]
            forward.append([layer, name, [place(n)[1] if layer is not None else n for n in params],
                            _needing_grad(inputs)])

    def post_hook(module, _inputs, output):
        if recording[0] and not backward:
            return _marked(output, list(place(module_names[id(module)])), backward)
        return None

    handles = [h for m in top.modules()
               for h in (m.register_forward_pre_hook(pre_hook), m.register_forward_hook(post_hook))]
    try:
        step()
    finally:
        recording[0] = False
        for handle in handles:
            handle.remove()
    return {"forward": forward, "backward": backward}
