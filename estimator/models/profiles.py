"""Architecture profiles: shipped for the catalogue, cached per user for anything else.

A profile is keyed by the config's fingerprint (layer count excluded) and the training variant that changes
which tensors exist (precision, attention, checkpointing, LoRA). Loading is pure JSON; building one imports
torch (``estimator.profiler``) and is done once per key.
"""

from __future__ import annotations

import functools
import json
import os
from importlib import resources
from pathlib import Path

from estimator.spec import TrainingSpec, model_code_release

# 2: SDPA traced without the 4-D mask transformers skips for full-length batches on the GPU.
# 3: the parameter table records the decoder layers' place in model.parameters() (``layers_at``) and the order
#    backward finishes the gradients (``grad_order``), which DeepSpeed ZeRO-1/2's partitions and buckets follow.
# (each regime may also hold ``events``, the step's compact event list for the reserved replay: optional, so
#    profiles without it stay valid at their schema and keep the reserved prior.)
# 4: each regime also holds ``segments_manual`` (the step as a manual loop runs it, the output object bound until
#    the next forward) and ``outputs_held`` (that object's storages besides the loss: dropped / saved by the graph).
# 5: traced with the kernels CUDA runs (``estimator.profiler.cuda_path``: dropout's bool mask, SDPA's CUDA backend),
#    not the CPU's; sequence lengths sampled at multiples of 32.
# 6: each regime also holds ``outputs_held_16bit``: the part of ``outputs_held`` held by 16-bit float tensors
#    (what accelerate's mixed-precision forward wrapper copies to fp32: ``TrainingSpec.outputs_fp32``).
PROFILE_SCHEMA_VERSION = 6
# The rule a profile's segment summaries follow (``summary_rule``, beside the schema; no field: before rule 1).
# 1: a gradient's hook moment (DeepSpeed ZeRO's reduce) after the node's releases (``summary._hook_moments``).
# A profile at the current rule loads as stored; an older one is summarised again from its events at every load
# (``estimator.profiler.cache``; 1.10 s of a cold opt-125m plan's 3.52 s under cProfile, 7 profiles): ``python -m
# estimator.profiler.ship --resummarise`` brings stored profiles to the current rule in place.
SUMMARY_RULE = 1
MONOMIALS = ("1", "s", "s^2", "b", "b*s", "b*s^2")


def variant_key(training: TrainingSpec, adapters_16bit: bool = False, input_grads: bool = False) -> str:
    """``adapters_16bit``: LoRA adapters in the model's 16-bit dtype (DeepSpeed casts every parameter to its
    mixed-precision dtype; peft alone keeps them fp32): peft then feeds them the 16-bit inputs instead of fp32
    copies (key suffix ``-a16``). ``input_grads``: a LoRA model without checkpointing traced with peft's input
    hook all the same (``estimator.profiler.build.embedding_output_grads``; key suffix ``-ig``)."""
    # flash attention has the memory shape of the SDPA flash kernel (output + logsumexp, no S×S matrix), but for
    # peft's QLoRA, whose attention inputs are fp32: FlashAttention-2 casts them to 16 bits, SDPA runs fp32 kernels.
    # (QLoRA without kbit preparation, ``-a16``, keeps them bf16, as LoRA does.)
    attn = "sdpa" if training.attn == "flash" and not training.qlora_kbit_prep else training.attn
    lora = f"{'qlora' if training.qlora else 'lora'}{training.lora_rank}-{training.lora_targets}" if training.lora \
        else "full"
    if training.lora_dropout:  # the masks exist whatever the probability: one profile for every p > 0
        lora += "-dropout"
    if adapters_16bit:
        lora += "-a16"
    elif training.qlora and not training.qlora_kbit_prep:  # no kbit preparation, fp32 adapters (qlora_prep none)
        lora += "-noprep"
    if training.qlora_quantizer == "lightning":  # every Linear incl. the head 4-bit, quantized from fp16
        lora += "-lightning"
    if training.qlora_keeps_inputs:  # bitsandbytes < 0.43.2's MatMul4Bit (estimator.profiler.bnb_041)
        lora += "-keepin"
    if input_grads and training.lora:
        lora += "-ig"
    # Padding changes only SDPA's trace: eager attention builds the 4-D mask for full-length batches too, and
    # FlashAttention-2 unpads the batch instead of masking it.
    padded = "_padded" if training.batch == "padded" and training.attn == "sdpa" else ""
    # Traced under autocast with CUDA's op lists (``estimator.profiler.cuda_path.cuda_autocast_lists``); amp_*
    # profiles traced before with CPU autocast's lists keep their old key and are not found.
    autocast = "_autocast" if training.forward_autocast else ""
    # Traced with the model's key/value cache on (``TrainingSpec.use_cache``); profiles without it keep their key.
    cache = "_kvcache" if training.use_cache else ""
    return (f"{training.precision}_{attn}_{_ckpt_token(training)}_{lora}{padded}{autocast}"
            f"{cache}{long_context_suffix(training)}")


