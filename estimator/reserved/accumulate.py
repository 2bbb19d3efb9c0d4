"""Gradient accumulation as the allocator sees it: an optimizer step every ``k`` micro-batches.

The profile traces one step (forward, backward, ``optimizer.step()``, ``zero_grad``). A cycle of ``k`` micro-steps
is built from it, each micro-step with its own keys (``estimator.profiler.expand``):

* the cycle's first micro-step runs the step's forward and backward: every gradient is allocated and kept (autograd
  steals the fresh gradient into ``.grad``);
* every later one runs them again, but each gradient the backward makes is added into the kept ``.grad`` and freed
  once its node is done and its outputs routed (``AccumulateGrad``): here, before the first allocation that follows
  a free after it — the order a real CPU run shows except where the engine sums another node's inputs first
  (a few events later then; ``tests/estimator/test_reserved.py``);
* a micro-step that is not the cycle's last frees what the step frees before its optimizer (the loss);
* the last runs the step's optimizer part; ``zero_grad`` frees the gradients of the cycle's first micro-step
  (``FREE_CYCLE``).

With ``k = 1`` a cycle is the profiled step, op for op. FSDP2 (``estimator.reserved.fsdp``) takes the same rules
with its reduce-scatter outputs as the "gradients": each micro-step's unsharded gradients are reduce-scattered and
freed in its own backward; the cycle's first output is what the sharded gradients view, a later one is added into
them (``foreach_reduce``: ``sharded_param.grad._local_tensor += ...``) and freed as ``foreach_reduce`` returns.
"""

from __future__ import annotations

from dataclasses import dataclass

from estimator.profiler.expand import FREE, Expansion, ExpansionError, stream_of

FREE_CYCLE = 3  # free a gradient the cycle's first micro-step allocated
# free a tensor the previous cycle's first micro-step allocated: FSDP1's sharded gradients, which the next cycle's
# first forward drops (``_clear_grads_if_needed``; ``estimator.reserved.fsdp1``)
FREE_PREVIOUS_CYCLE = 4


@dataclass(frozen=True)
class MicroSteps:
    """Op lists (kind, key, poly) of the micro-steps; keys are step-local, as in ``Expansion``."""

    first_head: list    # the run's first micro-step: the first step's forward and backward, the loss still alive
    head: list          # a later cycle's first micro-step
    middle: list        # any later micro-step of a cycle: gradients made, added and freed
    before_optimizer: list  # what a micro-step that is not a cycle's last frees of its own (the loss)
    first_tail: list    # the loss freed, the run's first optimizer step (Adam creates its states), gradients
                        # freed as FREE_CYCLE
    tail: list          # every later optimizer step
    last: list | None = None  # a cycle's last micro-step's forward and backward where it differs from ``middle``
                              # (FSDP1 reducing after no_sync: ``estimator.reserved.fsdp1``)
    # the run's first cycle's middle / last micro-steps where they differ from later cycles' (ZeRO-3: its
    # parameter coordinator's first cycle follows the trace-recording micro-step: ``estimator.reserved.zero3``)
    first_middle: list | None = None
    first_last: list | None = None

    def ops(self, cycle: int, micro: int, k: int) -> list:
        """Micro-step ``micro`` (0-based) of cycle ``cycle`` of ``k`` micro-steps each."""
        if cycle == 0 and 0 < micro < k - 1 and self.first_middle is not None:
            body = self.first_middle
        elif cycle == 0 and micro == k - 1 and micro and self.first_last is not None:
            body = self.first_last
        else:
            body = ((self.first_head if cycle == 0 else self.head) if micro == 0
                    else self.last if micro == k - 1 and self.last is not None else self.middle)
        if micro < k - 1:
            return body + self.before_optimizer
        return body + (self.first_tail if cycle == 0 else self.tail)


class KeyedBuilds:
    """A method's micro-steps built one after another (``_no_sync_micro_steps`` of ``reserved.fsdp`` and
    ``reserved.fsdp1``): every micro-step's tensors take keys from ``start`` on; ``keys`` is the most any used."""

    def __init__(self, step_ops, expansion: Expansion, build, start: int, common: dict) -> None:
        self.step_ops, self.expansion, self.build, self.start, self.common = step_ops, expansion, build, start, common
        self.used: list[int] = []

    def __call__(self, ops: list, marks: tuple, first: bool, micro: str, held: dict | None = None) -> tuple:
        self.build.next_key = self.start
        result = self.step_ops(self.expansion, ops, marks, first=first, micro=micro, held=held, **self.common)
        self.used.append(self.build.next_key)
        return result

    @property
    def keys(self) -> int:
        return max(self.used)


def micro_steps(expansion: Expansion) -> MicroSteps:
    """ExpansionError when the first step does not free the loss right before its optimizer step. A method's
    own micro-steps (``Expansion.micro``) when it built them."""
    if expansion.micro is not None:
        return expansion.micro
    first_at, steady_at = expansion.optimizer_at
    steady, first = expansion.steady.ops, expansion.first.ops
    head = steady[:steady_at]
    made = {key for kind, key, _ in head if stream_of(kind) is not None}
    grads = expansion.grad_keys
    tail = [_cycle_free(op, grads) for op in steady[steady_at:]]
    loss = [op for op in steady[steady_at:] if op[0] == FREE and op[1] in made and op[1] not in grads]
    # The first step frees the loss before its optimizer step begins (``expand._first_optimizer_pre``): its
    # forward and backward end there, and the loss goes with the optimizer part of the cycle's last micro-step.
    first_end = first_at - len(loss)
    if sorted(first[first_end:first_at]) != sorted(loss):
        raise ExpansionError("events: the first step does not free the loss right before its optimizer step")
    first_tail = [_cycle_free(op, grads) for op in first[first_end:]]
    return MicroSteps(first_head=first[:first_end], head=head, middle=accumulating_backward(head, grads),
                      before_optimizer=loss, first_tail=first_tail, tail=tail)


def _cycle_free(op: tuple, grads: frozenset[int]) -> tuple:
    kind, key, poly = op
    return (FREE_CYCLE, key, poly) if kind == FREE and key in grads else op


def accumulating_backward(head: list, grads: frozenset[int]) -> list:
    """``head`` with every gradient allocation freed again once its node is done: before the first allocation
    that follows a free after it (at the end, if none does)."""
    out: list = []
    pending: list[tuple] = []  # gradient frees waiting for their node's end
    freed_since: bool = False
    for kind, key, poly in head:
        allocates = stream_of(kind) is not None  # on any stream
        if allocates and pending and freed_since:
            out.extend(pending)
            pending = []
        out.append((kind, key, poly))
        if allocates and key in grads:
            pending.append((FREE, key, poly))
            freed_since = False
        elif not allocates:
            freed_since = True
    return out + pending
