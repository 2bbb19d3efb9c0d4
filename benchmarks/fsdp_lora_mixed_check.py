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

``--method dp_tp --csv docs/error_matrix/dp_tp_lora_mixed.csv``: the same for dp_tp, which is FSDP2 with the same
policy over the dp dimension of a (dp, tp) mesh, at (world, tp) = (4, 2) and (8, 4). MemTracker has no tensor
parallelism, so the oracle there is the harness's fake-tensor trace (``harness.fake.trace_run``; its counter equals
FSDPMemTracker byte for byte on FSDP2, tests/oracle, and it adds no hooks, so ``hook_held_bytes`` is 0).
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
DP_TP_LAYOUTS = ((4, 2), (8, 4))  # (world, tp)
POINTS = ((1, 512), (2, 1024))


def _targets(model: str, label: str) -> str:
    return MODELS[model] if label == "attn" else label


def _spec(model: str, targets: str, world: int, b: int, s: int, ckpt: bool, method: str = "fsdp",
          tp: int = 1) -> RunSpec:
    training = TrainingSpec(micro_batch_size=b, seq_len=s, precision=PRECISION, grad_ckpt=ckpt,
                            lora_rank=8, lora_targets=targets)
    return RunSpec(model=str(ROOT / "harness" / "assets" / "models" / f"{model}.json"), training=training,
                   parallel=ParallelSpec(method=method, world_size=world, tp=tp))


@contextlib.contextmanager
def _fp32_adapters():
    """The estimate as before: the fp32-adapter profile under FSDP2 (fsdp, dp_tp)."""
    import estimator.api as api

    saved = api.adapters_in_16bit
    api.adapters_in_16bit = lambda training, method, *wrap: (False if method in ("fsdp", "dp_tp")
                                                             else saved(training, method, *wrap))
    api._STEP_MODELS.clear()
    try:
        yield
    finally:
        api.adapters_in_16bit = saved
        api._STEP_MODELS.clear()


def _ranks(spec: RunSpec) -> dict[int, int]:
    return {r.rank: r.traced_allocated_bytes for r in estimate(spec, replay_reserved=False).ranks}


def _grid(quick: bool, layouts: tuple) -> list[tuple]:
    """(model, targets label, checkpointing, layout) to measure; --quick: the first of each."""
    models = list(MODELS)[:1] if quick else list(MODELS)
    return [(model, label, ckpt, layout) for model in models for label in (TARGETS[:1] if quick else TARGETS)
            for ckpt in ((False,) if quick else (False, True)) for layout in (layouts[:1] if quick else layouts)]


def _row(case: dict, rank: int, ckpt: bool, b: int, s: int, got: int, old: int, tracked: int, held: int,
         started: float) -> dict:
    measured = tracked - held
    row = {**case, "rank": rank, "grad_ckpt": ckpt, "micro_batch_size": b, "seq_len": s, "predicted_bytes": got,
           "predicted_fp32_adapters_bytes": old, "tracked_bytes": tracked, "hook_held_bytes": held,
           "measured_bytes": measured, "error_pct": round(100 * (got - measured) / measured, 4),
           "error_fp32_adapters_pct": round(100 * (old - measured) / measured, 4),
           "oracle_s": round(time.perf_counter() - started, 1)}
    print(" ".join(str(v) for v in row.values()), flush=True)
    return row


def _estimates(spec: RunSpec) -> tuple[dict[int, int], dict[int, int]]:
    """Each rank's estimate with the 16-bit-adapter rule, and with the fp32-adapter profile."""
    got = _ranks(spec)
    with _fp32_adapters():
        return got, _ranks(spec)


def _fsdp_rows(quick: bool) -> list[dict]:
    from harness.fake.memtracker import Variant, build, close, load_model_config, peak_bytes

    rows: list[dict] = []
    for model, label, ckpt, world in _grid(quick, WORLDS):
        config = load_model_config(model)
        points = POINTS[:1] if quick else POINTS
        estimates = {(b, s): _estimates(_spec(model, _targets(model, label), world, b, s, ckpt)) for b, s in points}
        case = {"model": model, "lora_targets": label, "world": world}
        for rank in sorted({0, world - 1}):
            started = time.perf_counter()
            built = build(config, Variant(PRECISION, "sdpa", ckpt, "cuda", world, rank, lora_rank=8,
                                          lora_targets=_targets(model, label)))
            try:
                for b, s in points:
                    held = b * s * config["hidden_size"] * 4 if ckpt else 0
                    got, old = estimates[b, s]
                    rows.append(_row(case, rank, ckpt, b, s, got[rank], old[rank], peak_bytes(built, b, s), held,
                                     started))
            finally:
                close(built)
    return rows


def _dp_tp_rows(quick: bool) -> list[dict]:
    from harness.fake.trace import trace_run

    rows: list[dict] = []
    for model, label, ckpt, (world, tp) in _grid(quick, DP_TP_LAYOUTS):
        case = {"model": model, "lora_targets": label, "world": world, "tp": tp}
        for b, s in POINTS[:1] if quick else POINTS:
            spec = _spec(model, _targets(model, label), world, b, s, ckpt, "dp_tp", tp)
            got, old = _estimates(spec)
            started = time.perf_counter()
            for rank, record in sorted(trace_run(spec, ranks=(0, world - 1))["per_rank"].items()):
                rows.append(_row(case, rank, ckpt, b, s, got[rank], old[rank], record["peak_allocated_bytes"], 0,
                                 started))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small-llama, attention targets, one layout and point")
    parser.add_argument("--method", choices=("fsdp", "dp_tp"), default="fsdp")
    parser.add_argument("--csv")
    args = parser.parse_args()
    rows = _dp_tp_rows(args.quick) if args.method == "dp_tp" else _fsdp_rows(args.quick)
    errors = sorted(abs(r["error_pct"]) for r in rows)
    olds = sorted(abs(r["error_fp32_adapters_pct"]) for r in rows)
    if args.csv and rows:
        write_rows(Path(args.csv), rows)
    print(f"points {len(rows)}  median |error| {errors[len(errors) // 2]:.4f} %  max |error| {errors[-1]:.4f} %  "
          f"(fp32-adapter profile: max {olds[-1]:.4f} %)")
    return 0 if errors[-1] <= 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
