"""The allocator model, one PyTorch rule at a time (c10/cuda/CUDACachingAllocator.cpp)."""

import pytest

from estimator.allocator import (
    CachingAllocator,
    OutOfMemory,
    allocation_size,
    parse_alloc_conf,
    round_size,
    simulate,
)
from estimator.allocator.config import AllocatorConfig

MIB = 1024 * 1024


def make(conf="", **kwargs):
    events = []
    return CachingAllocator(parse_alloc_conf(conf), events=events, **kwargs), events


def segment_events(events, kind):
    return [e for e in events if e[0] == kind]


def test_rounding_to_512_bytes_and_segment_sizes():
    conf = AllocatorConfig()
    assert [round_size(n, conf) for n in (1, 512, 513, 1000, 1024)] == [512, 512, 1024, 1024, 1024]
    assert allocation_size(MIB) == 2 * MIB  # small pool: 2 MiB segments
    assert allocation_size(MIB + 512) == 20 * MIB  # 1-10 MiB: kLargeBuffer
    assert allocation_size(10 * MIB - 512) == 20 * MIB
    assert allocation_size(10 * MIB) == 10 * MIB  # from 10 MiB: rounded to 2 MiB
    assert allocation_size(11 * MIB) == 12 * MIB


def test_small_requests_pack_into_one_2_mib_segment_and_large_ones_use_another_pool():
    alloc, events = make()
    a = alloc.malloc(100)
    b = alloc.malloc(1000)
    assert b - a == 512
    big = alloc.malloc(2 * MIB)
    assert [e[2] for e in segment_events(events, "segment_alloc")] == [2 * MIB, 20 * MIB]
    assert big == segment_events(events, "segment_alloc")[1][1]
    assert alloc.reserved_bytes == 22 * MIB
    assert alloc.allocated_bytes == 512 + 1024 + 2 * MIB


