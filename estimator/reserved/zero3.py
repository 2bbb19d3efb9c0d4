"""A DeepSpeed ZeRO-3 rank's timeline as the caching allocator sees it (DeepSpeed 0.19, ``stage3.py``,
``partitioned_param_coordinator.py``), read off the H100 snapshots of Llama-3.2-1B ranks
(``benchmarks/zero3_trace_anatomy.py``). Three streams, each with its own pools; their ``record_stream`` frees
complete at once (the GPU keeps up), so every free is a plain one, and since no pool lends blocks to another and
nothing is released after the setup, the reserved peak is the sum of each stream's own: where the side streams'
requests sit among the default stream's does not change it.

* **Default stream, setup** (after transformers' ``zero.Init`` construction, whose partitions DeepSpeed moves to
  the host before an ``empty_cache``, so none of it stays cached): the rank's 16-bit flat partition (every
  trainable tensor's ``ceil(numel / world)`` elements), the fp32 master partition (made twice, the first freed),
  ``initialize_optimizer_states``' fp32 gradient made and dropped, the IPG bucket (``reduce_bucket_size``
  16-bit elements) and the 16-bit gradient partition; then ``create_reduce_and_remove_grad_hooks`` gathers every
  non-persistent trainable tensor once, one at a time, each freed at once.
* **Default stream, each step**: the single-GPU forward and backward at full depth (``estimator.profiler.expand``;
  the parameters are the gathered ones, on the allgather stream; with checkpointing, each recomputation's
  stopped MLP output: ``_recompute_output_made_then_dropped``); each gradient copied into the IPG bucket at its
  hook and freed (a flush first when it would overflow the bucket); after backward the norm's fp64 copy of each
  tensor's gradient partition, one at a time, in ``model.parameters()`` order; the partition's gradients
  flattened and cast to fp32, the flat copy freed; AdamW over the fp32 partition (its states on the first step,
  one ``sqrt`` temporary); the fp32 gradient freed; ``_post_step`` gathers the persistent tensors (under
  ``stage3_param_persistence_threshold``: the norms) into blocks that live until the next backward's
  ``release_and_reset_all``.
* **Reduction stream**: a flush of several gradients concatenates them (``reduce_scatter_coalesced``'s flat
  input, each padded to the world size), freed once reduced. A biased Linear's bias reaches the bucket after its
  weight (the memory-efficient linear's backward order; torch's, the profile's, is the other: ``_Step3.hook``).
* **Allgather stream**: the parameter coordinator's gathers, prefetches, copy-outs and releases
  (``estimator.reserved.zero3_gathers``), placed at the start of each step's ops.

Checked against the four H100 snapshots (2 and 4 ranks, b1 s1024): ``tests/estimator/test_zero3_snapshots.py``.

Under LoRA (peft's adapters; ``bf16`` with DeepSpeed's bf16 masters, or the mixed precisions; no offload, and
checkpointing only full and non-reentrant): ``zero.Init``'s construction leaves the frozen tensors' partitions in the setup
(``_lora_construction``, then ``defragment``'s ``empty_cache``), the flat buffer is the adapters' fp32 and the
masters take the spec's dtype (``_lora_partitions``, ``master_elem_bytes``), the memory-efficient linear holds the
frozen Linears' inputs to backward (``_hold_saved_inputs``), the frozen head's backward workspace follows its input
gradient (``_frozen_head_workspace``), and the coordinator's trace has peft's modules
(``zero3_gathers.modules_of``, with each wrapper's ``lora_A`` an external parameter of it:
``zero3_gathers.external_params``). Checked against the H200 run 03ab897ea7873926: both ranks' plain-free replay
to the byte (``tests/estimator/test_zero3_lora.py``); its measured peaks are 2.5 % / 1.0 % higher by stream-event
timing (``record_stream_caveat``). With gradient accumulation (``_accumulating``, as under full fine-tuning): real
CPU runs of tiny Llamas, each allocation on the stream a GPU run makes it on, replayed on the three streams equal
the generated stream's (``benchmarks/zero3_ckpt_replay.py --lora``, ``docs/error_matrix/zero3_lora_accum_cpu.csv``).
With checkpointing: the recomputation's frozen weights tied to the module that triggered it, recomputed adapters'
storage kept to their backward (``zero3_gathers.emulate``), the embedding in backward
(``enable_input_require_grads``), the held inputs made by the recomputation (``_hold_saved_inputs``);
``docs/error_matrix/zero3_lora_ckpt_cpu.csv``. An adapter on the MLP's output projection moves the recomputation
to its ``lora_B`` (``zero3_gathers.with_recomputation``) and the stopped output to ``lora_B``'s
(``_stopping_linear``); ``docs/error_matrix/zero3_lora_mlp_ckpt_cpu.csv``.

Other architectures (full fine-tuning without checkpointing): the coordinator's module trace is the one the
profile recorded (``estimator.profiler.modules``: every module's pre-forward hook with its direct parameters, every
pre-backward hook as backward ran it), stretched to full depth (``ParamTable.module_trace``,
``zero3_gathers.recorded_modules``); a profile traced without it keeps the prior (``why_not_zero3``). Checked
against real CPU runs of tiny OPT, GPT-NeoX, BLOOM and GPT-2 (``benchmarks/zero3_arch_replay.py``,
``docs/error_matrix/zero3_arch_cpu.csv``). Full non-reentrant checkpointing too, the stopped output being the
layer's last Linear's (``_last_projection`` off the recorded trace: GPT-NeoX, BLOOM); where the hidden states are
dropped out after the MLP (OPT, GPT-2: ``_drops_out_hidden_states``) the recomputation runs before that Linear's
backward fetch and stops past it, with no output to drop (``docs/error_matrix/zero3_arch_ckpt_cpu.csv``).

Reentrant checkpointing (``ckpt_reentrant``, Llama-style decoders without LoRA): the coordinator's trace is
``zero3_gathers.emulate(reentrant=True)``'s (the whole recomputation before the layer's first backward fetch); on
the default stream the recomputation makes the stopped output and the layer's output too, and the checkpoint
keeps its hidden-states input, its incoming gradient and that output to its backward's end, its keyword inputs
to backward's end (``_reentrant_lifetimes``). Real DeepSpeed runs on CPU of a tiny Llama, all three streams
request for request (``benchmarks/zero3_arch_replay.py --archs llama --ckpt --reentrant``,
``docs/error_matrix/zero3_reentrant_cpu.csv``).

LoRA on those other architectures (no checkpointing): the frozen Linears whose inputs the memory-efficient linear holds are the trace's
(those whose input needs a gradient: ``_traced_linears``), their inputs found in the layer's events from its last
Linear back (``_held_by_trace``) and each freed once its Linear's backward made the input's gradient
(``docs/error_matrix/zero3_arch_lora_cpu.csv``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from estimator.methods.long_context import checkpointed
from estimator.methods.state import _linear_input_key, zero_layout
from estimator.models.params import ParamInfo
from estimator.models.zero3_leaf import table_leaves
from estimator.profiler.expand import ALLOC, FREE, FREE_PREVIOUS, Expansion, ExpansionError
from estimator.reserved.accumulate import MicroSteps
from estimator.reserved.fsdp import _Builder, method_expansion
from estimator.reserved.timeline import Setup, model_order
from estimator.reserved.zero import FP32, FP64, REDUCTION, _backward_ops, _grad_params, _Step
from estimator.reserved.zero3_gathers import _layer_of, emulate, is_adapter
from estimator.spec import ckpt_every

ALLGATHER = 2  # allocator stream of the coordinator's gathers (REDUCTION = 1: the reduce-scatter's)
LAYER_BLOCKS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def why_not_zero3(spec, table: list[ParamInfo] | None = None) -> str | None:
    """Why this ZeRO-3 spec's reserved peak cannot be replayed (None: it can). ``table``: the parameter table, for
    the module structure the coordinator's trace is modelled on."""
    parallel, training = spec.parallel, spec.training
    zcfg = parallel.zero
    if zcfg.offload_param:
        return "zero3 with parameter offload: not in the replay yet"
    if training.qlora:
        return "zero3 with QLoRA: the packed weights are built without zero.Init, not in the replay"
    if training.lora and training.grad_ckpt and training.ckpt_policy:
        return ("zero3 with LoRA and every-k checkpointing: checked against runs with every layer checkpointed "
                "only")
    if training.lora and zcfg.offload_optimizer:
        return "zero3 with LoRA and optimizer offload: not checked against a run yet"
    if zcfg.offload_optimizer and (training.grad_accum_steps > 1 or training.grad_ckpt):
        return "zero3 with optimizer offload and accumulation or checkpointing: not checked against a run yet"
    if not zcfg.overlap_comm_for(3) or not zcfg.contiguous_gradients or not zcfg.reduce_scatter:
        return "zero3 without overlap_comm, contiguous_gradients or reduce_scatter: not in the replay yet"
    if parallel.world_size < 2:
        return "zero3 on one GPU: nothing is gathered"
    if training.precision not in ("mixed_bf16", "mixed_fp16") and not (training.lora and training.precision == "bf16"):
        return f"zero3 under {training.precision}: not in the replay yet"
    if training.optimizer != "adamw":
        return f"zero3 with {training.optimizer}: only AdamW's step over the partition is checked"
    if training.grad_ckpt and training.ckpt_reentrant and training.lora:
        return ("zero3 with LoRA and reentrant checkpointing: checked without LoRA only "
                "(docs/error_matrix/zero3_reentrant_cpu.csv)")
    if training.grad_ckpt and training.ckpt_policy and ckpt_every(training.ckpt_policy) is None:
        return f"zero3 with {training.ckpt_policy} checkpointing: not in the replay yet"
    if training.grad_ckpt and training.activation_offload:
        return "zero3 with activation checkpointing and offload: not checked against a run yet"
    if table is not None:
        reason = _why_not_module_trace(table, training)
        if reason is not None:
            return reason
        if training.grad_ckpt and training.ckpt_reentrant and not llama_like(table):
            return ("zero3 with reentrant checkpointing outside Llama-style decoders: checked on Llama's only "
                    "(docs/error_matrix/zero3_reentrant_cpu.csv)")
        if training.grad_ckpt and table_leaves(zcfg, table):
            return ("zero3 with ZeRO-3 leaf modules (DeepSpeed's default for Mixtral's, Qwen2-MoE's and "
                    "Qwen3-MoE's MoE blocks, or zero.leaf_*) and checkpointing: the recomputation's fetches inside "
                    "a leaf are not in the replay yet")
        if partition_numel(table, parallel.world_size) > zcfg.sub_group_size:
            return "zero3 with more than one optimizer sub-group: not in the replay yet"
    return None


