"""``python -m estimator``: per-rank peak GPU memory of a fine-tuning run, or a comparison of every method.

Argument parsing and printing only; all numbers come from ``estimator.api.estimate``. User errors print one
line and exit 2; "does not fit" is not an error (use ``--check`` to gate scripts on it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from estimator.batching.cli_args import add_batching_arguments, batching_from_args
from estimator.options.cap_args import add_cap_arguments, cap_bytes_from_args, run_cap_bytes
from estimator.options.fsdp1_args import add_fsdp1_arguments, fsdp1_from_args
from estimator.options.technique_args import add_technique_arguments, technique_fields, technique_label
from estimator.options.zero_args import add_zero3_leaf_arguments, zero3_leaf_from_args
from estimator.spec import (
    ATTENTIONS,
    BATCHES,
    GRAD_SYNCS,
    LOOPS,
    LORA_DTYPES,
    METHODS,
    OPTIMIZERS,
    PP_ENGINES,
    PP_SCHEDULES,
    PRECISIONS,
    QLORA_PREPS,
    QLORA_QUANTIZERS,
    ParallelSpec,
    RunSpec,
    TrainingSpec,
)

GIB = 1024**3
# The embedded default: the paper's setting (a paper model on 4 x V100-16GB, seq 512, fp16, checkpointing).
DEFAULT = {"model": "facebook/opt-1.3b", "gpus": 4, "micro_batch_size": 4, "seq_len": 512,
           "precision": "mixed_fp16", "grad_ckpt": True, "attn": "eager", "gpu": "v100-16gb"}
COMPARE_METHODS = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp1", "tp", "dp_tp", "zero_offload")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage + line otherwise)
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m estimator", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="catalogue name (--list-models), path to a config.json, or a hub id "
                                   "(with --allow-hub)")
    p.add_argument("--method", choices=(*METHODS, "all"), help="distributed method; 'all' (default) compares all")
    p.add_argument("--gpus", type=int, help="number of GPUs (world size)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (tp; dp_tp)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel degree of a mixture-of-experts model (method fsdp: transformers' "
                        "DistributedConfig(ep_size=N, fsdp_size=gpus))")
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel degree (method fsdp, or dp_tp for cp x tp): torch's ring attention over N "
                        "ranks, each holding seq_len / N tokens; FSDP2 over all gpus (dp x cp) of each TP position, "
                        "as torchtitan")
    p.add_argument("--moe-imbalance", type=float, default=1.0,
                   help="load of the busiest expert relative to balanced routing (bound for skewed routing under --ep)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline-parallel degree (torch.distributed.pipelining; method single: --gpus = pp, "
                        "method fsdp: FSDP2 over gpus / pp ranks per stage, --precision mixed_bf16 as its "
                        "MixedPrecisionPolicy, method tp: --gpus = pp x tp, method dp_tp: --gpus = pp x dp x tp "
                        "(FSDP2 over dp of the TP-split stages); with --grad-ckpt every stage's decoder layers are "
                        "checkpointed, as torchtitan does)")
    p.add_argument("--pp-schedule", choices=PP_SCHEDULES, default="1f1b", help="pipeline schedule (with --pp)")
    p.add_argument("--pp-microbatches", type=int, default=0,
                   help="pipeline micro-batches of --micro-batch-size rows per optimizer step (default: pp)")
    p.add_argument("--pp-virtual", type=int, default=0,
                   help="stages per pipeline rank under interleaved_1f1b (default 2)")
    p.add_argument("--pp-engine", choices=PP_ENGINES, default="torch",
                   help="who runs the pipeline: torch (torch.distributed.pipelining) or deepspeed (PipelineModule + "
                        "PipelineEngine: layers split by parameter count, TrainSchedule; method single, ZeRO 0)")
    p.add_argument("--micro-batch-size", type=int, help="sequences per GPU per micro-step")
    p.add_argument("--seq-len", type=int, help="tokens per sequence")
    p.add_argument("--precision", choices=PRECISIONS)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--grad-ckpt", action="store_true", default=None, help="gradient (activation) checkpointing")
    p.add_argument("--attn", choices=ATTENTIONS)
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (0 = full fine-tuning)")
    p.add_argument("--lora-targets", default="auto", help="auto | all-linear | comma-separated module names")
    p.add_argument("--lora-dropout", type=float, default=None, metavar="P",
                   help="peft's lora_dropout (default 0): above 0 each adapted module keeps a dropout mask")
    p.add_argument("--lora-dtype", choices=LORA_DTYPES, default=None,
                   help="LoRA adapters' dtype: auto (as the method leaves them; peft: fp32) or model (built in the "
                        "model's dtype: Lightning bf16-true / LitGPT, peft autocast_adapter_dtype=False; with "
                        "--qlora: no kbit preparation, everything bf16 as answer.ai fsdp_qlora)")
    p.add_argument("--qlora", action="store_true", help="4-bit base weights (needs --lora-rank)")
    p.add_argument("--qlora-prep", choices=QLORA_PREPS, default=None,
                   help="QLoRA's preparation of the rest: kbit (peft's prepare_model_for_kbit_training, fp32), none "
                        "(bf16; adapters fp32 unless --lora-dtype model) or auto (none with --lora-dtype model)")
    p.add_argument("--qlora-quantizer", choices=QLORA_QUANTIZERS, default=None,
                   help="who quantizes QLoRA's base: transformers (every Linear but the head) or lightning "
                        "(BitsandbytesPrecision nf4-dq, LitGPT: every Linear incl. the head, from fp16)")
    p.add_argument("--qlora-bnb", default=None, metavar="RELEASE",
                   help="the bitsandbytes release the run uses (default: the installed one); before 0.43.2 each "
                        "4-bit Linear keeps its input for backward")
    p.add_argument("--grad-accum-steps", type=int, help="micro-batches per optimizer step (default 1)")
    p.add_argument("--grad-sync", choices=GRAD_SYNCS, help="FSDP under gradient accumulation: reduce the gradients "
                   "on 'every' micro-batch (default: torchtitan, a plain loop, accelerate's sync_each_batch=True) or "
                   "the 'last' only (the HF Trainer and accelerate's accumulate(): every rank holds the unsharded "
                   "gradients in between)")
    p.add_argument("--model-code", metavar="RELEASE", default=None, help="the transformers release whose model code runs (e.g. 4.45): releases allocate differently (before 4.46 the logits are upcast to fp32 inside forward). Default: the release the shipped profiles were traced with; a release with no shipped or cached profile is traced here when installed, else the default is used and the output says so")
    p.add_argument("--loop", choices=LOOPS, help="training loop: 'trainer' (default: HF Trainer, TRL, torchtune drop "
                   "the model's output object before backward) or 'manual' (outputs = model(**batch); "
                   "loss = outputs.loss; loss.backward(): the logits stay alive)")
    p.add_argument("--outputs-fp32", action="store_true", default=None,
                   help="the forward returns fp32 copies of its 16-bit outputs, as accelerate's mixed precision "
                        "wraps it (accelerate scripts, the HF Trainer with bf16/fp16; not DeepSpeed): a manual "
                        "loop then holds fp32 logits; over 16-bit weights (bf16, mixed_*) the forward also runs "
                        "under autocast, LayerNorm, softmax and the loss in fp32")
    p.add_argument("--use-cache", action="store_true", default=None,
                   help="the model's key/value cache stays on in training (its config.json's use_cache, left as "
                        "it is by the HF Trainer, TRL's SFTTrainer and loops that pass no use_cache=False); the "
                        "model code decides what it keeps: Llama-family code turns it off under checkpointing, "
                        "GPTBigCode keeps each layer's fused QKV output until the loss")
    p.add_argument("--ckpt-reentrant", action="store_true", default=None,
                   help="the model's checkpointing is reentrant (use_reentrant=True, the HF Trainer's default "
                        "through transformers 4.x); with --model-code before 4.52, FSDP1 over frozen layers (LoRA) "
                        "then keeps each recomputed layer's input until backward ends")
    p.add_argument("--vocab-size", type=int, default=None, metavar="N",
                   help="rows of the embedding (and untied LM head) after the training script resizes it "
                        "(model.resize_token_embeddings(N), e.g. a tokenizer's added <pad> token); default: the "
                        "model config's vocab_size")
    p.add_argument("--full-range-slices", action="store_true", default=None,
                   help="the run's torch records a SliceBackward for a full-range ':' (torch 2.4 and before; not "
                        "2.11 or 2.13): the causal-LM loss's logits[..., :-1, :] then zero-fills one more "
                        "b x (s-1) x V fp32 gradient in backward, which can change the reserved level by a segment")
    p.add_argument("--batch", choices=BATCHES, help="'full' (default: every row full length, or packed: no "
                   "attention mask) or 'padded' (some rows padded: transformers builds the 4-D mask; with "
                   "--lengths it is set per batch)")
    p.add_argument("--gpu", help="GPU type key (--list-gpus), case-insensitive; with --from-run, the GPU to "
                   "predict the run for instead of the one it ran on")
    p.add_argument("--deepspeed", metavar="DS_CONFIG_JSON", help="read ZeRO stage, offload, precision and "
                                                                  "bucket sizes from a DeepSpeed config")
    p.add_argument("--config", action="append", metavar="FILE", help="read the run from a training config "
                   "(HF/TRL args JSON/YAML, accelerate, DeepSpeed, torchtune, axolotl, LLaMA-Factory; repeatable; "
                   "TOOL:FILE names the tool); flags given as well override it")
    p.add_argument("--from-run", metavar="RUN_DIR", help="predict a harness run (reads RUN_DIR/spec.json)")
    p.add_argument("--coefficients", metavar="FILE", help="residual coefficient JSON (e.g. your own refit)")
    p.add_argument("--alloc-conf", metavar="STRING", default=None,
                   help="PYTORCH_CUDA_ALLOC_CONF the reserved replay uses (default: the environment's, else "
                        "PyTorch's defaults), e.g. expandable_segments:True")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="PNG", help="write the breakdown as a stacked bar chart")
    p.add_argument("--check", action="store_true", help="exit 1 when the run does not fit")
    p.add_argument("--allow-hub", action="store_true", help="fetch unknown model ids' config from the hub")
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom code of hub configs")
    p.add_argument("--list-models", action="store_true", help="list catalogue models")
    p.add_argument("--list-gpus", action="store_true", help="list GPU keys")
    add_fsdp1_arguments(p)
    add_zero3_leaf_arguments(p)
    add_batching_arguments(p)
    add_technique_arguments(p)
    add_cap_arguments(p)
    return p


def with_memory_cap(spec: RunSpec, cap_bytes: int | None) -> RunSpec:
    """``spec`` with the allocator cap (``training.memory_cap_bytes``) when one is given."""
    return spec if cap_bytes is None else spec.replace(**{"training.memory_cap_bytes": cap_bytes})


def _training(args, base: TrainingSpec) -> TrainingSpec:
    pick = lambda value, default: default if value is None else value  # noqa: E731
    techniques = technique_fields(args, base)
    return TrainingSpec(micro_batch_size=pick(args.micro_batch_size, base.micro_batch_size),
                        seq_len=pick(args.seq_len, base.seq_len), precision=pick(args.precision, base.precision),
                        optimizer=args.optimizer if args.optimizer != "adamw" else base.optimizer,
                        grad_ckpt=techniques.pop("grad_ckpt", pick(args.grad_ckpt, base.grad_ckpt)),
                        attn=pick(args.attn, base.attn), **techniques,
                        lora_rank=args.lora_rank or base.lora_rank,
                        lora_targets=args.lora_targets if args.lora_targets != "auto" else base.lora_targets,
                        lora_dropout=pick(args.lora_dropout, base.lora_dropout), qlora=args.qlora or base.qlora,
                        lora_dtype=pick(args.lora_dtype, base.lora_dtype),
                        qlora_prep=pick(args.qlora_prep, base.qlora_prep),
                        qlora_quantizer=pick(args.qlora_quantizer, base.qlora_quantizer),
                        qlora_bnb=pick(args.qlora_bnb, base.qlora_bnb),
                        loop=pick(args.loop, base.loop),
                        batch=pick(args.batch, base.batch), outputs_fp32=pick(args.outputs_fp32, base.outputs_fp32),
                        grad_accum_steps=pick(args.grad_accum_steps, base.grad_accum_steps),
                        grad_sync=pick(args.grad_sync, base.grad_sync),
                        model_code=pick(args.model_code, base.model_code),
                        use_cache=pick(args.use_cache, base.use_cache),
                        ckpt_reentrant=pick(args.ckpt_reentrant, base.ckpt_reentrant),
                        vocab_size=pick(args.vocab_size, base.vocab_size),
                        full_range_slices=pick(args.full_range_slices, base.full_range_slices))


# CPU runs and fake-tensor traces carry gpu "cpu": their allocated level is a GPU's minus the cuBLAS workspace,
# so they are predicted for a GPU (--gpu, else this one) and compared at the allocated level.
CPU_RUN_GPUS = ("cpu", "fake")
CPU_RUN_PREDICT_GPU = "h100-80gb"


def spec_from_args(args) -> tuple[RunSpec, bool]:
    """(spec, compare_all). No model/method given: the embedded default comparison."""
    if args.from_run:
        path = Path(args.from_run)
        path = path / "spec.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"from_run: no spec.json in {args.from_run!r}")
        try:
            spec = RunSpec.from_json(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"from_run: {str(path)!r} is not valid JSON ({err.msg})") from None
        if args.gpu:
            spec = spec.replace(gpu=args.gpu.lower())
        elif spec.gpu in CPU_RUN_GPUS:
            spec = spec.replace(gpu=CPU_RUN_PREDICT_GPU)
        # the cap the run applied (harness memory.cap_gib: not in its spec.json), unless the flags give another
        cap = cap_bytes_from_args(args, spec.gpu)
        return with_memory_cap(spec, cap if cap is not None else run_cap_bytes(path.parent, spec.gpu)), False
    use_default = args.model is None
    base = TrainingSpec(micro_batch_size=DEFAULT["micro_batch_size"], seq_len=DEFAULT["seq_len"],
                        precision=DEFAULT["precision"], grad_ckpt=DEFAULT["grad_ckpt"], attn=DEFAULT["attn"]) \
        if use_default else TrainingSpec()
    training = _training(args, base)
    gpus = args.gpus if args.gpus is not None else (DEFAULT["gpus"] if use_default else 1)
    method = args.method or ("single" if gpus == 1 and args.model else "all")
    gpu = (args.gpu or (DEFAULT["gpu"] if use_default else "h100-80gb")).lower()
    if method == "all" and args.cp != 1:
        raise ValueError("cp: context parallelism runs with FSDP2: name --method fsdp (or dp_tp with --tp) with --cp")
    if method == "all" and args.pp > 1:
        raise ValueError("pp: name the method the pipeline runs with (--method single: --gpus = pp; --method fsdp: "
                         "FSDP2 over gpus / pp ranks per stage; --method tp / dp_tp: TP inside each stage)")
    if method == "all":  # the comparison enumerates methods itself (compare_specs); fsdp1 flags go to its row
        parallel = ParallelSpec(world_size=1, fsdp1=fsdp1_from_args(args, "fsdp1"))
    else:
        tp = args.tp if args.tp is not None else (gpus if method == "tp" else 1)
        parallel = ParallelSpec(method=method, world_size=gpus, tp=tp, fsdp1=fsdp1_from_args(args, method),
                                ep=args.ep, moe_imbalance=args.moe_imbalance, cp=args.cp, pp=args.pp,
                                pp_schedule=args.pp_schedule, pp_microbatches=args.pp_microbatches,
                                pp_virtual=args.pp_virtual, pp_engine=args.pp_engine)
    spec = with_memory_cap(RunSpec(model=args.model or DEFAULT["model"], parallel=parallel, training=training,
                                   gpu=gpu), cap_bytes_from_args(args, gpu))
    if args.deepspeed:
        from estimator.configs.deepspeed_json import spec_from_deepspeed
        from estimator.models.arch import resolve_arch

        base_spec = spec if method != "all" else spec.replace(parallel=ParallelSpec(method="zero2", world_size=gpus)
                                                               if gpus > 1 else ParallelSpec())
        spec = spec_from_deepspeed(args.deepspeed, base_spec, resolve_arch(spec.model).hidden_size)
        return _with_leaf_args(args, spec), False
    return _with_leaf_args(args, spec), method == "all"


def _with_leaf_args(args, spec: RunSpec) -> RunSpec:
    """The ZeRO-3 leaf module flags over the spec's (a --deepspeed file's) settings."""
    zero = zero3_leaf_from_args(args, spec.parallel.method, spec.parallel.zero)
    return spec if zero is spec.parallel.zero else spec.replace(**{"parallel.zero": zero})


def compare_specs(spec: RunSpec, gpus: int) -> list[tuple[str, RunSpec | None, str]]:
    """(label, spec or None, why skipped) for every method on ``gpus`` GPUs."""
    rows = []
    for method in COMPARE_METHODS:
        if method == "single":
            rows.append(("single (1 GPU)", spec.replace(parallel=ParallelSpec()), ""))
            continue
        if gpus < 2:
            rows.append((method, None, "needs >= 2 GPUs"))
            continue
        tps = [gpus] if method == "tp" else ([t for t in range(2, gpus) if gpus % t == 0] if method == "dp_tp"
                                              else [1])
        if not tps:
            rows.append((method, None, f"no 1 < tp < {gpus} divides {gpus}"))
        for tp in tps:
            label = method if method != "dp_tp" else f"dp_tp {gpus // tp}x{tp}"
            try:
                rows.append((label, spec.replace(parallel=ParallelSpec(method=method, world_size=gpus, tp=tp,
                                                                       fsdp1=spec.parallel.fsdp1)), ""))
            except ValueError as err:
                rows.append((label, None, str(err)))
    return rows


def _gib(value: float) -> str:
    return f"{value / GIB:7.2f}"


def _lora_label(t) -> str:
    dropout = f" dropout {t.lora_dropout:g}" if t.lora_dropout else ""
    dtype = (" without kbit preparation (bf16 throughout)" if t.qlora else " adapters in the model's dtype") \
        if t.lora_dtype == "model" else " without kbit preparation (fp32 adapters)" if t.qlora and not t.qlora_kbit_prep \
        else ""
    quantizer = ", every Linear incl. the head 4-bit (Lightning)" if t.qlora_quantizer == "lightning" else ""
    kept = ", 4-bit inputs kept for backward (bitsandbytes < 0.43.2)" if t.qlora_keeps_inputs else ""
    return f", {'QLoRA' if t.qlora else 'LoRA'} r={t.lora_rank}{dropout}{dtype}{quantizer}{kept}" if t.lora else ""


def _loop_label(t) -> str:
    sync = f", gradients reduced on the {t.grad_sync} micro-batch" if t.grad_accum_steps > 1 and \
        t.grad_sync == "last" else ""
    return (f", {t.loop} loop" + (", fp32 outputs" if t.outputs_fp32 else "")
            + (", key/value cache on" if t.use_cache else "") + (f", vocabulary {t.vocab_size:,}" if t.vocab_size else "")
            + (", reentrant checkpointing" if t.ckpt_reentrant else "")
            + (", full-range slices recorded (torch 2.4)" if t.full_range_slices else "")
            + (f", allocator capped at {t.memory_cap_bytes / GIB:.2f} GiB" if t.memory_cap_bytes else "")
            + sync + technique_label(t))


def render_compare(results: list[tuple[str, object, str]], spec: RunSpec, gpus: int) -> str:
    t = spec.training
    head = (f"{spec.model} on {gpus} x {spec.gpu}  |  micro-batch {t.micro_batch_size}, seq {t.seq_len}, "
            f"{t.precision}, {t.optimizer}, attn {t.attn}, checkpointing {'on' if t.grad_ckpt else 'off'}"
            + _lora_label(t) + _loop_label(t))
    lines = [head, "", f"{'method':<16}{'alloc GiB':>10}{'reserved':>10}{'device':>10}{'fits':>6}{'headroom':>10}"
                       f"  {'peak phase':<28}{'host RAM':>9}"]
    capacity = None
    notes: list[str] = []
    for label, est, why in results:
        if est is None:
            lines.append(f"{label:<16}{'-':>10}{'-':>10}{'-':>10}{'-':>6}{'-':>10}  n/a: {why}")
            continue
        capacity = est.capacity_bytes
        host = _gib(est.host_ram_bytes) if est.host_ram_bytes else "      -"
        lines.append(f"{label:<16}{_gib(est.peak_allocated_bytes):>10}{_gib(est.peak_reserved_bytes):>10}"
                     f"{_gib(est.peak_device_bytes):>10}{'yes' if est.fits else 'NO':>6}"
                     f"{_gib(est.headroom_bytes):>10}  {est.phase:<28}{host:>9}")
        notes.extend(n for n in est.notes if n not in notes)
    if capacity:
        capped = (f" (allocator cap {t.memory_cap_bytes / GIB:.2f} GiB + context)"
                  if t.memory_cap_bytes and capacity < get_capacity_bytes(spec.gpu) else "")
        lines.append(f"\ncapacity {capacity / GIB:.2f} GiB per GPU{capped}; peaks are per rank (worst rank).")
    lines.extend(f"note: {n}" for n in notes)
    return "\n".join(lines)


def get_capacity_bytes(gpu_key: str) -> int:
    from estimator.hardware.gpus import get_gpu

    return get_gpu(gpu_key).capacity_bytes or 0


def render_detail(est) -> str:
    s, t = est.spec, est.spec.training
    lines = [f"{s.model}  {s.parallel.method}  world {s.parallel.world_size}"
             + (f" tp {s.parallel.tp}" if s.parallel.tp > 1 else "")
             + (f" cp {s.parallel.cp}" if s.parallel.cp > 1 else "")
             + (f" ep {s.parallel.ep}" + (f" (busiest expert {s.parallel.moe_imbalance:g}x balanced)"
                                        if s.parallel.moe_imbalance != 1 else "") if s.parallel.ep > 1 else "")
             + (f" pp {s.parallel.pp} {s.parallel.pp_schedule} x{s.parallel.microbatches} micro-batches"
                + (" (DeepSpeed's pipeline engine)" if s.parallel.pp_engine == "deepspeed" else "")
                if s.parallel.pp > 1 else "")
             + f"  on {est.gpu_key}",
             f"micro-batch {t.micro_batch_size}, seq {t.seq_len}, {t.precision}, {t.optimizer}, attn {t.attn}, "
             f"checkpointing {'on' if t.grad_ckpt else 'off'}" + _lora_label(t) + _loop_label(t)
             + f"  |  {est.params / 1e9:.3f} B params ({est.trainable_params / 1e9:.3f} B trainable)", ""]
    lines.append(f"{'rank':<6}{'allocated GiB':>14}{'reserved GiB':>14}{'device GiB':>12}  phase "
                 f"(reserved: {est.reserved_source})")
    for r in est.ranks:
        mark = " <- worst" if r.rank == est.worst_rank else ""
        lines.append(f"{r.rank:<6}{_gib(r.peak_allocated_bytes):>14}{_gib(r.peak_reserved_bytes):>14}"
                     f"{_gib(r.peak_device_bytes):>12}  {r.phase}{mark}")
    lines.append("\nbreakdown at the allocated peak (worst rank):")
    for name, value in est.breakdown.items():
        lines.append(f"  {name:<20}{_gib(value)} GiB")
        if name in est.experts_breakdown:
            lines.append(f"    {'routed experts':<18}{_gib(est.experts_breakdown[name])} GiB")
    verdict = "fits" if est.fits else "DOES NOT FIT"
    worst = next(r for r in est.ranks if r.rank == est.worst_rank)
    if est.memory_cap_bytes and worst.allocator_oom:
        verdict += " (OUT OF MEMORY under the allocator cap)"
    elif est.memory_cap_bytes and worst.num_alloc_retries:
        retry = f"release-and-retry, {worst.num_alloc_retries} under the allocator cap"
        verdict += (f" only through {retry}" if est.fits else
                    f" by the safety bound; the replayed steps fit only through {retry}")
    elif est.memory_cap_bytes and worst.gc_released_bytes and not est.fits:
        verdict += " by the safety bound; the replayed steps stay under the allocator cap through its garbage collection"
    of = (f"{est.capacity_bytes / GIB:.2f} GiB (allocator cap {est.memory_cap_bytes / GIB:.2f} GiB + context)"
          if est.memory_cap_bytes and est.capacity_bytes < get_capacity_bytes(est.gpu_key) else
          f"{est.capacity_bytes / GIB:.2f} GiB")
    lines.append(f"\n{verdict}: device peak {est.peak_device_bytes / GIB:.2f} GiB (safety bound "
                 f"{est.upper_bound_bytes / GIB:.2f}) of {of}; headroom {est.headroom_bytes / GIB:.2f} GiB")
    if est.host_ram_bytes:
        lines.append(f"host RAM (offloaded states, all ranks of a node share it): {est.host_ram_bytes / GIB:.2f} "
                     "GiB per rank")
    lines.extend(f"note: {n}" for n in est.notes)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "plan":
        from estimator.io.plan_cli import main as plan_main

        return plan_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.config:
            return _run_configs(args, argv)
        return _run(args)
    except ValueError as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2


def _run_configs(args, argv: list[str]) -> int:
    """One estimate of the spec the user's configs describe, with what was read from them."""
    from estimator.api import estimate
    from estimator.configs.cli import spec_from_args

    spec, report = spec_from_args(args, argv, build_parser)
    spec = with_memory_cap(spec, cap_bytes_from_args(args, spec.gpu))
    est = estimate(spec, args.coefficients)
    if args.plot:
        _plot([est], args.plot)
    if args.json:
        print(json.dumps({**est.to_dict(), "configs": report.to_dict()}, indent=2))
    else:
        print(render_detail(est) + "\n\n" + report.render())
    return 1 if args.check and not est.fits else 0