def _ckpt_token(training: TrainingSpec) -> str:
    if not training.grad_ckpt:
        return "nockpt"
    if training.ckpt_policy == "selective-ops":
        return "sacops"
    if training.ckpt_policy:  # every-k is replayed from the ckpt and nockpt profiles (estimator.methods.layer_mix)
        raise ValueError(f"ckpt_policy: {training.ckpt_policy} has no profile of its own")
    return "ckpt"


def long_context_suffix(training: TrainingSpec) -> str:
    """The key suffix of a profile traced with a long-context technique: the loss (``ce``), activation offload."""
    ce = {"standard": "", "chunked": f"_ce-chunked{training.ce_chunks}", "fused_linear": "_ce-fused"}[training.ce]
    return ce + ("_offload" if training.activation_offload else "")


def profile_key(config_sha: str, training: TrainingSpec, tp: int = 1, adapters_16bit: bool = False,
                input_grads: bool = False) -> str:
    """``<config sha>_<variant>``, plus ``_tp<N>`` for the profile of one rank of an N-way tensor-parallel model and
    ``_tf<major.minor>`` for one traced with the model code of that transformers release (``model_code``)."""
    release = model_code_release(training.model_code) if training.model_code else None
    return (f"{config_sha}_{variant_key(training, adapters_16bit, input_grads)}" + (f"_tp{tp}" if tp > 1 else "")
            + (f"_tf{release}" if release else ""))


def adapters_in_16bit(training: TrainingSpec, method: str, lora_wrap: str = "adapter") -> bool:
    """Whether a run's LoRA adapters are 16-bit: DeepSpeed casts the whole model to its mixed-precision dtype,
    adapters included (``engine._cast_module_mixed_precision``); elsewhere peft keeps them fp32
    (``autocast_adapter_dtype``). QLoRA's adapters stay as prepared; fp32 runs have nothing to cast. ZeRO-3
    builds the model under ``zero.Init`` (as the Hugging Face Trainer does), and DeepSpeed skips the cast for a
    zero-init model: its adapters stay fp32 (docs/error_matrix/README.md Finding 14). FSDP2 under mixed precision
    (``MixedPrecisionPolicy(param_dtype=...)``) all-gathers every floating parameter, the fp32 adapters included,
    in ``param_dtype`` (``FSDPParam.init_dtype_attrs``): peft's forward (``_cast_input_dtype(x,
    lora_A.weight.dtype)``) then makes no fp32 copy of the adapter inputs (benchmarks/fsdp_lora_mixed_check.py).
    dp_tp is FSDP2 over its dp dimension with the same policy: the same holds (``--method dp_tp`` of that check).
    tp alone keeps peft's fp32 adapters, as single and ddp do: no all-gather casts them (checked the same way).
    FSDP1 with the adapters inside their decoder layer's unit (``lora_wrap`` "layer") flattens them with the
    layer's weights, one dtype per flat parameter: a bf16 run built its adapters in bf16 (Lightning's
    ``bf16-true`` builds the whole model in it). ``lora_dtype`` "model": built in the model's dtype whatever the
    method (Lightning's ``bf16-true``, ``autocast_adapter_dtype=False``): 16-bit in a pure bf16 run (amp_* and
    mixed_* keep fp32 weights, so adapters in the model's dtype are fp32 there). QLoRA with ``lora_dtype`` "model"
    (no kbit preparation, pure bf16 only) builds them in bf16: its profile key is the QLoRA key with ``-a16``."""
    if not training.lora or training.qlora_kbit_prep:
        return False
    if training.qlora:  # without kbit preparation: bf16 adapters with lora_dtype model, fp32 with qlora_prep none
        return training.lora_dtype == "model"
    if training.lora_dtype == "model":
        return training.precision == "bf16"
    if method == "fsdp1" and lora_wrap == "layer":
        return training.precision == "bf16"
    if method in ("zero1", "zero2"):
        return training.precision in ("mixed_bf16", "mixed_fp16", "bf16")
    return method in ("fsdp", "dp_tp") and training.precision in ("mixed_bf16", "mixed_fp16")


