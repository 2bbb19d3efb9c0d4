"""``--config FILE`` for ``python -m estimator`` and ``python -m estimator plan``: the flags given explicitly
override what the configs say; the output gains a "read from your configs" section."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from estimator.configs import ConfigReport, spec_from_configs
from estimator.options.fsdp1_args import FLAG_FIELDS
from estimator.spec import RunSpec

# CLI destination -> config setting (flags of either command; a flag a command lacks is simply absent).
_FLAG_SETTINGS = {"model": "model", "gpus": "world_size", "method": "method", "tp": "tp",
                  "micro_batch_size": "micro_batch_size", "seq_len": "seq_len", "precision": "precision",
                  "optimizer": "optimizer", "grad_ckpt": "grad_ckpt", "attn": "attn", "lora_rank": "lora_rank",
                  "lora_targets": "lora_targets", "lora_dropout": "lora_dropout", "qlora": "qlora", "loop": "loop", "gpu": "gpu",
                  "grad_accum_steps": "grad_accum_steps", "grad_sync": "grad_sync", "outputs_fp32": "outputs_fp32",
                  "use_cache": "use_cache", "deepspeed": "deepspeed", "ce": "ce", "ce_chunks": "ce_chunks",
                  "activation_offload": "activation_offload", "ckpt_policy": "ckpt_policy",
                  "ckpt_reentrant": "ckpt_reentrant", "vocab_size": "vocab_size"}


def explicit_flags(build_parser: Callable[[], argparse.ArgumentParser], argv: list[str]) -> dict[str, Any]:
    """The settings the user typed on the command line (defaults left out), re-parsed with every default
    suppressed so "--optimizer adamw" given explicitly still overrides a config."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    given = vars(parser.parse_known_args(argv)[0])
    flags = {_FLAG_SETTINGS[k]: v for k, v in given.items() if k in _FLAG_SETTINGS}
    flags["fsdp1"] = {field: given[flag] for flag, field in FLAG_FIELDS.items() if given.get(flag) is not None}
    if flags.get("method") == "all":
        flags.pop("method")
    if "gpu" in flags:
        flags["gpu"] = str(flags["gpu"]).lower()
    if "deepspeed" in flags:
        flags["method"] = "deepspeed"
    return flags


def spec_from_args(args: argparse.Namespace, argv: list[str], build_parser) -> tuple[RunSpec, ConfigReport]:
    """``python -m estimator --config FILE ...``: the spec the configs describe, the typed flags overriding."""
    if args.from_run:
        raise ValueError("config: --config and --from-run describe the run twice; give one of them")
    return spec_from_configs(args.config, explicit_flags(build_parser, argv))


def plan_args_from_configs(args: argparse.Namespace, argv: list[str], build_parser) -> ConfigReport:
    """Fill ``plan``'s arguments from the configs (explicit flags win). The plan still searches methods,
    micro-batches and checkpointing; the configs give the model, GPU count, lengths, precision family,
    optimizer, attention, LoRA and the loop. Returns the report to print."""
    flags = explicit_flags(build_parser, argv)
    flags.pop("method", None)
    flags.pop("fsdp1", None)  # the --fsdp-* flags apply to the plan's fsdp1 row over the configs' FSDP1 settings
    spec, report = spec_from_configs(args.config, flags)
    t = spec.training
    if spec.parallel.method == "fsdp1":
        args.fsdp1_base = spec.parallel.fsdp1
    args.model, args.gpus = spec.model, spec.parallel.world_size
    args.gpu = args.gpu or spec.gpu
    keep = lambda name, value: value if flags.get(name) is None else getattr(args, name)  # noqa: E731
    args.seq_len = keep("seq_len", t.seq_len)
    args.optimizer = keep("optimizer", t.optimizer)
    args.attn = keep("attn", t.attn)
    args.lora_rank = keep("lora_rank", t.lora_rank)
    args.lora_targets = keep("lora_targets", t.lora_targets)
    args.lora_dropout = keep("lora_dropout", t.lora_dropout)
    args.loop = keep("loop", t.loop)
    args.grad_sync = keep("grad_sync", t.grad_sync)
    args.outputs_fp32 = keep("outputs_fp32", t.outputs_fp32)
    args.ce = keep("ce", None if t.ce == "standard" else t.ce)
    args.ce_chunks = keep("ce_chunks", t.ce_chunks if t.ce == "chunked" else None)
    args.activation_offload = keep("activation_offload", t.activation_offload or None)
    args.ckpt_reentrant = keep("ckpt_reentrant", t.ckpt_reentrant)
    if args.precision is None:
        args.precision = _plan_precision(spec)
    if args.global_batch is None:
        args.global_batch = t.micro_batch_size * t.grad_accum_steps * spec.parallel.dp
        report.notes.append(f"global batch {args.global_batch} = micro-batch {t.micro_batch_size} x accumulation "
                            f"{t.grad_accum_steps} x {spec.parallel.dp} GPUs; the plan searches the split and the "
                            f"method (the configs chose {spec.parallel.method})")
    if t.qlora:
        report.not_modelled.append("qlora: the planner does not search 4-bit bases; planned as 16-bit LoRA")
    return report


def _plan_precision(spec: RunSpec) -> str:
    """The planner gives every method one precision: the configs' 16-bit family with fp32 masters (what the
    sharded methods run), or pure bf16 / fp32 as read."""
    precision = spec.training.precision
    if precision.startswith(("amp_", "mixed_")):
        return "mixed_" + precision.split("_", 1)[1]
    return precision
