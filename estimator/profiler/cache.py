"""A model's profile for the estimator: shipped or cached (pure JSON, ``estimator.models.profiles``), else worked
out now with torch, once (``estimator.profiler.profile``), or an older cached one carried over
(``estimator.profiler.carry``). Importing this module imports no torch: only building does."""

from __future__ import annotations

import functools
import json
from dataclasses import replace

from estimator.models.arch import ModelArch, cached_arch, spec_arch
from estimator.models.profiles import (
    find_profile,
    has_events,
    installed_version,
    profile_key,
    save_profile,
    summaries_current,
    traced_release,
)
from estimator.spec import TrainingSpec, model_code_release


def _installed_release() -> str | None:
    installed = installed_version("transformers")
    return model_code_release(installed) if installed else None


def get_profile(config: dict, config_sha: str, training: TrainingSpec, *, allow_build: bool = True,
                tp: int = 1, adapters_16bit: bool = False, input_grads: bool = False) -> dict:
    """The cached profile, or one built now (torch + transformers, seconds) and cached. ``tp > 1``: the profile
    of one rank of the ``tp``-way tensor-parallel model (its own key); ``adapters_16bit``: LoRA adapters in the
    model's 16-bit dtype (``estimator.models.profiles.adapters_in_16bit``); ``input_grads``: a plain LoRA model
    traced with peft's input hook (``estimator.profiler.build.embedding_output_grads``)."""
    training = replace(training, vocab_size=0)  # profiles are the configured model's (``load_model_profile``)
    key = profile_key(config_sha, training, tp, adapters_16bit, input_grads)
    found = find_profile(key)
    if found is not None:
        return found
    if training.model_code and not (allow_build and _installed_release() == model_code_release(training.model_code)):
        # That release's model code cannot be traced here: the default profile stands in (its note says so).
        return get_profile(config, config_sha, replace(training, model_code=""), allow_build=allow_build, tp=tp,
                           adapters_16bit=adapters_16bit, input_grads=input_grads)
    if not allow_build:
        raise ValueError(f"model: no cached profile for this architecture and variant ({key}); "
                         "profiling it needs torch and transformers (pip install '.[profile]')")
    try:
        from estimator.profiler.profile import build_profile

        if training.lora:
            import peft  # noqa: F401
        if training.qlora:
            import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise ValueError(f"model: this architecture/variant has not been profiled yet and profiling needs "
                         f"torch + transformers (+ peft for LoRA, bitsandbytes for QLoRA; {err.name} missing): "
                         "pip install '.[profile]'") from None
    from estimator.profiler.build import embedding_output_grads, lora_adapters_16bit

    with lora_adapters_16bit(adapters_16bit), embedding_output_grads(input_grads):
        stale = find_profile(key, stale=True)
        if stale is not None and has_events(stale):  # without its event list, re-trace: the replay needs it
            from estimator.profiler.carry import carry_over

            stale = json.loads(json.dumps(stale))  # _read's cached object stays as read
            if carry_over(stale, config):  # seconds instead of a full trace
                save_profile(key, stale)
                return stale
        profile = build_profile(config, training, tp=tp) if tp > 1 else build_profile(config, training)
    save_profile(key, profile)
    return profile


def load_model_profile(model: str, training: TrainingSpec, tp: int = 1, *, allow_build: bool = True,
                       adapters_16bit: bool = False, input_grads: bool = False) -> tuple[ModelArch, dict]:
    """The architecture and its profile; ``tp > 1``: the profile of one rank of the ``tp``-way TP model (local
    shards in its parameter table, replicated parts and full logits in its activations). A resized vocabulary
    (``training.vocab_size``): the profile of the model as configured, re-sized (``estimator.profiler.vocab``)."""
    arch = cached_arch(model)
    resized = training.vocab_size and training.vocab_size != arch.vocab_size
    configured = replace(training, vocab_size=0)
    profile = get_profile(arch.config, arch.config_sha, configured, allow_build=allow_build, tp=tp,
                          adapters_16bit=adapters_16bit, input_grads=input_grads)
    profile = with_layer_kinds_at_depth(_with_hook_moments(profile), arch, configured, allow_build=allow_build)
    if not resized:
        return arch, profile
    return spec_arch(model, training.vocab_size), _resized_vocab(profile, arch.vocab_size, training.vocab_size)


# id of a loaded profile -> (that profile, kept so its id stays its own; its copy with today's hook moments)
_HOOKED: dict[int, tuple[dict, dict]] = {}


