"""CUDA autocast's op lists on CPU autocast: two implementations (the profiler's dispatcher registration, the
oracle's replaced functions) against CUDA's policy as aten/src/ATen/autocast_mode.h states it."""

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from estimator.profiler.cuda_path import cuda_autocast_lists  # noqa: E402
from harness.fake.cuda_kernels import cuda_autocast_functions  # noqa: E402

CALLS = {  # name: (call, dtype under CUDA's autocast for a bf16 input)
    "layer_norm": (lambda x: F.layer_norm(x, (x.size(-1),)), torch.float32),
    "module LayerNorm": (lambda x: torch.nn.LayerNorm(x.size(-1), dtype=torch.bfloat16)(x), torch.float32),
    "softmax": (lambda x: x.softmax(-1), torch.float32),
    "F.log_softmax": (lambda x: F.log_softmax(x, -1), torch.float32),
    "softmax, dtype given": (lambda x: F.softmax(x, -1, dtype=torch.bfloat16), torch.bfloat16),
    "sum": (lambda x: x.sum(), torch.float32),
    "sum over a dim": (lambda x: x.sum(-1), torch.float32),
    "exp": (lambda x: x.exp(), torch.float32),
    "pow": (lambda x: x.pow(2), torch.float32),
    "rsqrt": (lambda x: torch.rsqrt(x), torch.float32),
    "cross_entropy": (lambda x: F.cross_entropy(x, torch.zeros(x.size(0), dtype=torch.long)), torch.float32),
    "mean (no rule)": (lambda x: x.mean(), torch.bfloat16),
    "gelu (no rule)": (lambda x: F.gelu(x), torch.bfloat16),
    "matmul (16-bit rule)": (lambda x: x.float() @ x.float().t(), torch.bfloat16),
}


@pytest.mark.parametrize("lists", [cuda_autocast_lists, cuda_autocast_functions], ids=["dispatcher", "functions"])
@pytest.mark.parametrize("name", list(CALLS))
def test_cuda_autocast_lists_on_cpu_autocast(lists, name):
    # fake tensors: no kernel runs in this process (a real CPU op would start OpenMP's pool, and the harness's
    # fork-isolated runs later in the session hang in a forked child that uses it)
    call, expected = CALLS[name]
    with FakeTensorMode():
        x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
        with lists(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = call(x)
        assert out.dtype == expected
        out.float().sum().backward()
        assert x.grad.dtype == torch.bfloat16  # backward returns the input's dtype


def test_nothing_changes_outside_autocast_or_after_the_block():
    with FakeTensorMode():
        x = torch.randn(4, 8, dtype=torch.bfloat16)
        with cuda_autocast_lists():
            assert F.layer_norm(x, (8,)).dtype == torch.bfloat16  # no autocast region
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert F.layer_norm(x, (8,)).dtype == torch.bfloat16  # CPU autocast's own list again
            assert x.softmax(-1).dtype == torch.bfloat16


@pytest.mark.parametrize("lists", [cuda_autocast_lists, cuda_autocast_functions], ids=["dispatcher", "functions"])
def test_checkpointed_recomputation_sees_the_same_lists(lists):
    """backward recomputes a checkpointed block: it must run the forward's program (same dtypes saved)."""
    with FakeTensorMode():
        norm = torch.nn.LayerNorm(8, dtype=torch.bfloat16)
        x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
        with lists():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = torch.utils.checkpoint.checkpoint(lambda t: norm(t).softmax(-1), x, use_reentrant=False)
            out.float().sum().backward()
        assert out.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
