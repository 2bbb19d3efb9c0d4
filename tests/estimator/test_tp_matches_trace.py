"""Tensor-parallel estimates (TP profiles) vs the CPU oracle's full-depth trace of the same TP run, every rank.

Tiny configs of catalogue families (``tests/oracle/tiny.py``: hidden 64, 4 heads, vocab 1000) with 5 layers, so
the 3-layer profile is replayed for a deeper model. The oracle (``harness.fake.trace_run``) runs two steps on a
fake process group with storages unrounded (``round_to=1``, as the profile records them); the estimate's
allocated peak without the cuBLAS workspace must be within 1 % on every traced rank.
"""

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from estimator.api import estimate  # noqa: E402
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec  # noqa: E402
from tests.oracle.tiny import tiny_config  # noqa: E402

LAYERS = 5


def _compare(tmp_path, family: str, tp: int, training: TrainingSpec, method: str = "tp", world: int | None = None):
    import torch.distributed as dist

    from harness.fake import trace_run

    config = tiny_config(family, num_layers=LAYERS)
    path = tmp_path / f"{family}.json"
    path.write_text(json.dumps(config))
    spec = RunSpec(model=str(path), parallel=ParallelSpec(method=method, world_size=world or tp, tp=tp),
                   training=training)
    est = estimate(spec)
    assert not dist.is_initialized()  # the profiler's fake process group is gone
    traced = trace_run(spec, config=config, round_to=1)["per_rank"]
    ranks = {r.rank: r for r in est.ranks}
    assert set(traced) == set(ranks)
    for rank, record in traced.items():
        predicted = ranks[rank].traced_allocated_bytes
        reference = record["peak_allocated_bytes"]
        assert abs(predicted - reference) / reference < 0.01, (family, rank, predicted, reference)
    return est


@pytest.mark.parametrize(("family", "tp", "training"), [
    ("opt", 2, TrainingSpec(precision="fp32", micro_batch_size=3, seq_len=96, attn="eager")),
    ("llama", 2, TrainingSpec(precision="mixed_bf16", micro_batch_size=1, seq_len=64, grad_ckpt=True)),
    ("bloom", 4, TrainingSpec(precision="bf16", micro_batch_size=2, seq_len=80, attn="eager", grad_ckpt=True)),
])
def test_tp_allocated_peak_within_1_percent(tmp_path, family, tp, training):
    est = _compare(tmp_path, family, tp, training)
    from estimator.profiler.build import build_model

    meta = build_model(tiny_config(family, num_layers=LAYERS), training, meta=True)
    assert est.params == sum(p.numel() for p in meta.parameters())  # global counts from the local shards


def test_tp_two_optimizers_split_the_step(tmp_path):
    """At the optimizer step each optimizer (DTensor params, then plain ones) has its own foreach temporaries."""
    from estimator.methods import state as methods
    from estimator.models.params import expand_params
    from estimator.profiler.cache import load_model_profile

    config = tiny_config("opt", num_layers=LAYERS)  # the profile of the first opt case above (cached)
    path = tmp_path / "opt.json"
    path.write_text(json.dumps(config))
    training = TrainingSpec(precision="fp32", micro_batch_size=1, seq_len=32, attn="eager")
    arch, profile = load_model_profile(str(path), training, tp=2)
    assert profile["tp"] == 2
    table = expand_params(profile["params"], arch.num_layers)
    groups = {p.opt_group for p in table}
    assert groups == {0, 1}
    spec = RunSpec(model=str(path), parallel=ParallelSpec(method="tp", world_size=2, tp=2), training=training)
    step = methods.single(spec, table)
    per_group = [methods.step_temp_bytes([p for p in table if p.opt_group == g], "adamw", False) for g in (0, 1)]
    assert step.step_temp == max(per_group) < methods.step_temp_bytes(table, "adamw", False)


def test_tp_refusals_are_one_line_field_errors():
    for model, tp, words in (("bigcode/gpt_bigcode-santacoder", 2, "multi_query"),
                             ("facebook/opt-125m", 8, "does not divide")):
        spec = RunSpec(model=model, parallel=ParallelSpec(method="tp", world_size=tp, tp=tp))
        with pytest.raises(ValueError, match=f"^tp: .*{words}"):
            estimate(spec, allow_build=False)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "method", "tp", "world"), [
    ("gpt_neox", "tp", 4, 4), ("codegen", "tp", 2, 2), ("qwen2", "tp", 2, 2), ("biogpt", "tp", 4, 4),
    ("gpt_neo", "tp", 2, 2), ("opt", "tp", 4, 4), ("llama", "tp", 2, 2), ("mistral", "tp", 2, 2),
])
@pytest.mark.parametrize("training", [
    TrainingSpec(precision="fp32", micro_batch_size=4, seq_len=128, attn="sdpa"),
    TrainingSpec(precision="mixed_bf16", micro_batch_size=1, seq_len=48, attn="eager", grad_ckpt=True),
])
def test_slow_tp_every_family(tmp_path, family, method, tp, world, training):
    _compare(tmp_path, family, tp, training, method=method, world=world)
