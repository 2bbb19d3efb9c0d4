"""Build, wrap-free, the model/optimizer/step exactly as every torch consumer trains it.

The profiler, the CPU fake-tensor oracle and the harness worker all call these functions, so what the estimator
profiles is what the harness measures. torch and transformers are imported here (never on the predict path).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from estimator.spec import TrainingSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
NF4 = {"quant_type": "nf4", "compress_statistics": True}  # QLoRA's 4-bit format: NF4, double quantization


def param_dtype(precision: str) -> torch.dtype:
    """dtype the model's weights are stored in on the GPU."""
    if precision in ("bf16", "mixed_bf16"):
        return torch.bfloat16
    if precision == "mixed_fp16":
        return torch.float16
    return torch.float32  # fp32 and amp_* keep fp32 weights


def autocast_dtype(training: TrainingSpec) -> torch.dtype | None:
    """The forward's autocast dtype (``TrainingSpec.forward_autocast``), or None."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(training.forward_autocast or "")


def with_num_layers(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Copy of an HF config dict with its decoder depth changed (per-layer type lists truncated too)."""
    config = copy.deepcopy(config)
    for key in _LAYER_KEYS:
        if key in config:
            config[key] = num_layers
    if not any(key in config for key in _LAYER_KEYS):
        config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = (config["layer_types"] * num_layers)[:num_layers]
    if "max_window_layers" in config:
        config["max_window_layers"] = min(config["max_window_layers"], num_layers)
    if config.get("model_type") == "gpt_neo":  # attention_types must expand to exactly num_layers
        pattern = [t for block, repeat in config.get("attention_types", [[["global"], 1]]) for t in block * repeat]
        config["attention_types"] = [[(pattern * num_layers)[:num_layers], 1]]
    return config


def hf_config(config: dict[str, Any], training: TrainingSpec):
    from transformers import AutoConfig

    # a deep copy: transformers rewrites nested settings in place (rope_scaling's "type" -> "rope_type"), and the
    # caller's dict is the architecture's, whose fingerprint keys the profile
    config = {k: copy.deepcopy(v) for k, v in config.items() if k not in ("_name_or_path", "transformers_version")}
    model_type = config.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **config)
    cfg.use_cache = training.use_cache  # as the run leaves it (TrainingSpec.use_cache); the model code decides the rest
    return cfg


def attn_implementation(attn: str, device: torch.device | str, precision: str | None = None) -> str:
    """'flash' means FlashAttention-2 where it is installed on CUDA and the attention computes in 16 bits; else the
    SDPA kernel (same memory shape). ``fp32`` (no autocast) would reach flash-attn with fp32 q/k/v, which it
    refuses at the first forward ("FlashAttention only support fp16 and bf16 data type")."""
    if attn != "flash":
        return attn
    if torch.device(device).type == "cuda" and precision != "fp32":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def build_model(config: dict[str, Any], training: TrainingSpec, device: torch.device | str = "cpu", *,
                num_layers: int | None = None, meta: bool = False) -> torch.nn.Module:
    """Randomly initialised causal LM from a config dict, in the spec's precision, checkpointing and LoRA."""
    if num_layers is not None:
        config = with_num_layers(config, num_layers)
    config = with_vocab_size(config, training.vocab_size)
    cfg = hf_config(config, training)
    dtype = param_dtype(training.precision)
    target = torch.device("meta") if meta else torch.device(device)
    requested = attn_implementation(training.attn, device, training.precision)
    with target:
        model = _from_config(cfg, dtype, requested)
    model.config.use_cache = training.use_cache
    if training.grad_ckpt:  # a meta build is a profile's trace: non-reentrant whatever the spec says
        enable_grad_ckpt(model, training, reentrant=training.ckpt_reentrant and not meta)
    if training.ce != "standard":  # torchtune's / Liger's loss in place of the head's: wrappers still see a call
        from estimator.profiler.techniques import install_loss

        install_loss(model, training)
    if training.qlora:
        model = prepare_qlora_base(model, param_dtype(training.precision), kbit_prep=training.qlora_kbit_prep,
                                   quantizer=training.qlora_quantizer, keeps_inputs=training.qlora_keeps_inputs)
        if not meta:
            quantize_4bit_weights(model, target)
    if training.lora:
        model = apply_lora(model, training)
        if _INPUT_GRADS[0] and not training.grad_ckpt:
            # what peft's ``_prepare_model_for_gradient_checkpointing`` does to a model with checkpointing on
            # (get_peft_model only hooks it then): the embedding output needs a gradient, so autograd records
            # every decoder layer, a layer without adapters too (``embedding_output_grads``)
            model.get_base_model().enable_input_require_grads()
    model.train()
    return model


