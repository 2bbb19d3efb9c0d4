"""Replay a recorded `torch.cuda.memory._dump_snapshot` trace through the allocator model.

The model is driven by the trace's requests only (alloc sizes as requested, frees, and the one thing a
trace holds that the model cannot decide: what the driver answered). When the model calls cudaMalloc
(or maps pages), the answer comes from the recording: success with the recorded address if the real
allocator's next segment event is a segment_alloc (segment_map), failure if the real allocator went on
to release memory or raise instead. Every block address and every segment event the model produces is
then compared with the recording.
"""

from estimator.allocator.config import config_from_snapshot_settings
from estimator.allocator.initial_state import reconstruct_initial_state
from estimator.allocator.model import (
    SMALL_BUFFER_BYTES,
    Block,
    CachingAllocator,
    ExpandableSegment,
    OutOfMemory,
    free_key,
)

SEGMENT_ACTIONS = ("segment_alloc", "segment_free", "segment_map", "segment_unmap")
_GROWS = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
_MAX_LISTED_MISMATCHES = 20
_SYNTHETIC_ADDR = 0x7FF0_0000_0000
_TRACE_EVENT_STREAM = -1  # stands for "the streams the block was used on", which traces do not name


class TraceError(ValueError):
    """A snapshot that cannot be replayed (no trace, malformed events)."""


class RecordedDriver:
    """Answers the model's driver calls from the segment events recorded for the current request."""

    def __init__(self):
        self.window = []  # recorded segment/oom events that precede the current request
        self.model_events = None
        self.start = 0
        self._synthetic = _SYNTHETIC_ADDR
        self.in_use = {}  # the model's blocks by address, to refuse a recorded address the model still holds

    def begin(self, window, model_events):
        self.window, self.model_events, self.start = window, model_events, len(model_events)

    def _next(self):
        k = len(self.model_events) - self.start
        return self.window[k] if k < len(self.window) else None

    def _answer(self, success_action):
        upcoming = self._next()
        if upcoming is None:
            return "diverged"
        return upcoming if upcoming["action"] == success_action else None

    def malloc(self, size, stream):
        upcoming = self._answer("segment_alloc")
        if upcoming == "diverged" or (upcoming is not None and upcoming["addr"] in self.in_use):
            return self._fresh(size)  # the model went its own way: give it an address nobody holds
        return None if upcoming is None else upcoming["addr"]

    def map(self, addr, size, stream):
        return self._answer("segment_map") is not None

    def reserve_range(self, size, stream, small):
        upcoming = self._next()
        if upcoming is not None and upcoming["action"] == "segment_map" and upcoming["addr"] not in self.in_use:
            return upcoming["addr"]
        return self._fresh(size)

    def _fresh(self, size):
        addr = self._synthetic
        self._synthetic += size + SMALL_BUFFER_BYTES
        return addr

    def free(self, addr, size):
        pass

    def unmap(self, addr, size):
        pass

    def release_range(self, base, size):
        pass


def replay_device(snapshot, device, device_total_bytes=None, conf=None):
    """Replay one device's trace; returns the comparison report (a dict of numbers and mismatches).
    `conf` replaces the settings the snapshot recorded (or PyTorch's defaults when it recorded none)."""
    traces = snapshot.get("device_traces") or []
    if device >= len(traces) or not traces[device]:
        raise TraceError(f"device {device} has no trace events to replay")
    trace = traces[device]
    conf = conf or config_from_snapshot_settings(snapshot.get("allocator_settings"))
    segments = [s for s in snapshot.get("segments", []) if s.get("device", device) == device]
    state = reconstruct_initial_state(segments, trace, conf)
    driver = RecordedDriver()
    model_events = []
    model = CachingAllocator(conf, driver=driver, events=model_events,
                             device_total_bytes=device_total_bytes or 80 * 1024 ** 3)
    addr_map = _install_state(model, state)
    driver.in_use = model.blocks
    replayer = _Replayer(model, driver, model_events, addr_map, state)
    replayer.final_segments_bytes = sum(s["total_size"] for s in segments)
    return replayer.run(trace)


