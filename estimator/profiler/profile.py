"""Work out an architecture's memory profile from fake-tensor traces of a shrunken copy.

The profile is a compact, torch-free description of one steady-state training step (forward + backward):
segments (prefix, first/generic/last layer forward, middle, first/generic/last layer backward, suffix), each
reduced to its net change and its non-dominated peak candidates. Every tensor size is an exact polynomial in
micro-batch ``b`` and sequence ``s`` over the monomials ``MONOMIALS``, fitted per regime (b = 1 differs: size-1
dims make some reshapes views instead of copies; a sliding attention window changes masks past the window).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import time
import weakref
from collections.abc import Callable
from fractions import Fraction

import torch

from estimator.models.profiles import MONOMIALS, PROFILE_SCHEMA_VERSION, SUMMARY_RULE
from estimator.profiler import build
from estimator.profiler.events import compact_events, first_optimizer_events
from estimator.profiler.modules import record_module_trace
from estimator.profiler.summary import (  # noqa: F401 - tests and carry read them here
    TECHNIQUE_MARKS,
    _dominated,
    _hook_moments,
    _per_layer_events,
    _segment_summary,
    _sum_polys,
    manual_loop_events,
)
from estimator.profiler.techniques import liger_loop_as_marker
from estimator.profiler.trace import (
    StorageRecorder,
    decoder_layers,
    install_layer_markers,
    label_grads,
    label_layers,
)
from estimator.spec import TrainingSpec, installed_bnb_release

PROFILE_LAYERS = 3
CHECK_LAYERS = 4
SEGMENTS = ("prefix", "fw_first", "fw", "fw_last", "mid_fw", "mid_bw", "bw_first", "bw", "bw_last", "suffix")


def _monomial_values(b: int, s: int) -> list[int]:
    return [1, s, s * s, b, b * s, b * s * s]


def sliding_window(config: dict) -> int | None:
    for key in ("sliding_window", "window_size"):
        value = config.get(key)
        if isinstance(value, int) and value > 0 and config.get("use_sliding_window", True) is not False:
            return value
    return None


def regimes_for(config: dict) -> list[dict]:
    """(b, s) domains whose op sequence is the same; each gets its own fitted timeline."""
    window = sliding_window(config)
    max_pos = config.get("max_position_embeddings") or config.get("n_positions") or 1 << 20
    s_spans = [(1, window)] if window else [(1, None)]
    if window and window < max_pos:
        s_spans.append((window + 1, None))
    return [{"b_min": b_min, "b_max": b_max, "s_min": s_min, "s_max": s_max, "s_trace_max": s_max or max_pos}
            for b_min, b_max in ((1, 1), (2, None)) for s_min, s_max in s_spans]


def _sample_seqs(regime: dict) -> list[int]:
    """Three fitting lengths and one check length inside the regime's s-span, kept small (tracing is by op).
    Multiples of 32 where the span allows: CUDA's memory-efficient attention pads its logsumexp to a multiple of
    32 positions, a size that is a polynomial in s only on such lengths (elsewhere the profile is below it by
    < 32·b·h·4 bytes per layer); at least multiples of 8 in a short sliding-window span (the kernel's mask is
    padded to 8 columns, which changes the op sequence)."""
    base = regime["s_min"] + 31 if regime["s_min"] > 1 else 32
    longest = regime.get("s_trace_max") or regime["s_max"]  # a model's positions may end before 160
    step = 32 if longest is None else max(1, min(32, (longest - base) // 5))
    if step >= 8:  # a padded batch's mask is padded to 8 columns for CUDA's kernel: keep s % 8 alike
        step -= step % 8
    return [base, base + step, base + 2 * step, base + 4 * step]


def _points(regime: dict) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    s1, s2, s3, s4 = _sample_seqs(regime)
    if regime["b_max"] == 1:
        return [(1, s1), (1, s2), (1, s3)], [(1, s4)]
    return [(b, s) for b in (2, 3) for s in (s1, s2, s3)], [(4, s2), (2, s4)]


class _Model:
    """A fake-tensor model + optimizer kept alive across trace points (params and Adam states persist).

    ``tp > 1``: the model as TP rank 0 of ``tp`` runs it (``estimator.profiler.tp.apply_tp`` over a 1-D mesh, one
    optimizer per parameter kind, ``build_tp_optimizer``), exactly as the oracle and the harness wrap ``tp``.
    Needs the fake process group of ``build_profile`` (``estimator.profiler.fake_pg.fake_process_group``)."""

    def __init__(self, config: dict, training: TrainingSpec, num_layers: int, tp: int = 1) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.training = training
        self.num_layers = num_layers
        self.tp = tp
        self.vocab = int(config.get("vocab_size"))
        model = build.build_model(config, training, num_layers=num_layers, meta=True)
        self.recorder = StorageRecorder()
        mesh = None
        if tp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (tp,))  # outside FakeTensorMode (it reads a scalar)
        with self._dtensor_patches(), self.mode, self.recorder:
            self.model = build.materialize_fake(model)
            if mesh is None:
                self.optimizer = build.build_optimizer(self.model.parameters(), training)
            else:
                from estimator.profiler.tp import apply_tp, build_tp_optimizer

                apply_tp(self.model, mesh, config)
                self.optimizer = build_tp_optimizer(self.model.parameters(), training)
        self.base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        self.layers = decoder_layers(self.base, num_layers)
        self.tracker = install_layer_markers(self.recorder, self.layers)
        self.first = 0  # decoder layers that run forward only (``frozen_leading_layers``)
        self.warm = False  # after one step Adam states exist; every later window starts from the same state

    def replayed_layer(self, layer: int | None) -> int | None:
        """A traced layer's index among the layers backward reaches (the replay's layers)."""
        return None if layer is None else layer - self.first

    def _dtensor_patches(self) -> contextlib.AbstractContextManager:
        """TP: DeviceMesh host tensors and DTensor's global-shape metadata propagation kept out of the trace."""
        stack = contextlib.ExitStack()
        if self.tp > 1:
            from estimator.profiler.fake_pg import device_mesh_untracked, skip_dtensor_meta_propagation

            stack.enter_context(device_mesh_untracked(self.recorder))
            stack.enter_context(skip_dtensor_meta_propagation(self.recorder))
        return stack

    def warm_step(self, b: int = 1, s: int = 16) -> None:
        """One training step, not recorded (e.g. to read the gradient-hook order)."""
        with self._dtensor_patches(), self.mode:
            batch = build.synthetic_batch(b, s, min(self.vocab, 1000))
            with build.as_on_gpu(self.training.batch, self.training):
                build.train_step(self.model, self.optimizer, batch, self.training)

    def output_bytes(self, b: int, s: int) -> list[tuple[int, bool, bool]]:
        """(bytes, saved by the graph, 16-bit float) of each storage the output object holds besides the loss's,
        from one recorded forward (no backward): what a manual loop keeps bound that the trainer loop drops."""
        rec = self.recorder
        with self._dtensor_patches(), self.mode, rec, build.as_on_gpu(self.training.batch, self.training):
            batch = build.synthetic_batch(b, s, min(self.vocab, 1000))
            outputs, loss = build.step_forward(self.model, batch, self.training)
            held = output_storages(outputs, loss)
            facts = [(storage.nbytes(), sixteen) for storage, sixteen in held]
            refs = [weakref.ref(storage) for storage, _ in held]
            del outputs, held
            result = [(size, ref() is not None, sixteen) for (size, sixteen), ref in zip(facts, refs)]
            del loss
        return result

    def trace_window(self, b: int, s: int) -> list[tuple]:
        """One warm-up step, then the measured step's events (window_start .. optimizer). The whole step, optimizer
        step and ``zero_grad`` included (window_start .. step_end), is kept in ``full_window``; the first step's
        optimizer step and ``zero_grad`` (where Adam creates its states) in ``first_optimizer_window``."""
        rec = self.recorder
        with self._dtensor_patches(), self.mode, rec:
            batch = build.synthetic_batch(b, s, min(self.vocab, 1000))
            if not self.warm:
                with build.as_on_gpu(self.training.batch, self.training):
                    build.forward_backward(self.model, batch, self.training)
                self._label(mark="first_optimizer")
                self._step_and_zero_grad("first_step_end")
                self.warm = True
            rec.mark("window_start")
            with self.tracker, build.as_on_gpu(self.training.batch, self.training):
                outputs, loss = build.step_forward(self.model, batch, self.training)
                held = output_storages(outputs, loss)
                sids = [rec.sid(storage) for storage, _ in held]
                refs = [weakref.ref(storage) for storage, _ in held]
                # what accelerate's mixed-precision forward wrapper would copy to fp32 (TrainingSpec.outputs_fp32)
                self.held_16bit = {sid for sid, (_, sixteen) in zip(sids, held) if sixteen}
                del outputs, held  # the trainer loop: the output object goes before backward
                # (sid, still alive: the autograd graph saved it) for what a manual loop would keep bound
                self.held_outputs = [(sid, ref() is not None) for sid, ref in zip(sids, refs)]
                rec.mark("backward")
                loss.backward()
            self._label(mark="optimizer")
            del loss  # after the marker, as the activation summaries have always counted it
            self._step_and_zero_grad("step_end")
        events = rec.timeline.events
        start = max(i for i, e in enumerate(events) if e == ("m", "window_start"))
        end = max(i for i, e in enumerate(events) if e == ("m", "optimizer"))
        self.full_window = events[start:max(i for i, e in enumerate(events) if e == ("m", "step_end"))]
        first = events.index(("m", "first_optimizer"))
        self.first_optimizer_window = events[first:events.index(("m", "first_step_end"))]
        return events[start:end]

    def _label(self, mark: str) -> None:
        """Name the gradients, label every storage that belongs to a decoder layer's parameter, then mark."""
        label_grads(self.recorder, self.model)
        label_layers(self.recorder, self.layers, self.optimizer)
        self.recorder.mark(mark)

    def _step_and_zero_grad(self, end: str) -> None:
        """``optimizer.step()`` and ``zero_grad``; the storages they create take the decoder layer of the
        parameter they belong to."""
        rec = self.recorder
        rec.inherit_layers = True
        try:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        finally:
            rec.inherit_layers = False
        rec.mark(end)