def with_vocab_size(config: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """``config`` as ``model.resize_token_embeddings(vocab_size)`` leaves it (0: unchanged). transformers writes the
    new row count into ``config.vocab_size`` and re-ties the head, so building from the resized config gives the same
    parameters; it also matches where the training scripts resize: on the host, before the model moves to the GPU
    (fms-hf-tuning loads on the CPU and resizes there), so no old-and-new embedding pair passes through the GPU."""
    if not vocab_size or config.get("vocab_size") == vocab_size:
        return config
    return {**config, "vocab_size": vocab_size}


def enable_grad_ckpt(model: torch.nn.Module, training: TrainingSpec, reentrant: bool = False) -> None:
    """transformers' per-decoder-layer checkpointing (non-reentrant unless ``reentrant``; the spec's
    ``ckpt_policy``): each layer's ``forward`` runs under ``torch.utils.checkpoint``, its module hooks (FSDP2's)
    outside it."""
    from estimator.profiler.techniques import apply_layer_policy, checkpoint_kwargs
    from estimator.profiler.trace import decoder_layers

    kwargs = checkpoint_kwargs(training, reentrant)  # selective-ops adds torchtitan's op policy
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if training.ckpt_policy:
        apply_layer_policy(decoder_layers(model, model.config.num_hidden_layers), training)


_ATTN_FALLBACK = {"flash_attention_2": "sdpa", "sdpa": "eager"}


def _from_config(cfg, dtype: torch.dtype, attn: str) -> torch.nn.Module:
    """``from_config`` with the attention kernel the architecture has: HF refuses one it lacks with a ValueError
    (BLOOM and CodeGen have neither FlashAttention-2 nor SDPA), so fall back flash -> sdpa -> eager, as a CPU build
    of the same spec ends up (there 'flash' already means sdpa)."""
    from transformers import AutoModelForCausalLM

    dtype_kw = "dtype" if transformers_release() >= (4, 56) else "torch_dtype"  # the keyword's name before 4.56
    while True:
        try:
            return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, **{dtype_kw: dtype})
        except ValueError as err:
            text = str(err)
            if attn not in _ATTN_FALLBACK or ("attention implementation" not in text and "Flash Attention" not in text):
                raise
            attn = _ATTN_FALLBACK[attn]


