"""fms-acceleration's single-GPU Mistral-7B LoRA / QLoRA rows with fms-hf-tuning's 32,001 vocabulary rows: the
loss's segments in the estimate's stream, the same requests in a real GPU's recorded stream, and a lower bound on
what a real run holding the estimate's segments would read.

    PYTHONPATH=. .venv/bin/python benchmarks/fms_lora_loss_segments.py \\
        [--row fms_acceleration:24bdadb228e2:none:Mistral-7B-v0.1:lora:x1:b8:nvml] [--recorded lora|full|none]

Printed, per vocabulary (32,000 and the row's 32,001): step 1's logits-sized requests (at least 95 % of the
bf16 logits: no decoder-layer tensor of this model is) with the segment each lands in
(``reserved_stream_diff.placements``); the live bytes just before the first of them; the logits-sized segments
step 1 makes; the estimate's peak reserved. Then the same for a recorded H200 stream of the row's batch
(transformers 4.48.1, 32,001 rows, torch 2.11, ``benchmarks/fms_full_capacity_gpu.py``): ``lora`` (default) the
rows' own configuration (``snapshots_bench/fms_mistral7b_lora16_b{4,8}``: q/k/v/o r16 alpha 16 dropout 0.1, fp32
adapters, reentrant checkpointing), ``full`` the full fine-tuning re-run (``fms_mistral7b_full_b{4,8}``). The
bound: before the loss, the live bytes are held in segments made earlier, and each layer's MLP under the reentrant
checkpoint's no-grad forward holds at least two b x s x intermediate bf16 outputs at once, which no earlier cached
block can hold and no logits-sized request can reuse; so a run that makes the estimate's logits segments reserves
at least live-before-loss + 2 MLP outputs + those segments, with no CUDA context at all.

Measured (2026-11-28, the LoRA snapshots): the real run makes the estimate's sixteen logits-sized requests in the
same order and placements and the same fifth segment (18,006 MiB of logits segments at b8, 9,006 at b4); its
reserved peak 47,441,772,544 B (b8) / 31,293,702,144 (b4) against the estimate's 47,353,692,160 / 31,138,512,896
for the row's spec (a100-80gb; -0.19 / -0.50 %).
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


def recorded_stream(batch: int, kind: str = "lora", seq_len: int = 4096):
    """(requests, phase starts) of the H200 run's recorded stream at ``batch`` (``kind``: lora or full)."""
    from fms_full_stream import SNAPSHOTS
    from reserved_stream_diff import recorded

    name = "lora16" if kind == "lora" else "full"
    requests, starts, _ = recorded(SNAPSHOTS / f"fms_mistral7b_{name}_b{batch}.snapshot.pickle.gz",
                                   batch * seq_len * 8, 0)
    return requests, starts


def logits_min_bytes(batch: int, seq_len: int, vocab: int) -> int:
    """The smallest logits-sized request: 95 % of the bf16 logits (no decoder-layer tensor of this model is)."""
    return int(0.95 * batch * seq_len * vocab * 2)


def _print_region(title: str, requests: list, starts: list, min_bytes: int, mlp_bytes: int) -> None:
    lines, live, made, peak = loss_region(requests, starts, min_bytes)
    print(f"\n{title}: step 1's logits-sized requests (index, alloc/free, size, segment, offset)")
    print("\n".join(lines))
    print(f"live before the loss {live / GIB:.3f} GiB; logits-sized segments made in step 1 {made / MIB:.0f} MiB; "
          f"peak reserved {peak:,} B ({peak / GIB:.3f} GiB); bound (live + 2 MLP outputs {mlp_bytes / MIB:.0f} "
          f"MiB + those segments, no context) {(live + mlp_bytes + made) / GIB:.3f} GiB")


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from fms_full_stream import generated

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--row", default="fms_acceleration:24bdadb228e2:none:Mistral-7B-v0.1:lora:x1:b8:nvml")
    parser.add_argument("--recorded", choices=("lora", "full", "none"), default="lora",
                        help="the H200 stream to set beside the estimate's (lora: the rows' configuration)")
    args = parser.parse_args(argv)
    with open(ROOT / "data" / "public" / "measurements.csv") as handle:
        row = next(r for r in csv.DictReader(handle) if r["row_id"] == args.row)
    b, s, vocab = int(row["micro_batch_size"]), int(row["seq_len"]), int(row.get("vocab_size") or 32000)
    min_bytes = logits_min_bytes(b, s, vocab)
    mlp = 2 * b * s * INTERMEDIATE * 2
    print(f"{args.row}: model code {row['model_code']}, published {int(row['value_bytes']) / GIB:.2f} GiB")
    for v in (32000, vocab):
        requests, starts = generated(row, v)
        _print_region(f"estimate, V = {v}", requests, starts, min_bytes, mlp)
    if args.recorded != "none" and b in (4, 8):
        requests, starts = recorded_stream(b, args.recorded, s)
        _print_region(f"recorded H200 {args.recorded} b{b} (transformers 4.48.1, torch 2.11, V = 32001)",
                      requests, starts, min_bytes, mlp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
