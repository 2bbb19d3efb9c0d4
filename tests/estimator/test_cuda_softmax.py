"""fp16 -> fp32 softmax as CUDA runs it (aten/src/ATen/native/SoftMax.cpp: ``_softmax(input, dim,
half_to_float=True)``, no fp32 copy of the input), in the profiler's trace (``cuda_path.cuda_composites``) and the
oracle's (``harness.fake.cuda_kernels.cuda_kernels``), on fake CPU tensors."""

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from estimator.profiler.cuda_path import cuda_composites  # noqa: E402
from harness.fake.cuda_kernels import cuda_kernels  # noqa: E402

PATHS = {"profiler": cuda_composites, "oracle": cuda_kernels}
CALLS = {  # name: (call, autocast on, CUDA runs one half-to-float kernel)
    "eager attention's softmax(dtype=fp32)": (lambda x: F.softmax(x, dim=-1, dtype=torch.float32), False, True),
    "Tensor.softmax(dtype=fp32)": (lambda x: x.softmax(-1, dtype=torch.float32), False, True),
    "log_softmax(dtype=fp32)": (lambda x: F.log_softmax(x, -1, dtype=torch.float32), False, True),
    "softmax under autocast (fp32 result)": (lambda x: torch.softmax(x, -1), True, True),
    "softmax without a dtype": (lambda x: F.softmax(x, -1), False, False),
}


def _graph(call, autocast: bool, dtype=torch.float16):
    """(result dtype, the autograd node below the softmax's, the input's gradient dtype)."""
    with FakeTensorMode():
        x = torch.randn(2, 4, 8, 8, dtype=dtype, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            y = call(x * 2)
        below = type(y.grad_fn.next_functions[0][0]).__name__
        y.float().sum().backward()
        return y.dtype, below, x.grad.dtype


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", CALLS)
def test_fp16_softmax_to_fp32_is_one_kernel(path, name):
    call, autocast, fused = CALLS[name]
    with PATHS[path]():
        dtype, below, grad_dtype = _graph(call, autocast)
    assert grad_dtype == torch.float16
    if fused:  # no ToCopyBackward0: the fp32 copy of the scores is never made, nor its gradient
        assert (dtype, below) == (torch.float32, "MulBackward0")
    else:
        assert (dtype, below) == (torch.float16, "MulBackward0")


@pytest.mark.parametrize("path", PATHS)
def test_bf16_softmax_to_fp32_still_casts(path):
    """CUDA's fused branch is fp16 only: a bf16 input is cast to fp32 first, as on CPU."""
    with PATHS[path]():
        dtype, below, _ = _graph(lambda x: F.softmax(x, -1, dtype=torch.float32), False, torch.bfloat16)
    assert (dtype, below) == (torch.float32, "ToCopyBackward0")
