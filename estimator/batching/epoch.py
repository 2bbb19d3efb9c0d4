"""The peak of an epoch of variable-length batches: ``estimate_epoch(spec, lengths, options)``.

Activations follow the batch's padded shape, and the caching allocator keeps what the largest batch reserved, so
the epoch's peak is the estimate at its worst batch shape. Only the shapes no other batch dominates (as many rows
and as long) can be the worst; each is estimated and the largest device peak wins. ``spec.training.seq_len`` is
the truncation length (the tokenizer's ``max_length``, or the packed row length); ``micro_batch_size`` the
DataLoader's batch size; ``parallel.dp`` the ranks the epoch is split over.

The reported per-rank peaks assume the worst batch lands on the rank with the most model state (ranks differ only
under ZeRO-1/2 and TP/FSDP padding): an upper bound of the worst rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from estimator.batching.batches import BatchShape, Epoch, check_options, form_epoch, sample_lengths
from estimator.spec import RunSpec

# Steps of the worst rank's epoch replayed in order through the allocator model (about 10 ms a step for a 3B
# model): the reserved level only grows between empty_cache() calls, so a longer epoch can only add to it.
REPLAY_STEPS = 500


@dataclass(frozen=True)
class EpochOptions:
    padding: str = "longest"            # batches.PADDINGS
    batching: str = "random"            # batches.ORDERS
    pad_to_multiple_of: int | None = None
    seed: int = 0
    empty_cache_steps: int | None = None  # the loop's torch.cuda.empty_cache() schedule (torch_empty_cache_steps)
    replay_steps: int = REPLAY_STEPS      # 0: the reserved level of the worst batch's shape repeated
    truncation: str = "cut"               # batches.TRUNCATIONS: samples past seq_len cut, or deleted

    def __post_init__(self) -> None:
        check_options(padding=self.padding, order=self.batching, pad_to_multiple_of=self.pad_to_multiple_of,
                      seed=self.seed, truncation=self.truncation)
        if self.empty_cache_steps is not None and self.empty_cache_steps < 1:
            raise ValueError(f"empty_cache_steps: must be >= 1, got {self.empty_cache_steps}")
        if self.replay_steps < 0:
            raise ValueError(f"replay_steps: must be >= 0, got {self.replay_steps}")


@dataclass
class EpochEstimate:
    estimate: Any                       # estimator.api.Estimate at the worst batch's shape
    worst: BatchShape
    summary: dict[str, Any] = field(default_factory=dict)


def epoch_for(spec: RunSpec, lengths: list[int], options: EpochOptions) -> Epoch:
    t = spec.training
    return form_epoch(lengths, seq_len=t.seq_len, micro_batch=t.micro_batch_size, dp=spec.parallel.dp,
                      padding=options.padding, order=options.batching, pad_to_multiple_of=options.pad_to_multiple_of,
                      seed=options.seed, grad_accum=t.grad_accum_steps, truncation=options.truncation)


def shape_spec(spec: RunSpec, batch: BatchShape) -> RunSpec:
    return spec.replace(**{"training.micro_batch_size": batch.rows, "training.seq_len": batch.padded_len,
                           "training.batch": batch_kind(batch)})


def batch_kind(batch: BatchShape) -> str:
    """``TrainingSpec.batch`` of one batch: "padded" when a row is shorter than the batch (an attention mask)."""
    return "padded" if batch.has_padding else "full"


def estimate_epoch(spec: RunSpec, lengths: list[int], options: EpochOptions = EpochOptions(),
                   coefficients: Any = None, *, allow_build: bool = True) -> EpochEstimate:
    """The estimate at the epoch's worst batch, which batch that is, and the padded-length summary."""
    from estimator.api import estimate

    epoch = epoch_for(spec, lengths, options)
    best = None
    for batch in epoch.worst_shapes():
        est = estimate(shape_spec(spec, batch), coefficients, allow_build=allow_build)
        if best is None or est.peak_device_bytes > best[0].peak_device_bytes:
            best = (est, batch)
    est, worst = best
    if options.replay_steps and est.reserved_source == "replayed":
        # The same shape's estimate, its reserved level replayed over the epoch's batches in their order
        est = estimate(shape_spec(spec, worst), coefficients, allow_build=allow_build,
                       sequence=step_sequence(epoch, worst, options))
    est.notes.extend(epoch_notes(worst, epoch, options))
    t = spec.training
    summary = summarize(epoch, worst, options, lengths, seq_len=t.seq_len, micro_batch=t.micro_batch_size,
                        dp=spec.parallel.dp)
    return EpochEstimate(estimate=est, worst=worst, summary=summary)


