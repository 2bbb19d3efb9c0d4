"""The variable-length flags shared by ``python -m estimator`` and ``python -m estimator plan``."""

from __future__ import annotations

import argparse

from estimator.batching.batches import ORDERS, PADDINGS, TRUNCATIONS
from estimator.batching.epoch import REPLAY_STEPS, EpochOptions
from estimator.batching.lengths import read_lengths

FLAGS = ("padding", "batching", "pad_to_multiple_of", "seed", "empty_cache_steps", "replay_steps", "truncation")


def add_batching_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("variable-length batches (an epoch of real sample lengths)")
    group.add_argument("--lengths", metavar="FILE", help="token length per sample, one per line, or a 'LENGTH COUNT' "
                       "histogram: the peak over one epoch of these samples (--seq-len truncates them)")
    group.add_argument("--padding", choices=PADDINGS, default=None,
                       help="longest (default): pad each batch to its longest sample; max_length: to --seq-len; "
                            "packed: TRL packing into rows of --seq-len tokens")
    group.add_argument("--truncation", choices=TRUNCATIONS, default=None,
                       help="cut (default): samples longer than --seq-len are cut to it; delete: they are dropped "
                            "(ms-swift's truncation_strategy delete)")
    group.add_argument("--batching", choices=ORDERS, default=None,
                       help="random (default): shuffled; grouped: transformers' group_by_length; sorted: by length")
    group.add_argument("--pad-to-multiple-of", type=int, default=None, metavar="N",
                       help="round padded lengths up to a multiple of N (the data collator's option, e.g. 8)")
    group.add_argument("--seed", type=int, default=None, help="shuffle seed of the epoch (default 0)")
    group.add_argument("--empty-cache-steps", type=int, default=None, metavar="N",
                       help="the loop calls torch.cuda.empty_cache() every N steps (HF Trainer's "
                            "torch_empty_cache_steps): the cache is rebuilt from there")
    group.add_argument("--replay-steps", type=int, default=None, metavar="N",
                       help=f"replay the first N steps of the epoch in order through the allocator model for the "
                            f"reserved level (default {REPLAY_STEPS}; 0: the worst batch's shape repeated)")


def batching_from_args(args: argparse.Namespace) -> tuple[list[int], EpochOptions] | None:
    """(lengths, options) with ``--lengths``, else None; the other flags without ``--lengths`` are an error."""
    if args.lengths is None:
        given = [name for name in FLAGS if getattr(args, name) is not None]
        if given:
            raise ValueError(f"{given[0]}: needs --lengths FILE (the sample lengths of the epoch)")
        return None
    options = EpochOptions(padding=args.padding or "longest", batching=args.batching or "random",
                           pad_to_multiple_of=args.pad_to_multiple_of,
                           seed=0 if args.seed is None else args.seed, empty_cache_steps=args.empty_cache_steps,
                           replay_steps=REPLAY_STEPS if args.replay_steps is None else args.replay_steps,
                           truncation=args.truncation or "cut")
    return read_lengths(args.lengths), options