def _install_state(model, state):
    """Put the reconstructed segments into the model; returns recorded address -> model address."""
    addr_map = {}
    for seg in state.segments:
        if seg.expandable is not None:
            _install_expandable(model, seg)
            continue
        pool = model.small_pool if seg.small else model.large_pool
        _chain(model, pool, seg.stream, seg.small, seg.pieces, None)
        model.reserved_bytes += seg.size
    for piece_addr in state.live:
        addr_map[piece_addr] = piece_addr
    model.peak_reserved_bytes = model.reserved_bytes
    model.peak_allocated_bytes = model.allocated_bytes
    return addr_map


def _install_expandable(model, seg):
    base, page, n_pages = seg.expandable
    segment = ExpandableSegment(base, page, n_pages, seg.stream)
    pool = model.small_pool if seg.small else model.large_pool
    _chain(model, pool, seg.stream, seg.small, seg.pieces, segment)
    model.reserved_bytes += sum(p[1] for p in seg.pieces if p[2] != "unmapped")


def _chain(model, pool, stream, small, pieces, segment):
    """pieces: (addr, size, kind, requested) in address order, kind in allocated/free/unmapped."""
    previous = None
    for addr, size, kind, requested in pieces:
        block = Block(addr, size, stream, small, segment, mapped=kind != "unmapped")
        block.prev = previous
        if previous is not None:
            previous.next = block
        model.blocks[addr] = block
        if kind == "allocated":
            block.allocated, block.requested = True, requested
            model.allocated_bytes += size
        elif kind == "free":
            pool.free.append(free_key(stream, size, addr))
        else:
            pool.unmapped.append((stream, addr))
        previous = block
    pool.free.sort()
    pool.unmapped.sort()


