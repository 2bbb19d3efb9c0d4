"""Bring a profile of an older schema to the current one without re-tracing it, where that is exact (each step's
reason is in ``carry_over``); shipped profiles and user caches alike."""

from __future__ import annotations

import json
from pathlib import Path

from estimator.models.arch import arch_from_config, resolve_arch
from estimator.models.profiles import PROFILE_SCHEMA_VERSION, save_profile
from estimator.spec import TrainingSpec


def carry_over_file(path: Path) -> bool:
    """True when the shipped profile is current or could be carried over (``carry_over``, saved in place). Schema 2
    changed only SDPA traces (no 4-D mask for a full-length batch): a schema-1 profile traced with eager attention
    is carried over unchanged (rebuilding OPT-125m and Qwen2.5-0.5B eager profiles gave identical segments,
    2026-11-22). Schema 3 added two facts about the parameters, not the trace (``layers_at``, ``grad_order``): a
    schema-2 profile gets them from the same shrunken model built on fake tensors (``backfill_order``). Schema 4
    added the manual training loop (``backfill_manual_loop``). Schema 5 traces CUDA's kernels instead of the
    CPU's (``cpu_trace_is_cuda_trace`` says where that changes nothing). Schema 6 records which of the output
    object's storages are 16-bit (``backfill_outputs_16bit``)."""
    profile = json.loads(path.read_text())
    if profile.get("schema_version") == PROFILE_SCHEMA_VERSION:
        return True
    if not carry_over(profile):
        return False
    save_profile(path.stem, profile, path.parent)
    return True


def carry_over(profile: dict, config: dict | None = None) -> bool:
    """Bring an older profile to the current schema in place without re-tracing it, where that is exact; False
    when it must be rebuilt. ``config``: the model's config (default: the shipped profile's catalogue model's)."""
    config = config if config is not None else resolve_arch(profile["model"]).config
    version = profile.get("schema_version")
    provenance = profile.setdefault("provenance", {})
    if version == 1 and profile.get("attn_effective") == "eager":
        provenance["carried_over"] = "schema 1 -> 2: eager trace unaffected"
        version = 2
    if version == 2:
        backfill_order(profile, config)
        provenance["carried_over_3"] = "schema 2 -> 3: layers_at, grad_order backfilled"
        version = 3
    if version == 3:
        if not backfill_manual_loop(profile, config):
            return False
        provenance["carried_over_4"] = "schema 3 -> 4: outputs_held, segments_manual backfilled"
        version = 4
    if version == 4:
        if not cpu_trace_is_cuda_trace(config, variant_training(profile)):
            return False
        provenance["carried_over_5"] = "schema 4 -> 5: CUDA's kernels keep what the CPU trace kept"
        version = 5
    if version == 5:
        if not backfill_outputs_16bit(profile, config):
            return False
        provenance["carried_over_6"] = "schema 5 -> 6: outputs_held_16bit backfilled"
        version = 6
    profile["schema_version"] = version
    return version == PROFILE_SCHEMA_VERSION


def cpu_trace_is_cuda_trace(config: dict, training: TrainingSpec) -> bool:
    """Whether a profile traced with the CPU's kernels (schema <= 4) holds what CUDA's kernels keep (schema 5,
    ``estimator.profiler.cuda_path``): no dropout anywhere in the config, and attention that is eager or that CUDA
    runs on FlashAttention as the CPU runs its flash kernel (16-bit compute, head dim <= 256, no mask: no sliding
    window). Anything else is re-traced."""
    from estimator.profiler.profile import sliding_window

    if _dropout_keys(config):
        return False
    if training.attn == "eager":
        return True
    # QLoRA's attention is fp32 whatever the variant's precision (prepare_model_for_kbit_training upcasts)
    return (training.precision != "fp32" and not training.qlora and arch_from_config(config).head_dim <= 256
            and sliding_window(config) is None)


