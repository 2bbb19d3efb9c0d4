"""Context parallelism (issue 18): the estimate of each cp rank against torch's ring attention on fake tensors.

    LLMEM_CACHE_DIR=$(mktemp -d) PYTHONPATH=. .venv/bin/python benchmarks/context_parallel_table.py \\
        [--quick] [--csv docs/error_matrix/context_parallel.csv]

Oracle (``harness.fake.context_parallel``): FSDP2 over the dp x cp ranks of torch's fake process group,
``FSDPMemTracker`` over two steady steps, each rank training on its seq_len / cp tokens with every attention call
run by torch's ``_templated_ring_attention`` / ``_templated_ring_attention_backward`` over its cp group (flash,
all-gather rotation, head-tail load balancing). Estimate: ``python -m estimator ... --method fsdp --cp N``'s
``traced_allocated_bytes`` of the same global rank (less the cuBLAS workspace and the allocator's rounding, which
no CPU oracle has). Causal, mixed_bf16 (FSDP2's bf16 compute), ranks first, middle and last of the cp group.

Models: the harness's small Llama config (4 heads, MHA; its fp32 logits set the peak) and two configs derived from
it whose attention sets the peak (8 heads of 64, MHA and GQA with 2 key/value heads, a 256-wide MLP, a 128-token
vocabulary, 2 layers), all with 16384 positions (the config's own is 2048). Column ``ring_at_peak_bytes``: how
much the ring attention's own transients (``estimator.methods.context_parallel.ring_*_extra``) add to the
estimate (0: the peak is elsewhere). ``--models HuggingFaceTB/SmolLM2-135M``: a catalogue model whose profiles
ship (its 30 layers, 49k vocabulary: minutes per oracle run; ``SHIPPED_LAYOUTS``), the rows the tests check the
estimator against without torch. ``--techniques``: cp combined with the long-context techniques (torchtune's
chunked cross-entropy, 8 chunks; activation offload), ``TECHNIQUE_LAYOUTS`` of small-llama and attn-mha.
``--lora``: peft's LoRA (r8 on q/k/v/o and on all linear layers, bf16: fp32 adapters on frozen bf16 weights, as
``get_peft_model`` leaves them), ``LORA_LAYOUTS`` (cp 2 and 4, dp 1 and 2, with and without checkpointing, two
points) of ``LORA_MODELS``; under checkpointing MemTracker's own module hooks keep one fp32 adapter input alive
(``tests/oracle/test_memtracker_oracle.py`` finds it in the event log: the instrumented run's, not the real one's),
so ``measured_bytes`` is the tracker's peak (``tracked_bytes``) less that tensor (``hook_held_bytes``, b x s / cp x
hidden x 4). ``--rescore CSV ...``: the estimate of every row of committed tables again, against its measured bytes
(no oracle run): the error before and after. ``--tp``: cp x tp (method dp_tp, torchtitan's (dp_shard, cp, tp)
mesh; ``TP_LAYOUTS``: cp 2 and 4 x tp 2, with and without checkpointing, and dp 2 x cp 2 x tp 2; bf16 and
mixed_bf16; ``TP_MODELS``), against ``harness.fake.context_parallel.tp_peak_bytes``: ``harness.fake.trace_run``'s
dp_tp rank (TP on the fake process group, FSDP2 over the dp x cp ranks of each TP position) at seq / cp tokens with
every SDPA call run by torch's ring attention over the rank's cp group. ``--tp --lora``: LoRA under cp x tp
(``LORA_VARIANTS``, bf16, ``TP_LAYOUTS`` of ``TP_MODELS``; ``estimator.profiler.tp`` splits a colwise linear's
``lora_B`` and a rowwise one's ``lora_A`` with it, the other adapter replicated; ``trace_run``'s counter has no
module hooks, so no ``hook_held_bytes``). Exit 1 when a point is off by more than 1 %.

    LLMEM_CACHE_DIR=$(mktemp -d) PYTHONPATH=. .venv/bin/python benchmarks/context_parallel_table.py --tp \
        --csv docs/error_matrix/context_parallel_tp.csv

    LLMEM_CACHE_DIR=$(mktemp -d) PYTHONPATH=. .venv/bin/python benchmarks/context_parallel_table.py --lora \
        --csv docs/error_matrix/context_parallel_lora.csv
    LLMEM_CACHE_DIR=$(mktemp -d) PYTHONPATH=. .venv/bin/python benchmarks/context_parallel_table.py --tp --lora \
        --csv docs/error_matrix/context_parallel_tp_lora.csv
    LLMEM_CACHE_DIR=$(mktemp -d) PYTHONPATH=. .venv/bin/python benchmarks/context_parallel_table.py \
        --rescore docs/error_matrix/context_parallel*.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from estimator.api import estimate  # noqa: E402
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec  # noqa: E402

PRECISION = "mixed_bf16"
# (world, cp, [(b, s)], grad_ckpt): cp 2 and 4 over cp ranks alone, cp 2 with two data-parallel groups, and
# checkpointing (the ring's forward recomputed in backward).
LAYOUTS = (
    (2, 2, ((1, 1024), (2, 2048), (1, 8192)), False),
    (4, 4, ((1, 1024), (2, 4096), (1, 8192)), False),
    (4, 2, ((1, 4096),), False),
    (4, 4, ((2, 8192),), True),
    (2, 2, ((2, 4096),), True),
)


# A catalogue model with shipped profiles (the tests' rows): cp 2, rank first and last, with and without
# checkpointing.
SHIPPED = "HuggingFaceTB/SmolLM2-135M"
SHIPPED_LAYOUTS = ((2, 2, ((1, 4096),), False), (2, 2, ((1, 4096),), True))


# cp with the long-context techniques (issue 18's other part): the plan combines them when cp alone does not fit.
TECHNIQUES = (("chunked8", {"ce": "chunked", "ce_chunks": 8}), ("offload", {"activation_offload": True}))
TECHNIQUE_LAYOUTS = ((2, 2, ((1, 4096),), False), (4, 4, ((2, 8192),), True))
TECHNIQUE_MODELS = ("small-llama", "attn-mha")


# LoRA under cp (bf16, the ranks' adapters fp32): (world, cp, points, grad_ckpt): cp 2 and 4 over cp ranks alone
# and with two data-parallel groups, each with and without checkpointing.
LORA_PRECISION = "bf16"
LORA_POINTS = ((1, 2048), (2, 4096))
LORA_LAYOUTS = tuple((world, cp, LORA_POINTS, ckpt) for world, cp in ((2, 2), (4, 4), (4, 2), (8, 4))
                     for ckpt in (False, True))
LORA_VARIANTS = (("lora8-qkvo", {"lora_rank": 8, "lora_targets": "q_proj,k_proj,v_proj,o_proj"}),
                 ("lora8-all-linear", {"lora_rank": 8, "lora_targets": "all-linear"}))
LORA_MODELS = ("attn-gqa2", "attn-mha")


# cp x tp (``--tp``, method dp_tp: torchtitan's (dp_shard, cp, tp) mesh): (world, cp, tp, points, grad_ckpt): cp 2
# and 4 with tp 2 over cp x tp ranks alone, and cp 2 x tp 2 with two data-parallel groups; bf16 and mixed_bf16.
TP_POINTS = ((1, 2048), (2, 4096))
TP_LAYOUTS = tuple((world, cp, 2, TP_POINTS, ckpt) for world, cp in ((4, 2), (8, 4)) for ckpt in (False, True)) + (
    (8, 2, 2, TP_POINTS[:1], False),)
TP_PRECISIONS = ("bf16", "mixed_bf16")
TP_MODELS = ("attn-mha", "attn-gqa2")


def _hook_held_bytes(config: dict, fields: dict, b: int, s_local: int, grad_ckpt: bool) -> int:
    """The fp32 adapter input MemTracker's hooks keep alive under checkpointing (0 elsewhere)."""
    return b * s_local * config["hidden_size"] * 4 if grad_ckpt and fields.get("lora_rank") else 0


