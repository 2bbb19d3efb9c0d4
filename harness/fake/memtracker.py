"""Second oracle, independent of the estimator's code: torch's ``MemTracker`` over the real transformers model.

Shares nothing with ``estimator.profiler`` or ``harness.fake.trace``: the model is built here from an HF config
dict (``AutoModelForCausalLM.from_config``), trained by this module's own loop, and measured by torch's
``torch.distributed._tools.mem_tracker.MemTracker`` (``FSDPMemTracker`` for FSDP2, on torch's fake process
group). ``peak_bytes`` returns the peak of live device memory (raw storage bytes, unrounded) over two training
steps at one (micro-batch, seq_len), in steady state: one untracked warm-up step first, so the optimizer
states exist as in every step after the first (the two-step peak of a fresh run is the same: step 1 of a fresh
run holds less, and its optimizer step ends with the same states).

Options (each a choice a real run makes):

* ``loop``: ``trainer`` (``loss = model(**batch).loss``, the output object dropped before ``backward()``;
  HF Trainer, torchtune) or ``manual`` (``outputs = model(**batch); loss = outputs.loss; loss.backward();
  optimizer.step(); optimizer.zero_grad()``: ``outputs`` lives through backward and until the next forward
  rebinds it). Both: AdamW ``foreach=True``, ``zero_grad(set_to_none=True)``.
* ``batch``: ``full`` (every sequence full length, attention mask all ones: transformers reads the mask, finds
  no padding and skips the 4-D mask for SDPA: ``is_causal=True``, ``enable_gqa`` instead of ``repeat_kv``) or
  ``padded`` (some padding: the 4-D mask is built, converted per layer by SDPA and ``repeat_kv`` runs). On fake
  tensors transformers cannot read the mask and always takes the padded path; ``full`` answers its two
  questions (``is_tracing``, ``fast_all``) as the data would.
* ``kernels``: ``cuda`` (``harness.fake.cuda_kernels``: SDPA's CUDA backend choice, CUDA's dropout; the
  optimizer's ``step`` scalars are not counted: on CUDA they live on the host) or ``cpu`` (what a plain fake
  trace on the CPU runs, e.g. the trace of issue 13's report).
* ``precision``: fp32 / bf16 (weights and AdamW in that dtype), mixed_bf16 / mixed_fp16 (16-bit weights and
  grads, fp32 masters stepped by AdamW, each 16-bit grad converted and freed at ``step``, as the harness's
  torch methods run them), amp_bf16 / amp_fp16 (fp32 weights, ``torch.autocast`` on the CPU: its op lists
  differ from CUDA's, so amp points are CPU autocast).
* ``grad_ckpt``: non-reentrant activation checkpointing on every decoder layer, as HF enables it.
* ``lora_rank`` / ``lora_targets`` / ``lora_dropout``: peft's ``LoraConfig`` applied by ``get_peft_model`` after
  checkpointing is enabled (adapters in fp32 over 16-bit weights: peft's ``autocast_adapter_dtype``); the
  optimizer steps the adapters only.
* ``outputs_fp32``: the forward wrapped in accelerate's own ``convert_outputs_to_fp32`` (what
  ``Accelerator.prepare_model`` does under bf16/fp16 mixed precision): the output object holds fp32 copies.

CLI: ``python -m harness.fake.memtracker --model Qwen/Qwen2.5-0.5B --precision bf16 --attn sdpa -b 4 -s 512
[--ckpt] [--loop manual] [--batch padded] [--kernels cpu] [--layers N] [--fsdp N --rank R]`` prints one JSON
line. Errors: one line, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOOPS = ("trainer", "manual")
BATCHES = ("full", "padded")
KERNELS = ("cuda", "cpu")
PRECISIONS = ("fp32", "bf16", "mixed_bf16", "mixed_fp16", "amp_bf16", "amp_fp16")
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_REPO = Path(__file__).resolve().parents[2]
_CONFIG_DIRS = (_REPO / "estimator" / "catalogue" / "models", _REPO / "harness" / "assets" / "models")


@dataclass(frozen=True)
class Variant:
    """What fixes the built model and optimizer (every (b, s, loop, batch) point can reuse one build)."""

    precision: str = "bf16"
    attn: str = "sdpa"
    grad_ckpt: bool = False
    kernels: str = "cuda"
    fsdp_world: int = 1
    rank: int = 0
    # FSDP1 (FullyShardedDataParallel per decoder layer, then the root) with this sharding strategy instead of
    # FSDP2; torch's defaults otherwise (use_orig_params=False: MemTracker hooks every module parameter's
    # gradient accumulation, and with use_orig_params the layers' parameters are non-leaf views in forward).
    fsdp1: str | None = None
    # LoRA by peft's own ``get_peft_model`` (0: full fine-tuning); targets "auto" leave peft its per-architecture
    # default, else "all-linear" or comma-separated module names.
    lora_rank: int = 0
    lora_targets: str = "auto"
    lora_dropout: float = 0.0
    # The long-context techniques (``harness.fake.long_context``): torchtune's chunked / Liger's fused loss, saved
    # activations offloaded to the host, and which layers checkpoint (every-k:K, selective-ops; needs grad_ckpt).
    ce: str = "standard"
    ce_chunks: int = 8
    activation_offload: bool = False
    ckpt_policy: str = ""


@dataclass
class Built:
    variant: Variant
    model: Any
    optimizer: Any
    mode: Any
    vocab_size: int
    step_scalars: list = field(default_factory=list)
    process_group: bool = False


def load_model_config(name: str) -> dict[str, Any]:
    """An HF config dict: a JSON path, or a catalogue / harness-asset model name ('org/name' or 'tiny-llama')."""
    path = Path(name)
    if not path.is_file():
        stem = name.replace("/", "--")
        path = next((d / f"{stem}.json" for d in _CONFIG_DIRS if (d / f"{stem}.json").is_file()), path)
    if not path.is_file():
        raise ValueError(f"model: no config {name!r} (a JSON path or a name in {', '.join(map(str, _CONFIG_DIRS))})")
    return json.loads(path.read_text())


def with_layers(config: dict[str, Any], layers: int) -> dict[str, Any]:
    config = copy.deepcopy(config)
    for key in _LAYER_KEYS:
        if key in config:
            config[key] = layers
    return config


def _dtypes(precision: str):
    import torch

    half = torch.float16 if precision.endswith("fp16") else torch.bfloat16
    weights = half if precision in ("bf16", "mixed_bf16", "mixed_fp16") else torch.float32
    autocast = half if precision.startswith("amp_") else None
    return weights, autocast


class _MasterAdamW:
    """mixed_*: fp32 masters stepped by foreach AdamW; 16-bit grads converted to the masters' at ``step``."""

    def __init__(self, params, lr: float) -> None:
        import torch

        self.params = list(params)
        self.masters = [p.detach().float().requires_grad_(True) for p in self.params]
        self.inner = torch.optim.AdamW(self.masters, lr=lr, foreach=True)

    def step(self) -> None:
        import torch

        with torch.no_grad():
            for master, param in zip(self.masters, self.params):
                master.grad = None if param.grad is None else param.grad.float()
                param.grad = None
            self.inner.step()
            for master, param in zip(self.masters, self.params):
                param.copy_(master)
                master.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for t in self.params + self.masters:
            t.grad = None

    @property
    def state(self):
        return self.inner.state


