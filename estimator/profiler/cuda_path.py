"""Trace the kernels a CUDA run executes, not the ones a CPU trace would pick.

Profiles are traced on fake CPU tensors, but two composite ops of a transformer choose their kernels by device,
and the tensors the chosen kernel keeps for backward differ (docs/error_matrix/README.md, Findings 2-4):

* ``F.dropout``: on CUDA ``native_dropout`` (the mask it keeps is ``bool``); on CPU ``bernoulli_`` in the input's
  dtype times the input (a 4-byte mask per element in fp32, 2 in bf16).
* ``F.scaled_dot_product_attention``: CUDA's dispatcher (``select_sdp_backend`` in
  aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, torch 2.13, sm80/sm90) tries, in order,
  FlashAttention (16-bit inputs, no explicit mask, equal head dims <= 256, grouped-query heads allowed),
  memory-efficient attention (any float dtype, masks allowed, head dims aligned to 8 elements in 16 bits and 4 in
  fp32, equal head counts: grouped-query heads are not taken in torch 2.13) and the math composite. cuDNN, tried
  first on sm90, keeps what flash keeps (output + fp32 logsumexp). The CPU dispatcher instead runs its own
  flash kernel for any dtype and head count unless dropout is asked for (then math). The differences that
  matter: fp32 + GQA runs math on CUDA ((b, h, s, s) probabilities saved per layer); attention dropout runs
  flash on CUDA but math on CPU; the memory-efficient output is laid out (b, s, h, d), so transformers'
  ``transpose(1, 2).contiguous()`` after it is free on CUDA, while the CPU flash output follows the query's
  layout and may need a copy.

* ``torch._grouped_mm`` (``F.grouped_mm``; transformers' MoE experts on CUDA SM80+): CUDA runs its CUTLASS kernel
  for bf16 and otherwise ``_grouped_mm_fallback`` (aten/src/ATen/native/cuda/GroupedBlas.cpp: one output
  tensor, a ``mm_out`` per group), with the same autograd formula (mat_a and mat_b saved; backward makes one
  gradient per input). The meta kernel accepts only bf16, so other dtypes are traced through
  ``_GroupedMMFallback``, which allocates what the fallback allocates.

* ``softmax`` / ``log_softmax`` with ``dtype=torch.float32`` on an fp16 input (eager attention's
  ``softmax(scores, dtype=torch.float32)``; CUDA autocast's fp32-result policy gives every fp16 softmax that
  dtype): CUDA runs one kernel that reads fp16 and writes fp32 (``at::_softmax(input, dim, half_to_float=true)``,
  aten/src/ATen/native/SoftMax.cpp; fp16 only, not bf16), and its backward (``_softmax_backward_data`` with
  ``input_dtype`` fp16) returns the fp16 gradient directly. The CPU composite casts the input to fp32 first: a
  scores-sized fp32 copy in forward, and in backward an fp32 gradient then its fp16 cast. ``cuda_softmax()``
  registers the CUDA branch for the duration.

* Autocast: CUDA's op lists (aten/src/ATen/autocast_mode.h, ``AT_FORALL_FP32`` and
  ``AT_FORALL_FP32_SET_OPT_DTYPE``) run layer_norm, group_norm, exp, log, pow, rsqrt, the losses and logsumexp in
  fp32, and softmax, log_softmax, sum, cumsum and prod with an fp32 result; CPU autocast's lists leave most of
  them in 16 bits (docs/error_matrix/README.md, Finding 7). ``cuda_autocast_lists()`` registers CUDA's policy
  for them at the AutocastCPU dispatch key for the duration, so the CPU autocast of a trace runs CUDA's program.

``cuda_composites()`` swaps these functions for the duration with ones that call the op CUDA would run; the op's
meta kernel then gives, on fake tensors, the tensors CUDA returns and autograd saves. Under autocast the
attention inputs are cast first, as CUDA's autocast does for ``scaled_dot_product_attention``. Not reproduced:
kernel workspaces inside an op (FlashAttention backward's fp32 accumulators; GPU-only like the cuBLAS
workspace), and the few bytes of random-number state the meta kernels put on the device (<= 24 B per call).
Only for fake-tensor traces: real CPU tensors cannot run the CUDA ops.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

_SIXTEEN_BIT = (torch.float16, torch.bfloat16)
# The SDPA backends chosen while a ``backends_seen()`` block is open (a profile records them).
_SEEN: list[set[str]] = []
_FLASH_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class AttentionCall:
    """What CUDA's SDPA dispatcher looks at, read from one call's arguments."""

    dtype: torch.dtype
    heads_q: int
    heads_k: int
    heads_v: int
    head_dim_qk: int
    head_dim_v: int
    square: bool
    has_mask: bool
    is_causal: bool
    enable_gqa: bool

    @classmethod
    def of(cls, query, key, value, attn_mask, is_causal: bool, enable_gqa: bool) -> AttentionCall:
        return cls(query.dtype, query.size(-3), key.size(-3), value.size(-3), query.size(-1), value.size(-1),
                   query.size(-2) == key.size(-2), attn_mask is not None, is_causal, enable_gqa)

    @property
    def equal_heads(self) -> bool:
        return self.heads_q == self.heads_k == self.heads_v

    @property
    def grouped_heads_ok(self) -> bool:
        return self.enable_gqa and self.heads_k == self.heads_v and self.heads_q % self.heads_k == 0


def cuda_backend(call: AttentionCall) -> str:
    """'flash' | 'efficient' | 'math' for a dense, non-nested call (see the module doc)."""
    flash = (call.dtype in _SIXTEEN_BIT and not call.has_mask and (call.equal_heads or call.grouped_heads_ok)
             and call.head_dim_qk == call.head_dim_v <= _FLASH_MAX_HEAD_DIM
             and (call.square or not call.is_causal))
    if flash:
        return "flash"
    alignment = 8 if call.dtype in _SIXTEEN_BIT else 4
    if call.equal_heads and call.head_dim_qk % alignment == 0 and call.head_dim_v % alignment == 0:
        return "efficient"
    return "math"


def _autocast_inputs(*tensors):
    """CUDA's autocast runs ``scaled_dot_product_attention`` in its lower-precision dtype; the trace's CPU
    autocast stands in for it (the profiler enters ``torch.autocast("cpu")`` for ``amp_*``)."""
    if not torch.is_autocast_enabled("cpu"):
        return tensors
    dtype = torch.get_autocast_dtype("cpu")
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors)


def _float_mask(mask, dtype):
    """A boolean mask becomes additive (0 where attended, -inf elsewhere) in the attention dtype, as the CUDA
    composite converts it before any kernel."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask.logical_not(), -math.inf, torch.zeros((), dtype=dtype, device=mask.device))


