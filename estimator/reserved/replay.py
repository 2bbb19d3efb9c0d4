"""Replay one rank's timeline (``estimator.reserved.timeline``) through the caching-allocator model until the
cache repeats: after the first step, a step whose reserved peak and segment set equal the previous step's ends
the replay (the allocator is deterministic, so the next steps would repeat it).

Speed: each kind of step (the first, the second — DDP's bucket rebuild —, every later one) is compiled once
into (code, slot, bytes) operations on per-step address slots, so the loop does no key arithmetic and builds no
request tuples; the result is the same as replaying ``timeline.step_requests`` (test)."""

from __future__ import annotations

from dataclasses import dataclass

from estimator.allocator import CachingAllocator, OutOfMemory
from estimator.models.memo import memo_by_owner
from estimator.profiler.expand import ALLOC, FREE, FREE_PREVIOUS, Expansion, StepEvents, stream_of
from estimator.reserved.accumulate import FREE_PREVIOUS_CYCLE, micro_steps
from estimator.reserved.timeline import BATCH_TENSORS, Setup, StepPlan

MAX_STEPS = 8
# Operation codes: allocate into / free from this step's slots, free the previous step's, or the setup's, or the
# accumulation cycle's first micro-step's (its gradients, at zero_grad), or the previous cycle's first micro-step's.
_NEW, _FREE, _FREE_PREVIOUS, _FREE_SETUP, _NEW_SETUP, _FREE_CYCLE, _FREE_PREVIOUS_CYCLE = 0, 1, 2, 3, 4, 5, 6
_NEW_ON = 8  # 8 + s: allocate into this step's slot on side stream s
_TEMPLATES: dict[tuple, tuple] = {}


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
    # The replay stopped after the step in which the reserved peak passed ``stop_above_bytes`` (a level that already
    # decides the question asked, e.g. "does it fit?"): the peak fields are lower bounds, reached by then.
    stopped_above: bool = False
    # The reserved level the last replayed step reached (its own peak). Without an allocation retry the reserved
    # level never falls, so this is the peak; after a retry freed the cache (the capacity was reached) it is the
    # level every later step holds, below the peak of the step that retried: what a sampler of the device's used
    # memory reads through the run, where the peak above it lasts only until the retry (docs/allocator.md).
    held_reserved_bytes: int | None = None
    # Cached blocks ``garbage_collection_threshold`` returned to the driver (only under a memory fraction, as in
    # PyTorch): what kept the reserved level under the cap without a release-and-retry.
    gc_released_bytes: int = 0


class _Exceeded(Exception):
    """The reserved peak passed the replay's ``stop_above_bytes`` in the step (or setup) just replayed."""


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


def _template(expansion: Expansion, workspaces: int, kind: int) -> list[tuple[int, int, int]]:
    """Step kind ``kind``'s operations (0: the first step; 1: the second; 2: every later one) as
    ``step_requests`` orders them, DDP's rebuild left out: (code, slot, size index), the size index of a free
    being the one its tensor was allocated with. Size indices: the profile's polynomials; -2 the batch tensor,
    -1 the workspace (``_steps`` appends their bytes). Slots: the step's keys, then the batch, then the
    workspaces."""
    events = expansion.first if kind == 0 else expansion.steady
    poly_of = _slot_polys(expansion.steady if kind == 2 else expansion.first, events.keys)
    return _compile(expansion, events.ops, events.keys, workspaces if kind == 0 else 0, poly_of if kind else None)