def _decoder_layers(model, num_layers: int):
    import torch

    stacks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers]
    if not stacks:
        raise ValueError(f"model: no stack of {num_layers} decoder layers")
    return max(stacks, key=lambda m: sum(p.numel() for p in m.parameters()))


def build(config: dict[str, Any], variant: Variant, lr: float = 1e-5, *, fake: bool = True) -> Built:
    """Fake-tensor model + optimizer of ``variant`` (FSDP2: rank ``variant.rank`` of ``variant.fsdp_world``);
    ``fake=False``: the same program on real CPU tensors (``harness.fake.live_storage``; tiny configs only)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoConfig, AutoModelForCausalLM

    if variant.precision not in PRECISIONS:
        raise ValueError(f"precision: {variant.precision!r} is not one of {', '.join(PRECISIONS)}")
    fields = {k: copy.deepcopy(v) for k, v in config.items()  # transformers rewrites nested settings in place
              if k not in ("_name_or_path", "transformers_version", "architectures")}
    model_type = fields.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **fields)
    hf_config.use_cache = False
    weights, _ = _dtypes(variant.precision)
    if variant.fsdp_world > 1 and variant.precision.startswith("mixed_"):
        weights = torch.float32  # FSDP2 keeps fp32 sharded params and casts per its MixedPrecisionPolicy
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(hf_config, dtype=weights, attn_implementation=variant.attn)
        except ValueError as err:  # an architecture without SDPA (GPT-J, Gemma-2): transformers' default is eager
            if variant.attn != "sdpa" or "does not support" not in str(err):
                raise
            model = AutoModelForCausalLM.from_config(hf_config, dtype=weights, attn_implementation="eager")
    model.config.use_cache = False
    if variant.grad_ckpt and variant.ckpt_policy:
        from harness.fake.long_context import enable_checkpointing

        layers = next(getattr(hf_config, k) for k in _LAYER_KEYS if hasattr(hf_config, k))
        enable_checkpointing(model, _decoder_layers(model, layers), variant.ckpt_policy)
    elif variant.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if variant.ce != "standard":
        from harness.fake.long_context import replace_loss

        replace_loss(model, variant.ce, variant.ce_chunks)
    if variant.lora_rank:
        model = _with_lora(model, variant)
    model.train()
    process_group = False
    if variant.fsdp_world > 1:
        _init_fake_process_group(variant)
        process_group = True
        if variant.fsdp1 is None:
            _shard(model, hf_config, variant)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with mode:
        model.to_empty(device="cpu")
        if variant.fsdp_world == 1 or variant.fsdp1 is not None:
            model.tie_weights()
        if variant.fsdp1 is not None:
            with _fsdp1_on_fake_tensors():
                model = _shard_fsdp1(model, hf_config, variant)
        params = [p for p in model.parameters() if p.requires_grad]
        if variant.precision.startswith("mixed_") and variant.fsdp_world == 1:  # FSDP: fp32 shards are masters
            optimizer = _MasterAdamW(params, lr)
        else:
            optimizer = torch.optim.AdamW(params, lr=lr, foreach=True)
    return Built(variant, model, optimizer, mode, int(config["vocab_size"]), process_group=process_group)


def _with_lora(model, variant: Variant):
    from peft import LoraConfig, get_peft_model

    targets = None if variant.lora_targets == "auto" else (
        "all-linear" if variant.lora_targets == "all-linear" else variant.lora_targets.split(","))
    config = LoraConfig(r=variant.lora_rank, lora_alpha=2 * variant.lora_rank, lora_dropout=variant.lora_dropout,
                        target_modules=targets, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def _init_fake_process_group(variant: Variant) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=variant.rank, world_size=variant.fsdp_world, store=FakeStore())


def _shard(model, hf_config, variant: Variant) -> None:
    """FSDP2 as the harness applies it: ``fully_shard`` on every decoder layer, then on the root."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from harness.fake.units import fp32_kept_modules

    model.tie_weights()
    mesh = init_device_mesh("cpu", (variant.fsdp_world,))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if variant.precision.startswith("mixed_"):
        half = torch.float16 if variant.precision.endswith("fp16") else torch.bfloat16
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
    layers = next(getattr(hf_config, k) for k in _LAYER_KEYS if hasattr(hf_config, k))
    for module in fp32_kept_modules(model):  # one group per dtype (a bf16 model's fp32 router)
        fully_shard(module, **kwargs)
    for layer in _decoder_layers(model, layers):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def _shard_fsdp1(model, hf_config, variant: Variant):
    """FSDP1 as accelerate's TRANSFORMER_BASED_WRAP applies it: one unit per decoder layer class, the root
    (``use_orig_params=False``: see ``Variant.fsdp1``)."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    layers = next(getattr(hf_config, k) for k in _LAYER_KEYS if hasattr(hf_config, k))
    if variant.lora_rank:  # peft's own policy, as the HF Trainer applies it to a PEFT model
        from peft.utils.other import fsdp_auto_wrap_policy

        policy = fsdp_auto_wrap_policy(model)
    else:
        policy = ModuleWrapPolicy({type(layer) for layer in _decoder_layers(model, layers)})
    mixed = None
    if variant.precision.startswith("mixed_"):
        half = torch.float16 if variant.precision.endswith("fp16") else torch.bfloat16
        mixed = MixedPrecision(param_dtype=half, reduce_dtype=torch.float32)
    return FullyShardedDataParallel(model, auto_wrap_policy=policy, mixed_precision=mixed,
                                    sharding_strategy=ShardingStrategy[variant.fsdp1], use_orig_params=False,
                                    device_id=torch.device("cpu"))


@contextlib.contextmanager
def _fsdp1_on_fake_tensors() -> Iterator[None]:
    """FSDP1 tells shared and freed storages apart by ``data_ptr()``, 0 for every fake tensor: compare the
    storage objects and their sizes instead."""
    from torch.distributed.fsdp import _flat_param

    saved = _flat_param._same_storage, _flat_param._data_ptr_allocated
    _flat_param._same_storage = lambda a, b: a.untyped_storage()._cdata == b.untyped_storage()._cdata
    _flat_param._data_ptr_allocated = lambda t: t.untyped_storage().size() > 0
    try:
        yield
    finally:
        _flat_param._same_storage, _flat_param._data_ptr_allocated = saved


def close(built: Built) -> None:
    """Tear down the fake process group of an FSDP build (one rank at a time per process)."""
    import torch.distributed as dist

    if built.process_group and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def _batch_answers(batch: str) -> Iterator[None]:
    """``full``: transformers' padding questions on the fake mask answered as real all-ones data answers them."""
    if batch == "padded":
        yield
        return
    import torch
    from torch._subclasses.fake_tensor import is_fake
    from transformers import masking_utils

    saved = masking_utils.is_tracing, masking_utils.fast_all

    def is_tracing(tensor=None):
        if tensor is not None and is_fake(tensor) and tensor.dtype == torch.bool:
            return saved[0]()  # a fake bool padding mask is data we know; other tracing checks still apply
        return saved[0](tensor)

    def fast_all(tensor):
        return True if is_fake(tensor) else saved[1](tensor)

    masking_utils.is_tracing, masking_utils.fast_all = is_tracing, fast_all
    try:
        yield
    finally:
        masking_utils.is_tracing, masking_utils.fast_all = saved


