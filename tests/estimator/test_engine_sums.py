"""Autograd's input-buffer sums in the trace, by torch's rule (docs/allocator.md, "helper sums").

``InputBuffer::accumulate`` sums a second gradient into the first in place (``old.add_(new)``) only when the buffer
holds the last reference to ``old`` and to its storage. A gradient that arrives as an autograd view (``linear`` on a
3-D input: ``ViewBackward0`` returns ``grad.view(...)``, whose ``ViewInfo`` keeps its base) never passes: the sum
makes a new tensor. A fresh gradient (``mm``'s output, ``sin``'s) is summed into. Fake tensors sum every gradient
out of place; the recorder's ``fold_engine_sums`` folds those a GPU makes in place."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from estimator.profiler.trace import StorageRecorder

B, S, H = 2, 4, 8


def _two_linears(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (3-D) feeds two linears: each input gradient is ``ViewBackward0``'s view of an ``mm`` output."""
    return torch.nn.functional.linear(x, weight) + torch.nn.functional.linear(x, weight.t())


def _two_pointwise(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x feeds sin and cos: each input gradient is a fresh tensor."""
    return x.sin() + x.cos()


def _folded_sums(forward) -> int:
    """How many of the backward's sums into x's gradient the recorder folds (fake tensors, fold on)."""
    rec = StorageRecorder()
    rec.fold_engine_sums = True
    with FakeTensorMode(allow_non_fake_inputs=True), rec:
        leaf = torch.randn(B, S, H, requires_grad=True)
        weight = torch.randn(H, H)
        x = leaf * 2.0  # a non-leaf: its gradient is summed in MulBackward0's input buffer
        forward(x, weight).sum().backward()
        rec.mark("end")  # settles the noted sums
    return len(rec._alias)


def test_a_sum_into_a_view_gradient_stays_out_of_place():
    assert _folded_sums(_two_linears) == 0


def test_a_sum_into_a_fresh_gradient_is_folded():
    assert _folded_sums(_two_pointwise) == 1


def test_with_the_switch_off_every_sum_stays_as_traced():
    rec = StorageRecorder()
    rec.fold_engine_sums = False
    with FakeTensorMode(allow_non_fake_inputs=True), rec:
        x = torch.randn(B, S, H, requires_grad=True) * 2.0
        _two_pointwise(x, None).sum().backward()
        rec.mark("end")
    assert rec._alias == {}


def _summed_in_place(forward) -> bool:
    """On real CPU tensors: whether x's summed gradient lives in the first gradient's memory."""
    leaf = torch.randn(B, S, H, requires_grad=True)
    weight = torch.randn(H, H)
    x = leaf * 2.0
    node = x.grad_fn
    first_ptrs, summed_ptrs = [], []
    consumers = []
    out = forward(x, weight)

    def walk(fn, seen):  # the nodes whose next edge is x's MulBackward0
        if fn is None or fn in seen:
            return
        seen.add(fn)
        for nxt, _ in fn.next_functions:
            if nxt is node:
                consumers.append(fn)
            walk(nxt, seen)
    walk(out.grad_fn, set())
    for fn in consumers:
        fn.register_hook(lambda grad_inputs, _outs, fn=fn: first_ptrs.append(
            grad_inputs[[n for n, _ in fn.next_functions].index(node)].data_ptr()))
    node.register_prehook(lambda grads: summed_ptrs.append(grads[0].data_ptr()))
    out.sum().backward()
    return summed_ptrs[0] == first_ptrs[0]


@pytest.mark.slow  # real CPU autograd in the pytest process: the rule the recorder follows, on torch itself
def test_torch_sums_a_fresh_gradient_in_place_and_a_view_out_of_place():
    assert _summed_in_place(_two_pointwise)
    assert not _summed_in_place(_two_linears)
