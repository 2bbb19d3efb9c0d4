"""Record a training step's storage timeline on fake tensors.

A TorchDispatchMode sees every aten op; each new untyped storage is an allocation, its weakref callback a free.
DTensor ops are let through to their local-tensor ops (what a rank allocates); DTensor's global-shape
metadata propagation is not recorded (``paused``, see ``estimator.profiler.fake_pg``).
Decoder-layer boundaries (forward and backward, checkpoint recompute included) come from ModTracker hooks, so a
shrunken copy of a model yields per-layer segments that can be replayed for any depth.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch._guards import active_fake_mode
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from estimator.models.moe import EXPERTS_DONE_MARK, experts_entry_mark


@dataclass
class Timeline:
    """events: ("a", sid, nbytes) | ("f", sid) | ("m", label). sizes: sid -> nbytes."""

    events: list[tuple] = field(default_factory=list)
    sizes: dict[int, int] = field(default_factory=dict)
    grad_names: dict[int, str] = field(default_factory=dict)  # sid -> parameter name, for .grad storages
    # sid -> decoder layer of the parameter a storage belongs to (the parameter, its master copy, its gradient,
    # its optimizer states and the optimizer's per-parameter temporaries): what a deeper model repeats per layer.
    layer_of: dict[int, int] = field(default_factory=dict)
    # sids of 0-dim tensors an optimizer step makes from Python numbers (Adam's ``step`` counters, the scalar it adds
    # to them): host tensors on a GPU unless the optimizer is fused or capturable.
    scalars: set[int] = field(default_factory=set)
    # sids of the first new storage of each cuBLAS op (a matmul's output), in order: a thread's first cuBLAS call
    # allocates that thread's workspace right after its output (``estimator.profiler.expand``, ``blas_first``)
    blas_outputs: list[int] = field(default_factory=list)


# aten ops that call cuBLAS on CUDA tensors (a handle and its workspace are made at a thread's first call)
BLAS_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "_addmm_activation",
                      "_scaled_mm"})


class StorageRecorder(TorchDispatchMode):
    # on: autograd's gradient sums in place where torch's rule makes them so (``_engine_sum_candidate``: not into an
    # autograd view); off (the default): every sum out of place, as fake tensors make them. The shipped profiles are
    # traced with it off (docs/allocator.md, helper sums: switching it on means re-tracing them all)
    fold_engine_sums_default = False
    def __init__(self) -> None:
        super().__init__()
        self.timeline = Timeline()
        self._sid_of: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: dict[int, weakref.ref] = {}
        self._next_sid = 0
        self._paused = 0
        self.inherit_layers = False  # while on: a new storage takes the layer of the input it is computed from
        self.fold_engine_sums = self.fold_engine_sums_default
        self._pending_sums: list[tuple[int, int, int, int]] = []  # (sum's sid, its inputs' sids, its "a" index)
        self._alias: dict[int, int] = {}  # a folded sum's sid -> the input storage it stands for

    def mark(self, label: str) -> None:
        self._settle_sums()
        self.timeline.events.append(("m", label))

    def sid(self, storage: torch.UntypedStorage) -> int | None:
        if self._pending_sums:  # a folded sum's storage answers with the input it stands for
            self._settle_sums()
        return self._sid_of.get(storage)

    def track(self, tensor: torch.Tensor) -> None:
        for storage in _storages(tensor):
            self._track_storage(storage)

    def _track_storage(self, storage: torch.UntypedStorage) -> None:
        if storage in self._sid_of:
            return
        self._settle_sums()
        sid = self._next_sid
        self._next_sid += 1
        self._sid_of[storage] = sid
        nbytes = storage.nbytes()
        self.timeline.sizes[sid] = nbytes
        self.timeline.events.append(("a", sid, nbytes))
        events = self.timeline.events
        alias = self._alias
        self._refs[sid] = weakref.ref(storage, lambda _ref, sid=sid: (events.append(("f", alias.get(sid, sid))),
                                                                     self._refs.pop(sid, None)))

    def _engine_sum_candidate(self, func, args: tuple, kwargs: dict | None) -> bool:
        """Whether ``func`` is autograd's input-buffer sum of two gradients of one input (an add inside the
        engine, no grad mode) that a GPU may make in place: ``InputBuffer::accumulate`` sums ``old.add_(new)``
        only when ``can_accumulate_inplace(old)``: ``old`` dense, no tensor subclass, the buffer holding the only
        reference to it *and to its storage*. An autograd view never passes: its ``ViewInfo`` keeps its base,
        which shares the storage (``linear`` on a 3-D input returns ``ViewBackward0``'s ``grad.view(...)``, the
        residual ``AddBackward0`` passes it on), so such a sum makes a new tensor on the GPU (real CPU tensors
        show the same: docs/allocator.md, helper sums). ``new`` may be anything of ``old``'s shape."""
        if (func is not torch.ops.aten.add.Tensor or not self.fold_engine_sums or torch.is_grad_enabled()
                or torch._C._current_graph_task_id() == -1 or len(args) != 2
                or (kwargs or {}).get("alpha", 1) != 1):
            return False
        old, new = args
        return (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and old.shape == new.shape
                and old.dtype == new.dtype and not old._is_view() and is_non_overlapping_and_dense_or_false(old)
                and old.untyped_storage().nbytes() == old.numel() * old.element_size())

    @staticmethod
    def _sum_in_first_layout(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """``old + new`` in ``old``'s strides: what ``old.add_(new)`` leaves (a folded sum is ``old`` itself; the
        traced add may pick another layout, and a later ``transpose(...).contiguous()`` would copy)."""
        out = torch.empty_strided(old.shape, old.stride(), dtype=old.dtype, device=old.device)
        return torch.ops.aten.add.out(old, new, out=out)

    def _engine_sum(self, args: tuple, out, first_new: int) -> None:
        """Note a candidate sum (``_engine_sum_candidate``) that made one new storage; ``_settle_sums`` folds it
        once the frees that follow it are known (the traced ``buffer[pos] = old + new`` dropping the buffer's
        last reference to ``old`` frees its storage right after the sum)."""
        if self._next_sid != first_new + 1 or not isinstance(out, torch.Tensor):
            return
        if out.untyped_storage().nbytes() != args[0].untyped_storage().nbytes():
            return
        inputs = [self.sid(a.untyped_storage()) for a in args]
        if None not in inputs:
            self._pending_sums.append((first_new, inputs[0], inputs[1], len(self.timeline.events) - 1))

    def _settle_sums(self) -> None:
        """Fold the noted sums whose ``old`` input was freed right after them (before any later allocation: the
        buffer held its last reference, as the traced ``buffer[pos] = old + new`` drops it): the sum's storage
        becomes ``old``'s (no allocation; its free goes, the sum's free frees it). Others stay out of place."""
        pending, self._pending_sums = self._pending_sums, []
        events = self.timeline.events
        for out, old, _new, at in reversed(pending):  # from the end: earlier indices stay valid
            if events[at] != ("a", out, self.timeline.sizes[out]):
                continue
            after = events[at + 1:]
            upto = next((i for i, event in enumerate(after) if event[0] == "a"), len(after))
            if ("f", old) not in after[:upto]:
                continue
            kept = old
            del events[at + 1 + after.index(("f", kept))]
            del events[at]
            self._alias[out] = self._alias.get(kept, kept)
            ref = self._refs.get(out)
            storage = ref() if ref is not None else None
            if storage is not None:
                self._sid_of[storage] = self._alias[out]

    def _fills_fresh_zeros(self, func, args: tuple, kwargs: dict) -> bool:
        """Whether ``func`` is a backward formula's fill of the zeros it has just made (torch's FunctionsManual:
        ``index_backward``, ``gather_backward``, ``value_selecting_reduction_backward``, ``index_select_backward``
        write the gradient into a fresh zeros tensor in place, ``_index_put_impl_`` / ``scatter_`` / ...,
        except on tensor subclasses such as fake tensors, which take the out-of-place op and allocate a second
        tensor of the input's size). In a backward pass (no grad mode), an out-of-place fill whose target is the
        storage allocated last runs in place here, as on a GPU's or CPU's plain tensors."""
        if (func not in _IN_PLACE_FILL or active_fake_mode() is None or torch.is_grad_enabled()
                or torch._C._current_graph_task_id() == -1 or not args or not isinstance(args[0], torch.Tensor)):
            return False
        if func is torch.ops.aten.index_put.default and not (args[3] if len(args) > 3 else kwargs.get("accumulate")):
            return False  # index_backward accumulates; a plain index_put is the model's own op
        return self._sid_of.get(args[0].untyped_storage()) == self._next_sid - 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Storages created inside are not recorded (metadata-only computations, e.g. DTensor's global-shape
        sharding propagation on fake tensors; see ``estimator.profiler.fake_pg``)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, _dtensor_type()) for t in types):
            return NotImplemented  # DTensor desugars into ops on its local tensors, which come back here
        engine_sum = False
        if func is torch.ops._c10d_functional.wait_tensor.default and active_fake_mode() is not None:
            out = args[0]  # the fake impl returns a new tensor; on a GPU wait_tensor returns its input
        elif self._fills_fresh_zeros(func, args, kwargs or {}):
            out = _IN_PLACE_FILL[func](*args, **(kwargs or {}))
        elif (engine_sum := not self._paused and self._engine_sum_candidate(func, args, kwargs)):
            out = self._sum_in_first_layout(*args)
        else:
            out = func(*args, **(kwargs or {}))
        if not self._paused:
            before = self._next_sid
            for item in tree_flatten(out)[0]:
                if isinstance(item, torch.Tensor):
                    self.track(item)
            if self._next_sid > before and func.namespace == "aten" and func.overloadpacket.__name__ in BLAS_OPS:
                self.timeline.blas_outputs.append(before)
            if engine_sum:
                self._engine_sum(args, out, before)
            if self.inherit_layers and self._next_sid > before:
                self._inherit_layer(args, out)
                self._note_scalars(args, kwargs, out)
        return out

    def label_layer(self, tensor: torch.Tensor, layer: int) -> None:
        for storage in _storages(tensor):
            sid = self.sid(storage)
            if sid is not None:
                self.timeline.layer_of[sid] = layer

    def _layer(self, tensor) -> int | None:
        if not isinstance(tensor, torch.Tensor):
            return None
        for storage in _storages(tensor):
            sid = self.sid(storage)
            if sid is not None and sid in self.timeline.layer_of:
                return self.timeline.layer_of[sid]
        return None

    def _note_scalars(self, args: tuple, kwargs: dict | None, out) -> None:
        """0-dim outputs of an op whose inputs hold no traced storage (``torch.tensor(0.0)`` lifts a constant)."""
        if any(isinstance(x, torch.Tensor) and self._traced(x) for x in tree_flatten((args, kwargs or {}))[0]):
            return
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor) and item.dim() == 0:
                sid = self.sid(item.untyped_storage())
                if sid is not None:
                    self.timeline.scalars.add(sid)

    def _traced(self, tensor: torch.Tensor) -> bool:
        return any(self.sid(storage) is not None for storage in _storages(tensor))

    def _inherit_layer(self, args: tuple, out) -> None:
        """A foreach op's i-th output belongs to its first list argument's i-th tensor; any other op's outputs to
        its first input that belongs to a layer (``p.grad.float()``, ``zeros_like(p)``)."""
        outs = out if isinstance(out, (list, tuple)) else [out]
        first = args[0] if args else None
        if isinstance(first, (list, tuple)) and len(first) == len(outs):
            sources = list(first)
        else:
            found = next((layer for layer in map(self._layer, tree_flatten(args)[0]) if layer is not None), None)
            if found is None:
                return
            for item in outs:
                if isinstance(item, torch.Tensor):
                    self.label_layer(item, found)
            return
        for item, source in zip(outs, sources):
            layer = self._layer(source)
            if layer is not None and isinstance(item, torch.Tensor):
                self.label_layer(item, layer)