def output_storages(outputs, loss: torch.Tensor) -> list[tuple[torch.UntypedStorage, bool]]:
    """The storages the model's output object holds besides the loss's (logits; auxiliary losses, hidden states
    or attentions when the model returns them), each once, with whether a 16-bit float tensor holds it."""
    from torch.utils._pytree import tree_flatten

    values = outputs.to_tuple() if hasattr(outputs, "to_tuple") else outputs
    skip = {id(loss.untyped_storage())}
    found: list[tuple[torch.UntypedStorage, bool]] = []
    for item in tree_flatten(values)[0]:
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if id(storage) not in skip:
                skip.add(id(storage))
                found.append((storage, item.dtype in (torch.float16, torch.bfloat16)))
    return found


def _normalise(window: list[tuple], timeline, held: list[tuple[int | None, bool]] = ()
               ) -> tuple[list[tuple], list[int], list[str | None], tuple]:
    """Events with sids replaced by first-appearance ordinals: comparable across points. ``held``: (sid, saved by
    the graph) of the output object's storages, returned as (ordinal, saved) pairs."""
    out, sizes, grads, held_ordinals, _sids = _normalise_sids(window, timeline, held)
    return out, sizes, grads, held_ordinals


def _normalise_sids(window: list[tuple], timeline, held: list[tuple[int | None, bool]] = ()
                    ) -> tuple[list[tuple], list[int], list[str | None], tuple, list[int]]:
    """``_normalise``, plus each ordinal's sid."""
    ordinal: dict[int, int] = {}
    sizes: list[int] = []
    grads: list[str | None] = []
    sids: list[int] = []
    out: list[tuple] = []
    for event in window:
        if event[0] == "m":
            out.append(event)
            continue
        sid = event[1]
        if sid not in ordinal:
            ordinal[sid] = len(sizes)
            sizes.append(timeline.sizes[sid])
            grads.append(timeline.grad_names.get(sid))
            sids.append(sid)
            if event[0] == "f":  # freed in the window, allocated before it (e.g. a step-1 leftover)
                out.append(("f_pre", ordinal[sid]))
                continue
        out.append((event[0], ordinal[sid]))
    held_ordinals = tuple(sorted((ordinal[sid], saved) for sid, saved in held if sid in ordinal))
    return out, sizes, grads, held_ordinals, sids


