"""The one typed spec that flows through harness, calibrate and estimator.

Hydra stops at the harness entry point; below it only these dataclasses travel (as JSON files, as table
columns, as API arguments). Every user error raises ``ValueError`` with a one-line message naming the field.
Pure standard library: importing this must stay cheap.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1

METHODS = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp1", "tp", "dp_tp", "zero_offload")
# Methods DeepSpeed runs; their bucket/prefetch settings live in ZeroSpec.
ZERO_METHODS = ("zero1", "zero2", "zero3", "zero_offload")
# FSDP shards (dp_tp: FSDP2 over the mesh's dp axis): what TrainingSpec.grad_sync changes and the methods share.
FSDP_METHODS = ("fsdp", "fsdp1", "dp_tp")
QLORA_UNSUPPORTED_METHODS = ("fsdp", "tp", "dp_tp")
# torch.distributed.fsdp.ShardingStrategy names (FSDP1); HYBRID_SHARD shards within a node, replicates across.
FSDP1_SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
# torch.distributed.fsdp.BackwardPrefetch names, "NONE" for backward_prefetch=None.
FSDP1_BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NONE")
# Where FSDP1's auto-wrap policy puts the LoRA adapters: "adapter" (peft's ``fsdp_auto_wrap_policy``, what the HF
# Trainer gives a PEFT model: each adapter Linear a unit of its own inside the decoder-layer units) or "layer" (the
# decoder-layer policy alone, e.g. Lightning's ``FSDPStrategy(auto_wrap_policy={Block})``: the adapters share
# their layer's flat parameter, so they must be in its dtype, and with ``use_orig_params`` that flat parameter
# needs a gradient: every frozen weight of the layer gets one, as torch's FSDP docs warn).
FSDP1_LORA_WRAPS = ("adapter", "layer")
PRECISIONS = ("fp32", "bf16", "amp_bf16", "amp_fp16", "mixed_bf16", "mixed_fp16")
OPTIMIZERS = ("adamw", "adamw_fused", "sgd", "adamw_8bit")
ATTENTIONS = ("eager", "sdpa", "flash")
PADDINGS = ("max_length", "longest")
# How the training loop treats the model's output object: "trainer" drops it before backward (HF Trainer, TRL,
# torchtune), "manual" keeps ``outputs`` bound through backward and the optimizer step (accelerate's examples).
LOOPS = ("trainer", "manual")
# Whether a micro-batch has padding: "full" (every row full length or packed: transformers skips the attention mask
# and SDPA runs causal kernels) or "padded" (some rows shorter: it builds the 4-D mask, and SDPA repeats the
# grouped k/v heads and converts the mask in every layer).
BATCHES = ("full", "padded")
# When FSDP reduces the gradients under gradient accumulation: on "every" micro-batch (torchtitan, a plain torch
# loop, accelerate with ``sync_each_batch=True``) or on the "last" one only (the HF Trainer and accelerate's
# ``accumulate()``, Lightning's ``no_backward_sync``: ``no_sync()`` / ``set_requires_gradient_sync(False)`` on the
# others, every rank holding the unsharded gradients in between). Other methods' memory does not depend on it.
GRAD_SYNCS = ("every", "last")
# How the loss is computed from the last hidden states: "standard" (the model's own head and loss: logits for the
# whole sequence, upcast to fp32), "chunked" (torchtune's LinearCrossEntropyLoss: head and fp32 cross-entropy one
# sequence chunk at a time, ``ce_chunks`` chunks) or "fused_linear" (Liger's LigerFusedLinearCrossEntropyFunction:
# the gradients of the hidden states and the head's weight computed chunk by chunk inside the forward).
CES = ("standard", "chunked", "fused_linear")
LORA_DTYPES = ("auto", "model")
# QLoRA's preparation of the rest of the model: "kbit" (peft's prepare_model_for_kbit_training: fp32 embedding,
# norms, head and residual stream), "none" (everything not quantized stays in the model's bf16), "auto" ("none"
# with lora_dtype model, else "kbit").
QLORA_PREPS = ("auto", "kbit", "none")
# Who quantizes QLoRA's base: "transformers" (``BitsAndBytesConfig``: every nn.Linear but the output head, quantized
# from the loaded 16-bit weight) or "lightning" (Lightning's ``BitsandbytesPrecision("nf4-dq")``, LitGPT: every
# nn.Linear, the LM head included, each weight quantized from ``weight.to(torch.half)``, so every 4-bit matmul
# dequantizes to fp16 and casts that to the bf16 input's dtype).
QLORA_QUANTIZERS = ("transformers", "lightning")
# The first bitsandbytes release whose ``MatMul4Bit`` no longer keeps its input for backward (0.43.2, 9e753741,
# "fix QLoRA mem bug", bitsandbytes #1270): before it, ``ctx.tensors = (A, B)`` holds each 4-bit Linear's input
# until the autograd graph is freed, a backward that never reads it.
BNB_DROPS_4BIT_INPUTS = (0, 43, 2)
# Which decoder layers are checkpointed when ``grad_ckpt`` is on: "" every layer (HF, full AC); "every-k:K" every
# K-th layer (torchtitan/torchtune's selective layer AC: layers K-1, 2K-1, ...); "selective-ops" every layer with
# torchtitan's op policy (torch's create_selective_checkpoint_contexts: matmul and attention outputs saved,
# every second matmul and the rest recomputed).
CKPT_POLICIES = ("every-k", "selective-ops")
# torch.distributed.pipelining's schedules (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B).
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
PP_ENGINES = ("torch", "deepspeed")  # who runs a pipeline: torch.distributed.pipelining, DeepSpeed's PipelineEngine


def ckpt_every(policy: str) -> int | None:
    """K of "every-k:K" (None for another policy); raises ValueError for a malformed one."""
    if not policy.startswith("every-k"):
        return None
    head, _, tail = policy.partition(":")
    if head != "every-k" or not tail.isdigit() or int(tail) < 1:
        _fail("ckpt_policy", f"every-k needs a layer count, e.g. every-k:2, got {policy!r}")
    return int(tail)


def _fail(field_name: str, message: str) -> None:
    raise ValueError(f"{field_name}: {message}")


def _check_choice(field_name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(field_name, f"{value!r} is not one of {', '.join(choices)}")


def _check_positive_int(field_name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        _fail(field_name, f"must be a positive integer, got {value!r}")


def _check_nonneg_number(field_name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        _fail(field_name, f"must be a non-negative number, got {value!r}")


def model_code_release(version: str) -> str | None:
    """'4.45.2' -> '4.45' (major.minor, what model code changes with); None when it is not a release number."""
    parts = str(version).strip().split(".")
    if len(parts) < 2 or not parts[0].isdigit():
        return None
    minor = "".join(ch for ch in parts[1] if ch.isdigit()) if parts[1][:1].isdigit() else ""
    return f"{int(parts[0])}.{int(minor)}" if minor else None


def bnb_release(version: str) -> tuple[int, int, int] | None:
    """'0.41.1' -> (0, 41, 1) (a missing patch is 0); None when it is not a release number."""
    parts = str(version).strip().split(".")
    if len(parts) < 2 or not all(p[:1].isdigit() for p in parts[:3]):
        return None
    a, b, c = ([int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts[:3]] + [0])[:3]
    return a, b, c


def installed_bnb_release() -> tuple[int, int, int] | None:
    """The installed bitsandbytes' release (no import: the predict path stays torch-free); None when absent."""
    from importlib import metadata

    try:
        return bnb_release(metadata.version("bitsandbytes"))
    except metadata.PackageNotFoundError:
        return None