def test_large_pool_splits_only_remainders_above_1_mib():
    alloc, events = make()
    a = alloc.malloc(19 * MIB + MIB // 2)  # 20 MiB segment, 0.5 MiB left: not split
    assert alloc.allocated_bytes == 20 * MIB
    alloc.free(a)
    b = alloc.malloc(18 * MIB)  # 2 MiB left: split
    assert b == a and alloc.allocated_bytes == 18 * MIB
    c = alloc.malloc(2 * MIB)
    assert c == a + 18 * MIB and len(segment_events(events, "segment_alloc")) == 1


def test_small_pool_splits_remainders_of_512_bytes():
    alloc, events = make()
    a = alloc.malloc(MIB)
    alloc.malloc(MIB - 512)
    last = alloc.malloc(1)  # the 512-byte remainder was split off
    assert last == a + 2 * MIB - 512
    assert len(segment_events(events, "segment_alloc")) == 1


def test_freed_neighbours_merge():
    alloc, events = make()
    a, b, c = alloc.malloc(4 * MIB), alloc.malloc(4 * MIB), alloc.malloc(4 * MIB)
    alloc.free(a)
    alloc.free(b)
    assert alloc.malloc(8 * MIB) == a  # a and b became one free block
    assert len(segment_events(events, "segment_alloc")) == 1
    assert c == a + 8 * MIB


def test_best_fit_takes_the_smallest_block_then_the_lowest_address():
    alloc, _ = make()
    first = alloc.malloc(12 * MIB)  # own 12 MiB segment
    second = alloc.malloc(16 * MIB)  # own 16 MiB segment
    third = alloc.malloc(12 * MIB)
    alloc.free(second)
    alloc.free(third)
    alloc.free(first)
    assert alloc.malloc(11 * MIB) == min(first, third)  # 12 MiB blocks before the 16 MiB one
    assert alloc.malloc(11 * MIB) == max(first, third)
    assert alloc.malloc(11 * MIB) == second


def test_blocks_never_cross_streams():
    alloc, events = make()
    a = alloc.malloc(4 * MIB, stream=1)
    alloc.free(a)
    b = alloc.malloc(4 * MIB, stream=2)
    assert b != a and len(segment_events(events, "segment_alloc")) == 2
    assert alloc.malloc(4 * MIB, stream=1) == a


def test_oversize_blocks_are_not_split_and_serve_only_requests_close_to_their_size():
    alloc, events = make("max_split_size_mb:40")
    big = alloc.malloc(64 * MIB)
    alloc.free(big)
    small = alloc.malloc(10 * MIB)  # below max_split: the 64 MiB oversize block is not used
    assert small != big
    near = alloc.malloc(50 * MIB)  # 64 < 50 + 20: handed out whole, not split
    assert near == big and alloc.allocated_bytes == 10 * MIB + 64 * MIB
    alloc.free(near)
    far = alloc.malloc(42 * MIB)  # 64 >= 42 + 20 (kLargeBuffer rounding limit): new segment
    assert far != big
    assert [e[2] for e in segment_events(events, "segment_alloc")] == [64 * MIB, 10 * MIB, 42 * MIB]


def test_max_non_split_rounding_widens_the_reuse_limit():
    alloc, _ = make("max_split_size_mb:40,max_non_split_rounding_mb:30")
    big = alloc.malloc(64 * MIB)
    alloc.free(big)
    assert alloc.malloc(42 * MIB) == big  # 64 < 42 + 30


def test_roundup_power2_divisions_single_value_and_interval_list():
    four = parse_alloc_conf("roundup_power2_divisions:4")
    assert round_size(1200 * 1024, four) == 1280 * 1024  # between 1 and 2 MiB in quarters
    assert round_size(1024 * 1024, four) == 1024 * 1024  # powers of two stay
    assert round_size(1500, four) == 1536  # 1500 < 512 * 4: plain 512-byte rounding
    listed = parse_alloc_conf("roundup_power2_divisions:[1:2,256:4,512:8]")
    assert listed.roundup_power2_divisions == (2, 0, 0, 0, 0, 0, 0, 0, 4, 8, 0, 0, 0, 0, 0, 0)
    assert round_size(1200 * 1024, listed) == 1536 * 1024  # 1 MiB interval: halves
    assert round_size(3 * MIB + 1, listed) == 3 * MIB + 512  # 2 MiB interval: 0, plain rounding
    assert round_size(300 * MIB, listed) == 320 * MIB  # 256 MiB interval: quarters
    assert round_size(600 * MIB, listed) == 640 * MIB  # 512 MiB interval: eighths
    # the first entry also fills the intervals below it; '>' fills from the last listed one, itself included
    assert parse_alloc_conf("roundup_power2_divisions:[4:2,256:4,>:8]").roundup_power2_divisions == \
        (2, 2, 2, 0, 0, 0, 0, 0) + (8,) * 8


def test_garbage_collection_frees_aged_cached_segments_above_the_threshold():
    alloc, events = make("garbage_collection_threshold:0.5", memory_fraction=1.0,
                         device_total_bytes=100 * MIB)
    old = alloc.malloc(40 * MIB)
    alloc.free(old)
    for _ in range(3):  # each malloc counts a call to get_free_block: the cached blocks age
        alloc.free(alloc.malloc(2 * MIB, stream=1))
    alloc.malloc(50 * MIB)  # 60 MiB reserved > 0.5 x 100 MiB: blocks older than the mean age go
    assert segment_events(events, "segment_free") == [("segment_free", old, 40 * MIB, 0)]
    no_gc, no_gc_events = make(memory_fraction=1.0, device_total_bytes=100 * MIB)
    kept = no_gc.malloc(40 * MIB)
    no_gc.free(kept)
    no_gc.malloc(50 * MIB)
    assert not segment_events(no_gc_events, "segment_free")


def test_cudamalloc_failure_releases_cached_segments_then_retries():
    alloc, events = make(capacity_bytes=100 * MIB)
    cached = alloc.malloc(60 * MIB)
    alloc.free(cached)
    alloc.malloc(70 * MIB)  # 60 + 70 > 100: release the cache, retry
    kinds = [e[0] for e in events]
    assert kinds == ["segment_alloc", "segment_free", "segment_alloc"]
    assert alloc.num_alloc_retries == 1 and alloc.num_ooms == 0
    with pytest.raises(OutOfMemory):
        alloc.malloc(40 * MIB)
    assert alloc.num_ooms == 1 and alloc.num_alloc_retries == 2
    assert events[-1][0] == "oom"


def test_with_max_split_only_enough_oversize_blocks_are_released_first():
    alloc, events = make("max_split_size_mb:20", capacity_bytes=200 * MIB)
    blocks = [alloc.malloc(n * MIB) for n in (40, 50, 60)]
    for b in blocks:
        alloc.free(b)
    alloc.malloc(90 * MIB)  # 150 + 90 > 200: oversize blocks go, largest first, until 90 MiB are freed
    assert segment_events(events, "segment_free") == [("segment_free", blocks[2], 60 * MIB, 0),
                                                      ("segment_free", blocks[1], 50 * MIB, 0)]
    assert alloc.num_alloc_retries == 0


def test_memory_fraction_caps_reserved_memory_before_the_driver():
    alloc, _ = make(memory_fraction=0.5, device_total_bytes=100 * MIB)
    alloc.malloc(40 * MIB)
    with pytest.raises(OutOfMemory):
        alloc.malloc(20 * MIB)


def test_empty_cache_releases_only_unsplit_free_segments():
    alloc, events = make()
    live = alloc.malloc(4 * MIB)
    alloc.malloc(4 * MIB)
    idle = alloc.malloc(30 * MIB)
    alloc.free(idle)
    alloc.free(live)
    alloc.empty_cache()
    assert segment_events(events, "segment_free") == [("segment_free", idle, 30 * MIB, 0)]
    assert alloc.reserved_bytes == 20 * MIB


def test_record_stream_delays_reuse_until_the_stream_work_completes():
    alloc, _ = make()
    a = alloc.malloc(4 * MIB)
    alloc.record_stream(a, 7)
    alloc.free(a)
    assert alloc.malloc(4 * MIB) != a  # still in use on stream 7
    alloc.complete_stream_work(7)
    assert alloc.malloc(4 * MIB) == a  # returned at the next malloc's event processing
    b = alloc.malloc(4 * MIB)
    alloc.record_stream(b, 7)
    alloc.free(b)
    alloc.empty_cache()  # synchronizes outstanding events first
    assert alloc.blocks[b].allocated is False and not alloc.pending


def test_expandable_segments_map_pages_and_unmap_them_on_empty_cache():
    alloc, events = make("expandable_segments:True")
    a = alloc.malloc(30 * MIB)  # large pool: 20 MiB pages, maps 40 MiB
    b = alloc.malloc(5 * MIB)  # placed in the mapped remainder
    c = alloc.malloc(20 * MIB)  # 5 MiB free + one more page
    assert (b - a, c - a) == (30 * MIB, 35 * MIB)
    assert [(e[0], e[2]) for e in events] == [("segment_map", 40 * MIB), ("segment_map", 20 * MIB)]
    assert events[1][1] == a + 40 * MIB
    small = alloc.malloc(1000)  # small pool: its own segment with 2 MiB pages
    assert events[-1][0] == "segment_map" and events[-1][2] == 2 * MIB and small not in (a, b, c)
    alloc.free(c)
    alloc.free(b)
    alloc.empty_cache()  # pages fully free are unmapped: [30 MiB, 60 MiB) -> page [40, 60)
    assert events[-1] == ("segment_unmap", a + 40 * MIB, 20 * MIB, 0)
    assert alloc.reserved_bytes == 40 * MIB + 2 * MIB


def test_expandable_segment_oom_unmaps_free_pages_then_retries():
    alloc, events = make("expandable_segments:True", capacity_bytes=100 * MIB)
    a = alloc.malloc(60 * MIB)
    alloc.free(a)
    small = alloc.malloc(100, stream=1)  # a second segment (other stream) holds 2 MiB
    alloc.malloc(70 * MIB, stream=2)  # 60 + 2 + 80 > 100: unmap stream 0's pages, map again
    assert ("segment_unmap", a, 60 * MIB, 0) in events
    assert alloc.num_alloc_retries == 1 and small


def test_simulate_a_request_list_with_a_side_stream_and_a_cap():
    requests = [("alloc", "w", 100 * MIB, 0), ("alloc", "bucket", 30 * MIB, 0),
                ("record_stream", "bucket", 5), ("free", "bucket"),
                ("alloc", "act", 30 * MIB, 0),  # the bucket still waits for stream 5: a new segment
                ("stream_done", 5), ("free", "act"), ("alloc", "act2", 30 * MIB, 0)]
    result = simulate(requests)
    assert result["peak_reserved_bytes"] == 160 * MIB
    assert result["unallocated_at_reserved_peak_bytes"] == 30 * MIB
    assert result["oom_at_request"] is None
    capped = simulate(requests, capacity_bytes=150 * MIB)  # the retry path waits for stream 5, frees
    assert capped["oom_at_request"] is None and capped["num_alloc_retries"] == 1
    assert capped["peak_reserved_bytes"] == 130 * MIB
    too_small = simulate(requests, capacity_bytes=120 * MIB)
    assert too_small["oom_at_request"] == 1 and too_small["num_ooms"] == 1
    with pytest.raises(ValueError, match="unknown allocator request 'grow'"):
        simulate([("grow", 1)])