def _aligned_bias(mask, query, key):
    """The memory-efficient kernel wants the bias's rows 16-byte aligned: an unaligned last dim is padded to a
    multiple of 8 and sliced back, then the bias is broadcast to (b, h, L, S)."""
    aligned = mask.stride(-1) == 1 and all(stride % 8 == 0 for stride in mask.stride()[:-1])
    if not aligned:
        length = mask.size(-1)
        mask = F.pad(mask, (0, 8 - length % 8))[..., :length]
    return mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))


def _flash(query, key, value, dropout_p, is_causal, scale):
    head_dim = query.size(-1)
    pad = -head_dim % 8  # the composite pads the head dim to a multiple of 8 for the kernel
    padded = [F.pad(t, (0, pad)) if pad else t for t in (query, key, value)]
    scale = scale if scale is not None else head_dim ** -0.5
    out = torch.ops.aten._scaled_dot_product_flash_attention(*padded, dropout_p, is_causal, False, scale=scale)[0]
    return out[..., :head_dim] if pad else out


_FA2_TARGET: list[torch.dtype] = []  # FlashAttention-2's dtype for fp32 inputs, while ``flash_attention_2`` runs


@contextlib.contextmanager
def flash_attention_2(target_dtype: torch.dtype) -> Iterator[None]:
    """The attention calls run as transformers runs FlashAttention-2 (``integrations/flash_attention.py``): fp32
    query, key and value (peft's QLoRA keeps the residual stream fp32) are cast to ``target_dtype`` (the
    quantized model's ``config.dtype``, ``get_target_dtype``) before the kernel, which returns that dtype. The
    casts keep the layout (heads second-to-last in memory), so the flash kernel's output needs no copy."""
    _FA2_TARGET.append(target_dtype)
    try:
        yield
    finally:
        _FA2_TARGET.pop()