def _synthetic_batch(b: int, s: int, vocab: int, batch: str):
    import torch

    ids = torch.randint(0, min(vocab, 1000), (b, s))
    mask = torch.ones_like(ids)
    if batch == "padded":
        mask[:, : s // 4] = 0  # content is not read on fake tensors; written for a real-tensor run of the same code
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _unsynced(built: Built, grad_sync: str, last: bool) -> contextlib.AbstractContextManager:
    """A micro-batch before the last under ``grad_sync="last"``: FSDP2's ``set_requires_gradient_sync(False)``,
    FSDP1's ``no_sync()`` (what accelerate's ``no_sync`` calls for each)."""
    if last or grad_sync == "every" or built.variant.fsdp_world == 1:
        return contextlib.nullcontext()
    if built.variant.fsdp1 is not None:
        return built.model.no_sync()

    @contextlib.contextmanager
    def fsdp2_no_sync():
        built.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            built.model.set_requires_gradient_sync(True)
    return fsdp2_no_sync()


def _train_steps(built: Built, b: int, s: int, loop: str, batch: str, steps: int, after_step=None,
                 outputs_fp32: bool = False, accum: int = 1, grad_sync: str = "every") -> None:
    import torch

    weights, autocast = _dtypes(built.variant.precision)
    if outputs_fp32 and autocast is None and weights != torch.float32:
        autocast = weights  # accelerate's mixed precision autocasts the forward over 16-bit weights too
    model, optimizer = built.model, built.optimizer
    if outputs_fp32:  # accelerate's own wrapper, as Accelerator.prepare_model applies it under mixed precision
        from accelerate.utils import convert_outputs_to_fp32

        model = convert_outputs_to_fp32(built.model.forward)
    data = _synthetic_batch(b, s, built.vocab_size, batch)
    outputs = None
    for _ in range(steps):
        for micro in range(accum):
            amp = _forward_contexts(built.variant, autocast)
            with _unsynced(built, grad_sync, micro == accum - 1):
                if loop == "manual":
                    with amp:
                        outputs = model(**data)
                    loss = outputs.loss
                else:
                    with amp:
                        loss = model(**data).loss
                (loss * (1.0 / accum) if accum > 1 else loss).backward()  # the scale the harness's loop applies
            if after_step is not None and micro < accum - 1:  # FSDPMemTracker: one forward per iteration
                after_step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step()
    del outputs


@contextlib.contextmanager
def _forward_contexts(variant: Variant, autocast) -> Iterator[None]:
    """The forward's autocast, and the host offload of what it saves for backward."""
    import torch

    with contextlib.ExitStack() as stack:
        if autocast:
            stack.enter_context(torch.autocast("cpu", dtype=autocast))
        if variant.activation_offload:
            from harness.fake.long_context import offloaded

            stack.enter_context(offloaded())
        yield


def _step_scalars(optimizer) -> list:
    import torch

    state = optimizer.state
    return [s["step"] for s in state.values() if isinstance(s.get("step"), torch.Tensor)]


def _contexts(built: Built, batch: str) -> contextlib.ExitStack:
    from harness.fake.cuda_kernels import cuda_kernels

    stack = contextlib.ExitStack()
    stack.enter_context(built.mode)
    stack.enter_context(_batch_answers(batch))
    if built.variant.fsdp1 is not None:
        stack.enter_context(_fsdp1_on_fake_tensors())
    if built.variant.kernels == "cuda":
        stack.enter_context(cuda_kernels())
    return stack


def warm_up(built: Built) -> None:
    """One untracked step (tiny batch): the optimizer states exist from here on, as in steady state."""
    with _contexts(built, "full"):
        _train_steps(built, 1, 16, "trainer", "full", 1)
    built.step_scalars = _step_scalars(built.optimizer)


def peak_bytes(built: Built, b: int, s: int, loop: str = "trainer", batch: str = "full", *,
               by_category: bool = False, outputs_fp32: bool = False, accum: int = 1, grad_sync: str = "every"
               ) -> int | tuple[int, dict[str, int]]:
    """Peak live bytes over two steady-state steps at (b, s), from MemTracker (FSDPMemTracker for FSDP);
    ``accum`` micro-batches per step, reduced on every one or on the last (``grad_sync``)."""
    if loop not in LOOPS:
        raise ValueError(f"loop: {loop!r} is not one of {', '.join(LOOPS)}")
    if batch not in BATCHES:
        raise ValueError(f"batch: {batch!r} is not one of {', '.join(BATCHES)}")
    if not built.step_scalars:
        warm_up(built)
    tracker = _tracker(built)
    with _contexts(built, batch), tracker:
        # MemTracker keeps per-module stats of one iteration; its peak snapshot spans both
        _train_steps(built, b, s, loop, batch, 2, after_step=tracker.reset_mod_stats, outputs_fp32=outputs_fp32,
                     accum=accum, grad_sync=grad_sync)
    snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
    peak = snapshot["Total"]
    if built.variant.kernels == "cuda":  # AdamW's step counts are host tensors on CUDA
        peak -= sum(t.untyped_storage().nbytes() for t in built.step_scalars)
    if by_category:
        return peak, {str(k): v for k, v in snapshot.items() if k != "Total"}
    return peak


class _NoHook:
    def remove(self) -> None:
        pass


def _skip_frozen_grad_hooks(tracker, model) -> None:
    """MemTracker puts a gradient hook on every module parameter it meets, which torch refuses on a frozen one
    (LoRA's base weights). A frozen parameter never has a gradient, so marking its hooks as installed changes
    nothing it counts: tensors are counted by MemTracker's dispatch mode, the hooks only label gradients."""
    for param in model.parameters():
        if not param.requires_grad:
            tracker._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())