def _compile(expansion: Expansion, step_ops: list, keys: int, workspaces: int, poly_of: dict | None
             ) -> list[tuple[int, int, int]]:
    """One step's (code, slot, size index) operations: its batch, the previous step's batch freed (``poly_of``:
    the previous step's slot sizes; None for the run's first step), ``workspaces`` cuBLAS workspaces at their
    first matmuls, its events."""
    batch, workspace = -2, -1
    ops: list[tuple] = [(_NEW, keys + t, batch) for t in range(BATCH_TENSORS)]
    if poly_of is not None:
        ops += [(_FREE_PREVIOUS, keys + t, batch) for t in range(BATCH_TENSORS)]
    workspace_at: dict[int, list[int]] = {}
    if workspaces:
        forward, backward = expansion.workspace_at
        workspace_at = {forward: [0], backward: list(range(1, workspaces))}
    own: dict[int, int] = {}
    for index, (op, key, poly) in enumerate(step_ops):
        for w in workspace_at.get(index, ()):
            ops.append((_NEW, keys + BATCH_TENSORS + w, workspace))
        if op == ALLOC:
            own[key] = poly
            ops.append((_NEW, key, poly))
        elif op > _NEW_ON:
            own[key] = poly
            ops.append((_NEW_ON + stream_of(op), key, poly))
        elif op == FREE:
            ops.append((_FREE, key, own[key]))
        elif op == FREE_PREVIOUS:
            ops.append((_FREE_PREVIOUS, key, poly_of[key]))
        elif op == FREE_PREVIOUS_CYCLE:
            ops.append((_FREE_PREVIOUS_CYCLE, key, poly))
        else:  # FREE_CYCLE: a gradient of the cycle's first micro-step
            ops.append((_FREE_CYCLE, key, poly))
    return ops


def _micro_templates(expansion: Expansion, workspaces: int, k: int) -> dict[tuple[int, int], list]:
    """Gradient accumulation over ``k`` micro-steps: templates by (cycle kind: 0 the run's first cycle, 1 any
    later; micro kind: 0 the cycle's first, 1 a middle one, 2 the last)."""
    key = (id(expansion), workspaces, "micro", k)
    hit = _TEMPLATES.get(key)
    if hit is not None and hit[0] is expansion:
        return hit[1]
    micro = micro_steps(expansion)
    keys = expansion.steady.keys
    poly_of = _slot_polys(expansion.steady, keys)
    templates = {}
    for cycle in (0, 1):
        for kind, index in ((0, 0), (1, 1), (2, k - 1)):
            first = cycle == 0 and index == 0
            templates[cycle, kind] = _compile(expansion, micro.ops(cycle, index, k), keys,
                                              workspaces if first else 0, None if first else poly_of)
    if len(_TEMPLATES) > 64:
        _TEMPLATES.clear()
    _TEMPLATES[key] = (expansion, templates)
    return templates


def _micro_kind(micro: int, k: int) -> int:
    return 0 if micro == 0 else 2 if micro == k - 1 else 1


def _slot_polys(events: StepEvents, keys: int) -> dict[int, int]:
    """The size index each slot of a step of ``events`` is allocated with (the previous step's, for its frees)."""
    polys = {key: poly for op, key, poly in events.ops if stream_of(op) is not None}
    polys.update({keys + t: -2 for t in range(BATCH_TENSORS)})
    return polys


def _cached_template(expansion: Expansion, workspaces: int, kind: int) -> list[tuple[int, int, int]]:
    """``_template``, memoized per expansion and kind (a replay that stops in its first step never compiles the
    later kinds)."""
    return memo_by_owner(_TEMPLATES, (id(expansion), workspaces, kind), expansion,
                         lambda: _template(expansion, workspaces, kind), limit=192)


class _Steps:
    """The (code, slot, bytes) operations of step ``index`` at this plan's sizes: the first, the second (with DDP's
    bucket rebuild, after the batch is allocated) or any later one; each kind built when first asked for (a replay
    that stops early never needs the later ones)."""

    def __init__(self, plan: StepPlan, setup: Setup) -> None:
        self.plan, self.setup = plan, setup
        self.kinds: list[list | None] = [None, None, None]

    def __getitem__(self, index: int) -> list:
        kind = min(index, 2)
        if self.kinds[kind] is None:
            self.kinds[kind] = _step_ops(self.plan, self.plan, self.setup, kind)
        return self.kinds[kind]


