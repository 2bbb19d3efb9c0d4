"""Replay one rank's timeline (``estimator.reserved.timeline``) through the caching-allocator model until the
cache repeats: after the first step, a step whose reserved peak and segment set equal the previous step's ends
the replay (the allocator is deterministic, so the next steps would repeat it)."""

from __future__ import annotations

from dataclasses import dataclass

from estimator.allocator import CachingAllocator, OutOfMemory
from estimator.reserved.timeline import BATCH_TENSORS, Setup, StepPlan, step_requests

MAX_STEPS = 8


@dataclass(frozen=True)
class ReservedReplay:
    peak_reserved_bytes: int
    peak_allocated_bytes: int        # rounded blocks, as torch.cuda.max_memory_allocated counts
    peak_requested_bytes: int        # unrounded requests alive at once (the estimator's allocated level)
    fragmentation_bytes: int         # reserved - allocated at the reserved peak
    num_alloc_retries: int
    oom: bool                        # the allocator could not serve a request under the cap
    steps: int                       # steps replayed (setup excluded)
    steady: bool                     # the last two steps were the same


def _segments(allocator: CachingAllocator) -> tuple:
    """The reserved segments' sizes, sorted (each from the block that starts it, along its chain)."""
    sizes = []
    for block in allocator.blocks.values():
        if block.prev is None:
            size, nxt = block.size, block.next
            while nxt is not None:
                size, nxt = size + nxt.size, nxt.next
            sizes.append(size)
    return tuple(sorted(sizes))


class _Run:
    """The allocator plus the bookkeeping of one replay."""

    def __init__(self, conf, allowed_bytes: int | None) -> None:
        self.allocator = CachingAllocator(conf, capacity_bytes=allowed_bytes)
        self.addr: dict = {}
        self.size: dict = {}
        self.live = self.requested_peak = 0
        self.peak = self.step_peak = self.fragmentation = 0

    def run(self, requests: list[tuple]) -> None:
        allocator, addr, size = self.allocator, self.addr, self.size
        malloc, free = allocator.malloc, allocator.free
        for request in requests:
            if request[0] == "alloc":
                key, nbytes = request[1], request[2]
                addr[key] = malloc(nbytes, request[3])
                size[key] = nbytes
                self.live += nbytes
                if self.live > self.requested_peak:
                    self.requested_peak = self.live
                reserved = allocator.reserved_bytes
                if reserved > self.step_peak:
                    self.step_peak = reserved
                    if reserved > self.peak:
                        self.peak = reserved
                        self.fragmentation = reserved - allocator.allocated_bytes
            else:
                key = request[1]
                free(addr.pop(key))
                self.live -= size.pop(key)


def replay_rank(setup: Setup, plan: StepPlan, conf=None, allowed_bytes: int | None = None,
                max_steps: int = MAX_STEPS) -> ReservedReplay:
    """``allowed_bytes``: what the allocator may reserve (the GPU's memory less what others hold); None:
    unlimited."""
    run = _Run(conf, allowed_bytes)
    setup_keys = len(setup.allocations)
    steps, steady, oom = 0, False, False
    try:
        run.run([("alloc", i, nbytes, 0) for i, (_name, nbytes) in enumerate(setup.allocations)])
        previous = None
        base = setup_keys + len(setup.rebuilt_buckets)
        for step in range(max_steps):
            requests = step_requests(plan, step, base)
            if step == 1 and setup.rebuilt_buckets:  # DDP rebuilds its buckets at the second forward
                rebuild = [("free", i) for i in setup.bucket_indices]
                rebuild += [("alloc", setup_keys + k, nbytes, 0) for k, nbytes in enumerate(setup.rebuilt_buckets)]
                requests = requests[:BATCH_TENSORS] + rebuild + requests[BATCH_TENSORS:]
            run.step_peak = run.allocator.reserved_bytes
            run.run(requests)
            steps += 1
            state = (run.step_peak, _segments(run.allocator))
            if step >= 2 and state == previous:
                steady = True
                break
            previous = state
    except OutOfMemory:
        oom = True
    allocator = run.allocator
    return ReservedReplay(peak_reserved_bytes=run.peak, peak_allocated_bytes=allocator.peak_allocated_bytes,
                          peak_requested_bytes=run.requested_peak, fragmentation_bytes=run.fragmentation,
                          num_alloc_retries=allocator.num_alloc_retries, oom=oom, steps=steps, steady=steady)
