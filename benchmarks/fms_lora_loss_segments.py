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
for the row's spec with torch 2.11's slicing (a100-80gb; -0.19 / -0.50 %). The rows' torch 2.4.1 records the
loss's full-range ``:`` (``benchmarks/loss_slice_order.py``); rewritten with it (``with_full_range_slices``) the
stream makes four logits segments, as the estimator does with ``full_range_slices`` (``--table``).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB, GIB = 1024**2, 1024**3
INTERMEDIATE = 14336  # Mistral-7B-v0.1's MLP width
HIDDEN = 4096


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


def with_full_range_slices(requests: list, starts: list, batch: int, seq_len: int, vocab: int, hidden: int
                           ) -> tuple[list, list]:
    """The stream as torch 2.4 runs the same code (``benchmarks/loss_slice_order.py``): its Python indexing records
    a ``SliceBackward`` for every full-range ``:`` (``applySlice`` elides a slice only when its stop equals the
    dimension, and ``:`` passes INT64_MAX; torch 2.11 / 2.13 elide stop >= the dimension). So the loss's
    ``logits[..., :-1, :]`` backward first zero-fills a b x (s-1) x V fp32 gradient for the vocabulary dimension's
    ``:`` and frees the incoming one, and only then the b x s x V one for the sequence slice; and the head's input
    ``hidden_states[:, -num_logits_to_keep:, :]`` (4.45; ``slice_indices`` in 4.48) adds three b x s x hidden bf16
    zero-fills after the head's backward matmul. Returns (requests, phase starts)."""
    full, shifted, head_in, bf16 = (batch * seq_len * vocab * 4, batch * (seq_len - 1) * vocab * 4,
                                    batch * seq_len * hidden * 2, batch * seq_len * vocab * 2)
    sizes, out, rename, new_starts, state = {}, [], {}, [], None
    index, added = 0, 0
    while index < len(requests):
        while len(new_starts) < len(starts) and starts[len(new_starts)] == index:
            new_starts.append(len(out))
        request = requests[index]
        if request[0] == "alloc":
            sizes[request[1]] = request[2]
        after = requests[index + 1] if index + 1 < len(requests) else None
        if (request[0] == "alloc" and request[2] == full and after is not None and after[0] == "free"
                and sizes.get(after[1]) == shifted):  # the sequence slice's zero-fill, then its incoming gradient
            extra, added = ("v", added), added + 1
            out += [("alloc", extra, shifted, request[3]), after, request, ("free", extra)]
            state = "logits grad"
            index += 2
            continue
        if request[0] == "free" and request[1] in rename:
            request = ("free", rename.pop(request[1]))
        out.append(request)
        if state == "logits grad" and request[0] == "alloc" and request[2] == bf16:
            state = "head input grad"
        elif state == "head input grad" and request[0] == "alloc" and request[2] == head_in:
            state = ("after the logits grad's free", request[1])
        elif isinstance(state, tuple) and request[0] == "free" and sizes.get(request[1]) == bf16:
            previous = state[1]
            for _ in range(3):  # the dims 2, 1, 0 slices' backwards, each freeing the gradient before it
                extra, added = ("h", added), added + 1
                out += [("alloc", extra, head_in, 0), ("free", previous)]
                previous = extra
            rename[state[1]] = previous
            state = None
        index += 1
    new_starts += [len(out)] * (len(starts) - len(new_starts))
    return out, new_starts


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


def modern_slicing(row: dict) -> dict:
    """``row`` as torch 2.11 / 2.13 run it (the H200 runs'): full-range slices elided."""
    return dict(row, full_range_slices="False")


def table() -> list[str]:
    """Per single-GPU LoRA / QLoRA ``nvml_used`` row at 32,001 rows: published; the estimate with torch 2.11's
    slicing (what the H200 run confirms); the estimate as the row states it (``full_range_slices`` from its torch);
    and, as a check on the estimator's event rewrite, the 2.11 estimate less the reserved bytes this script's
    stream rewrite (``with_full_range_slices``) does not make, with the same device term."""
    from fms_full_stream import generated, through

    from estimator.api import estimate
    from estimator.columns import spec_from_columns

    with open(ROOT / "data" / "public" / "measurements.csv") as handle:
        rows = [r for r in csv.DictReader(handle) if r["source"] == "fms_acceleration" and r["method"] == "single"
                and r["lora_rank"] not in ("", "0") and r["vocab_size"] == "32001" and r["quantity"] == "nvml_used"
                and r["complete"] == "True" and r["in_scope"] == "True" and r["model"] == "mistralai/Mistral-7B-v0.1"]
    lines = ["| row | torch | published GiB | torch 2.11 slicing GiB | % | as stated GiB | % | stream rewrite GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for row in sorted(rows, key=lambda r: r["row_id"]):
        b, s, published = int(row["micro_batch_size"]), int(row["seq_len"]), int(row["value_bytes"])
        modern = estimate(spec_from_columns(modern_slicing(row)), allow_build=False).ranks[0].peak_device_bytes
        stated = estimate(spec_from_columns(row), allow_build=False).ranks[0]
        requests, starts = generated(modern_slicing(row), 32001)
        rewritten = modern - (through(requests, None)[0]
                              - through(with_full_range_slices(requests, starts, b, s, 32001, HIDDEN)[0], None)[0])
        lines.append(f"| `{row['row_id']}` | {row['torch_version']} | {published / GIB:.2f} | {modern / GIB:.2f} | "
                     f"{100 * (modern - published) / published:+.1f} | {stated.peak_device_bytes / GIB:.2f} | "
                     f"{100 * (stated.peak_device_bytes - published) / published:+.1f} | {rewritten / GIB:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from fms_full_stream import generated

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--row", default="fms_acceleration:24bdadb228e2:none:Mistral-7B-v0.1:lora:x1:b8:nvml")
    parser.add_argument("--recorded", choices=("lora", "full", "none"), default="lora",
                        help="the H200 stream to set beside the estimate's (lora: the rows' configuration)")
    parser.add_argument("--table", action="store_true",
                        help="every such row: published, the estimate with torch 2.11's and with its own slicing")
    args = parser.parse_args(argv)
    if args.table:
        print("\n".join(table()))
        return 0
    with open(ROOT / "data" / "public" / "measurements.csv") as handle:
        row = next(r for r in csv.DictReader(handle) if r["row_id"] == args.row)
    b, s, vocab = int(row["micro_batch_size"]), int(row["seq_len"]), int(row.get("vocab_size") or 32000)
    min_bytes = logits_min_bytes(b, s, vocab)
    mlp = 2 * b * s * INTERMEDIATE * 2
    print(f"{args.row}: model code {row['model_code']}, published {int(row['value_bytes']) / GIB:.2f} GiB")
    for v in (32000, vocab):
        requests, starts = generated(modern_slicing(row), v)
        _print_region(f"estimate with torch 2.11's slicing, V = {v}", requests, starts, min_bytes, mlp)
    _print_region(f"that stream rewritten with torch 2.4's full-range slices (the rows' torch {row['torch_version']})",
                  *with_full_range_slices(requests, starts, b, s, vocab, HIDDEN), min_bytes, mlp)
    _print_region(f"estimate as the row states it (full_range_slices {row['full_range_slices']})",
                  *generated(row, vocab), min_bytes, mlp)
    if args.recorded != "none" and b in (4, 8):
        requests, starts = recorded_stream(b, args.recorded, s)
        _print_region(f"recorded H200 {args.recorded} b{b} (transformers 4.48.1, torch 2.11, V = 32001)",
                      requests, starts, min_bytes, mlp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