# the out-of-place fills backward formulas use on tensor subclasses -> the in-place op plain tensors get
_IN_PLACE_FILL = {
    torch.ops.aten.index_put.default: torch.ops.aten.index_put_.default,
    torch.ops.aten.scatter.src: torch.ops.aten.scatter_.src,
    torch.ops.aten.scatter_add.default: torch.ops.aten.scatter_add_.default,
    torch.ops.aten.index_add.default: torch.ops.aten.index_add_.default,
}


@functools.cache
def _dtensor_type() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def _storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding ``tensor``'s data: a DTensor's (or another wrapper subclass's) inner tensors'."""
    if is_traceable_wrapper_subclass(tensor):
        from torch.distributed._tools.common_utils import get_untyped_storages

        return list(get_untyped_storages(tensor))
    return [tensor.untyped_storage()]


def decoder_layers(model: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList:
    """The ModuleList holding the decoder blocks (the one with num_layers children and the most parameters)."""
    best, best_params = None, -1
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            params = sum(p.numel() for p in module.parameters())
            if params > best_params:
                best, best_params = module, params
    if best is None:
        raise ValueError(f"model: found no stack of {num_layers} decoder layers")
    return best


def install_layer_markers(recorder: StorageRecorder, layers: torch.nn.ModuleList) -> ModTracker:
    """Decoder-layer boundaries, and the routed experts module's entry and exit (``estimator.models.moe``'s
    marks: where expert parallelism swaps in its own dispatch, experts and combine)."""
    index = {id(layer): i for i, layer in enumerate(layers)}
    experts = {id(module) for layer in layers for name, module in layer.named_modules()
               if name.rsplit(".", 1)[-1] == "experts"}
    tracker = ModTracker()

    def on(kind: str):
        def hook(module, args, *rest):
            i = index.get(id(module))
            if i is not None:
                recompute = kind == "fw_pre" and tracker.is_bw
                recorder.mark(f"{'rc_pre' if recompute else kind}:{i}")
            elif id(module) in experts:
                _mark_experts(recorder, kind, args, rest)
        return hook

    tracker.register_user_hooks(pre_fw_hook=on("fw_pre"), post_fw_hook=on("fw_post"),
                                pre_bw_hook=on("bw_pre"), post_bw_hook=on("bw_post"))
    return tracker


def _mark_experts(recorder: StorageRecorder, kind: str, args, rest: tuple) -> None:
    # experts(hidden_states, top_k_index, top_k_weights), positional in every transformers MoE block
    weights = args[2] if isinstance(args, tuple) and len(args) > 2 else None
    if kind == "fw_pre" and isinstance(weights, torch.Tensor):
        recorder.mark(experts_entry_mark(weights.element_size()))
    elif kind == "fw_post" and rest and rest[0] is not None:
        # ModTracker's post-forward hook is always called: with no output when the forward raised, as a
        # checkpoint's recomputation does once it has every tensor backward needs (early stop)
        recorder.mark(EXPERTS_DONE_MARK)


def label_grads(recorder: StorageRecorder, model: torch.nn.Module) -> None:
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = getattr(param.grad, "_local_tensor", param.grad)  # TP: the DTensor grad's local shard
            sid = recorder.sid(grad.untyped_storage())
            if sid is not None:
                recorder.timeline.grad_names[sid] = name


def label_layers(recorder: StorageRecorder, layers: torch.nn.ModuleList, optimizer) -> None:
    """Mark each decoder layer's parameters, gradients and fp32 masters with the layer's index; the optimizer's
    states and temporaries inherit it when created (``inherit_layers``)."""
    layer_of = {}
    for i, layer in enumerate(layers):
        for param in layer.parameters():
            layer_of[id(param)] = i
            recorder.label_layer(param, i)
            if param.grad is not None:
                recorder.label_layer(param.grad, i)
    for opt in getattr(optimizer, "optimizers", [optimizer]):
        for model_param, master in zip(getattr(opt, "model_params", ()), getattr(opt, "masters", ())):
            if id(model_param) in layer_of:
                recorder.label_layer(master, layer_of[id(model_param)])
                layer_of[id(master)] = layer_of[id(model_param)]
        inner = getattr(opt, "inner", opt)
        for param, state in getattr(inner, "state", {}).items():
            if id(param) in layer_of:
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        recorder.label_layer(value, layer_of[id(param)])
