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
