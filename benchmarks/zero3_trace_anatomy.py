"""The anatomy of a DeepSpeed ZeRO-3 rank from its real allocator snapshot, and how much each modelling
simplification costs the reserved peak.

    PYTHONPATH=. .venv/bin/python benchmarks/zero3_trace_anatomy.py [SNAPSHOT ...]

Default: the four H100 ZeRO-3 snapshots of ``data/measurements/h100-80gb/snapshots`` (Llama-3.2-1B, mixed_bf16,
b1 s1024, 2 and 4 emulated ranks). Per snapshot:

* the streams (0: the default one; then in order of first use) with their allocations by size, per phase: setup
  (before the first step's batch), each step's forward+backward, each optimizer step (``Optimizer.step``
  annotations);
* the frees whose block waited for another stream (``record_stream``: a ``free_requested`` not followed at once by
  its ``free_completed``), on which stream they were allocated and how many allocations they waited;
* the reserved peak per stream;
* each stream's requests replayed alone: the pools never share blocks and nothing is released after the setup's
  ``empty_cache``, so the rank's reserved peak is the sum of the streams' own peaks;
* the trace's own requests replayed through the allocator model under four assumptions: (a) a delayed free
  returns its block where the trace completed it; (b) at once, where it was requested (the GPU keeping up: what
  the estimator's op lists can say without a record_stream op); (c) as (a) on one stream; (d) as (b) with each
  stream's first step (DeepSpeed's trace-building step) kept.

Load snapshots only through ``estimator.allocator.snapshot.load_snapshot`` (a restricted unpickler).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOTS = ROOT / "data/measurements/h100-80gb/snapshots"
DEFAULT = [SNAPSHOTS / f"{run}.rank{r}.snapshot.pickle.gz"
           for run, ranks in (("c48192443733c281-c4073027", (0, 1)), ("3ecb0313a7cc836b-a4b7c02a", (0, 3)))
           for r in ranks]
MIB = 2**20
GIB = 2**30


def _trace(path):
    from estimator.allocator.snapshot import check_snapshot, load_snapshot

    snapshot = check_snapshot(load_snapshot(str(path)))
    trace = snapshot["device_traces"][0]
    streams: dict[int, int] = {0: 0}
    for event in trace:
        streams.setdefault(event["stream"], len(streams))
    starts = [a["time_us"] for a in snapshot.get("external_annotations", ()) if a["stage"] == "START"]
    ends = [a["time_us"] for a in snapshot.get("external_annotations", ()) if a["stage"] == "END"]
    return trace, streams, starts, ends


def _requests(trace, streams, delayed_at: str, one_stream: bool = False):
    """The trace as ``estimator.allocator.requests`` tuples; ``delayed_at``: 'completed' or 'requested'."""
    key_of: dict[int, int] = {}
    out, pending = [], set()
    for i, event in enumerate(trace):
        action = event["action"]
        stream = 0 if one_stream else streams[event["stream"]]
        if action == "alloc":
            key_of[event["addr"]] = i
            out.append(("alloc", i, event["size"], stream))
        elif action == "free_requested":
            following = trace[i + 1] if i + 1 < len(trace) else None
            at_once = following and following["action"] == "free_completed" and following["addr"] == event["addr"]
            if at_once or delayed_at == "requested":
                out.append(("free", key_of[event["addr"]]))
            else:
                pending.add(event["addr"])
        elif action == "free_completed" and event["addr"] in pending:
            pending.discard(event["addr"])
            out.append(("free", key_of[event["addr"]]))
        elif action == "segment_free" and trace[i - 1]["action"] != "segment_free":
            out.append(("empty_cache",))  # no OOM in these traces: a release is torch.cuda.empty_cache()
    return out


def stream_pools(trace, streams) -> dict[int, int]:
    """Each stream's reserved peak from its own requests alone (the plain-free sequence kept to that stream)."""
    from estimator.allocator.requests import simulate

    requests = _requests(trace, streams, "requested")
    stream_of = {r[1]: r[3] for r in requests if r[0] == "alloc"}
    pools = {}
    for stream in sorted(set(streams.values())):
        mine = [r for r in requests if r[0] == "empty_cache" or stream_of.get(r[1]) == stream]
        pools[stream] = simulate(mine)["peak_reserved_bytes"]
    return pools