def sdpa_as_on_cuda(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    """``F.scaled_dot_product_attention`` taking the CUDA dispatcher's kernel."""
    query, key, value, attn_mask = _autocast_inputs(query, key, value, attn_mask)
    if _FA2_TARGET and query.dtype == torch.float32:
        query, key, value = (t.to(_FA2_TARGET[-1]) for t in (query, key, value))
    with torch.autocast("cpu", enabled=False):
        backend = cuda_backend(AttentionCall.of(query, key, value, attn_mask, is_causal, enable_gqa))
        for seen in _SEEN:
            seen.add(backend)
        if backend == "flash":
            return _flash(query, key, value, dropout_p, is_causal, scale)
        bias = _float_mask(attn_mask, query.dtype)
        if backend == "efficient":
            bias = _aligned_bias(bias, query, key) if bias is not None else None
            wants_lse = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, bias, wants_lse, dropout_p, is_causal, scale=scale)[0]
        with _MathAsOnCuda():
            return torch.ops.aten._scaled_dot_product_attention_math(
                query, key, value, bias, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]


class _MathAsOnCuda(TorchDispatchMode):
    """The math composite (``_scaled_dot_product_attention_math``, aten/src/ATen/native/transformers/attention.cpp)
    allocates differently on fake tensors than on CUDA ones, because it branches on tensor subclasses:

    * the mask is added to the scores with ``attn.add_(mask)`` unless a tensor is subclass-like (a fake tensor
      is), then out of place: the trace would hold a second (b, h, L, S) tensor the GPU never allocates;
    * ``_safe_softmax`` is one op with a meta kernel on fake tensors; on CUDA its composite body runs, and next to
      the softmax output it allocates ``self.eq(-inf)`` (bool, (b, h, L, S)), ``all(masked, dim, keepdim)``
      (bool, (b, h, L, 1)) and a 0-dim zero, freed before the scores are.

    The H100 snapshot of Qwen2.5-0.5B fp32 (grouped-query heads: the math kernel) shows exactly that per layer:
    scores, softmax output, a 1-byte (b, h, L, S) tensor, a (b, h, L) one and 4 B, then the three freed and the
    scores; in the fake trace the scores, a second scores-sized tensor and the output. The 56 MiB masks change which
    cached blocks the step's later requests split: the generated stream's reserved peak was 7 % low."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.add.Tensor and not kwargs and _adds_in_place(*args):
            scores, mask = args
            scores.add_(mask)
            return torch.ops.aten.alias.default(scores)  # the same storage: no allocation, as on CUDA
        out = func(*args, **kwargs)
        if func is torch.ops.aten._safe_softmax.default:
            scores, dim = args[0], args[1]
            masked = scores.eq(-math.inf)
            rows = masked.all(dim, keepdim=True)
            zero = torch.zeros((), dtype=out.dtype, device=out.device)
            del zero, rows, masked  # freed in this order before _safe_softmax returns
        return out


def _adds_in_place(scores, mask) -> bool:
    """``attn.add_(mask)``: a floating mask that broadcasts to the scores' shape and dtype."""
    return (isinstance(scores, torch.Tensor) and isinstance(mask, torch.Tensor) and scores.dim() == 4
            and mask.is_floating_point() and mask.dtype == scores.dtype
            and tuple(torch.broadcast_shapes(scores.shape, mask.shape)) == tuple(scores.shape))


