"""The allocator's state at a trace's first event, undone backwards from the snapshot's final segments.

Segments: the final ones, minus those the trace cudaMalloc'ed, plus those it cudaFree'd (expandable
segments: pages mapped at the end, minus those the trace mapped, plus those it unmapped). Live blocks:
those allocated at the end, minus the trace's allocations, plus the blocks it freed. Free space is then
determined, because the allocator always merges free neighbours. What a trace cannot show is the size
of a block allocated before recording and freed during it (the free event carries the requested bytes):
it is taken as the rounded request, or the whole gap to its neighbour when that gap is too small for the
allocator to have split it off; `guessed` counts the blocks where this choice mattered.
"""

import dataclasses
from bisect import bisect_left, bisect_right, insort

from estimator.allocator.model import (
    LARGE_BUFFER_BYTES,
    MIN_BLOCK_BYTES,
    SMALL_BUFFER_BYTES,
    SMALL_SIZE_BYTES,
    round_size,
)

_LIVE_STATES = ("active_allocated", "active_pending_free")


@dataclasses.dataclass
class Segment:
    addr: int
    size: int
    stream: int
    small: bool
    pieces: list = dataclasses.field(default_factory=list)  # (addr, size, kind, requested)
    expandable: tuple = None  # (base, page_bytes, n_pages) for an expandable segment


@dataclasses.dataclass
class State:
    segments: list
    live: dict  # addr -> (size or None, requested)
    warm: bool
    reserved_bytes: int
    guessed: int


def reconstruct_initial_state(segments, trace, conf, device_total_bytes=80 * 1024 ** 3):
    fixed = {s["address"]: (s["total_size"], s["stream"], s["segment_type"] == "small")
             for s in segments if not s.get("is_expandable")}
    live = {}
    for seg in segments:
        addr = seg["address"]
        for block in seg["blocks"]:
            if block["state"] in _LIVE_STATES:
                live[block.get("address", addr)] = (block["size"], block["requested_size"])
            addr += block["size"]
    expandable = _ExpandableGroups(segments, trace)
    for event in reversed(trace):
        action = event["action"]
        if action == "alloc":
            live.pop(event["addr"], None)
        elif action == "free_requested":
            live[event["addr"]] = (None, event["size"])
        elif action == "segment_alloc":
            fixed.pop(event["addr"], None)
        elif action == "segment_free":
            fixed[event["addr"]] = (event["size"], event["stream"], event["size"] == SMALL_BUFFER_BYTES)
        elif action in ("segment_map", "segment_unmap"):
            expandable.undo(event)
    extents = [(a, a + size) for a, (size, _, _) in fixed.items()]
    extents += [(seg.addr, seg.addr + seg.size) for seg in expandable.segments(device_total_bytes)]
    _pin_sizes_from_trace(live, trace, sorted(extents))
    result, guessed = [], 0
    for addr, (size, stream, small) in sorted(fixed.items()):
        seg = Segment(addr, size, stream, small)
        guessed += _fill(seg.pieces, addr, addr + size, live, small, conf)
        result.append(seg)
    for seg in expandable.segments(device_total_bytes):
        for run_start, run_end, mapped in seg.runs:
            if mapped:
                guessed += _fill(seg.pieces, run_start, run_end, live, seg.small, conf)
            else:
                seg.pieces.append((run_start, run_end - run_start, "unmapped", 0))
        result.append(seg)
    reserved = sum(s.size for s in result if s.expandable is None)
    reserved += sum(p[1] for s in result if s.expandable is not None for p in s.pieces if p[2] != "unmapped")
    return State(result, dict(live), bool(reserved or live), reserved, guessed)


def _pin_sizes_from_trace(live, trace, extents):
    """An allocation always starts a free block, and the block before a free block is allocated: so an
    allocation at R inside a segment ends the live block nearest below R at R. This pins the sizes of
    blocks allocated before recording (until they are freed)."""
    unknown = {a for a, (size, _) in live.items() if size is None}
    if not unknown:
        return
    starts = [e[0] for e in extents]
    live_addrs = sorted(live)
    for event in trace:
        action, addr = event["action"], event.get("addr")
        if action == "alloc":
            i = bisect_right(live_addrs, addr) - 1
            if i >= 0 and live_addrs[i] in unknown:
                below = live_addrs[i]
                k = bisect_right(starts, below) - 1
                if k >= 0 and extents[k][0] < addr < extents[k][1] and below < addr:
                    live[below] = (addr - below, live[below][1])
                    unknown.discard(below)
            insort(live_addrs, addr)
        elif action == "free_requested":
            i = bisect_left(live_addrs, addr)
            if i < len(live_addrs) and live_addrs[i] == addr:
                del live_addrs[i]
            unknown.discard(addr)
        if not unknown:
            return