def _dropout_keys(config: dict) -> list[str]:
    """Config keys (nested configs included) naming a dropout probability above zero."""
    found = []
    for key, value in config.items():
        if isinstance(value, dict):
            found += _dropout_keys(value)
        elif "drop" in key.lower() and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            found.append(key)
    return found


def backfill_manual_loop(profile: dict, config: dict) -> bool:
    """Add ``outputs_held`` and ``segments_manual`` (schema 4) to a schema-3 profile, from forward passes of the
    same shrunken model at the regime's fitting points: the output object's storages besides the loss, and
    whether the autograd graph keeps them. When the graph keeps none, the manual loop's step is the traced step
    with the previous step's outputs alive from its start, so ``segments_manual`` is ``segments`` with the prefix
    raised by them (``manual_loop_events`` gives the same for such a trace). False (nothing changed) when the
    graph keeps one: that profile must be re-traced."""
    fitted = [(regime, _held_polys(points, held)) for regime, points, held in _held_outputs(profile, config)]
    if any(any(polys["saved"]) for _, polys in fitted):
        return False
    for regime, polys in fitted:
        regime["outputs_held"] = polys
        regime["segments_manual"] = _raised_prefix(regime["segments"], polys["dropped"])
    return True


def backfill_outputs_16bit(profile: dict, config: dict) -> bool:
    """Add ``outputs_held_16bit`` (schema 6: the part of ``outputs_held`` that 16-bit float tensors hold, which
    accelerate's mixed-precision forward wrapper copies to fp32) from forward passes of the same shrunken model
    at each regime's fitting points. False (nothing changed) when those passes do not give back the profile's own
    ``outputs_held``: that profile must be re-traced."""
    fitted = []
    for regime, points, held in _held_outputs(profile, config):
        polys = _held_polys(points, held)
        if any(abs(a - b) > 1e-6 * max(1.0, abs(b)) for kind in polys
               for a, b in zip(polys[kind], regime["outputs_held"][kind])):
            return False
        fitted.append((regime, _held_polys(points, held, only_16bit=True)))
    for regime, sixteen in fitted:
        regime["outputs_held_16bit"] = sixteen
    return True


def _held_outputs(profile: dict, config: dict) -> list[tuple[dict, list, dict]]:
    """(regime, fitting points, {point: output_bytes}) from forward passes of the profile's shrunken model."""
    from estimator.profiler.profile import PROFILE_LAYERS, _Model, _points, _process_group

    tp = profile.get("tp", 1)
    out = []
    with _process_group(tp):
        model = _Model(config, variant_training(profile), PROFILE_LAYERS, tp)
        for regime in profile["regimes"]:
            points = _points(regime)[0]
            out.append((regime, points, {point: model.output_bytes(*point) for point in points}))
    return out


def _held_polys(points: list, held: dict, only_16bit: bool = False) -> dict[str, list[float]]:
    """The output object's bytes per kind (dropped: only the object holds it; saved: the graph too) as a
    polynomial in (b, s); ``only_16bit``: the storages 16-bit float tensors hold."""
    from estimator.profiler.profile import _solve

    return {kind: [float(c) for c in _solve(points, [sum(n for n, saved, is16 in held[p]
                                                         if saved == want and (is16 or not only_16bit))
                                                     for p in points])]
            for kind, want in (("dropped", False), ("saved", True))}


def _raised_prefix(segments: dict, held: list[float]) -> dict:
    prefix = segments["prefix"]
    raised = {"net_act": [a + h for a, h in zip(prefix["net_act"], held)], "net_grad": prefix["net_grad"],
              "candidates": [(list(held), 0.0)]  # the step's start: the previous outputs alone
              + [([a + h for a, h in zip(act, held)], grad) for act, grad in prefix["candidates"]]}
    return {**segments, "prefix": raised}