def run_adapters_in_16bit(spec) -> bool:
    """``adapters_in_16bit`` of a whole run spec (its method and FSDP1's adapter wrap)."""
    return adapters_in_16bit(spec.training, spec.parallel.method, spec.parallel.fsdp1.lora_wrap)


def user_cache_dir() -> Path:
    root = os.environ.get("LLMEM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llm-memory-estimator")
    return Path(root) / "profiles"


def _shipped_path(key: str):
    return resources.files("estimator") / "profiles" / f"{key}.json"


@functools.lru_cache(maxsize=512)
def _read(path: str) -> dict:
    return json.loads(Path(path).read_text())


def summaries_current(profile: dict) -> bool:
    """The profile's segment summaries follow today's rule (``SUMMARY_RULE``): no re-summary at load."""
    return profile.get("summary_rule") == SUMMARY_RULE


def has_events(profile: dict) -> bool:
    """Every regime keeps its event list (``estimator.profiler.events``: the reserved replay's input)."""
    return all("events" in regime for regime in profile["regimes"])


def find_profile(key: str, *, stale: bool = False) -> dict | None:
    """The shipped or cached profile at this schema; ``stale``: a cached one of an older schema instead. A cached
    profile with event lists is taken over a shipped one without (``python -m estimator.profiler.ship --events
    --out $LLMEM_CACHE_DIR/profiles`` re-traces shipped models into the cache)."""
    shipped = _shipped_path(key)
    cached = user_cache_dir() / f"{key}.json"
    if shipped.is_file() and not stale:
        profile = _read(str(shipped))
        if has_events(profile) or not cached.is_file():
            return profile
        newer = _read(str(cached))
        return newer if newer.get("schema_version") == PROFILE_SCHEMA_VERSION and has_events(newer) else profile
    if cached.is_file():
        profile = _read(str(cached))
        if (profile.get("schema_version") == PROFILE_SCHEMA_VERSION) != stale:  # older ones are carried or rebuilt
            return profile
    return None


def save_profile(key: str, profile: dict, directory: Path | None = None) -> Path:
    directory = directory or user_cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{key}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(profile, separators=(",", ":")))
    os.replace(tmp, path)
    _read.cache_clear()  # a memoized older copy at this path would hide the new one
    return path


def _major_minor(version: str | None) -> tuple[int, ...]:
    parts = []
    for part in (version or "").split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


@functools.cache
def installed_version(package: str) -> str | None:
    """The installed release of ``package`` from its metadata (nothing imported); None when absent. Read once per
    process: every estimate's notes ask, and a plan makes a hundred estimates (1.5 ms each uncached)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def traced_release(profile: dict) -> str | None:
    """The transformers release (major.minor) a profile was traced with; None when it does not record one."""
    traced = profile.get("provenance", {}).get("transformers")
    return model_code_release(traced) if traced else None


def versions_note(profile: dict, installed_transformers: str | None = None, model_code: str = "") -> str:
    """Which model code the estimate describes: the transformers and torch releases the profile was traced with,
    and a warning when the transformers installed here (or ``installed_transformers``) is an older release or
    another major one, whose model code may allocate differently (releases before 4.46 upcast the logits inside
    ``forward`` and kept them in the output; GPTBigCode before 4.49 took the loss of 16-bit logits without an
    upcast). A newer minor release is only named: it is what a fresh install traces next. ``model_code``: the
    release the spec asked for (``TrainingSpec.model_code``), compared instead of the installed one."""
    traced = profile.get("provenance", {})
    transformers, torch = traced.get("transformers"), traced.get("torch")
    if not transformers:
        return "model code: the profile does not record the transformers release it was traced with"
    note = f"model code: traced with transformers {transformers}" + (f", torch {torch}" if torch else "")
    if model_code:
        if traced_release(profile) == model_code_release(model_code):
            return note + f" (the model code of transformers {model_code_release(model_code)}, as asked)"
        return note + (f"; no profile of transformers {model_code_release(model_code)}'s model code for this model "
                       "and variant is shipped or cached, and tracing one needs that release installed "
                       f"(pip install 'transformers=={model_code_release(model_code)}.*'): the estimate is for "
                       f"{transformers}")
    mine = installed_transformers or installed_version("transformers")
    theirs, ours = _major_minor(mine), _major_minor(transformers)
    if mine and theirs and ours and (theirs < ours or theirs[0] != ours[0]):
        note += (f"; transformers {mine} here is another release, whose model code may allocate differently "
                 "(the estimate is for the traced one)")
    return note