def bnb_keeps_4bit_inputs(release: tuple[int, int, int] | None) -> bool:
    """Whether that bitsandbytes release's ``MatMul4Bit`` keeps each 4-bit Linear's input (None: no release known,
    today's behaviour)."""
    return release is not None and release < BNB_DROPS_4BIT_INPUTS


# Methods ring attention is modelled with: FSDP2 over the dp x cp ranks (torchtitan), and dp_tp: torchtitan's
# (dp_shard, cp, tp) mesh, TP innermost, FSDP2 over the dp x cp ranks of each TP position. Pipeline stages are not
# modelled.
CP_METHODS = ("fsdp", "dp_tp")
CP_PRECISIONS = ("bf16", "fp16", "mixed_bf16", "mixed_fp16", "amp_bf16", "amp_fp16")
CP_ATTN = ("sdpa", "flash")


def check_cp(cp: int, method: str, world_size: int, seq_len: int, precision: str, attn: str, *, tp: int = 1,
             ep: int = 1, qlora: bool = False, padded: bool = False) -> None:
    """ValueError("cp: ...") for a layout torch's ring attention or this model does not cover."""
    if cp == 1:
        return
    if method not in CP_METHODS:
        raise ValueError(f"cp: context parallelism is modelled with FSDP2 over the dp x cp ranks (torchtitan): use "
                         f"method fsdp, or dp_tp for cp x tp, got {method!r}")
    if world_size % (cp * tp):
        raise ValueError(f"cp: world size {world_size} is not divisible by cp x tp = {cp * tp}")
    if ep > 1:
        raise ValueError("cp: context parallelism with expert parallelism is not modelled (use ep 1)")
    if seq_len % (2 * cp):
        raise ValueError(f"cp: seq_len {seq_len} must be a multiple of 2 x cp = {2 * cp} (torch's head-tail load "
                         f"balancer; without it the causal ring runs unbalanced, not modelled)")
    if attn not in CP_ATTN:
        raise ValueError(f"cp: torch's ring attention replaces scaled_dot_product_attention; attn {attn!r} does not "
                         f"call it (use sdpa)")
    if precision not in CP_PRECISIONS:
        raise ValueError(f"cp: ring attention is modelled for the flash kernel (16-bit attention); {precision} "
                         f"attention runs the memory-efficient kernel (use {', '.join(CP_PRECISIONS)})")
    if qlora:
        raise ValueError("cp: QLoRA under context parallelism is not modelled (FSDP2 cannot shard 4-bit weights; "
                         "use LoRA)")
    if padded:
        raise ValueError("cp: ring attention takes no attention mask: full rows or packed sequences only (batch full)")