def device_events(window: list[tuple], timeline, training: TrainingSpec) -> list[tuple]:
    """The window without the optimizer's host scalars (foreach / for-loop Adam keeps its ``step`` counters on
    the CPU; fused Adam keeps them on the device)."""
    if training.optimizer == "adamw_fused" or not timeline.scalars:
        return window
    host = timeline.scalars
    return [e for e in window if e[0] == "m" or e[1] not in host]


def _solve(points: list[tuple[int, int]], values: list[int]) -> list[Fraction]:
    """Exact least-structure fit: quadratic in s per b, then linear in b (b=1 regime: no b terms)."""
    by_b: dict[int, dict[int, int]] = {}
    for (b, s), v in zip(points, values):
        by_b.setdefault(b, {})[s] = v
    quad = {b: _quadratic(list(vals.items())) for b, vals in by_b.items()}
    if len(quad) == 1:
        (c0, c1, c2), = quad.values()
        return [c0, c1, c2, Fraction(0), Fraction(0), Fraction(0)]
    (b1, q1), (b2, q2) = sorted(quad.items())[:2]
    slope = [(y - x) / (b2 - b1) for x, y in zip(q1, q2)]
    intercept = [x - k * b1 for x, k in zip(q1, slope)]
    return intercept + slope


def _quadratic(pairs: list[tuple[int, int]]) -> tuple[Fraction, Fraction, Fraction]:
    (x0, y0), (x1, y1), (x2, y2) = pairs[:3]
    # Newton divided differences, exact.
    d01 = Fraction(y1 - y0, x1 - x0)
    d12 = Fraction(y2 - y1, x2 - x1)
    c2 = (d12 - d01) / (x2 - x0)
    c1 = d01 - c2 * (x0 + x1)
    c0 = y0 - c1 * x0 - c2 * x0 * x0
    return c0, c1, c2