def recorded_trace(table: list[ParamInfo]) -> tuple | None:
    """The profile's recorded module trace where it stands for the derived one (``zero3_gathers.modules_of``):
    for tables that are not Llama's structure (None: derive it, or there is none)."""
    return None if llama_like(table) else getattr(table, "module_trace", None)


def _why_not_module_trace(table: list[ParamInfo], training) -> str | None:
    """Why the coordinator's module trace is not known for this table (None: it is): Llama-style decoders'
    is derived from the table (``zero3_gathers.modules_of``); other architectures' is the profile's recorded one
    (``ParamTable.module_trace``; under LoRA the frozen Linears' held inputs read off it, ``_traced_linears``,
    without checkpointing); checkpointing there: every layer only (a dropout after the MLP:
    ``_drops_out_hidden_states``)."""
    if llama_like(table):
        return None
    if recorded_trace(table) is None:
        return ("zero3: the coordinator's module trace is derived for Llama-style decoders, or recorded in the "
                "profile (not in this one, or its layers do not run alike)")
    if training.lora and training.grad_ckpt:
        return ("zero3 with LoRA and checkpointing outside Llama-style decoders: checked without checkpointing "
                "only (docs/error_matrix/zero3_arch_lora_cpu.csv)")
    if training.grad_ckpt and training.ckpt_policy:
        return ("zero3 with every-k checkpointing outside Llama-style decoders: checked with every layer "
                "checkpointed only")
    return None


def record_stream_caveat(spec) -> str | None:
    """What a ZeRO-3 LoRA replay leaves out (None elsewhere): it takes every ``record_stream`` free when
    requested, but under LoRA the default stream's backward computes no base-model weight gradients, the CPU runs
    further ahead, and a gathered copy freed on the allgather stream can wait for the default stream while that
    stream's next gathers are allocated (docs/allocator.md, ZeRO-3 with LoRA)."""
    if spec.parallel.method != "zero3" or not spec.training.lora:
        return None
    return ("zero3 with LoRA: record_stream frees taken when requested (the plain-free order); the allgather "
            "stream's can wait on the default stream's kernels: the H200 run 03ab897ea7873926 measured 2.5 % "
            "(rank 0) and 1.0 % (rank 3) above this replay")


def master_elem_bytes(training) -> int:
    """Element size of DeepSpeed's master weights and optimizer states: pure bf16 runs with
    ``bf16_master_weights_and_grads`` and ``bf16_optimizer_states`` (``harness/methods/deepspeed.py``), the
    mixed precisions keep them in fp32."""
    return 2 if training.precision == "bf16" else FP32


def recomputed_layers(training, num_layers: int) -> frozenset[int]:
    """The decoder layers whose forward backward runs again (non-reentrant checkpointing, every layer or
    every-k's), each with its fetches (``zero3_gathers.with_recomputation``)."""
    if not training.grad_ckpt:
        return frozenset()
    every = ckpt_every(training.ckpt_policy)
    on = checkpointed(num_layers, every) if every is not None else [True] * num_layers
    return frozenset(i for i, layer_on in enumerate(on) if layer_on)


def llama_like(table: list[ParamInfo]) -> bool:
    """Every decoder layer holds ``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj`` and two norms, every
    module one tensor (no biases), a projection possibly a peft LoRA wrapper (its frozen ``base_layer`` and one
    ``lora_A`` / ``lora_B`` pair): the structure ``zero3_gathers.modules_of`` orders as Llama's forward runs."""
    layers: dict[int, list[str]] = {}
    for p in table:
        if not p.name.endswith(".weight"):
            return False
        if p.layer is not None and not is_adapter(p):
            module = p.name.rsplit(".", 1)[0].removesuffix(".base_layer")
            layers.setdefault(p.layer, []).append(module.split(f".{p.layer}.", 1)[1])
    if not layers:
        return False
    expected = sorted([f"{block}.{leaf}" for block, leaves in LAYER_BLOCKS.items() for leaf in leaves]
                      + ["input_layernorm", "post_attention_layernorm"])
    return all(sorted(modules) == expected for modules in layers.values()) and _adapters_wrap_projections(table)


