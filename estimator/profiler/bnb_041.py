"""bitsandbytes before 0.43.2: a 4-bit Linear whose ``MatMul4Bit`` keeps its input for backward.

Read at bitsandbytes 0.41.1 (18e827d6, the release LitGPT 8641822's resource tables ran), ``autograd/_functions.py``
``MatMul4Bit``: the forward dequantizes the weight to its quantization dtype and casts that to the input's
(``F.linear(A, dequantize_4bit(B, state).to(A.dtype).t(), bias)``), then stores ``ctx.tensors = (A, B)`` whenever
an input needs a gradient; the backward reads only ``B`` (``grad_A = grad_output @ dequantize_4bit(B).to(dtype)``).
A tensor stored on ``ctx`` is no saved variable: autograd does not release it after the node runs, so the input
lives until the graph itself is freed. ``matmul_4bit`` took that path for every input but a single-token one
without a gradient (``A.numel() == A.shape[-1]``: inference). 0.43.2 (9e753741, "fix QLoRA mem bug", #1270) stores
``(None, B)``; the installed release (0.50.2 here) also dispatches to its own ``gemm_4bit`` op. ``Linear4bit``'s
forward is 0.41.1's: the input and bias cast to ``compute_dtype``, the output cast back to the input's dtype.

The profiler traces this class in place of ``bnb.nn.Linear4bit`` where the run's bitsandbytes keeps the inputs
(``TrainingSpec.qlora_keeps_inputs``); the layout of the packed weight and its quant state is today's.
"""

from __future__ import annotations

import bitsandbytes as bnb
import torch


class MatMul4BitKeepsInput(torch.autograd.Function):
    """bitsandbytes 0.41.1's ``MatMul4Bit`` over today's packed weight (``quant_state.shape`` = (out, in))."""

    @staticmethod
    def forward(ctx, A, B, bias, quant_state):  # noqa: N803 (bitsandbytes' names)
        weight = bnb.functional.dequantize_4bit(B, quant_state).to(A.dtype)
        output = torch.nn.functional.linear(A, weight, bias)
        ctx.state = quant_state
        ctx.dtype_bias = None if bias is None else bias.dtype
        # what 0.41.1 keeps: the input, held by the context until the graph is freed
        ctx.tensors = (A, B) if any(ctx.needs_input_grad[:2]) else (None, None)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        _, B = ctx.tensors  # noqa: N806
        grad_A = grad_bias = None  # noqa: N806
        if ctx.needs_input_grad[2]:
            grad_bias = grad_output.sum(0, dtype=ctx.dtype_bias)
        if ctx.needs_input_grad[0]:
            grad_A = torch.matmul(grad_output, bnb.functional.dequantize_4bit(B, ctx.state).to(grad_output.dtype))  # noqa: N806
        return grad_A, None, grad_bias, None


class Linear4bitKeepsInput(bnb.nn.Linear4bit):
    """``bnb.nn.Linear4bit`` with bitsandbytes 0.41.1's forward (peft wraps it as it wraps its base class)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp_dtype = x.dtype
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        out = MatMul4BitKeepsInput.apply(x, self.weight, bias, self.weight.quant_state)
        return out.to(inp_dtype)
