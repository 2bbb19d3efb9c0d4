"""Replay every recorded allocator trace in a folder and print the table of docs/allocator.md.

    PYTHONPATH=$PWD python benchmarks/allocator_traces.py /work/shared/data/allocator-traces
    PYTHONPATH=$PWD python benchmarks/allocator_traces.py /work/shared/data/allocator-traces --ablate

`--ablate` replays them again with one allocator rule broken at a time and counts the mismatches each
broken rule causes: a rule whose breaking changes nothing is a rule these traces do not test.
"""

import argparse
import contextlib
import pathlib

from estimator.allocator import model as allocator_model
from estimator.allocator.replay import replay_device
from estimator.allocator.snapshot import check_snapshot, load_snapshot


def _reports(folder, tolerate_breakage=False):
    for path in sorted(pathlib.Path(folder).rglob("*.pickle")):
        snapshot = check_snapshot(load_snapshot(str(path)))
        for device, trace in enumerate(snapshot["device_traces"]):
            if not trace:
                continue
            try:
                yield path, device, len(trace), replay_device(snapshot, device)
            except (AssertionError, AttributeError, KeyError, IndexError, ValueError):
                if not tolerate_breakage:
                    raise
                yield path, device, len(trace), None  # a broken rule broke the model's own invariants


def table(folder):
    print("| file | device | events | start | allocs matched | segment events matched | ooms rec/sim | "
          "reserved peak recorded | simulated | blocks sized by rule |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path, device, n_events, r in _reports(folder):
        peak = r["reserved_peak_bytes"]
        print(f"| {path.parent.name}/{path.name} | {device} | {n_events} | "
              f"{'warm' if r['warm_start'] else 'cold'} | {r['addr_matches']}/{r['allocs']} | "
              f"{r['segment_matches']}/{r['segment_events']} | {r['ooms_recorded']}/{r['ooms_simulated']} | "
              f"{peak['recorded']:,} | {peak['simulated']:,} | {r['guessed_block_sizes']} |")


@contextlib.contextmanager
def _patched(owner, name, replacement):
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _split_always(self, block, size, pool):
    return block.size - size >= allocator_model.MIN_BLOCK_BYTES


def _no_20mib_segments(size):
    if size <= allocator_model.SMALL_SIZE_BYTES:
        return allocator_model.SMALL_BUFFER_BYTES
    return -(-size // allocator_model.ROUND_LARGE_BYTES) * allocator_model.ROUND_LARGE_BYTES


def _first_fit(self, pool, stream, size):
    address = (1 << 64) - 1
    candidates = [k for k in pool.free if allocator_model.key_stream(k) == stream and allocator_model.key_size(k) >= size]
    if not candidates:
        return None
    key = min(candidates, key=lambda k: k & address)
    pool.free.remove(key)
    return self.blocks[key & address]


def _no_merge(self, dst, src, pool):
    return None


def _release_small_first(self):
    self._synchronize_and_free_events()
    self._release_blocks(self.small_pool)
    self._release_blocks(self.large_pool)


ABLATIONS = {
    "large pool splits any remainder >= 512 B (not only > 1 MiB)":
        (allocator_model.CachingAllocator, "_should_split", _split_always),
    "1-10 MiB requests get a 2 MiB-rounded segment (no 20 MiB kLargeBuffer)":
        (allocator_model, "allocation_size", _no_20mib_segments),
    "first fit by address instead of best fit by size":
        (allocator_model.CachingAllocator, "_get_free_block", _first_fit),
    "free neighbours are not merged":
        (allocator_model.CachingAllocator, "_try_merge", _no_merge),
    "release_cached_blocks frees the small pool before the large one":
        (allocator_model.CachingAllocator, "_release_cached_blocks", _release_small_first),
}


def ablate(folder):
    print("| rule broken | alloc mismatches | segment mismatches | traces affected |")
    print("|---|---|---|---|")
    for label, (owner, name, replacement) in ABLATIONS.items():
        allocs = segments = affected = crashed = 0
        with _patched(owner, name, replacement):
            for _, _, _, r in _reports(folder, tolerate_breakage=True):
                if r is None:
                    affected += 1
                    crashed += 1
                    continue
                bad_allocs = r["allocs"] - r["addr_matches"]
                bad_segments = r["segment_events"] - r["segment_matches"]
                allocs += bad_allocs
                segments += bad_segments
                affected += bool(bad_allocs or bad_segments)
        broke = f" ({crashed} replays stopped: the model's invariants broke)" if crashed else ""
        print(f"| {label} | {allocs} | {segments} | {affected}{broke} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--ablate", action="store_true")
    args = parser.parse_args()
    (ablate if args.ablate else table)(args.folder)


if __name__ == "__main__":
    main()