@dataclass(frozen=True)
class TrainingSpec:
    """What one optimizer step looks like on one data-parallel rank."""

    micro_batch_size: int = 1
    seq_len: int = 512
    # fp32; bf16 = pure bf16 weights, grads and states; amp_* = fp32 weights + autocast;
    # mixed_* = 16-bit weights and grads + fp32 master weights in the optimizer (DeepSpeed / LLMem).
    precision: str = "mixed_bf16"
    optimizer: str = "adamw"
    grad_ckpt: bool = False
    attn: str = "sdpa"
    # 0 = full fine-tuning. LoRA targets: "auto" = peft's default modules for the architecture,
    # "all-linear", or a comma-separated list of module names.
    lora_rank: int = 0
    lora_targets: str = "auto"
    # peft's LoraConfig.lora_dropout: above zero, each adapted module keeps a dropout mask and the dropped input
    # for backward (how much depends only on whether it is above zero, not on its value).
    lora_dropout: float = 0.0
    # The LoRA adapters' dtype. "auto": as the method leaves them (peft builds them in fp32,
    # ``autocast_adapter_dtype``; DeepSpeed's and FSDP's casts below); "model": built in the model's own dtype,
    # as Lightning's ``bf16-true`` builds a LitGPT model with its adapters (``fabric.init_module``) and as
    # ``get_peft_model(..., autocast_adapter_dtype=False)`` leaves them: a 16-bit run then feeds each adapter
    # its 16-bit input (no fp32 copy, no fp32 dropped input) and keeps 16-bit adapter states.
    # With ``qlora``, "model" is the QLoRA recipe WITHOUT kbit preparation (answer.ai fsdp_qlora's train.py, most
    # hand-written bitsandbytes loops): every nn.Linear but the head NF4, everything else (embedding, norms, head,
    # residual stream) and the adapters kept in the model's dtype (pure bf16 only); "auto" with ``qlora`` is peft's
    # ``prepare_model_for_kbit_training`` (fp32 embedding, norms, head and residual stream, fp32 adapters).
    lora_dtype: str = "auto"
    qlora: bool = False
    # QLORA_PREPS. "none" with lora_dtype auto: no kbit preparation but fp32 adapters, as peft 0.13 leaves
    # them on a 4-bit base stored as uint8 (``_move_adapter_to_device_of_base_layer`` casts adapters to the base
    # weight's dtype only when it is a float; later peft reads ``compute_dtype``): each adapter then takes an fp32
    # copy of its input and keeps an fp32 dropped input (peft-experiments' QLoRA notebook, peft 1b16753a).
    qlora_prep: str = "auto"
    # QLORA_QUANTIZERS. "lightning" needs QLoRA without kbit preparation (Lightning's ``bf16-true`` leaves the rest
    # in bf16); a head tied to the embedding stays unquantized (the embedding is no Linear).
    qlora_quantizer: str = "transformers"
    # The bitsandbytes release the run uses ("0.41.1"; "": the installed one): before 0.43.2 every 4-bit Linear
    # keeps its input for backward (``qlora_keeps_inputs``), traced by a copy of that release's ``MatMul4Bit``.
    qlora_bnb: str = ""
    grad_accum_steps: int = 1
    loop: str = "trainer"
    batch: str = "full"
    # The forward returns fp32 copies of its 16-bit outputs (accelerate's mixed precision wraps the model's
    # forward in autocast + ``convert_outputs_to_fp32``: accelerate scripts and the HF Trainer with bf16/fp16,
    # DeepSpeed excepted). A manual loop then holds fp32 logits through backward; over 16-bit weights the forward
    # runs under autocast too (``forward_autocast``).
    outputs_fp32: bool = False
    grad_sync: str = "every"
    # The transformers release whose model code runs ("4.45"; major.minor): releases allocate differently (before
    # 4.46 the logits are upcast to fp32 inside ``forward`` and kept in the output). "": the release the shipped
    # profiles were traced with. A profile traced with it is used where one is shipped or cached, or can be traced
    # here (that release installed); otherwise the shipped one, and the estimate says so.
    model_code: str = ""
    # The model's key/value cache stays on in training: its config's ``use_cache`` (true in most config.json
    # files) is left as it is by the HF Trainer, TRL's SFTTrainer (through 0.13), accelerate and plain loops
    # that pass no ``use_cache=False``. What that keeps is the model code's business, so the profile traces it:
    # Llama-family code turns the cache off under checkpointing; GPTBigCode (<= 4.57) never does, and each
    # layer's present key/value, a view of its fused QKV output, keeps that whole output alive to the loss.
    # False: the loop or the model turns it off (``model.config.use_cache = False``, ms-swift, axolotl, ...).
    use_cache: bool = False
    ce: str = "standard"
    ce_chunks: int = 8  # torchtune's num_output_chunks (chunked only; Liger picks its own chunk size)
    # Saved activations moved to host memory during the forward (torch.autograd.graph.save_on_cpu(pin_memory=True)
    # around the forward), copied back when backward unpacks them.
    activation_offload: bool = False
    ckpt_policy: str = ""
    # The model's own gradient checkpointing runs torch.utils.checkpoint's reentrant variant
    # (``use_reentrant=True``: the HF Trainer's default through transformers 4.x). Before transformers 4.52 the
    # model's layer loop calls the checkpoint around each decoder layer, outside an FSDP1 unit wrapping it: the
    # recompute then re-enters the unit's forward with a detached copy of the layer's input, on which FSDP1 hangs
    # the post-backward hook of a unit without gradients (LoRA's frozen layers), and that hook keeps the input's
    # storage until backward ends (``estimator.methods.fsdp1``). Traced profiles are non-reentrant either way.
    ckpt_reentrant: bool = False
    # Rows of the model's embedding (and untied LM head) after the training script resized it
    # (``model.resize_token_embeddings(N)``, e.g. fms-hf-tuning adding a ``<pad>`` token: 32,001 for Mistral-7B);
    # 0 = the config's ``vocab_size``. The parameters, their gradients and optimizer states and every logits-sized
    # tensor follow it: the configured model's profile, re-sized (``estimator.profiler.vocab``).
    vocab_size: int = 0
    # The run's torch records a ``SliceBackward`` for a full-range basic slice (``:``) in Python indexing: torch
    # 2.4's ``applySlice`` elides a slice only when its stop equals the dimension, and ``:`` passes INT64_MAX
    # (2.11 and 2.13 elide any stop at or past it; the release between that changed it is not located). The
    # causal-LM loss's ``logits[..., :-1, :]`` then zero-fills a b x (s-1) x V fp32 gradient in backward before
    # the b x s x V one (``estimator.reserved.torch_slices``). Traced profiles (torch 2.13) have neither.
    full_range_slices: bool = False
    # The caching allocator's cap in bytes (0: none): ``torch.cuda.set_per_process_memory_fraction(f)`` caps it at
    # ``int(f x total_memory)`` (``estimator.hardware.gpus.cap_from_fraction``), the harness's ``memory.cap_gib``
    # (the paper's 16 GB V100 on a larger GPU). Past it the allocator releases its cached blocks and retries, then
    # runs out of memory, whatever the GPU has left; the reserved replay's allowance is the smaller of the two.
    memory_cap_bytes: int = 0

    def __post_init__(self) -> None:
        _check_positive_int("micro_batch_size", self.micro_batch_size)
        _check_positive_int("seq_len", self.seq_len)
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        _check_choice("attn", self.attn, ATTENTIONS)
        if not isinstance(self.grad_ckpt, bool):
            _fail("grad_ckpt", f"must be true or false, got {self.grad_ckpt!r}")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            _fail("lora_rank", f"must be a positive integer (0 disables LoRA), got {self.lora_rank!r}")
        if self.qlora and self.lora_rank == 0:
            _fail("qlora", "QLoRA needs a LoRA rank (--lora-rank R)")
        if isinstance(self.lora_dropout, bool) or not isinstance(self.lora_dropout, (int, float)) \
                or not 0 <= self.lora_dropout < 1:
            _fail("lora_dropout", f"must be a probability in [0, 1), got {self.lora_dropout!r}")
        if self.lora_dropout and self.lora_rank == 0:
            _fail("lora_dropout", "LoRA dropout needs a LoRA rank (--lora-rank R)")
        _check_choice("lora_dtype", self.lora_dtype, LORA_DTYPES)
        if self.lora_dtype == "model" and self.lora_rank == 0:
            _fail("lora_dtype", "adapters in the model's dtype need LoRA (--lora-rank R)")
        _check_choice("qlora_prep", self.qlora_prep, QLORA_PREPS)
        if self.qlora_prep != "auto" and not self.qlora:
            _fail("qlora_prep", "the kbit preparation is QLoRA's (--qlora)")
        if self.qlora_prep == "kbit" and self.lora_dtype == "model":
            _fail("qlora_prep", "peft's kbit preparation keeps the adapters fp32: use lora_dtype auto")
        if self.qlora and not self.qlora_kbit_prep and self.precision != "bf16":
            _fail("lora_dtype" if self.qlora_prep == "auto" else "qlora_prep",
                  f"QLoRA without kbit preparation is modelled for a pure bf16 model (precision bf16), got "
                  f"{self.precision}")
        _check_choice("qlora_quantizer", self.qlora_quantizer, QLORA_QUANTIZERS)
        if self.qlora_quantizer != "transformers" and (not self.qlora or self.qlora_kbit_prep):
            _fail("qlora_quantizer", "Lightning's quantization is QLoRA without kbit preparation (--qlora "
                                     "--lora-dtype model)")
        if not isinstance(self.qlora_bnb, str) or (self.qlora_bnb and bnb_release(self.qlora_bnb) is None):
            _fail("qlora_bnb", f"must be a bitsandbytes release such as 0.41.1, got {self.qlora_bnb!r}")
        if self.qlora_bnb and not self.qlora:
            _fail("qlora_bnb", "the bitsandbytes release matters to QLoRA only (--qlora)")
        if not isinstance(self.lora_targets, str) or not self.lora_targets.strip():
            _fail("lora_targets", f"must be 'auto', 'all-linear' or module names, got {self.lora_targets!r}")
        _check_positive_int("grad_accum_steps", self.grad_accum_steps)
        _check_choice("loop", self.loop, LOOPS)
        _check_choice("batch", self.batch, BATCHES)
        _check_choice("grad_sync", self.grad_sync, GRAD_SYNCS)
        if not isinstance(self.outputs_fp32, bool):
            _fail("outputs_fp32", f"must be true or false, got {self.outputs_fp32!r}")
        if not isinstance(self.use_cache, bool):
            _fail("use_cache", f"must be true or false, got {self.use_cache!r}")
        if not isinstance(self.model_code, str) or (self.model_code and model_code_release(self.model_code) is None):
            _fail("model_code", f"must be a transformers release such as 4.45 or 4.45.2, got {self.model_code!r}")
        if self.attn == "flash" and self.precision == "fp32":
            _fail("attn", "flash attention needs 16-bit activations; use sdpa or eager with fp32")
        _check_choice("ce", self.ce, CES)
        _check_positive_int("ce_chunks", self.ce_chunks)
        if not isinstance(self.activation_offload, bool):
            _fail("activation_offload", f"must be true or false, got {self.activation_offload!r}")
        if not isinstance(self.ckpt_policy, str):
            _fail("ckpt_policy", f"must be every-k:K or selective-ops, got {self.ckpt_policy!r}")
        if self.ckpt_policy:
            if self.ckpt_policy != "selective-ops" and ckpt_every(self.ckpt_policy) is None:
                _fail("ckpt_policy", f"{self.ckpt_policy!r} is not one of every-k:K, selective-ops")
            if not self.grad_ckpt:
                _fail("ckpt_policy", "a checkpointing policy needs checkpointing on (--grad-ckpt)")
        if not isinstance(self.ckpt_reentrant, bool):
            _fail("ckpt_reentrant", f"must be true or false, got {self.ckpt_reentrant!r}")
        if self.ckpt_reentrant and (not self.grad_ckpt or self.ckpt_policy):
            _fail("ckpt_reentrant", "reentrant checkpointing is the model's own checkpointing of every layer: it "
                                    "needs --grad-ckpt and no --ckpt-policy")
        if not isinstance(self.full_range_slices, bool):
            _fail("full_range_slices", f"must be true or false, got {self.full_range_slices!r}")
        if isinstance(self.memory_cap_bytes, bool) or not isinstance(self.memory_cap_bytes, int) \
                or self.memory_cap_bytes < 0:
            _fail("memory_cap_bytes", f"must be a positive number of bytes (0: no cap), got {self.memory_cap_bytes!r}")
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 0:
            _fail("vocab_size", f"must be a positive integer (0: the config's vocabulary), got {self.vocab_size!r}")
        if self.ce != "standard" and self.outputs_fp32:
            _fail("ce", "a loss outside the model under accelerate's fp32 output wrapper (outputs_fp32) is not "
                        "modelled")
        if (self.ce != "standard" or self.activation_offload or self.ckpt_policy) and self.lora:
            self._check_lora_techniques()

    def _check_lora_techniques(self) -> None:
        """LoRA with the long-context techniques: what both CPU oracles checked (peft adapters, dropout 0, on the
        decoder's linears: docs/error_matrix/long_context_lora_*.csv); the rest one line naming what is not."""
        field = "ce" if self.ce != "standard" else "activation_offload" if self.activation_offload else "ckpt_policy"
        if self.qlora:
            _fail(field, "the long-context techniques with QLoRA are not checked (LoRA and full fine-tuning are)")
        if self.ckpt_policy == "selective-ops":
            _fail("ckpt_policy", "selective-ops with LoRA is not checked (every-k:K is)")
        if self.lora_dropout:
            _fail(field, "the long-context techniques with LoRA dropout are not checked (use lora_dropout 0)")
        if "lm_head" in self.lora_targets:
            _fail(field, "the long-context techniques with an adapter on the output head are not checked")

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def qlora_kbit_prep(self) -> bool:
        """QLoRA as peft's ``prepare_model_for_kbit_training`` leaves the model: the non-quantized parameters, the
        residual stream and the adapters in fp32 (``lora_dtype`` auto). False for LoRA and for QLoRA without the
        preparation (``lora_dtype`` model: everything in the model's bf16; ``qlora_prep`` none)."""
        return self.qlora and (self.qlora_prep == "kbit" or (self.qlora_prep == "auto" and self.lora_dtype == "auto"))

    @property
    def qlora_keeps_inputs(self) -> bool:
        """QLoRA under a bitsandbytes release whose ``MatMul4Bit`` keeps each 4-bit Linear's input (before 0.43.2):
        the declared ``qlora_bnb``, else the installed release."""
        if not self.qlora:
            return False
        return bnb_keeps_4bit_inputs(bnb_release(self.qlora_bnb) if self.qlora_bnb else installed_bnb_release())

    @property
    def forward_autocast(self) -> str | None:
        """The dtype ("bf16" | "fp16") the forward runs under autocast, or None: amp_* over fp32 weights, and
        accelerate's mixed precision (``outputs_fp32``: the HF Trainer's --bf16/--fp16, accelerate's
        ``mixed_precision``) over 16-bit weights too, where CUDA's autocast still runs layer_norm, softmax,
        log_softmax, exp, pow, sum and the losses in fp32."""
        if self.precision.startswith("amp_"):
            return self.precision[len("amp_"):]
        if self.outputs_fp32 and self.precision in ("bf16", "mixed_bf16", "mixed_fp16"):
            return "fp16" if self.precision.endswith("fp16") else "bf16"
        return None

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch_size * self.seq_len


