"""The training loop's convention (``TrainingSpec.loop``): what a manual loop keeps bound, derived from the trace."""

import json

import pytest

from estimator.columns import spec_columns, spec_from_columns
from estimator.spec import RunSpec, TrainingSpec


def test_loop_is_validated_and_defaults_to_trainer():
    assert TrainingSpec().loop == "trainer"
    with pytest.raises(ValueError, match="^loop: 'eager' is not one of trainer, manual"):
        TrainingSpec(loop="eager")


def test_loop_travels_as_a_column_and_older_tables_mean_trainer():
    spec = RunSpec(training=TrainingSpec(loop="manual"))
    row = {k: ("" if v is None else str(v)) for k, v in spec_columns(spec).items()}
    row["world_size"] = "1"
    assert spec_from_columns(row).training.loop == "manual"
    del row["loop"]  # written before the column existed: the harness ran the trainer loop
    assert spec_from_columns(row).training.loop == "trainer"
    row["loop"] = ""
    assert spec_from_columns(row).training.loop == "trainer"


torch = pytest.importorskip("torch")

from estimator.methods.timeline import replay  # noqa: E402
from estimator.profiler.carry import _raised_prefix, carry_over  # noqa: E402
from estimator.profiler.profile import build_profile  # noqa: E402

from .test_matches_trace import TINY  # noqa: E402


@pytest.fixture(scope="module")
def tiny_profile():
    return build_profile(TINY["llama"], TrainingSpec(precision="bf16"), check=False)


def test_output_object_is_found_in_the_trace(tiny_profile):
    """The logits (b * s * vocab bf16) are what the output object holds besides the loss; the graph keeps none."""
    for regime in tiny_profile["regimes"]:
        held = regime["outputs_held"]
        assert not any(held["saved"])
        b, s = (1, 64) if regime["b_max"] == 1 else (3, 64)
        dropped = held["dropped"]
        value = dropped[0] + s * (dropped[1] + dropped[2] * s) + b * (dropped[3] + s * (dropped[4] + dropped[5] * s))
        assert value == b * s * TINY["llama"]["vocab_size"] * 2
        assert regime["outputs_held_16bit"] == held  # bf16 logits: all of it is what accelerate copies to fp32


def test_a_new_profile_is_marked_with_today_s_summary_rule(tiny_profile):
    """Its summaries are what the loader's re-summary gives, so the marker lets the loader skip it."""
    from estimator.models.profiles import SUMMARY_RULE
    from estimator.profiler.vocab import with_hook_moments

    stored = json.loads(json.dumps(tiny_profile))
    assert stored["summary_rule"] == SUMMARY_RULE
    assert with_hook_moments(stored) == stored


def test_fp32_outputs_are_not_16bit():
    profile = build_profile(TINY["llama"], TrainingSpec(precision="fp32", attn="eager"), check=False)
    for regime in profile["regimes"]:
        assert any(regime["outputs_held"]["dropped"]) and not any(regime["outputs_held_16bit"]["dropped"])


@pytest.mark.parametrize(("b", "s", "layers"), [(1, 64, 2), (1, 300, 6), (2, 128, 3), (16, 2048, 32)])
def test_manual_loop_trace_equals_its_carry_over(tiny_profile, b, s, layers):
    """The manual step built from the event list (``manual_loop_events``) and the carry-over used for shipped
    profiles (the traced step with the prefix raised by the outputs) replay to the same peak and end state."""
    regime = tiny_profile["regimes"][0 if b == 1 else 1]
    exact = replay(regime["segments_manual"], layers, b, s)
    carried = replay(_raised_prefix(regime["segments"], regime["outputs_held"]["dropped"]), layers, b, s)
    trainer = replay(regime["segments"], layers, b, s)
    assert exact.peak_bytes == carried.peak_bytes > trainer.peak_bytes
    assert exact.end_act_bytes == carried.end_act_bytes


def test_stale_profile_is_carried_over_not_retraced(tiny_profile, monkeypatch):
    stale = json.loads(json.dumps(tiny_profile))
    stale["schema_version"] = 3
    for regime in stale["regimes"]:
        del regime["segments_manual"], regime["outputs_held"], regime["outputs_held_16bit"]
    monkeypatch.setattr("estimator.profiler.profile.build_profile",
                        lambda *a, **k: pytest.fail("carried over, not re-traced"))
    assert carry_over(stale, TINY["llama"])
    assert stale["schema_version"] == tiny_profile["schema_version"]
    for got, want in zip(stale["regimes"], tiny_profile["regimes"]):
        assert got["outputs_held"] == want["outputs_held"]
        assert got["outputs_held_16bit"] == want["outputs_held_16bit"]
        assert replay(got["segments_manual"], 8, 4, 256).peak_bytes == \
            replay(want["segments_manual"], 8, 4, 256).peak_bytes


def test_the_estimate_says_which_batch_it_assumed(tmp_path):
    """SDPA estimates name the batch (full length: no attention mask; padded: the mask path)."""
    from estimator.api import estimate

    path = tmp_path / "llama.json"
    path.write_text(json.dumps(TINY["llama"]))

    def said(**training):
        notes = estimate(RunSpec(model=str(path), training=TrainingSpec(seq_len=64, **training))).notes
        return [n for n in notes if n.startswith("batch:")]

    assert said()[0].startswith("batch: full")
    assert said(batch="padded")[0].startswith("batch: padded")
    assert said(attn="eager") == []


def test_which_cpu_traced_profiles_carry_over_to_cuda_kernels():
    """Schema 4 -> 5: a CPU-kernel trace is kept only where CUDA's kernels keep the same tensors."""
    from estimator.profiler.carry import cpu_trace_is_cuda_trace

    llama = TINY["llama"]
    assert cpu_trace_is_cuda_trace(llama, TrainingSpec(precision="bf16", attn="sdpa"))
    assert cpu_trace_is_cuda_trace(llama, TrainingSpec(precision="fp32", attn="eager"))
    assert not cpu_trace_is_cuda_trace(llama, TrainingSpec(precision="fp32", attn="sdpa"))  # efficient / math
    assert not cpu_trace_is_cuda_trace({**llama, "sliding_window": 64}, TrainingSpec(precision="bf16"))
    assert not cpu_trace_is_cuda_trace({**llama, "head_dim": 512}, TrainingSpec(precision="bf16"))
    assert not cpu_trace_is_cuda_trace({**llama, "attention_dropout": 0.1}, TrainingSpec(attn="eager"))
    assert not cpu_trace_is_cuda_trace({**llama, "text_config": {"hidden_dropout": 0.1}}, TrainingSpec())


def test_a_failed_depth_check_is_said():
    """Layers that are not all alike (Gemma-2's alternating attention: a 3-layer profile replayed at 4 layers is
    1.8 % under a 4-layer trace) make the profile's own depth check miss; the estimate says so."""
    from estimator.api import _depth_note

    assert _depth_note({"layer_check": {"rel_error": 0.0179}})[0].startswith("depth check:")
    assert "under a 4-layer trace by 1.8 %" in _depth_note({"layer_check": {"rel_error": 0.0179}})[0]
    assert _depth_note({"layer_check": {"rel_error": 0.0001}}) == []
    assert _depth_note({}) == []
