"""ms-swift's Yi-6B-Chat LoRA rows (data/public, ``ms_swift_benchmark``) over their epoch of variable-length
batches: the reserved level of identical ``max_length`` steps beside the epoch's, by how samples past ``max_length``
are handled (``delete`` as the benchmark ran, ``cut`` as the estimator did before session 32) and by shuffle seed.

    PYTHONPATH=. .venv/bin/python benchmarks/swift_epoch_orders.py [--seeds 0 1] [--truncation delete cut]

The epoch is ``calibrate.public.row_epoch``'s (the lengths file's lognormal, 1,000 samples above 2048); the first
``REPLAY_STEPS`` steps are replayed through the allocator model (``estimate_epoch``). About 1-2 min a row and seed.
"""

from __future__ import annotations

import argparse
import dataclasses

from calibrate import public as P
from estimator.api import estimate
from estimator.batching.epoch import estimate_epoch
from estimator.columns import spec_from_columns

GIB = 1024**3
PREFIX = "ms_swift_benchmark:LoRA:yi-6b-chat:max_length="


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--truncation", nargs="+", default=["delete", "cut"])
    args = parser.parse_args()
    rows = sorted((r for r in P.scorable(P.load(P.DEFAULT_DATA)) if r["row_id"].startswith(PREFIX)),
                  key=lambda r: int(r["seq_len"]))
    print("| max_length | published | identical steps | " + " | ".join(
        f"{t} seed {s}" for t in args.truncation for s in args.seeds) + " |")
    print("|---" * (3 + len(args.truncation) * len(args.seeds)) + "|")
    for r in rows:
        spec = spec_from_columns(r)
        seq_len = spec.training.seq_len
        try:
            same = estimate(spec).peak_reserved_bytes / GIB
        except ValueError as err:
            print(f"| {seq_len} | {float(r['value']):.2f} | {str(err).splitlines()[0]} |")
            continue
        lengths, options, _ = P.row_epoch(r, seq_len)
        cells = []
        for truncation in args.truncation:
            for seed in args.seeds:
                o = dataclasses.replace(options, truncation=truncation, seed=seed)
                cells.append(f"{estimate_epoch(spec, lengths, o).estimate.peak_reserved_bytes / GIB:.2f}")
        print(f"| {seq_len} | {float(r['value']):.2f} | {same:.2f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