def step_sequence(epoch: Epoch, worst: BatchShape, options: EpochOptions):
    """The worst batch's rank's steps in order, at most ``options.replay_steps`` of them, the worst batch last
    when it comes later (its shape sets the allocated peak)."""
    from estimator.api import StepSequence

    steps = list(epoch.ranks[worst.rank][:options.replay_steps])
    if worst not in steps:
        steps[-1:] = [worst]
    return StepSequence(shapes=tuple((b.rows, b.padded_len) for b in steps),
                        empty_cache_every=options.empty_cache_steps)


def epoch_notes(worst: BatchShape, epoch: Epoch, options: EpochOptions = EpochOptions()) -> list[str]:
    rank_steps = len(epoch.ranks[worst.rank])
    if not options.replay_steps:
        held = ("the caching allocator keeps that batch's blocks for the rest of the epoch; the reserved level is "
                "that shape's repeated (no mix of batch shapes)")
    elif rank_steps > options.replay_steps:
        held = (f"the reserved level replays the first {options.replay_steps} of the rank's {rank_steps} steps in "
                "order through the allocator (the worst batch among them): the blocks of mixed shapes fragment the "
                "cache, and later steps can only add to it between empty_cache() calls")
    else:
        held = (f"the reserved level replays all {rank_steps} of the rank's steps in order through the allocator: "
                "the blocks of mixed shapes fragment the cache")
    notes = [f"epoch: peak at the worst batch (#{worst.index}: {worst.rows} x {worst.padded_len} tokens); {held}"]
    if worst.has_padding:
        notes.append("attention mask: the worst batch has padding, so transformers builds the 4-D attention mask "
                     "(with SDPA each layer keeps it and repeats grouped key/value heads); estimated as such "
                     "(--batch padded)")
    return notes