def _grouped_mm_shape(a, b) -> tuple[int, ...]:
    """Output shape of ``_grouped_mm`` (2D x 3D: (S, N); 3D x 3D: (G, M, N); 2D x 2D with offs: (G, M, N), G
    the number of groups; 3D x 2D: (M, N))."""
    if a.dim() == 2 and b.dim() == 3:
        return a.size(0), b.size(-1)
    if a.dim() == 3 and b.dim() == 3:
        return a.size(0), a.size(1), b.size(-1)
    if a.dim() == 3 and b.dim() == 2:
        return a.size(1), b.size(-1)
    raise NotImplementedError("grouped_mm: 2D x 2D groups need offs' length")


class _GroupedMMFallback(torch.autograd.Function):
    """What CUDA's ``_grouped_mm_fallback`` allocates: the output, and in backward one gradient per input that
    needs it; mat_a and mat_b saved (the values are never read: fake tensors)."""

    @staticmethod
    def forward(ctx, a, b, out_dtype):
        ctx.save_for_backward(a, b)
        dtype = out_dtype or a.dtype
        shape = _grouped_mm_shape(a, b)
        # CUDA pads the output's rows to 16 bytes (GroupedBlas.cpp's output tensor, as the meta kernel of a CUDA
        # build makes it)
        align = 16 // dtype.itemsize
        row = (shape[-1] + align - 1) // align * align
        stride = (shape[1] * row, row, 1) if len(shape) == 3 else (row, 1)
        return a.new_empty_strided(shape, stride, dtype=dtype)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad_a = a.new_empty(a.shape) if ctx.needs_input_grad[0] else None
        grad_b = b.new_empty(b.shape) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b, None


def grouped_mm_as_on_cuda(mat_a, mat_b, *, offs=None, bias=None, out_dtype=None):
    """``F.grouped_mm`` / ``torch._grouped_mm`` as CUDA runs it: the bf16 kernel's meta, else the fallback."""
    if mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16 and out_dtype in (None, torch.bfloat16):
        return _ORIGINAL_GROUPED_MM(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
    if bias is not None:
        raise NotImplementedError("grouped_mm: a bias on the fallback path is not traced")
    return _GroupedMMFallback.apply(mat_a, mat_b, out_dtype)


_ORIGINAL_GROUPED_MM = torch._grouped_mm


def dropout_as_on_cuda(input, p=0.5, training=True, inplace=False):
    """``F.dropout`` as CUDA runs it: ``native_dropout`` keeps a bool mask (0 < p < 1, training)."""
    if not training or p == 0.0 or input.numel() == 0:
        return input
    if p == 1.0:
        return input.mul_(0.0) if inplace else input * 0.0
    out = torch.ops.aten.native_dropout(input, p, True)[0]
    return input.copy_(out) if inplace else out


@contextlib.contextmanager
def backends_seen() -> Iterator[set[str]]:
    """The set of SDPA backends ``sdpa_as_on_cuda`` picks inside the block."""
    seen: set[str] = set()
    _SEEN.append(seen)
    try:
        yield seen
    finally:
        _SEEN.remove(seen)


# CUDA autocast's fp32 policy (``AT_FORALL_FP32``): 16-bit floating inputs are cast to fp32. Overloads as
# ``name`` or ``name.overload``; upsampling and the rarer norms are left out (no transformer runs them).
_FP32_OPS = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
             "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus",
             "layer_norm", "native_layer_norm", "group_norm", "cosine_similarity", "poisson_nll_loss",
             "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss",
             "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
             "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits",
             "dist", "pdist", "cdist", "renorm", "logsumexp")
