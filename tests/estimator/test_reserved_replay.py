"""The compiled replay (``estimator.reserved.replay``: per-step operation lists on address slots) gives exactly
what a plain replay of ``timeline.step_requests`` gives — the stream a real CPU run was checked against
(tests/estimator/test_reserved.py) — on shipped profiles: single, DDP (the bucket rebuild), the manual loop,
expandable segments, and caps that force release-and-retry and out-of-memory."""

import pytest

from estimator import api
from estimator.allocator import CachingAllocator, OutOfMemory
from estimator.hardware.residuals import load_coefficients
from estimator.profiler.expand import step_sizes
from estimator.reserved import rank as reserved_rank
from estimator.reserved.accumulate import micro_steps
from estimator.reserved.replay import ReservedReplay, _segments, replay_rank
from estimator.reserved.timeline import BATCH_TENSORS, INT64, StepPlan, micro_step_requests, step_requests
from estimator.spec import TrainingSpec

GIB = 1024**3


def _plain_replay(setup, plan, conf, allowed_bytes, max_steps=8, sequence=None, empty_cache_every=None,
                  accum=1) -> ReservedReplay:
    """The replay over request tuples with global keys, one dict lookup per event. ``sequence``: one plan per
    step, replayed whole (no stop when the cache repeats). ``accum``: micro-steps per optimizer step (the steps
    counted, and the cache compared, per optimizer step)."""
    if sequence is not None:
        max_steps = len(sequence)
    elif accum > 1:
        max_steps *= accum
    micro = micro_steps((plan or sequence[0]).expansion) if accum > 1 else None
    allocator = CachingAllocator(conf, capacity_bytes=allowed_bytes)
    addr, size = {}, {}
    live = requested_peak = peak = fragmentation = 0
    steps, steady, oom, previous = 0, False, False, None
    setup_keys = len(setup.allocations)
    base = setup_keys + len(setup.rebuilt_buckets)
    streams = [[("alloc", i, n, 0) for i, (_name, n) in enumerate(setup.allocations)]]
    try:
        for step in range(-1, max_steps):
            if step >= 0 and micro is not None:
                step_plan = plan if sequence is None else sequence[step]
                requests = micro_step_requests(step_plan, micro, accum, step, base)
                if step == accum and setup.rebuilt_buckets:  # the first forward after a synchronised backward
                    rebuild = [("free", i) for i in setup.bucket_indices]
                    rebuild += [("alloc", setup_keys + k, n, 0) for k, n in enumerate(setup.rebuilt_buckets)]
                    requests = requests[:BATCH_TENSORS] + rebuild + requests[BATCH_TENSORS:]
            elif step >= 0:
                requests = step_requests(plan if sequence is None else sequence[step], step, base)
                if step == 1 and setup.rebuilt_buckets:
                    rebuild = [("free", i) for i in setup.bucket_indices]
                    rebuild += [("alloc", setup_keys + k, n, 0) for k, n in enumerate(setup.rebuilt_buckets)]
                    requests = requests[:BATCH_TENSORS] + rebuild + requests[BATCH_TENSORS:]
            else:
                requests = streams[0]
            if step < 0 or step % accum == 0:
                step_peak = allocator.reserved_bytes
            for request in requests:
                if request[0] == "alloc":
                    addr[request[1]] = allocator.malloc(request[2], request[3])
                    size[request[1]] = request[2]
                    live += request[2]
                    requested_peak = max(requested_peak, live)
                    if allocator.reserved_bytes > step_peak:
                        step_peak = allocator.reserved_bytes
                        if step_peak > peak:
                            peak, fragmentation = step_peak, step_peak - allocator.allocated_bytes
                else:
                    allocator.free(addr.pop(request[1]))
                    live -= size.pop(request[1])
            if step < 0:
                continue
            steps += 1
            if sequence is not None:
                if empty_cache_every and steps % (empty_cache_every * accum) == 0:
                    allocator.empty_cache()
                continue
            if steps % accum:
                continue
            state = (step_peak, _segments(allocator))
            if step // accum >= 2 and state == previous:
                steady = True
                break
            previous = state
    except OutOfMemory:
        oom = True
    # after a release-and-retry, the level the last step (or cycle) reached is what the later ones hold
    retried = allocator.num_alloc_retries > 0 and steps > 0 and not oom and sequence is None
    return ReservedReplay(peak, allocator.peak_allocated_bytes, requested_peak, fragmentation,
                          allocator.num_alloc_retries, oom, steps, steady,
                          held_reserved_bytes=step_peak if retried else peak)


