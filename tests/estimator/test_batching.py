"""Variable-length batches: lengths files, padding, ordering, the per-rank split and the epoch's peak."""

from __future__ import annotations

import json

import pytest

from estimator.api import estimate
from estimator.batching import (
    BatchShape,
    Epoch,
    EpochOptions,
    estimate_epoch,
    form_epoch,
    parse_lengths,
    read_lengths,
)
from estimator.batching.batches import grouped_order
from estimator.batching.epoch import epoch_for, percentile, render_summary, shape_spec, step_sequence
from estimator.io.cli import main
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec

MODEL = "facebook/opt-125m"


def shapes(epoch, rank=0):
    return [(b.rows, b.padded_len) for b in epoch.ranks[rank]]


# --- lengths files -----------------------------------------------------------------------------------------------
def test_one_length_per_line_with_comments():
    assert parse_lengths("# lengths\n12\n\n7  # short\n300\n") == [12, 7, 300]


def test_histogram_is_expanded_and_zero_counts_skipped():
    assert parse_lengths("# length count\n10 3\n20 0\n5 2\n") == [10, 10, 10, 5, 5]


@pytest.mark.parametrize("text, message", [
    ("12\n7 3\n", "line 2: 2 field(s) in a file of one length per line"),
    ("10 3\n7\n", "line 2: 1 field(s) in a file of 'length count' histogram"),
    ("12\nabc\n", "line 2: token length 'abc' is not an integer"),
    ("# c\n0\n", "line 2: token length must be >= 1, got 0"),
    ("10 -1\n", "line 1: count must be >= 0, got -1"),
    ("1 2 3\n", "line 1: expected 'LENGTH' or 'LENGTH COUNT'"),
    ("# only comments\n\n", "holds no lengths"),
])
def test_bad_lengths_are_one_line_errors_naming_file_and_line(text, message):
    with pytest.raises(ValueError) as err:
        parse_lengths(text, "data.txt")
    assert str(err.value).startswith("lengths: data.txt") and message in str(err.value)
    assert "\n" not in str(err.value)