def percentile(sorted_values: list[int], q: float) -> int:
    """Nearest-rank percentile of an ascending list."""
    rank = max(1, -(-len(sorted_values) * q // 100))
    return sorted_values[int(rank) - 1]


def summarize(epoch: Epoch, worst: BatchShape, options: EpochOptions, lengths: list[int], *, seq_len: int,
              micro_batch: int, dp: int) -> dict[str, Any]:
    batches = epoch.batches
    padded = sorted(b.padded_len for b in batches)
    ordered = sorted(lengths)
    real = sum(b.real_tokens for b in batches)
    padded_tokens = sum(b.padded_tokens for b in batches)
    return {
        "padding": options.padding, "batching": options.batching, "pad_to_multiple_of": options.pad_to_multiple_of,
        "truncation": options.truncation,
        "seed": options.seed, "seq_len": seq_len, "micro_batch_size": micro_batch, "dp": dp,
        "lengths": {"samples": len(lengths), "p50": percentile(ordered, 50), "p90": percentile(ordered, 90),
                    "max": ordered[-1], "truncated": epoch.truncated},
        "batches": len(batches), "batches_per_rank": max(len(r) for r in epoch.ranks),
        "batches_with_padding": sum(b.has_padding for b in batches),
        "padded_len": {"p50": percentile(padded, 50), "p90": percentile(padded, 90), "max": padded[-1]},
        "real_tokens": real, "padded_tokens": padded_tokens, "padded_per_real": round(padded_tokens / real, 4),
        "worst_batch": {"index": worst.index, "rank": worst.rank, "step": worst.step, "rows": worst.rows,
                        "padded_len": worst.padded_len, "real_tokens": worst.real_tokens,
                        "has_padding": worst.has_padding},
        "rank_worst_padded_len": [max(b.padded_len for b in rank) for rank in epoch.ranks],
    }


def render_summary(summary: dict[str, Any]) -> str:
    s, w, n = summary, summary["worst_batch"], summary["lengths"]
    verb = "deleted (longer than" if s.get("truncation") == "delete" else "truncated at"
    cut = f"; {n['truncated']} {verb} {s['seq_len']}" + (")" if s.get("truncation") == "delete" else "") \
        if n["truncated"] else ""
    multiple = f", padded to a multiple of {s['pad_to_multiple_of']}" if s["pad_to_multiple_of"] else ""
    p = s["padded_len"]
    return "\n".join([
        f"epoch: {n['samples']} samples (length p50 {n['p50']}, p90 {n['p90']}, max {n['max']}{cut}) -> "
        f"{s['batches']} batches of {s['micro_batch_size']} over {s['dp']} rank(s), "
        + (f"packed into rows of {s['seq_len']}" if s["padding"] == "packed" else f"{s['padding']} padding")
        + f"{multiple}, {s['batching']} order (seed {s['seed']})",
        f"  padded length per batch: p50 {p['p50']}, p90 {p['p90']}, max {p['max']}; padded tokens / real tokens "
        f"{s['padded_per_real']:.3f}; {s['batches_with_padding']} batches with padding",
        f"  peak set by batch #{w['index']} (rank {w['rank']}, step {w['step']}): {w['rows']} x {w['padded_len']} "
        f"tokens padded, {w['real_tokens']} real" + (", with an attention mask" if w["has_padding"] else ""),
    ])


@dataclass(frozen=True)
class EpochShapes:
    """What the planner needs of one epoch at one micro-batch size."""

    worst: tuple[tuple[int, int, str], ...]  # (rows, padded length, TrainingSpec.batch) that can set the peak
    mean_padded_len: int                 # padded tokens per row, averaged over the epoch (for the step time)
    real_per_padded: float               # real tokens / padded tokens
    epoch: Epoch
    source: EpochSource

    @property
    def summary(self) -> dict[str, Any]:
        """The epoch summary, its worst batch being the longest (the plan does not estimate each shape here)."""
        e, o = self.epoch, self.source.options
        longest = max(e.worst_shapes(), key=lambda b: (b.padded_len, b.rows))
        return summarize(e, longest, o, self.source.lengths, seq_len=e.seq_len, micro_batch=e.micro_batch,
                         dp=len(e.ranks))


class EpochSource:
    """An epoch of ``lengths`` batched as ``options`` say, at any micro-batch size, data-parallel degree and
    truncation length (memoised: a plan asks for the same shapes many times)."""

    def __init__(self, lengths: list[int], options: EpochOptions = EpochOptions()) -> None:
        self.lengths, self.options = lengths, options
        self._memo: dict[tuple[int, int, int], EpochShapes] = {}

    def rows_per_rank(self, dp: int, seq_len: int) -> int:
        """Samples (packed: rows) each rank gets: no micro-batch can be larger."""
        o = self.options
        return -(-len(sample_lengths(self.lengths, seq_len, o.padding, o.truncation)[0]) // dp)

    def shapes(self, micro_batch: int, dp: int, seq_len: int) -> EpochShapes:
        key = (micro_batch, dp, seq_len)
        if key not in self._memo:
            o = self.options
            epoch = form_epoch(self.lengths, seq_len=seq_len, micro_batch=micro_batch, dp=dp, padding=o.padding,
                               order=o.batching, pad_to_multiple_of=o.pad_to_multiple_of, seed=o.seed,
                               truncation=o.truncation)
            batches = [b for rank in epoch.ranks for b in rank]
            rows = sum(b.rows for b in batches)
            padded = sum(b.padded_tokens for b in batches)
            self._memo[key] = EpochShapes(
                worst=tuple((b.rows, b.padded_len, batch_kind(b)) for b in epoch.worst_shapes()),
                mean_padded_len=max(1, round(padded / rows)),
                real_per_padded=sum(b.real_tokens for b in batches) / padded, epoch=epoch, source=self)
        return self._memo[key]