def _tracker(built: Built):
    if built.variant.fsdp_world > 1 and built.variant.fsdp1 is None:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        tracker = FSDPMemTracker(built.model, built.optimizer)
        return tracker
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    _skip_frozen_grad_hooks(tracker, built.model)
    inner = getattr(built.optimizer, "inner", built.optimizer)
    # mixed_*: the fp32 masters are no module's parameters; MemTracker counts them only when named
    tracker.track_external(built.model, inner, *getattr(built.optimizer, "masters", []))
    return tracker


def oracle_peak(config: dict[str, Any], variant: Variant, b: int, s: int, loop: str = "trainer",
                batch: str = "full", layers: int | None = None, outputs_fp32: bool = False) -> int:
    """One point, built from scratch."""
    built = build(with_layers(config, layers) if layers else config, variant)
    try:
        return peak_bytes(built, b, s, loop, batch, outputs_fp32=outputs_fp32)
    finally:
        close(built)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m harness.fake.memtracker", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="catalogue name (org/name), harness asset or JSON path")
    parser.add_argument("--precision", default="bf16", choices=PRECISIONS)
    parser.add_argument("--attn", default="sdpa", choices=("eager", "sdpa"))
    parser.add_argument("-b", "--micro-batch-size", type=int, default=1)
    parser.add_argument("-s", "--seq-len", type=int, default=512)
    parser.add_argument("--ckpt", action="store_true", help="gradient checkpointing")
    parser.add_argument("--loop", default="trainer", choices=LOOPS)
    parser.add_argument("--batch", default="full", choices=BATCHES)
    parser.add_argument("--outputs-fp32", action="store_true",
                        help="wrap the forward in accelerate's convert_outputs_to_fp32 (its mixed precision)")
    parser.add_argument("--kernels", default="cuda", choices=KERNELS)
    parser.add_argument("--layers", type=int, help="decoder depth (default: the config's)")
    parser.add_argument("--fsdp", type=int, default=1, help="FSDP2 world size (1: single GPU)")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    parser.add_argument("--lora-targets", default="auto", help="auto | all-linear | comma-separated module names")
    parser.add_argument("--lora-dropout", type=float, default=0.0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        config = load_model_config(args.model)
        if not 0 <= args.rank < args.fsdp:
            raise ValueError(f"rank: {args.rank} not in 0..{args.fsdp - 1}")
        if args.lora_rank < 0 or not 0 <= args.lora_dropout < 1:
            raise ValueError("lora: the rank must be >= 0 and the dropout in [0, 1)")
        variant = Variant(args.precision, args.attn, args.ckpt, args.kernels, args.fsdp, args.rank,
                          lora_rank=args.lora_rank, lora_targets=args.lora_targets, lora_dropout=args.lora_dropout)
        peak = oracle_peak(config, variant, args.micro_batch_size, args.seq_len, args.loop, args.batch,
                           args.layers, args.outputs_fp32)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"model": args.model, **vars(variant), "micro_batch_size": args.micro_batch_size,
                      "seq_len": args.seq_len, "loop": args.loop, "batch": args.batch, "layers": args.layers,
                      "outputs_fp32": args.outputs_fp32,
                      "peak_bytes": peak, "measured_by": "torch MemTracker, fake tensors"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