def anatomy(path) -> dict:
    from estimator.allocator.requests import simulate

    trace, streams, starts, ends = _trace(path)
    # phases: setup until the first step's first 8 KiB int64 batch is hard to spot; the optimizer annotations are
    # exact, so a phase is "before optimizer k" / "optimizer k"
    phase_names = []
    for k in range(len(starts)):
        phase_names += [f"fw+bw {k + 1}" if k else "setup+fw+bw 1", f"optimizer {k + 1}"]
    phase_names.append("after")
    bounds = sorted(starts + ends)

    def phase(t):
        return phase_names[sum(1 for b in bounds if b <= t)]

    allocs: dict = {}
    live: dict[int, tuple] = {}
    delayed: Counter = Counter()
    waits: dict[int, list[int]] = {}
    requested_at: dict[int, int] = {}
    mallocs = 0
    reserved: Counter = Counter()
    peak, peak_at, peak_streams = 0, None, None
    for i, event in enumerate(trace):
        action, stream = event["action"], streams[event["stream"]]
        if action == "alloc":
            mallocs += 1
            live[event["addr"]] = (stream, event["size"])
            allocs.setdefault((phase(event["time_us"]), stream), Counter())[event["size"]] += 1
        elif action == "free_requested":
            following = trace[i + 1] if i + 1 < len(trace) else None
            if not (following and following["action"] == "free_completed" and following["addr"] == event["addr"]):
                home = live.get(event["addr"], (stream, 0))[0]
                delayed[(phase(event["time_us"]), home, event["size"])] += 1
                requested_at[event["addr"]] = mallocs
        elif action == "free_completed" and event["addr"] in requested_at:
            waits.setdefault(streams[event["stream"]], []).append(mallocs - requested_at.pop(event["addr"]))
        elif action in ("segment_alloc", "segment_free"):
            reserved[stream] += event["size"] if action == "segment_alloc" else -event["size"]
            total = sum(reserved.values())
            if total > peak:
                peak, peak_at, peak_streams = total, phase(event["time_us"]), dict(reserved)
    replays = {
        "(a) delayed frees where completed": simulate(_requests(trace, streams, "completed")),
        "(b) delayed frees at once": simulate(_requests(trace, streams, "requested")),
        "(c) as (a), one stream": simulate(_requests(trace, streams, "completed", True)),
        "(d) as (b), one stream": simulate(_requests(trace, streams, "requested", True)),
    }
    return dict(path=path, streams=streams, allocs=allocs, delayed=delayed, waits=waits, peak=peak, peak_at=peak_at,
                peak_streams=peak_streams, replays=replays, pools=stream_pools(trace, streams))


def _sizes(counter: Counter, top: int = 6) -> str:
    items = sorted(counter.items(), key=lambda kv: -kv[0] * kv[1])[:top]
    return ", ".join(f"{n} x {size / MIB:.2f} MiB" for size, n in items)


def report(a: dict) -> None:
    print(f"== {Path(a['path']).name}")
    print(f"streams: {', '.join(f's{v}={k}' for k, v in a['streams'].items())}")
    for (ph, stream), counter in sorted(a["allocs"].items(), key=lambda kv: (kv[0][0].split()[-1], kv[0])):
        total = sum(size * n for size, n in counter.items())
        print(f"  {ph:>14} s{stream}: {sum(counter.values()):5d} allocs, {total / GIB:7.3f} GiB: {_sizes(counter)}")
    by_phase: dict = {}
    for (ph, home, size), n in a["delayed"].items():
        by_phase.setdefault((ph, home), Counter())[size] += n
    for (ph, home), counter in sorted(by_phase.items()):
        print(f"  delayed frees {ph:>14}, blocks of s{home}: {sum(counter.values())}: {_sizes(counter)}")
    for stream, waits in sorted(a["waits"].items()):
        w = Counter(min(x, 5) for x in waits)
        print(f"  completed via s{stream}: allocations waited {dict(sorted(w.items()))} (5 = 5 or more)")
    print(f"  reserved peak {a['peak']} B ({a['peak'] / GIB:.3f} GiB) in {a['peak_at']}: "
          + ", ".join(f"s{s} {b / GIB:.3f} GiB" for s, b in sorted(a["peak_streams"].items())))
    pools = a["pools"]
    print("  each stream alone: " + ", ".join(f"s{s} {b} B" for s, b in pools.items())
          + f"; sum {sum(pools.values())} B ({sum(pools.values()) - a['peak']:+d} B against the peak)")
    for name, r in a["replays"].items():
        err = (r["peak_reserved_bytes"] - a["peak"]) / a["peak"] * 100
        print(f"  replay {name:<38} reserved {r['peak_reserved_bytes']:>12} ({err:+.2f} %), "
              f"allocated {r['peak_allocated_bytes']}")


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    paths = [Path(p) for p in (argv if argv is not None else sys.argv[1:])] or DEFAULT
    for path in paths:
        report(anatomy(path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