class _Replayer:
    def __init__(self, model, driver, model_events, addr_map, state):
        self.model, self.driver, self.model_events = model, driver, model_events
        self.addr_map = addr_map
        self.state = state
        self.report = {"allocs": 0, "addr_matches": 0, "segment_events": 0, "segment_matches": 0,
                       "ooms_recorded": 0, "ooms_simulated": 0, "mismatch_count": 0, "mismatches": []}
        self.recorded_reserved = model.reserved_bytes
        self.recorded_peak = model.reserved_bytes
        self.deferred = {}  # recorded address -> model address of blocks waiting for stream events

    def run(self, trace):
        window = []
        for index, event in enumerate(trace):
            action = event["action"]
            if action in SEGMENT_ACTIONS:
                self._count_recorded(event)
                window.append((index, event))
            elif action == "oom":
                self.report["ooms_recorded"] += 1
                window.append((index, event))
                self._request(window, index, self._oom, event)
                window = []
            elif action == "alloc":
                if _released_before_request(window):
                    self._flush(window)
                    window = []
                self._request(window, index, self._alloc, event)
                window = []
            elif action == "free_requested":
                self._flush(window)
                window = []
                self._free(trace, index, event)
            elif action == "free_completed":
                self._flush(window)
                window = []
                self._free_completed(event)
        self._flush(window)
        return self._finish()

    def _count_recorded(self, event):
        self.report["segment_events"] += 1
        self.recorded_reserved += _GROWS[event["action"]] * event["size"]
        self.recorded_peak = max(self.recorded_peak, self.recorded_reserved)

    def _request(self, window, index, call, event):
        recorded = [e for _, e in window]
        self.driver.begin(recorded, self.model_events)
        start = len(self.model_events)
        call(index, event)
        self._compare(window, self.model_events[start:], index)

    def _flush(self, window):
        """Segment events not followed by a request: released by empty_cache()."""
        if not window:
            return
        index = window[-1][0]
        self._request(window, index, lambda *_: self.model.empty_cache(), None)

    def _alloc(self, index, event):
        self.report["allocs"] += 1
        try:
            addr = self.model.malloc(event["size"], event["stream"])
        except OutOfMemory:
            self._mismatch(index, "alloc", f"addr {event['addr']:#x}", "model raised out of memory")
            return
        self.addr_map[event["addr"]] = addr
        if addr == event["addr"]:
            self.report["addr_matches"] += 1
        else:
            self._mismatch(index, "alloc", f"addr {event['addr']:#x} size {event['size']}", f"addr {addr:#x}")

    def _oom(self, index, event):
        try:
            self.model.malloc(event["size"], event["stream"])
        except OutOfMemory:
            self.report["ooms_simulated"] += 1
            return
        self._mismatch(index, "oom", "out of memory", "model served the request")

    def _free(self, trace, index, event):
        addr = self.addr_map.pop(event["addr"], None)
        if addr is None:
            self._mismatch(index, "free_requested", f"free of {event['addr']:#x}", "unknown to the model")
            return
        following = trace[index + 1] if index + 1 < len(trace) else None
        if not (following and following["action"] == "free_completed" and following["addr"] == event["addr"]):
            # freed with a record_stream use: the block waits for its event (free_completed later)
            self.model.record_stream(addr, _TRACE_EVENT_STREAM)
            self.deferred[event["addr"]] = addr
        try:
            self.model.free(addr)
        except ValueError:
            self._mismatch(index, "free_requested", f"free of {event['addr']:#x}", "not allocated in the model")

    def _free_completed(self, event):
        addr = self.deferred.pop(event["addr"], None)
        if addr is None:
            return
        for entry in self.model.pending.get(_TRACE_EVENT_STREAM, ()):
            if entry[0].addr == addr:
                entry[1] = True

    def _compare(self, window, produced, index):
        recorded = [(i, e) for i, e in window if e["action"] in SEGMENT_ACTIONS]
        for k, (event_index, event) in enumerate(recorded):
            got = produced[k] if k < len(produced) else None
            if got is None:
                self._mismatch(event_index, event["action"], _describe(event), "no segment event")
            elif (got[0], got[1], got[2]) == (event["action"], event["addr"], event["size"]):
                self.report["segment_matches"] += 1
            else:
                self._mismatch(event_index, event["action"], _describe(event),
                               f"{got[0]} {got[1]:#x} size {got[2]}")
        for got in produced[len(recorded):]:
            if got[0] != "oom":
                self._mismatch(index, got[0], "no segment event", f"{got[0]} {got[1]:#x} size {got[2]}")

    def _mismatch(self, index, action, expected, got):
        self.report["mismatch_count"] += 1
        if len(self.report["mismatches"]) < _MAX_LISTED_MISMATCHES:
            self.report["mismatches"].append({"event": index, "action": action, "recorded": expected,
                                              "simulated": got})

    def _finish(self):
        report = self.report
        report["reserved_peak_bytes"] = {"recorded": self.recorded_peak,
                                         "simulated": self.model.peak_reserved_bytes}
        report["reserved_final_bytes"] = {"recorded": self.recorded_reserved,
                                          "simulated": self.model.reserved_bytes,
                                          "snapshot": self.final_segments_bytes}
        report["warm_start"] = self.state.warm
        report["initial_reserved_bytes"] = self.state.reserved_bytes
        report["initial_live_blocks"] = len(self.state.live)
        report["guessed_block_sizes"] = self.state.guessed
        report["num_alloc_retries"] = self.model.num_alloc_retries
        return report


def _released_before_request(window):
    """Segment releases ahead of an alloc that grew nothing: an `empty_cache()` the program called just
    before the request. `malloc` itself only releases cached segments (release_available_cached_blocks,
    release_cached_blocks, garbage_collect_cached_blocks) when no cached block fits, and then always
    goes on to cudaMalloc or map pages (or raise), so its releases are followed by a growth event in
    the same window."""
    actions = {e["action"] for _, e in window}
    return bool(actions & {"segment_free", "segment_unmap"}) and not actions & {"segment_alloc", "segment_map"}


def _describe(event):
    return f"{event['action']} {event['addr']:#x} size {event['size']}"

