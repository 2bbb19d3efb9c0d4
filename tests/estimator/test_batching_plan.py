"""The planner with sample lengths, against test_plan's fake estimator (memory linear in micro-batch x length)."""

from __future__ import annotations

import json

from estimator.batching.epoch import EpochOptions, EpochSource
from estimator.io.plan_cli import run_plan
from tests.estimator.test_plan import MODEL, _cli_args, fake_model, make_fake, run  # noqa: F401 (fixture)


def _no_cp(plan) -> list:
    """A fixed-length plan's results without its context-parallel layouts (an epoch's plan weighs none)."""
    return [r for r in plan.results if r.candidate.cp == 1]


def test_memory_is_searched_at_each_micro_batchs_worst_batch():
    # the 10 longest samples (256 tokens) open the sorted epoch: every micro-batch's worst batch is mb x 256
    lengths = [256] * 10 + [64] * 3990
    calls: list = []
    with_lengths = run(estimate_fn=make_fake(calls=calls), seq_len=1024,
                       epoch=EpochSource(lengths, EpochOptions(batching="sorted")))
    assert {spec.training.seq_len for spec in calls} == {256}
    assert all(spec.training.micro_batch_size <= -(-4000 // spec.parallel.dp) for spec in calls)
    fixed = run(seq_len=256)
    assert [r.max_micro_batch for r in with_lengths.results] == [r.max_micro_batch for r in _no_cp(fixed)]


def test_packed_rows_cap_the_micro_batch_at_a_ranks_share():
    # 3000 tokens packed into rows of 1024: 3 rows, so no rank ever runs a micro-batch of more than 3 (1 GPU)
    result = run(gpus=1, seq_len=1024, epoch=EpochSource([1000] * 3, EpochOptions(padding="packed")))
    assert result.best.max_micro_batch == 3 and result.epoch["worst_batch"]["rows"] == 3


def test_no_padding_gives_the_fixed_length_plan():
    lengths = [512] * 2000
    with_lengths = run(seq_len=512, epoch=EpochSource(lengths, EpochOptions(padding="max_length")))
    fixed = run(seq_len=512)
    for a, b in zip(with_lengths.results, _no_cp(fixed), strict=True):
        assert (a.max_micro_batch, a.micro_batch, a.peak_bytes) == (b.max_micro_batch, b.micro_batch, b.peak_bytes)
        assert a.tokens_per_s == b.tokens_per_s
    assert with_lengths.epoch["padded_per_real"] == 1.0
    assert any(n.startswith("lengths:") for n in with_lengths.notes)


def test_tokens_per_second_counts_real_tokens():
    lengths = [32] * 1900 + [512] * 100
    padded = run(seq_len=512, epoch=EpochSource(lengths, EpochOptions(padding="max_length")))
    fixed = run(seq_len=512)
    # every batch is 512 long and costs what it costs at a fixed 512; only the real tokens count as work
    real_fraction = sum(lengths) / (512 * len(lengths))
    best = padded.best
    twin = next(r for r in fixed.results if r.candidate == best.candidate)
    assert abs(best.tokens_per_s - twin.tokens_per_s * real_fraction) < 1e-6 * twin.tokens_per_s


def test_plan_cli_with_lengths(monkeypatch, capsys, tmp_path):
    from estimator.planning import plan as P
    from tests.estimator.test_plan import GPU

    real = P.plan
    monkeypatch.setattr(P, "plan", lambda model, **kw: real(model, estimate_fn=make_fake(), gpu_info=GPU, **kw))
    path = tmp_path / "lengths.txt"
    path.write_text("100 500\n400 20\n")
    args = ["--model", MODEL, "--gpus", "2", "--gpu", "x", "--lengths", str(path), "--batching", "grouped"]
    assert run_plan(_cli_args(args + ["--json"])) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["epoch"]["batching"] == "grouped" and data["epoch"]["padded_len"]["max"] == 400
    assert run_plan(_cli_args(args)) == 0
    assert "Recommendation's epoch: 520 samples" in capsys.readouterr().out
    assert run_plan(_cli_args(["--model", MODEL, "--gpus", "2", "--gpu", "x", "--padding", "packed"])) == 2
    assert capsys.readouterr().err.startswith("error: padding: needs --lengths FILE")
