"""Backward formulas that fill a fresh zeros tensor (``index_backward``, ``gather_backward``,
``value_selecting_reduction_backward``, ``index_select_backward`` in torch's FunctionsManual) do it in place on
plain tensors but out of place on tensor subclasses such as the fake tensors of a trace. The recorder runs them in
place (``StorageRecorder._fills_fresh_zeros``), so a traced backward allocates what a GPU's (or CPU's) does:
one tensor of the input's size, not two. An MoE layer's token gather (``hidden_states[perm // k]``) and its
reordering (``weighted_out[inv_perm]``) are such indexes (docs/allocator.md, "Backward fills")."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from estimator.profiler.trace import StorageRecorder


def _backward_allocations(forward) -> tuple[list[int], int]:
    """(sizes of the storages the backward of ``forward(x)`` allocates, x's size in bytes), on fake tensors."""
    rec = StorageRecorder()
    with FakeTensorMode(allow_non_fake_inputs=True), rec:
        x = torch.randn(64, 32, requires_grad=True)
        out = forward(x)
        rec.mark("backward")
        out.sum().backward()
    events = rec.timeline.events
    start = events.index(("m", "backward"))
    return [event[2] for event in events[start:] if event[0] == "a"], x.numel() * x.element_size()


def test_an_index_backward_allocates_one_gradient_of_the_input_size():
    idx = torch.arange(128) % 64
    sizes, x_bytes = _backward_allocations(lambda x: x[idx] * 2.0)
    assert sizes.count(x_bytes) == 1


def test_gather_and_topk_backwards_fill_their_zeros_in_place():
    index = torch.zeros(64, 4, dtype=torch.long)
    sizes, x_bytes = _backward_allocations(lambda x: torch.gather(x, 1, index) * 2.0)
    assert sizes.count(x_bytes) == 1
    sizes, x_bytes = _backward_allocations(lambda x: torch.topk(x, 4, dim=1).values * 2.0)
    assert sizes.count(x_bytes) == 1


def test_an_out_of_place_fill_outside_backward_is_left_as_traced():
    """The model's own ``index_put`` (forward, grad mode on) keeps its own output tensor."""
    rec = StorageRecorder()
    with FakeTensorMode(allow_non_fake_inputs=True), rec:
        zeros = torch.zeros(64, 32)
        values = torch.ones(128, 32)
        rec.mark("fill")
        filled = zeros.index_put((torch.arange(128) % 64,), values, accumulate=True)
    events = rec.timeline.events
    new = [e for e in events[events.index(("m", "fill")):] if e[0] == "a" and e[2] == 64 * 32 * 4]
    assert len(new) == 1 and filled.untyped_storage() is not zeros.untyped_storage()