def prepare_qlora_base(model: torch.nn.Module, compute_dtype: torch.dtype, kbit_prep: bool = True,
                       quantizer: str = "transformers", keeps_inputs: bool = False) -> torch.nn.Module:
    """The QLoRA recipe on a randomly initialised model, as ``from_pretrained(quantization_config=
    BitsAndBytesConfig(load_in_4bit, nf4, double quant, compute_dtype))`` then ``peft.prepare_model_for_kbit_training``
    (what TRL's SFTTrainer and the QLoRA reference code run) would leave it: every ``nn.Linear`` but the output
    head (and anything tied to the embeddings) becomes a bitsandbytes ``Linear4bit`` holding its weight unquantized
    until ``quantize_4bit_weights``; every other 16-bit parameter is cast to fp32. Gradient checkpointing stays as
    ``build_model`` set it (non-reentrant: peft's input-grad hook is not needed). ``kbit_prep`` False: the recipe
    without ``prepare_model_for_kbit_training`` (answer.ai fsdp_qlora's train.py, ``TrainingSpec.lora_dtype``
    "model"): the other parameters stay in the model's dtype. ``quantizer`` "lightning": Lightning's
    ``BitsandbytesPrecision("nf4-dq")`` (71aed751 ``fabric/plugins/precision/bitsandbytes.py``, LitGPT's QLoRA)
    replaces the class ``torch.nn.Linear`` at init, so the output head is 4-bit too (a head tied to the embedding
    stays as it is: the embedding is no Linear), and ``_quantize_weight`` quantizes ``weight.to(torch.half)``: each
    matmul dequantizes to fp16, then casts to the input's dtype. ``keeps_inputs``: bitsandbytes < 0.43.2's
    ``MatMul4Bit`` (``estimator.profiler.bnb_041``)."""
    import bitsandbytes as bnb
    from peft import prepare_model_for_kbit_training

    linear = bnb.nn.Linear4bit
    if keeps_inputs:
        from estimator.profiler.bnb_041 import Linear4bitKeepsInput as linear
    lightning = quantizer == "lightning"
    quant_dtype = torch.float16 if lightning else compute_dtype
    keep = set() if lightning else {name for name, module in model.named_modules()
                                    if module is model.get_output_embeddings()}
    tied = {id(p) for p in model.get_input_embeddings().parameters()}
    for name, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear or name in keep or id(module.weight) in tied:
            continue
        quantized = linear(module.in_features, module.out_features, bias=module.bias is not None,
                           compute_dtype=compute_dtype, device=module.weight.device, **NF4)
        # ``module``: quantizing also sets ``quantized.quant_state``, from which bitsandbytes restores the weight's
        # state once FSDP1 has swapped the weight for a view of its flat parameter (fsdp_qlora builds it so; the
        # keyword exists from bitsandbytes 0.43)
        owner = {"module": quantized} if "module" in inspect.signature(bnb.nn.Params4bit.__new__).parameters else {}
        quantized.weight = bnb.nn.Params4bit(module.weight.data.to(quant_dtype), requires_grad=False, **owner,
                                             **NF4)
        if module.bias is not None:
            quantized.bias = module.bias
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, quantized)
    model.is_loaded_in_4bit = True
    if not kbit_prep:
        return model
    with warnings.catch_warnings():  # peft's fp32 cast may warn about the allocator cache on CPU: harmless
        warnings.simplefilter("ignore")
        return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def quantize_4bit_weights(model: torch.nn.Module, device: torch.device | str) -> None:
    """Quantize every ``Linear4bit`` weight still in 16 bits, as bitsandbytes does on the move to a device (the
    16-bit copy is freed). On fake tensors (the profiler, the CPU oracle) ``Params4bit`` cannot wrap a FakeTensor
    and quantizing reads values: the weight becomes a frozen parameter of the packed shape carrying a
    ``quant_state`` of the real layout (``fake_quantized``), which ``Linear4bit.forward`` uses as it is."""
    import bitsandbytes as bnb
    from torch._subclasses.fake_tensor import FakeTensor

    for module in model.modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        weight = module.weight
        if isinstance(weight, FakeTensor):
            if getattr(weight, "quant_state", None) is None:
                module.weight = fake_quantized(weight)
        elif not weight.bnb_quantized:
            module.weight = weight.to(device)


def fake_quantized(weight: torch.Tensor) -> torch.nn.Parameter:
    """A fake NF4 (double-quantized) weight: bitsandbytes' own ``quantize_4bit`` run on a meta tensor of the
    weight's shape gives every tensor of the layout; each becomes an uninitialised fake tensor."""
    import bitsandbytes as bnb
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        packed, state = bnb.functional.quantize_4bit(torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                                                     **NF4)

    def fake(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device=weight.device)
    state.absmax, state.code, state.offset = fake(state.absmax), fake(state.code), fake(state.offset)
    state.state2.absmax, state.state2.code = fake(state.state2.absmax), fake(state.state2.code)
    out = torch.nn.Parameter(fake(packed), requires_grad=False)
    out.quant_state = state
    return out


def effective_attn(model: torch.nn.Module) -> str:
    """The attention kernel family the built model really uses (eager / sdpa / flash)."""
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    return "flash" if impl.startswith("flash") else impl


def materialize_fake(model: torch.nn.Module) -> torch.nn.Module:
    """Turn a meta-device model into fake CPU tensors (call inside FakeTensorMode) and re-tie embeddings."""
    model.to_empty(device="cpu")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.tie_weights()
    if getattr(base, "is_loaded_in_4bit", False):
        quantize_4bit_weights(model, "cpu")
    return model