def _models() -> dict[str, dict]:
    from harness.fake.memtracker import load_model_config

    base = {**load_model_config("small-llama"), "max_position_embeddings": 16384}
    attention = {**base, "hidden_size": 512, "num_attention_heads": 8, "intermediate_size": 256, "vocab_size": 128,
                 "num_hidden_layers": 2}
    return {"small-llama": base, "attn-mha": {**attention, "num_key_value_heads": 8},
            "attn-gqa2": {**attention, "num_key_value_heads": 2}}


def _without_ring_transients():
    """The estimate with the ring's own transients left out (to report what they add)."""
    import contextlib

    import estimator.api as api
    from estimator.methods import context_parallel as cpm

    @contextlib.contextmanager
    def patched():
        saved = cpm.ring_forward_extra, cpm.ring_backward_extra
        cpm.ring_forward_extra = cpm.ring_backward_extra = lambda *args, **kwargs: (0.0, 0.0)
        api._STEP_MODELS.clear()
        try:
            yield
        finally:
            cpm.ring_forward_extra, cpm.ring_backward_extra = saved
            api._STEP_MODELS.clear()
    return patched()


def _ranks(world: int, cp: int, tp: int = 1) -> list[int]:
    """cp rank 0, a middle one and the last, of the first cp group (every tp-th rank), and the last global rank
    (the ranks the estimate reports)."""
    return sorted({0, cp // 2 * tp, (cp - 1) * tp, world - 1})


def _spec(model: str, world: int, cp: int, b: int, s: int, ckpt: bool, precision: str, fields: dict,
          tp: int = 1) -> RunSpec:
    training = TrainingSpec(micro_batch_size=b, seq_len=s, precision=precision, grad_ckpt=ckpt, **fields)
    parallel = ParallelSpec(method="dp_tp" if tp > 1 else "fsdp", world_size=world, tp=tp, cp=cp)
    return RunSpec(model=model, training=training, parallel=parallel)


def _model_path(name: str, models: dict[str, dict], tmp: str) -> tuple[dict, str]:
    """(config, what the estimator is given): the shipped catalogue model by name, a derived config as a file."""
    if name == SHIPPED:
        from harness.fake.memtracker import load_model_config

        return load_model_config(name), name
    path = Path(tmp) / f"{name}.json"
    path.write_text(json.dumps(models[name]))
    return models[name], str(path)


def _runs(args) -> tuple[list, tuple, str]:
    """(models, (label, fields) per variant, precision) of the table asked for."""
    if args.lora:
        return list(args.models or LORA_MODELS), LORA_VARIANTS, LORA_PRECISION
    if args.techniques:
        return list(args.models or TECHNIQUE_MODELS), TECHNIQUES, PRECISION
    return list(args.models or _models()), (("", {}),), PRECISION


def _layouts(args, name: str) -> tuple:
    if name == SHIPPED:
        return SHIPPED_LAYOUTS
    return LORA_LAYOUTS if args.lora else TECHNIQUE_LAYOUTS if args.techniques else LAYOUTS


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="the first layout's first point only")
    parser.add_argument("--csv")
    parser.add_argument("--techniques", action="store_true", help="cp with chunked CE / activation offload")
    parser.add_argument("--lora", action="store_true", help="cp with peft's LoRA (bf16, LORA_VARIANTS)")
    parser.add_argument("--models", nargs="*", help=f"names of the derived configs, or {SHIPPED} (default: the "
                                                     "derived configs)")
    parser.add_argument("--rescore", nargs="+", type=Path, metavar="CSV", help="re-estimate committed rows")
    parser.add_argument("--precision", help="instead of the table's own (mixed_bf16; bf16 for --lora)")
    parser.add_argument("--tp", action="store_true", help="cp x tp (method dp_tp, TP_LAYOUTS, bf16 and mixed_bf16)")
    args = parser.parse_args()
    if args.rescore:
        return rescore(args.rescore)
    return _write(table_rows(args), args.csv)


def _plan(args) -> list[tuple]:
    """(model, label, fields, precision, world, cp, tp, b, s, grad_ckpt) of every point of the table asked for."""
    names, variants, precision = _runs(args)
    if args.tp:
        names = list(args.models or TP_MODELS)
        precisions = (args.precision,) if args.precision else (LORA_PRECISION,) if args.lora else TP_PRECISIONS
    else:
        precisions = (args.precision or precision,)
    points = []
    for name, precision, (label, fields) in ((n, p, v) for n in names for p in precisions for v in variants):
        layouts = TP_LAYOUTS if args.tp else tuple((w, cp, 1, pts, ck) for w, cp, pts, ck in _layouts(args, name))
        for world, cp, tp, pts, ckpt in layouts[:1] if args.quick else layouts:
            for b, s in pts[:1] if args.quick else pts:
                points.append((name, label, fields, precision, world, cp, tp, b, s, ckpt))
    return points


def _measure(config: dict, precision: str, world: int, cp: int, tp: int, rank: int, b: int, s: int, ckpt: bool,
             fields: dict) -> tuple[int, int]:
    """(tracked bytes, bytes MemTracker's hooks hold) of one rank: FSDPMemTracker under cp alone,
    ``trace_run``'s dp_tp (its own counter, no hooks) under cp x tp."""
    from harness.fake.context_parallel import peak_bytes, tp_peak_bytes

    if tp > 1:
        return tp_peak_bytes(config, precision, world, cp, tp, rank, b, s, grad_ckpt=ckpt, **fields), 0
    tracked = peak_bytes(config, precision, world, cp, rank, b, s, grad_ckpt=ckpt, **fields)
    return tracked, _hook_held_bytes(config, fields, b, s // cp, ckpt)


def table_rows(args) -> list[dict]:
    """Every point's estimate of each reported rank against the oracle (``_measure``), one row per rank."""
    models, rows = _models(), []
    with tempfile.TemporaryDirectory() as tmp:
        for name, label, fields, precision, world, cp, tp, b, s, ckpt in _plan(args):
            config, model = _model_path(name, models, tmp)
            spec = _spec(model, world, cp, b, s, ckpt, precision, fields, tp)
            predicted = {r.rank: r for r in estimate(spec, replay_reserved=False).ranks}
            with _without_ring_transients():
                bare = {r.rank: r for r in estimate(spec, replay_reserved=False).ranks}
            for rank in _ranks(world, cp, tp):
                started = time.perf_counter()
                tracked, held = _measure(config, precision, world, cp, tp, rank, b, s, ckpt, fields)
                measured = tracked - held
                got = predicted[rank].traced_allocated_bytes
                row = {"model": name, **({"precision": precision} if args.tp else {}),
                       **({"technique": label} if label else {}), "world": world, "cp": cp,
                       **({"tp": tp} if args.tp else {}), "rank": rank, "cp_rank": rank // tp % cp,
                       **({"tp_rank": rank % tp} if args.tp else {}), "grad_ckpt": ckpt, "micro_batch_size": b,
                       "seq_len": s, "predicted_bytes": got,
                       **({"tracked_bytes": tracked, "hook_held_bytes": held} if args.lora and not args.tp else {}),
                       "measured_bytes": measured, "ring_at_peak_bytes": got - bare[rank].traced_allocated_bytes,
                       "error_pct": round(100 * (got - measured) / measured, 4),
                       "oracle_s": round(time.perf_counter() - started, 1)}
                rows.append(row)
                print(" ".join(str(v) for v in row.values()), flush=True)
    return rows


def _write(rows: list[dict], path: str | None) -> int:
    """The table to ``path`` and its summary; 1 when a point is off by more than 1 %."""
    errors = sorted(abs(r["error_pct"]) for r in rows)
    if path and rows:
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    print(f"points {len(rows)}  median |error| {errors[len(errors) // 2]:.4f} %  max |error| {errors[-1]:.4f} %")
    return 0 if errors[-1] <= 1.0 else 1


def _row_fields(row: dict) -> tuple[str, dict]:
    """(precision, TrainingSpec fields) of a committed row, from its precision column and its technique label."""
    label = row.get("technique", "")
    for table, precision in ((LORA_VARIANTS, LORA_PRECISION), (TECHNIQUES, PRECISION)):
        for name, fields in table:
            if name == label:
                return row.get("precision") or precision, fields
    if label:
        raise ValueError(f"rescore: unknown technique {label!r}")
    return row.get("precision") or PRECISION, {}


def rescore(paths: list[Path]) -> int:
    """Every committed row estimated again against its measured bytes: max |error| before and after, per table."""
    models, worst = _models(), 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for path in paths:
            with open(path, newline="") as handle:
                rows = list(csv.DictReader(handle))
            before = after = 0.0
            for row in rows:
                precision, fields = _row_fields(row)
                _, model = _model_path(row["model"], models, tmp)
                spec = _spec(model, int(row["world"]), int(row["cp"]), int(row["micro_batch_size"]),
                             int(row["seq_len"]), row["grad_ckpt"] == "True", precision, fields,
                             int(row.get("tp") or 1))
                got = {r.rank: r for r in estimate(spec, replay_reserved=False).ranks}[int(row["rank"])]
                measured = int(row["measured_bytes"])
                before = max(before, abs(float(row["error_pct"])))
                after = max(after, abs(100 * (got.traced_allocated_bytes - measured) / measured))
            worst = max(worst, after)
            print(f"{path}: {len(rows)} rows  max |error| before {before:.4f} %  after {after:.4f} %", flush=True)
    return 0 if worst <= 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
