"""``python -m harness.fake --model facebook/opt-125m --method fsdp --gpus 4 ... --json``: a debugging CLI."""

from __future__ import annotations

import argparse
import json
import sys

from estimator.spec import ATTENTIONS, PRECISIONS, ParallelSpec, RunSpec, TrainingSpec

_GIB = 2**30


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness.fake",
                                description="Per-rank peak memory of a training run, traced on fake tensors.")
    p.add_argument("--model", required=True, help="catalogue name or config.json path")
    p.add_argument("--method", default="single", choices=("single", "ddp", "fsdp", "tp", "dp_tp"))
    p.add_argument("--gpus", type=int, default=1, help="world size")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (tp: = gpus)")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--precision", default="fp32", choices=PRECISIONS)
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--attn", default="sdpa", choices=ATTENTIONS)
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument("--lora-targets", default="auto")
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--num-layers", type=int, default=None, help="trace a copy with this many layers")
    p.add_argument("--ranks", default=None, help="comma-separated ranks (default: 0 and the last)")
    p.add_argument("--round-to", type=int, default=512)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        tp = args.tp if args.tp is not None else (args.gpus if args.method == "tp" else 1)
        spec = RunSpec(model=args.model,
                       parallel=ParallelSpec(method=args.method, world_size=args.gpus, tp=tp),
                       training=TrainingSpec(micro_batch_size=args.micro_batch_size, seq_len=args.seq_len,
                                             precision=args.precision, optimizer=args.optimizer,
                                             grad_ckpt=args.grad_ckpt, attn=args.attn,
                                             lora_rank=args.lora_rank, lora_targets=args.lora_targets,
                                             lora_dropout=args.lora_dropout))
        ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else None
        config = None
        if args.num_layers is not None:
            from estimator.models.arch import load_config
            from estimator.profiler.build import with_num_layers

            config = with_num_layers(load_config(spec.model), args.num_layers)
        from harness.fake import trace_run

        result = trace_run(spec, ranks, config=config, round_to=args.round_to)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return 0
    for rank, rec in result["per_rank"].items():
        steps = "  ".join(f"step{i + 1} {s['peak'] / _GIB:.3f}" for i, s in enumerate(rec["step_peaks"]))
        print(f"rank {rank}: peak {rec['peak_allocated_bytes'] / _GIB:.3f} GiB "
              f"(step {rec['peak_step']}, {rec['peak_phase']})  [{steps}]")
        parts = ", ".join(f"{k} {v / _GIB:.3f}" for k, v in sorted(rec["breakdown_at_peak"].items(),
                                                                   key=lambda kv: -kv[1]))
        print(f"  at peak (GiB): {parts}")
    print(f"trace {result['trace_s']:.1f} s")
    for note in result["notes"]:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