def _fill(pieces, start, end, live, small, conf):
    """Live blocks inside [start, end) and the free gaps between them; returns the number of guesses."""
    inside = sorted(a for a in live if start <= a < end)
    cursor, guesses = start, 0
    for k, addr in enumerate(inside):
        size, requested = live[addr]
        boundary = inside[k + 1] if k + 1 < len(inside) else end
        if size is None:
            guesses += 1
            size = round_size(requested, conf)
            gap = boundary - addr - size
            if gap < 0 or (small and gap < MIN_BLOCK_BYTES) or (not small and gap <= SMALL_SIZE_BYTES):
                size = boundary - addr
            live[addr] = (size, requested)
        if addr > cursor:
            pieces.append((cursor, addr - cursor, "free", 0))
        pieces.append((addr, size, "allocated", requested))
        cursor = addr + size
    if cursor < end:
        pieces.append((cursor, end - cursor, "free", 0))
    return guesses


class _ExpandableGroups:
    """Expandable segments, one per (stream, pool) as the allocator makes them; mapped pages at start."""

    def __init__(self, segments, trace):
        self.pages = {}  # (stream, small) -> set of mapped page start addresses
        self.low = {}  # (stream, small) -> lowest address seen
        for seg in segments:
            if seg.get("is_expandable"):
                key = (seg["stream"], seg["segment_type"] == "small")
                self._touch(key, seg["address"])
                page = _page(key[1])
                for offset in range(0, seg["total_size"], page):
                    self.pages.setdefault(key, set()).add(seg["address"] + offset)
        self.pool_of_map = {}
        for index, event in enumerate(trace):
            if event["action"] == "segment_map":
                small = _pool_of_request_after(trace, index)
                self.pool_of_map[index] = small
                self._touch((event["stream"], small), event["addr"])
        self._trace_ids = {id(e): i for i, e in enumerate(trace)}

    def _touch(self, key, addr):
        self.low[key] = min(self.low.get(key, addr), addr)
        self.pages.setdefault(key, set())

    def _key_for(self, event):
        index = self._trace_ids[id(event)]
        if index in self.pool_of_map:
            return (event["stream"], self.pool_of_map[index])
        same_stream = [k for k in self.low if k[0] == event["stream"] and self.low[k] <= event["addr"]]
        key = max(same_stream, key=lambda k: self.low[k]) if same_stream else (event["stream"], False)
        self._touch(key, event["addr"])
        return key

    def undo(self, event):
        key = self._key_for(event)
        page = _page(key[1])
        pages = self.pages[key]
        for offset in range(0, event["size"], page):
            if event["action"] == "segment_map":
                pages.discard(event["addr"] + offset)
            else:
                pages.add(event["addr"] + offset)

    def segments(self, device_total_bytes):
        for (stream, small), pages in sorted(self.pages.items()):
            page = _page(small)
            base = self.low[(stream, small)]
            n_pages = -(-(device_total_bytes + device_total_bytes // 8) // page)
            seg = Segment(base, n_pages * page, stream, small, expandable=(base, page, n_pages))
            seg.runs = _runs(base, base + n_pages * page, page, pages)
            yield seg


def _runs(start, end, page, mapped_pages):
    runs, cursor = [], start
    for addr in sorted(mapped_pages):
        if addr > cursor:
            runs.append((cursor, addr, False))
        if runs and runs[-1][2] and runs[-1][1] == addr:
            runs[-1] = (runs[-1][0], addr + page, True)
        else:
            runs.append((addr, addr + page, True))
        cursor = addr + page
    if cursor < end:
        runs.append((cursor, end, False))
    return runs


def _page(small):
    return SMALL_BUFFER_BYTES if small else LARGE_BUFFER_BYTES


def _pool_of_request_after(trace, index):
    for event in trace[index + 1:]:
        if event["action"] in ("alloc", "oom"):
            return round_size(event["size"], _DEFAULT) <= SMALL_SIZE_BYTES
    return False


class _Defaults:
    @staticmethod
    def divisions_for(size):
        return 0


_DEFAULT = _Defaults()