def _adapters_wrap_projections(table: list[ParamInfo]) -> bool:
    """Each wrapped projection holds one ``lora_A`` / ``lora_B`` pair (one adapter) and its ``base_layer``."""
    names = {p.name for p in table}
    for p in table:
        if ".lora_A." in p.name:
            projection, adapter = p.name.split(".lora_A.")
            if {f"{projection}.lora_B.{adapter}", f"{projection}.base_layer.weight"} - names:
                return False
    return sum(".lora_A." in p.name for p in table) == sum(".lora_B." in p.name for p in table)


def linear_weight_of_bias(table: list[ParamInfo]) -> dict[int, ParamInfo]:
    """id(bias) -> weight of each biased ``nn.Linear``, whose forward under ``zero.Init`` is DeepSpeed's
    memory-efficient linear (``F.linear`` replaced by ``zero3_linear_wrap``). Told apart from transformers'
    ``Conv1D`` (GPT-2; ``torch.addmm``, torch's own backward) by the weight's layout: a Linear's is
    ``(out, in)``, its bias ``out`` long; a Conv1D's ``(in, out)``. A table with any transposed biased weight
    is taken for a Conv1D model throughout (its square weights cannot tell)."""
    pairs = _biased_linears(table)
    if _conv1d_model(pairs):
        return {}
    return {id(b): w for b, w in pairs}


def unsaved_by_recomputation(table: list[ParamInfo]) -> frozenset[str]:
    """Names of the trainable tensors a checkpointed layer's recomputation does not save for backward: a
    ``Conv1D``'s bias (GPT-2: ``torch.addmm`` saves its two matrices, not the added bias), so its gathered copy
    goes at the recomputation's release; the memory-efficient linear saves a Linear's bias with its weight
    (``zero3_gathers.emulate``'s ``saved``; a real GPT-2 run on CPU: docs/error_matrix/zero3_arch_ckpt_cpu.csv)."""
    pairs = _biased_linears(table)
    return frozenset(b.name for b, _ in pairs) if _conv1d_model(pairs) else frozenset()


def _biased_linears(table: list[ParamInfo]) -> list[tuple[ParamInfo, ParamInfo]]:
    """(bias, weight) of each 2-D ``linear`` weight with a bias beside it."""
    by_name = {p.name: p for p in table}
    pairs = []
    for p in table:
        weight = by_name.get(p.name.removesuffix("bias") + "weight") if p.name.endswith(".bias") else None
        if weight is not None and weight.module_kind == "linear" and len(weight.shape) == 2:
            pairs.append((p, weight))
    return pairs


def _conv1d_model(pairs: list[tuple[ParamInfo, ParamInfo]]) -> bool:
    """Whether any biased weight is stored ``(in, out)`` (a ``Conv1D``'s layout: ``linear_weight_of_bias``)."""
    return any(w.shape[0] != b.numel for b, w in pairs)


def partition_numel(table: list[ParamInfo], world: int) -> int:
    """Elements of the rank's flat partition: every trainable tensor's ``ceil(numel / world)``."""
    return sum(math.ceil(p.numel / world) for p in table if p.trainable)


def _aligned_bytes(p: ParamInfo, world: int) -> int:
    return math.ceil(p.numel / world) * world * p.elem_bytes


def zero3_setup(table: list[ParamInfo], world: int, elem16: int, bucket_numel: int, persistence: int,
                offload_optimizer: bool = False, master_elem: int = FP32) -> Setup:
    """The default stream's allocations before the first step (module docstring). ``offload_optimizer``: the
    fp32 master partition, its gradient and the 16-bit gradient partition (``grad_partitions_flat_buffer``) are
    made on the host (``self.device`` is the CPU), so only the 16-bit partition and the IPG bucket are the GPU's.
    ``master_elem``: the master weights' and optimizer states' element size (2 under DeepSpeed's
    ``bf16_master_weights_and_grads``). Under LoRA (peft adapters in the table) the frozen tensors' partitions
    stay on the device: ``_lora_construction``."""
    partition = partition_numel(table, world)
    build = _SetupBuilder()
    lora = any(is_adapter(p) for p in table)
    if lora:
        _lora_construction(build, table, world, elem16)
        build.empty_cache_before = len(build.allocations)  # defragment's empty_cache, before the flat buffer
    if offload_optimizer:
        build.alloc("zero3.fp16_partition", partition * elem16)
        build.alloc("zero3.ipg_bucket", bucket_numel * elem16)
    elif lora:
        _lora_partitions(build, table, world, elem16, bucket_numel, master_elem)
    else:
        build.alloc("zero3.fp16_partition", partition * elem16)
        first = build.alloc("zero3.fp32_partition_first", partition * FP32)
        build.alloc("zero3.fp32_partition", partition * FP32)
        build.free(first)
        build.free(build.alloc("zero3.initial_grad", partition * FP32))
        build.alloc("zero3.ipg_bucket", bucket_numel * elem16)
        build.alloc("zero3.grad_partition", partition * elem16)
    for p in model_order(table):
        if p.trainable and p.numel >= persistence:
            build.free(build.alloc(f"zero3.hook_gather.{p.name}", _aligned_bytes(p, world)))
    return build.setup()


class _SetupBuilder:
    """A ``Setup`` built in order: each free runs right after the latest allocation."""

    def __init__(self) -> None:
        self.allocations: list[tuple[str, int]] = []
        self.frees: dict[int, list[int]] = {}
        self.empty_cache_before: int | None = None

    def alloc(self, name: str, nbytes: int) -> int:
        self.allocations.append((name, nbytes))
        return len(self.allocations) - 1

    def free(self, *indices: int) -> None:
        self.frees.setdefault(len(self.allocations) - 1, []).extend(indices)

    def setup(self) -> Setup:
        return Setup(self.allocations, [], [], tuple((at, tuple(ks)) for at, ks in self.frees.items()),
                     empty_cache_before=self.empty_cache_before)


def _lora_construction(build: _SetupBuilder, table: list[ParamInfo], world: int, elem16: int) -> None:
    """What a peft model under ZeRO-3 leaves on the device before ``defragment`` (H200 run 03ab897ea7873926's
    trace, every tensor of at least 16 KiB): transformers builds the model under ``zero.Init``, each tensor made
    whole, partitioned (``ceil(numel / world)`` elements of its own) and the whole freed, in creation order, a
    tied head made last; loading gathers each tensor whole and frees it, the head's partition freed as the
    weights are tied. peft then makes the adapters in the model's dtype, casts them to their own (fp32: peft's
    ``autocast_adapter_dtype``), and the engine partitions them (``_convert_to_zero_parameters``).
    ``defragment`` moves the trainable partitions to the host (freed here) and empties the cache; the frozen
    partitions stay, and so do the segments that hold them."""
    frozen = [p for p in model_order(table) if not is_adapter(p)]
    tied = [p for p in frozen if p.tied_names]
    for p in frozen:
        whole = build.alloc(f"zero3.init.{p.name}", p.numel * p.elem_bytes)
        build.alloc(f"zero3.frozen_partition.{p.name}", math.ceil(p.numel / world) * p.elem_bytes)
        build.free(whole)
    heads = []
    for p in tied:
        whole = build.alloc(f"zero3.init.{p.tied_names[0]}", p.numel * p.elem_bytes)
        heads.append(build.alloc(f"zero3.tied_partition.{p.tied_names[0]}", math.ceil(p.numel / world) * p.elem_bytes))
        build.free(whole)
    for p in frozen:
        build.free(build.alloc(f"zero3.load.{p.name}", _aligned_bytes(p, world)))
    for p, head in zip(tied, heads):
        build.free(build.alloc(f"zero3.load.{p.tied_names[0]}", _aligned_bytes(p, world)), head)
    adapters = [p for p in table if is_adapter(p)]
    made = [build.alloc(f"zero3.adapter.{p.name}", p.numel * elem16) for p in adapters]
    if any(p.elem_bytes != elem16 for p in adapters):
        made = [_cast(build, p, k) for p, k in zip(adapters, made)]
    partitions = []
    for p, k in zip(adapters, made):
        partitions.append(build.alloc(f"zero3.adapter_partition.{p.name}", math.ceil(p.numel / world) * p.elem_bytes))
        build.free(k)
    build.free(*partitions)