def _inputs(model, precision, method, loop, b, s, other_lengths=()):
    """(setup, the plan at (b, s)[, the plans at (b, each of ``other_lengths``)])."""
    training = TrainingSpec(precision=precision, micro_batch_size=b, seq_len=s, loop=loop)
    arch, profile = api.load_model_profile(model, training, 1, allow_build=False)
    regime = api._regime(profile, b, s)
    events = regime["events"]
    table = api._param_table(profile, arch.num_layers)
    coeffs = load_coefficients("h100-80gb")
    expansion = reserved_rank._expansion(events, arch.num_layers, loop)
    plans = [StepPlan(expansion, step_sizes(events["polys"], b, length), b * length * INT64,
                      coeffs.cublas_workspace_bytes, coeffs.cublas_workspaces) for length in (s, *other_lengths)]
    setup = reserved_rank._setup(profile, table, arch.num_layers, method, precision.startswith("mixed_"))
    return (setup, *plans) if other_lengths else (setup, plans[0])


CASES = [("meta-llama/Llama-3.2-1B", "mixed_bf16", "single", "trainer", 2, 512),
         ("meta-llama/Llama-3.2-1B", "mixed_bf16", "ddp", "trainer", 4, 1024),
         ("Qwen/Qwen2.5-0.5B", "bf16", "ddp", "manual", 3, 256),
         ("Qwen/Qwen2.5-0.5B", "bf16", "single", "manual", 8, 1024)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].split('/')[1]}-{c[2]}-{c[3]}")