# ``AT_FORALL_FP32_SET_OPT_DTYPE``: a 16-bit input with no ``dtype`` given runs with ``dtype=torch.float32``.
_FP32_RESULT_OPS = ("prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
                    "linalg_vector_norm", "sum", "sum.dim_IntList")


def _aten(name: str):
    op, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, op), overload or "default")


def _to_fp32(value):
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in _SIXTEEN_BIT else value
    if isinstance(value, (list, tuple)):
        return type(value)(_to_fp32(v) for v in value)
    return value


_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _fp32_policy(op):
    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            return op(*_to_fp32(args), **{k: _to_fp32(v) for k, v in kwargs.items()})
    return kernel


def _fp32_result_policy(op):
    at = [a.name for a in op._schema.arguments].index("dtype")

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            given = args[at] if len(args) > at else kwargs.get("dtype")
            if given is None and isinstance(args[0], torch.Tensor) and args[0].dtype in _SIXTEEN_BIT:
                if len(args) > at:
                    args = (*args[:at], torch.float32, *args[at + 1:])
                else:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)
    return kernel


@contextlib.contextmanager
def cuda_autocast_lists() -> Iterator[None]:
    """CPU autocast applies CUDA autocast's fp32 policies for the duration (see the module doc): a dispatcher
    registration at AutocastCPU, removed on exit. Outside an autocast region nothing changes."""
    import warnings

    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # each registration overrides CPU autocast's own kernel, and says so
            warnings.simplefilter("ignore")
            for name in _FP32_OPS:
                library.impl(name, _fp32_policy(_aten(name)), "AutocastCPU")
            for name in _FP32_RESULT_OPS:
                library.impl(name, _fp32_result_policy(_aten(name)), "AutocastCPU")
        yield
    finally:
        library._destroy()


def _softmax_policy(op):
    """``softmax.int`` / ``log_softmax.int`` as CUDA's composite runs them (see the module doc)."""
    def kernel(input, dim, dtype=None):
        half_to_float = input.dtype == torch.float16 and dtype == torch.float32
        converted = input if half_to_float or dtype is None else input.to(dtype)
        return op(converted, dim, half_to_float)
    return kernel


@contextlib.contextmanager
def cuda_softmax() -> Iterator[None]:
    """fp16 -> fp32 softmax and log_softmax in one kernel, as on CUDA, for the duration: a registration at
    AutogradCPU, which takes precedence over the composite's (fake tensors only: the CPU kernel refuses
    ``half_to_float``)."""
    import warnings

    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # the composite's kernel is overridden, and the dispatcher says so
            warnings.simplefilter("ignore")
            library.impl("softmax.int", _softmax_policy(torch.ops.aten._softmax.default), "AutogradCPU")
            library.impl("log_softmax.int", _softmax_policy(torch.ops.aten._log_softmax.default), "AutogradCPU")
        yield
    finally:
        library._destroy()


@contextlib.contextmanager
def cuda_composites() -> Iterator[None]:
    """``F.scaled_dot_product_attention``, ``F.dropout``, grouped matmuls and fp16 -> fp32 softmax run CUDA's
    kernels, and autocast CUDA's op lists, for the duration (fake tensors)."""
    originals = F.scaled_dot_product_attention, F.dropout, getattr(F, "grouped_mm", None), torch._grouped_mm
    F.scaled_dot_product_attention, F.dropout = sdpa_as_on_cuda, dropout_as_on_cuda
    torch._grouped_mm = grouped_mm_as_on_cuda
    if originals[2] is not None:
        F.grouped_mm = grouped_mm_as_on_cuda
    try:
        with cuda_autocast_lists(), cuda_softmax():
            yield
    finally:
        F.scaled_dot_product_attention, F.dropout = originals[:2]
        torch._grouped_mm = originals[3]
        if originals[2] is not None:
            F.grouped_mm = originals[2]