# DeepSpeed 0.19.8's default ZeRO-3 leaf module classes (``zero_optimization.leaf_module.classes``):
# ``DEFAULT_LEAF_MODULE_CLASSES`` in ``deepspeed/runtime/zero/leaf_module_config.py``, copied as it is there
# (tests/estimator/test_zero3_leaf.py compares it with the installed DeepSpeed's). ``names`` and ``name_suffixes``
# default to none.
DEFAULT_LEAF_MODULE_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)
LEAF_FIELDS = ("leaf_classes", "leaf_names", "leaf_name_suffixes")


def _names_tuple(field_name: str, value: Any) -> tuple[str, ...]:
    """A list of names as DeepSpeed's ``DeepSpeedZeroLeafModuleConfig`` takes it: a lone string is a list of one,
    duplicates dropped in order."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v.strip() for v in value):
        _fail(field_name, f"must be a list of module names, got {value!r}")
    return tuple(dict.fromkeys(v.strip() for v in value))


@dataclass(frozen=True)
class ZeroSpec:
    """DeepSpeed ZeRO settings, with DeepSpeed's own defaults (deepspeed/runtime/zero/config.py).

    Sizes are element counts, as in DeepSpeed's JSON. ``overlap_comm=None`` means DeepSpeed's default:
    on for stage 3, off otherwise.
    """

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool | None = None
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000
    offload_optimizer: bool = False
    offload_param: bool = False
    pin_memory: bool = False
    # ZeRO-3 leaf modules (``zero_optimization.leaf_module``: ``classes``, ``names``, ``name_suffixes``): DeepSpeed
    # puts no hooks inside one, gathers every parameter under it when it is entered and reduces their gradients
    # when its backward is done (``estimator.models.zero3_leaf``)
    leaf_classes: tuple[str, ...] = DEFAULT_LEAF_MODULE_CLASSES
    leaf_names: tuple[str, ...] = ()
    leaf_name_suffixes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in LEAF_FIELDS:
            object.__setattr__(self, name, _names_tuple(f"zero.{name}", getattr(self, name)))
        for name in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                     "stage3_param_persistence_threshold", "stage3_max_live_parameters",
                     "stage3_max_reuse_distance", "sub_group_size"):
            _check_nonneg_number(f"zero.{name}", getattr(self, name))

    def overlap_comm_for(self, stage: int) -> bool:
        return (stage == 3) if self.overlap_comm is None else bool(self.overlap_comm)


@dataclass(frozen=True)
class Fsdp1Spec:
    """FSDP1 (``FullyShardedDataParallel``) settings for method ``fsdp1``: torch's defaults, except
    ``use_orig_params`` (on in accelerate, the Trainer and torchtune, which is how most FSDP1 runs are launched).
    ``gpus_per_node``: the shard group of HYBRID_SHARD (FSDP1 shards within a node). ``lora_wrap``: which units
    hold the LoRA adapters (``FSDP1_LORA_WRAPS``)."""

    sharding_strategy: str = "FULL_SHARD"
    use_orig_params: bool = True
    cpu_offload: bool = False
    backward_prefetch: str = "BACKWARD_PRE"
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    gpus_per_node: int = 8
    lora_wrap: str = "adapter"

    def __post_init__(self) -> None:
        _check_choice("fsdp1.sharding_strategy", self.sharding_strategy, FSDP1_SHARDING)
        _check_choice("fsdp1.lora_wrap", self.lora_wrap, FSDP1_LORA_WRAPS)
        _check_choice("fsdp1.backward_prefetch", self.backward_prefetch, FSDP1_BACKWARD_PREFETCH)
        for name in ("use_orig_params", "cpu_offload", "forward_prefetch", "limit_all_gathers"):
            if not isinstance(getattr(self, name), bool):
                _fail(f"fsdp1.{name}", f"must be true or false, got {getattr(self, name)!r}")
        _check_positive_int("fsdp1.gpus_per_node", self.gpus_per_node)

    def shard_size(self, world_size: int) -> int:
        """Ranks one parameter is sharded over."""
        if self.sharding_strategy == "NO_SHARD":
            return 1
        if self.sharding_strategy == "HYBRID_SHARD":
            return min(world_size, self.gpus_per_node)
        return world_size


@dataclass(frozen=True)
class ParallelSpec:
    """How the job is split over GPUs. ``world_size`` counts all GPUs; ``tp`` is the tensor-parallel degree."""

    method: str = "single"
    world_size: int = 1
    tp: int = 1
    zero: ZeroSpec = field(default_factory=ZeroSpec)
    # Expert parallelism of a mixture-of-experts model (method fsdp): ``ep`` ranks own distinct experts
    # (num_experts / ep each) and exchange the routed tokens all-to-all; each expert shard is FSDP-sharded over the
    # world_size / ep ranks holding the same experts (transformers' DistributedConfig(ep_size=, fsdp_size=)).
    ep: int = 1
    # Load of the busiest expert relative to balanced routing (1.0: balanced). Under ep > 1 the rank that owns the
    # busiest experts receives up to this many times its balanced share of routed tokens.
    moe_imbalance: float = 1.0
    # Context parallelism: ``cp`` ranks each hold seq_len / cp tokens of every sequence and run torch's ring
    # attention (``context_parallel``); FSDP2 shards over all world_size (dp x cp) ranks, as torchtitan does.
    cp: int = 1
    fsdp1: Fsdp1Spec = field(default_factory=Fsdp1Spec)
    # Pipeline parallelism (torch.distributed.pipelining, torchtitan's stage split): ``pp`` pipeline ranks each hold
    # a slice of the decoder layers (the embedding on the first, final norm + head + loss on the last) and run
    # ``pp_microbatches`` micro-batches of ``micro_batch_size`` rows per optimizer step in ``pp_schedule``'s order
    # (0 = pp micro-batches); ``pp_virtual`` stages per rank under interleaved 1F1B (0 = 2 there, 1 otherwise).
    # The remaining world_size / pp ranks are data parallel: method ``single`` (none: world_size == pp) or
    # ``fsdp`` (FSDP2 over the dp ranks of each stage); method ``tp`` splits each stage over tp ranks, ``dp_tp``
    # both (torchtitan's mesh (pp, dp, tp): FSDP2 over dp of each stage's TP-split layers).
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 0
    pp_virtual: int = 0
    # Which engine runs the pipeline: ``torch`` (torch.distributed.pipelining, above) or ``deepspeed`` (DeepSpeed's
    # PipelineModule + PipelineEngine: its parameter-balanced layer split, TrainSchedule, its buffers; method single,
    # or ddp over world_size / pp data-parallel ranks per stage, ZeRO stage 0, pp_schedule 1f1b, the micro-batches
    # its gradient accumulation steps).
    pp_engine: str = "torch"

    def __post_init__(self) -> None:
        _check_choice("method", self.method, METHODS)
        _check_positive_int("world_size", self.world_size)
        _check_positive_int("tp", self.tp)
        _check_positive_int("pp", self.pp)
        if self.method == "single" and self.world_size != self.pp:
            _fail("world_size", f"method 'single' runs on 1 GPU (one per pipeline stage rank under pp), got "
                                f"{self.world_size}" + (f" with pp {self.pp}" if self.pp > 1 else ""))
        if self.world_size % self.tp:
            _fail("tp", f"world size {self.world_size} is not divisible by tp {self.tp}")
        if self.method == "tp" and self.tp * self.pp != self.world_size:
            _fail("tp", f"method 'tp' uses every GPU for tensor parallelism: tp must equal world size "
                        f"{self.world_size}" + (f" / pp {self.pp}" if self.pp > 1 else "")
                  + f", got {self.tp} (use dp_tp for a 2-D split)")
        if self.method == "dp_tp" and (self.tp < 2 or self.tp * self.pp >= self.world_size):
            _fail("tp", "dp_tp needs 1 < tp < world size" + (f" / pp {self.pp}" if self.pp > 1 else "")
                  + f", got tp={self.tp} on {self.world_size} GPUs")
        if self.method == "fsdp1" and self.world_size % self.fsdp1.shard_size(self.world_size):
            _fail("fsdp1.gpus_per_node", f"HYBRID_SHARD needs whole nodes: world size {self.world_size} is not a "
                                         f"multiple of {self.fsdp1.gpus_per_node} GPUs per node")
        if self.method not in ("tp", "dp_tp") and self.tp != 1:
            _fail("tp", f"method {self.method!r} has no tensor parallelism: tp must be 1, got {self.tp}")
        _check_positive_int("ep", self.ep)
        if self.ep > 1 and self.method != "fsdp":
            _fail("ep", f"expert parallelism runs with FSDP2 (transformers needs ep to divide fsdp_size): use method "
                        f"fsdp, got {self.method!r}")
        if self.world_size % self.ep:
            _fail("ep", f"world size {self.world_size} is not divisible by ep {self.ep}")
        if isinstance(self.moe_imbalance, bool) or not isinstance(self.moe_imbalance, (int, float)) \
                or not self.moe_imbalance >= 1:
            _fail("moe_imbalance", f"must be a number >= 1 (1 = balanced routing), got {self.moe_imbalance!r}")
        _check_positive_int("cp", self.cp)
        if self.cp > 1:
            try:
                check_cp(self.cp, self.method, self.world_size, 2 * self.cp, "bf16", "sdpa", tp=self.tp, ep=self.ep)
            except ValueError as err:
                _fail("cp", str(err).removeprefix("cp: "))

        self._check_pipeline()

    def _check_pipeline(self) -> None:
        _check_choice("pp_schedule", self.pp_schedule, PP_SCHEDULES)
        for name in ("pp_microbatches", "pp_virtual"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                _fail(name, f"must be a positive integer (0: the default), got {value!r}")
        _check_choice("pp_engine", self.pp_engine, PP_ENGINES)
        if self.pp == 1:
            if self.pp_schedule != "1f1b" or self.pp_microbatches or self.pp_virtual or self.pp_engine != "torch":
                _fail("pp", "pipeline settings (pp_schedule, pp_microbatches, pp_virtual, pp_engine) need pp > 1")
            return
        if self.pp_engine == "deepspeed":
            self._check_deepspeed_pipeline()
            return
        if self.method not in ("single", "fsdp", "tp", "dp_tp"):
            _fail("pp", f"pipeline parallelism is modelled alone (method single, world size = pp), with FSDP2 "
                        f"over the remaining ranks (method fsdp), with TP inside each stage (method tp, world "
                        f"size = pp x tp) or with both (method dp_tp, world size = pp x dp x tp), got {self.method!r}")
        if self.ep > 1:
            _fail("pp", "pp with expert parallelism is not modelled")
        if self.cp > 1:
            _fail("pp", "pp with context parallelism is not modelled")
        if self.world_size % self.pp:
            _fail("pp", f"world size {self.world_size} is not divisible by pp {self.pp}")
        if self.world_size % (self.pp * self.tp):
            _fail("pp", f"world size {self.world_size} is not divisible by pp {self.pp} x tp {self.tp} (the mesh "
                        "(pp, dp, tp))")
        if self.pp_schedule != "interleaved_1f1b" and self.pp_virtual > 1:
            _fail("pp_virtual", f"virtual stages need pp_schedule interleaved_1f1b, got {self.pp_schedule!r}")
        m = self.microbatches
        if self.pp_schedule == "1f1b" and m < self.pp:
            _fail("pp_microbatches", f"torch's 1F1B needs at least as many micro-batches as stages ({self.pp}), "
                                     f"got {m}")
        if self.pp_schedule == "interleaved_1f1b" and m % max(1, m // self.pp):
            _fail("pp_microbatches", f"interleaved 1F1B needs the micro-batches to be a multiple of its rounds "
                                     f"(max(1, {m} // pp {self.pp}) = {max(1, m // self.pp)}), got {m}")

    def _check_deepspeed_pipeline(self) -> None:
        """What DeepSpeed's pipeline engine is modelled with (one line per refusal)."""
        if self.method not in ("single", "ddp"):
            _fail("pp_engine", f"DeepSpeed's pipeline engine is modelled with ZeRO stage 0: one rank per stage "
                               f"(method single, world size = pp) or data parallel over each stage's ranks (method "
                               f"ddp, world size = pp x dp), got method {self.method!r} (DeepSpeed refuses ZeRO-2/3 "
                               "under pipelines; ZeRO-1 is not modelled yet)")
        if self.world_size % self.pp:
            _fail("pp", f"world size {self.world_size} is not divisible by pp {self.pp}")
        if self.pp_schedule != "1f1b" or self.pp_virtual:
            _fail("pp_engine", "DeepSpeed's pipeline engine runs its own TrainSchedule (1F1B, no virtual stages): "
                               "leave pp_schedule at 1f1b and pp_virtual at 0")

    @property
    def microbatches(self) -> int:
        """Pipeline micro-batches per optimizer step (pp_microbatches, default pp); 1 without pp."""
        return self.pp_microbatches or self.pp

    @property
    def virtual_stages(self) -> int:
        """Stages per pipeline rank (pp_virtual, default 2 under interleaved 1F1B, else 1)."""
        return self.pp_virtual or (2 if self.pp_schedule == "interleaved_1f1b" else 1)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def zero_stage(self) -> int:
        return {"zero1": 1, "zero2": 2, "zero3": 3}.get(self.method, 2 if self.method == "zero_offload" else 0)


