"""GPU catalogue, device-name normalisation and the residual coefficient files (estimator.hardware.gpus, .residuals)."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from estimator.hardware import gpus, residuals
from estimator.hardware.gpus import GENERIC, get_gpu, list_gpus, normalize_gpu_name

MIB = 1 << 20
GIB = 1 << 30
KEYS = ["h100-80gb", "h200-141gb", "a100-40gb", "a100-80gb", "v100-16gb", "v100-32gb", "l40s-48gb", "a10-24gb",
        "l4-24gb", "rtx4090-24gb", "rtx3090-24gb", "t4-16gb"]


def test_catalogue_keys_and_capacities():
    assert [g.key for g in list_gpus()] == KEYS
    assert GENERIC in [g.key for g in list_gpus(include_generic=True)]
    expected_mib = {"h100-80gb": 81_559, "h200-141gb": 143_771, "a100-40gb": 40_960, "a100-80gb": 81_920,
                    "v100-16gb": 16_384, "v100-32gb": 32_768, "l40s-48gb": 46_068, "a10-24gb": 23_028,
                    "l4-24gb": 23_034, "rtx4090-24gb": 24_564, "rtx3090-24gb": 24_576,
                    "t4-16gb": 15_360}
    for key, mib in expected_mib.items():
        spec = get_gpu(key)
        assert spec.capacity_bytes == mib * MIB and spec.capacity_mib == mib
        assert spec.capacity_source
        if spec.torch_total_bytes is not None:  # what a process gets never exceeds the board total
            assert spec.torch_total_bytes <= spec.capacity_bytes


def test_catalogue_entries_are_complete():
    arches = {"volta", "turing", "ampere", "ada", "hopper"}
    for spec in list_gpus():
        assert spec.architecture in arches
        major, minor = spec.compute_capability.split(".")
        assert int(major) >= 7 and minor.isdigit()
        assert set(spec.peak_tflops) == {"fp32", "tf32", "bf16", "fp16"}
        assert spec.peak_tflops["fp32"] > 0 and spec.peak_tflops["fp16"] > spec.peak_tflops["fp32"]
        assert spec.interconnect in ("nvlink", "pcie")
        assert spec.memory_bandwidth_bytes_per_s > 1e11
        assert spec.interconnect_bandwidth_bytes_per_s > 0 and spec.host_bandwidth_bytes_per_s > 0
        assert spec.supports_bf16 == (spec.architecture not in ("volta", "turing"))
    assert get_gpu("h100-80gb").peak_tflops["bf16"] == 989.5
    assert get_gpu("h100-80gb").interconnect_bandwidth_bytes_per_s == 450e9   # 900 GB/s bidirectional


@pytest.mark.parametrize("name, key", [
    ("H100", "h100-80gb"), ("h100", "h100-80gb"), ("H100-SXM-80GB", "h100-80gb"), ("h100_sxm5", "h100-80gb"),
    ("NVIDIA H100 80GB HBM3", "h100-80gb"), ("h200", "h200-141gb"), ("A100 40GB", "a100-40gb"),
    ("a100-sxm4-80gb", "a100-80gb"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("Tesla V100-SXM2-16GB", "v100-16gb"),
    ("v100s", "v100-32gb"), ("L40S", "l40s-48gb"), ("A10G", "a10-24gb"), ("l4", "l4-24gb"),
    ("RTX 4090", "rtx4090-24gb"), ("NVIDIA GeForce RTX 4090", "rtx4090-24gb"), ("T4", "t4-16gb"),
    ("RTX 3090", "rtx3090-24gb"), ("rtx3090", "rtx3090-24gb"),
    ("generic", "generic"),
])
def test_get_gpu_aliases(name, key):
    assert get_gpu(name).key == key


def test_get_gpu_errors():
    with pytest.raises(ValueError, match=r"^gpu: 'a100' is ambiguous; use one of a100-40gb, a100-80gb$"):
        get_gpu("a100")
    with pytest.raises(ValueError, match="ambiguous.*v100-16gb, v100-32gb"):
        get_gpu("V100")
    with pytest.raises(ValueError, match="ambiguous"):
        get_gpu("NVIDIA A100-PCIE")       # a full name without its capacity is no better
    with pytest.raises(ValueError, match=r"^gpu: unknown GPU 'h10' \(did you mean h100-80gb.*\); known: h100-80gb, "):
        get_gpu("h10")
    with pytest.raises(ValueError, match=r"^gpu: unknown GPU 'mi300x'; known: "):
        get_gpu("mi300x")
    with pytest.raises(ValueError, match="^gpu: must be"):
        get_gpu("  ")


@pytest.mark.parametrize("device, total_gib, key", [
    ("NVIDIA H100 80GB HBM3", 79.2, "h100-80gb"),
    ("NVIDIA H100 PCIe", 79.6, "h100-80gb"),
    ("NVIDIA H100 NVL", 93.6, GENERIC),                 # 94 GB board: not the catalogue's H100
    ("NVIDIA H200", 139.8, "h200-141gb"),
    ("NVIDIA H200 NVL", 139.8, "h200-141gb"),
    ("NVIDIA GH200 480GB", 94.5, GENERIC),
    ("NVIDIA A100-SXM4-40GB", 39.6, "a100-40gb"),
    ("NVIDIA A100-SXM4-80GB", 80.0, "a100-80gb"),
    ("NVIDIA A100 80GB PCIe", 79.2, "a100-80gb"),
    ("NVIDIA A100-SXM4-80GB MIG 1g.10gb", 9.5, GENERIC),
    ("Tesla V100-SXM2-16GB", 15.78, "v100-16gb"),      # old drivers: 16,160 MiB
    ("Tesla V100-SXM2-32GB", 31.7, "v100-32gb"),
    ("Tesla V100S-PCIE-32GB", 31.7, "v100-32gb"),
    ("NVIDIA L40S", 44.5, "l40s-48gb"),
    ("NVIDIA L40", 44.5, GENERIC),
    ("NVIDIA A10", 22.1, "a10-24gb"),
    ("NVIDIA A10G", 22.0, "a10-24gb"),
    ("NVIDIA L4", 22.0, "l4-24gb"),
    ("NVIDIA GeForce RTX 4090", 23.99, "rtx4090-24gb"),
    ("NVIDIA GeForce RTX 4090 D", 23.99, "rtx4090-24gb"),
    ("NVIDIA GeForce RTX 3090", 23.7, "rtx3090-24gb"),
    ("NVIDIA GeForce RTX 3090 Ti", 23.7, GENERIC),     # another board
    ("Tesla T4", 14.58, "t4-16gb"),
    ("NVIDIA T400", 1.8, GENERIC),
    ("AMD Instinct MI300X", 191.5, GENERIC),
    ("", 0, GENERIC),
])
def test_normalize_gpu_name(device, total_gib, key):
    assert normalize_gpu_name(device, int(total_gib * GIB)) == key


def test_normalize_without_memory_uses_the_name():
    assert normalize_gpu_name("NVIDIA A100-PCIE-40GB", 0) == "a100-40gb"
    assert normalize_gpu_name("Tesla V100-PCIE-16GB", None) == "v100-16gb"
    assert normalize_gpu_name("NVIDIA A100-SXM4", 0) == "a100-80gb"     # family default: the first board
    assert normalize_gpu_name("Tesla T4", 0) == "t4-16gb"


def test_normalize_memory_decides_within_a_family():
    # the name says A100, the memory says 40 GB: the measured memory wins
    assert normalize_gpu_name("NVIDIA A100", 40_536 * MIB) == "a100-40gb"
    assert normalize_gpu_name("NVIDIA A100", 81_920 * MIB) == "a100-80gb"
    assert gpus.CAPACITY_TOLERANCE == 0.10


# --- residual coefficients ------------------------------------------------------------------------------------
# Fitted to this project's own GPU runs (python -m calibrate fit --gpu KEY; data/measurements/KEY/).
FITTED = {"h100-80gb", "h200-141gb"}


def test_every_gpu_has_prior_or_fitted_coefficients():
    for spec in list_gpus(include_generic=True):
        coeffs = residuals.load_coefficients(spec.key)
        fitted = spec.key in FITTED
        assert coeffs.gpu_key == spec.key and coeffs.calibrated is fitted
        assert coeffs.source == ("fit" if fitted else "prior")
        assert set(coeffs.notes) >= set(residuals.REQUIRED_TERMS)      # every term documented
        assert coeffs.cublas_workspaces == 2
        hopper = spec.architecture == "hopper" or spec.key == GENERIC
        assert coeffs.cublas_workspace_bytes == (33_554_432 if hopper else 8_519_680)  # torch's own sizes
        assert 300 * MIB <= coeffs.cuda_context_bytes <= 1024 * MIB
        assert coeffs.nccl_bytes_per_communicator >= 544 * 1000 * 1000   # NCCL #964's smallest figure
        assert coeffs.upper_bound_ratio >= 1


def test_load_coefficients_by_alias_and_cache():
    assert residuals.load_coefficients("H100") is residuals.load_coefficients("h100-80gb")
    with pytest.raises(ValueError, match="^gpu: unknown GPU"):
        residuals.load_coefficients("tpu-v5")


def _prior(**terms):
    data = json.loads((resources.files("estimator") / "coefficients" / "a100-80gb.json").read_text())
    data["terms"].update(terms)
    return data


def test_user_file_overrides(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**_prior(cuda_context_bytes=123 * MIB, fitted_intercept=7), "calibrated": True}))
    coeffs = residuals.load_coefficients("h100-80gb", path=path)
    assert coeffs.cuda_context_bytes == 123 * MIB and coeffs.calibrated is True
    assert coeffs.extra_terms == {"fitted_intercept": 7} and coeffs.path == str(path)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(schema_version=2), r"'schema_version' is 2; this build reads 1"),
    (lambda d: d["terms"].pop("nccl_bytes_per_communicator"), r"'terms.nccl_bytes_per_communicator' is missing"),
    (lambda d: d["terms"].update(cuda_context_bytes=-1), r"'terms.cuda_context_bytes' must be >= 0"),
    (lambda d: d["terms"].update(cublas_workspaces=1.5), r"'terms.cublas_workspaces' must be a whole number"),
    (lambda d: d["terms"].update(reserved_slack_ratio="big"), r"'terms.reserved_slack_ratio' must be a number"),
    (lambda d: d["terms"].update(upper_bound_ratio=0.9), r"'terms.upper_bound_ratio' must be >= 1"),
    (lambda d: d.update(calibrated="no"), r"'calibrated' must be a bool"),
    (lambda d: d.update(terms=[]), r"'terms' must be an object"),
])
def test_bad_coefficient_files(tmp_path, mutate, message):
    data = _prior()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"^coefficients: {path}: {message}") as err:
        residuals.load_coefficients("a100-80gb", path=path)
    assert "\n" not in str(err.value)


def test_unreadable_coefficient_files(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        residuals.load_coefficients("a100-80gb", path=broken)
    with pytest.raises(ValueError, match="cannot read"):
        residuals.load_coefficients("a100-80gb", path=tmp_path / "missing.json")


def test_residual_arithmetic():
    coeffs = residuals.parse_coefficients(_prior(
        cuda_context_bytes=500 * MIB, cublas_workspace_bytes=32 * MIB, cublas_workspaces=2,
        reserved_slack_ratio=0.25, reserved_slack_bytes=64 * MIB, nccl_bytes_per_communicator=600 * MIB,
        upper_bound_ratio=1.2), "test")
    assert residuals.cublas_workspace_bytes(coeffs) == 64 * MIB
    assert residuals.reserved_from_allocated(1000 * MIB, coeffs) == 1250 * MIB + 64 * MIB
    assert residuals.reserved_from_allocated(3, coeffs) == 4 + 64 * MIB          # rounded up, never down
    assert residuals.device_from_reserved(2000 * MIB, coeffs, 0) == 2500 * MIB
    assert residuals.device_from_reserved(2000 * MIB, coeffs, 2) == 3700 * MIB
    assert residuals.upper_bound_bytes(1000 * MIB, coeffs) == 1200 * MIB
    with pytest.raises(ValueError, match="^num_communicators:"):
        residuals.device_from_reserved(0, coeffs, -1)
    with pytest.raises(ValueError, match="^allocated_bytes:"):
        residuals.reserved_from_allocated(-1, coeffs)
