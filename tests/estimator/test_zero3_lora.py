"""ZeRO-3 with LoRA (run 03ab897ea7873926 on the H200: DeepSpeed 0.19.8 ZeRO-3, Llama-3.2-1B bf16 with LoRA r16 on
q/v, b2 s1024, 4 emulated ranks, ranks 0 and 3 traced): why its reserved peak is not a function of the program's
requests alone. No torch: the snapshots are read with the restricted unpickler."""

import pathlib

import pandas as pd

from benchmarks.zero3_trace_anatomy import _requests, _trace
from estimator.allocator.requests import simulate

H200 = pathlib.Path(__file__).resolve().parents[2] / "data" / "measurements" / "h200-141gb"
RUN = "03ab897ea7873926-a4b7c02a"


def _trace_of(rank: int):
    return _trace(H200 / "snapshots" / f"{RUN}.rank{rank}.snapshot.pickle.gz")


def _measured(rank: int) -> int:
    rows = pd.read_csv(H200 / "gpu_snapshots.csv")
    row = rows[(rows["run_id"] == RUN) & (rows["rank"] == rank)]
    assert len(row) == 1 and row.iloc[0]["method"] == "zero3" and row.iloc[0]["lora_rank"] == 16
    return int(row.iloc[0]["peak_reserved_bytes"])


def test_the_two_ranks_make_the_same_requests_and_differ_only_by_stream_event_timing():
    """Ranks 0 and 3 run the same program (the fake process group: same tensors, same sizes): with every
    ``record_stream`` free taken where it was requested, both traces give 12,507,414,528 B. Taken where the GPU
    completed it, they give each rank's measured peak, 2.5 % and 1.0 % above, and 1.5 % apart. So no replay of
    DeepSpeed's requests can land within 0.1 % of both: the rest is when the default stream's kernels finished."""
    plain = []
    for rank in (0, 3):
        trace, streams, _, _ = _trace_of(rank)
        plain.append(simulate(_requests(trace, streams, "requested"))["peak_reserved_bytes"])
        assert simulate(_requests(trace, streams, "completed"))["peak_reserved_bytes"] == _measured(rank)
    assert plain == [12_507_414_528, 12_507_414_528]
    assert (_measured(0), _measured(3)) == (12_826_181_632, 12_629_049_344)
    assert _measured(0) - _measured(3) > 0.015 * _measured(3)


def test_rank0s_excess_is_the_allgather_stream_growing_while_the_embeddings_copy_waits():
    """Rank 0's 318,767,104 B above the plain replay: in step 3's backward the tied embedding's gathered copy
    (525,336,576 B) is freed with a pending ``record_stream`` event on the default stream; before it completes,
    the allgather stream allocates four prefetch buffers that cannot reuse its block; at the run's peak that stream
    holds 318,767,104 B more than its plain replay's pool (2 x 121,634,816 + 75,497,472 B), the whole excess."""
    from benchmarks.zero3_trace_anatomy import anatomy

    trace, streams, _, _ = _trace_of(0)
    mallocs, requested, late = 0, {}, []
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            mallocs += 1
        elif event["action"] == "free_requested":
            following = trace[i + 1] if i + 1 < len(trace) else None
            if not (following and following["action"] == "free_completed" and following["addr"] == event["addr"]):
                requested[event["addr"]] = (mallocs, i)
        elif event["action"] == "free_completed" and event["addr"] in requested:
            before, at = requested.pop(event["addr"])
            if mallocs - before > 4:
                late.append((event["size"], [trace[j]["size"] for j in range(at, i) if trace[j]["action"] == "alloc"
                                             and streams[trace[j]["stream"]] == 1]))
    assert len(late) == 1
    size, allgather_meanwhile = late[0]
    assert size == 525_336_576 and allgather_meanwhile == [121_634_816, 121_634_816, 121_634_816, 75_497_472]
    found = anatomy(H200 / "snapshots" / f"{RUN}.rank0.snapshot.pickle.gz")
    excess = found["peak_streams"][1] - found["pools"][1]
    assert excess == 2 * 121_634_816 + 75_497_472 == 12_826_181_632 - 12_507_414_528
    assert found["peak_streams"][0] == found["pools"][0] and found["peak_streams"][2] == found["pools"][2]
