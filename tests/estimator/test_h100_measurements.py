"""The estimator against real GPU measurements on one NVIDIA H100 (torch 2.11, transformers 5.24, session 19,
data/measurements/h100-80gb/): mixture-of-experts at full width, LoRA, autocast over 16-bit weights, LLMem's
Table 2 protocol, FSDP1, the small core, and allocator snapshots. Profiles for every measured spec ship, so nothing
is traced here."""

import pathlib
import statistics

import pandas as pd

from calibrate.terms import rank_estimates
from estimator.hardware.residuals import load_coefficients

MEASUREMENTS = pathlib.Path(__file__).resolve().parents[2] / "data" / "measurements" / "h100-80gb"


def scored(table: str) -> list[tuple[pd.Series, object]]:
    rows = pd.read_csv(MEASUREMENTS / f"{table}.csv")
    rows = rows[rows["run_status"] == "ok"]
    results = rank_estimates(rows, load_coefficients("h100-80gb"), allow_build=False)
    assert not [r for r in results if isinstance(r, str)], [r for r in results if isinstance(r, str)][:3]
    return [(row, rank) for (_, row), (_, rank) in zip(rows.iterrows(), results)]


def pct(predicted: int, measured: int) -> float:
    return 100.0 * (predicted - measured) / measured


def allocated_errors(table: str) -> list[float]:
    return [abs(pct(rank.peak_allocated_bytes, row["peak_allocated_bytes"])) for row, rank in scored(table)]


def test_every_table_at_the_allocated_level():
    """224 rank rows: MoE, LoRA r16 on 0.5-8B bases, autocast over bf16 weights, LLMem's Table 2 protocol (16 GB
    cap, fp16, eager, checkpointing), FSDP1 in every sharding strategy, the small core, snapshot runs (ZeRO-1/2/3
    included)."""
    tables = ["gpu_moe", "gpu_lora", "gpu_single", "paper_table2", "gpu_emulated", "gpu_snapshots"]
    errors = {table: allocated_errors(table) for table in tables}
    assert sum(len(e) for e in errors.values()) >= 220
    for table, table_errors in errors.items():
        assert max(table_errors) < 0.5, table
        assert statistics.median(table_errors) < 0.05, table


def test_mixture_of_experts_at_full_width_on_cuda_kernels():
    """Five MoE families' first layers at full width (harness/assets/models): experts through CUDA's grouped_mm
    path, a dense first layer (DeepSeek-V2-Lite), shared experts, pure bf16, FSDP2 ranks."""
    results = scored("gpu_moe")
    families = {pathlib.Path(row["model"]).stem.rsplit("-", 1)[0] for row, _ in results}
    assert families == {"qwen3-30b-a3b", "olmoe-1b-7b", "deepseek-v2-lite", "qwen1.5-moe-a2.7b", "mixtral-8x7b"}
    assert {row["method"] for row, _ in results} == {"single", "fsdp"}
    for row, rank in results:
        assert abs(pct(rank.peak_allocated_bytes, row["peak_allocated_bytes"])) < 0.5, row["run_id"]
        assert rank.reserved_source == "replayed", row["run_id"]
    reserved = [abs(pct(rank.peak_reserved_bytes, row["peak_reserved_bytes"])) for row, rank in results]
    assert statistics.median(reserved) < 0.1


def test_single_gpu_reserved_level_where_the_replay_runs():
    results = [(row, rank) for table in ("gpu_single", "gpu_lora", "paper_table2") for row, rank in scored(table)]
    reserved = [abs(pct(rank.peak_reserved_bytes, row["peak_reserved_bytes"])) for row, rank in results
                if rank.reserved_source == "replayed"]
    assert len(reserved) >= 160
    assert statistics.median(reserved) < 0.1 and sorted(reserved)[int(0.9 * len(reserved))] < 3.0


def test_codegen_takes_sdpa_with_the_model_code_that_ran():
    """transformers 5.24 gave CodeGen SDPA (5.17 and 5.23 fell back to eager): the H100 ran SDPA, and the shipped
    profiles, re-traced with 5.24, follow it (before: +25 to +218 % at the allocated level)."""
    codegen = [(row, rank) for row, rank in scored("gpu_single") if "codegen" in row["model"]]
    assert len(codegen) >= 10 and {row["effective_attn"] for row, _ in codegen} == {"sdpa"}
    assert max(abs(pct(rank.peak_allocated_bytes, row["peak_allocated_bytes"])) for row, rank in codegen) < 0.2


def test_fsdp1_reserved_level_in_every_sharding_strategy():
    """FSDP1 ranks (Llama-3.2-1B FULL_SHARD / SHARD_GRAD_OP / NO_SHARD / HYBRID_SHARD, SantaCoder FULL_SHARD), the
    replay with the flat gradients on the unshard stream (where ``use_orig_params``' views put them; on the
    default stream the replay was 5-10 % under) and NO_SHARD's whole-gradient reduction. The first rank to a few
    tenths of a percent; a last rank once took one 502 MiB segment more than in a second run of the same
    configuration (12.68 vs 12.16 GB: when a ``record_stream`` free completes), so it gets the spread of the two
    outcomes."""
    results = [(row, rank) for table in ("gpu_emulated", "gpu_snapshots") for row, rank in scored(table)
               if row["method"] == "fsdp1"]
    assert {row["fsdp1_sharding_strategy"] for row, _ in results} == {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD",
                                                                       "HYBRID_SHARD"}
    assert len(results) >= 24
    for row, rank in results:
        assert rank.reserved_source == "replayed", row["run_id"]
        error = pct(rank.peak_reserved_bytes, row["peak_reserved_bytes"])
        assert abs(error) < (0.6 if row["rank"] == 0 else 4.5), (row["run_id"], row["rank"], error)
