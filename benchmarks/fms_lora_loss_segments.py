"""fms-acceleration's single-GPU Mistral-7B LoRA / QLoRA rows with fms-hf-tuning's 32,001 vocabulary rows: the
loss's segments in the estimate's stream, the same requests in the H200 full fine-tuning re-run's recorded stream,
and a lower bound on what a real run holding the estimate's segments would read.

    PYTHONPATH=. .venv/bin/python benchmarks/fms_lora_loss_segments.py \\
        [--row fms_acceleration:9239802cc91a:none:Mistral-7B-v0.1:lora:x1:b8:nvml] [--no-recorded]

Printed, per vocabulary (32,000 and the row's 32,001): step 1's logits-sized requests (at least 95 % of the
bf16 logits: no decoder-layer tensor of this model is) with the segment each lands in
(``reserved_stream_diff.placements``); the live bytes just before the first of them; the logits-sized segments
step 1 makes; the estimate's peak reserved. Then the recorded H200 stream's
(``snapshots_bench/fms_mistral7b_full_b{4,8}``, transformers 4.48.1, 32,001 rows) requests of those sizes in its
first step. The bound: before the loss, the live bytes are held in segments made earlier, and each layer's MLP
under the reentrant checkpoint's no-grad forward holds at least two b x s x intermediate bf16 outputs at once,
which no earlier cached block can hold and no logits-sized request can reuse; so a run that makes the estimate's
logits segments reserves at least live-before-loss + 2 MLP outputs + those segments, with no CUDA context at all.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB, GIB = 1024**2, 1024**3
INTERMEDIATE = 14336  # Mistral-7B-v0.1's MLP width


def loss_region(requests: list, starts: list, min_bytes: int) -> tuple[list[str], int, int, int]:
    """(placement lines of step 1's requests of at least ``min_bytes``, live bytes before the first of them,
    bytes of the segments step 1 makes from it on for such requests, peak reserved)."""
    from reserved_stream_diff import placements

    from estimator.allocator.model import CachingAllocator

    allocator, addr = CachingAllocator(None), {}
    first, live, made = None, 0, 0
    for index, request in enumerate(requests):
        if request[0] == "alloc":
            if first is None and index >= starts[1] and request[2] >= min_bytes:
                first, live = index, allocator.allocated_bytes
            before = allocator.reserved_bytes
            addr[request[1]] = allocator.malloc(request[2], request[3])
            if first is not None and index < starts[2] and request[2] >= min_bytes:
                made += allocator.reserved_bytes - before
        else:
            allocator.free(addr.pop(request[1]))
    lines = [line for line in placements(requests, starts[1], starts[2], min_bytes)
             if float(line.split()[2].removesuffix("MiB")) * MIB >= min_bytes]
    return lines, live, made, allocator.peak_reserved_bytes


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from fms_full_stream import SNAPSHOTS, generated
    from reserved_stream_diff import placements, recorded

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--row", default="fms_acceleration:9239802cc91a:none:Mistral-7B-v0.1:lora:x1:b8:nvml")
    parser.add_argument("--no-recorded", action="store_true", help="skip the H200 full fine-tuning stream")
    args = parser.parse_args(argv)
    with open(ROOT / "data" / "public" / "measurements.csv") as handle:
        row = next(r for r in csv.DictReader(handle) if r["row_id"] == args.row)
    b, s, vocab = int(row["micro_batch_size"]), int(row["seq_len"]), int(row.get("vocab_size") or 32000)
    min_bytes = int(0.95 * b * s * vocab * 2)  # the bf16 logits and larger: no decoder-layer tensor
    mlp = 2 * b * s * INTERMEDIATE * 2
    print(f"{args.row}: model code {row['model_code']}, published {int(row['value_bytes']) / GIB:.2f} GiB")
    for v in (32000, vocab):
        requests, starts = generated(row, v)
        lines, live, made, peak = loss_region(requests, starts, min_bytes)
        print(f"\nV = {v}: step 1's logits-sized requests (index, alloc/free, size, segment, offset)")
        print("\n".join(lines))
        print(f"live before the loss {live / GIB:.3f} GiB; logits-sized segments made in step 1 {made / MIB:.0f} MiB; "
              f"estimate's peak reserved {peak / GIB:.3f} GiB; bound (live + 2 MLP outputs {mlp / MIB:.0f} MiB + "
              f"those segments, no context) {(live + mlp + made) / GIB:.3f} GiB")
    if not args.no_recorded and b in (4, 8):
        path = SNAPSHOTS / f"fms_mistral7b_full_b{b}.snapshot.pickle.gz"
        rec, _, _ = recorded(path, b * s * 8, 0)
        lines = [line for line in placements(rec, 0, len(rec), min_bytes)
                 if float(line.split()[2].removesuffix("MiB")) * MIB >= min_bytes]
        print(f"\nrecorded {path.name} (H200, transformers 4.48.1, full fine-tuning, V = 32001), first step:")
        print("\n".join(lines[:16]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
