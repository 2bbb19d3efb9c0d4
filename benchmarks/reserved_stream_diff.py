"""Where the estimator's generated allocation stream departs from a recorded one (a harness snapshot).

    PYTHONPATH=. .venv/bin/python benchmarks/reserved_stream_diff.py RUN_ID [--rank R] [--gpu h100-80gb] [--show 25]
        [--replay-refused] [--segments MIB] [--ablate]

For the run's spec (its row of ``data/measurements/<gpu>/gpu_snapshots.csv``) the estimator's replay is intercepted
(``estimator.reserved.rank.replay_rank``) to get its setup and step plan; the generated requests are the setup's
allocations then ``timeline.step_requests`` for three steps (what ``replay_rank`` replays, test
``test_reserved``). The recorded requests are the snapshot's ``alloc`` / ``free_requested`` events. Both are cut in
phases (setup, step 1, 2, 3; the recorded steps end at the trace's ``zero_grad`` annotations, else at the end of
each step's last ``Optimizer.step`` (a TP run steps one optimizer per kind of parameter), the recorded setup at the
first batch-sized int64 tensor) and aligned per phase by size (``difflib``). Printed: per phase the allocation
count, requested bytes and reserved level at the phase end (each stream through the model with the simulated
driver), the size multiset difference, and the first aligned runs that differ; then the reserved peak of
  - the recorded stream, recorded addresses (the measured peak, exact: ``estimator.allocator.replay``),
  - the recorded stream with the simulated driver (isolates the driver's addresses from the stream),
  - the generated stream with the simulated driver (the estimate).
``--segments MIB`` lists where steps 1-2's requests land in segments of at least MIB (which cached segments the
largest requests find); ``--ablate`` replays each stream less each size of its unmatched requests (which
differences decide its reserved peak); ``--replay-refused`` replays every-k over a first layer of another kind,
which the estimate keeps on the prior.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import difflib
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEASUREMENTS = ROOT / "data" / "measurements"
MIB = 1024 * 1024
# a snapshot runs to the end of the third training step; a TP run steps one optimizer per kind of parameter
# (DTensor shards, replicated tensors: harness.methods.tp), so each step ends at its last optimizer's end
STEPS = 3


def _row(run_id: str, gpu: str, rank: int = 0) -> dict:
    for name in ("gpu_snapshots.csv", "gpu_single.csv"):
        path = MEASUREMENTS / gpu / name
        if not path.exists():
            continue
        with open(path) as handle:
            for row in csv.DictReader(handle):
                if row["run_id"].startswith(run_id) and row["rank"] in (str(rank), "" if rank == 0 else str(rank)):
                    return row
    raise SystemExit(f"{run_id}: no row in {MEASUREMENTS / gpu}")


def intercepted_replay(run):
    """``run()`` with the estimator's reserved replay intercepted: (its result, {"setup", "plan"} of the first
    replay it made; empty when it made none)."""
    import estimator.reserved.rank as rank_mod

    caught: dict = {}
    original = rank_mod.replay_rank

    def spy(setup, plan, *args, **kwargs):
        caught.setdefault("setup", setup)
        caught.setdefault("plan", plan)
        return original(setup, plan, *args, **kwargs)

    rank_mod.replay_rank = spy
    try:
        return run(), caught
    finally:
        rank_mod.replay_rank = original


@contextlib.contextmanager
def every_k_over_other_first_layer():
    """The estimate refuses to replay every-k checkpointing over a first layer of another kind
    (``reserved.rank.why_not_layer_kinds``); for a diagnosis, let it replay the merged event list all the same."""
    import estimator.reserved.rank as rank_mod

    original = rank_mod.why_not_layer_kinds
    rank_mod.why_not_layer_kinds = lambda table, every_k=False: original(table, False)
    try:
        yield
    finally:
        rank_mod.why_not_layer_kinds = original


def _reserved_note(result) -> str:
    if isinstance(result, str):
        return result
    return next((note for note in result[0].notes if note.startswith("reserved:")), result[1].reserved_source)


def generated(row: dict, steps: int = 3, replay_refused: bool = False):
    """(requests, phase starts, estimate): the estimator's own request stream for the row's spec.
    ``replay_refused``: also where the estimate keeps the prior for every-k over a first layer of another kind."""
    import pandas as pd

    from calibrate.terms import rank_estimates
    from estimator.hardware.residuals import load_coefficients
    from estimator.reserved.timeline import step_requests

    refused = every_k_over_other_first_layer() if replay_refused else contextlib.nullcontext()
    with refused:
        result, caught = intercepted_replay(
            lambda: rank_estimates(pd.DataFrame([row]), load_coefficients(row["gpu_key"]), allow_build=False)[0])
    if "setup" not in caught:
        raise SystemExit(f"no replay for this spec: {_reserved_note(result)}")
    setup, plan = caught["setup"], caught["plan"]
    requests = []
    frees = dict(setup.frees_after)
    for i, (_name, nbytes) in enumerate(setup.allocations):
        if i == setup.empty_cache_before:
            requests.append(("empty_cache",))
        requests.append(("alloc", ("setup", i), nbytes, 0))
        requests.extend(("free", ("setup", j)) for j in frees.get(i, ()))
    starts = [0, len(requests)]
    base = 0
    for step in range(steps):
        for request in step_requests(plan, step, base):
            if request[0] == "alloc":
                requests.append(("alloc", ("s", request[1]), request[2], request[3]))
            else:
                requests.append((request[0], ("s", request[1])))
        starts.append(len(requests))
    return requests, starts, result


def recorded(path: Path, batch_bytes: int, setup_bytes: int = 0):
    """(requests, phase starts, snapshot) from a snapshot's device-0 trace. The setup ends at the first three
    batch-sized allocations in a row once ``setup_bytes`` (the generated setup's) are live: a layer's weights can
    have the batch's size."""
    from estimator.allocator.snapshot import load_snapshot

    snapshot = load_snapshot(str(path))
    trace = snapshot["device_traces"][0]
    annotations = snapshot.get("external_annotations", [])
    ends = [a["time_us"] for a in annotations if a["stage"] == "END" and "zero_grad" in a["name"]]
    if not ends and annotations:  # no zero_grad annotation (a wrapping optimizer): the outermost step's end
        ends = [a["time_us"] for a in annotations if a["stage"] == "END" and a["name"] == annotations[0]["name"]]
        ends = ends[len(ends) // STEPS - 1::len(ends) // STEPS] if len(ends) > STEPS else ends
    allocs, live_bytes, sizes = [], [], {}
    for event in trace:  # live requested bytes before each allocation
        if event["action"] == "alloc":
            allocs.append(event)
            live_bytes.append(sum(sizes.values()))
            sizes[event["addr"]] = event["size"]
        elif event["action"] == "free_requested":
            sizes.pop(event["addr"], None)
    first_batch = next(i for i in range(len(allocs) - 2) if live_bytes[i] >= setup_bytes - 4096
                       and all(a["size"] == batch_bytes for a in allocs[i:i + 3]))
    requests, live, generation = [], {}, 0
    starts = [0]
    for event in trace:
        while len(starts) - 2 < len(ends) and len(starts) >= 2 and event.get("time_us", 0) > ends[len(starts) - 2]:
            starts.append(len(requests))
        action = event["action"]
        if action == "alloc":
            if generation == first_batch:
                starts.append(len(requests))
            generation += 1
            live[event["addr"]] = generation
            requests.append(("alloc", generation, event["size"], event["stream"]))
        elif action == "free_requested":
            requests.append(("free", live.pop(event["addr"])))
    while len(starts) < 5:
        starts.append(len(requests))
    return requests, starts[:5], snapshot


def _live(requests) -> int:
    sizes = {}
    for r in requests:
        if r[0] == "alloc":
            sizes[r[1]] = r[2]
        elif r[0] == "free":
            sizes.pop(r[1])
    return sum(sizes.values())


def trajectory(requests, conf=None):
    """Per request: reserved bytes after it, through the model with the simulated driver; also the segment
    allocations (index, size)."""
    from estimator.allocator.model import CachingAllocator

    allocator = CachingAllocator(conf)
    addr, reserved, segments = {}, [], []
    for index, request in enumerate(requests):
        if request[0] == "alloc":
            before = allocator.reserved_bytes
            addr[request[1]] = allocator.malloc(request[2], request[3])
            if allocator.reserved_bytes > before:
                segments.append((index, allocator.reserved_bytes - before, request[2]))
        elif request[0] == "free":
            allocator.free(addr.pop(request[1]))
        reserved.append(allocator.reserved_bytes)
    return reserved, segments, allocator.peak_reserved_bytes


def capped_peak(requests, cap_bytes: int) -> tuple[int, int]:
    """(reserved peak, num_alloc_retries) of ``requests`` through the model with the simulated driver under an
    allocator cap (``set_per_process_memory_fraction``: a new segment past it first releases the cached blocks and
    retries); the estimate replays under the same cap where the spec carries it (``training.memory_cap_bytes``,
    read from the row)."""
    from estimator.allocator.model import CachingAllocator

    allocator = CachingAllocator(capacity_bytes=cap_bytes)
    addr = {}
    for request in requests:
        if request[0] == "alloc":
            addr[request[1]] = allocator.malloc(request[2], request[3])
        elif request[0] == "free":
            allocator.free(addr.pop(request[1]))
        elif request[0] == "empty_cache":
            allocator.empty_cache()
    return allocator.peak_reserved_bytes, allocator.num_alloc_retries


def placements(requests, lo: int, hi: int, min_segment_bytes: int) -> list[str]:
    """Requests ``lo:hi`` whose block lies in a segment of at least ``min_segment_bytes`` (through the model with
    the simulated driver): index, alloc / free, size, the segment (its creation order and size) and the offset in
    it. What shows which cached segments a step's largest requests find, and what holds the others."""
    import bisect

    from estimator.allocator.model import CachingAllocator

    events: list = []
    allocator = CachingAllocator(events=events)
    segments: list[tuple[int, int, int]] = []  # (base, bytes, creation order)
    placed: dict = {}
    out = []
    for index, request in enumerate(requests[:hi]):
        if request[0] == "alloc":
            seen = len(events)
            addr = allocator.malloc(request[2], request[3])
            for kind, base, nbytes, _stream in events[seen:]:
                if kind == "segment_alloc":
                    bisect.insort(segments, (base, nbytes, len(segments)))
            base, nbytes, order = segments[bisect.bisect_right(segments, (addr, 1 << 62, 0)) - 1]
            entry = placed[request[1]] = (addr, request[2], base, nbytes, order)
        elif request[0] == "free":
            entry = placed.pop(request[1])
            allocator.free(entry[0])
        else:
            continue
        addr, size, base, nbytes, order = entry
        if index >= lo and nbytes >= min_segment_bytes:
            what = "A" if request[0] == "alloc" else "F"
            out.append(f"{index:6d} {what} {_fmt(size):>12s} segment #{order} ({_fmt(nbytes)}) at "
                       f"{_fmt(addr - base)}")
    return out


def unmatched(requests, starts, other, other_starts, min_bytes: int = MIB) -> list[tuple]:
    """The allocations of at least ``min_bytes`` that the per-phase size alignment (``difflib``) leaves without
    a counterpart in the other stream."""
    out = []
    for phase in range(len(starts) - 1):
        mine = [r for r in requests[starts[phase]:starts[phase + 1]] if r[0] == "alloc"]
        theirs = [r[2] for r in other[other_starts[phase]:other_starts[phase + 1]] if r[0] == "alloc"]
        matcher = difflib.SequenceMatcher(None, [r[2] for r in mine], theirs, autojunk=False)
        matched = {i for tag, i1, i2, _j1, _j2 in matcher.get_opcodes() if tag == "equal" for i in range(i1, i2)}
        out.extend(r for i, r in enumerate(mine) if i not in matched and r[2] >= min_bytes)
    return out


def without(requests, drop: set) -> list:
    """The stream less the allocations named in ``drop`` and their frees."""
    return [r for r in requests if r[1] not in drop]


def ablation(requests, starts, other, other_starts) -> list[tuple[int | None, int, int]]:
    """(size, count, reserved peak) of the stream as it is (size 0), less each size of its unmatched requests
    (>= 1 MiB), then less all of them (size None): which differences from the other stream decide its peak."""
    extra = unmatched(requests, starts, other, other_starts)
    out: list[tuple[int | None, int, int]] = [(0, 0, trajectory(requests)[2])]
    for size in sorted({r[2] for r in extra}):
        drop = {r[1] for r in extra if r[2] == size}
        out.append((size, len(drop), trajectory(without(requests, drop))[2]))
    out.append((None, len(extra), trajectory(without(requests, {r[1] for r in extra}))[2]))
    return out


def _sizes(requests, lo, hi):
    return [r[2] for r in requests[lo:hi] if r[0] == "alloc"]


def _fmt(n: int) -> str:
    return f"{n / MIB:.3f}MiB" if n >= MIB else f"{n}B"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_id")
    parser.add_argument("--gpu", default="h100-80gb")
    parser.add_argument("--rank", type=int, default=0, help="which rank's snapshot (emulated ranks)")
    parser.add_argument("--show", type=int, default=20, help="differing aligned runs shown per phase")
    parser.add_argument("--replay-refused", action="store_true",
                        help="replay every-k over a first layer of another kind, which the estimate refuses")
    parser.add_argument("--segments", type=float, metavar="MIB",
                        help="list the step-1 and step-2 requests placed in segments of at least MIB MiB")
    parser.add_argument("--ablate", action="store_true",
                        help="each stream's reserved peak less each size of its unmatched requests (>= 1 MiB)")
    args = parser.parse_args(argv)
    row = _row(args.run_id, args.gpu, args.rank)
    b, s = int(row["micro_batch_size"]), int(row["seq_len"])
    snap = MEASUREMENTS / args.gpu / "snapshots" / f"{row['run_id']}.rank{row['rank'] or 0}.snapshot.pickle.gz"
    gen, gen_starts, result = generated(row, replay_refused=args.replay_refused)
    rec, rec_starts, _snapshot = recorded(snap, b * s * 8, _live(gen[:gen_starts[1]]))
    gen_res, gen_segs, gen_peak = trajectory(gen)
    rec_res, rec_segs, rec_peak = trajectory(rec)
    print(f"{row['run_id']} {row['model']} {row['precision']} b{b} s{s}: measured reserved "
          f"{int(row['peak_reserved_bytes']):,}  estimate {result[1].peak_reserved_bytes:,}")
    print(f"recorded stream, simulated driver: {rec_peak:,}  generated stream, simulated driver: {gen_peak:,}")
    if row.get("memory_cap_bytes"):
        cap = int(float(row["memory_cap_bytes"]))
        (rec_capped, rec_retries), (gen_capped, gen_retries) = capped_peak(rec, cap), capped_peak(gen, cap)
        print(f"under the run's allocator cap {cap:,} (retries measured {row.get('num_alloc_retries')}): recorded "
              f"stream {rec_capped:,} ({rec_retries} retries), generated stream {gen_capped:,} ({gen_retries})")
    names = ["setup", "step1", "step2", "step3"]
    for p, name in enumerate(names):
        g_lo, g_hi = gen_starts[p], gen_starts[p + 1]
        r_lo, r_hi = rec_starts[p], rec_starts[p + 1]
        gs, rs = _sizes(gen, g_lo, g_hi), _sizes(rec, r_lo, r_hi)
        g_peak = max(gen_res[g_lo:g_hi] or [0])
        r_peak = max(rec_res[r_lo:r_hi] or [0])
        print(f"\n== {name}: allocs gen {len(gs)} rec {len(rs)}; requested gen {_fmt(sum(gs))} rec {_fmt(sum(rs))}; "
              f"reserved peak in phase gen {g_peak:,} rec {r_peak:,} (diff {g_peak - r_peak:+,})")
        gseg = [x for x in gen_segs if g_lo <= x[0] < g_hi]
        rseg = [x for x in rec_segs if r_lo <= x[0] < r_hi]
        print(f"   new segments gen {len(gseg)} ({_fmt(sum(x[1] for x in gseg))}) rec {len(rseg)} "
              f"({_fmt(sum(x[1] for x in rseg))})")
        diff = Counter(gs)
        diff.subtract(Counter(rs))
        extra = sorted(((k, v) for k, v in diff.items() if v > 0), key=lambda kv: -kv[0] * kv[1])
        missing = sorted(((k, -v) for k, v in diff.items() if v < 0), key=lambda kv: -kv[0] * kv[1])
        print("   sizes only in generated (size x count):", ", ".join(f"{_fmt(k)}x{v}" for k, v in extra[:10]))
        print("   sizes only in recorded  (size x count):", ", ".join(f"{_fmt(k)}x{v}" for k, v in missing[:10]))
        matcher = difflib.SequenceMatcher(None, gs, rs, autojunk=False)
        shown = 0
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag == "equal" or shown >= args.show:
                continue
            big = [x for x in gs[i1:i2] + rs[j1:j2] if x > MIB]
            if not big:
                continue
            print(f"   {tag:7s} gen[{i1}:{i2}] {[_fmt(x) for x in gs[i1:i2]][:6]} rec[{j1}:{j2}] "
                  f"{[_fmt(x) for x in rs[j1:j2]][:6]}")
            shown += 1
    if args.segments:
        for name, requests, starts in (("generated", gen, gen_starts), ("recorded", rec, rec_starts)):
            print(f"\n== {name}: steps 1-2, requests in segments >= {args.segments:g} MiB")
            print("\n".join(placements(requests, starts[1], starts[3], int(args.segments * MIB))))
    if args.ablate:
        for name, mine, theirs in (("recorded", (rec, rec_starts), (gen, gen_starts)),
                                   ("generated", (gen, gen_starts), (rec, rec_starts))):
            print(f"\n== {name} stream's reserved peak (simulated driver)")
            for size, count, peak in ablation(*mine, *theirs):
                what = "as it is" if size == 0 else "less all its unmatched" if size is None else \
                    f"less its unmatched {_fmt(size)}"
                print(f"   {what:36s} x{count:<4d} {peak:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
