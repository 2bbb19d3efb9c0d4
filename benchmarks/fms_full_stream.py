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

``--torch-slices``: the published rows ran torch 2.4.1, whose indexing records the loss's full-range ``:``
(``TrainingSpec.full_range_slices``; ``fms_lora_loss_segments.with_full_range_slices``). Printed then, uncapped:
the recorded stream rewritten so, and also in 4.45's loss order (``logits = logits.float()`` rebinds, freeing the
bf16 logits after their fp32 copy; the shifted copy freed before the fp32 logits: the 4.44 / 4.45 commits' model
code); the estimate with and without the rewrite; and, for each, the logits-sized segments wholly free when step 1
ends (after zero_grad): what step 2's loss can reuse without new segments.

Measured 2026-11-28 (``--batch 4 --torch-slices`` with ``--commit 9239802cc91a`` and ``24bdadb228e2``; vocab
32,001; GiB reserved, uncapped):

| stream | torch 2.11 slicing | torch 2.4.1 slicing | logits-sized segments wholly free after step 1 (2.4.1) |
|---|---|---|---|
| recorded (H200, 4.48.1) | 75.77 | 73.80 | 1 of 4 (the 1002 MiB bf16 one) |
| recorded, 4.45's loss order | 75.77 | 73.80 | 1 of 4 |
| estimate, model code 4.48 (24bdadb) | 73.79 | 71.83 | 2 of 4 |
| estimate, model code 4.45 (9239802) | 73.78 | 69.87 | 3 of 4 |

