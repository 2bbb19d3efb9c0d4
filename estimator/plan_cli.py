"""``python -m estimator plan``: argument parsing and printing for :mod:`estimator.plan`.

Exit codes: 0 for a plan (also when nothing fits: the advice says what would), 2 for invalid input
(one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys

from estimator.spec import ATTENTIONS, OPTIMIZERS, PRECISIONS


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_plan_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of the ``plan`` subcommand (also used standalone by ``python -m estimator.plan_cli``)."""
    parser.add_argument("--model", required=True, help="catalogue name, config.json path or hub id")
    parser.add_argument("--gpus", required=True, type=_positive_int, help="number of GPUs (N)")
    parser.add_argument("--gpu", required=True, help="GPU key, e.g. h100-80gb (see --list-gpus)")
    parser.add_argument("--seq-len", type=_positive_int, default=512, help="tokens per sample (default 512)")
    parser.add_argument("--global-batch", type=_positive_int, default=None,
                        help="samples per optimizer step; counts gradient-accumulation steps")
    parser.add_argument("--precision", choices=PRECISIONS, default=None,
                        help="default: mixed_bf16 where the GPU has bf16, else mixed_fp16")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    parser.add_argument("--attn", choices=ATTENTIONS, default="sdpa")
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (0 = full fine-tuning)")
    parser.add_argument("--lora-targets", default="auto", help="LoRA target modules (default: auto)")
    parser.add_argument("--ckpt", choices=("both", "on", "off"), default="both",
                        help="gradient checkpointing candidates (default: both)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated subset of methods to consider (default: all)")
    parser.add_argument("--interconnect", choices=("nvlink", "pcie", "infiniband"), default=None,
                        help="link for collectives (default: the GPU's own within a node, InfiniBand beyond 8 GPUs)")
    parser.add_argument("--bandwidth", type=float, default=None, metavar="GB/S",
                        help="override the collective bus bandwidth per GPU, GB/s")
    parser.add_argument("--llmem", action="store_true",
                        help="also show LLMem's Algorithm 1 choice for this setting")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _methods(text: str | None) -> list[str] | None:
    if text is None:
        return None
    from estimator.plan import METHOD_ORDER
    chosen = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in METHOD_ORDER]
    if unknown or not chosen:
        raise ValueError(f"methods: {', '.join(unknown) or repr(text)} not among {', '.join(METHOD_ORDER)}")
    return chosen


def run_plan(args: argparse.Namespace) -> int:
    from estimator import plan as planner
    try:
        ckpt = {"both": (False, True), "on": (True,), "off": (False,)}[args.ckpt]
        result = planner.plan(args.model, gpus=args.gpus, gpu=args.gpu, seq_len=args.seq_len,
                              global_batch=args.global_batch, precision=args.precision, optimizer=args.optimizer,
                              attn=args.attn, lora_rank=args.lora_rank, lora_targets=args.lora_targets,
                              ckpt_options=ckpt, methods=_methods(args.methods), interconnect=args.interconnect,
                              bandwidth_gbs=args.bandwidth)
        baseline = None
        if args.llmem:
            from estimator import llmem_select
            baseline = llmem_select.algorithm1(args.model, gpus=args.gpus, gpu=args.gpu, seq_len=args.seq_len)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        out = result.to_dict()
        if baseline is not None:
            out["llmem_algorithm1"] = baseline.to_dict()
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    print(planner.format_plan(result))
    if baseline is not None:
        print()
        print(baseline.describe())
    return 0


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:      # one line, exit 2 (argparse prints the usage block otherwise)
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    parser = _OneLineParser(prog="python -m estimator plan",
                            description="The fastest method and micro-batch that fit N GPUs of a type.")
    add_plan_arguments(parser)
    return run_plan(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