def lora_target_modules(model: torch.nn.Module, targets: str) -> list[str] | str:
    if targets == "all-linear":
        return "all-linear"
    if targets != "auto":
        return [t.strip() for t in targets.split(",") if t.strip()]
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as mapping

    found = mapping.get(model.config.model_type)
    if found:
        return list(found)
    # peft has no default for this family: attention query/value projections when named the usual way.
    leaf_names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    return ["q_proj", "v_proj"] if {"q_proj", "v_proj"} <= leaf_names else "all-linear"


_ADAPTERS_16BIT = [False]
_INPUT_GRADS = [False]


@contextlib.contextmanager
def embedding_output_grads(on: bool) -> Iterator[None]:
    """LoRA models built inside without checkpointing get peft's input hook all the same (the embedding output
    needs a gradient), as a run with checkpointing on has it in the layers every-k leaves unchecked: the plain
    profile every-k mixes with the checkpointed one where layers before the first adapter run
    (``estimator.profiler.cache.load_plain_and_checkpointed``)."""
    before, _INPUT_GRADS[0] = _INPUT_GRADS[0], on
    try:
        yield
    finally:
        _INPUT_GRADS[0] = before


@contextlib.contextmanager
def lora_adapters_16bit(on: bool) -> Iterator[None]:
    """Models built inside get their LoRA adapters in the model's dtype (``get_peft_model(...,
    autocast_adapter_dtype=False)``), as DeepSpeed's cast leaves them; peft's default is fp32 adapters."""
    before, _ADAPTERS_16BIT[0] = _ADAPTERS_16BIT[0], on
    try:
        yield
    finally:
        _ADAPTERS_16BIT[0] = before


def apply_lora(model: torch.nn.Module, training: TrainingSpec) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=training.lora_rank, lora_alpha=2 * training.lora_rank,
                      lora_dropout=training.lora_dropout,
                      target_modules=lora_target_modules(model, training.lora_targets), task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing: harmless
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*deprecated", category=FutureWarning)
        # QLoRA without kbit preparation builds its adapters in the model's dtype whoever builds it (the oracle too)
        return get_peft_model(model, lora, autocast_adapter_dtype=not (_ADAPTERS_16BIT[0] or (
            training.qlora and training.lora_dtype == "model")))


def build_optimizer(params, training: TrainingSpec, lr: float = 1e-5) -> torch.optim.Optimizer:
    """The optimizer as it runs on CUDA by default (foreach AdamW), with fp32 masters for mixed_*."""
    params = [p for p in params if p.requires_grad]
    if training.precision.startswith("mixed_"):
        return MasterWeightOptimizer(params, training, lr)
    return _inner_optimizer(params, training, lr)


def _inner_optimizer(params, training: TrainingSpec, lr: float) -> torch.optim.Optimizer:
    if training.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=True)
    if training.optimizer == "adamw_fused":
        return torch.optim.AdamW(params, lr=lr, fused=True)
    if training.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=True)
    if training.optimizer == "adamw_8bit":
        import bitsandbytes as bnb  # GPU only

        return bnb.optim.AdamW8bit(params, lr=lr)
    raise ValueError(f"optimizer: {training.optimizer!r} is not supported")


class MasterWeightOptimizer(torch.optim.Optimizer):
    """16-bit model weights and grads, fp32 master copies stepped by the inner optimizer (as DeepSpeed does).

    At ``step`` each 16-bit grad is converted to an fp32 grad on its master and freed at once; the inner
    optimizer steps the masters; the 16-bit weights are refreshed from them.
    """

    def __init__(self, params, training: TrainingSpec, lr: float) -> None:
        self.model_params = list(params)
        self.masters = [p.detach().float().requires_grad_(True) for p in self.model_params]
        self.inner = _inner_optimizer(self.masters, training, lr)
        super().__init__(self.masters, {"lr": lr})
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    @torch.no_grad()
    def step(self, closure=None):
        for master, param in zip(self.masters, self.model_params):
            master.grad = None if param.grad is None else param.grad.float()
            param.grad = None
        self.inner.step()
        for master, param in zip(self.masters, self.model_params):
            param.copy_(master)
            master.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.model_params:
            param.grad = None
        for master in self.masters:
            master.grad = None