def _with_hook_moments(profile: dict) -> dict:
    """``estimator.profiler.vocab.with_hook_moments`` once per loaded profile summarised by an older rule for
    gradients' hook moments (no ``summary_rule``: a user's cached or carried-over profile), summarised again from
    its events. A profile at today's rule (traced since, or ``ship --resummarise``d, as the shipped ones are) is
    taken as it is."""
    if summaries_current(profile) or not any("events" in regime for regime in profile.get("regimes", ())):
        return profile
    from estimator.profiler.vocab import with_hook_moments

    key = id(profile)
    if key not in _HOOKED or _HOOKED[key][0] is not profile:
        _HOOKED[key] = (profile, with_hook_moments(profile))
    return _HOOKED[key][1]


# (id of the configured profile, rows) -> (that profile, kept so its id stays its own; the re-sized copy)
_RESIZED: dict[tuple[int, int], tuple[dict, dict]] = {}


def _resized_vocab(profile: dict, old_vocab: int, new_vocab: int) -> dict:
    """``estimator.profiler.vocab.resize_vocab`` once per profile and row count (a plan asks for many shapes)."""
    from estimator.profiler.vocab import resize_vocab

    key = (id(profile), new_vocab)
    if key not in _RESIZED:
        _RESIZED[key] = (profile, resize_vocab(profile, old_vocab, new_vocab))
    return _RESIZED[key][1]


def load_plain_and_checkpointed(model: str, training: TrainingSpec, tp: int = 1, *, allow_build: bool = True,
                                adapters_16bit: bool = False) -> tuple[ModelArch, dict, dict]:
    """(arch, plain profile, checkpointed profile) for every-k checkpointing, both traced with one model code.
    Each profile falls back on its own to the default one when the spec's release (``model_code``) was not traced
    for it; a pair of two releases' code is not one run's step (transformers moves where a small tensor of the
    decoder's prologue is freed between releases, so the two prefixes differ), so then both are the default's.

    Where the checkpointed profile has layers before the first adapter (``frozen_layers``), the plain one is traced
    with peft's input hook: with checkpointing on, get_peft_model makes the embedding output need a gradient,
    so the layers every-k leaves unchecked there keep what autograd saves and get a backward (a plain run without
    the hook runs them forward only; docs/error_matrix/README.md, helper moek)."""
    def load(spec: TrainingSpec, input_grads: bool = False) -> tuple[ModelArch, dict]:
        return load_model_profile(model, spec, tp, allow_build=allow_build, adapters_16bit=adapters_16bit,
                                  input_grads=input_grads)

    def pair(full: TrainingSpec) -> tuple[ModelArch, dict, dict]:
        arch, ckpt = load(full)
        _, plain = load(replace(full, grad_ckpt=False), bool(ckpt["params"].get("frozen_layers")))
        return arch, plain, ckpt

    full = replace(training, ckpt_policy="")
    arch, plain, ckpt = pair(full)
    if training.model_code and traced_release(plain) != traced_release(ckpt):
        arch, plain, ckpt = pair(replace(full, model_code=""))
    return arch, plain, ckpt


def with_layer_kinds_at_depth(profile: dict, arch: ModelArch, training: TrainingSpec, *,
                              allow_build: bool = True) -> dict:
    """The profile with its layer kinds for ``arch``'s depth. One profile serves every depth of an architecture
    (``config_fingerprint`` leaves the depth out), but which layers are dense and which hold experts was recorded
    for the depth traced first. transformers picks each layer's kind from its index (``first_k_dense_replace``,
    ``mlp_only_layers``, ``decoder_sparse_step``, ``moe_layer_freq``), so a shallower model's kinds are the first
    layers' kinds; a deeper one's are read off a meta-device build (torch, once per process)."""
    kinds = profile["params"].get("layer_kinds")
    if not kinds or len(kinds["of_layer"]) == arch.num_layers:
        return profile
    if arch.num_layers < len(kinds["of_layer"]):
        of_layer = kinds["of_layer"][:arch.num_layers]
        kinds = {"rows": kinds["rows"], "of_layer": of_layer}
    elif not allow_build:
        raise ValueError(f"model: which of its {arch.num_layers} layers hold experts was recorded for "
                         f"{len(kinds['of_layer'])} layers only; reading it off the model needs torch and "
                         "transformers (pip install '.[profile]')")
    else:
        kinds = _deeper_layer_kinds(json.dumps(arch.config, sort_keys=True), training)
    return {**profile, "params": {**profile["params"], "layer_kinds": kinds}}


@functools.lru_cache(maxsize=16)
def _deeper_layer_kinds(config_json: str, training: TrainingSpec) -> dict:
    from estimator.profiler.profile import full_depth_layer_kinds

    return full_depth_layer_kinds(json.loads(config_json), training)
