"""Allocator model speed: a synthetic training-like stream of ~20k alloc/free events, replayed through
`estimator.allocator.CachingAllocator`.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_allocator.py
The stream: 32 layers; per step, forward allocates each layer's activations (sizes from 512 B to 64 MiB,
drawn once per layer so steps repeat, as training steps do) and frees its temporaries; backward frees the
activations in reverse while allocating and freeing gradient temporaries; weights and gradients stay.
Target (issue 14): an estimate replays a few thousand events and must stay well under 50 ms.
"""

import random
import statistics
import time

from estimator.allocator import CachingAllocator, parse_alloc_conf

MIB = 1024 * 1024
LAYERS = 32


def layer_sizes(rng):
    def size():
        if rng.random() < 0.3:
            return rng.randint(1, 1024 * 1024)  # small pool
        return rng.choice((2, 4, 8, 16, 24, 32, 48, 64)) * MIB + rng.choice((0, 512, 4096, 12345))
    return [[size() for _ in range(rng.randint(4, 9))] for _ in range(LAYERS)]


def training_stream(steps, seed=0):
    """Events: ('a', key, size, stream) allocates, ('f', key) frees; keys are names for blocks."""
    rng = random.Random(seed)
    shapes = layer_sizes(rng)
    events, key = [], 0
    for layer in range(LAYERS):  # weights, allocated once
        events.append(("a", ("w", layer), 24 * MIB + 4096, 0))
    for _ in range(steps):
        saved = []
        for layer in range(LAYERS):
            for i, size in enumerate(shapes[layer]):
                key += 1
                events.append(("a", key, size, 0))
                if i % 3 == 2:
                    events.append(("f", key))  # a temporary
                else:
                    saved.append(key)
        for layer in reversed(range(LAYERS)):
            for size in shapes[layer][:3]:
                key += 1
                events.append(("a", key, size, 0))
                events.append(("f", key))
            for _ in range(len(shapes[layer]) - len(shapes[layer]) // 3):
                events.append(("f", saved.pop()))
    return events


def replay(events, conf):
    allocator = CachingAllocator(conf)
    addr = {}
    malloc, free = allocator.malloc, allocator.free
    for event in events:
        if event[0] == "a":
            addr[event[1]] = malloc(event[2], event[3])
        else:
            free(addr.pop(event[1]))
    return allocator


def timed_ms(events, conf, repeats=5):
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        allocator = replay(events, conf)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times), allocator


def main():
    events = training_stream(steps=35)
    print(f"synthetic stream: {len(events)} events "
          f"({sum(e[0] == 'a' for e in events)} allocs), {LAYERS} layers, 35 steps")
    for label, text in (("defaults", ""), ("expandable_segments:True", "expandable_segments:True"),
                        ("max_split_size_mb:128,roundup_power2_divisions:4",
                         "max_split_size_mb:128,roundup_power2_divisions:4")):
        ms, allocator = timed_ms(events, parse_alloc_conf(text))
        print(f"{label:50s} {ms:8.1f} ms  {1e3 * ms / len(events):6.2f} us/event  "
              f"reserved peak {allocator.peak_reserved_bytes / MIB:,.0f} MiB, "
              f"allocated peak {allocator.peak_allocated_bytes / MIB:,.0f} MiB")
    small = training_stream(steps=3)
    ms, _ = timed_ms(small, parse_alloc_conf(""), repeats=20)
    print(f"an estimate-sized stream ({len(small)} events, 3 steps): {ms:.2f} ms (target < 50 ms)")


if __name__ == "__main__":
    main()