def _evaluate(coeffs: list[Fraction], b: int, s: int) -> Fraction:
    return sum(c * m for c, m in zip(coeffs, _monomial_values(b, s)))


def _segment_bounds(signature: list[tuple], num_layers: int, first: int = 0) -> dict[str, tuple[int, int]]:
    """``first``: the decoder layers before it run forward only (``frozen_leading_layers``): they are part of the
    prefix, and layers ``first`` .. ``first + 2`` are the first, generic and last layer."""
    where = {e[1]: i for i, e in enumerate(signature) if e[0] == "m"}
    first_where = {}
    for i, e in enumerate(signature):
        if e[0] == "m":
            first_where.setdefault(e[1], i)
    last = num_layers - 1
    skipped = [i for i in range(first, num_layers) if f"fw_pre:{i}" in first_where and f"bw_pre:{i}" not in first_where]
    if skipped and "backward" in first_where:
        # e.g. LoRA on the routed experts of a model whose first layers are dense: nothing there needs a gradient
        raise ValueError(f"lora_targets: backward never reaches decoder layer {skipped[0]} (no trainable parameter "
                         "in it or before it); a layer without gradients is not modelled: add a target it has")
    try:
        fw = [first_where[f"fw_pre:{i}"] for i in range(first, num_layers)]
        fw_end = first_where[f"fw_post:{last}"]
        bw = [first_where[f"bw_pre:{i}"] for i in range(first, num_layers)]
        bw_end = where[f"bw_post:{first}"]
        backward = first_where["backward"]
    except KeyError as err:
        raise RuntimeError(f"profile: missing layer marker {err} (layer hooks did not fire)") from None
    last = len(fw) - 1  # the traced layers from ``first`` on
    return {
        "prefix": (0, fw[0]), "fw_first": (fw[0], fw[1]), "fw": (fw[1], fw[2]),
        "fw_last": (fw[last], fw_end), "mid_fw": (fw_end, backward), "mid_bw": (backward, bw[last]),
        "bw_first": (bw[last], bw[last - 1]), "bw": (bw[last - 1], bw[last - 2]),
        "bw_last": (bw[0], bw_end), "suffix": (bw_end, len(signature)),
    }


def _fit_regime(model: _Model, regime: dict) -> tuple[dict, list, list]:
    fit_points, check_points = _points(regime)
    traces = {}
    for b, s in fit_points + check_points:
        model.trace_window(b, s)
        normalised = _normalise_sids(device_events(model.full_window, model.recorder.timeline, model.training),
                                     model.recorder.timeline, model.held_outputs)
        sixteen = frozenset(k for k, sid in enumerate(normalised[4]) if sid in model.held_16bit)
        traces[(b, s)] = (*normalised, sixteen)
    full, _, grads, held, sids, sixteen = traces[fit_points[0]]
    for point, (sig, _sizes, _g, point_held, _sids, point_sixteen) in traces.items():
        if sig != full or point_held != held or point_sixteen != sixteen:
            raise RuntimeError(f"profile: op sequence at (b, s) = {point} differs from {fit_points[0]}; "
                               "this architecture changes control flow with shape")
    n = len(traces[fit_points[0]][1])
    coeffs = [_solve(fit_points, [traces[p][1][k] for p in fit_points]) for k in range(n)]
    worst = 0.0
    for point in check_points:
        for k in range(n):
            actual = traces[point][1][k]
            predicted = _evaluate(coeffs[k], *point)
            if predicted != actual:
                worst = max(worst, abs(float(predicted) - actual) / max(actual, 1))
    signature = full[:full.index(("m", "optimizer"))]  # the summaries end where the optimizer step begins
    segments = _summarise(signature, coeffs, grads, model.num_layers, first=model.first)
    manual_signature, manual_coeffs, manual_grads = manual_loop_events(signature, coeffs, grads, held)
    previous = {len(coeffs) + i: k for i, (k, _saved) in enumerate(held)}  # manual_loop_events' copies
    outputs = {kind: [float(x) for x in _sum_polys([coeffs[k] for k, saved in held if saved == want])]
               for kind, want in (("dropped", False), ("saved", True))}
    outputs_16bit = {kind: [float(x) for x in _sum_polys([coeffs[k] for k, saved in held
                                                          if saved == want and k in sixteen])]
                     for kind, want in (("dropped", False), ("saved", True))}
    timeline = model.recorder.timeline
    grad_ordinal = {name: o for o, name in enumerate(grads) if name is not None}
    first = first_optimizer_events(device_events(model.first_optimizer_window, timeline, model.training), timeline,
                                   grad_ordinal, n)
    events = compact_events(full, _segment_bounds(signature, model.num_layers, model.first), coeffs, grads,
                            [model.replayed_layer(timeline.layer_of.get(sid)) for sid in sids], held,
                            (*first[:2], {o: model.replayed_layer(layer) for o, layer in first[2].items()}))
    events["optimizer"] = model.training.optimizer
    events["blas_first"] = first_blas_outputs(full, sids, timeline.blas_outputs)
    events["sums_in_place"] = model.recorder.fold_engine_sums
    frozen = {"frozen_layers": model.first} if model.first else {}
    return {**regime, **frozen, "segments": segments,
            "segments_manual": _summarise(manual_signature, manual_coeffs, manual_grads, model.num_layers,
                                          previous, model.first),
            "outputs_held": outputs, "outputs_held_16bit": outputs_16bit, "check_max_rel_error": worst,
            "events": events}, signature, coeffs


