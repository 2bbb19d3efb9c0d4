"""Variable-length batches: a dataset's token lengths -> the batch shapes of one epoch -> the epoch's peak.

``lengths`` reads a lengths file, ``batches`` forms one epoch's batches per data-parallel rank (padding,
ordering, splitting as PyTorch / transformers / TRL do), ``epoch`` estimates the epoch's peak at its worst
batch. Pure standard library; imports point one way: epoch -> batches -> lengths.
"""

from estimator.batching.batches import BatchShape, Epoch, form_epoch
from estimator.batching.epoch import EpochEstimate, EpochOptions, estimate_epoch
from estimator.batching.lengths import parse_lengths, read_lengths

__all__ = ["BatchShape", "Epoch", "EpochEstimate", "EpochOptions", "estimate_epoch", "form_epoch", "parse_lengths",
           "read_lengths"]
