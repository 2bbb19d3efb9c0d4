"""The long-context techniques (issue 18) against the project's two CPU oracles; writes an error table.

    .venv/bin/python benchmarks/long_context_check.py [--quick]
        [--oracles memtracker fsdp2-memtracker fsdp2-every-k fsdp1-every-k counted-cpu] [--techniques LABEL ...]
        [--precisions P ...] [--models M ...] [--lora-rank R [--lora-targets T]] [--csv FILE]

The committed tables: ``--oracles memtracker --csv docs/error_matrix/long_context_memtracker.csv``,
``--oracles fsdp2-memtracker --csv docs/error_matrix/long_context_fsdp2.csv``, ``--oracles fsdp2-every-k --csv
docs/error_matrix/long_context_fsdp2_every_k.csv``, ``--oracles fsdp1-every-k --csv
docs/error_matrix/long_context_fsdp1_every_k.csv``, ``--oracles counted-cpu --csv
docs/error_matrix/long_context_counted_cpu.csv`` (``LLMEM_CACHE_DIR`` set to a fresh directory traces the
variants' profiles first). Exit 1 when a point is off by more than 1 %. ``--lora-rank`` runs every point with peft's
adapters (the LoRA tables: ``long_context_lora_*.csv``, commands in docs/error_matrix/README.md).

Techniques: torchtune's chunked cross-entropy (``--ce chunked --ce-chunks 8``), Liger's fused linear
cross-entropy (``--ce fused_linear``: a pure-torch re-implementation of its CUDA path's allocations, since Liger
needs Triton), activation offload (``save_on_cpu``), every-k checkpointing (k 2, 3), torchtitan's op SAC
(``selective-ops``), and two combinations. Allocated peak of ``python -m estimator`` (``traced_allocated_bytes``:
less the cuBLAS workspace and the allocator's rounding, which no CPU oracle has) against:

* ``memtracker``: torch's ``MemTracker`` over a full-depth fake-tensor run of the real transformers model
  (``harness.fake.memtracker``: its own model build, loop and techniques, ``harness.fake.long_context``), two
  steady steps, CUDA's kernel choices;
* ``fsdp2-memtracker``: FSDP2 over 2 ranks (``FSDPMemTracker``, fake process group), ranks 0 and 1, of the small
  configs (every-k has its own oracle below);
* ``fsdp2-every-k``: every-k checkpointing (k 2, 3) under FSDP2, the same oracle over 2 and 4 ranks (the first and
  the last rank), two (b, s) points, bf16 and mixed_bf16 (FSDP2's MixedPrecisionPolicy), the small configs;
* ``fsdp1-every-k``: the same points under FSDP1 FULL_SHARD (its defaults: BACKWARD_PRE, no forward prefetch;
  ``use_orig_params=False``, MixedPrecision for mixed_bf16), FSDPMemTracker on the fake process group;
* ``counted-cpu``: the same program on real CPU tensors in a spawned interpreter, every live storage summed after
  every operator (``harness.fake.live_storage``); tiny configs, since it computes for real.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from estimator.api import estimate  # noqa: E402
from estimator.spec import Fsdp1Spec, ParallelSpec, RunSpec, TrainingSpec  # noqa: E402

PRECISIONS = ("bf16", "fp32")  # fp32 for Liger's fused loss only (its fp32 weight-gradient fallback)
# (label, TrainingSpec fields): each technique alone, then two combinations a long-context run uses.
TECHNIQUES = (
    ("chunked8", {"ce": "chunked", "ce_chunks": 8}),
    ("fused_linear", {"ce": "fused_linear"}),
    ("offload", {"activation_offload": True}),
    ("every-k:2", {"grad_ckpt": True, "ckpt_policy": "every-k:2"}),
    ("every-k:3", {"grad_ckpt": True, "ckpt_policy": "every-k:3"}),
    ("selective-ops", {"grad_ckpt": True, "ckpt_policy": "selective-ops"}),
    ("chunked8+every-k:2", {"ce": "chunked", "ce_chunks": 8, "grad_ckpt": True, "ckpt_policy": "every-k:2"}),
    ("fused+offload", {"ce": "fused_linear", "activation_offload": True}),
)
# MemTracker on fake tensors: catalogue models of two families (Llama: untied RMSNorm decoder with grouped heads in
# SmolLM2's tied variant; OPT: learned positions, LayerNorm, biases, tied head), (b, s) where activations dominate.
# (model, points, precisions): SmolLM2's 30 layers and 49k vocabulary take minutes per MemTracker run on 2 cores,
# so it gets one point.
FAKE_RUNS = (("facebook/opt-125m", ((1, 2048), (4, 512)), PRECISIONS),
             ("HuggingFaceTB/SmolLM2-135M", ((1, 2048),), PRECISIONS[:1]))
# Real CPU runs (bf16; fp32 too for Liger's fp32 fallback): small configs of the same two families (harness/assets/models), eager attention (the CPU has no
# flash or memory-efficient SDPA kernel; eager attention allocates alike on both).
REAL_MODELS = ("small-llama", "small-opt")
REAL_POINTS = ((2, 512), (4, 1024))
FSDP_WORLD = 2  # FSDP2 on torch's fake process group (oracle "fsdp2-memtracker"): the small configs, mixed_bf16
# every-k under FSDP2 (oracle "fsdp2-every-k"): worlds, (b, s) points, precisions
EVERY_K_WORLDS = (2, 4)
EVERY_K_POINTS = ((2, 512), (4, 1024))
EVERY_K_PRECISIONS = ("bf16", "mixed_bf16")


def _config(name: str) -> dict:
    from harness.fake.memtracker import load_model_config

    return load_model_config(name)


# LoRA (``--lora-rank``, ``--lora-targets``): TrainingSpec fields every point adds (empty: full fine-tuning); the
# oracles apply the same adapters with peft's own ``get_peft_model`` (``harness.fake.memtracker.Variant``).
LORA: dict = {}


def _training(**fields) -> TrainingSpec:
    return TrainingSpec(**fields, **LORA)


def _variant(training: TrainingSpec, kernels: str = "cuda"):
    from harness.fake.memtracker import Variant

    return Variant(training.precision, training.attn, training.grad_ckpt, kernels, ce=training.ce,
                   ce_chunks=training.ce_chunks, activation_offload=training.activation_offload,
                   ckpt_policy=training.ckpt_policy, lora_rank=training.lora_rank,
                   lora_targets=training.lora_targets)


def _memtracker_peak(config: dict, training: TrainingSpec, world: int = 1, rank: int = 0, fsdp1: bool = False
                     ) -> int:
    """``world`` > 1: FSDP2 (FSDPMemTracker on torch's fake process group), this rank; ``fsdp1``: FSDP1
    FULL_SHARD instead (``use_orig_params=False``, as the harness wraps it)."""
    import dataclasses

    from harness.fake import memtracker as mt

    built = mt.build(config, dataclasses.replace(_variant(training), fsdp_world=world, rank=rank,
                                                 fsdp1="FULL_SHARD" if fsdp1 else None))
    try:
        return mt.peak_bytes(built, training.micro_batch_size, training.seq_len)
    finally:
        mt.close(built)


def _counted_peak(config: dict, fields: dict) -> int:
    """In a spawned interpreter: real CPU tensors, every live storage counted."""
    from harness.fake import live_storage
    from harness.fake import memtracker as mt

    training = TrainingSpec(**fields)
    built = mt.build(config, _variant(training, "cpu"), fake=False)
    return live_storage.peak_bytes(built, training.micro_batch_size, training.seq_len)


def _row(oracle: str, model: str, label: str, training: TrainingSpec, predicted: int, measured: int,
         seconds: float) -> dict:
    if training.lora:
        label = f"{label} lora{training.lora_rank}:{training.lora_targets}"
    return {"oracle": oracle, "model": model, "technique": label, "precision": training.precision,
            "micro_batch_size": training.micro_batch_size, "seq_len": training.seq_len,
            "predicted_bytes": predicted, "measured_bytes": measured,
            "error_pct": round(100 * (predicted - measured) / measured, 4), "oracle_s": round(seconds, 1)}


def every_k_fsdp2_predicted(config_path: str, label: str, precision: str, b: int, s: int, world: int, rank: int,
                            fsdp1: bool = False) -> int:
    """The estimate of one ``fsdp2-every-k`` (``fsdp1``: ``fsdp1-every-k``) row (``tests/estimator/
    test_long_context.py`` re-estimates the committed tables with it)."""
    fields = dict(TECHNIQUES)[label]
    training = _training(micro_batch_size=b, seq_len=s, precision=precision, **fields)
    parallel = ParallelSpec(method="fsdp1", world_size=world, fsdp1=Fsdp1Spec(use_orig_params=False)) if fsdp1 \
        else ParallelSpec(method="fsdp", world_size=world)
    spec = RunSpec(model=config_path, training=training, parallel=parallel)
    return {r.rank: r for r in estimate(spec).ranks}[rank].traced_allocated_bytes


def _every_k_fsdp2_rows(techniques, quick: bool, fsdp1: bool = False):
    """Every-k checkpointing under FSDP2 (``fsdp1``: FSDP1 FULL_SHARD): each (model, k, precision, point, world),
    the first and the last rank."""
    oracle = "fsdp1-every-k" if fsdp1 else "fsdp2-every-k"
    every_k = [label for label, fields in techniques if fields.get("ckpt_policy", "").startswith("every-k")
               and len(fields) == 2]  # alone, not combined with another technique
    for model in REAL_MODELS:
        config = _config(model)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"{model}.json"
            path.write_text(json.dumps(config))
            for label in every_k:
                for precision in EVERY_K_PRECISIONS:
                    for b, s in EVERY_K_POINTS[:1] if quick else EVERY_K_POINTS:
                        for world in EVERY_K_WORLDS:
                            training = _training(micro_batch_size=b, seq_len=s, precision=precision,
                                                 **dict(TECHNIQUES)[label])
                            for rank in (0, world - 1):
                                predicted = every_k_fsdp2_predicted(str(path), label, precision, b, s, world, rank,
                                                                    fsdp1)
                                started = time.perf_counter()
                                measured = _memtracker_peak(config, training, world, rank, fsdp1)
                                row = _row(oracle, model, label, training, predicted, measured,
                                           time.perf_counter() - started)
                                yield {**row, "technique": f"{label} rank {rank}/{world}"}


def _precisions(args, defaults: tuple[str, ...], label: str) -> tuple[str, ...]:
    """``--precisions``, else the first default (all of them for Liger's fused loss, whose fp32 path differs)."""
    if args.precisions:
        return tuple(args.precisions)
    return defaults if label == "fused_linear" else defaults[:1]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="one point per model and oracle")
    parser.add_argument("--oracles", nargs="*",
                        default=["memtracker", "fsdp2-memtracker", "fsdp2-every-k", "fsdp1-every-k", "counted-cpu"])
    parser.add_argument("--techniques", nargs="*", help="labels of TECHNIQUES (default: all)")
    parser.add_argument("--precisions", nargs="*", help="in place of bf16 (and fp32 for the fused loss)")
    parser.add_argument("--models", nargs="*", help="of FAKE_RUNS / REAL_MODELS (default: all)")
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    parser.add_argument("--lora-targets", default="auto", help="auto | all-linear | comma-separated module names")
    parser.add_argument("--csv")
    args = parser.parse_args()
    if args.lora_rank:
        LORA.update(lora_rank=args.lora_rank, lora_targets=args.lora_targets)
    techniques = [t for t in TECHNIQUES if not args.techniques or t[0] in args.techniques]
    rows: list[dict] = []

    def report(row: dict) -> None:
        rows.append(row)
        print(" ".join(str(v) for v in row.values()), flush=True)

    if "memtracker" in args.oracles:
        for model, points, precisions in FAKE_RUNS:
            if args.models and model not in args.models:
                continue
            for b, s in points[:1] if args.quick else points:
                for label, fields in techniques:
                    for precision in _precisions(args, precisions, label):
                        training = _training(micro_batch_size=b, seq_len=s, precision=precision, **fields)
                        predicted = estimate(RunSpec(model=model, training=training)).traced_allocated_bytes
                        started = time.perf_counter()
                        measured = _memtracker_peak(_config(model), training)
                        report(_row("memtracker", model, label, training, predicted, measured,
                                    time.perf_counter() - started))
    if "fsdp2-memtracker" in args.oracles:  # every-k is refused under FSDP (alike layers): the others
        for model in REAL_MODELS:
            config = _config(model)
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / f"{model}.json"
                path.write_text(json.dumps(config))
                for label, fields in techniques:
                    if "every-k" in fields.get("ckpt_policy", ""):
                        continue
                    training = _training(micro_batch_size=4, seq_len=512, precision="mixed_bf16", **fields)
                    spec = RunSpec(model=str(path), training=training,
                                   parallel=ParallelSpec(method="fsdp", world_size=FSDP_WORLD))
                    ranks = {r.rank: r for r in estimate(spec).ranks}
                    for rank in (0, FSDP_WORLD - 1):
                        started = time.perf_counter()
                        measured = _memtracker_peak(config, training, FSDP_WORLD, rank)
                        row = _row("fsdp2-memtracker", model, label, training,
                                   ranks[rank].traced_allocated_bytes, measured, time.perf_counter() - started)
                        report({**row, "technique": f"{label} rank {rank}/{FSDP_WORLD}"})
    if "fsdp2-every-k" in args.oracles:
        for row in _every_k_fsdp2_rows(techniques, args.quick):
            report(row)
    if "fsdp1-every-k" in args.oracles:
        for row in _every_k_fsdp2_rows(techniques, args.quick, fsdp1=True):
            report(row)
    if "counted-cpu" in args.oracles:
        spawn = multiprocessing.get_context("spawn")
        with tempfile.TemporaryDirectory() as tmp, \
                concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
            for model in REAL_MODELS:
                if args.models and model not in args.models:
                    continue
                config = _config(model)
                path = Path(tmp) / f"{model}.json"
                path.write_text(json.dumps(config))
                for b, s in REAL_POINTS[:1] if args.quick else REAL_POINTS:
                    for label, fields in techniques:
                        for precision in _precisions(args, PRECISIONS, label):
                            training = _training(micro_batch_size=b, seq_len=s, precision=precision,
                                                 attn="eager", **fields)
                            predicted = estimate(RunSpec(model=str(path), training=training)).traced_allocated_bytes
                            started = time.perf_counter()
                            measured = pool.submit(_counted_peak, config, {
                                **fields, **LORA, "micro_batch_size": b, "seq_len": s, "precision": precision,
                                "attn": "eager"}).result()
                            report(_row("counted-cpu", model, label, training, predicted, measured,
                                        time.perf_counter() - started))
    worst = max((abs(r["error_pct"]) for r in rows), default=0.0)
    if args.csv and rows:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    print(f"points {len(rows)}  max |error| {worst:.4f} %")
    return 0 if worst <= 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