OUTER_SEGMENTS = ("prefix", "mid_fw", "mid_bw", "suffix")


def first_blas_outputs(window: list[tuple], sids: list[int], blas_sids: list[int]) -> list[int | None]:
    """[forward, backward]: the ordinal of the first cuBLAS op's output before and after the window's ``backward``
    marker (None: no such op). The forward runs on the main thread, backward on autograd's device thread; each
    thread's first cuBLAS call makes its handle's workspace just after that output (``expand.expand``)."""
    blas = set(blas_sids)
    found: list[int | None] = [None, None]
    phase = 0
    for event in window:
        if event == ("m", "backward"):
            phase = 1
        elif event[0] == "a" and found[phase] is None and sids[event[1]] in blas:
            found[phase] = event[1]
    return found


def _summarise(signature: list[tuple], coeffs: list, grads: list, num_layers: int,
               copies_of: dict[int, int] | None = None, first: int = 0) -> dict:
    """``copies_of``: ordinals standing for another's tensor of the previous step (a manual loop's outputs);
    ``first``: the first decoder layer backward reaches (``frozen_leading_layers``)."""
    bounds = _segment_bounds(signature, num_layers, first)
    layer_of: dict[int, int] = {}
    for name, layer in (("fw_first", 0), ("fw", 1), ("fw_last", 2)):
        lo, hi = bounds[name]
        layer_of.update((e[1], layer) for e in signature[lo:hi] if e[0] == "a")
    layer_of.update((copy, layer_of[original]) for copy, original in (copies_of or {}).items()
                    if original in layer_of)
    return {name: _segment_summary(signature[lo:hi], coeffs, grads,
                                   _per_layer_events(signature[lo:hi], layer_of) if name in OUTER_SEGMENTS
                                   else frozenset())
            for name, (lo, hi) in bounds.items()}


def param_table(model: torch.nn.Module, layers: torch.nn.ModuleList, num_layers: int, generic: int = 1) -> dict:
    """Parameters of the shrunken model split into non-layer ones and one generic layer's (``generic``: its index;
    after forward-only first layers, the generic one of the layers backward reaches).

    Shapes and sizes are what this rank holds: a TP model's DTensor parameters give their local shard (row
    ``dtensor: true`` with ``global_shape`` / ``global_numel`` of the whole parameter); plain ones are whole.
    ``buffers``: bytes of module buffers outside the layers and in one generic layer."""
    prefix = next(name for name, mod in model.named_modules() if mod is layers)
    non_layer, per_layer = [], []
    generic_index, generic = generic, f"{prefix}.{generic}."
    layers_at = None  # how many non-layer tensors model.parameters() yields before the decoder layers
    for name, _param, row in _param_rows(model):
        if layers_at is None and name.startswith(f"{prefix}."):
            layers_at = len(non_layer)
        if name.startswith(generic):
            per_layer.append({**row, "name": name[len(generic):]})
        elif not name.startswith(f"{prefix}."):
            non_layer.append(row)
    signatures: dict[int, list] = {}  # each traced layer's (name, shape, dtype size, trainable): all alike?
    for name, param in model.named_parameters():
        if name.startswith(f"{prefix}."):
            index, _, rest = name[len(prefix) + 1:].partition(".")
            signatures.setdefault(int(index), []).append((rest, tuple(param.shape), param.element_size(),
                                                          param.requires_grad))
    differing = sorted(i for i, sig in signatures.items() if sig != signatures.get(generic_index))
    buffers = {"non_layer": 0, "per_layer": 0}  # resident on every rank (e.g. CodeGen's sin/cos, GPT-Neo's masks)
    for name, buf in model.named_buffers():
        held = getattr(buf, "_local_tensor", buf)
        if name.startswith(generic):
            buffers["per_layer"] += held.numel() * held.element_size()
        elif not name.startswith(f"{prefix}."):
            buffers["non_layer"] += held.numel() * held.element_size()
    table = {"layer_prefix": prefix, "non_layer": non_layer, "per_layer": per_layer, "buffers": buffers,
             "layers_at": len(non_layer) if layers_at is None else layers_at}
    if differing:  # e.g. a dense first layer before mixture-of-experts ones: every layer is counted as layer 1
        table["layers_differ"] = differing
    return table


