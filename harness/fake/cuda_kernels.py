"""Run the CUDA path's kernels on fake CPU tensors: what CUDA saves for backward, not what the CPU kernels save.

A trace on fake *CPU* tensors runs the CPU choices of two composite ops whose CUDA choice differs:

* ``F.scaled_dot_product_attention``: on CPU, ``_fused_sdp_choice`` picks the CPU flash kernel (GQA natively,
  any mask) or the math kernel (any dropout). On CUDA, ``select_sdp_backend`` (aten/src/ATen/native/
  transformers/cuda/sdp_utils.cpp) tries flash (fp16/bf16, no mask, head dim <= 256, equal q/k/v head dims,
  GQA allowed), memory-efficient (any float dtype, masks, head dim a multiple of 8 for 16 bits and 4 for fp32,
  *no* GQA in torch 2.13: the docstring of ``F.scaled_dot_product_attention`` says GQA "works only for
  Flash_attention and math kernel on CUDA tensor" and its backward meta kernel returns key-shaped grads with
  the query's head count), then math. sm90 with cuDNN > 9.15 tries cuDNN first (16 bits, dropout a multiple
  of 1/16); cuDNN saves the same bytes as flash (output, fp32 logsumexp of (b, h, s, 1)), so flash stands
  for both here.
* ``F.dropout``: on CUDA the composite calls ``native_dropout`` (a bool mask is saved); on CPU it draws a
  mask in the input's dtype (``bernoulli_``) and multiplies.

* Autocast: CUDA's autocast runs layer_norm, exp, log, pow, rsqrt, logsumexp and the losses in fp32 and gives
  softmax, log_softmax, sum, cumsum and prod an fp32 result (``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``
  in aten/src/ATen/autocast_mode.h); CPU autocast keeps most of them in 16 bits. ``cuda_kernels()`` applies
  CUDA's rule to the Python functions a model calls (they are replaced for the duration), while CPU autocast
  is on.

* ``softmax`` / ``log_softmax`` of an fp16 input with ``dtype=torch.float32`` (eager attention asks for it; CUDA's
  autocast gives every fp16 softmax that dtype): CUDA's composite (aten/src/ATen/native/SoftMax.cpp) runs
  ``_softmax(input, dim, half_to_float=True)``, one kernel from fp16 to fp32 whose backward returns the fp16
  gradient; the CPU composite casts the input to fp32 first. fp16 only, not bf16.

``cuda_kernels()`` replaces both functions for the duration with the CUDA choice, calling the CUDA ops
(``_scaled_dot_product_flash_attention``, ``_scaled_dot_product_efficient_attention``, ``native_dropout``),
whose meta kernels give on fake tensors exactly the tensors the CUDA kernels return and autograd saves
(flash: logsumexp (b, h, s) fp32; memory-efficient: logsumexp padded to a multiple of 32 positions, the
additive mask padded to a multiple of 8 columns). Not emulated: kernel workspaces inside an op (flash
backward's fp32 ``dq_accum`` and GQA ``dk/dv_expanded``, cuDNN's workspace), which no fake trace sees, and
the philox seed/offset, which the meta kernels put on the device (24 B per call) while CUDA keeps them on the
host when not capturing a graph. CUDA needs no real GPU here: fake tensors on the ``cuda`` device cannot run
autograd in a CPU-only build of torch ("PyTorch is not linked with support for cuda devices").
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

_HALF = (torch.float16, torch.bfloat16)


def sdpa_backend(query, key, value, attn_mask, dropout_p: float, is_causal: bool, enable_gqa: bool) -> str:
    """'flash' | 'efficient' | 'math': the backend CUDA (sm80/sm90, torch 2.13) selects for dense inputs."""
    heads_q, heads_k, heads_v = query.size(-3), key.size(-3), value.size(-3)
    same_heads = heads_q == heads_k == heads_v
    gqa_ok = same_heads or (enable_gqa and heads_k == heads_v and heads_q % heads_k == 0)
    dims = query.size(-1), key.size(-1), value.size(-1)
    square = query.size(-2) == key.size(-2)
    if (query.dtype in _HALF and attn_mask is None and gqa_ok and dims[0] == dims[1] == dims[2] <= 256
            and (square or not is_causal)):
        return "flash"
    alignment = 8 if query.dtype in _HALF else 4
    if same_heads and dims[0] == dims[1] and dims[0] % alignment == 0 and dims[2] % alignment == 0:
        return "efficient"
    return "math"


def _additive_mask(attn_mask, dtype: torch.dtype):
    """``convert_boolean_attn_mask``: a bool mask becomes 0 / -inf in the query's dtype."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    zero = torch.zeros((), dtype=dtype, device=attn_mask.device)
    return torch.where(attn_mask.logical_not(), -math.inf, zero)