def _cast(build: _SetupBuilder, p: ParamInfo, made: int) -> int:
    """peft's cast of an adapter made in the model's dtype to its own: the copy made, the original freed."""
    cast = build.alloc(f"zero3.adapter_cast.{p.name}", p.numel * p.elem_bytes)
    build.free(made)
    return cast


def _lora_partitions(build: _SetupBuilder, table: list[ParamInfo], world: int, elem16: int, bucket_numel: int,
                     master_elem: int) -> None:
    """``_create_fp16_partitions_with_defragmentation``'s flat buffer of the trainable partitions, in their own
    dtype (peft's fp32 adapters); the master partition (``_create_fp32_partitions``): none when the flat buffer
    is already in the master dtype, else converted and cloned, the converted copy freed; then as without LoRA the
    optimizer's initial gradient (made and dropped), the IPG bucket and the gradient partition."""
    trainable = [p for p in table if p.trainable]
    partition = partition_numel(table, world)
    build.alloc("zero3.lp_partition", sum(math.ceil(p.numel / world) * p.elem_bytes for p in trainable))
    if any(p.elem_bytes != master_elem for p in trainable):
        converted = build.alloc("zero3.master_converted", partition * master_elem)
        build.alloc("zero3.master_partition", partition * master_elem)
        build.free(converted)
    build.free(build.alloc("zero3.initial_grad", partition * master_elem))
    build.alloc("zero3.ipg_bucket", bucket_numel * elem16)
    build.alloc("zero3.grad_partition", partition * elem16)


class _Step3(_Step):
    """One ZeRO-3 step's default- and reduction-stream tensors: ZeRO-2's hooks over a bucket made in the setup,
    flushes that concatenate on the reduction stream, and stage 3's norm and optimizer step."""

    def __init__(self, build: _Builder, table: list[ParamInfo], world: int, elem16: int, bucket: int,
                 grad_of: dict, first: bool, optimizer: str, master_elem: int = FP32) -> None:
        super().__init__(build, zero_layout(table, world), 0, 2, elem16, bucket, grad_of, first, optimizer,
                         overlap=True)
        self.table, self.world, self.master_elem = table, world, master_elem
        self.ipg = []  # the IPG bucket is the setup's
        self.weight_of = linear_weight_of_bias(table)
        self.deferred: dict[int, ParamInfo] = {}  # id(weight) -> its bias, hooked once the weight is
        self.hooked: set[int] = set()

    def setup_buckets(self, out: list) -> None:
        return None

    def hook(self, out: list, p: ParamInfo) -> None:
        """A Linear's bias gradient is hooked after its weight's: ``LinearFunctionForZeroStage3.backward``
        makes grad_weight before grad_bias, torch's linear (the profile's step) the bias first, and the hook
        order decides which flush of the IPG bucket the bias joins."""
        weight = self.weight_of.get(id(p))
        if weight is not None and id(weight) in self.grad_of and id(weight) not in self.hooked:
            self.deferred[id(weight)] = p
            return
        super().hook(out, p)
        self.hooked.add(id(p))
        bias = self.deferred.pop(id(p), None)
        if bias is not None:
            self.hook(out, bias)

    def epilogue(self, out: list) -> None:
        for bias in list(self.deferred.values()):  # a weight whose gradient never came (none expected)
            super().hook(out, bias)
        self.deferred = {}
        self.flush(out)

    def flush(self, out: list) -> None:
        """``__reduce_and_partition_ipg_grads``: several gradients concatenated on the reduction stream (one is
        reduced in place); the partition copied into the setup's gradient partition; an oversized gradient (kept
        out of the bucket) freed."""
        if len(self.pending) > 1:
            nbytes = sum(math.ceil(p.numel / self.world) * self.world for p in self.pending) * self.elem16
            self._free(out, self._alloc(out, nbytes, REDUCTION))
        if self.oversized is not None:
            self._free_grad(out, self.oversized)
        self.pending, self.elements, self.oversized = [], 0, None

    def optimizer_step(self, out: list) -> None:
        """The norm's fp64 copy of each tensor's gradient partition, then the flat gradient cast to fp32 and
        AdamW over the fp32 partition."""
        for p in model_order(self.table):
            if p.trainable:
                self._free(out, self._alloc(out, math.ceil(p.numel / self.world) * FP64))
        partition = partition_numel(self.table, self.world)
        flat = self._alloc(out, partition * self.elem16)
        grad = flat
        if self.master_elem != self.elem16:  # _prepare_fp32_grad_for_sub_group's .to(master dtype)
            grad = self._alloc(out, partition * self.master_elem)
            self._free(out, flat)
        self.adamw(out, [partition * self.master_elem], self.first, self.optimizer)
        self._free(out, grad)


class _Step3Offload(_Step3):
    """ZeRO-3 with ``offload_optimizer``: the gradient partitions go to the host as each flush reduces them, and
    the optimizer steps on the host.

    ``partition_grads`` (on the reduction stream, inside the flush, so while the flush's concatenation lives), for
    each reduced tensor in ``ds_id`` order: the partition copied into the host's ``grad_partitions_flat_buffer``,
    then brought back (``grad_buffer.to(device)``: a 16-bit partition on the GPU); at the accumulation boundary
    ``_offload_grad_partition_at_boundary`` takes its norm (``_constant_buffered_norm2``: an fp64 copy, one
    chunk under 250M elements) and copies its fp32 cast into the host's fp32 gradient; the GPU copy goes when
    the loop moves on. After backward nothing but scalars is made on the GPU: the norm is summed on the host,
    the step runs on the host and its copy into the 16-bit partition is made there."""

    NORM_CHUNK = 250_000_000  # _constant_buffered_norm2's buffer_size

    def flush(self, out: list) -> None:
        concatenated = None
        if len(self.pending) > 1:
            nbytes = sum(math.ceil(p.numel / self.world) * self.world for p in self.pending) * self.elem16
            concatenated = self._alloc(out, nbytes, REDUCTION)
        order = {id(p): k for k, p in enumerate(self.table)}  # params_in_bucket.sort(key=ds_id)
        for p in sorted(self.pending, key=lambda q: order[id(q)]):
            self._offload_partition(out, math.ceil(p.numel / self.world))
        if concatenated is not None:
            self._free(out, concatenated)
        if self.oversized is not None:
            self._free_grad(out, self.oversized)
        self.pending, self.elements, self.oversized = [], 0, None

    def _offload_partition(self, out: list, numel: int) -> None:
        on_gpu = self._alloc(out, numel * self.elem16, REDUCTION)
        for start in range(0, numel, self.NORM_CHUNK):
            self._free(out, self._alloc(out, min(self.NORM_CHUNK, numel - start) * FP64, REDUCTION))
        self._free(out, self._alloc(out, numel * FP32, REDUCTION))
        self._free(out, on_gpu)

    def optimizer_step(self, out: list) -> None:
        return None


