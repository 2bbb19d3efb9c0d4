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
chunked cross-entropy, 8 chunks; activation offload), ``TECHNIQUE_LAYOUTS`` of small-llama and attn-mha. Exit 1 when a point is off by more than 1 %.
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


def _ranks(world: int, cp: int) -> list[int]:
    """cp rank 0, a middle one and the last, of the first cp group, and the last global rank (the ranks the
    estimate reports)."""
    return sorted({0, cp // 2, cp - 1, world - 1})


def main() -> int:
    from harness.fake.context_parallel import peak_bytes

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="the first layout's first point only")
    parser.add_argument("--csv")
    parser.add_argument("--techniques", action="store_true", help="cp with chunked CE / activation offload")
    parser.add_argument("--models", nargs="*", help=f"names of the derived configs, or {SHIPPED} (default: the "
                                                     "derived configs)")
    args = parser.parse_args()
    rows: list[dict] = []
    models = _models()
    wanted = args.models or list(TECHNIQUE_MODELS if args.techniques else models)
    techniques = TECHNIQUES if args.techniques else (("", {}),)
    with tempfile.TemporaryDirectory() as tmp:
        for name, (label, fields) in ((n, t) for n in wanted for t in techniques):
            if name == SHIPPED:
                from harness.fake.memtracker import load_model_config

                config, model, layouts = load_model_config(name), name, SHIPPED_LAYOUTS
            else:
                config, layouts = models[name], TECHNIQUE_LAYOUTS if args.techniques else LAYOUTS
                model = str(Path(tmp) / f"{name}.json")
                Path(model).write_text(json.dumps(config))
            for world, cp, points, ckpt in layouts[:1] if args.quick else layouts:
                for b, s in points[:1] if args.quick else points:
                    training = TrainingSpec(micro_batch_size=b, seq_len=s, precision=PRECISION, grad_ckpt=ckpt,
                                            **fields)
                    spec = RunSpec(model=model, training=training,
                                   parallel=ParallelSpec(method="fsdp", world_size=world, cp=cp))
                    predicted = {r.rank: r for r in estimate(spec, replay_reserved=False).ranks}
                    with _without_ring_transients():
                        bare = {r.rank: r for r in estimate(spec, replay_reserved=False).ranks}
                    for rank in _ranks(world, cp):
                        started = time.perf_counter()
                        measured = peak_bytes(config, PRECISION, world, cp, rank, b, s, grad_ckpt=ckpt, **fields)
                        got = predicted[rank].traced_allocated_bytes
                        row = {"model": name, **({"technique": label} if label else {}), "world": world, "cp": cp, "rank": rank, "cp_rank": rank % cp,
                               "grad_ckpt": ckpt, "micro_batch_size": b, "seq_len": s, "predicted_bytes": got,
                               "measured_bytes": measured,
                               "ring_at_peak_bytes": got - bare[rank].traced_allocated_bytes,
                               "error_pct": round(100 * (got - measured) / measured, 4),
                               "oracle_s": round(time.perf_counter() - started, 1)}
                        rows.append(row)
                        print(" ".join(str(v) for v in row.values()), flush=True)
    errors = sorted(abs(r["error_pct"]) for r in rows)
    if args.csv and rows:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    print(f"points {len(rows)}  median |error| {errors[len(errors) // 2]:.4f} %  max |error| {errors[-1]:.4f} %")
    return 0 if errors[-1] <= 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