def _param_rows(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, dict]]:
    """(name, parameter, table row) of every parameter, in ``model.parameters()`` order."""
    kinds = {}
    for mod_name, mod in model.named_modules():
        kind = _module_kind(mod)
        for p_name, _ in mod.named_parameters(recurse=False):
            kinds[f"{mod_name}.{p_name}" if mod_name else p_name] = kind
    tied: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(param), []).append(name)
    out = []
    for name, param in model.named_parameters():
        local = getattr(param, "_local_tensor", None)  # TP: a DTensor; this rank holds its local shard
        held = param if local is None else local
        row = {"name": name, "shape": list(held.shape), "numel": held.numel(),
               "elem_bytes": held.element_size(), "trainable": param.requires_grad,
               "kind": kinds.get(name, "other"), "tied": tied[id(param)][1:]}
        state = getattr(param, "quant_state", None)
        if state is not None:  # QLoRA: the logical weight, stored packed with its quantization state
            row.update(shape=list(state.shape), numel=math.prod(state.shape), elem_bytes=state.dtype.itemsize,
                       stored_bytes=quantized_bytes(held, state))
        if local is not None:  # stepped by the DTensor optimizer (build_tp_optimizer); global size for counts
            row.update(dtensor=True, global_shape=list(param.shape), global_numel=param.numel())
        out.append((name, param, row))
    return out


def full_depth_layer_kinds(config: dict, training: TrainingSpec) -> dict:
    """Every decoder layer's parameter rows for the whole model (a meta-device build, no memory), grouped into
    kinds: ``{"rows": [rows of kind 0, ...], "of_layer": [kind of layer 0, ...]}``. For models whose layers are
    not all alike (a dense first layer before mixture-of-experts ones, sparse steps): ``expand_params`` gives
    each layer its own kind's tensors."""
    from estimator.models.arch import arch_from_config

    full = build.build_model(config, training, meta=True)
    base = full.get_base_model() if hasattr(full, "get_base_model") else full
    layers = decoder_layers(base, arch_from_config(config).num_layers)
    table_model = full if training.lora else base
    prefix = next(name for name, mod in table_model.named_modules() if mod is layers)
    per_layer: dict[int, list[dict]] = {}
    for name, _param, row in _param_rows(table_model):
        if name.startswith(f"{prefix}."):
            index, _, rest = name[len(prefix) + 1:].partition(".")
            per_layer.setdefault(int(index), []).append({**row, "name": rest, "tied": []})
    rows: list[list[dict]] = []
    of_layer = []
    for index in range(len(layers)):
        layer_rows = per_layer.get(index, [])
        if layer_rows not in rows:
            rows.append(layer_rows)
        of_layer.append(rows.index(layer_rows))
    return {"rows": rows, "of_layer": of_layer}


def frozen_leading_layers(config: dict, training: TrainingSpec, model: _Model) -> int:
    """How many first decoder layers backward never reaches: LoRA whose adapters leave them without a trainable
    parameter, with nothing trainable before them (peft turns expert projections' names into
    ``target_parameters`` on the fused routed experts, which a dense first layer has not: Qwen3-MoE's
    ``mlp_only_layers``, DeepSeek-V2's ``first_k_dense_replace``). Autograd records nothing there: those layers
    run forward only, their transients freed as they go, so they belong to the step's prefix; the profile traces
    them and three layers after them (the first, generic and last layer backward reaches)."""
    if not training.lora or model.tp > 1:
        return 0
    trainable = [any(p.requires_grad for p in layer.parameters()) for layer in model.layers]
    if trainable[0]:
        return 0
    embeddings = model.base.get_input_embeddings()
    if embeddings is None or any(p.requires_grad for p in embeddings.parameters()):
        return 0
    if not any(trainable) and not training.qlora:  # all traced layers frozen: the whole model's (a meta build)
        kinds = full_depth_layer_kinds(config, training)
        trainable = [any(row["trainable"] for row in kinds["rows"][kind]) for kind in kinds["of_layer"]]
    return trainable.index(True) if any(trainable) else 0


def grad_hook_order(top: torch.nn.Module, base: torch.nn.Module, layers: torch.nn.ModuleList,
                    step: Callable[[], None]) -> list[list]:
    """The order in which backward finishes each trainable parameter's gradient, as ``[layer, name]`` pairs
    (``layer`` None for non-layer tensors, named as in ``param_table``; layer tensors by their name inside the
    layer). Read from post-accumulate-grad hooks, the hooks DeepSpeed's ZeRO-1/2 reduce gradients from, during
    one ``step()``: a tensor used twice (tied embeddings and head) is finished once, when its last use's
    gradient arrives."""
    key: dict[int, list] = {}
    for i, layer in enumerate(layers):
        for name, param in layer.named_parameters():
            key[id(param)] = [i, name]
    for name, param in base.named_parameters():
        key.setdefault(id(param), [None, name])
    order: list[list] = []
    handles = [param.register_post_accumulate_grad_hook(lambda p: order.append(key[id(p)]))
               for param in top.parameters() if param.requires_grad and id(param) in key]
    try:
        step()
    finally:
        for handle in handles:
            handle.remove()
    return order


