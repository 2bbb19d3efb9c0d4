"""One epoch's micro-batches, per data-parallel rank, as the usual PyTorch / transformers / TRL stack forms them.

Padding (``PADDINGS``):

* ``longest`` -- each batch padded to its longest sample (DataCollatorWithPadding's default), samples truncated
  at ``seq_len`` first (the tokenizer's ``max_length``);
* ``max_length`` -- every batch padded to ``seq_len``;
* ``packed`` -- TRL's "wrapped" packing: all samples, untruncated, concatenated in dataset order and cut into rows
  of ``seq_len`` tokens (the remainder is a shorter last row). Packed batches carry no padding mask.

``pad_to_multiple_of`` rounds a padded length up, as ``tokenizer.pad`` does (also past ``seq_len``).

Samples longer than ``seq_len`` (``TRUNCATIONS``; padding ``longest`` and ``max_length``):

* ``cut`` -- cut at ``seq_len`` (the tokenizer's ``truncation=True``): every long sample becomes a ``seq_len`` batch;
* ``delete`` -- dropped from the epoch (ms-swift's ``truncation_strategy delete``, TRL's length filters): the
  epoch keeps only the samples up to ``seq_len``, of every length below it.

Order (``ORDERS``) and the split over data-parallel ranks:

* ``random`` -- a shuffled epoch split by ``DistributedSampler`` (sample ``i`` of the shuffled, wrap-padded
  order goes to rank ``i % dp``); each rank batches its samples in order, the last batch may be partial;
* ``grouped`` -- transformers' ``group_by_length`` (``LengthGroupedSampler``): megabatches of ``mult x (micro-batch
  x accumulation)`` shuffled samples, each sorted by length, longest sample moved to the front; Accelerate then
  deals the micro-batches round-robin to the ranks (batch ``j`` to rank ``j % dp``), completing the last round
  from the start of the epoch;
* ``sorted`` -- fully sorted by length (bucketing samplers), dealt to the ranks like ``grouped``.

The shuffles use Python's ``random.Random(seed)``: the same seed is not torch's permutation, but the shapes that
matter (the longest batch, the padded-length distribution) are properties of the lengths, not of one shuffle.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

PADDINGS = ("longest", "max_length", "packed")
TRUNCATIONS = ("cut", "delete")
ORDERS = ("random", "grouped", "sorted")
MEGABATCH_MULT = 50      # transformers' get_length_grouped_indices default cap


@dataclass(frozen=True)
class BatchShape:
    """One micro-batch: ``rows`` samples padded to ``padded_len`` tokens."""

    index: int            # position in the epoch's batch order (before the split over ranks)
    rank: int             # data-parallel rank that runs it
    step: int             # its micro-step on that rank
    rows: int
    padded_len: int
    real_tokens: int
    # True: transformers runs it with a materialized attention mask (the profiles are traced without one).
    has_padding: bool

    @property
    def padded_tokens(self) -> int:
        return self.rows * self.padded_len


@dataclass(frozen=True)
class Epoch:
    """The batches of one epoch, in the order each rank runs them (``ranks[r]``: rank r's batches)."""

    ranks: tuple[tuple[BatchShape, ...], ...]
    samples: int          # samples (packed: rows) before any wrap-around fill
    truncated: int        # samples longer than seq_len (cut, or deleted; packing cuts none)
    seq_len: int
    micro_batch: int

    @property
    def batches(self) -> list[BatchShape]:
        return sorted((b for rank in self.ranks for b in rank), key=lambda b: (b.index, b.rank))

    def worst_shapes(self) -> list[BatchShape]:
        """One batch per (rows, padded length, padding) no other batch dominates (as many rows, as long, padded
        if it is): the only shapes that can set the peak (a padded batch runs attention with a mask, which can
        cost more). The first such batch of the epoch represents each shape."""
        first: dict[tuple[int, int, bool], BatchShape] = {}
        for batch in self.batches:
            first.setdefault((batch.rows, batch.padded_len, batch.has_padding), batch)

        def dominated(key: tuple[int, int, bool]) -> bool:
            return any(other != key and all(o >= k for o, k in zip(other, key)) for other in first)

        return [first[key] for key in sorted(first, reverse=True) if not dominated(key)]


def grouped_order(lengths: list[int], group_size: int, order: list[int], mega_batch_mult: int | None = None
                  ) -> list[int]:
    """transformers' length grouping of the permutation ``order``: megabatches of ``mult x group_size``
    consecutive indices, each sorted by descending length (stable), then the longest sample of the epoch swapped
    to the very front so an OOM shows at the first step."""
    if mega_batch_mult is None:
        mega_batch_mult = max(1, min(len(lengths) // (group_size * 4), MEGABATCH_MULT))
    size = mega_batch_mult * group_size
    megabatches = [sorted(order[i:i + size], key=lambda i: lengths[i], reverse=True)
                   for i in range(0, len(order), size)]
    heads = [lengths[mb[0]] for mb in megabatches]
    top = heads.index(max(heads))
    megabatches[0][0], megabatches[top][0] = megabatches[top][0], megabatches[0][0]
    return [i for mb in megabatches for i in mb]


def sample_lengths(lengths: list[int], seq_len: int, padding: str, truncation: str = "cut"
                   ) -> tuple[list[int], int]:
    """(the samples' lengths as the model sees them, how many were truncated or deleted)."""
    if padding == "packed":
        total = sum(lengths)
        rows = [seq_len] * (total // seq_len)
        return rows + ([total % seq_len] if total % seq_len else []), 0
    longer = sum(n > seq_len for n in lengths)
    if truncation == "delete":
        kept = [n for n in lengths if n <= seq_len]
        if not kept:
            raise ValueError(f"lengths: every sample is longer than seq_len {seq_len} (truncation delete keeps none)")
        return kept, longer
    return [min(n, seq_len) for n in lengths], longer


def _wrap(indices: list[int], total: int) -> list[int]:
    """``indices`` extended to ``total`` by repeating from the start (DistributedSampler, Accelerate)."""
    out = list(indices)
    while len(out) < total:
        out += indices[:total - len(out)]
    return out


def _chunks(indices: list[int], size: int) -> list[list[int]]:
    return [indices[i:i + size] for i in range(0, len(indices), size)]


@functools.lru_cache(maxsize=8)
def _shuffled(n: int, seed: int) -> tuple[int, ...]:
    """The epoch's permutation (cached: a plan forms the same epoch at many micro-batch sizes)."""
    indices = list(range(n))
    random.Random(seed).shuffle(indices)
    return tuple(indices)


def _rank_batches(samples: list[int], *, micro_batch: int, dp: int, order: str, grad_accum: int, seed: int
                  ) -> list[list[tuple[int, list[int]]]]:
    """Per rank: (epoch batch index, sample indices) of each micro-batch, in the rank's order."""
    n = len(samples)
    indices = list(_shuffled(n, seed)) if order != "sorted" else list(range(n))
    if order == "random":
        per_rank = -(-n // dp)
        padded = _wrap(indices, per_rank * dp) if dp > 1 else indices
        ranks = []
        for rank in range(dp):
            mine = _chunks(padded[rank::dp], micro_batch)
            ranks.append([(step * dp + rank, batch) for step, batch in enumerate(mine)])
        return ranks
    if order == "grouped":
        indices = grouped_order(samples, micro_batch * grad_accum, indices)
    else:
        indices.sort(key=lambda i: samples[i], reverse=True)
    if dp > 1:   # Accelerate's even_batches: complete the last round of micro-batches from the epoch's start
        rounds = -(-n // (micro_batch * dp))
        indices = _wrap(indices, rounds * micro_batch * dp)
    ranks = [[] for _ in range(dp)]
    for j, batch in enumerate(_chunks(indices, micro_batch)):
        ranks[j % dp].append((j, batch))
    return ranks


def _round_up(value: int, multiple: int | None) -> int:
    return -(-value // multiple) * multiple if multiple else value


def _shape(samples: list[int], index: int, rank: int, step: int, batch: list[int], *, seq_len: int, padding: str,
           pad_to_multiple_of: int | None) -> BatchShape:
    rows = [samples[i] for i in batch]
    longest, real = max(rows), sum(rows)
    if padding == "packed":
        padded, has_padding = longest, False
    else:
        padded = _round_up(seq_len if padding == "max_length" else longest, pad_to_multiple_of)
        has_padding = real < padded * len(rows)
    return BatchShape(index, rank, step, len(rows), padded, real, has_padding)


def check_options(*, padding: str, order: str, pad_to_multiple_of: int | None, seed: int,
                  truncation: str = "cut") -> None:
    if padding not in PADDINGS:
        raise ValueError(f"padding: {padding!r} is not one of {', '.join(PADDINGS)}")
    if truncation not in TRUNCATIONS:
        raise ValueError(f"truncation: {truncation!r} is not one of {', '.join(TRUNCATIONS)}")
    if order not in ORDERS:
        raise ValueError(f"batching: {order!r} is not one of {', '.join(ORDERS)}")
    if pad_to_multiple_of is not None and (isinstance(pad_to_multiple_of, bool)
                                           or not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1):
        raise ValueError(f"pad_to_multiple_of: must be a positive integer, got {pad_to_multiple_of!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed: must be an integer, got {seed!r}")


def form_epoch(lengths: list[int], *, seq_len: int, micro_batch: int, dp: int = 1, padding: str = "longest",
               order: str = "random", pad_to_multiple_of: int | None = None, seed: int = 0, grad_accum: int = 1,
               truncation: str = "cut") -> Epoch:
    """The batches of one epoch of ``lengths`` (token lengths) on each of ``dp`` data-parallel ranks."""
    check_options(padding=padding, order=order, pad_to_multiple_of=pad_to_multiple_of, seed=seed,
                  truncation=truncation)
    for name, value in (("seq_len", seq_len), ("micro_batch_size", micro_batch), ("dp", dp),
                        ("grad_accum_steps", grad_accum)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    if not lengths:
        raise ValueError("lengths: no samples")
    samples, truncated = sample_lengths(lengths, seq_len, padding, truncation)
    per_rank = _rank_batches(samples, micro_batch=micro_batch, dp=dp, order=order, grad_accum=grad_accum, seed=seed)
    ranks = tuple(tuple(_shape(samples, index, rank, step, batch, seq_len=seq_len, padding=padding,
                               pad_to_multiple_of=pad_to_multiple_of)
                        for step, (index, batch) in enumerate(mine))
                  for rank, mine in enumerate(per_rank))
    return Epoch(ranks=ranks, samples=len(samples), truncated=truncated, seq_len=seq_len, micro_batch=micro_batch)