def _efficient_mask(mask, query, key):
    """``preprocess_mask``: pad the last dim to a multiple of 8 unless aligned, then expand to (b, h, L, S)."""
    strides_aligned = all(st % 8 == 0 for st in mask.stride()[:-1]) and mask.stride(-1) == 1
    if not strides_aligned:
        last = mask.size(-1)
        mask = F.pad(mask, (0, 8 - last % 8))[..., :last]
    return mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))


def cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` as the CUDA composite runs it (see the module doc). Under autocast CUDA
    casts its inputs to the autocast dtype first (``scaled_dot_product_attention`` is on CUDA autocast's
    lower-precision list); the oracle's CPU autocast stands in for CUDA's."""
    if torch.is_autocast_enabled("cpu"):
        low = torch.get_autocast_dtype("cpu")
        query, key, value = (t.to(low) for t in (query, key, value))
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(low)
        with torch.autocast("cpu", enabled=False):
            return cuda_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    backend = sdpa_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    aten = torch.ops.aten
    if backend == "flash":
        head_dim = query.size(-1)
        pad = (8 - head_dim % 8) % 8
        if scale is None:
            scale = 1.0 / math.sqrt(head_dim)
        q, k, v = (F.pad(t, (0, pad)) if pad else t for t in (query, key, value))
        out = aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        return out[..., :head_dim] if pad else out
    mask = _additive_mask(attn_mask, query.dtype)
    if backend == "efficient":
        if mask is not None:
            mask = _efficient_mask(mask, query, key)
        needs_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return aten._scaled_dot_product_efficient_attention(query, key, value, mask, needs_lse, dropout_p,
                                                            is_causal, scale=scale)[0]
    return aten._scaled_dot_product_attention_math(query, key, value, mask, dropout_p, is_causal, None,
                                                   scale=scale, enable_gqa=enable_gqa)[0]


def cuda_dropout(input, p=0.5, training=True, inplace=False):
    """``F.dropout`` as the CUDA composite runs it: ``native_dropout`` (bool mask) when 0 < p < 1."""
    if not training or p == 0.0 or input.numel() == 0:
        return input
    if p == 1.0:
        return input.mul_(0) if inplace else input * 0
    out = torch.ops.aten.native_dropout(input, p, True)[0]
    return input.copy_(out) if inplace else out


_T = torch.Tensor
# (owner, attribute) of the Python functions a model calls that CUDA's autocast runs in fp32 ...
_CUDA_FP32 = [(F, "layer_norm"), (F, "group_norm"), (F, "softplus"), (F, "mse_loss"), (F, "l1_loss"),
              (F, "smooth_l1_loss"), (F, "huber_loss"), (F, "kl_div"), (F, "nll_loss"),
              (F, "binary_cross_entropy_with_logits"), (F, "cosine_similarity"), (torch, "layer_norm")] + [
    (owner, name) for name in ("exp", "log", "log1p", "expm1", "pow", "rsqrt", "reciprocal", "logsumexp")
    for owner in (torch, _T)] + [(_T, "__pow__")]
# ... or with an fp32 result when no dtype is asked for.
_CUDA_FP32_RESULT = [(F, "softmax"), (F, "log_softmax")] + [
    (owner, name) for name in ("softmax", "log_softmax", "sum", "cumsum", "prod") for owner in (torch, _T)]


def _fp32(value):
    if isinstance(value, torch.Tensor) and value.dtype in _HALF:
        return value.float()
    if isinstance(value, (list, tuple)):
        return type(value)(_fp32(v) for v in value)
    return value


def _in_fp32(fn):
    def run(*args, **kwargs):
        if not torch.is_autocast_enabled("cpu"):
            return fn(*args, **kwargs)
        with torch.autocast("cpu", enabled=False):  # nested patched calls pass straight through
            return fn(*_fp32(args), **{k: _fp32(v) for k, v in kwargs.items()})
    return run


def _fp32_result(fn):
    def run(*args, **kwargs):
        asked = kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)
        if torch.is_autocast_enabled("cpu") and not asked and args and isinstance(args[0], torch.Tensor) \
                and args[0].dtype in _HALF:
            kwargs = {**kwargs, "dtype": torch.float32}
        return fn(*args, **kwargs)
    return run


_HALF_TO_FLOAT = [(owner, name) for name in ("softmax", "log_softmax") for owner in (F, torch, _T)]


def _half_to_float(fn, name: str):
    """``fn`` (a softmax or log_softmax) as CUDA's composite runs an fp16 input asked for an fp32 result."""
    op = torch.ops.aten._softmax if name == "softmax" else torch.ops.aten._log_softmax

    def run(*args, **kwargs):
        tensor, rest = args[0], list(args[1:])
        dim = kwargs["dim"] if "dim" in kwargs else (rest[0] if rest else None)
        dtype = kwargs.get("dtype") or next((a for a in rest if isinstance(a, torch.dtype)), None)
        if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float16 and dtype == torch.float32 \
                and isinstance(dim, int):
            return op(tensor, dim, True)
        return fn(*args, **kwargs)
    return run


@contextlib.contextmanager
def _functions_replaced(patched: list[tuple]) -> Iterator[None]:
    """Each (owner, name, original or None when inherited, replacement) set for the duration."""
    for owner, name, _, replacement in patched:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, original, _ in reversed(patched):
            if original is None:
                delattr(owner, name)  # inherited: uncover the base class's again
            else:
                setattr(owner, name, original)


@contextlib.contextmanager
def cuda_softmax_functions() -> Iterator[None]:
    """fp16 -> fp32 softmax and log_softmax in one kernel, as on CUDA, for the duration (functions replaced)."""
    with _functions_replaced([(owner, name, owner.__dict__.get(name), _half_to_float(getattr(owner, name), name))
                              for owner, name in _HALF_TO_FLOAT]):
        yield


@contextlib.contextmanager
def cuda_autocast_functions() -> Iterator[None]:
    """While CPU autocast is on, the functions CUDA's autocast runs in fp32 (or gives an fp32 result) do so: the
    functions themselves are replaced (not a function mode, which backward's recomputation would not see)."""
    with _functions_replaced([(owner, name, owner.__dict__.get(name), wrap(getattr(owner, name)))
                              for pairs, wrap in ((_CUDA_FP32, _in_fp32), (_CUDA_FP32_RESULT, _fp32_result))
                              for owner, name in pairs]):
        yield


@contextlib.contextmanager
def cuda_kernels() -> Iterator[None]:
    """``F.scaled_dot_product_attention``, ``F.dropout`` and fp16 -> fp32 softmax take their CUDA path, and
    autocast CUDA's fp32 rules, for the duration."""
    saved = F.scaled_dot_product_attention, F.dropout
    F.scaled_dot_product_attention, F.dropout = cuda_sdpa, cuda_dropout
    try:
        with cuda_softmax_functions(), cuda_autocast_functions():
            yield
    finally:
        F.scaled_dot_product_attention, F.dropout = saved