@contextlib.contextmanager
def autocast_context(training: TrainingSpec, device: torch.device | str) -> Iterator[None]:
    dtype = autocast_dtype(training)
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=torch.device(device).type, dtype=dtype):
        yield


class HeldOutputs:
    """The model's output object across micro-batches, as the user's training loop keeps it.

    ``trainer`` (HF Trainer, TRL, torchtune): only the loss is taken from the output object, which is dropped
    before ``backward()``. ``manual`` (accelerate's examples, most hand-written loops): ``outputs = model(**batch);
    loss = outputs.loss; loss.backward()`` keeps ``outputs`` (the logits) bound through backward and the optimizer
    step, until the next forward's result is bound to the name. ``outputs_fp32``: the forward returns fp32
    copies of its 16-bit float outputs, as accelerate's mixed-precision wrapper does (``TrainingSpec.outputs_fp32``)."""

    def __init__(self, loop: str, outputs_fp32: bool = False) -> None:
        self.loop = loop
        self.outputs_fp32 = outputs_fp32
        self.outputs: Any = None

    def forward(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], training: TrainingSpec | None = None,
                device: torch.device | str = "cpu") -> torch.Tensor:
        """``training``: the forward with its autocast and long-context techniques (``step_forward``); without
        it, a plain call (e.g. DeepSpeed's engine, which autocasts inside)."""
        if training is None:
            outputs = model(**batch)
            loss = outputs.loss
        else:
            outputs, loss = step_forward(model, batch, training, device)
        if self.outputs_fp32:
            outputs = outputs_to_fp32(outputs)
        if self.loop == "manual":
            self.outputs = outputs  # rebinding frees the previous micro-batch's outputs only now
        return loss

    def clear(self) -> None:
        self.outputs = None


def outputs_to_fp32(outputs: Any) -> Any:
    """The output object with every 16-bit float tensor replaced by ``tensor.float()`` (nested mappings,
    lists and tuples kept as they are), as accelerate's ``convert_outputs_to_fp32`` returns it."""
    if isinstance(outputs, torch.Tensor):
        return outputs.float() if outputs.dtype in (torch.float16, torch.bfloat16) else outputs
    if isinstance(outputs, Mapping):  # ModelOutput is an OrderedDict: rebuild the same type
        return type(outputs)(**{k: outputs_to_fp32(v) for k, v in outputs.items()})
    if isinstance(outputs, (list, tuple)):
        items = [outputs_to_fp32(v) for v in outputs]
        return type(outputs)(*items) if hasattr(outputs, "_fields") else type(outputs)(items)
    return outputs


def forward_backward(model: torch.nn.Module, batch: dict[str, torch.Tensor], training: TrainingSpec,
                     device: torch.device | str = "cpu", scale: float = 1.0,
                     held: HeldOutputs | None = None) -> torch.Tensor:
    """Forward and backward of one micro-batch; returns the detached loss. The output object is dropped before
    backward unless ``held`` keeps it (``training.loop`` "manual": pass one ``HeldOutputs`` for every step)."""
    held = held if held is not None else HeldOutputs("trainer", training.outputs_fp32)
    loss = held.forward(model, batch, training, device)
    (loss * scale if scale != 1.0 else loss).backward()
    return loss.detach()


def step_forward(model: torch.nn.Module, batch: dict[str, torch.Tensor], training: TrainingSpec,
                 device: torch.device | str = "cpu") -> tuple[Any, torch.Tensor]:
    """(output object, loss) of one forward as the spec runs it: under its autocast, with its activation offload
    (the loss of ``training.ce`` is the model's forward itself, ``build_model``)."""
    with autocast_context(training, device), offload_context(training, device):
        outputs = model(**batch)
        return outputs, outputs.loss


def offload_context(training: TrainingSpec, device: torch.device | str) -> contextlib.AbstractContextManager:
    """``activation_offload``: the forward's saved tensors moved to the host (``techniques``)."""
    if not training.activation_offload:
        return contextlib.nullcontext()
    from estimator.profiler.techniques import offload_saved_tensors

    return offload_saved_tensors(device)


