"""``python -m estimator plan``: argument parsing and printing for :mod:`estimator.planning.plan` (here, above
the planner and the LLMem selection baseline it compares with).

Exit codes: 0 for a plan (also when nothing fits: the advice says what would), 2 for invalid input
(one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys

from estimator.batching.cli_args import add_batching_arguments, batching_from_args
from estimator.options.cap_args import add_cap_arguments, cap_bytes_from_args
from estimator.options.fsdp1_args import add_fsdp1_arguments, fsdp1_from_args
from estimator.options.technique_args import add_technique_arguments
from estimator.planning import plan as planner
from estimator.planning.plan import Plan
from estimator.spec import ATTENTIONS, BATCHES, GRAD_SYNCS, LOOPS, OPTIMIZERS, PRECISIONS

GIB = 1024**3


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_plan_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of the ``plan`` subcommand (also used standalone by ``python -m estimator.io.plan_cli``)."""
    parser.add_argument("--model", help="catalogue name, config.json path or hub id (required without --config)")
    parser.add_argument("--gpus", type=_positive_int, help="number of GPUs (N; required without --config)")
    parser.add_argument("--gpu", help="GPU key, e.g. h100-80gb (see --list-gpus; required without --config)")
    parser.add_argument("--config", action="append", metavar="FILE",
                        help="read model, GPUs, lengths, precision, LoRA and loop from training configs (repeatable); "
                             "flags given as well override them")
    parser.add_argument("--seq-len", type=_positive_int, default=512, help="tokens per sample (default 512)")
    parser.add_argument("--global-batch", type=_positive_int, default=None,
                        help="samples per optimizer step; counts gradient-accumulation steps")
    parser.add_argument("--precision", choices=PRECISIONS, default=None,
                        help="default: mixed_bf16 where the GPU has bf16, else mixed_fp16")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    parser.add_argument("--attn", choices=ATTENTIONS, default="sdpa")
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (0 = full fine-tuning)")
    parser.add_argument("--lora-targets", default="auto", help="LoRA target modules (default: auto)")
    parser.add_argument("--lora-dropout", type=float, default=0.0, metavar="P",
                        help="peft's lora_dropout (default 0): above 0 each adapted module keeps a dropout mask")
    parser.add_argument("--ckpt", choices=("both", "on", "off"), default="both",
                        help="gradient checkpointing candidates (default: both)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated subset of methods to consider (default: all; ds_pipeline, DeepSpeed's "
                             "pipeline engine with one stage per GPU, is weighed only when named)")
    parser.add_argument("--interconnect", choices=("nvlink", "pcie", "infiniband"), default=None,
                        help="link for collectives (default: the GPU's own within a node, InfiniBand beyond 8 GPUs)")
    parser.add_argument("--bandwidth", type=float, default=None, metavar="GB/S",
                        help="override the collective bus bandwidth per GPU, GB/s")
    parser.add_argument("--host-ram", type=float, default=None, metavar="GIB",
                        help="host RAM per node, GiB: offload layouts that need more do not fit (default: unchecked)")
    parser.add_argument("--llmem", action="store_true",
                        help="also show LLMem's Algorithm 1 choice for this setting")
    parser.add_argument("--grad-sync", choices=GRAD_SYNCS, default="every",
                        help="FSDP under gradient accumulation: reduce on 'every' micro-batch (torchtitan, "
                             "sync_each_batch=True) or the 'last' only (the HF Trainer's default: unsharded "
                             "gradients held in between)")
    parser.add_argument("--model-code", metavar="RELEASE", default="", help="the transformers release whose model code runs (e.g. 4.45): releases allocate differently (before 4.46 the logits are upcast to fp32 inside forward). Default: the release the shipped profiles were traced with; a release with no shipped or cached profile is traced here when installed, else the default is used and the output says so")
    parser.add_argument("--loop", choices=LOOPS, default="trainer",
                        help="training loop: 'trainer' drops the output object before backward (HF Trainer, TRL); "
                             "'manual' keeps `outputs` (the logits) alive through backward")
    parser.add_argument("--outputs-fp32", action="store_true",
                        help="the forward returns fp32 copies of its 16-bit outputs (accelerate's mixed precision, "
                             "the HF Trainer with bf16/fp16): a manual loop holds fp32 logits; over 16-bit weights "
                             "the forward also runs under autocast")
    parser.add_argument("--ckpt-reentrant", action="store_true",
                        help="the checkpointed layouts checkpoint reentrantly (use_reentrant=True, the HF Trainer's "
                             "default through transformers 4.x); with --model-code before 4.52 the fsdp1 layout "
                             "over frozen layers (LoRA) then keeps each recomputed layer's input until backward ends")
    parser.add_argument("--batch", choices=BATCHES, default="full",
                        help="'full' (default: every row full length, or packed) or 'padded' (some rows padded: "
                             "an attention mask; set per batch from --lengths)")
    parser.add_argument("--moe-imbalance", type=float, default=1.0, metavar="F",
                        help="load of the busiest expert relative to balanced routing: the expert-parallel layouts' "
                             "memory and step time follow their busiest rank (default 1: balanced)")
    parser.add_argument("--alloc-conf", metavar="STRING", default=None,
                        help="PYTORCH_CUDA_ALLOC_CONF the reserved replay uses (default: the environment's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_fsdp1_arguments(parser)
    add_batching_arguments(parser)
    add_technique_arguments(parser)
    parser.add_argument("--no-techniques", action="store_true",
                        help="never try the long-context techniques when nothing fits (default: chunked, then "
                             "fused cross-entropy, then activation offload, until a GPU-resident layout fits)")
    add_cap_arguments(parser)
    return parser


def _techniques(args: argparse.Namespace) -> dict:
    fields = {"ce": args.ce, "ce_chunks": args.ce_chunks, "activation_offload": args.activation_offload,
              "ckpt_policy": args.ckpt_policy}
    return {k: v for k, v in fields.items() if v}


def _methods(text: str | None) -> list[str] | None:
    if text is None:
        return None
    chosen = [m.strip() for m in text.split(",") if m.strip()]
    names = planner.METHOD_ORDER + planner.FILTER_ONLY
    unknown = [m for m in chosen if m not in names]
    if unknown or not chosen:
        raise ValueError(f"methods: {', '.join(unknown) or repr(text)} not among {', '.join(names)}")
    return chosen


def run_plan(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    try:
        report = None
        if args.config:
            from estimator.configs.cli import plan_args_from_configs

            report = plan_args_from_configs(args, argv or [], build_parser)
        missing = [f"--{name}" for name in ("model", "gpus", "gpu") if getattr(args, name) is None]
        if missing:
            raise ValueError(f"the following arguments are required: {', '.join(missing)} (or --config)")
        ckpt = {"both": (False, True), "on": (True,), "off": (False,)}[args.ckpt]
        epoch = _epoch_source(args)
        result = planner.plan(args.model, gpus=args.gpus, gpu=args.gpu, seq_len=args.seq_len,
                              global_batch=args.global_batch, precision=args.precision, optimizer=args.optimizer,
                              attn=args.attn, lora_rank=args.lora_rank, lora_targets=args.lora_targets,
                              lora_dropout=args.lora_dropout, ckpt_options=ckpt, methods=_methods(args.methods), interconnect=args.interconnect,
                              bandwidth_gbs=args.bandwidth, host_ram_gb=args.host_ram, loop=args.loop,
                              epoch=epoch, alloc_conf=args.alloc_conf, batch=args.batch,
                              fsdp1=fsdp1_from_args(args, "fsdp1", getattr(args, "fsdp1_base", None)),
                              outputs_fp32=args.outputs_fp32, grad_sync=args.grad_sync, ckpt_reentrant=args.ckpt_reentrant,
                              model_code=args.model_code, techniques=_techniques(args),
                              try_techniques=not args.no_techniques, moe_imbalance=args.moe_imbalance,
                              memory_cap_bytes=cap_bytes_from_args(args, args.gpu) or 0)
        baseline = None
        if args.llmem:
            from estimator.baselines import llmem_select
            baseline = llmem_select.algorithm1(args.model, gpus=args.gpus, gpu=args.gpu, seq_len=args.seq_len)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        out = result.to_dict()
        if baseline is not None:
            out["llmem_algorithm1"] = baseline.to_dict()
        if report is not None:
            out["configs"] = report.to_dict()
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    print(format_plan(result))
    if result.epoch is not None:
        from estimator.batching.epoch import render_summary

        print("\nRecommendation's " + render_summary(result.epoch))
    if report is not None:
        print("\n" + report.render())
    if baseline is not None:
        print()
        print(baseline.describe())
    return 0


def _epoch_source(args: argparse.Namespace):
    varlen = batching_from_args(args)
    if varlen is None:
        return None
    from estimator.batching.epoch import EpochSource

    return EpochSource(*varlen)


def _gib(value: int | None) -> str:
    return f"{value / GIB:.1f}" if value is not None else "-"


def format_plan(p: Plan) -> str:
    """The fixed-width table, the recommendation, advice, notes and the throughput assumptions."""
    gb = f", global batch {p.global_batch}" if p.global_batch else ""
    lora = f", LoRA r={p.lora_rank}" if p.lora_rank else ""
    lines = [f"Plan: {p.model} on {p.world_size} x {p.gpu_name}, seq {p.seq_len}, {p.precision}, "
             f"{p.optimizer}{lora}{gb}, {p.loop} loop"
             + (", FSDP gradients reduced on the last micro-batch" if p.grad_sync == "last" else ""), ""]
    # the method column widens for the longest layout name (pp x dp x tp's) so the columns stay aligned
    width = max([14] + [len(r.candidate.label) + 1 for r in p.results])
    header = (f"{'method':<{width}}{'tp':>3} {'ckpt':<5}{'fits':<5}{'max mb':>7}{'mb':>6}{'accum':>6}"
              f"{'peak GiB':>9}{'bound GiB':>10}{'host GiB':>9}{'tokens/s':>11}  rank / why lost")
    lines += [header, "-" * len(header)]
    order = sorted(p.results, key=lambda r: (r.rank is None, r.rank or 0, r.status != "oom",
                                             planner.METHOD_RANK[r.candidate.method], r.candidate.tp))
    for r in order:
        c = r.candidate
        why = f"{r.rank}" + ("" if r.rank == 1 else f"  {r.reason}") if r.rank else r.reason
        at_least = ">=" if r.peak_lower_bound else ""
        mx = "-" if r.status == "invalid" else (f">={r.max_micro_batch}" if r.max_micro_batch >= planner.MAX_MICRO_BATCH
                                                  else str(r.max_micro_batch))
        lines.append(f"{c.label:<{width}}{c.tp:>3} {'yes' if c.grad_ckpt else 'no':<5}"
                     f"{'yes' if r.fits else ('-' if r.status == 'invalid' else 'no'):<5}{mx:>7}"
                     f"{r.micro_batch or '-':>6}{r.grad_accum or '-':>6}{at_least + _gib(r.peak_bytes):>9}"
                     f"{at_least + _gib(r.bound_bytes):>10}{_gib(r.host_ram_node_bytes):>9}"
                     f"{(f'{r.tokens_per_s:,.0f}' if r.time else '-'):>11}  {why}")
    lines.append("")
    if any(r.host_ram_node_bytes for r in p.results):
        lines.append("host GiB: CPU RAM per node for the offloaded states (optimizer partitions, fp32 master "
                     "weights and gradients; ZeRO-Infinity also the parameters)")
    if any(r.peak_lower_bound for r in p.results):
        lines.append(">= GiB: lower bounds; the reserved replay stopped once it proved the layout does not fit")
    lines.append(recommendation_line(p))
    lines += [f"  advice: {a}" for a in p.advice]
    lines += [f"  note: {n}" for n in p.notes]
    lines.append(_assumptions_line(p))
    return "\n".join(lines)


def recommendation_line(p: Plan) -> str:
    b = p.best
    if b is None:
        return "Recommendation: nothing fits (see advice)"
    c = b.candidate
    layout = f"{c.label}" + (f" (tp={c.tp})" if c.method == "tp" else "")
    host = f", host RAM ~{_gib(b.host_ram_node_bytes)} GiB/node" if b.host_ram_node_bytes else ""
    technique = f", {p.technique}," if p.technique else ""
    return (f"Recommendation: {layout} [{planner.run_as(c)}]{' with' if c.grad_ckpt else ' without'} "
            f"gradient checkpointing{technique} micro-batch {b.micro_batch} x {b.grad_accum} accumulation x dp {c.dp}: "
            f"~{b.tokens_per_s:,.0f} tokens/s, peak {_gib(b.peak_bytes)} GiB/rank "
            f"(bound {_gib(b.bound_bytes)} of {_gib(b.capacity_bytes)} GiB){host}")


def _assumptions_line(p: Plan) -> str:
    a = p.assumptions
    if not a:
        return ""
    e, dl, tl = a["compute_efficiency"], a["dp_link"], a["tp_link"]
    kind = "FITTED" if e["calibrated"] else "PRIOR"
    links = f"dp {dl['name']} {dl['bus_bandwidth_gbs']:.0f} GB/s ({dl['source']})"
    if p.world_size > 1:
        links += f", tp {tl['name']} {tl['bus_bandwidth_gbs']:.0f} GB/s"
    return (f"Throughput model: compute efficiency {kind} [{e['source']}]: e_max {e['e_max']:.2f}, half at "
            f"{e['tokens_half']:.0f} tokens/micro-batch, GEMM-width half point {e['width_half']:.0f} (prior); "
            f"{links}; DP overlap {a['overlap_priors']['ddp']:.0%} of backward (prior); "
            f"CPU Adam {a['cpu_adam_params_per_s'] / 1e9:.1f} Gparam/s (prior). See estimator/planning/throughput.py.")


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:      # one line, exit 2 (argparse prints the usage block otherwise)
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="python -m estimator plan",
                            description="The fastest method and micro-batch that fit N GPUs of a type.")
    return add_plan_arguments(parser)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_plan(build_parser().parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