def _run(args) -> int:
    if args.list_models:
        from estimator.models.arch import catalogue_models

        print("\n".join(catalogue_models()))
        return 0
    if args.alloc_conf is not None:  # every estimate of this process replays under it
        from estimator.api import resolve_alloc_conf

        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = resolve_alloc_conf(args.alloc_conf)
    if args.list_gpus:
        from estimator.hardware.gpus import list_gpus

        for gpu in list_gpus():
            print(f"{gpu.key:<14}{gpu.capacity_bytes / GIB:8.2f} GiB  {gpu.name}")
        return 0
    for name in ("gpus", "micro_batch_size", "seq_len", "tp", "grad_accum_steps"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"{name}: must be a positive integer, got {value}")
    if args.lora_rank < 0:
        raise ValueError(f"lora_rank: must be a positive integer (0 disables LoRA), got {args.lora_rank}")
    if args.allow_hub and args.model:
        from estimator.models.arch import resolve_arch

        resolve_arch(args.model, allow_hub=True, trust_remote_code=args.trust_remote_code)
    varlen = batching_from_args(args)  # (lengths, options) with --lengths
    spec, compare_all = spec_from_args(args)
    epochs: dict[str, dict] = {}
    if compare_all:
        gpus = args.gpus if args.gpus is not None else (DEFAULT["gpus"] if args.model is None else 1)
        results = []
        for label, candidate, why in compare_specs(spec, gpus):
            if candidate is None:
                results.append((label, None, why))
                continue
            try:
                est, epochs[label] = _estimate(candidate, args.coefficients, varlen)
                results.append((label, est, ""))
            except ValueError as err:
                if label.startswith(("tp", "dp_tp")) and str(err).startswith("tp:"):
                    results.append((label, None, str(err)))
                else:
                    raise
        if args.plot:
            _plot([est for _, est, _ in results if est is not None], args.plot)
        if args.json:
            print(json.dumps({label: (_with_epoch(est.to_dict(), epochs.get(label)) if est else {"skipped": why})
                              for label, est, why in results}, indent=2))
        else:
            print(render_compare(results, spec, gpus) + _epoch_text(epochs))
        return 0
    est, epoch = _estimate(spec, args.coefficients, varlen)
    if args.from_run and not args.gpu and _run_gpu(args.from_run) in CPU_RUN_GPUS:
        est.notes.append(f"from_run: measured without a GPU; predicted for {CPU_RUN_PREDICT_GPU} (--gpu names "
                         "another). Compare traced_allocated_bytes: the allocated level less cublas_workspace and "
                         "allocator_rounding, which CPU runs lack")
    if args.plot:
        _plot([est], args.plot)
    print(json.dumps(_with_epoch(est.to_dict(), epoch), indent=2) if args.json
          else render_detail(est) + _epoch_text({"": epoch}))
    return 1 if args.check and not est.fits else 0


def _estimate(spec: RunSpec, coefficients, varlen) -> tuple[object, dict | None]:
    """(estimate, epoch summary): with --lengths, the estimate at the epoch's worst batch."""
    from estimator.api import estimate

    if varlen is None:
        return estimate(spec, coefficients), None
    from estimator.batching.epoch import estimate_epoch

    result = estimate_epoch(spec, *varlen, coefficients)
    return result.estimate, result.summary


def _with_epoch(data: dict, epoch: dict | None) -> dict:
    return {**data, "epoch": epoch} if epoch else data


def _epoch_text(epochs: dict[str, dict | None]) -> str:
    """Each distinct epoch summary once (methods with the same data-parallel degree split it alike)."""
    from estimator.batching.epoch import render_summary

    texts = list(dict.fromkeys(render_summary(e) for e in epochs.values() if e))
    return "".join("\n\n" + text for text in texts)


def _run_gpu(run: str) -> str | None:
    path = Path(run)
    path = path / "spec.json" if path.is_dir() else path
    return json.loads(path.read_text()).get("gpu")


def _plot(estimates: list, path: str) -> None:
    from estimator.io.plot import plot_breakdown

    plot_breakdown(estimates, path)
