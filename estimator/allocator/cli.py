"""`python -m estimator.allocator replay SNAPSHOT.pickle [--device N] [--json]`."""

import argparse
import json
import sys

from estimator.allocator.config import parse_alloc_conf
from estimator.allocator.replay import TraceError, replay_device
from estimator.allocator.snapshot import SnapshotError, check_snapshot, load_snapshot

_NO_TRACE = ("replay needs a trace: this snapshot holds the allocator's state only (record one with "
             "torch.cuda.memory._record_memory_history() before the run, then _dump_snapshot())")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def _parser():
    parser = _Parser(prog="python -m estimator.allocator",
                     description="Replay a PyTorch CUDA memory snapshot through the caching-allocator model.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    replay = commands.add_parser("replay", help="replay every device's trace and compare with the recording")
    replay.add_argument("snapshot", help="a torch.cuda.memory._dump_snapshot() pickle")
    replay.add_argument("--device", type=int, default=None, help="replay this device only")
    replay.add_argument("--json", action="store_true", help="print one JSON object")
    replay.add_argument("--alloc-conf", default=None, metavar="STRING",
                        help="replay under this PYTORCH_CUDA_ALLOC_CONF instead of the settings the snapshot "
                             "recorded (snapshots without settings: PyTorch's defaults)")
    return parser


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        conf = None if args.alloc_conf is None else parse_alloc_conf(args.alloc_conf)
        snapshot = check_snapshot(load_snapshot(args.snapshot))
        devices = _devices(snapshot, args.device)
        if not devices:
            _print_state_only(snapshot, args.json)
            raise TraceError(_NO_TRACE)
        reports = {d: replay_device(snapshot, d, conf=conf) for d in devices}
    except (SnapshotError, TraceError, ValueError) as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    summary = _summary(reports)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(_text(args.snapshot, summary))
    return 0


def _devices(snapshot, wanted):
    traces = snapshot["device_traces"]
    if wanted is None:
        return [d for d, trace in enumerate(traces) if trace]
    if wanted < 0 or wanted >= len(traces) or not traces[wanted]:
        raise TraceError(f"device {wanted} has no trace events (devices with traces: "
                         f"{[d for d, t in enumerate(traces) if t] or 'none'})")
    return [wanted]


def segment_summary(snapshot):
    per_device = {}
    for seg in snapshot["segments"]:
        row = per_device.setdefault(seg.get("device", 0), {"segments": 0, "reserved_bytes": 0,
                                                           "allocated_bytes": 0, "small_segments": 0,
                                                           "expandable_segments": 0})
        row["segments"] += 1
        row["reserved_bytes"] += seg["total_size"]
        row["allocated_bytes"] += sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
        row["small_segments"] += seg["segment_type"] == "small"
        row["expandable_segments"] += bool(seg.get("is_expandable"))
    return per_device


def _print_state_only(snapshot, as_json):
    summary = segment_summary(snapshot)
    if as_json:
        print(json.dumps({"state_only": True, "devices": summary, "note": _NO_TRACE}, indent=1))
        return
    for device, row in sorted(summary.items()):
        print(f"device {device}: {row['segments']} segments ({row['small_segments']} small, "
              f"{row['expandable_segments']} expandable), reserved {_mib(row['reserved_bytes'])}, "
              f"allocated {_mib(row['allocated_bytes'])}")
    if not summary:
        print("no segments")


def _summary(reports):
    total = {key: sum(r[key] for r in reports.values())
             for key in ("allocs", "addr_matches", "segment_events", "segment_matches", "mismatch_count",
                         "ooms_recorded", "ooms_simulated")}
    worst = max(reports.values(), key=lambda r: r["reserved_peak_bytes"]["recorded"])
    total["reserved_peak_bytes"] = dict(worst["reserved_peak_bytes"])  # the largest device peak
    total["mismatches"] = [dict(m, device=d) for d, r in reports.items() for m in r["mismatches"]]
    total["devices"] = {str(d): r for d, r in reports.items()}
    return total


def _pct(part, whole):
    return "100 %" if whole == 0 else f"{100.0 * part / whole:.2f} %"


def _mib(nbytes):
    return f"{nbytes / 2 ** 20:,.1f} MiB"


def _text(path, summary):
    lines = [f"replay of {path}"]
    for device, r in summary["devices"].items():
        peak = r["reserved_peak_bytes"]
        lines += [
            f"device {device}: {'warm' if r['warm_start'] else 'cold'} start, {r['initial_reserved_bytes']:,} B "
            f"reserved and {r['initial_live_blocks']} live blocks at the first event "
            f"({r['guessed_block_sizes']} block sizes guessed)",
            f"  allocs {r['allocs']}, addresses matched {r['addr_matches']} ({_pct(r['addr_matches'], r['allocs'])})",
            f"  segment events {r['segment_events']}, matched {r['segment_matches']} "
            f"({_pct(r['segment_matches'], r['segment_events'])}); ooms recorded {r['ooms_recorded']}, "
            f"simulated {r['ooms_simulated']}; alloc retries {r['num_alloc_retries']}",
            f"  reserved peak recorded {peak['recorded']:,} B, simulated {peak['simulated']:,} B "
            f"({'equal' if peak['recorded'] == peak['simulated'] else 'differ'})"]
        for m in r["mismatches"][:10]:
            lines.append(f"  mismatch at event {m['event']} ({m['action']}): recorded {m['recorded']}, "
                         f"simulated {m['simulated']}")
        if r["mismatch_count"] > 10:
            lines.append(f"  ... {r['mismatch_count'] - 10} more mismatches")
    return "\n".join(lines)