def train_step(model, optimizer, batch, training: TrainingSpec, device: torch.device | str = "cpu",
               held: HeldOutputs | None = None) -> torch.Tensor:
    loss = forward_backward(model, batch, training, device, held=held)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def synthetic_batch(batch_size: int, seq_len: int, vocab_size: int, device: torch.device | str = "cpu",
                    ) -> dict[str, torch.Tensor]:
    """Full-length batch (every position attended, every label trained): the worst case the paper measures."""
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), device=device)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids.clone()}


@contextlib.contextmanager
def as_on_gpu(batch: str = "full", training: TrainingSpec | None = None) -> Iterator[None]:
    """A fake-tensor trace of the program a GPU runs for ``synthetic_batch``: CUDA's kernel choices
    (``estimator.profiler.cuda_path``) and, for a full-length batch (``TrainingSpec.batch``), transformers'
    maskless path (``full_length_attention_mask``); a padded batch takes the 4-D mask path, which is what
    transformers does on fake tensors anyway. ``training``: QLoRA with ``attn="flash"`` runs FlashAttention-2's
    16-bit casts of its fp32 attention inputs (the SDPA trace stands for the kernel otherwise). Only for fake
    tensors: real CPU runs keep their own kernels."""
    from estimator.profiler.cuda_path import cuda_composites, flash_attention_2

    with contextlib.ExitStack() as stack:
        stack.enter_context(cuda_composites())
        stack.enter_context(full_length_attention_mask(padded=batch != "full"))
        if training is not None and training.qlora_kbit_prep and training.attn == "flash":
            stack.enter_context(flash_attention_2(param_dtype(training.precision)))
        yield


@contextlib.contextmanager
def full_length_attention_mask(padded: bool = False) -> Iterator[None]:
    """Let transformers skip the 4-D attention mask for SDPA as it does on the GPU for our batch.

    The traced batch is ``synthetic_batch``: full length, ``attention_mask`` all ones. On real tensors
    transformers checks that (``fast_all``) and calls SDPA with ``attn_mask=None, is_causal=True`` (flash /
    memory-efficient kernels, ``enable_gqa`` instead of ``repeat_kv``). On fake tensors it cannot read the mask
    (``is_tracing`` is true for FakeTensor) and materialises a ``(b, 1, s, s)`` mask instead, which changes the
    SDPA path and adds per-layer mask copies. We tell it what the data would have told it: no padding.
    ``padded``: the batch has padding, so the mask is kept (what transformers 5 concludes on fake tensors by
    itself; older releases read the mask's values, which fake tensors do not have).
    """
    from torch._subclasses.fake_tensor import is_fake

    def make(orig):
        def ignore_causal_mask_sdpa(padding_mask, *args, **kwargs):
            if padding_mask is not None and is_fake(padding_mask):
                if padded:
                    return False
                padding_mask = None  # all ones by construction (synthetic_batch)
            return orig(padding_mask, *args, **kwargs)
        return ignore_causal_mask_sdpa

    if transformers_release() >= (4, 53):
        from transformers import masking_utils

        with patched_attr(masking_utils, "_ignore_causal_mask_sdpa", make):
            yield
        return
    # Older releases ask AttentionMaskConverter, a staticmethod there (patched on the class, kept static).
    from transformers.modeling_attn_mask_utils import AttentionMaskConverter

    orig = AttentionMaskConverter.__dict__["_ignore_causal_mask_sdpa"]
    AttentionMaskConverter._ignore_causal_mask_sdpa = staticmethod(make(orig.__func__))
    try:
        yield
    finally:
        AttentionMaskConverter._ignore_causal_mask_sdpa = orig


@functools.cache
def transformers_release() -> tuple[int, int]:
    """(major, minor) of the transformers imported here: the profiler also traces older model code (a profile's
    ``transformers`` release, ``TrainingSpec.transformers``), whose API differs in a few names."""
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


@contextlib.contextmanager
def patched_attr(owner: Any, name: str, make) -> Iterator[None]:
    """``owner.name`` replaced by ``make(original)`` (wrapped to keep its name) for the duration."""
    orig = getattr(owner, name)
    setattr(owner, name, functools.wraps(orig)(make(orig)))
    try:
        yield
    finally:
        setattr(owner, name, orig)
