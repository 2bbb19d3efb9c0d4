"""fms-acceleration's Mistral-7B full fine-tuning rows (one A100-80GB): the estimator's own request stream beside the
H200 re-run's recorded one (benchmarks/fms_full_capacity_gpu.py, snapshots in
data/measurements/h200-141gb/snapshots_bench/), through the allocator model, uncapped and capped.

    PYTHONPATH=. .venv/bin/python benchmarks/fms_full_stream.py [--batch 8] [--commit 9239802cc91a] [--cap-gib 79.5]

The generated stream is the estimate's (``estimate`` of the public row, its replay intercepted: setup, then three
steps of ``timeline.step_requests``). The re-run used the vocabulary fms-hf-tuning leaves after adding the
tokenizer's pad token (32,001 rows, ``fms_fsdp1_lora_gpu.MISTRAL_7B``), which the row's spec now says
(``vocab_size``); ``--vocab`` estimates the row with other vocabularies (``training.vocab_size``; 0: the catalogue
config's 32,000), to show what those sizes alone do to the reserved level: 2 MiB-rounded segments that one size
fits and the other does not. Printed per stream: the uncapped reserved peak, and under the cap the peak, the level
each step ends at, and the retries.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3
SNAPSHOTS = ROOT / "data" / "measurements" / "h200-141gb" / "snapshots_bench"


def generated(row: dict, vocab: int):
    """(requests, phase starts) of the estimator's replay for ``row``'s spec with ``vocab`` embedding rows."""
    from reserved_stream_diff import intercepted_replay

    from estimator.api import estimate
    from estimator.columns import spec_from_columns
    from estimator.reserved.timeline import step_requests

    spec = spec_from_columns(row).replace(**{"training.vocab_size": vocab})
    _, caught = intercepted_replay(lambda: estimate(spec, allow_build=False))
    setup, plan = caught["setup"], caught["plan"]
    requests, frees = [], dict(setup.frees_after)
    for i, (_name, nbytes) in enumerate(setup.allocations):
        requests.append(("alloc", ("setup", i), nbytes, 0))
        requests.extend(("free", ("setup", j)) for j in frees.get(i, ()))
    starts = [0, len(requests)]
    for step in range(3):
        for request in step_requests(plan, step, 0):
            requests.append(("alloc", ("s", request[1]), request[2], request[3]) if request[0] == "alloc"
                            else (request[0], ("s", request[1])))
        starts.append(len(requests))
    return requests, starts


def through(requests: list, cap_bytes: int | None, ends: list[int] = ()):
    """(peak reserved, reserved after each index in ``ends``, retries) through the allocator model."""
    from estimator.allocator.model import CachingAllocator

    allocator = CachingAllocator(None, capacity_bytes=cap_bytes)
    addr, levels = {}, []
    marks = set(ends)
    for index, request in enumerate(requests):
        if request[0] == "alloc":
            addr[request[1]] = allocator.malloc(request[2], request[3])
        else:
            allocator.free(addr.pop(request[1]))
        if index in marks:
            levels.append(allocator.reserved_bytes)
    return allocator.peak_reserved_bytes, levels, allocator.num_alloc_retries


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from reserved_stream_diff import recorded

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8, choices=(4, 8))
    parser.add_argument("--commit", default="9239802cc91a", help="the public row's fms-acceleration commit")
    parser.add_argument("--cap-gib", type=float, default=79.5)
    parser.add_argument("--vocab", type=int, nargs="*", default=[0, 32001, 32008],
                        help="embedding rows to estimate with (0: the catalogue config's)")
    args = parser.parse_args(argv)
    row_id = f"fms_acceleration:{args.commit}:none:Mistral-7B-v0.1:full:x1:b{args.batch}:nvml"
    with open(ROOT / "data" / "public" / "measurements.csv") as handle:
        row = next(r for r in csv.DictReader(handle) if r["row_id"] == row_id)
    b, s = args.batch, int(row["seq_len"])
    cap = int(args.cap_gib * GIB)
    snapshot = SNAPSHOTS / f"fms_mistral7b_full_b{b}.snapshot.pickle.gz"
    rec, _starts, _ = recorded(snapshot, b * s * 8, 0)
    print(f"{row_id} (model code {row['model_code']}, vocab_size {row.get('vocab_size') or 0}); cap {args.cap_gib} GiB")
    peak, _, _ = through(rec, None)
    capped, levels, retries = through(rec, cap, [len(rec) - 1])
    print(f"recorded (H200, transformers 4.48.1, vocab 32001): uncapped {peak / GIB:.2f} GiB; capped peak "
          f"{capped / GIB:.2f}, end {levels[0] / GIB:.2f}, retries {retries}")
    for vocab in args.vocab:
        stream, starts = generated(row, vocab)
        peak, _, _ = through(stream, None)
        capped, levels, retries = through(stream, cap, [i - 1 for i in starts[2:]])
        print(f"generated, vocab {vocab}: uncapped {peak / GIB:.2f} GiB; capped peak {capped / GIB:.2f}, steps end "
              f"{', '.join(f'{x / GIB:.2f}' for x in levels)}, retries {retries}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
