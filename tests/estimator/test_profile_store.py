"""The profile store (estimator.models.profiles): pure JSON, memoized reads."""

from __future__ import annotations

from estimator.models.profiles import PROFILE_SCHEMA_VERSION, find_profile, save_profile


def test_a_saved_profile_replaces_the_memoized_older_copy(tmp_path, monkeypatch):
    """An older cached profile read once (memoized by path) must not hide the one saved over it: a carried-over
    or re-traced profile is found by the next lookup in the same process."""
    monkeypatch.setenv("LLMEM_CACHE_DIR", str(tmp_path))
    key = "0123456789abcdef_bf16_sdpa_nockpt_full"
    save_profile(key, {"schema_version": PROFILE_SCHEMA_VERSION - 1, "regimes": []})
    assert find_profile(key) is None and find_profile(key, stale=True) is not None
    save_profile(key, {"schema_version": PROFILE_SCHEMA_VERSION, "regimes": []})
    assert find_profile(key) == {"schema_version": PROFILE_SCHEMA_VERSION, "regimes": []}


def test_the_estimate_names_the_model_code_it_describes():
    from estimator.models.profiles import versions_note

    profile = {"provenance": {"transformers": "5.23.0", "torch": "2.13.0+cpu"}}
    assert versions_note(profile, "5.24.1") == "model code: traced with transformers 5.23.0, torch 2.13.0+cpu"
    for other in ("4.48.3", "5.22.0", "6.0.0"):  # older, or another major release: warned
        assert f"transformers {other} here is another release" in versions_note(profile, other)
    assert "does not record" in versions_note({"provenance": {}})
    from estimator import estimate
    from estimator.spec import RunSpec

    notes = estimate(RunSpec(model="facebook/opt-125m")).notes
    assert any(n.startswith("model code: traced with transformers ") for n in notes)