def _last_projection(table: list[ParamInfo], layer: int) -> ParamInfo:
    """The layer's MLP output projection: the last module with parameters its forward runs, the first its
    backward reaches (Llama's ``mlp.down_proj``; elsewhere read off the recorded module trace)."""
    recorded = recorded_trace(table)
    if recorded is not None:
        in_layer = [params for name, params, _ in recorded[0] if params and _layer_of(name) == layer]
        weight = next(n for n in in_layer[-1] if n.endswith(".weight")) if in_layer else None
        return next(p for p in table if p.name == weight)
    suffix = f"mlp.{LAYER_BLOCKS['mlp'][-1]}.weight"
    return next(p for p in table if p.layer == layer and p.name.replace(".base_layer", "").endswith(suffix))


def _stopped_output_size_index(table: list[ParamInfo], polys: list) -> int:
    """The size index of the MLP output projection's output (``b * s * out_features`` 16-bit elements), made
    by a recomputation before it stops (``_recompute_output_made_then_dropped``). Where that projection is a
    peft LoRA wrapper, the last tensor the layer saves is its ``lora_B``'s input, so the output made before the
    stop is ``lora_B``'s, in the adapter's dtype (``_stopping_linear``)."""
    layer = next(p.layer for p in table if p.layer is not None)
    down = _stopping_linear(table, _last_projection(table, layer))
    index = _per_token_size_index(polys, float(_out_features(table, down) * down.elem_bytes))
    if index is None:
        raise ExpansionError("zero3 with checkpointing: the profile has no tensor of the MLP output's size")
    return index


def _stopping_linear(table: list[ParamInfo], down: ParamInfo) -> ParamInfo:
    """The weight of the Linear whose inputs a checkpointed layer packs last: the MLP output projection's, or
    under a peft LoRA wrapper its (last adapter's) ``lora_B`` (``LoraLayer.forward`` runs ``base_layer``, then
    ``lora_A``, then ``lora_B``; real CPU runs with ``all-linear`` adapters:
    docs/error_matrix/zero3_lora_mlp_ckpt_cpu.csv)."""
    if ".base_layer." not in down.name:
        return down
    prefix = down.name.split(".base_layer.")[0] + ".lora_B."
    return next((p for p in reversed(table) if p.name.startswith(prefix) and p.name.endswith(".weight")), down)


def _drops_out_hidden_states(table: list[ParamInfo], polys: list) -> bool:
    """Whether the profile holds a dropout mask of the hidden states (``b * s * hidden`` bools: the profile is
    traced with CUDA's fused dropout, ``estimator.profiler.cuda_path``). Where a layer's last saved tensor is such a
    mask rather than its MLP output projection's inputs, a checkpointed layer's recomputation runs before that
    projection's backward fetch (``zero3_gathers.recomputed_before_fetch``) and past its forward, so it stops
    with no output of its own to drop (``_recompute_output_made_then_dropped`` is not theirs): real CPU runs of
    tiny OPT and GPT-2, docs/error_matrix/zero3_arch_ckpt_cpu.csv."""
    down = _last_projection(table, next(p.layer for p in table if p.layer is not None))
    return _per_token_size_index(polys, float(_out_features(table, down))) is not None


def _out_features(table: list[ParamInfo], weight: ParamInfo) -> int:
    """A Linear's output width: its bias's length where it has one (a ``Conv1D`` stores ``(in, out)``), else
    the weight's rows."""
    bias = next((p for p in table if p.name == weight.name.removesuffix("weight") + "bias"), None)
    return bias.numel if bias is not None else weight.shape[0]


def _per_token_size_index(polys: list, per_token: float) -> int | None:
    """The size index of a ``b * s * per_token``-byte tensor (None: the profile has none). A micro-batch-1
    regime's polynomials are in ``s`` alone (``b * s`` folded into ``s``): there the ``s`` term stands for it."""
    for term in (4, 1):  # c4 * b * s, else c1 * s
        wanted = [per_token if k == term else 0.0 for k in range(6)]
        for index, poly in enumerate(polys):
            if [float(c) for c in poly] == wanted:
                return index
    return None


def _hold_saved_inputs(body: list, moved: dict[int, int], marks: tuple, saved: tuple, polys: list,
                       recomputation_end=None, linears=None) -> None:
    """DeepSpeed's memory-efficient linear (``LinearFunctionForZeroStage3``, ``zero.Init``'s replacement of
    ``F.linear``) saves each frozen Linear's input, which plain autograd (the profile's step) frees in forward
    (``estimator.methods.state.zero3_saved_linear_input_tensors``: under LoRA a layer's norm outputs and
    down_proj's input, the head's input). So those tensors' frees move from their forward segment to the end
    of their layer's backward segment (the head's: to the end of ``mid_bw``), the blocks staying where they
    were made. Found in the segment as Llama's forward makes them (``_held_in_segment``), or, where the profile's
    recorded module trace stands for Llama's (``linears(layer)``: ``_traced_linears``), a decoder layer's from
    the trace's frozen Linears (``_held_by_trace``), each freed right after the first tensor of its size in the
    layer's backward past the one before (its Linear's input gradient; real CPU runs of GPT-NeoX and BLOOM free
    them so, not at the layer's end). ``body`` and ``moved``
    (old op index -> new) are updated in place; ExpansionError where a held tensor is not found. A checkpointed
    layer's forward saves nothing: its recomputation (``recomputation_end(layer, start)``: the index in ``body``
    where it ends, None for a layer not recomputed) makes the held tensors, kept likewise to the layer's
    backward end."""
    if not saved:
        return

    def bounds(prefix: str, layer: int | None) -> tuple[int, int]:
        """New op indices of the first segment named ``prefix...`` of ``layer``: (start, start of the next one)."""
        k = next(k for k, (name, at_layer, _at) in enumerate(marks) if name.startswith(prefix) and at_layer == layer)
        return moved[marks[k][2]], moved[marks[k + 1][2]]

    by_segment: dict[int | None, list[int]] = {}
    for layer, per_token in saved:
        size_index = _per_token_size_index(polys, per_token)
        if size_index is None:
            raise ExpansionError(f"zero3: the profile has no tensor of a held Linear input's size ({per_token} B "
                                 "per token)")
        by_segment.setdefault(layer, []).append(size_index)
    removed: set[int] = set()
    inserted: dict[int, list] = {}
    for layer, sizes in by_segment.items():
        forward = bounds("mid_fw" if layer is None else "fw", layer)
        backward = bounds("mid_bw" if layer is None else "bw", layer)
        end = None if layer is None or recomputation_end is None else recomputation_end(layer, backward[0])
        if end is not None:
            forward = (backward[0], end)
        backward_end = backward[1] if layer is not None else _after_head_backward(body, *backward, sizes)
        traced = None if linears is None or layer is None else linears(layer)
        if traced is not None:  # each freed once its Linear's backward has made the input's gradient
            after = backward[0]
            for at in _held_by_trace(body, *forward, traced):
                after = _after_head_backward(body, after, backward[1], [body[at][2]])
                removed.add(at)
                inserted.setdefault(after, []).append(body[at])
            continue
        for at in _held_in_segment(body, *forward, sizes):
            removed.add(at)
            inserted.setdefault(backward_end, []).append(body[at])
    _rebuilt(body, moved, removed, inserted)