Published (nvml_used, peak minus first reading): 74.26 GiB for the 4.44 / 4.45 commits, 75.45 for 24bdadb (whose
stack holds a constant ~1.18 GiB more, ``calibrate.public`` DIAGNOSES): the recorded stream with 2.4.1's slicing
plus the 0.5 GiB context prior is 74.30. So the rows' 3.9 GiB is not torch 2.4.1's slicing nor the loss's order:
the estimate's stream packs step 1's gradients into the loss's freed 2000 MiB segments densely, so zero_grad leaves
two of them empty for step 2's loss; in the real run those segments keep holes that the first optimizer step's
Adam states fill, and step 2 makes three new logits-sized segments where the estimate makes one. The streams part
at once, in the last layer's reentrant recomputation: the real run makes b x s x hidden temporaries the trace lacks
(an extra 128 MiB block among the MLP's 448 MiB ones; 270,532,608 B where the trace has 256 MiB fp32). Its 65
blocks of 138,412,032 B per step (the norm weights' gradients: none in the LoRA re-run) are not the cause: injected
(``with_norm_reductions``) they leave the estimate at 69.87 / 71.83 GiB. Not located further (no stack frames).
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


def as_445_loss_order(requests: list, batch: int, seq_len: int, vocab: int) -> list:
    """The recorded (4.48.1) stream with each loss forward in 4.44 / 4.45's order: the bf16 logits freed right
    after their fp32 copy, and the fp32 logits freed after the first shifted copy's free."""
    bf16, fp32, shifted = batch * seq_len * vocab * 2, batch * seq_len * vocab * 4, batch * (seq_len - 1) * vocab * 4
    out, index = list(requests), 0
    while index < len(out) - 1:
        request, after = out[index], out[index + 1]
        if not (request[0] == "alloc" and request[2] == bf16 and after[0] == "alloc" and after[2] == fp32):
            index += 1
            continue
        moved = next(k for k in range(index + 2, len(out)) if out[k] == ("free", request[1]))
        out.insert(index + 2, out.pop(moved))
        copies = {x[1] for x in out[index + 3:index + 40] if x[0] == "alloc" and x[2] == shifted}
        fp32_free = next(k for k in range(index + 3, len(out)) if out[k] == ("free", after[1]))
        copy_free = next(k for k in range(index + 3, len(out)) if out[k][0] == "free" and out[k][1] in copies)
        if fp32_free < copy_free:
            out.insert(copy_free, out.pop(fp32_free))
        index += 2
    return out


NORM_REDUCTION_BYTES = 138_412_032  # the block the H200 full run makes at each norm weight's gradient (b4 s4096)


def with_norm_reductions(requests: list, batch: int, seq_len: int, hidden: int) -> tuple[list, int]:
    """The stream with the real run's norm-weight-gradient block (``NORM_REDUCTION_BYTES``, allocated and freed at
    once) after every hidden-sized bf16 allocation that follows a b x s x hidden bf16 one within three requests
    (the weight gradient of an RMSNorm after its product), and that product's free moved after it as the real run
    orders it. Returns (requests, blocks inserted)."""
    product, weight_grad = batch * seq_len * hidden * 2, hidden * 2
    out, live, count, index = [], {}, 0, 0
    for request in requests:  # unique ids first: the estimate's stream reuses them, and frees move here
        if request[0] == "alloc":
            index += 1
            live[request[1]] = index
            out.append(("alloc", index, request[2], request[3]))
        else:
            out.append(("free", live.pop(request[1])))
    sizes, result = {}, []
    for position, request in enumerate(out):
        result.append(request)
        if request[0] != "alloc":
            continue
        sizes[request[1]] = request[2]
        recent = out[max(0, position - 3):position]
        if request[2] == weight_grad and any(x[0] == "alloc" and x[2] == product for x in recent):
            moved = []
            before = out[position - 1]
            if before[0] == "free" and sizes.get(before[1]) == product:
                moved = [result.pop(-2)]
            key = ("norm reduction", count)
            count += 1
            result += [("alloc", key, NORM_REDUCTION_BYTES, request[3]), ("free", key), *moved]
    return result, count


def free_logits_segments(requests: list, end: int, min_bytes: int) -> tuple[int, int]:
    """(wholly free, all) segments of at least ``min_bytes`` after ``requests[:end]``."""
    from estimator.allocator.model import CachingAllocator

    allocator, addr = CachingAllocator(None), {}
    for request in requests[:end]:
        if request[0] == "alloc":
            addr[request[1]] = allocator.malloc(request[2], request[3])
        else:
            allocator.free(addr.pop(request[1]))
    free = total = 0
    for head in (block for block in allocator.blocks.values() if block.prev is None):
        blocks, block = [], head
        while block is not None:
            blocks.append(block)
            block = block.next
        if sum(x.size for x in blocks) >= min_bytes:
            total += 1
            free += not any(x.allocated for x in blocks)
    return free, total


def torch_slices(row: dict, rec: list, rec_starts: list, b: int, s: int) -> int:
    """Print the ``--torch-slices`` comparison (module docstring)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from fms_lora_loss_segments import HIDDEN, with_full_range_slices

    vocab, min_bytes = 32001, int(0.95 * b * s * 32001 * 2)
    recs = {"recorded (4.48.1)": rec, "recorded, 4.45's loss order": as_445_loss_order(rec, b, s, vocab)}
    for name, stream in recs.items():
        sliced, starts = with_full_range_slices(stream, rec_starts, b, s, vocab, HIDDEN)
        free, total = free_logits_segments(sliced, starts[2], min_bytes)
        print(f"{name}: torch 2.11 slicing {through(stream, None)[0] / GIB:.2f} GiB, torch 2.4.1 slicing "
              f"{through(sliced, None)[0] / GIB:.2f}; logits-sized segments wholly free after step 1: {free} of "
              f"{total}")
    for flag in ("False", "True"):
        stream, starts = generated({**row, "full_range_slices": flag}, vocab)
        free, total = free_logits_segments(stream, starts[2], min_bytes)
        print(f"estimate, model code {row['model_code']}, full_range_slices {flag}: "
              f"{through(stream, None)[0] / GIB:.2f} GiB; logits-sized segments wholly free after step 1: "
              f"{free} of {total}")
    injected, count = with_norm_reductions(stream, b, s, HIDDEN)
    print(f"estimate (full_range_slices True) with the real run's {count} norm-weight-gradient blocks: "
          f"{through(injected, None)[0] / GIB:.2f} GiB")
    return 0


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from reserved_stream_diff import recorded

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8, choices=(4, 8))
    parser.add_argument("--commit", default="9239802cc91a", help="the public row's fms-acceleration commit")
    parser.add_argument("--cap-gib", type=float, default=79.5)
    parser.add_argument("--vocab", type=int, nargs="*", default=[0, 32001, 32008],
                        help="embedding rows to estimate with (0: the catalogue config's)")
    parser.add_argument("--torch-slices", action="store_true",
                        help="compare with torch 2.4.1's full-range slices (the rows' torch), vocab 32,001")
    args = parser.parse_args(argv)
    row_id = f"fms_acceleration:{args.commit}:none:Mistral-7B-v0.1:full:x1:b{args.batch}:nvml"
    with open(ROOT / "data" / "public" / "measurements.csv") as handle:
        row = next(r for r in csv.DictReader(handle) if r["row_id"] == row_id)
    b, s = args.batch, int(row["seq_len"])
    cap = int(args.cap_gib * GIB)
    snapshot = SNAPSHOTS / f"fms_mistral7b_full_b{b}.snapshot.pickle.gz"
    rec, rec_starts, _ = recorded(snapshot, b * s * 8, 0)
    print(f"{row_id} (model code {row['model_code']}, vocab_size {row.get('vocab_size') or 0}); cap {args.cap_gib} GiB")
    peak, _, _ = through(rec, None)
    capped, levels, retries = through(rec, cap, [len(rec) - 1])
    print(f"recorded (H200, transformers 4.48.1, vocab 32001): uncapped {peak / GIB:.2f} GiB; capped peak "
          f"{capped / GIB:.2f}, end {levels[0] / GIB:.2f}, retries {retries}")
    if args.torch_slices:
        return torch_slices(row, rec, rec_starts, b, s)
    for vocab in args.vocab:
        stream, starts = generated(row, vocab)
        peak, _, _ = through(stream, None)
        capped, levels, retries = through(stream, cap, [i - 1 for i in starts[2:]])
        print(f"generated, vocab {vocab}: uncapped {peak / GIB:.2f} GiB; capped peak {capped / GIB:.2f}, steps end "
              f"{', '.join(f'{x / GIB:.2f}' for x in levels)}, retries {retries}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