def _step_ops(plan: StepPlan, previous: StepPlan, setup: Setup, kind: int, template: list | None = None
              ) -> list[tuple[int, int, int]]:
    """Step kind ``kind``'s (code, slot, bytes) operations at ``plan``'s sizes (``template``: a micro-step's
    instead); what it frees of the previous step (its batch, a manual loop's outputs) at ``previous``'s. The
    second step carries DDP's bucket rebuild (after the batch is allocated)."""
    sizes = [*plan.sizes, plan.batch_bytes, plan.workspace_bytes]
    before = sizes if previous is plan else [*previous.sizes, previous.batch_bytes, previous.workspace_bytes]
    if template is None:
        template = _cached_template(plan.expansion, plan.workspaces, kind)
    ops = [(code, slot, (before if code == _FREE_PREVIOUS else sizes)[index]) for code, slot, index in template]
    if kind == 1 and setup.rebuilt_buckets:
        setup_keys = len(setup.allocations)
        rebuild = [(_FREE_SETUP, i, setup.allocations[i][1]) for i in setup.bucket_indices]
        rebuild += [(_NEW_SETUP, setup_keys + k, size) for k, size in enumerate(setup.rebuilt_buckets)]
        ops[BATCH_TENSORS:BATCH_TENSORS] = rebuild
    return ops


class _Run:
    """The allocator plus the bookkeeping of one replay."""

    def __init__(self, conf, allowed_bytes: int | None, setup: Setup, stop_above_bytes: int | None = None,
                 fraction_cap_bytes: int | None = None) -> None:
        self.allocator = CachingAllocator(conf, capacity_bytes=allowed_bytes, allowed_bytes=fraction_cap_bytes)
        # the reserved peak never falls, so once above this level the rest of the replay cannot change the answer
        self.stop_above_bytes = float("inf") if stop_above_bytes is None else stop_above_bytes
        self.setup_addr: list = [None] * (len(setup.allocations) + len(setup.rebuilt_buckets))
        self.live = self.requested_peak = 0
        self.peak = self.step_peak = self.fragmentation = 0
        self.previous_state: tuple | None = None

    def setup(self, setup: Setup) -> None:
        frees = dict(setup.frees_after)
        ops = []
        for i, (_name, nbytes) in enumerate(setup.allocations):
            if i == setup.empty_cache_before:
                self.run(ops, [], [])
                self.allocator.empty_cache()
                ops = []
            ops.append((_NEW_SETUP, i, nbytes))
            ops.extend((_FREE_SETUP, j, setup.allocations[j][1]) for j in frees.get(i, ()))
        self.run(ops, [], [])

    def check_stop(self) -> None:
        """At the end of a step (or the setup): stop if the reserved peak passed ``stop_above_bytes``. The step
        that passed it is finished first, so the lower bound is that step's whole peak (the first step's is
        usually close to the steady one: a better guide for the plan's micro-batch search than the crossing)."""
        if self.peak > self.stop_above_bytes:
            raise _Exceeded

    def repeats(self, index: int) -> bool:
        """After step (or cycle) ``index``: whether it repeated the previous one's reserved peak and segments (the
        allocator is deterministic, so every later one would too); the first steps never count."""
        state = (self.step_peak, _segments(self.allocator))
        repeated = index >= 2 and state == self.previous_state
        self.previous_state = state
        return repeated

    def result(self, *, oom: bool, steps: int, steady: bool, stopped_above: bool = False,
               repeated_steps: bool = True) -> ReservedReplay:
        """``repeated_steps``: every step is the same (the last one's level is what the later ones hold); False for
        a sequence of differently shaped steps, whose held level is then taken as its peak."""
        allocator = self.allocator
        # a retry or a garbage collection freed cached blocks: the level later steps hold is below the peak
        released = allocator.num_alloc_retries > 0 or allocator.gc_released_bytes > 0
        retried = released and steps > 0 and not oom and repeated_steps
        return ReservedReplay(peak_reserved_bytes=self.peak, peak_allocated_bytes=allocator.peak_allocated_bytes,
                              peak_requested_bytes=self.requested_peak, fragmentation_bytes=self.fragmentation,
                              num_alloc_retries=allocator.num_alloc_retries, oom=oom, steps=steps, steady=steady,
                              stopped_above=stopped_above, gc_released_bytes=allocator.gc_released_bytes,
                              held_reserved_bytes=self.step_peak if retried else self.peak)

    def run(self, ops: list[tuple], addr: list, previous: list, cycle: list | None = None,
            previous_cycle: list | None = None) -> None:
        """Apply ``ops`` with this step's address slots ``addr``, the previous step's ``previous``, the
        accumulation cycle's first micro-step's ``cycle`` (default: this step's) and the previous cycle's first
        micro-step's ``previous_cycle``."""
        cycle = addr if cycle is None else cycle
        allocator, setup_addr = self.allocator, self.setup_addr
        malloc, free = allocator.malloc, allocator.free
        live, requested_peak, step_peak = self.live, self.requested_peak, self.step_peak
        try:
            for code, slot, nbytes in ops:
                if code == _NEW:
                    addr[slot] = malloc(nbytes, 0)
                elif code == _FREE:
                    free(addr[slot])
                    live -= nbytes
                    continue
                elif code == _FREE_PREVIOUS:
                    free(previous[slot])
                    live -= nbytes
                    continue
                elif code == _FREE_SETUP:
                    free(setup_addr[slot])
                    live -= nbytes
                    continue
                elif code == _FREE_CYCLE:
                    free(cycle[slot])
                    live -= nbytes
                    continue
                elif code == _FREE_PREVIOUS_CYCLE:
                    free(previous_cycle[slot])
                    live -= nbytes
                    continue
                elif code > _NEW_ON:
                    addr[slot] = malloc(nbytes, code - _NEW_ON)
                else:
                    setup_addr[slot] = malloc(nbytes, 0)
                live += nbytes
                if live > requested_peak:
                    requested_peak = live
                reserved = allocator.reserved_bytes
                if reserved > step_peak:
                    step_peak = reserved
                    if reserved > self.peak:
                        self.peak = reserved
                        self.fragmentation = reserved - allocator.allocated_bytes
        finally:
            self.live, self.requested_peak, self.step_peak = live, requested_peak, step_peak


