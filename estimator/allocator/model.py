"""A model of PyTorch's CUDA caching allocator (`DeviceCachingAllocator`), one device.

Rules re-implemented from `c10/cuda/CUDACachingAllocator.cpp` (torch 2.6 … 2.11; function names are
PyTorch's): `round_size` / `roundup_power2_next_division`, `get_pool`, `get_allocation_size`,
`get_free_block`, `should_split`, `alloc_found_block`, `free` / `free_block` / `try_merge_blocks`,
`alloc_block`, `release_available_cached_blocks`, `release_cached_blocks` / `release_blocks` /
`release_block`, `garbage_collect_cached_blocks`, the expandable-segment path (`find_expandable_block`,
`map_block`, `try_allocate_expandable_block`, `unmap_block`, `ExpandableSegment::map/unmap`),
`recordStream` / `insert_events` / `process_events` / `synchronize_and_free_events`, and `malloc`'s order
of attempts. Free-memory callbacks (`trigger_free_memory_callbacks`) only free CUDA-IPC shared blocks;
the model has none. CUDA-graph private pools are not modelled.

Speed: free blocks live in one sorted list of (stream, size, address) keys per pool (bisect), each key
one integer (`free_key`: int comparisons are about twice as fast as tuple ones), blocks are `__slots__`
objects found by address, and nothing is allocated per event beyond a split's remainder.
"""

from bisect import bisect_left, insort
from collections import deque

from estimator.allocator.config import UNLIMITED_BYTES, AllocatorConfig
from estimator.allocator.driver import SimulatedDevice

MIN_BLOCK_BYTES = 512  # kMinBlockSize
SMALL_SIZE_BYTES = 1024 * 1024  # kSmallSize: largest request served by the small pool
SMALL_BUFFER_BYTES = 2 * 1024 * 1024  # kSmallBuffer: small-pool segment, small expandable page
MIN_LARGE_ALLOC_BYTES = 10 * 1024 * 1024  # kMinLargeAlloc
LARGE_BUFFER_BYTES = 20 * 1024 * 1024  # kLargeBuffer: 1-10 MiB requests' segment, large expandable page
ROUND_LARGE_BYTES = 2 * 1024 * 1024  # kRoundLarge
_ADDR_MASK = (1 << 64) - 1  # a free key's low 64 bits: the address; the next 64: the size; above: the stream


def free_key(stream, size, addr):
    """The sort key (stream, size, address) of a free block as one integer (any integer stream; sizes and
    addresses below 2**64): ordered as the tuple is."""
    return (stream << 128) | (size << 64) | addr


def key_stream(key):
    return key >> 128


def key_size(key):
    return (key >> 64) & _ADDR_MASK


class OutOfMemory(MemoryError):
    """The allocator could not serve a request even after releasing its cache (PyTorch raises
    torch.OutOfMemoryError at this point)."""


class Block:
    __slots__ = ("addr", "size", "stream", "small", "prev", "next", "allocated", "mapped", "segment",
                 "requested", "event_count", "stream_uses", "gc_base")

    def __init__(self, addr, size, stream, small, segment=None, mapped=True):
        self.addr, self.size, self.stream, self.small = addr, size, stream, small
        self.prev = self.next = None
        self.allocated = False
        self.mapped = mapped
        self.segment = segment  # ExpandableSegment or None
        self.requested = 0
        self.event_count = 0
        self.stream_uses = None
        self.gc_base = 0

    def is_split(self):
        return self.prev is not None or self.next is not None