def test_compiled_replay_equals_the_plain_replay(case):
    setup, plan = _inputs(*case)
    seen = set()
    for text in ("", "expandable_segments:True"):
        conf = reserved_rank.alloc_conf(text)
        free = replay_rank(setup, plan, conf, None)
        assert free == _plain_replay(setup, plan, conf, None)
        # Caps just under what the uncapped run reserves: the allocator releases its cache and retries, or OOMs.
        for allowed in (free.peak_reserved_bytes - GIB // 4, free.peak_reserved_bytes * 3 // 4):
            capped = replay_rank(setup, plan, conf, allowed)
            assert capped == _plain_replay(setup, plan, conf, allowed)
            seen.add((capped.oom, capped.num_alloc_retries > 0))
    assert (True, True) in seen  # the out-of-memory path was exercised


def test_a_replay_that_retries_holds_less_than_its_peak():
    """A cap under the uncapped peak that the allocator meets by releasing its cache and retrying: the peak is
    the step that retried (reaching the cap), the held level is what the later steps reach, below the peak and
    at least the allocated level; and a replay that never retries holds its peak."""
    setup, plan = _inputs(*CASES[2])
    conf = reserved_rank.alloc_conf("")
    free = replay_rank(setup, plan, conf, None)
    assert free.num_alloc_retries == 0 and free.held_reserved_bytes == free.peak_reserved_bytes
    retried = [r for r in (replay_rank(setup, plan, conf, int(free.peak_reserved_bytes * fraction))
                           for fraction in (0.95, 0.9)) if r.num_alloc_retries and not r.oom]
    assert retried, "no cap made the allocator release and retry without running out"
    for capped in retried:
        assert capped.steady
        assert capped.peak_allocated_bytes <= capped.held_reserved_bytes < capped.peak_reserved_bytes


@pytest.mark.parametrize("case", CASES[1:3], ids=lambda c: f"{c[0].split('/')[1]}-{c[2]}-{c[3]}")
def test_a_sequence_of_shapes_equals_the_plain_replay(case):
    """Steps of mixed lengths (an epoch of padded batches; the manual loop frees the previous step's outputs at
    their own size), with and without an empty_cache() schedule: the compiled sequence replay equals the plain
    one, and a sequence of one shape reaches what the repeated-step replay reaches."""
    from estimator.reserved.replay import replay_sequence

    setup, longest, short, middle = _inputs(*case, other_lengths=(case[5] // 4, case[5] // 2))
    conf = reserved_rank.alloc_conf("")
    order = [short, longest, middle, short, middle, middle, longest, short, longest, middle]
    for every in (None, 3):
        got = replay_sequence(setup, order, conf, None, every)
        assert got == _plain_replay(setup, None, conf, None, sequence=order, empty_cache_every=every)
    alone = replay_rank(setup, longest, conf, None)
    assert replay_sequence(setup, [longest] * alone.steps, conf, None).peak_reserved_bytes == \
        alone.peak_reserved_bytes


ACCUMULATING = [("meta-llama/Llama-3.2-1B", "mixed_bf16", "single", "trainer", 2, 512),
                ("Qwen/Qwen2.5-0.5B", "bf16", "single", "manual", 3, 256),
                ("meta-llama/Llama-3.2-1B", "mixed_bf16", "ddp", "trainer", 2, 512)]


@pytest.mark.parametrize("case", ACCUMULATING, ids=lambda c: f"{c[0].split('/')[1]}-{c[2]}-{c[3]}")
def test_accumulating_replay_equals_the_plain_replay(case):
    """An optimizer step every 3 micro-steps: the compiled replay until a cycle repeats, and a sequence of mixed
    lengths with an empty_cache() schedule, against the plain replay of ``micro_step_requests``; a cap that
    forces release-and-retry or out-of-memory."""
    from estimator.reserved.replay import replay_sequence

    setup, plan, short = _inputs(*case, other_lengths=(case[5] // 2,))
    conf = reserved_rank.alloc_conf("")
    free = replay_rank(setup, plan, conf, None, accum=3)
    assert free == _plain_replay(setup, plan, conf, None, accum=3) and free.steady
    capped = replay_rank(setup, plan, conf, free.peak_reserved_bytes * 3 // 4, accum=3)
    assert capped == _plain_replay(setup, plan, conf, free.peak_reserved_bytes * 3 // 4, accum=3)
    assert capped.oom or capped.num_alloc_retries
    order = [short, plan, short, plan, plan, short, short, plan]
    assert replay_sequence(setup, order, conf, None, 2, accum=3) == \
        _plain_replay(setup, None, conf, None, sequence=order, empty_cache_every=2, accum=3)


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=lambda c: f"{c[0].split('/')[1]}-{c[2]}-{c[3]}")
def test_a_replay_stops_once_its_reserved_peak_passes_the_level(case):
    """``stop_above_bytes``: below the full replay's peak the replay stops with a peak above the level and no
    higher than the full one (the peak only rises); at the full peak or above it changes nothing; in every
    form (repeated steps, accumulation, a sequence of shapes)."""
    from estimator.reserved.replay import replay_sequence

    setup, plan, short = _inputs(*case, other_lengths=(case[5] // 2,))
    conf = reserved_rank.alloc_conf("")
    runs = {"steps": lambda stop: replay_rank(setup, plan, conf, None, stop_above_bytes=stop),
            "accumulation": lambda stop: replay_rank(setup, plan, conf, None, accum=2, stop_above_bytes=stop),
            "sequence": lambda stop: replay_sequence(setup, [short, plan, short, plan], conf, None,
                                                     stop_above_bytes=stop)}
    for name, run in runs.items():
        full = run(None)
        assert not full.stopped_above
        assert run(full.peak_reserved_bytes) == full, name
        for stop in (full.peak_reserved_bytes - 1, full.peak_reserved_bytes // 2):
            early = run(stop)
            assert early.stopped_above and stop < early.peak_reserved_bytes <= full.peak_reserved_bytes, name
            assert early.steps <= full.steps and not early.steady, name


def test_decide_fit_answers_fits_exactly_and_marks_lower_bounds():
    """The plan's ``estimate(decide_fit=True)``: the same ``fits`` at every micro-batch across the point where the
    full estimate stops fitting; the same numbers where it fits; lower bounds, marked, where it does not. The
    stop level is the largest reserved peak whose bound still fits."""
    from estimator.hardware.residuals import device_from_reserved, reserved_fit_limit_bytes, upper_bound_bytes
    from estimator.spec import RunSpec

    coeffs = load_coefficients("t4-16gb")
    capacity = 16 * GIB
    for communicators in (0, 1, 2):
        limit = reserved_fit_limit_bytes(capacity, coeffs, communicators)
        assert upper_bound_bytes(device_from_reserved(limit, coeffs, communicators), coeffs) <= capacity
        assert upper_bound_bytes(device_from_reserved(limit + 1, coeffs, communicators), coeffs) > capacity
    assert reserved_fit_limit_bytes(GIB // 4, coeffs, 0) == -1  # the CUDA context alone does not fit

    seen = set()
    for mb in (1, 2, 3, 4, 8):
        spec = RunSpec(model="Qwen/Qwen2.5-0.5B", gpu="t4-16gb",
                       training=TrainingSpec(precision="bf16", micro_batch_size=mb, seq_len=1024, loop="manual"))
        full = api.estimate(spec, alloc_conf="", allow_build=False)
        decided = api.estimate(spec, alloc_conf="", allow_build=False, decide_fit=True)
        assert full.reserved_source == decided.reserved_source == "replayed"
        assert decided.fits == full.fits, mb
        seen.add(full.fits)
        if full.fits:
            assert decided == full
        else:
            assert decided.ranks[0].reserved_lower_bound and not full.ranks[0].reserved_lower_bound
            assert decided.upper_bound_bytes <= full.upper_bound_bytes
            # above the capacity, or out of memory under it (a segment the cap refuses: no second replay)
            assert full.capacity_bytes < decided.upper_bound_bytes or decided.ranks[0].allocator_oom
            assert any("lower bounds" in n for n in decided.notes)
    assert seen == {True, False}