def test_read_lengths_from_a_file(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("3 2\n9 1\n")
    assert read_lengths(path) == [3, 3, 9]
    with pytest.raises(ValueError, match="lengths: no such file"):
        read_lengths(tmp_path / "missing.txt")


# --- padding -----------------------------------------------------------------------------------------------------
def test_longest_pads_each_batch_to_its_longest_truncated_sample():
    epoch = form_epoch([5, 3, 9, 9, 2, 2], seq_len=8, micro_batch=2, order="sorted")
    # sorted descending, truncated at 8: [8, 8], [5, 3], [2, 2]
    assert shapes(epoch) == [(2, 8), (2, 5), (2, 2)]
    assert [b.has_padding for b in epoch.ranks[0]] == [False, True, False]
    assert [b.real_tokens for b in epoch.ranks[0]] == [16, 8, 4] and epoch.truncated == 2


def test_max_length_pads_every_batch_to_seq_len():
    epoch = form_epoch([5, 3, 8, 2], seq_len=8, micro_batch=2, padding="max_length", order="sorted")
    assert shapes(epoch) == [(2, 8), (2, 8)]
    assert [b.has_padding for b in epoch.ranks[0]] == [True, True]


def test_packed_rows_are_seq_len_tokens_without_padding():
    # 5 + 3 + 9 + 2 = 19 tokens, untruncated -> rows of 8, 8 and a last row of 3
    epoch = form_epoch([5, 3, 9, 2], seq_len=8, micro_batch=2, padding="packed", order="sorted")
    assert shapes(epoch) == [(2, 8), (1, 3)]
    assert not any(b.has_padding for b in epoch.ranks[0]) and epoch.truncated == 0
    assert sum(b.real_tokens for b in epoch.ranks[0]) == 19


def test_delete_drops_the_samples_past_seq_len_instead_of_cutting_them():
    # ms-swift's truncation_strategy 'delete': the epoch keeps the short samples, of every length, and no batch of
    # seq_len tokens unless a sample is exactly that long
    epoch = form_epoch([5, 3, 9, 9, 2, 2], seq_len=8, micro_batch=2, order="sorted", truncation="delete")
    assert shapes(epoch) == [(2, 5), (2, 2)] and epoch.truncated == 2
    assert shapes(form_epoch([5, 3, 9, 9, 2, 2], seq_len=8, micro_batch=2, order="sorted")) == [(2, 8), (2, 5),
                                                                                               (2, 2)]
    with pytest.raises(ValueError, match="truncation delete keeps none"):
        form_epoch([9, 9], seq_len=8, micro_batch=1, truncation="delete")


def test_deleting_long_samples_replays_batches_of_many_lengths():
    # most samples past the cap: cut, the epoch is the cap's shape repeated; deleted, it is every kept length, whose
    # blocks of distinct sizes the cache holds side by side (a higher reserved level for the same allocated peak)
    lengths = list(range(16, 257, 16)) + [400] * 40
    cut = estimate_epoch(spec(mb=1, seq_len=256), lengths, EpochOptions(seed=1))
    deleted = estimate_epoch(spec(mb=1, seq_len=256), lengths, EpochOptions(seed=1, truncation="delete"))
    assert cut.summary["lengths"]["truncated"] == deleted.summary["lengths"]["truncated"] == 40
    assert deleted.summary["batches"] == 16 and cut.summary["batches"] == 56
    assert deleted.summary["padded_len"]["p50"] == 128 and cut.summary["padded_len"]["p50"] == 256
    assert deleted.worst.padded_len == cut.worst.padded_len == 256
    assert "16 deleted (longer than 256)" not in render_summary(cut.summary)
    assert "40 deleted (longer than 256)" in render_summary(deleted.summary)


def test_pad_to_multiple_of_rounds_up_like_the_collator():
    epoch = form_epoch([13, 3], seq_len=20, micro_batch=2, pad_to_multiple_of=8)
    assert shapes(epoch) == [(2, 16)]
    # max_length rounds seq_len itself, past the truncation length (tokenizer.pad does the same)
    epoch = form_epoch([1000], seq_len=1000, micro_batch=1, padding="max_length", pad_to_multiple_of=64)
    assert shapes(epoch) == [(1, 1024)] and epoch.ranks[0][0].has_padding


# --- ordering ----------------------------------------------------------------------------------------------------
LENGTHS = [5, 1, 9, 3, 7, 2, 8, 4]


def test_grouped_order_sorts_megabatches_and_puts_the_longest_first():
    # megabatches of 2 x 2: indices [0,1,2,3] (5,1,9,3) -> [2,0,3,1]; [4,5,6,7] (7,2,8,4) -> [6,4,7,5]
    assert grouped_order(LENGTHS, 2, list(range(8)), mega_batch_mult=2) == [2, 0, 3, 1, 6, 4, 7, 5]
    # the longest sample (9, index 2) sits in the second megabatch: swapped with the first one's head (8, index 6)
    assert grouped_order(LENGTHS, 2, [4, 5, 6, 7, 0, 1, 2, 3], mega_batch_mult=2) == [2, 4, 7, 5, 6, 0, 3, 1]


def test_grouped_order_default_megabatch_is_50_groups_or_a_quarter_of_the_data():
    lengths = list(range(1, 1001))                     # index i has length i + 1
    out = grouped_order(lengths, 4, list(range(1000)))
    # 1000 // (4 * 4) = 62 -> capped at 50 groups of 4: megabatches of 200, each sorted descending; the epoch's
    # longest (index 999, head of the last megabatch) swapped with the first megabatch's head (index 199)
    assert out[:3] == [999, 198, 197] and out[199:201] == [0, 399] and out[800:802] == [199, 998]
    assert sorted(out) == list(range(1000))
    # 8 samples in groups of 2: 8 // 8 = 1 group per megabatch; pairs sorted, the 9 (index 2) moved to the front
    assert grouped_order(LENGTHS, 2, list(range(8))) == [2, 1, 0, 3, 4, 5, 6, 7]


def test_grouped_order_matches_transformers():
    torch = pytest.importorskip("torch")
    trainer_pt_utils = pytest.importorskip("transformers.trainer_pt_utils")
    import random

    rng = random.Random(3)
    lengths = [rng.randint(1, 500) for _ in range(997)]
    for batch_size, seed in ((4, 0), (8, 1), (16, 2)):
        theirs = trainer_pt_utils.get_length_grouped_indices(lengths, batch_size,
                                                               generator=torch.Generator().manual_seed(seed))
        permutation = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
        assert grouped_order(lengths, batch_size, permutation) == theirs


def test_grouping_cuts_padding_but_not_the_longest_batch():
    import random

    rng = random.Random(0)
    lengths = [rng.choice((20, 30, 40, 400)) for _ in range(400)]
    random_epoch = form_epoch(lengths, seq_len=512, micro_batch=8, order="random", seed=1)
    grouped_epoch = form_epoch(lengths, seq_len=512, micro_batch=8, order="grouped", seed=1)

    def ratio(epoch):
        return sum(b.padded_tokens for b in epoch.batches) / sum(b.real_tokens for b in epoch.batches)
    assert ratio(grouped_epoch) < 0.5 * ratio(random_epoch)
    assert max(b.padded_len for b in random_epoch.batches) == max(b.padded_len for b in grouped_epoch.batches) == 400
    assert grouped_epoch.batches[0].padded_len == 400           # the longest sample first (OOM early)


def test_random_order_depends_on_the_seed_only():
    a = form_epoch(LENGTHS, seq_len=16, micro_batch=2, seed=4)
    assert a == form_epoch(LENGTHS, seq_len=16, micro_batch=2, seed=4)
    assert any(form_epoch(LENGTHS, seq_len=16, micro_batch=2, seed=s) != a for s in range(5, 10))


# --- per-rank split ---------------------------------------------------------------------------------------------
def test_distributed_sampler_split_wraps_and_deals_samples():
    import random

    lengths = [10, 20, 30, 40, 50]
    epoch = form_epoch(lengths, seq_len=64, micro_batch=2, dp=2, seed=7)
    order = list(range(5))
    random.Random(7).shuffle(order)
    padded = order + order[:1]                   # 6 = 3 per rank: the first sample again
    for rank in (0, 1):
        mine = [lengths[i] for i in padded[rank::2]]
        assert [b.real_tokens for b in epoch.ranks[rank]] == [sum(mine[:2]), mine[2]]
        assert [b.rows for b in epoch.ranks[rank]] == [2, 1]
    assert [b.index for b in epoch.ranks[1]] == [1, 3]           # step k of rank r is batch k * dp + r


def test_sorted_and_grouped_deal_batches_round_robin_with_even_batches():
    # sorted [5,4,3,2,1], 2 per batch, 2 ranks: 2 rounds need 8 samples -> [5,4,3,2,1,5,4,3] from the start
    epoch = form_epoch([1, 2, 3, 4, 5], seq_len=8, micro_batch=2, dp=2, order="sorted")
    assert shapes(epoch, 0) == [(2, 5), (2, 5)] and [b.real_tokens for b in epoch.ranks[0]] == [9, 6]
    assert shapes(epoch, 1) == [(2, 3), (2, 4)] and [b.real_tokens for b in epoch.ranks[1]] == [5, 7]
    assert [b.index for b in epoch.ranks[1]] == [1, 3]


def test_worst_shapes_keep_only_undominated_batches():
    epoch = form_epoch([4, 4, 3, 3, 9], seq_len=16, micro_batch=2, order="sorted")
    assert shapes(epoch) == [(2, 9), (2, 4), (1, 3)]
    assert [(b.rows, b.padded_len) for b in epoch.worst_shapes()] == [(2, 9)]
    # a partial batch holding a longer sample than any full batch: both shapes can set the peak
    batches = tuple(BatchShape(i, 0, i, rows, length, rows * length, False)
                    for i, (rows, length) in enumerate([(2, 9), (2, 4), (1, 12), (1, 3), (2, 9)]))
    epoch = Epoch(ranks=(batches,), samples=8, truncated=0, seq_len=16, micro_batch=2)
    assert [(b.index, b.rows, b.padded_len) for b in epoch.worst_shapes()] == [(0, 2, 9), (2, 1, 12)]


@pytest.mark.parametrize("kwargs, message", [
    ({"padding": "pad"}, "padding: 'pad' is not one of"), ({"order": "magic"}, "batching: 'magic'"),
    ({"pad_to_multiple_of": 0}, "pad_to_multiple_of: must be a positive integer"),
    ({"dp": 0}, "dp: must be a positive integer"), ({"truncation": "left"}, "truncation: 'left' is not one of"),
])
def test_bad_options_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        form_epoch([1, 2], seq_len=8, micro_batch=1, **kwargs)


def test_percentile_is_nearest_rank():
    assert [percentile([1, 2, 3, 4, 10], q) for q in (50, 90, 100)] == [3, 10, 10]


# --- the epoch's peak --------------------------------------------------------------------------------------------
def spec(mb=4, seq_len=256, method="single", gpus=1) -> RunSpec:
    return RunSpec(model=MODEL, training=TrainingSpec(micro_batch_size=mb, seq_len=seq_len),
                   parallel=ParallelSpec(method=method, world_size=gpus))


def test_the_epoch_peak_is_the_estimate_at_the_worst_batch():
    lengths = [40] * 30 + [200, 1500]
    result = estimate_epoch(spec(seq_len=1024), lengths, EpochOptions(batching="grouped"))
    worst = result.worst
    assert (worst.rows, worst.padded_len, worst.has_padding) == (4, 1024, True)   # 1500 truncated at 1024
    direct = estimate(shape_spec(spec(), worst))
    assert result.estimate.traced_allocated_bytes == direct.traced_allocated_bytes
    # the reserved level, and the allocator's block rounding in the allocated one: the rank's batches replayed in
    # order through the allocator (blocks cached by earlier shapes), the worst shape among them
    sequence = step_sequence(epoch_for(spec(seq_len=1024), lengths, EpochOptions(batching="grouped")), worst,
                             EpochOptions())
    assert len(sequence.shapes) == 8 and sequence.shapes[0] == (4, 1024) and (4, 40) in sequence.shapes
    in_order = estimate(shape_spec(spec(), worst), sequence=sequence)
    assert result.estimate.peak_device_bytes == in_order.peak_device_bytes
    assert result.estimate.peak_allocated_bytes == in_order.peak_allocated_bytes
    assert "replays all 8 of the rank's steps" in " ".join(result.estimate.notes)
    alone = estimate_epoch(spec(seq_len=1024), lengths, EpochOptions(batching="grouped", replay_steps=0))
    assert alone.estimate.peak_device_bytes == direct.peak_device_bytes
    # activations follow the longest batch: more than the typical 4 x 40 batch holds
    assert result.estimate.peak_allocated_bytes > estimate(spec(seq_len=40)).peak_allocated_bytes
    summary = result.summary
    assert summary["worst_batch"]["padded_len"] == 1024 and summary["padded_len"]["max"] == 1024
    assert summary["padded_len"]["p50"] == 40 and summary["lengths"]["truncated"] == 1
    assert summary["real_tokens"] == 30 * 40 + 200 + 1024
    assert any(n.startswith("attention mask:") for n in result.estimate.notes)


def test_the_replayed_steps_are_capped_and_keep_the_worst_batch():
    lengths = [40] * 60 + [300]
    options = EpochOptions(batching="random", seed=0, replay_steps=5, empty_cache_steps=2)
    epoch = epoch_for(spec(seq_len=256), lengths, options)
    worst = max(epoch.ranks[0], key=lambda b: b.padded_len)
    assert worst.step >= 5  # a later batch: it replaces the fifth
    sequence = step_sequence(epoch, worst, options)
    assert sequence.shapes[-1] == (worst.rows, 256) and len(sequence.shapes) == 5
    assert sequence.empty_cache_every == 2
    result = estimate_epoch(spec(seq_len=256), lengths, options)
    assert "replays the first 5 of the rank's 16 steps" in " ".join(result.estimate.notes)
    assert "empty_cache() every 2" in " ".join(result.estimate.notes)


def test_packed_epochs_have_no_mask_note_and_full_rows():
    result = estimate_epoch(spec(), [100] * 50, EpochOptions(padding="packed"))
    assert (result.worst.rows, result.worst.padded_len, result.worst.has_padding) == (4, 256, False)
    assert not any(n.startswith("attention mask:") for n in result.estimate.notes)
    assert result.summary["padded_per_real"] < 1.05


def test_each_rank_gets_its_own_batches():
    lengths = [10] * 63 + [200]
    result = estimate_epoch(spec(mb=2, method="ddp", gpus=4), lengths, EpochOptions(batching="sorted"))
    summary = result.summary
    assert summary["dp"] == 4 and summary["batches"] == 32 and summary["batches_per_rank"] == 8
    assert sorted(summary["rank_worst_padded_len"]) == [10, 10, 10, 200]
    assert summary["worst_batch"]["rank"] == 0 and summary["worst_batch"]["index"] == 0


# --- CLI ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def lengths_file(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("# length count\n40 30\n200 1\n500 1\n")
    return str(path)


def test_cli_text_names_the_batch_that_sets_the_peak(capsys, lengths_file):
    assert main(["--model", MODEL, "--micro-batch-size", "4", "--seq-len", "256", "--lengths", lengths_file,
                 "--batching", "grouped", "--pad-to-multiple-of", "8"]) == 0
    out = capsys.readouterr().out
    assert "peak set by batch #0 (rank 0, step 0): 4 x 256 tokens padded" in out
    assert "grouped order" in out and "padded to a multiple of 8" in out and "micro-batch 4, seq 256" in out


def test_cli_json_has_an_epoch_object(capsys, lengths_file):
    assert main(["--model", MODEL, "--method", "ddp", "--gpus", "2", "--micro-batch-size", "2", "--seq-len", "128",
                 "--lengths", lengths_file, "--padding", "packed", "--seed", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    epoch = data["epoch"]
    assert epoch["padding"] == "packed" and epoch["seed"] == 3 and epoch["dp"] == 2
    assert epoch["worst_batch"]["padded_len"] == 128 and epoch["worst_batch"]["has_padding"] is False
    assert data["spec"]["training"]["seq_len"] == 128


def test_cli_compare_prints_each_split_once(capsys, lengths_file):
    # checkpointing: the shipped TP profile (no torch build in a unit test)
    assert main(["--model", MODEL, "--gpus", "2", "--seq-len", "256", "--grad-ckpt", "--lengths", lengths_file]) == 0
    out = capsys.readouterr().out
    assert out.count("over 1 rank(s)") == 1 and out.count("over 2 rank(s)") == 1


@pytest.mark.parametrize("extra, message", [
    (["--padding", "packed"], "error: padding: needs --lengths FILE"),
    (["--lengths", "/no/such/file"], "error: lengths: no such file '/no/such/file'"),
    (["--lengths", "BAD"], "line 2: token length 'x' is not an integer"),
    (["--lengths", "GOOD", "--pad-to-multiple-of", "0"], "error: pad_to_multiple_of: must be a positive integer"),
    (["--lengths", "GOOD", "--empty-cache-steps", "0"], "error: empty_cache_steps: must be >= 1, got 0"),
    (["--lengths", "GOOD", "--replay-steps", "-1"], "error: replay_steps: must be >= 0, got -1"),
    (["--empty-cache-steps", "10"], "error: empty_cache_steps: needs --lengths FILE"),
    (["--truncation", "delete"], "error: truncation: needs --lengths FILE"),
    (["--lengths", "GOOD", "--seq-len", "4", "--truncation", "delete"],
     "error: lengths: every sample is longer than seq_len 4 (truncation delete keeps none)"),
])
def test_cli_errors_are_one_line_exit_2(capsys, tmp_path, extra, message):
    (tmp_path / "bad.txt").write_text("5\nx\n")
    (tmp_path / "good.txt").write_text("5\n")
    extra = [str(tmp_path / "bad.txt") if a == "BAD" else str(tmp_path / "good.txt") if a == "GOOD" else a
             for a in extra]
    assert main(["--model", MODEL, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