def replay_rank(setup: Setup, plan: StepPlan, conf=None, allowed_bytes: int | None = None,
                max_steps: int = MAX_STEPS, accum: int = 1, stop_above_bytes: int | None = None,
                fraction_cap_bytes: int | None = None) -> ReservedReplay:
    """``allowed_bytes``: what the allocator may reserve (the GPU's memory less what others hold); None:
    unlimited. ``fraction_cap_bytes``: ``set_per_process_memory_fraction``'s cap (None: no fraction set), which
    also turns on ``garbage_collection_threshold``. ``accum``: micro-steps per optimizer step (``max_steps`` then counts optimizer steps).
    ``stop_above_bytes``: stop at the end of the step in which the reserved peak passes it (``stopped_above``)."""
    if accum > 1:
        return _replay_accumulating(setup, plan, conf, allowed_bytes, max_steps, accum, stop_above_bytes,
                                    fraction_cap_bytes)
    run = _Run(conf, allowed_bytes, setup, stop_above_bytes, fraction_cap_bytes)
    steps, steady, oom, stopped = 0, False, False, False
    steps_ops = _Steps(plan, setup)
    slots = plan.expansion.steady.keys + BATCH_TENSORS + plan.workspaces
    try:
        run.setup(setup)
        run.check_stop()
        previous_addr: list = []
        for step in range(max_steps):
            ops = steps_ops[step]
            addr = [None] * slots
            run.step_peak = run.allocator.reserved_bytes
            run.run(ops, addr, previous_addr)
            previous_addr = addr
            steps += 1
            run.check_stop()
            if run.repeats(step):
                steady = True
                break
    except OutOfMemory:
        oom = True
    except _Exceeded:
        stopped = True
    return run.result(oom=oom, steps=steps, steady=steady, stopped_above=stopped)


