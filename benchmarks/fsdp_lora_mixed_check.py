"""LoRA under FSDP2 mixed precision: the estimate of each rank against FSDPMemTracker on fake tensors.

    LLMEM_CACHE_DIR=$(mktemp -d) PYTHONPATH=. .venv/bin/python benchmarks/fsdp_lora_mixed_check.py \\
        [--quick] [--csv docs/error_matrix/fsdp_lora_mixed.csv]

FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (the estimator's ``--method fsdp
--precision mixed_bf16``) all-gathers every floating parameter in bf16, peft's fp32 adapters included
(``FSDPParam.init_dtype_attrs``), so peft's LoRA forward (``_cast_input_dtype(x, lora_A.weight.dtype)``) computes
the adapters in bf16 and makes no fp32 copy of their inputs: the estimate reads the profile traced with 16-bit
adapters (``estimator.models.profiles.adapters_in_16bit``, key suffix ``-a16``). Oracle:
``harness.fake.memtracker`` (``fully_shard`` per decoder layer and the root, peft's ``get_peft_model``, two steady
steps, CUDA's kernel choices), ranks first and last of 2 and 4. Estimate: ``traced_allocated_bytes`` (less the
cuBLAS workspace and the allocator's rounding, which no CPU oracle has); ``predicted_fp32_adapters_bytes``: the
same estimate from the fp32-adapter profile (the rule before). Models: the harness's small Llama and small OPT
(tied embeddings, biases); LoRA r8 on the attention projections and on all linear layers; with and without
checkpointing; two (b, s) points. Under checkpointing MemTracker's own module hooks keep one (b, s, hidden) fp32
tensor alive (the instrumented run's, not the real one's: ``tests/oracle/test_memtracker_oracle.py``, and
``benchmarks/context_parallel_table.py --lora`` subtracts the same): ``measured_bytes`` is the tracker's peak
(``tracked_bytes``) less ``hook_held_bytes`` = b x s x hidden x 4 (the checkpointed rows' excess over the
estimate is exactly that, whichever adapter profile). Exit 1 when a point is off by more than 1 %.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.table_csv import write_rows  # noqa: E402
from estimator.api import estimate  # noqa: E402
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec  # noqa: E402

PRECISION = "mixed_bf16"
MODELS = {"small-llama": "q_proj,k_proj,v_proj,o_proj", "small-opt": "q_proj,k_proj,v_proj,out_proj"}
TARGETS = ("attn", "all-linear")
WORLDS = (2, 4)
POINTS = ((1, 512), (2, 1024))


def _targets(model: str, label: str) -> str:
    return MODELS[model] if label == "attn" else label


def _spec(model: str, targets: str, world: int, b: int, s: int, ckpt: bool) -> RunSpec:
    training = TrainingSpec(micro_batch_size=b, seq_len=s, precision=PRECISION, grad_ckpt=ckpt,
                            lora_rank=8, lora_targets=targets)
    return RunSpec(model=str(ROOT / "harness" / "assets" / "models" / f"{model}.json"), training=training,
                   parallel=ParallelSpec(method="fsdp", world_size=world))


@contextlib.contextmanager
def _fp32_adapters():
    """The estimate as before: the fp32-adapter profile under FSDP2."""
    import estimator.api as api

    saved = api.adapters_in_16bit
    api.adapters_in_16bit = lambda training, method: False if method == "fsdp" else saved(training, method)
    api._STEP_MODELS.clear()
    try:
        yield
    finally:
        api.adapters_in_16bit = saved
        api._STEP_MODELS.clear()


def _ranks(spec: RunSpec) -> dict[int, int]:
    return {r.rank: r.traced_allocated_bytes for r in estimate(spec, replay_reserved=False).ranks}


def main() -> int:
    from harness.fake.memtracker import Variant, build, close, load_model_config, peak_bytes

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small-llama, attention targets, 2 ranks, one point")
    parser.add_argument("--csv")
    args = parser.parse_args()
    rows: list[dict] = []
    models = list(MODELS)[:1] if args.quick else list(MODELS)
    for model in models:
        config = load_model_config(model)
        for label in TARGETS[:1] if args.quick else TARGETS:
            targets = _targets(model, label)
            for ckpt in (False,) if args.quick else (False, True):
                for world in WORLDS[:1] if args.quick else WORLDS:
                    points = POINTS[:1] if args.quick else POINTS
                    predicted, before = {}, {}
                    for b, s in points:
                        spec = _spec(model, targets, world, b, s, ckpt)
                        predicted[b, s] = _ranks(spec)
                        with _fp32_adapters():
                            before[b, s] = _ranks(spec)
                    for rank in sorted({0, world - 1}):
                        started = time.perf_counter()
                        built = build(config, Variant(PRECISION, "sdpa", ckpt, "cuda", world, rank, lora_rank=8,
                                                      lora_targets=targets))
                        try:
                            for b, s in points:
                                tracked = peak_bytes(built, b, s)
                                held = b * s * config["hidden_size"] * 4 if ckpt else 0
                                measured = tracked - held
                                got, old = predicted[b, s][rank], before[b, s][rank]
                                row = {"model": model, "lora_targets": label, "world": world, "rank": rank,
                                       "grad_ckpt": ckpt, "micro_batch_size": b, "seq_len": s,
                                       "predicted_bytes": got, "predicted_fp32_adapters_bytes": old,
                                       "tracked_bytes": tracked, "hook_held_bytes": held,
                                       "measured_bytes": measured,
                                       "error_pct": round(100 * (got - measured) / measured, 4),
                                       "error_fp32_adapters_pct": round(100 * (old - measured) / measured, 4),
                                       "oracle_s": round(time.perf_counter() - started, 1)}
                                rows.append(row)
                                print(" ".join(str(v) for v in row.values()), flush=True)
                        finally:
                            close(built)
    errors = sorted(abs(r["error_pct"]) for r in rows)
    olds = sorted(abs(r["error_fp32_adapters_pct"]) for r in rows)
    if args.csv and rows:
        write_rows(Path(args.csv), rows)
    print(f"points {len(rows)}  median |error| {errors[len(errors) // 2]:.4f} %  max |error| {errors[-1]:.4f} %  "
          f"(fp32-adapter profile: max {olds[-1]:.4f} %)")
    return 0 if errors[-1] <= 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