def quantized_bytes(packed: torch.Tensor, state) -> int:
    """Bytes of a bitsandbytes 4-bit weight: the packed values and every tensor of its (nested) quant state, each
    in whole 512-byte allocator blocks (most of the state is a few bytes: a code table, an offset)."""
    tensors = [packed, state.absmax, state.code, state.offset]
    if state.state2 is not None:
        tensors += [state.state2.absmax, state.state2.code]
    return sum(-(-t.numel() * t.element_size() // 512) * 512 for t in tensors if isinstance(t, torch.Tensor))


def _module_kind(module: torch.nn.Module) -> str:
    name = type(module).__name__.lower()
    if isinstance(module, torch.nn.Embedding) or "embedding" in name:
        return "embedding"
    if isinstance(module, torch.nn.Linear) or name in ("conv1d", "linear"):
        return "linear"
    if "norm" in name:
        return "norm"
    return "other"


def adapter_libraries(training: TrainingSpec) -> dict[str, str]:
    """The releases of the libraries that built a LoRA / QLoRA model, for its provenance: peft decides the adapters'
    dtype (before 0.12 it cast them to the base weight's, from 0.12 it keeps fp32) and bitsandbytes the 4-bit
    layout, so a profile says which it was traced with as it does for transformers and torch."""
    from estimator.models.profiles import installed_version

    wanted = (["peft"] if training.lora else []) + (["bitsandbytes"] if training.qlora else [])
    return {name: version for name in wanted if (version := installed_version(name))}


def build_profile(config: dict, training: TrainingSpec, *, check: bool = True, tp: int = 1) -> dict:
    """Trace, fit and summarise. Seconds of CPU on fake tensors; no real memory is used.

    ``tp > 1``: the profile of TP rank 0 of ``tp`` (layers split by ``estimator.models.tp_plans``, embeddings, norms and
    lm_head replicated), traced on a fake process group that exists only during this call. The model is ``config``'s
    as configured: a resized vocabulary (``training.vocab_size``) is derived from it (``estimator.profiler.vocab``),
    so the profile is cached under the configured model's key."""
    from dataclasses import replace

    from estimator.profiler.cuda_path import backends_seen

    training = replace(training, vocab_size=0)
    started = time.perf_counter()
    with _process_group(tp), backends_seen() as sdpa_backends, liger_loop_as_marker():
        model = _Model(config, training, PROFILE_LAYERS, tp)
        frozen = frozen_leading_layers(config, training, model)
        if frozen:  # trace the forward-only layers too, and three layers backward reaches after them
            del model
            model = _Model(config, training, frozen + PROFILE_LAYERS, tp)
            model.first = frozen
        regimes = []
        for regime in regimes_for(config):
            fitted, signature, coeffs = _fit_regime(model, regime)
            if check:
                fitted["layer_check"] = _check_depth(config, training, regime, fitted, tp, frozen)
            regimes.append(fitted)
        table_model = model.base if not training.lora else model.model
        params = param_table(table_model, model.layers, model.num_layers, generic=frozen + 1)
        if params.get("layers_differ") and tp <= 1 and not training.qlora:
            params["layer_kinds"] = full_depth_layer_kinds(config, training)
        # DeepSpeed ZeRO-1/2 reduces gradients in this order (ZeRO runs on the untouched model); FSDP2's
        # post-backward keeps a group's last gradient longest (dp_tp on a TP profile: estimator.reserved.fsdp)
        params["grad_order"] = [[model.replayed_layer(layer), name] for layer, name in
                                grad_hook_order(model.model, table_model, model.layers, model.warm_step)]
        if frozen:
            params["frozen_layers"] = frozen
        elif tp <= 1:  # DeepSpeed ZeRO-3's parameter coordinator follows it (estimator.reserved.zero3_gathers)
            params["module_trace"] = record_module_trace(model.model, table_model, model.layers, model.warm_step)
        attn = build.effective_attn(model.base)
        del model
    import transformers

    profile = {
        "schema_version": PROFILE_SCHEMA_VERSION,
        "summary_rule": SUMMARY_RULE,  # summarised by today's rule (``estimator.profiler.summary``)
        "model_type": config.get("model_type"),
        "variant": _variant(training),
        "attn_effective": attn,
        # CUDA's SDPA kernels the trace took (``cuda_path``): "math" keeps (b, heads, s, s) probabilities per layer
        "sdpa_backends": sorted(sdpa_backends),
        "monomials": list(MONOMIALS),
        "params": params,
        "regimes": regimes,
        "provenance": {"torch": torch.__version__, "transformers": transformers.__version__,
                       **adapter_libraries(training),
                       "created": _dt.date.today().isoformat(), "trace_s": round(time.perf_counter() - started, 2),
                       "profile_layers": frozen + PROFILE_LAYERS},
    }
    if tp > 1:
        profile["tp"] = tp
    return profile


def _process_group(tp: int) -> contextlib.AbstractContextManager:
    if tp <= 1:
        return contextlib.nullcontext()
    from estimator.profiler.fake_pg import fake_process_group

    # The cache key the oracle uses for rank 0 of a 1-D tp mesh: the same group names, so DTensor's caches stay.
    return fake_process_group(0, tp, cache_key=(0, tp, "tp", tp))


def _variant(training: TrainingSpec) -> dict:
    return {"precision": training.precision, "attn": training.attn, "grad_ckpt": training.grad_ckpt,
            "lora_rank": training.lora_rank, "lora_targets": training.lora_targets, "qlora": training.qlora,
            "batch": training.batch, "lora_dropout": training.lora_dropout,
            "forward_autocast": training.forward_autocast, "use_cache": training.use_cache,
            # QLoRA without kbit preparation: a base built otherwise (LoRA's 16-bit adapters: the key's -a16 alone)
            **({"lora_dtype": training.lora_dtype, "qlora_prep": training.qlora_prep}
               if training.qlora and not training.qlora_kbit_prep else {}),
            **({"qlora_quantizer": training.qlora_quantizer} if training.qlora_quantizer != "transformers" else {}),
            # the release whose MatMul4Bit kept the inputs (declared, else the installed one)
            **({"qlora_bnb": training.qlora_bnb or ".".join(map(str, installed_bnb_release() or ()))}
               if training.qlora_keeps_inputs else {})}


def _check_depth(config: dict, training: TrainingSpec, regime: dict, fitted: dict, tp: int = 1,
                 frozen: int = 0) -> dict:
    """Replay the 3-layer segments for 4 layers and compare with a real 4-layer trace at one point; expand the
    3-layer event list to 4 layers and compare it with the same trace event by event (steady step, and the first
    step's optimizer step). ``frozen``: forward-only first layers, traced before the 3 (and the 4) layers."""
    from estimator.methods.timeline import replay_activation_peak

    b, s = _points(regime)[1][0]
    deeper = _Model(config, training, frozen + CHECK_LAYERS, tp)
    deeper.first = frozen
    window = deeper.trace_window(b, s)
    signature, sizes, grads, _held = _normalise(window, deeper.recorder.timeline)
    running, peak = 0, 0
    for event in signature:
        if event[0] == "m":
            continue
        running += sizes[event[1]] if event[0] == "a" else -sizes[event[1]]
        peak = max(peak, running)
    replayed = replay_activation_peak(fitted["segments"], CHECK_LAYERS, b, s)  # the layers backward reaches
    return {"b": b, "s": s, "traced_peak_bytes": peak, "replayed_peak_bytes": replayed,
            "rel_error": abs(replayed - peak) / max(peak, 1), **_check_events(deeper, fitted["events"], b, s)}


def _check_events(deeper: _Model, events: dict, b: int, s: int) -> dict:
    """``events_first_mismatch`` (steady step) and ``events_first_optimizer_mismatch``: None when the expansion
    to the deeper model's depth equals its trace; ``events_steady``: how many events were compared."""
    from estimator.profiler.expand import FREE, ExpansionError, expand, first_mismatch, step_sizes

    timeline = deeper.recorder.timeline

    def traced(window: list[tuple]) -> list[tuple[bool, int, int]]:
        return [(e[0] == "a", e[1], timeline.sizes[e[1]])
                for e in device_events(window, timeline, deeper.training) if e[0] != "m"]

    try:
        expansion = expand(events, deeper.num_layers - deeper.first)
    except ExpansionError as err:
        return {"events_error": str(err)}
    sizes = step_sizes(events["polys"], b, s)
    steady = traced(deeper.full_window)
    first_at = expansion.optimizer_at[0]
    # the frees the expansion adds where the trace's module tracker keeps the autograd graph's leaves
    added = expansion.freed_with_loss
    steady_ops = [op for op in expansion.steady.ops if not (op[0] == FREE and op[1] in added)]
    return {"events_steady": len(steady),
            "events_first_mismatch": first_mismatch(steady_ops, sizes, steady),
            "events_first_optimizer_mismatch": first_mismatch(expansion.first.ops[first_at:], sizes,
                                                              traced(deeper.first_optimizer_window))}