def _replay_accumulating(setup: Setup, plan: StepPlan, conf, allowed_bytes: int | None, max_cycles: int,
                         k: int, stop_above_bytes: int | None = None,
                         fraction_cap_bytes: int | None = None) -> ReservedReplay:
    """``replay_rank`` with an optimizer step every ``k`` micro-steps (``estimator.reserved.accumulate``), until
    a cycle repeats the previous one's reserved peak and segments."""
    run = _Run(conf, allowed_bytes, setup, stop_above_bytes, fraction_cap_bytes)
    templates = _micro_templates(plan.expansion, plan.workspaces, k)
    ops = {kinds: _step_ops(plan, plan, setup, 2, template) for kinds, template in templates.items()}
    # DDP rebuilds its buckets at the first forward after a synchronised backward (DistributedDataParallel.
    # _pre_forward calls Reducer._rebuild_buckets under no_sync too; the order is recorded by a synchronised
    # backward only): the second cycle's first micro-step
    rebuild = _step_ops(plan, plan, setup, 1, templates[1, 0]) if setup.rebuilt_buckets else ops[1, 0]
    slots = plan.expansion.steady.keys + BATCH_TENSORS + plan.workspaces
    steps, steady, oom, stopped = 0, False, False, False
    try:
        run.setup(setup)
        run.check_stop()
        previous_addr: list = []
        cycle_addr: list = []
        for cycle in range(max_cycles):
            run.step_peak = run.allocator.reserved_bytes
            previous_cycle_addr = cycle_addr
            for micro in range(k):
                addr = [None] * slots
                cycle_addr = addr if micro == 0 else cycle_addr
                kinds = (min(cycle, 1), _micro_kind(micro, k))
                run.run(rebuild if (cycle, micro) == (1, 0) else ops[kinds], addr, previous_addr, cycle_addr,
                        previous_cycle_addr)
                previous_addr = addr
                steps += 1
                run.check_stop()
            if run.repeats(cycle):
                steady = True
                break
    except OutOfMemory:
        oom = True
    except _Exceeded:
        stopped = True
    return run.result(oom=oom, steps=steps, steady=steady, stopped_above=stopped)


def replay_sequence(setup: Setup, plans: list[StepPlan], conf=None, allowed_bytes: int | None = None,
                    empty_cache_every: int | None = None, accum: int = 1, stop_above_bytes: int | None = None,
                    fraction_cap_bytes: int | None = None) -> ReservedReplay:
    """Setup, then one step per plan in order: batches of different shapes (one expansion, sizes per step)
    through one caching allocator, whose reserved level keeps what the blocks of every shape so far left
    split in its cache. ``accum``: the plans are micro-batches, an optimizer step every ``accum`` of them.
    ``empty_cache_every``: ``torch.cuda.empty_cache()`` after every that many optimizer steps (a training
    script's schedule). ``steady`` is False: the sequence is replayed whole, not until it repeats."""
    run = _Run(conf, allowed_bytes, setup, stop_above_bytes, fraction_cap_bytes)
    expansion = plans[0].expansion
    slots = expansion.steady.keys + BATCH_TENSORS + plans[0].workspaces
    templates = _micro_templates(expansion, plans[0].workspaces, accum) if accum > 1 else None
    steps, oom, stopped = 0, False, False
    try:
        run.setup(setup)
        run.check_stop()
        previous_addr: list = []
        cycle_addr: list = []
        previous_cycle_addr: list = []
        for step, plan in enumerate(plans):
            before = plans[step - 1] if step else plan
            cycle, micro = divmod(step, accum)
            if templates is None:
                ops = _step_ops(plan, before, setup, min(step, 2))
            else:
                kind = 1 if (cycle, micro) == (1, 0) else 2  # DDP's bucket rebuild (above)
                ops = _step_ops(plan, before, setup, kind, templates[min(cycle, 1), _micro_kind(micro, accum)])
            addr = [None] * slots
            previous_cycle_addr = cycle_addr if micro == 0 else previous_cycle_addr
            cycle_addr = addr if micro == 0 else cycle_addr
            run.step_peak = run.allocator.reserved_bytes
            run.run(ops, addr, previous_addr, cycle_addr, previous_cycle_addr)
            previous_addr = addr
            steps += 1
            run.check_stop()
            if empty_cache_every and micro == accum - 1 and (cycle + 1) % empty_cache_every == 0:
                run.allocator.empty_cache()
    except OutOfMemory:
        oom = True
    except _Exceeded:
        stopped = True
    return run.result(oom=oom, steps=steps, steady=False, stopped_above=stopped, repeated_steps=False)