def _after_head_backward(body: list, start: int, end: int, sizes: list[int]) -> int:
    """Where the head's held input goes: its backward frees it once it has made the input's gradient (the first
    tensor of the input's size in ``mid_bw``), before the loss's tensors go (the segment's end where none)."""
    return next((k + 1 for k in range(start, end) if body[k][0] == ALLOC and body[k][2] in sizes), end)


def _held_in_segment(body: list, start: int, end: int, sizes: list[int]) -> list[int]:
    """Op indices of the frees of the held inputs made in ``body[start:end]`` (a layer's forward segment, or
    ``mid_fw``), by size: a norm's output (Llama's RMSNorm with a frozen weight: ``.to(dtype)`` then the weight
    product, the copy freed right after, ``+a +b -a``; the last ones when fewer are held than the segment has
    norms: the first layer's input norm reads no gradient) or else the last tensor of that size the segment
    makes and frees (down_proj's input, the activation product)."""
    ops = body[start:end]
    freed_at = {op[1]: start + k for k, op in enumerate(ops) if op[0] == FREE}
    made = [op for op in ops if op[0] == ALLOC and op[1] in freed_at]
    found: list[int] = []
    for size_index in dict.fromkeys(sizes):
        wanted = sizes.count(size_index)
        norms = [ops[k + 1][1] for k in range(len(ops) - 2)
                 if ops[k][0] == ALLOC and ops[k + 1][0] == ALLOC and ops[k + 2][0] == FREE
                 and ops[k][2] == ops[k + 1][2] == size_index and ops[k + 2][1] == ops[k][1]
                 and ops[k + 1][1] in freed_at]
        keys = norms[-wanted:] if len(norms) >= wanted else [op[1] for op in made if op[2] == size_index][-wanted:]
        if len(keys) < wanted:
            raise ExpansionError("zero3: a frozen Linear's input that the memory-efficient linear holds is not in "
                                 "the layer's forward")
        found += [freed_at[key] for key in keys]
    return found