def variant_training(profile: dict) -> TrainingSpec:
    variant = profile["variant"]
    return TrainingSpec(precision=variant["precision"], attn=variant["attn"], grad_ckpt=variant["grad_ckpt"],
                        lora_rank=variant["lora_rank"], lora_targets=variant["lora_targets"],
                        qlora=variant.get("qlora", False), batch=variant.get("batch", "full"),
                        lora_dropout=variant.get("lora_dropout", 0.0), lora_dtype=variant.get("lora_dtype", "auto"),
                        qlora_prep=variant.get("qlora_prep", "auto"),
                        qlora_quantizer=variant.get("qlora_quantizer", "transformers"),
                        qlora_bnb=variant.get("qlora_bnb", ""),
                        use_cache=variant.get("use_cache", False),
                        # traced under accelerate's autocast over 16-bit weights (TrainingSpec.forward_autocast)
                        outputs_fp32=bool(variant.get("forward_autocast"))
                        and not variant["precision"].startswith("amp_"))


def backfill_order(profile: dict, config: dict) -> None:
    """Add ``params.layers_at`` and (single-rank profiles) ``params.grad_order`` to a profile that lacks them,
    from the shrunken model on fake tensors and one untraced training step (seconds)."""
    from estimator.profiler.profile import PROFILE_LAYERS, _Model, grad_hook_order, param_table

    training = variant_training(profile)
    model = _Model(config, training, PROFILE_LAYERS)
    table_model = model.base if not training.lora else model.model
    profile["params"]["layers_at"] = param_table(table_model, model.layers, PROFILE_LAYERS)["layers_at"]
    if not profile.get("tp"):
        profile["params"]["grad_order"] = grad_hook_order(model.model, table_model, model.layers, model.warm_step)


def backfill_tp_grad_order(path: Path) -> bool:
    """TP profiles traced before they recorded ``params.grad_order``: take the single-rank sibling's (the same
    variant without ``_tpN``). Splitting the linears adds collectives to the graph but does not reorder when
    backward finishes each parameter (fresh tiny-Llama traces agree, ``tests/estimator/test_reserved_fsdp.py``).
    FSDP2 over a TP model (dp_tp) keeps each group's last gradient longest. True if changed."""
    profile = json.loads(path.read_text())
    if not profile.get("tp") or "grad_order" in profile["params"]:
        return False
    sibling = path.with_name(path.name.replace(f"_tp{profile['tp']}.json", ".json"))
    if sibling == path or not sibling.exists():
        return False
    order = json.loads(sibling.read_text())["params"].get("grad_order")
    names = {(None, row["name"]) for row in profile["params"]["non_layer"] if row.get("trainable", True)}
    names |= {(0, row["name"]) for row in profile["params"]["per_layer"] if row.get("trainable", True)}
    if order is None or not {(layer if layer is None else 0, name) for layer, name in order} <= names:
        return False
    profile["params"]["grad_order"] = order
    profile.setdefault("provenance", {})["grad_order"] = f"from {sibling.name} (single-rank trace, same variant)"
    save_profile(path.stem, profile, path.parent)
    return True


def backfill_buffers(path: Path) -> bool:
    """Profiles shipped before module buffers were recorded lack ``params.buffers``: add them from a meta-device
    build of the same shrunken model (buffers are created at construction; no trace needed). True if changed."""
    from estimator.profiler import build
    from estimator.profiler.profile import PROFILE_LAYERS, param_table
    from estimator.profiler.trace import decoder_layers

    profile = json.loads(path.read_text())
    if "buffers" in profile["params"]:
        return False
    training = variant_training(profile)
    model = build.build_model(resolve_arch(profile["model"]).config, training, num_layers=PROFILE_LAYERS, meta=True)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    table = param_table(base, decoder_layers(base, PROFILE_LAYERS), PROFILE_LAYERS)
    profile["params"]["buffers"] = table["buffers"]
    save_profile(path.stem, profile, path.parent)
    return True
