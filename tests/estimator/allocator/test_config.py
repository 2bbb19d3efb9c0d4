"""PYTORCH_CUDA_ALLOC_CONF parsing (c10/core/AllocatorConfig.cpp, c10/cuda/CUDAAllocatorConfig.cpp)."""

import pytest

from estimator.allocator.config import (
    LARGE_BUFFER_BYTES,
    UNLIMITED_BYTES,
    AllocatorConfig,
    config_from_snapshot_settings,
    parse_alloc_conf,
)

MIB = 1024 * 1024


def test_defaults_from_empty_or_missing_string():
    assert parse_alloc_conf(None) == parse_alloc_conf("") == AllocatorConfig()
    assert AllocatorConfig().max_split_size_bytes == UNLIMITED_BYTES
    assert AllocatorConfig().max_non_split_rounding_bytes == LARGE_BUFFER_BYTES


def test_keys_values_and_spaces():
    conf = parse_alloc_conf("backend:native, max_split_size_mb:128,garbage_collection_threshold:0.6,"
                            " expandable_segments:True,release_lock_on_cudamalloc:True")
    assert conf.max_split_size_bytes == 128 * MIB
    assert conf.garbage_collection_threshold == 0.6
    assert conf.expandable_segments is True
    assert ("release_lock_on_cudamalloc", "True") in conf.extra


@pytest.mark.parametrize("text, message", [
    ("foo:1", "unknown allocator option 'foo'"),
    ("max_split_size_mb:10", "too small"),
    ("max_split_size_mb:abc", "expects an integer"),
    ("garbage_collection_threshold:1.5", "(0.0, 1.0)"),
    ("roundup_power2_divisions:3", "power of 2"),
    ("roundup_power2_divisions:[3:2]", "powers of 2"),
    ("roundup_power2_divisions:[256:3]", "power of 2 or 0"),
    ("roundup_power2_divisions:[256:2", "not closed"),
    ("expandable_segments:yes", "True or False"),
    ("expandable_segments", "expected ':'"),
    ("max_split_size_mb:64;expandable_segments:True", "expects an integer"),
    ("backend:cudaMallocAsync", "not modelled"),
    ("backend:other", "unknown allocator backend"),
])
def test_errors_are_one_line_naming_the_problem(text, message):
    with pytest.raises(ValueError) as err:
        parse_alloc_conf(text)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_settings_recorded_in_a_snapshot():
    settings = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "max_split_size": -1,
                "garbage_collection_threshold": 0.0, "expandable_segments": True,
                "roundup_power2_divisions": {str(2 ** k): (4 if k == 3 else 0) for k in range(16)}}
    conf = config_from_snapshot_settings(settings)
    assert conf.expandable_segments and conf.max_split_size_bytes == UNLIMITED_BYTES
    assert conf.roundup_power2_divisions[3] == 4 and sum(conf.roundup_power2_divisions) == 4
    assert config_from_snapshot_settings(None) == AllocatorConfig()
    assert config_from_snapshot_settings({"max_split_size": 64 * MIB}).max_split_size_bytes == 64 * MIB
