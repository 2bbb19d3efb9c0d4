"""Drive the allocator model with a plain list of requests, as an estimator timeline would.

A request is a tuple:
  ("alloc", key, nbytes, stream)  a tensor's storage is allocated (nbytes as requested, unrounded)
  ("free", key)                   it is freed (its block waits if record_stream was called on it)
  ("record_stream", key, stream)  Tensor.record_stream: the storage is used on another stream
  ("stream_done", stream)         all work queued so far on that stream has completed
  ("empty_cache",)                torch.cuda.empty_cache()
Keys are any hashable names the caller gives its tensors.
"""

from estimator.allocator.model import CachingAllocator, OutOfMemory


def simulate(requests, conf=None, capacity_bytes=None, memory_fraction=None, device_total_bytes=None):
    """Replay `requests`; returns the reserved/allocated peaks, the unallocated reserve at the reserved
    peak (fragmentation), retries and whether (and at which request) the allocator ran out of memory."""
    allocator = CachingAllocator(conf, capacity_bytes=capacity_bytes, memory_fraction=memory_fraction,
                                 device_total_bytes=device_total_bytes)
    addr = {}
    peak_seen, reserve_at_peak, oom_at = 0, 0, None
    malloc = allocator.malloc
    for index, request in enumerate(requests):
        kind = request[0]
        if kind == "alloc":
            try:
                addr[request[1]] = malloc(request[2], request[3])
            except OutOfMemory:
                oom_at = index
                break
            if allocator.peak_reserved_bytes > peak_seen:
                peak_seen = allocator.peak_reserved_bytes
                reserve_at_peak = allocator.reserved_bytes - allocator.allocated_bytes
        elif kind == "free":
            allocator.free(addr.pop(request[1]))
        elif kind == "record_stream":
            allocator.record_stream(addr[request[1]], request[2])
        elif kind == "stream_done":
            allocator.complete_stream_work(request[1])
        elif kind == "empty_cache":
            allocator.empty_cache()
        else:
            raise ValueError(f"unknown allocator request {kind!r} at index {index}")
    return {"peak_reserved_bytes": allocator.peak_reserved_bytes,
            "peak_allocated_bytes": allocator.peak_allocated_bytes,
            "unallocated_at_reserved_peak_bytes": reserve_at_peak,
            "reserved_bytes_at_end": allocator.reserved_bytes,
            "num_alloc_retries": allocator.num_alloc_retries,
            "num_ooms": allocator.num_ooms,
            "oom_at_request": oom_at}