@dataclass(frozen=True)
class RunSpec:
    """One fine-tuning configuration: a model (catalogue name, config.json path or hub id), how it is
    parallelised, how it trains, and the GPU type it runs on."""

    model: str = "facebook/opt-1.3b"
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    training: TrainingSpec = field(default_factory=TrainingSpec)
    gpu: str = "h100-80gb"
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            _fail("model", "must name a catalogue model, a config.json path or a hub id")
        if not isinstance(self.gpu, str) or not self.gpu.strip():
            _fail("gpu", "must be a GPU key such as h100-80gb")
        if self.training.ce != "standard" and self.parallel.tp > 1:
            _fail("ce", "a chunked or fused loss over a tensor-parallel head is not modelled (use tp 1)")
        t = self.training
        if t.lora and (t.ce != "standard" or t.activation_offload or t.ckpt_policy) and self.parallel.method != "single":
            _fail("parallel.method", "the long-context techniques with LoRA are checked on one GPU only (method single)")
        if self.parallel.cp > 1:
            try:
                check_cp(self.parallel.cp, self.parallel.method, self.parallel.world_size, self.training.seq_len,
                         self.training.precision, self.training.attn, tp=self.parallel.tp, ep=self.parallel.ep,
                         qlora=self.training.qlora,
                         padded=self.training.batch == "padded")
            except ValueError as err:
                _fail("cp", str(err).removeprefix("cp: "))
        if self.training.qlora and not self.training.qlora_kbit_prep and self.parallel.method not in (
                "single", "ddp", "fsdp1"):
            # DeepSpeed casts the whole model to its dtype whatever the recipe: QLoRA under ZeRO is peft's recipe only
            _fail("lora_dtype" if self.training.qlora_prep == "auto" else "qlora_prep",
                  f"QLoRA without kbit preparation is modelled on one GPU, DDP or FSDP1, not {self.parallel.method}")
        if self.parallel.method not in ("single", "ddp"):
            # traced and checked on one GPU's trace only (benchmarks/qlora_bf16_check.py --lightning)
            if self.training.qlora_quantizer != "transformers":
                _fail("qlora_quantizer", f"Lightning's QLoRA quantization is modelled on one GPU or DDP, not "
                                         f"{self.parallel.method}")
            if self.training.qlora_keeps_inputs:
                _fail("qlora_bnb", f"bitsandbytes before 0.43.2 (4-bit inputs kept for backward) is modelled on one "
                                   f"GPU or DDP, not {self.parallel.method}")
        if self.training.qlora_kbit_prep and self.parallel.method == "fsdp1":
            # FSDP1 flattens one dtype per unit: peft's kbit preparation leaves fp32 norms beside the packed weights.
            _fail("qlora", "fsdp1 shards 4-bit weights only as answer.ai's fsdp_qlora builds them (lora_dtype model: "
                           "no kbit preparation, 16-bit quant_storage and norms); peft's recipe mixes fp32 norms into "
                           "each layer's flat parameter (docs/fsdp1_qlora.md); use single, ddp or a ZeRO method")
        if self.training.qlora and self.parallel.method in QLORA_UNSUPPORTED_METHODS:
            _fail("qlora", f"bitsandbytes 4-bit weights cannot be sharded by {self.parallel.method} here (FSDP2 and "
                           "DTensor cannot wrap Params4bit); use single, ddp or a ZeRO method")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def _canonical_dict(self) -> dict[str, Any]:
        """to_dict without the settings of a method not used, nor settings added later at their default (FSDP1's
        ``lora_wrap``, ``ep``, ``moe_imbalance``, ``cp``, ``outputs_fp32``, ``lora_dropout``, ``grad_sync``, ``model_code``, ``use_cache``,
        the long-context techniques, ``ckpt_reentrant``, ``vocab_size``, ``full_range_slices``, ``lora_dtype``,
        ``qlora_prep``, ``qlora_quantizer``, ``qlora_bnb``, ``memory_cap_bytes``, ZeRO-3's leaf modules):
        ids stay as they were."""
        data = self.to_dict()
        if self.parallel.method != "fsdp1":
            data["parallel"].pop("fsdp1")
        elif self.parallel.fsdp1.lora_wrap == "adapter":
            data["parallel"]["fsdp1"].pop("lora_wrap")
        if self.parallel.ep == 1:
            data["parallel"].pop("ep")
        if self.parallel.moe_imbalance == 1:
            data["parallel"].pop("moe_imbalance")
        if self.parallel.cp == 1:
            data["parallel"].pop("cp")
        for name, default in (("pp", 1), ("pp_schedule", "1f1b"), ("pp_microbatches", 0), ("pp_virtual", 0),
                              ("pp_engine", "torch")):
            if data["parallel"][name] == default:
                data["parallel"].pop(name)
        for name in ("outputs_fp32", "lora_dropout", "model_code", "use_cache", "activation_offload", "ckpt_policy",
                     "ckpt_reentrant", "vocab_size", "full_range_slices", "memory_cap_bytes"):
            if not getattr(self.training, name):
                data["training"].pop(name)
        if self.training.ce == "standard":
            data["training"].pop("ce")
        if self.training.lora_dtype == "auto":
            data["training"].pop("lora_dtype")
        if self.training.qlora_prep == "auto":
            data["training"].pop("qlora_prep")
        if self.training.qlora_quantizer == "transformers":
            data["training"].pop("qlora_quantizer")
        if not self.training.qlora_bnb:
            data["training"].pop("qlora_bnb")
        if self.training.ce != "chunked":
            data["training"].pop("ce_chunks")
        if self.training.grad_sync == "every":
            data["training"].pop("grad_sync")
        for name in LEAF_FIELDS:  # added later: at DeepSpeed's default, ids stay as they were
            if getattr(self.parallel.zero, name) == getattr(ZeroSpec, name):
                data["parallel"]["zero"].pop(name)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2)

    @property
    def spec_id(self) -> str:
        """Stable id: a hash of the canonical JSON (the same spec always lands in the same run dir)."""
        canonical = json.dumps(self._canonical_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSpec:
        data = dict(data)
        version = data.pop("schema_version", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            _fail("schema_version", f"spec schema {version} is not supported (this build reads {SCHEMA_VERSION})")
        parallel = dict(data.pop("parallel", {}) or {})
        zero = _build(ZeroSpec, parallel.pop("zero", {}) or {}, "parallel.zero")
        fsdp1 = _build(Fsdp1Spec, parallel.pop("fsdp1", {}) or {}, "parallel.fsdp1")
        return cls(
            parallel=_build(ParallelSpec, {**parallel, "zero": zero, "fsdp1": fsdp1}, "parallel"),
            training=_build(TrainingSpec, data.pop("training", {}) or {}, "training"),
            **_known(cls, data, ""),
        )

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        return cls.from_dict(json.loads(text))

    def replace(self, **changes: Any) -> RunSpec:
        """Copy with top-level or dotted changes: ``spec.replace(**{"training.seq_len": 1024})``."""
        top = {k: v for k, v in changes.items() if "." not in k}
        nested: dict[str, dict[str, Any]] = {}
        for key, value in changes.items():
            if "." in key:
                head, tail = key.split(".", 1)
                nested.setdefault(head, {})[tail] = value
        for head, sub in nested.items():
            top[head] = dataclasses.replace(getattr(self, head), **sub)
        return dataclasses.replace(self, **top)


def _known(cls: type, data: dict[str, Any], prefix: str) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        _fail(f"{prefix}{unknown[0]}", f"unknown field (known: {', '.join(sorted(names))})")
    return data


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    return cls(**_known(cls, data, prefix + "."))
