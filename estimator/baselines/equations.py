"""Published estimators, re-implemented as baselines to compare against.

* ``llmem``: LLMem (Kim et al., IJCAI 2024): its per-GPU peak equations, quirks included, for
  single / CDP (``ddp``) / ADP (``zero3``, ``fsdp``) / 1-D TP (``tp``) / DP+TP (``dp_tp``). ``llmem_max_batch``
  is its linear batch-size search.
* ``deepspeed_model_states``: DeepSpeed's ``estimate_zero2_model_states_mem_needs`` /
  ``estimate_zero3_model_states_mem_needs``. These cover model states only, with no activations.
* ``accelerate_estimate``: the "Training using Adam" column of ``accelerate estimate-memory``.
* ``rule_of_thumb``: X billion parameters -> 8X GB.

Each function is pure and returns a ``Baseline`` with ``total_bytes`` and an additive ``breakdown``.
Inputs are the model's parameter table (``estimator.models.params.ParamInfo`` rows: ``name``, ``shape``,
``numel``, ``module_kind`` in embedding/linear/norm/other, ``tied_names``; a tied tensor is listed once)
and a ``RunSpec``. Pure standard library.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Protocol

from estimator.models.arch import ModelArch
from estimator.spec import RunSpec

MIB = 1 << 20


class ParamLike(Protocol):
    name: str
    shape: tuple[int, ...]
    numel: int
    module_kind: str
    tied_names: tuple[str, ...]


@dataclass(frozen=True)
class Baseline:
    name: str
    total_bytes: int                              # per GPU
    breakdown: dict[str, int] = field(hash=False)  # additive: sums to total_bytes
    host_bytes: int | None = None                 # CPU RAM, where the baseline estimates it
    details: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "total_bytes": self.total_bytes, "breakdown": dict(self.breakdown),
                "host_bytes": self.host_bytes, "details": dict(self.details), "notes": list(self.notes)}


def total_params(params: Sequence[ParamLike]) -> int:
    """Parameter count with tied tensors counted once (as DeepSpeed's data_ptr dedup and accelerate do)."""
    return sum(p.numel for p in params)


def largest_layer_params(params: Sequence[ParamLike]) -> int:
    """DeepSpeed's ZeRO-3 "largest layer": the module with the most *direct* parameters. A tied tensor
    counts in every module that holds it (``m.parameters(recurse=False)`` sees it in each)."""
    per_module: dict[str, int] = defaultdict(int)
    for p in params:
        for name in dict.fromkeys((p.name, *getattr(p, "tied_names", ()))):
            per_module[name.rsplit(".", 1)[0] if "." in name else ""] += p.numel
    return max(per_module.values(), default=0)


# --- LLMem ------------------------------------------------------------------------------------------------
CU_P = 2 * MIB                       # LLMem's "CUDA page": every tensor rounded up to 2 MiB
GEMINI_MIN_CHUNK = 32 * MIB          # Colossal-AI 0.3.0 GeminiPlugin defaults, in *elements*
GEMINI_SEARCH_RANGE = 32 * MIB
GEMINI_SEARCH_INTERVAL = 1024
# LLMem switches fp32 logits on by model-name substrings 'codegen' / 'neo' (the HF code of CodeGen and
# GPT-Neo casts logits to fp32). We key on model_type instead: the substring 'neo' would also catch
# 'gpt-neox' checkpoints, whose logits stay 16-bit.
LLMEM_FP32_LOGITS = ("codegen", "gpt_neo")
LLMEM_METHODS = {"single": "single", "ddp": "cdp", "zero3": "adp", "fsdp": "adp", "fsdp1": "adp", "tp": "tp",
                 "dp_tp": "dp_tp"}


def _page(nbytes: int | Fraction) -> int:
    """Round up to LLMem's 2 MiB unit (exact for fractional shares)."""
    return int(-(-nbytes // CU_P)) * CU_P


@dataclass(frozen=True)
class ChunkPlan:
    """Colossal-AI 0.3.0 ``search_chunk_configuration`` for one DP group: chunk size in elements."""

    chunk_size: int
    outliers: tuple[int, ...]     # numels above mean + 3 sigma: each gets a dedicated chunk
    chunked_numel: int            # the rest, packed into chunk_size chunks
    waste: int                    # elements left unused by the chosen size
    keep_gathered: bool           # group smaller than the minimum chunk: one unsharded chunk


def _unused(sizes: Sequence[int], chunk_size: int, bound: float) -> float:
    """Gemini's ``_get_unused_byte``: greedy in-order packing; stops early once it cannot beat ``bound``."""
    acc = 0
    left = 0
    for size in sizes:
        if size > left:
            acc += left
            if acc >= bound:
                return math.inf
            left = chunk_size
        left -= size
    return left + acc


@functools.lru_cache(maxsize=32)
def gemini_chunk_plan(numels: tuple[int, ...], dp_degree: int = 1, *, min_chunk_size: int = GEMINI_MIN_CHUNK,
                      search_range: int = GEMINI_SEARCH_RANGE,
                      search_interval: int = GEMINI_SEARCH_INTERVAL) -> ChunkPlan:
    """The chunk size Gemini picks for parameters of ``numels`` (in order), all in one DP group."""
    total = sum(numels)
    if total < min_chunk_size:
        return ChunkPlan(total, (), total, 0, True)
    mean = total / len(numels)
    upper = mean + 3 * math.sqrt(sum((n - mean) ** 2 for n in numels) / len(numels))  # np.std: ddof=0
    kept = [n for n in numels if n <= upper]
    outliers = tuple(n for n in numels if n > upper)
    start = -(-max(min_chunk_size, *kept) // search_interval) * search_interval
    best, best_waste = start, math.inf
    for chunk_size in range(start, start + search_range + 1, search_interval):
        waste = _unused(kept, chunk_size, best_waste)
        if waste < best_waste:
            best, best_waste = chunk_size, waste
    best += -best % dp_degree
    return ChunkPlan(best, outliers, sum(kept), int(best_waste), False)


def _llmem_tensors(params: Sequence[ParamLike]) -> list[int]:
    """numels LLMem loops over: every Embedding and Linear tensor (weights and biases; norms left out) in
    module order. A tied head appears again as the lm_head, the last module of an HF causal LM."""
    main = [p.numel for p in params if p.module_kind in ("embedding", "linear")]
    tied = [p.numel for p in params if p.module_kind in ("embedding", "linear")
            for name in getattr(p, "tied_names", ()) if name != p.name]
    if not main:
        raise ValueError("llmem: the parameter table has no embedding or linear tensors")
    return main + tied


def llmem(arch: ModelArch, params: Sequence[ParamLike], spec: RunSpec, *, coefficients: Any = None,
          m_base_bytes: int | None = None) -> Baseline:
    """LLMem's per-GPU peak (llmem-paper.md 2.4-2.9 and the code's ``estimate_size``, section 6.3).

    Faithful to LLMem, quirks included:
    * Every tensor is rounded up to 2 MiB on its own.
    * Adam m and v are counted for Embedding and Linear tensors (biases too); norms are left out.
    * The last tensor (the lm_head) adds only its fp16 bytes: ``lm_p``.
    * ADP all-gathers the entire fp16 model.
    * ``e_n = 2`` embedding outputs, plus one ``[bs, sl, h]`` per layer.
    * Logits are fp32 only for CodeGen / GPT-Neo.
    * TP's ``m_back`` covers L-1 layers.
    * DP+TP's fp16 share is ``(gpu_n - tp - 1)/gpu_n``, with ``gpu_n`` = world size.
    * A 2 MiB int64 input_ids term is added.

    LLMem *measured* ``m_base`` + chunk memory on the GPU. Here chunk memory is the paper's
    ``m_p = ceil((embed_p + ceil(other_p/cs)*cs) x 6 B)``, with Gemini's chunk-size search (outliers as
    ``embed_p``). It is divided by ``gpu_n`` where Gemini shards it; a model under 32 Mi elements is one
    keep-gathered chunk that Gemini does not shard over DP. ``m_base`` is the coefficient file's CUDA
    context (``m_base_bytes`` overrides). The model is LLMem's throughout: fp16 mixed precision, Adam and
    gradient checkpointing, whatever the spec's precision / optimizer / checkpointing / LoRA say.
    """
    method = spec.parallel.method
    if method not in LLMEM_METHODS:
        raise ValueError(f"llmem: method {method!r} is not one LLMem models ({', '.join(LLMEM_METHODS)})")
    kind = LLMEM_METHODS[method]
    world, tp = spec.parallel.world_size, spec.parallel.tp
    gpu_n = 1 if kind in ("single", "cdp") else world      # CDP: m_peak^cdp = m_peak^s
    dp_degree = {"single": 1, "cdp": 1, "adp": world, "tp": 1, "dp_tp": world // tp}[kind]
    bs, sl = spec.training.micro_batch_size, spec.training.seq_len
    hidden, layers, vocab = arch.hidden_size, arch.num_layers, arch.vocab_size
    if m_base_bytes is None:
        if coefficients is None:
            from estimator.hardware.residuals import load_coefficients
            coefficients = load_coefficients(spec.gpu)
        m_base_bytes = coefficients.cuda_context_bytes

    plan = gemini_chunk_plan(tuple(p.numel for p in params), dp_degree)
    chunk_elems = sum(plan.outliers) + -(-plan.chunked_numel // plan.chunk_size) * plan.chunk_size
    # fp16 + fp32 chunks resident on this rank: TP shards, and DP shards unless the group is small enough for
    # Gemini to keep it gathered (one replicated chunk)
    shards = (tp if kind in ("tp", "dp_tp") else 1) * (1 if plan.keep_gathered else dp_degree)
    chunks = _page(Fraction(chunk_elems * (2 + 4), shards))

    tensors = _llmem_tensors(params)
    gather = optim = 0
    for numel in tensors[:-1]:
        fp16 = _page(2 * numel)
        if kind == "adp" and gpu_n > 1:
            gather += _page(Fraction(gpu_n - 1, gpu_n) * fp16)
        elif kind == "dp_tp":
            gather += _page(Fraction(gpu_n - tp - 1, gpu_n) * fp16)
        optim += 2 * _page(Fraction(4 * numel, gpu_n))
    lm_p = _page(2 * tensors[-1])
    input_ids = _page(8 * 2 * sl)  # int64 input_ids of LLMem's 2-row probe batch
    embed_dim = next((p.shape[-1] for p in params if p.module_kind == "embedding" and p.shape), hidden)
    m_out = 2 * _page(2 * bs * sl * embed_dim) + layers * _page(2 * bs * sl * hidden)
    fp32_logits = arch.model_type in LLMEM_FP32_LOGITS
    logit_bytes = 4 if fp32_logits else 2
    m_lm = _page(logit_bytes * bs * sl * vocab) + 2 * _page(logit_bytes * bs * (sl - 1) * vocab)
    m_back = ((layers - 1) * _page(Fraction(2 * bs * sl * hidden * (tp - 1), tp))
              if kind in ("tp", "dp_tp") else 0)

    breakdown = {"m_base": int(m_base_bytes), "chunks": chunks, "gather_fp16": gather, "optimizer_states": optim,
                 "lm_p": lm_p, "input_ids": input_ids, "m_out": m_out, "m_lm": m_lm, "m_back": m_back}
    return Baseline(
        name="llmem", total_bytes=sum(breakdown.values()), breakdown=breakdown,
        details={"method": kind, "gpu_n": gpu_n, "chunk_size_elements": plan.chunk_size,
                 "dedicated_chunk_numels": list(plan.outliers), "fp32_logits": fp32_logits},
        notes=("LLMem assumes Colossal-AI Gemini fp16 mixed precision, Adam and gradient checkpointing",
               "m_base is the coefficient file's CUDA context (LLMem measured it on the GPU)"))


def llmem_max_batch(arch: ModelArch, params: Sequence[ParamLike], spec: RunSpec, *,
                    capacity_bytes: int | None = None, coefficients: Any = None, m_base_bytes: int | None = None,
                    max_batch: int = 1 << 16) -> tuple[int, Baseline]:
    """LLMem's ``bs_search``: bs = 1, 2, ... until the estimate exceeds ``m_total``. Returns the largest bs
    that fits and its estimate, or ``(0, estimate at bs=1)`` when none fits. ``m_total`` is the catalogue
    capacity of ``spec.gpu`` (LLMem used the NVML total: 16,384 MiB on its V100) unless given.
    """
    if capacity_bytes is None:
        from estimator.hardware.gpus import get_gpu
        capacity_bytes = get_gpu(spec.gpu).capacity_bytes
        if capacity_bytes is None:
            raise ValueError(f"gpu: {spec.gpu!r} has no catalogue capacity; pass capacity_bytes")
    if coefficients is None and m_base_bytes is None:
        from estimator.hardware.residuals import load_coefficients
        coefficients = load_coefficients(spec.gpu)

    def at(bs: int) -> Baseline:
        return llmem(arch, params, spec.replace(**{"training.micro_batch_size": bs}), coefficients=coefficients,
                     m_base_bytes=m_base_bytes)

    previous = at(1)
    if previous.total_bytes > capacity_bytes:
        return 0, previous
    for bs in range(2, max_batch + 1):
        current = at(bs)
        if current.total_bytes > capacity_bytes:
            return bs - 1, previous
        previous = current
    return max_batch, previous


# --- DeepSpeed -----------------------------------------------------------------------------------------------
def deepspeed_model_states(params: Sequence[ParamLike], spec: RunSpec, *, num_nodes: int = 1,
                           additional_buffer_factor: float = 1.5, zero_init: bool = True) -> Baseline:
    """DeepSpeed's model-state estimate per GPU (``deepspeed/runtime/zero/stage_1_and_2.py`` and ``stage3.py``,
    0.19.8), for the spec's ZeRO method and offload flags. ``host_bytes`` is its CPU figure (with
    ``additional_buffer_factor``). N = world size = ``num_nodes`` x GPUs per node.

    * ZeRO-2: GPU = 2P + 18P/N (2 fp16 grads + 4 fp32 grads + 4 fp32 master + 8 Adam, since PR #5099), or
      2P with the optimizer offloaded.
    * ZeRO-3: GPU = 4 x largest layer + 18P/N; with optimizer offload, 4 x largest layer + 2P/N; with
      parameters offloaded too, 4 x largest layer.

    ZeRO-1 has no DeepSpeed estimator; the ZeRO-2 formula stands in. ``zero_offload`` uses ZeRO-3's
    formula when parameters are offloaded (DeepSpeed offloads parameters only at stage 3), else ZeRO-2's
    with the optimizer offloaded. The offload flags map to DeepSpeed's ``cpu_offload`` /
    ``cpu_offload_params`` arguments; ``zero_offload`` with neither flag set counts as optimizer offload.
    Activations, buffers, context and fragmentation are not included.
    """
    method, zero = spec.parallel.method, spec.parallel.zero
    if method not in ("zero1", "zero2", "zero3", "zero_offload"):
        raise ValueError(f"deepspeed: method {method!r} has no DeepSpeed estimator (zero1, zero2, zero3, "
                         f"zero_offload)")
    total_gpus = spec.parallel.world_size
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1 or total_gpus % num_nodes:
        raise ValueError(f"num_nodes: must divide the world size {total_gpus}, got {num_nodes!r}")
    per_node = total_gpus // num_nodes
    p = total_params(params)
    notes: list[str] = ["model states only: no activations, buffers, CUDA context or fragmentation"]
    if method == "zero1":
        notes.append("DeepSpeed has no ZeRO-1 estimator; ZeRO-2's formula is used")
    stage3 = method == "zero3" or (method == "zero_offload" and zero.offload_param)
    # zero_offload with neither flag set means what the method says: the optimizer is offloaded.
    cpu_offload = zero.offload_optimizer or (method == "zero_offload" and not zero.offload_param)
    if not stage3:
        if cpu_offload:
            breakdown = {"params_16bit": 2 * p}
            cpu = p * max(4 * total_gpus, 16) * additional_buffer_factor
        else:
            breakdown = {"params_16bit": 2 * p, "grads_master_optimizer_sharded": int(18 * p / total_gpus)}
            cpu = p * 4 * per_node * additional_buffer_factor
        return Baseline(name="deepspeed_zero2", total_bytes=int(sum(breakdown.values())), breakdown=breakdown,
                        host_bytes=int(cpu), details={"total_params": p, "total_gpus": total_gpus,
                                                      "cpu_offload": cpu_offload}, notes=tuple(notes))
    offload_params = zero.offload_param
    largest = largest_layer_params(params)
    gpus_factor = 1 / num_nodes
    breakdown = {"largest_layer": 4 * largest}
    if cpu_offload:
        if offload_params:
            cpu = (p * 18 * gpus_factor if zero_init else p * max(4 * per_node, 18 * gpus_factor))
        else:
            breakdown["params_16bit_sharded"] = int(2 * p / total_gpus)
            cpu = (p * 16 * gpus_factor if zero_init else p * max(4 * per_node, 16 * gpus_factor))
    else:
        breakdown["params_grads_master_optimizer_sharded"] = int(18 * p / total_gpus)
        cpu = largest * 4 * per_node if zero_init else p * 4 * per_node
    return Baseline(name="deepspeed_zero3", total_bytes=int(sum(breakdown.values())), breakdown=breakdown,
                    host_bytes=int(cpu * additional_buffer_factor),
                    details={"total_params": p, "largest_layer_params": largest, "total_gpus": total_gpus,
                             "cpu_offload": cpu_offload, "cpu_offload_params": offload_params,
                             "zero_init": zero_init}, notes=tuple(notes))


# --- accelerate ----------------------------------------------------------------------------------------------
def accelerate_dtype(precision: str) -> str:
    """The ``mixed_precision`` name accelerate's estimator would use for a spec precision."""
    if precision == "fp32":
        return "float32"
    return "float16" if precision.endswith("fp16") else "bfloat16"


def accelerate_estimate(params: Sequence[ParamLike], spec: RunSpec, *, buffer_bytes: int = 0) -> Baseline:
    """``accelerate estimate-memory``'s "Training using Adam" figure (``commands/estimate.py``).

    accelerate sizes the model in fp32 (parameters, plus buffers at their own dtype: ``buffer_bytes``).
    ``estimate_training_usage`` then gives four stage figures, and the command prints their maximum:
    fp32 is model 1x, gradients 1x, optimizer 2x, step 4x = 16 B/param. 16-bit is model 1x, gradients 1.5x,
    optimizer 2x, step 2x = 8 B/param. The figure is per GPU and independent of the method: no activations,
    no sharding.
    """
    size = 4 * total_params(params) + int(buffer_bytes)
    dtype = accelerate_dtype(spec.training.precision)
    if dtype == "float32":
        stages = {"model": size, "gradients": size, "optimizer": 2 * size, "step": 4 * size}
    else:
        stages = {"model": size, "gradients": size + size // 2, "optimizer": 2 * size, "step": 2 * size}
    total = max(stages.values())
    return Baseline(name="accelerate", total_bytes=total, breakdown={"training_adam": total},
                    details={"dtype": dtype, "model_bytes_fp32": size, "stages": stages},
                    notes=("maximum of accelerate's model/gradients/optimizer/step stages; no activations",))


def rule_of_thumb(params: Sequence[ParamLike], spec: RunSpec | None = None, *, bytes_per_param: int = 8) -> Baseline:
    """"X billion parameters need 8X GB": ``bytes_per_param`` x parameter count, whatever the spec."""
    total = bytes_per_param * total_params(params)
    return Baseline(name="rule_of_thumb", total_bytes=total, breakdown={"model_states": total},
                    notes=(f"{bytes_per_param} bytes per parameter",))