def _traced_linears(table: list[ParamInfo], layer: int, polys: list) -> list[tuple[bool, int | None, int | None]]:
    """Each frozen Linear the recorded module trace runs in ``layer``'s forward, one per input tensor (q/k/v read
    one: ``state._linear_input_key``), in forward order: (whether the memory-efficient linear holds its input,
    the size indices of its input and output, ``b * s * features`` 16-bit elements; None: the profile has no
    tensor of that size). Held: its positional input needs a gradient (the trace's count: none in a first layer
    whose branch reads only the frozen embedding's activations, as GPT-NeoX's parallel MLP) and it is an
    ``nn.Linear`` (``F.linear``, which ``zero.Init`` replaces; a ``Conv1D`` runs ``torch.addmm``:
    ``linear_weight_of_bias``)."""
    by_name = {p.name: p for p in table}
    conv1d = _conv1d_model(_biased_linears(table))
    out: list[tuple[bool, int | None, int | None]] = []
    seen: set = set()
    for name, params, grad_inputs in recorded_trace(table)[0]:
        weight = next((by_name[n] for n in params if n.endswith(".weight") and n in by_name), None)
        if (_layer_of(name) != layer or weight is None or weight.module_kind != "linear" or len(weight.shape) != 2
                or weight.trainable or is_adapter(weight) or _linear_input_key(weight.name) in seen):
            continue
        seen.add(_linear_input_key(weight.name))
        features_out = _out_features(table, weight)
        out.append((grad_inputs > 0 and not conv1d,
                    _per_token_size_index(polys, float(weight.numel // features_out * weight.elem_bytes)),
                    _per_token_size_index(polys, float(features_out * weight.elem_bytes))))
    return out


def _held_by_trace(body: list, start: int, end: int, linears: list[tuple[bool, int | None, int | None]]
                   ) -> list[int]:
    """Op indices of the frees of the held inputs made in ``body[start:end]`` (a decoder layer's forward segment
    of a plain-autograd profile), from its frozen Linears (``_traced_linears``): a Linear's input is the
    allocation right before its output, both of their sizes, freed in the segment (plain autograd saves no
    frozen Linear's input; a LayerNorm's statistics may come between). The Linears are matched from the last one back, each at the latest such pair whose
    output precedes the next Linear's input (attention's internals and the residual sums make tensors of the
    hidden size too). A Linear with no such pair reads a tensor autograd saves anyway (a LoRA adapter's or a
    ReLU's): nothing of its own to hold. Real DeepSpeed CPU runs of GPT-NeoX, OPT, BLOOM with peft LoRA:
    docs/error_matrix/zero3_arch_lora_cpu.csv."""
    ops = body[start:end]
    freed_at = {op[1]: start + k for k, op in enumerate(ops) if op[0] == FREE}
    allocs = [op for op in ops if op[0] == ALLOC]
    limit, found = len(allocs), []
    for held, input_index, output_index in reversed(linears):
        pair = next(((i, k) for k in range(limit - 1, 0, -1) if output_index is not None
                     and allocs[k][2] == output_index
                     for i in [_input_before(allocs, k, input_index, output_index)]
                     if i is not None and allocs[i][1] in freed_at), None)
        if pair is None:
            continue
        limit = pair[0]
        if held:
            found.append(freed_at[allocs[pair[0]][1]])
    return found


def _input_before(allocs: list, k: int, input_index: int | None, output_index: int) -> int | None:
    """The latest allocation of the input's size before ``allocs[k]`` with none of the output's size between
    (a LayerNorm's per-token statistics come between its output and the next Linear's)."""
    for i in range(k - 1, -1, -1):
        if allocs[i][2] == input_index:
            return i
        if allocs[i][2] == output_index:
            return None
    return None


def _first_gradient(body: list, layer: int, table: list[ParamInfo], grad_of: dict, start: int) -> int:
    """The index in ``body`` of the layer's first parameter gradient from ``start`` on: its recomputation ends
    before it."""
    grads = {grad_of[id(p)][0] for p in table if p.layer == layer and id(p) in grad_of}
    at = next((i for i in range(start, len(body)) if body[i][0] == ALLOC and body[i][1] in grads), None)
    if at is None:
        raise ExpansionError(f"zero3 with checkpointing: layer {layer} has no gradient after its recomputation")
    return at


def _recompute_output_made_then_dropped(body: list, moved: dict[int, int], layer: int, table: list[ParamInfo],
                                        grad_of: dict, size_index: int, build: _Builder,
                                        layer_output: bool = False) -> int | None:
    """Under ``zero.Init`` a Linear runs DeepSpeed's ``LinearFunctionForZeroStage3``, an autograd Function that
    computes its output before it saves its inputs; torch's own linear saves them first. So a checkpointed
    layer's recomputation, stopping early once the MLP output projection has packed its inputs (the last tensors
    the layer saves), has made that projection's output first, freed as the stop unwinds: one
    ``b * s * hidden`` 16-bit tensor per recomputed layer, right after the recomputation's last allocation,
    which precedes the layer's first gradient. ZeRO-1/2 (torch's linear) have none: their streams match a real
    run's without it (tests/estimator/test_zero3_recompute.py).

    ``layer_output``: a reentrant recomputation does not stop: it also makes the layer's output (the residual
    sum, of the same size), which lives on (``_reentrant_lifetimes``); its key is returned (else None)."""
    grads = {grad_of[id(p)][0] for p in table if p.layer == layer and id(p) in grad_of}
    first_grad = next((i for i, op in enumerate(body) if op[0] == ALLOC and op[1] in grads), None)
    if first_grad is None or not any(op[0] == ALLOC for op in body[:first_grad]):
        raise ExpansionError(f"zero3 with checkpointing: layer {layer} has no gradient after its recomputation")
    after = max(i for i in range(first_grad) if body[i][0] == ALLOC) + 1
    key = build.next_key
    build.next_key += 1
    made = [(ALLOC, key, size_index)]
    output = None
    if layer_output:
        output = build.next_key
        build.next_key += 1
        made.append((ALLOC, output, size_index))
    body[after:after] = made + [(FREE, key, size_index)]
    for index, at in moved.items():
        if at >= after:
            moved[index] = at + len(made) + 1
    return output


def _reentrant_lifetimes(body: list, moved: dict[int, int], marks: tuple, outputs: dict[int, int],
                         hidden_size_index: int, cut: int) -> None:
    """What a reentrant checkpoint (``CheckpointFunction``) keeps to the end of its layer's backward, where a
    non-reentrant one frees it at its last use: the recomputed layer's output (``outputs``: layer -> key), the
    layer's incoming gradient (the backward's argument) and its hidden-states input (``save_for_backward``,
    released with the node's variables once its backward returns). The checkpoint's keyword inputs (attention
    mask, position ids, the rotary ``cos`` / ``sin``: ``partial(layer.__call__, **kwargs)`` is the node's
    ``run_function``) live as long as the nodes, to the end of backward (after its last allocation): a layer
    input made before the first layer's forward that is not the earliest of the hidden states' size
    (``hidden_size_index``). ``cut``: the old op index where the optimizer part begins. Checked against real
    DeepSpeed runs on CPU of a tiny Llama (docs/error_matrix/zero3_reentrant_cpu.csv). ``body`` and ``moved``
    updated in place."""
    order = [(name, layer, moved[at]) for name, layer, at in marks if at in moved]
    first_layer_at = next(at for name, _layer, at in order if name.startswith("fw"))
    born = {op[1]: i for i, op in enumerate(body) if op[0] == ALLOC}
    backward_end = 1 + max(i for i in range(moved[cut]) if body[i][0] == ALLOC)
    inserted: dict[int, list] = {}
    removed: set[int] = set()
    for k, (name, layer, start) in enumerate(order):
        if not name.startswith("bw") or outputs.get(layer) is None:
            continue
        end = order[k + 1][2]
        early = [i for i in range(start, end) if body[i][0] == FREE and born.get(body[i][1], start) < start]
        hidden = min((i for i in early if born[body[i][1]] < first_layer_at and body[i][2] == hidden_size_index),
                     key=lambda i: born[body[i][1]], default=None)
        for i in early:
            keyword = born[body[i][1]] < first_layer_at and i != hidden
            inserted.setdefault(backward_end if keyword else end, []).append(body[i])
            removed.add(i)
        inserted.setdefault(end, []).append((FREE, outputs[layer], hidden_size_index))
    _rebuilt(body, moved, removed, inserted)


def _rebuilt(body: list, moved: dict[int, int], removed: set[int], inserted: dict[int, list]) -> None:
    """``body`` less the ops at ``removed``, with ``inserted[i]`` before old op ``i``; ``moved`` (old op index
    -> new) follows."""
    new_at, out = [], []
    for i, op in enumerate(body):
        out += inserted.get(i, [])
        new_at.append(len(out))
        if i not in removed:
            out.append(op)
    out += inserted.get(len(body), [])
    new_at.append(len(out))
    body[:] = out
    for index, at in moved.items():
        moved[index] = new_at[at]


@dataclass(frozen=True)
class Zero3Step:
    expansion: Expansion
    sizes: list[int]  # bytes of DeepSpeed's tensors, size indices ``base`` + j


def zero3_step(expansion: Expansion, table: list[ParamInfo], world: int, elem16: int, bucket_numel: int,
               optimizer: str, base_size_index: int, polys: list, zcfg,
               recomputed: frozenset[int] = frozenset(), accumulate: int = 1,
               offload_optimizer: bool = False, master_elem: int = FP32, saved_inputs: tuple = (),
               reentrant: bool = False) -> Zero3Step:
    """The expansion with ZeRO-3's events (module docstring); new tensors' sizes take indices from
    ``base_size_index`` on; ``recomputed``: the checkpointed layers (their recomputation's fetches; the
    expansion holds their recomputed activations); ``accumulate``: micro-steps per optimizer step
    (``_accumulating``); ``master_elem``: the master weights' and optimizer states' element size
    (``master_elem_bytes``); ``saved_inputs``: (layer, bytes per token) of each frozen Linear input DeepSpeed's
    memory-efficient linear holds (``_hold_saved_inputs``); ``reentrant``: the checkpoints re-enter
    (``zero3_gathers.emulate``'s). ExpansionError where the step cannot be built."""
    recorded = recorded_trace(table)
    if not llama_like(table) and recorded is None:
        raise ExpansionError("zero3: the coordinator's module trace is derived for Llama-style decoders, or "
                             "recorded in the profile")
    dropped_out = bool(recomputed) and recorded is not None and _drops_out_hidden_states(table, polys)
    gathers = emulate(table, world, steps=2 * accumulate, prefetch_bucket=zcfg.stage3_prefetch_bucket_size,
                      max_live=zcfg.stage3_max_live_parameters, max_reuse=zcfg.stage3_max_reuse_distance,
                      persistence=zcfg.stage3_param_persistence_threshold, checkpointed=recomputed,
                      accumulate=accumulate, recorded=recorded, dropped_out=dropped_out,
                      unsaved=unsaved_by_recomputation(table) if recomputed else frozenset(), reentrant=reentrant,
                      leaves=table_leaves(zcfg, table))
    if accumulate > 1:
        gathers.steps = _within_each_step(gathers.steps)
        # the plain steps' gathers: a step after an optimizer step that ends with one (a cycle's last micro-step
        # after a cycle's first, for the optimizer tail's keys)
        plain = [gathers.steps[0], gathers.steps[2 * accumulate - 1]]
    else:
        plain = gathers.steps
    build = _Builder(expansion.steady.keys, base_size_index)
    stopped_output = _stopped_output_size_index(table, polys) if recomputed and not dropped_out else None
    first_marks, steady_marks = expansion.marks
    persistent = [p for p in model_order(table) if p.numel < zcfg.stage3_param_persistence_threshold]
    # the persistent tensors' gathered copies keep the same keys from step to step (the next step frees them)
    kept_keys, start, ends = build.next_key, build.next_key + len(persistent), []

    def built(first: bool, gathered: list | None = None, kept_freed: bool | None = None
              ) -> tuple[list, dict[int, int], list, list]:
        """``gathered``: the allgather stream's ops (default: the plain step's); ``kept_freed``: whether
        backward's end frees the persistent tensors ``_post_step`` gathered (default: in every step but the
        first)."""
        events, marks = (expansion.first, first_marks) if first else (expansion.steady, steady_marks)
        build.next_key = start
        step = (_Step3Offload if offload_optimizer else _Step3)(
            build, table, world, elem16, int(bucket_numel), _grad_params(expansion, events.ops, table), first,
            optimizer, master_elem)
        head: list = []
        tensors: dict[int, object] = {}
        for sign, buffer, nbytes in plain[0 if first else 1] if gathered is None else gathered:
            if sign > 0:
                tensors[buffer] = step._alloc(head, nbytes, ALLGATHER)
            else:
                step._free(head, tensors.pop(buffer))
        body, moved, loss = _backward_ops(expansion, events.ops, marks, table, step, polys)
        _hold_saved_inputs(body, moved, marks, saved_inputs, polys,
                           lambda layer, start: _first_gradient(body, layer, table, step.grad_of, start)
                           if layer in recomputed else None,
                           None if recorded is None else lambda layer: _traced_linears(table, layer, polys))
        outputs = {layer: _recompute_output_made_then_dropped(body, moved, layer, table, step.grad_of,
                                                              stopped_output, build, layer_output=reentrant)
                   for layer in (sorted(recomputed) if not dropped_out else ())}
        if reentrant and outputs:
            cut = next(at for name, _layer, at in marks if name == "optimizer_pre")
            _reentrant_lifetimes(body, moved, marks, outputs, stopped_output, cut)
        if not first if kept_freed is None else kept_freed:
            # the optimizer step's release_and_reset_all drops the persistent tensors' gathered copies
            body += [(FREE_PREVIOUS, kept_keys + j, build.tensor(_aligned_bytes(p, world)).size_index)
                     for j, p in enumerate(persistent)]
        tail: list = []
        step.optimizer_step(tail)
        # _post_step gathers the persistent tensors again, on the default stream; they live into the next step
        tail += [(ALLOC, kept_keys + j, build.tensor(_aligned_bytes(p, world)).size_index)
                 for j, p in enumerate(persistent)]
        ends.append(build.next_key)
        shifted = {index: at + len(head) for index, at in moved.items()}
        return head + body, shifted, loss, tail

    (first_body, first_moved, first_loss, first_tail), (body, _, loss, tail) = built(True), built(False)
    first_ops, steady_ops = first_body + first_loss + first_tail, body + loss + tail
    optimizer_at = (len(first_body) + len(first_loss), len(body) + len(loss))
    micro = _accumulating(built, gathers.steps, accumulate, loss) if accumulate > 1 else None
    expansion = _frozen_head_workspace(expansion, table, polys)
    return Zero3Step(expansion=method_expansion("zero3", expansion, first_ops, steady_ops, max(ends), first_moved,
                                                optimizer_at, micro=micro), sizes=build.sizes)


def _frozen_head_workspace(expansion: Expansion, table: list[ParamInfo], polys: list) -> Expansion:
    """The backward thread's cuBLAS workspace under a frozen head (LoRA), for a profile traced before
    ``blas_first`` (``expand._backward_workspace_at`` then puts it at the start of the middle segment, before
    the loss's backward): the backward's first matmul is the head's input gradient (the loss's backward has
    none, and a frozen head makes no weight gradient), so the workspace follows the first allocation of the
    head input's size in the middle segment. Seen in the H200 run 03ab897ea7873926 (both traced ranks, every
    step): the 32 MiB workspace right after the head's 8 MiB input gradient, past the fp32 logits' frees; where
    it went before, it took a freed logits block and cost the second step a 1002 MiB segment less than the
    run made."""
    first_marks = expansion.marks[0]
    mid_bw = next((at for name, _layer, at in first_marks if name == "mid_bw"), None)
    bw_first = next((at for name, _layer, at in first_marks if name.startswith("bw")), None)
    head = next((p for p in table if p.layer is None and any(n.endswith("lm_head.weight")
                                                              for n in (p.name, *p.tied_names))), None)
    if mid_bw is None or bw_first is None or head is None or head.trainable or expansion.workspace_at[1] != mid_bw:
        return expansion
    size_index = _per_token_size_index(polys, float(head.shape[1] * head.elem_bytes))
    found = next((at for at in range(mid_bw, bw_first) if expansion.first.ops[at][0] == ALLOC
                  and expansion.first.ops[at][2] == size_index), None)
    if size_index is None or found is None:
        return expansion
    return replace(expansion, workspace_at=(expansion.workspace_at[0], found + 1))


def _accumulating(built, gathered: list[list], k: int, loss: list) -> MicroSteps:
    """ZeRO-3 under gradient accumulation (``k`` micro-steps per optimizer step). Every micro-step's backward
    reduces as a plain step's does: each gradient copied into the setup's IPG bucket and freed at its hook, the
    bucket's flushes reduce-scattered, a later micro-step's partition added in place into the setup's gradient
    partition (``partition_grads``: no allocation, the accumulation dtype being the model's). Only the cycle's
    last micro-step runs the optimizer step: its ``release_and_reset_all`` (``step`` ->
    ``_partition_all_parameters``), the norm, AdamW, and ``_post_step``'s gathers of the persistent tensors.
    The allgather stream's ops per micro-step: ``emulate(accumulate=k)`` (``zero3_gathers._micro_step_start``).
    ``_post_step``'s persistent copies (a few KiB each, in a small-pool segment of their own) are freed at the
    end of the next cycle's first micro-step, not at its last one's optimizer step: a step's ops free only
    tensors of the step before."""
    def body(first: bool, step: int, kept_freed: bool) -> list:
        made, _, _, _ = built(first, gathered[step], kept_freed)
        return made

    first_body, _, first_loss, first_tail = built(True, gathered[0], False)
    _, _, _, tail = built(False, gathered[2 * k - 1], False)
    return MicroSteps(first_head=first_body, head=body(False, k, True),
                      middle=body(False, k + 1, False) if k > 2 else body(False, 2 * k - 1, False),
                      before_optimizer=loss, first_tail=first_loss + first_tail, tail=loss + tail,
                      last=body(False, 2 * k - 1, False),
                      first_middle=body(False, 1, False) if k > 2 else None,
                      first_last=body(False, k - 1, False))


def _within_each_step(steps: list[list]) -> list[list]:
    """The gather ops with the tensors one micro-step gathers and a later one frees left out: only persistent
    tensors live so (fetched in the run's first cycle after the trace-recording micro-step, released at its
    optimizer step; ``accumulate`` > 2), a few KiB each, in the allgather stream's small-pool segment that the
    trace-recording step made for them. A step's ops free only its own tensors (or the step before's)."""
    owner = {buffer: at for at, ops in enumerate(steps) for sign, buffer, _ in ops if sign > 0}
    crossing = {buffer for at, ops in enumerate(steps) for sign, buffer, _ in ops if sign < 0 and owner[buffer] != at}
    return [[op for op in ops if op[1] not in crossing] for ops in steps]