class ExpandableSegment:
    """A reserved virtual range mapped page by page (2 MiB pages small pool, 20 MiB large)."""
    __slots__ = ("base", "page_bytes", "n_pages", "stream")

    def __init__(self, base, page_bytes, n_pages, stream):
        self.base, self.page_bytes, self.n_pages, self.stream = base, page_bytes, n_pages, stream

    def pages_covering(self, addr, size):  # segmentLeft(begin), segmentRight(end)
        page = self.page_bytes
        return (addr - self.base) // page, -(-(addr + size - self.base) // page)

    def pages_inside(self, addr, size):  # segmentRight(begin), segmentLeft(end)
        page = self.page_bytes
        return -(-(addr - self.base) // page), (addr + size - self.base) // page


class Pool:
    __slots__ = ("small", "free", "unmapped", "free_calls")

    def __init__(self, small):
        self.small = small
        self.free = []  # sorted free_key(stream, size, addr) of cached free mapped blocks
        self.unmapped = []  # sorted (stream, addr) of unmapped expandable ranges
        self.free_calls = 0  # get_free_blocks_call_count (garbage-collection ages)


def round_size(size, conf):
    if size < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    divisions = conf.divisions_for(size)
    if divisions > 1 and size > MIN_BLOCK_BYTES * divisions:
        return _roundup_power2_next_division(size, divisions)
    return -(-size // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES


def _roundup_power2_next_division(size, divisions):
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def allocation_size(size):
    """Bytes cudaMalloc'ed for a new segment serving a rounded request (get_allocation_size)."""
    if size <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


class CachingAllocator:
    """One device's caching allocator.

    `capacity_bytes`: physical memory the driver can hand out (cudaMalloc / page mapping fails beyond it).
    `memory_fraction` with `device_total_bytes`: `torch.cuda.set_per_process_memory_fraction`, checked by
    the allocator itself before it asks the driver (and the base of `garbage_collection_threshold`);
    `allowed_bytes`: that cap in bytes, as PyTorch computes it (``int(fraction x total)``), in its place.
    `driver`: replaces the simulated device (trace replay passes one that answers from a recording).
    `events`: if a list, every segment event is appended to it as (kind, addr, size, stream).
    """

    def __init__(self, conf=None, capacity_bytes=None, memory_fraction=None, device_total_bytes=None,
                 driver=None, events=None, allowed_bytes=None):
        self.conf = conf or AllocatorConfig()
        total = device_total_bytes or capacity_bytes or 80 * 1024 ** 3
        self.driver = driver or SimulatedDevice(capacity_bytes, total_bytes=total)
        self.device_total_bytes = total
        self.allowed_bytes = allowed_bytes if memory_fraction is None else int(memory_fraction * total)
        self.small_pool, self.large_pool = Pool(True), Pool(False)
        self.blocks = {}  # addr -> Block, every block of every segment
        self.pending = {}  # stream -> deque of [block, completed] (record_stream end-of-life events)
        self.events = events
        self.reserved_bytes = self.peak_reserved_bytes = 0
        self.allocated_bytes = self.peak_allocated_bytes = 0
        self.num_alloc_retries = self.num_ooms = 0
        self.num_device_alloc = self.num_device_free = 0
        self.gc_released_bytes = 0  # what garbage_collect_cached_blocks returned to the driver
        self._gc_on = self.allowed_bytes is not None and self.conf.garbage_collection_threshold > 0
        self._max_split = self.conf.max_split_size_bytes
        self._non_split_rounding = self.conf.max_non_split_rounding_bytes
        self._rounded = {}  # request bytes -> round_size(request) under self.conf

    # ----- public API -------------------------------------------------------------------------------
    def malloc(self, size, stream=0):
        """Serve a request of `size` bytes on `stream`; returns the block's address."""
        if self.pending:
            self._process_events()
        size_rounded = self._rounded.get(size)
        if size_rounded is None:  # a replay asks for few distinct sizes: round each once
            size_rounded = self._rounded[size] = round_size(size, self.conf)
        pool = self.small_pool if size_rounded <= SMALL_SIZE_BYTES else self.large_pool
        block = self._get_free_block(pool, stream, size_rounded)
        if block is None:
            block = self._allocate_new(pool, stream, size_rounded)
            if block is None:
                self.num_ooms += 1
                self._log("oom", 0, size_rounded, stream)
                raise OutOfMemory(f"cannot allocate {size} bytes on stream {stream}: reserved "
                                  f"{self.reserved_bytes}, allocated {self.allocated_bytes}")
        return self._alloc_found_block(block, pool, size_rounded, size)

    def free(self, addr):
        block = self.blocks.get(addr)
        if block is None or not block.allocated:
            raise ValueError(f"free of an address the allocator did not hand out: {addr:#x}")
        block.allocated = False
        self.allocated_bytes -= block.size
        if block.stream_uses:
            self._insert_events(block)
        else:
            self._free_block(block)

    def record_stream(self, addr, stream):
        """`Tensor.record_stream`: the block is used on `stream`; its free waits for that work."""
        block = self.blocks[addr]
        if stream != block.stream:
            if block.stream_uses is None:
                block.stream_uses = set()
            block.stream_uses.add(stream)

    def complete_stream_work(self, stream):
        """Everything queued on `stream` so far has run: its end-of-life events are complete. The
        blocks return to the cache at the next malloc (process_events), as in PyTorch."""
        for entry in self.pending.get(stream, ()):
            entry[1] = True

    def empty_cache(self):
        self._release_cached_blocks()

    # ----- malloc path ------------------------------------------------------------------------------
    def _allocate_new(self, pool, stream, size):
        if self._gc_on:
            self._garbage_collect()
        alloc_bytes = allocation_size(size)
        block = self._alloc_block(pool, stream, size, alloc_bytes, False)
        if block is None and self._release_available_cached_blocks(pool, stream, size):
            block = self._alloc_block(pool, stream, size, alloc_bytes, False)
        if block is None:
            self._release_cached_blocks()
            block = self._alloc_block(pool, stream, size, alloc_bytes, True)
        return block

    def _get_free_block(self, pool, stream, size):
        if self._gc_on:
            pool.free_calls += 1
        keys = pool.free
        i = bisect_left(keys, (stream << 128) | (size << 64))
        if i == len(keys) or keys[i] >> 128 != stream:
            return None
        block = self.blocks[keys[i] & _ADDR_MASK]
        if block.segment is not None:
            i = self._expandable_choice(keys, i, stream)
            if i is None:
                return None
            block = self.blocks[keys[i] & _ADDR_MASK]
        if size < self._max_split and block.size >= self._max_split:
            return None  # an oversize block is not split for a smaller request
        if size >= self._max_split and block.size >= size + self._non_split_rounding:
            return None  # nor handed whole to a request it exceeds by the rounding limit
        del keys[i]
        return block

    def _expandable_choice(self, keys, i, stream):
        """Best fit counts a block followed by unmapped space at the size it could grow to."""
        blocks = self.blocks
        if not self.conf.expandable_segments:
            i += 1
            while i < len(keys) and keys[i] >> 128 == stream and blocks[keys[i] & _ADDR_MASK].segment is not None:
                i += 1
            return None if i == len(keys) or keys[i] >> 128 != stream else i

        def growable(block):
            following = block.next
            return block.size + (following.size if following is not None and not following.mapped else 0)

        block = blocks[keys[i] & _ADDR_MASK]
        j = i + 1
        while block.segment is not None and j < len(keys) and keys[j] >> 128 == stream:
            candidate = blocks[keys[j] & _ADDR_MASK]
            if growable(candidate) >= growable(block):
                break
            i, block, j = j, candidate, j + 1
        return i

    def _should_split(self, block, size, pool):
        remaining = block.size - size
        if pool.small or self.conf.expandable_segments:
            return remaining >= MIN_BLOCK_BYTES
        return size < self._max_split and remaining > SMALL_SIZE_BYTES

    def _alloc_found_block(self, block, pool, size, requested):
        if self._should_split(block, size, pool):
            rest = Block(block.addr + size, block.size - size, block.stream, block.small, block.segment)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self.blocks[rest.addr] = rest
            rest.gc_base = pool.free_calls
            insort(pool.free, (rest.stream << 128) | (rest.size << 64) | rest.addr)  # free_key, inlined
        block.allocated = True
        block.requested = requested
        self.allocated_bytes += block.size
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes
        return block.addr

    def _alloc_block(self, pool, stream, size, alloc_bytes, is_retry):
        if is_retry:
            self.num_alloc_retries += 1
        if self.allowed_bytes is not None and self.reserved_bytes + alloc_bytes > self.allowed_bytes:
            return None
        if self.conf.expandable_segments:
            return self._try_allocate_expandable(pool, stream, size)
        addr = self.driver.malloc(alloc_bytes, stream)
        if addr is None:
            return None
        block = Block(addr, alloc_bytes, stream, pool.small)
        self.blocks[addr] = block
        self._grow_reserved(alloc_bytes)
        self._log("segment_alloc", addr, alloc_bytes, stream)
        return block

    # ----- free path --------------------------------------------------------------------------------
    def _free_block(self, block):
        pool = self.small_pool if block.small else self.large_pool
        if block.prev is not None and not block.prev.allocated:
            self._try_merge(block, block.prev, pool)
        if block.next is not None and not block.next.allocated:
            self._try_merge(block, block.next, pool)
        block.gc_base = pool.free_calls
        insort(pool.free, (block.stream << 128) | (block.size << 64) | block.addr)  # free_key, inlined

    def _try_merge(self, dst, src, pool):
        if (src is None or src.allocated or src.event_count > 0 or src.stream_uses
                or dst.mapped != src.mapped):
            return
        if src.mapped:
            keys, key = pool.free, (src.stream << 128) | (src.size << 64) | src.addr  # free_key, inlined
        else:
            keys, key = pool.unmapped, (src.stream, src.addr)
        del keys[bisect_left(keys, key)]
        if dst.prev is src:
            del self.blocks[dst.addr]
            dst.addr = src.addr
            self.blocks[dst.addr] = dst
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            del self.blocks[src.addr]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    # ----- releasing cached memory -------------------------------------------------------------------
    def _release_available_cached_blocks(self, pool, stream, size):
        max_split = self._max_split
        if max_split == UNLIMITED_BYTES:
            return False
        wanted = max(size, max_split)
        keys = pool.free
        i = bisect_left(keys, free_key(stream, wanted, 0))
        if i < len(keys) and key_stream(keys[i]) == stream and self.blocks[keys[i] & _ADDR_MASK].segment is None:
            self._release_block(self.blocks[keys[i] & _ADDR_MASK], pool)
            return True
        released = 0
        i -= 1  # the largest block of this stream, then smaller ones
        while i >= 0 and released < wanted and key_size(keys[i]) >= max_split and key_stream(keys[i]) == stream:
            block = self.blocks[keys[i] & _ADDR_MASK]
            if block.segment is None:
                released += block.size
                self._release_block(block, pool)
            i -= 1
        return released >= wanted

    def _release_cached_blocks(self):
        self._synchronize_and_free_events()
        self._release_blocks(self.large_pool)
        self._release_blocks(self.small_pool)

    def _release_blocks(self, pool):
        to_unmap = []
        for key in list(pool.free):
            block = self.blocks[key & _ADDR_MASK]
            if block.segment is not None:
                to_unmap.append(block)
            elif block.prev is None and block.next is None:
                self._release_block(block, pool)
        for block in to_unmap:
            self._unmap_block(block, pool)
            if block.prev is None and block.next is None:
                del pool.unmapped[bisect_left(pool.unmapped, (block.stream, block.addr))]
                del self.blocks[block.addr]
                self.driver.release_range(block.segment.base, block.size)

    def _release_block(self, block, pool):
        if block.is_split():
            raise AssertionError(f"release of a split block at {block.addr:#x}")
        del pool.free[bisect_left(pool.free, free_key(block.stream, block.size, block.addr))]
        del self.blocks[block.addr]
        self.driver.free(block.addr, block.size)
        self.reserved_bytes -= block.size
        self.num_device_free += 1
        self._log("segment_free", block.addr, block.size, block.stream)

    def _garbage_collect(self):
        threshold_bytes = int(self.conf.garbage_collection_threshold * self.allowed_bytes)
        if self.reserved_bytes <= threshold_bytes:
            return
        target = self.reserved_bytes - threshold_bytes
        pool = self.large_pool
        ages = [pool.free_calls - self.blocks[k & _ADDR_MASK].gc_base for k in pool.free
                if not self.blocks[k & _ADDR_MASK].is_split()]
        total_age, count = sum(ages), len(ages)
        reclaimed, freed_one = 0, True
        while reclaimed < target and freed_one and count > 0:
            threshold_age = total_age / count
            freed_one = False
            for key in list(pool.free):
                block = self.blocks.get(key & _ADDR_MASK)
                if block is None or block.is_split() or block.segment is not None:
                    continue
                age = pool.free_calls - block.gc_base
                if age >= threshold_age:
                    freed_one = True
                    reclaimed += block.size
                    self.gc_released_bytes += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block, pool)

    # ----- expandable segments ----------------------------------------------------------------------
    def _try_allocate_expandable(self, pool, stream, size):
        candidate = self._find_expandable_block(pool, stream, size)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size), pool):
            return None
        while candidate.size < size:
            following = candidate.next
            if not self._map_block(following, min(size - candidate.size, following.size), pool):
                return None
            candidate = following
        del pool.free[bisect_left(pool.free, free_key(candidate.stream, candidate.size, candidate.addr))]
        return candidate

    def _find_expandable_block(self, pool, stream, size):
        def allocatable(block):
            return (block is not None and not block.allocated and block.event_count == 0
                    and not block.stream_uses)

        keys = pool.unmapped
        i = bisect_left(keys, (stream, -1))
        while i < len(keys) and keys[i][0] == stream:
            candidate = self.blocks[keys[i][1]]
            if allocatable(candidate.prev):
                candidate = candidate.prev
            room, walker = 0, candidate
            while room < size and allocatable(walker):
                room += walker.size
                walker = walker.next
            if room >= size:
                return candidate
            i += 1
        page = SMALL_BUFFER_BYTES if pool.small else LARGE_BUFFER_BYTES
        total = self.device_total_bytes
        n_pages = -(-(total + total // 8) // page)
        base = self.driver.reserve_range(n_pages * page, stream, pool.small)
        segment = ExpandableSegment(base, page, n_pages, stream)
        block = Block(base, n_pages * page, stream, pool.small, segment, mapped=False)
        self.blocks[base] = block
        insort(keys, (stream, base))
        return block

    def _map_block(self, block, size, pool):
        segment = block.segment
        begin, end = segment.pages_covering(block.addr, size)
        mapped_bytes = (end - begin) * segment.page_bytes
        if mapped_bytes == 0 or not self.driver.map(block.addr, mapped_bytes, block.stream):
            return False
        del pool.unmapped[bisect_left(pool.unmapped, (block.stream, block.addr))]
        block.mapped = True
        if mapped_bytes < block.size:
            rest = Block(block.addr + mapped_bytes, block.size - mapped_bytes, block.stream, block.small,
                         segment, mapped=False)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            self.blocks[rest.addr] = rest
            insort(pool.unmapped, (rest.stream, rest.addr))
            block.size = mapped_bytes
        mapped_addr = block.addr
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        block.gc_base = pool.free_calls
        insort(pool.free, free_key(block.stream, block.size, block.addr))
        self._grow_reserved(mapped_bytes)
        self._log("segment_map", mapped_addr, mapped_bytes, block.stream)
        return True

    def _unmap_block(self, block, pool):
        segment = block.segment
        begin, end = segment.pages_inside(block.addr, block.size)
        if begin >= end:
            return
        del pool.free[bisect_left(pool.free, free_key(block.stream, block.size, block.addr))]
        start = segment.base + begin * segment.page_bytes
        unmapped_bytes = (end - begin) * segment.page_bytes
        before, after = start - block.addr, block.size - (start - block.addr) - unmapped_bytes
        if before > 0:
            self._split_off_free(block, pool, block.addr, before, ahead=True)
        if after > 0:
            self._split_off_free(block, pool, start + unmapped_bytes, after, ahead=False)
        block.addr, block.size, block.mapped = start, unmapped_bytes, False
        self.blocks[start] = block
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        insort(pool.unmapped, (block.stream, block.addr))
        self.reserved_bytes -= unmapped_bytes
        self.num_device_free += 1
        self.driver.unmap(start, unmapped_bytes)
        self._log("segment_unmap", start, unmapped_bytes, block.stream)

    def _split_off_free(self, block: Block, pool, addr: int, size: int, *, ahead: bool) -> None:
        """A free block of ``size`` bytes at ``addr`` cut from ``block``'s head (``ahead``) or tail, linked in
        beside it and put in its pool."""
        piece = Block(addr, size, block.stream, block.small, block.segment)
        if ahead:
            piece.prev, piece.next = block.prev, block
            if block.prev is not None:
                block.prev.next = piece
            block.prev = piece
        else:
            piece.prev, piece.next = block, block.next
            if block.next is not None:
                block.next.prev = piece
            block.next = piece
        self.blocks[piece.addr] = piece
        piece.gc_base = pool.free_calls
        insort(pool.free, free_key(piece.stream, piece.size, piece.addr))

    # ----- record_stream events ---------------------------------------------------------------------
    def _insert_events(self, block):
        for stream in sorted(block.stream_uses):
            block.event_count += 1
            self.pending.setdefault(stream, deque()).append([block, False])
        block.stream_uses = None

    def _process_events(self):
        for stream in list(self.pending):
            queue = self.pending[stream]
            while queue and queue[0][1]:
                block = queue.popleft()[0]
                block.event_count -= 1
                if block.event_count == 0:
                    self._free_block(block)
            if not queue:
                del self.pending[stream]

    def _synchronize_and_free_events(self):
        for queue in self.pending.values():
            for block, _ in queue:
                block.event_count -= 1
                if block.event_count == 0:
                    self._free_block(block)
        self.pending.clear()

    # ----- bookkeeping ------------------------------------------------------------------------------
    def _grow_reserved(self, nbytes):
        self.reserved_bytes += nbytes
        self.num_device_alloc += 1
        if self.reserved_bytes > self.peak_reserved_bytes:
            self.peak_reserved_bytes = self.reserved_bytes

    def _log(self, kind, addr, size, stream):
        if self.events is not None:
            self.events.append((kind, addr, size, stream))

    def stats(self):
        return {"reserved_bytes": self.reserved_bytes, "peak_reserved_bytes": self.peak_reserved_bytes,
                "allocated_bytes": self.allocated_bytes, "peak_allocated_bytes": self.peak_allocated_bytes,
                "num_alloc_retries": self.num_alloc_retries, "num_ooms": self.num_ooms,
                "num_device_alloc": self.num_device_alloc, "num_device_free": self.num_device_free}
