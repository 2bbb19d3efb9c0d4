"""Predicted training throughput: a small, inspectable model used by the planner to rank methods.

Pure standard library. One optimizer step on one rank takes

    step_s = accum * (compute_s + exposed_micro_comm_s) + exposed_step_comm_s + optimizer_s

* **compute** = FLOPs / (peak FLOP/s of the GPU for the precision * efficiency). FLOPs per micro-batch of
  ``T = mb * seq`` tokens, with ``P`` the parameters that take part in a matmul (the LM head counts, the
  input-embedding lookup does not), ``L`` layers, hidden size ``h``:
  - weights: ``6 P T`` (forward 2, backward 4: input grads 2 + weight grads 2). LoRA freezes the base, so
    there are no weight grads: ``4 P T`` (the adapters' own FLOPs are negligible and ignored).
  - attention scores: ``12 L h s T`` (QK^T and AV, forward 4 L h s T, backward twice that; no causal
    discount, since eager and SDPA-math compute the full square).
  - gradient checkpointing re-runs the forward: ``+ 2 P T + 4 L h s T`` (x4/3 of full fine-tuning).
  Under tensor parallelism each rank does 1/tp of the decoder layers' share; the LM head is replicated
  (our TP plans keep it whole on every rank, estimator/models/tp_plans.py).
* **efficiency** = ``e_max * T/(T + tokens_half) * w/(w + width_half)`` with ``w = h / tp`` (TP narrows every
  GEMM). ``e_max`` and ``tokens_half`` are fitted per GPU type from single-GPU harness runs
  (:func:`fit_efficiency`); until then they are priors (:data:`EFFICIENCY_PRIORS`), and ``width_half`` is
  always a prior.
* **communication**, bytes sent per rank, ring collectives (all-reduce moves ``2(n-1)/n`` of the buffer,
  all-gather and reduce-scatter ``(n-1)/n``) over the link's bus bandwidth; ``Psi`` = trainable parameters
  times the gradient element size (2 B for 16-bit grads, 4 B for fp32/amp):
  - DDP 2 Psi per optimizer step (one all-reduce, after gradient accumulation); ZeRO-1 2 Psi per step
    (reduce-scatter + all-gather of the updated weights); ZeRO-2 Psi per micro-batch (reduce-scatter) +
    Psi per step (all-gather); ZeRO-3 and FSDP 3 Psi per micro-batch (all-gather forward, all-gather
    backward, reduce-scatter) -- the volumes of the ZeRO paper (Rajbhandari et al., SC'20, §7).
  - TP: per layer 2 all-reduces of ``mb*s*h`` activations in the forward and 2 in the backward (Megatron
    column/row pairing), 2 more when checkpointing recomputes the forward; never overlapped.
  - dp_tp (TP inside, FSDP2 over the dp axis, as the harness runs it): the TP traffic plus FSDP's 3 Psi
    over the dp group for the rank's TP shard.
  - FSDP with expert parallelism (``ep``, transformers' ``AllToAllEP``): each MoE layer's T x top_k rows go to
    the experts' ranks and come back (dispatch and combine) in forward, backward and a checkpointed layer's
    recomputation, ``(ep-1)/ep`` of them leaving the rank, on the EP group's link and never overlapped (each
    exchange is waited on); the routed experts are gathered and reduce-scattered only for the rank's
    ``experts / ep``, over the ``world / ep`` ranks that hold them. Balanced routing: every rank runs the same
    expert FLOPs; skewed routing (``moe_imbalance``): the busiest rank runs and exchanges the rows its experts
    receive (``EpLayout.received_rows_factor``), and the step waits for it.
  - zero_offload (ZeRO-2 + optimizer on the CPU): ZeRO-2's collectives, plus over PCIe the rank's gradient
    shard to the host each micro-batch and its 16-bit weight shard back each step, plus CPU Adam over the
    rank's shard (the CPU is shared by the ranks on a node). Host copies run at pageable speed unless
    ``pin_memory`` (DeepSpeed's ``offload_optimizer.pin_memory`` default is false).
  - zero3_offload (ZeRO-3 + optimizer on the CPU): ZeRO-3's collectives plus the same PCIe and CPU Adam terms.
  - zero_infinity (ZeRO-3 + optimizer and parameters on the CPU): as zero3_offload, but the parameter
    partition crosses PCIe at every gather (forward, backward, and the recomputed forward) instead of once
    per step; not overlapped (prior).
* **overlap**: DP communication hides behind compute up to ``overlap * window`` (window = backward for
  DDP/ZeRO-1/2, forward+backward for ZeRO-3/FSDP which prefetch); the fractions are priors in
  :data:`OVERLAP`. DeepSpeed ZeRO-1/2 do not overlap unless ``overlap_comm`` is on (their default is off).
* **optimizer**: the update is memory-bound: bytes touched per local trainable parameter over the GPU's
  memory bandwidth (prior :data:`OPTIMIZER_BYTES_PER_PARAM`).
* tokens/s per job = ``dp * mb * accum * seq / step_s``.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import functools
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from estimator.models.moe_ep import received_rows_factor
from estimator.planning.shape import ModelShape, model_shape
from estimator.spec import FSDP_METHODS

SCHEMA_VERSION = 1

# --- priors ---------------------------------------------------------------------------------------------
# Reachable fraction of dense peak FLOP/s for HF-style fine-tuning at large micro-batches (e_max), and the
# micro-batch token count at which half of it is reached (tokens_half). Priors, to be replaced per GPU type by
# fit_efficiency() on the harness's single-GPU step times. Sources: Megatron-LM (Shoeybi et al. 2019) ran
# 39 TFLOP/s on one V100 = 30 % of the 125 TFLOP/s fp16 peak; Megatron-LM (Narayanan et al., SC'21) up to
# 52 % on A100; FSDP/torchtitan-class Llama training on H100 reports roughly 35-45 % MFU. HF eager/SDPA
# fine-tuning is rarely better than those hand-tuned stacks, so the priors sit at or below them.
EFFICIENCY_PRIORS: dict[str, dict[str, float]] = {
    "volta": {"e_max": 0.30, "tokens_half": 512.0},
    "turing": {"e_max": 0.30, "tokens_half": 512.0},
    "ampere": {"e_max": 0.45, "tokens_half": 512.0},
    "ada": {"e_max": 0.40, "tokens_half": 512.0},
    "hopper": {"e_max": 0.40, "tokens_half": 1024.0},
    "blackwell": {"e_max": 0.35, "tokens_half": 1024.0},
    "generic": {"e_max": 0.30, "tokens_half": 512.0},
}
# GEMM width (h / tp) at which efficiency halves: small hidden sizes and deep TP underuse the tensor cores.
WIDTH_HALF = 256.0

# Effective per-GPU bus bandwidth of ring collectives (what nccl-tests reports as busbw), bytes/s, by link
# and GPU generation. Priors from public nccl-tests figures: DGX-1 V100 NVLink2 ~130 GB/s, DGX A100 NVLink3
# ~230 GB/s, DGX H100 NVLink4 ~370 GB/s; PCIe all-reduce through the host bridge ~10 (gen3), 20 (gen4),
# 40 (gen5) GB/s; InfiniBand one NIC per GPU: EDR 100 Gb/s ~11, HDR 200 Gb/s ~23, NDR 400 Gb/s ~45 GB/s.
INTERCONNECTS: dict[str, dict[str, float]] = {
    "nvlink": {"volta": 130e9, "turing": 50e9, "ampere": 230e9, "ada": 20e9, "hopper": 370e9,
               "blackwell": 700e9, "generic": 130e9},
    "pcie": {"volta": 10e9, "turing": 10e9, "ampere": 20e9, "ada": 20e9, "hopper": 40e9,
             "blackwell": 40e9, "generic": 10e9},
    "infiniband": {"volta": 11e9, "turing": 11e9, "ampere": 23e9, "ada": 23e9, "hopper": 45e9,
                   "blackwell": 45e9, "generic": 11e9},
}
# GPU <-> host copies (offload), pinned memory, one direction: PCIe gen3 / gen4 / gen5 x16 ~12 / 24 / 48 GB/s
# achieved; Grace-Hopper C2C far more. Pageable memory (ZeroSpec.pin_memory False, the default) ~half.
# Achieved fraction of the catalogue's spec-sheet per-direction bandwidth: ring all-reduce bus bandwidth on
# NVLink/NVSwitch systems (A100 ~230-240 of 300 GB/s, H100 ~360-370 of 450 without NVLS); PCIe rings through
# the host bridge or a PCIe switch do worse (~20 of 32 GB/s on gen4). Pinned host copies reach ~80 %.
LINK_EFFICIENCY = {"nvlink": 0.8, "pcie": 0.65}
HOST_EFFICIENCY = 0.8
HOST_LINK = {"volta": 12e9, "turing": 12e9, "ampere": 24e9, "ada": 24e9, "hopper": 48e9, "blackwell": 48e9,
             "generic": 12e9}
PAGEABLE_FACTOR = 0.5
# DeepSpeedCPUAdam: "5x-7x faster than the PyTorch CPU Adam" (deepspeed.ai ZeRO-Offload tutorial). The update
# is DRAM-bound at ~28 B/param; a 2-socket server streams 100-200 GB/s. Prior: 1e9 params/s per node.
CPU_ADAM_PARAMS_PER_S = 1.0e9
GPUS_PER_NODE = 8
# Fraction of the overlap window that hides DP communication (bucketed all-reduce / prefetched all-gather);
# the last bucket and the first gather are always exposed. Priors.
# ZeRO-3 prefetches at most stage3_prefetch_bucket_size (5e7 elements) ahead, so less of it hides than FSDP's
# one-module-ahead prefetch of whole layers.
OVERLAP = {"ddp": 0.8, "zero_on": 0.8, "zero_off": 0.0, "zero3": 0.6, "fsdp": 0.8, "tp": 0.0,
           "offload_grads": 0.5, "offload_params": 0.0}
# Latency per collective launch (the alpha of an alpha-beta model; NCCL small-message all-reduce latency is
# tens of microseconds within a node, more across nodes). Priors.
LATENCY_S = {"nvlink": 20e-6, "pcie": 30e-6, "infiniband": 50e-6, "custom": 30e-6}
# Per-layer, per-micro-batch bookkeeping of parameter sharding (module hooks, gather/release, stream syncs)
# that does not overlap: DeepSpeed ZeRO-3's Python hooks are heavier than FSDP's. Priors.
SHARDING_OVERHEAD_S = {"zero3": 0.3e-3, "fsdp": 0.1e-3}
DDP_BUCKET_BYTES = 25 * 1024**2                  # torch DDP bucket_cap_mb default
ZERO_BUCKET_ELEMENTS = 5e8                       # DeepSpeed reduce_bucket_size default
# Bytes of HBM traffic per local trainable parameter in one optimizer update (read + write of master weight,
# grad, states, and the 16-bit copy). Adam: ~4+2+8 read, 4+8+2 write + grad unscale ~ 32.
OPTIMIZER_BYTES_PER_PARAM = {"adamw": 32.0, "adamw_fused": 32.0, "adamw_8bit": 20.0, "sgd": 14.0}
HBM_EFFICIENCY = 0.7

_SIXTEEN_BIT = ("bf16", "mixed_bf16", "mixed_fp16")
# The planner's offload layouts (estimator.planning.plan): ZeRO-Offload is stage 2 + optimizer on the CPU; the ZeRO-3
# ones shard the parameters too, ZeRO-Infinity (CPU) also keeps the parameter partitions on the host.
OFFLOAD_METHODS = ("zero_offload", "zero3_offload", "zero_infinity")
ZERO3_OFFLOAD = ("zero3_offload", "zero_infinity")


def gpu_family(key: str, name: str = "") -> str:
    """GPU generation from its key or name (most specific patterns first)."""
    text = f"{key} {name}".lower()
    for family, patterns in (("blackwell", ("b100", "b200", "gb200", "rtx 50", "rtx-50")),
                             ("hopper", ("h100", "h200", "h800", "gh200", "h20")),
                             ("ada", ("l40", "l4", "rtx 40", "rtx-40", "4090", "6000 ada", "6000-ada")),
                             ("ampere", ("a100", "a800", "a10", "a30", "a40", "a6000", "rtx 30", "3090")),
                             ("turing", ("t4", "rtx 20", "2080", "titan rtx")),
                             ("volta", ("v100", "titan v"))):
        if any(p in text for p in patterns):
            return family
    return "generic"


# --- the GPU as the throughput model sees it ------------------------------------------------------------
@dataclass(frozen=True)
class GpuPerf:
    key: str
    name: str
    capacity_bytes: int
    peak_flops: dict[str, float]            # FLOP/s by dtype: "bf16", "fp16", "fp32" (0 = unsupported)
    memory_bandwidth: float                  # bytes/s
    family: str = "generic"
    link: str = "nvlink"                     # intra-node link: nvlink | pcie
    link_bandwidth: float | None = None      # catalogue's bus bandwidth for that link, bytes/s, if known
    host_bandwidth: float | None = None      # GPU <-> host, bytes/s, if known

    def flops_for(self, precision: str) -> float:
        dtype = "fp32" if precision == "fp32" else ("bf16" if "bf16" in precision else "fp16")
        return float(self.peak_flops.get(dtype) or 0.0)

    def supports_bf16(self) -> bool:
        return bool(self.peak_flops.get("bf16"))


def _num(value: Any, scale: float = 1.0) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value) * scale
    except (TypeError, ValueError):
        return None


def _attr(obj: Any, *names: str) -> Any:
    for name in names:
        value = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
        if value is not None:
            return value
    return None


def gpu_perf_from_spec(spec: Any) -> GpuPerf:
    """Adapt a catalogue ``GpuSpec`` (``estimator.hardware.gpus``; or a dict with the same fields).

    The catalogue's link figures are spec-sheet bandwidths per direction; collectives reach about
    :data:`LINK_EFFICIENCY` of them (nccl-tests bus bandwidth), host copies :data:`HOST_EFFICIENCY`.
    A GPU without peak figures (``generic``) gets zeros, which the planner refuses with a message.
    """
    key = str(_attr(spec, "key"))
    name = str(_attr(spec, "name") or key)
    peak = _attr(spec, "peak_tflops") or {}
    flops = {dtype: _num(peak.get(dtype), 1e12) or 0.0 for dtype in ("bf16", "fp16", "fp32")}
    family = str(_attr(spec, "architecture") or "")
    family = family if family in EFFICIENCY_PRIORS else gpu_family(key, name)
    link = str(_attr(spec, "interconnect") or "pcie").lower()
    link = "nvlink" if "nvlink" in link else "pcie"
    link_bw = _num(_attr(spec, "interconnect_bandwidth_bytes_per_s"))
    host_bw = _num(_attr(spec, "host_bandwidth_bytes_per_s"))
    return GpuPerf(
        key=key, name=name, capacity_bytes=int(_attr(spec, "capacity_bytes") or 0), peak_flops=flops,
        memory_bandwidth=_num(_attr(spec, "memory_bandwidth_bytes_per_s")) or 1e12, family=family, link=link,
        link_bandwidth=link_bw * LINK_EFFICIENCY[link] if link_bw else None,
        host_bandwidth=host_bw * HOST_EFFICIENCY if host_bw else None)


@functools.lru_cache(maxsize=64)
def gpu_perf(key: str) -> GpuPerf:
    """The catalogue GPU ``key`` (raises ``ValueError("gpu: ...")`` for an unknown key)."""
    from estimator.hardware.gpus import get_gpu  # the catalogue; lazy so this module imports alone
    return gpu_perf_from_spec(get_gpu(key))


# --- interconnect ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float   # bytes/s, ring bus bandwidth per GPU
    source: str

    @property
    def latency_s(self) -> float:
        return LATENCY_S.get(self.name, LATENCY_S["custom"])

    def time(self, kind: str, nbytes: float, ranks: int, count: int = 1) -> float:
        """Seconds for ``count`` ring collectives of ``kind`` that together move ``nbytes`` over ``ranks``."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        return count * self.latency_s + _ring(kind, ranks) * nbytes / self.bandwidth


def resolve_link(gpu: GpuPerf, span_gpus: int, name: str | None = None,
                 bandwidth_gbs: float | None = None) -> Link:
    """The link a collective over ``span_gpus`` GPUs runs on. Within a node (<= 8 GPUs) the GPU's own link
    (catalogue, else the preset); across nodes the slowest hop, InfiniBand. ``name`` / ``bandwidth_gbs``
    (GB/s) override."""
    if bandwidth_gbs is not None:
        if not 0 < bandwidth_gbs < float("inf"):
            raise ValueError(f"bandwidth: must be a positive number of GB/s, got {bandwidth_gbs!r}")
        return Link(name or "custom", float(bandwidth_gbs) * 1e9, "user override")
    if name is not None and name not in INTERCONNECTS:
        raise ValueError(f"interconnect: {name!r} is not one of {', '.join(INTERCONNECTS)}")
    chosen = name or (gpu.link if span_gpus <= GPUS_PER_NODE else "infiniband")
    if chosen == gpu.link and gpu.link_bandwidth:
        return Link(chosen, gpu.link_bandwidth, f"catalogue x {LINK_EFFICIENCY[chosen]} ({gpu.key})")
    bandwidth = INTERCONNECTS[chosen].get(gpu.family, INTERCONNECTS[chosen]["generic"])
    return Link(chosen, bandwidth, f"prior: {chosen} preset for {gpu.family}")


def host_bandwidth(gpu: GpuPerf, pinned: bool) -> float:
    base = gpu.host_bandwidth or HOST_LINK.get(gpu.family, HOST_LINK["generic"])
    return base * (1.0 if pinned else PAGEABLE_FACTOR)


# --- compute efficiency ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Efficiency:
    gpu_key: str
    e_max: float
    tokens_half: float
    width_half: float = WIDTH_HALF
    calibrated: bool = False
    source: str = "prior"

    def at(self, tokens: float, width: float) -> float:
        return self.e_max * tokens / (tokens + self.tokens_half) * width / (width + self.width_half)


def coefficients_dir() -> Path:
    return Path(str(resources.files("estimator") / "coefficients"))


def prior_efficiency(gpu: GpuPerf) -> Efficiency:
    prior = EFFICIENCY_PRIORS.get(gpu.family, EFFICIENCY_PRIORS["generic"])
    return Efficiency(gpu.key, prior["e_max"], prior["tokens_half"], WIDTH_HALF, False,
                      f"{gpu.family} prior; no fit for {gpu.key} yet: python -m estimator.planning.throughput fit")


@functools.lru_cache(maxsize=64)
def _read_coefficients(path: str, mtime_ns: int) -> dict:
    return json.loads(Path(path).read_text())


def load_efficiency(gpu: GpuPerf, directory: Path | None = None) -> Efficiency:
    """Fitted efficiency from ``coefficients/throughput_<gpu-key>.json`` (written by :func:`fit_efficiency`)
    if there is one, else the prior of the GPU's generation."""
    path = (directory or coefficients_dir()) / f"throughput_{gpu.key}.json"
    if not path.is_file():
        return prior_efficiency(gpu)
    try:
        data = _read_coefficients(str(path), path.stat().st_mtime_ns)
        e_max, half = float(data["e_max"]), float(data["tokens_half"])
        width = float(data.get("width_half", WIDTH_HALF))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"coefficients: {path} is not a throughput fit ({err})") from None
    fit = data.get("fit", {})
    return Efficiency(gpu.key, e_max, half, width, bool(data.get("calibrated", True)),
                      f"fitted to {fit.get('n_rows', '?')} single-GPU runs, {path.name}")


# --- FLOPs ----------------------------------------------------------------------------------------------
def micro_batch_flops(shape: ModelShape, tokens: int, seq_len: int, *, grad_ckpt: bool, lora: bool,
                      tp: int = 1) -> float:
    """Training FLOPs one rank does for a micro-batch of ``tokens`` tokens. Under TP the decoder layers and
    attention split ``tp`` ways; the LM head is replicated (no vocab-parallel head, see tp_plans)."""
    passes = (4.0 if lora else 6.0) + (2.0 if grad_ckpt else 0.0)
    layer_params = shape.matmul_params - shape.head_params
    weights = passes * (layer_params / tp + shape.head_params) * tokens
    attention = (12.0 + (4.0 if grad_ckpt else 0.0)) * shape.layers * shape.hidden_size * seq_len * tokens / tp
    return weights + attention


def backward_fraction(*, grad_ckpt: bool, lora: bool) -> float:
    """Share of the micro-batch compute that is backward (the window DDP buckets overlap with)."""
    fwd, bwd = 2.0, (2.0 if lora else 4.0)
    # checkpointing recomputes each layer's forward inside the backward pass
    return (bwd + (2.0 if grad_ckpt else 0.0)) / (fwd + bwd + (2.0 if grad_ckpt else 0.0))


# --- the step -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """One candidate run as the throughput model needs it."""

    method: str
    world_size: int
    tp: int
    micro_batch: int
    seq_len: int
    grad_accum: int = 1
    grad_ckpt: bool = False
    precision: str = "mixed_bf16"
    optimizer: str = "adamw"
    lora: bool = False
    overlap_comm: bool | None = None   # DeepSpeed's ZeroSpec.overlap_comm (None = its default)
    pin_memory: bool = False
    cp: int = 1                        # context parallelism: each rank runs seq_len / cp tokens of a sequence
    pp: int = 1                        # pipeline stages (grad_accum: the pipeline's micro-batches per step)
    ep: int = 1                        # expert parallelism (FSDP2): each rank holds experts / ep of every layer
    moe_imbalance: float = 1.0         # the busiest expert's load relative to balanced routing (ParallelSpec's)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def shards(self) -> int:
        """Ranks the sharded states are split over (FSDP2 shards over dp x cp; a pipeline stage's over its dp)."""
        return self.world_size // (self.tp * self.pp)


@dataclass
class StepTime:
    step_s: float
    compute_s: float          # per optimizer step (all micro-batches)
    comm_s: float             # network communication per step, before overlap
    exposed_comm_s: float     # what is left after overlap
    offload_s: float          # PCIe transfers + CPU Adam (exposed)
    optimizer_s: float        # GPU optimizer update
    efficiency: float
    flops_per_step: float     # per rank
    tokens_per_s: float
    parts: dict[str, float] = field(default_factory=dict)   # seconds per named term, before overlap

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ring(kind: str, n: int) -> float:
    if n <= 1:
        return 0.0
    return (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n


def _sharded_gather_s(shape: ModelShape, setup: Setup, psi: float, grad_elem: float, dp_link: Link) -> float:
    """One pass of FSDP's per-layer all-gathers (the reduce-scatter moves as much). Under EP the routed experts
    are a unit of their own, sharded over the world / ep ranks that hold the same experts: a rank gathers only its
    experts / ep of them, over those ranks (``estimator.models.moe_ep``), which are strided across the EP groups,
    so across the data-parallel link."""
    if setup.ep == 1 or not shape.moe_layers or shape.trainable_params is not None:
        return dp_link.time("all_gather", psi, setup.shards, shape.layers + 1)
    experts = shape.expert_params * grad_elem
    efsdp = setup.shards // setup.ep
    return dp_link.time("all_gather", psi - experts, setup.shards, shape.layers + 1) + \
        dp_link.time("all_gather", experts / setup.ep, efsdp, shape.moe_layers)


def _tp_all_reduce_s(shape: ModelShape, setup: Setup, tokens: int, tp_link: Link) -> float:
    """TP's all-reduces of one micro-batch over every decoder layer (Megatron pairing: 2 per layer and pass:
    forward, backward, and a checkpointed layer's recomputed forward), each of the micro-batch's hidden states."""
    if setup.tp <= 1:
        return 0.0
    act_elem = 4.0 if setup.precision == "fp32" else 2.0
    passes = 3 if setup.grad_ckpt else 2
    count = 2 * passes * shape.layers
    return tp_link.time("all_reduce", count * tokens * shape.hidden_size * act_elem, setup.tp, count)


def _busiest_rows_factor(shape: ModelShape, setup: Setup) -> float:
    """Rows the busiest EP rank's experts run on relative to balanced routing: the step waits for that rank."""
    return received_rows_factor(setup.moe_imbalance, setup.ep, shape.experts, shape.top_k)


def _all_to_all_s(shape: ModelShape, setup: Setup, tokens: int, act_elem: float, link: Link) -> float:
    """EP's exchanges of one micro-batch: each MoE layer sends its T x top_k rows to the experts' ranks and gets
    them back (dispatch and combine), in forward, in backward (their gradients) and again in a checkpointed
    layer's recomputation; (ep - 1) / ep of them leave the rank under balanced routing. Skewed routing: the
    busiest rank receives (and returns) ``_busiest_rows_factor`` x as many, and every rank waits for it."""
    passes = 3 if setup.grad_ckpt else 2
    count = 2 * passes * shape.moe_layers
    rows = tokens * shape.top_k * _busiest_rows_factor(shape, setup)
    return link.time("all_gather", count * rows * shape.hidden_size * act_elem, setup.ep, count)


def _skewed_experts_flops(shape: ModelShape, setup: Setup, tokens: int) -> float:
    """The routed-expert FLOPs the busiest EP rank runs beyond its balanced share: each row costs an expert's
    matmuls (expert parameters / experts per MoE layer) in every pass."""
    extra = _busiest_rows_factor(shape, setup) - 1.0
    if extra <= 0 or not shape.experts or not shape.moe_layers:
        return 0.0
    passes = (4.0 if setup.lora else 6.0) + (2.0 if setup.grad_ckpt else 0.0)
    return extra * passes * tokens * shape.top_k * shape.expert_params / shape.experts


def step_time(shape: ModelShape, setup: Setup, gpu: GpuPerf, eff: Efficiency, *,
              dp_link: Link, tp_link: Link, ep_link: Link | None = None) -> StepTime:
    """Predicted time of one optimizer step (see the module docstring for every term). ``ep_link``: the link of
    the expert-parallel group (default: ``dp_link``)."""
    ep_link = ep_link or dp_link
    if setup.pp > 1:
        return _pipeline_step_time(shape, setup, gpu, eff, dp_link=dp_link, tp_link=tp_link)
    m, tp, dp, accum = setup.method, setup.tp, setup.dp, setup.grad_accum
    shards = setup.shards
    tokens = setup.micro_batch * setup.seq_len // setup.cp  # this rank's (its share of causal attention too)
    peak = gpu.flops_for(setup.precision)
    if peak <= 0:
        raise ValueError(f"precision: {gpu.key} has no {setup.precision} tensor throughput "
                         f"(no bf16 before Ampere); use mixed_fp16 or fp32")
    efficiency = eff.at(tokens, shape.hidden_size / tp)
    flops = micro_batch_flops(shape, tokens, setup.seq_len, grad_ckpt=setup.grad_ckpt, lora=setup.lora, tp=tp)
    skewed = _skewed_experts_flops(shape, setup, tokens) if setup.ep > 1 else 0.0
    flops += skewed
    compute_micro = flops / (peak * efficiency)
    bwd_micro = compute_micro * backward_fraction(grad_ckpt=setup.grad_ckpt, lora=setup.lora)

    grad_elem = 2.0 if setup.precision in _SIXTEEN_BIT else 4.0
    act_elem = 4.0 if setup.precision == "fp32" else 2.0
    psi = shape.trainable_per_rank(tp) * grad_elem   # this rank's gradient bytes (its TP shard)
    zero_overlap = OVERLAP["zero_on" if setup.overlap_comm else "zero_off"]
    parts: dict[str, float] = {}
    micro_comm = step_comm = 0.0                      # seconds per micro-batch / per optimizer step
    hidden_micro = hidden_step = 0.0                  # how much of each overlap can hide
    if m in ("ddp", "zero1"):                         # one all-reduce (ZeRO-1: reduce-scatter + all-gather)
        buckets = max(1, math.ceil(psi / DDP_BUCKET_BYTES))
        step_comm = dp_link.time("all_reduce", psi, dp, buckets)
        parts["dp_allreduce"] = step_comm
        hidden_step = (zero_overlap if m == "zero1" else OVERLAP["ddp"]) * bwd_micro   # last backward only
    elif m in ("zero2", "zero_offload"):
        buckets = max(1, math.ceil(psi / grad_elem / ZERO_BUCKET_ELEMENTS))
        micro_comm = dp_link.time("reduce_scatter", psi, dp, buckets)
        step_comm = dp_link.time("all_gather", psi, dp, buckets)
        parts["dp_reduce_scatter"], parts["dp_all_gather"] = micro_comm * accum, step_comm
        hidden_micro = zero_overlap * bwd_micro
    elif m in ("zero3", "fsdp", "fsdp1", "dp_tp") + ZERO3_OFFLOAD:   # dp_tp: FSDP2 over the dp axis of the mesh
        micro_comm = 3 * _sharded_gather_s(shape, setup, psi, grad_elem, dp_link)
        parts["dp_gather_scatter"] = micro_comm * accum
        overlap = OVERLAP["fsdp" if m in FSDP_METHODS else "zero3"] \
            if setup.overlap_comm is not False else 0.0
        hidden_micro = overlap * compute_micro        # prefetch hides under forward and backward
    sharded = "fsdp" if m in ("dp_tp", "fsdp1") else ("zero3" if m in ZERO3_OFFLOAD else m)
    sharding = SHARDING_OVERHEAD_S.get(sharded, 0.0) * shape.layers * (3 if setup.grad_ckpt else 2)
    if sharding:
        parts["sharding_overhead"] = sharding * accum
    tp_micro = 0.0
    if m in ("tp", "dp_tp"):
        tp_micro = _tp_all_reduce_s(shape, setup, tokens, tp_link)
        parts["tp_allreduce"] = tp_micro * accum      # on the critical path: nothing hides it
    if setup.cp > 1:  # ring attention: k|v all-gathered per layer and pass; backward rotates fp32 dk|dv cp - 1 times
        passes = 3 if setup.grad_ckpt else 2
        kv_bytes = 2 * tokens * shape.kv_dim * act_elem / setup.tp  # this rank's k|v (its kv heads under tp)
        ring = shape.layers * (passes * setup.cp * kv_bytes + (setup.cp - 1) * 2 * kv_bytes)
        ring_micro = dp_link.time("all_gather", ring, setup.cp, shape.layers * (passes + setup.cp - 1))
        tp_micro += ring_micro
        parts["cp_ring"] = ring_micro * accum         # waited on inside attention: on the critical path
    if setup.ep > 1 and shape.moe_layers:  # transformers' AllToAllEP waits on each exchange: the critical path
        a2a = _all_to_all_s(shape, setup, tokens, act_elem, ep_link)
        parts["ep_all_to_all"] = a2a * accum
        tp_micro += a2a
    exposed_micro = max(0.0, micro_comm - hidden_micro) + tp_micro + sharding
    exposed_step = max(0.0, step_comm - hidden_step)
    micro_comm += tp_micro

    offload = 0.0
    if m in OFFLOAD_METHODS:
        shard = shape.trainable / dp                  # this rank's optimizer partition
        pcie = host_bandwidth(gpu, setup.pin_memory)
        grads_d2h = shard * grad_elem / pcie          # every micro-batch (accumulated in fp32 on the host)
        ranks_per_node = min(setup.world_size, GPUS_PER_NODE)
        cpu_adam = shard * ranks_per_node / CPU_ADAM_PARAMS_PER_S
        if m == "zero_infinity":                      # parameters live on the host: every gather fetches them
            passes = 3 if setup.grad_ckpt else 2
            params_h2d = passes * shape.params / dp * grad_elem / pcie * accum
        else:                                         # the updated 16-bit partition goes back once per step
            params_h2d = shard * grad_elem / pcie
        parts.update(offload_grads_d2h=grads_d2h * accum, offload_params_h2d=params_h2d, cpu_adam=cpu_adam)
        offload = accum * max(0.0, grads_d2h - OVERLAP["offload_grads"] * bwd_micro) \
            + params_h2d * (1 - OVERLAP["offload_params"]) + cpu_adam
        optimizer = 0.0
    else:
        local = shape.trainable_per_rank(tp) / (shards if m in ("zero1", "zero2", "zero3", "fsdp", "fsdp1", "dp_tp")
                                                else 1)
        per_param = OPTIMIZER_BYTES_PER_PARAM.get(setup.optimizer, 32.0)
        optimizer = local * per_param / (gpu.memory_bandwidth * HBM_EFFICIENCY)
    parts["compute"] = compute_micro * accum
    if skewed:
        parts["ep_busiest_rank_extra_compute"] = skewed / (peak * efficiency) * accum
    parts["optimizer"] = optimizer
    step = accum * (compute_micro + exposed_micro) + exposed_step + offload + optimizer
    comm = micro_comm * accum + step_comm
    exposed = accum * exposed_micro + exposed_step     # includes the sharding bookkeeping
    tokens_per_s = dp * setup.micro_batch * accum * setup.seq_len / step
    return StepTime(step_s=step, compute_s=compute_micro * accum, comm_s=comm, exposed_comm_s=exposed,
                    offload_s=offload, optimizer_s=optimizer, efficiency=efficiency,
                    flops_per_step=flops * accum, tokens_per_s=tokens_per_s, parts=parts)


def _pipeline_step_time(shape: ModelShape, setup: Setup, gpu: GpuPerf, eff: Efficiency, *, dp_link: Link,
                        tp_link: Link | None = None) -> StepTime:
    """A prior for a pipeline step (``Setup.pp`` stages, ``grad_accum`` micro-batches M): each stage does 1 / pp
    of a micro-batch's FLOPs, and a 1F1B / GPipe step takes (M + pp - 1) stage slots (the bubble); the
    point-to-point activation sends are not counted. Under fsdp the stage's gradients are reduce-scattered and its
    parameters gathered once per step (torch's stage defers both to the last micro-batch). Under pp x tp each stage
    splits its layers' FLOPs tp ways and waits on TP's all-reduces as tp alone does (2 per layer and pass, nothing
    hides them), for its 1 / pp of the layers: a stage slot is its compute plus that. pp x dp x tp (dp_tp) adds the
    fsdp terms over the TP rank's shards."""
    pp, dp, tp, accum = setup.pp, setup.dp, setup.tp, setup.grad_accum
    tokens = setup.micro_batch * setup.seq_len
    peak = gpu.flops_for(setup.precision)
    if peak <= 0:
        raise ValueError(f"precision: {gpu.key} has no {setup.precision} tensor throughput")
    efficiency = eff.at(tokens, shape.hidden_size / tp)
    flops = micro_batch_flops(shape, tokens, setup.seq_len, grad_ckpt=setup.grad_ckpt, lora=setup.lora, tp=tp)
    stage_micro = flops / pp / (peak * efficiency)
    stage_tp = _tp_all_reduce_s(shape, setup, tokens, tp_link or dp_link) / pp
    slots = accum + pp - 1
    compute = slots * stage_micro
    grad_elem = 2.0 if setup.precision in _SIXTEEN_BIT else 4.0
    trainable = shape.trainable_per_rank(tp)
    psi = trainable / pp * grad_elem
    comm = 0.0
    sharded = setup.method in ("fsdp", "dp_tp") and dp > 1  # pp x fsdp, pp x dp x tp: FSDP2 over each stage's dp
    if sharded:
        layers = max(1, shape.layers // pp) + 1
        comm = dp_link.time("reduce_scatter", psi, dp, layers) + dp_link.time("all_gather", psi, dp, layers)
    local = trainable / pp / (dp if sharded else 1)
    optimizer = local * OPTIMIZER_BYTES_PER_PARAM.get(setup.optimizer, 32.0) / (gpu.memory_bandwidth * HBM_EFFICIENCY)
    step = compute + slots * stage_tp + comm + optimizer
    parts = {"compute": compute, "pipeline_bubble": (pp - 1) * (stage_micro + stage_tp), "dp_gather_scatter": comm,
             "optimizer": optimizer}
    if stage_tp:
        parts["tp_allreduce"] = slots * stage_tp
    comm += slots * stage_tp
    return StepTime(step_s=step, compute_s=compute, comm_s=comm, exposed_comm_s=comm, offload_s=0.0,
                    optimizer_s=optimizer, efficiency=efficiency, flops_per_step=flops * accum,
                    tokens_per_s=dp * setup.micro_batch * accum * setup.seq_len / step, parts=parts)


def assumptions(gpu: GpuPerf, eff: Efficiency, dp_link: Link, tp_link: Link) -> dict[str, Any]:
    """Every number the ranking rests on, with where it comes from (printed by the planner)."""
    return {
        "compute_efficiency": {"e_max": eff.e_max, "tokens_half": eff.tokens_half,
                               "width_half": eff.width_half, "calibrated": eff.calibrated,
                               "source": eff.source},
        "peak_tflops": {k: v / 1e12 for k, v in gpu.peak_flops.items()},
        "dp_link": {"name": dp_link.name, "bus_bandwidth_gbs": dp_link.bandwidth / 1e9, "source": dp_link.source},
        "tp_link": {"name": tp_link.name, "bus_bandwidth_gbs": tp_link.bandwidth / 1e9, "source": tp_link.source},
        "overlap_priors": dict(OVERLAP),
        "collective_latency_s": dict(LATENCY_S),
        "sharding_overhead_s_per_layer": dict(SHARDING_OVERHEAD_S),
        "cpu_adam_params_per_s": CPU_ADAM_PARAMS_PER_S,
        "host_link_gbs": host_bandwidth(gpu, True) / 1e9,
        "optimizer_bytes_per_param": dict(OPTIMIZER_BYTES_PER_PARAM),
    }


# --- calibration: compute efficiency from measured step times ----------------------------------------------
# fit_efficiency() turns the harness's single-GPU rows into e_max and tokens_half per GPU type. It uses the same
# FLOP count as the predictions (micro_batch_flops) and subtracts the optimizer update the model predicts, so
# what it measures is exactly the knob the planner turns. Pure standard library, like the predict path.
SKIPPED_GPU_KEYS = ("cpu", "fake")           # data/measurements/cpu (CPU runs) and fake (traces): no GPU time
FIT_PRECISIONS = ("bf16", "mixed_bf16", "mixed_fp16", "amp_bf16", "amp_fp16")   # tensor-core matmuls


def _row_value(row: dict, *names: str) -> Any:
    for name in names:
        if row.get(name) not in (None, ""):
            return row[name]
    return None


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def _row_shape(row: dict) -> ModelShape:
    """The model as the FLOP count sees it: explicit ``params``/``num_layers``/``hidden_size`` columns, else the
    estimator's parameter table for the row's ``model`` (``estimator.planning.shape.model_shape``)."""
    params = _row_value(row, "params", "model_params", "num_params", "param_count")
    layers = _row_value(row, "num_layers", "layers", "num_hidden_layers")
    hidden = _row_value(row, "hidden_size")
    matmul = _row_value(row, "matmul_params")
    lora_rank = int(float(_row_value(row, "lora_rank") or 0))
    if params is None or layers is None or hidden is None:
        model = _row_value(row, "model")
        if model is None:
            raise ValueError("rows: need 'params', 'num_layers', 'hidden_size' or a 'model' column")
        return model_shape(str(model), lora_rank, str(_row_value(row, "lora_targets") or "auto"))
    p = int(float(params))
    trainable = _row_value(row, "trainable_params")
    return ModelShape(params=p, matmul_params=int(float(matmul)) if matmul is not None else p,
                      layers=int(float(layers)), hidden_size=int(float(hidden)),
                      trainable_params=int(float(trainable)) if trainable is not None else None)


@dataclass(frozen=True)
class MeasuredPoint:
    """One single-GPU run as the fit sees it."""

    model: str
    tokens: float            # tokens per micro-batch actually fed (padding included)
    width: float             # GEMM width (hidden size; tp = 1)
    efficiency: float        # achieved fraction of the precision's peak FLOP/s
    step_s: float


def measured_point(row: dict, gpu: GpuPerf) -> MeasuredPoint:
    """Achieved efficiency of one measured single-GPU row: the model's training FLOPs over (step time minus the
    predicted optimizer update) over peak FLOP/s. Tokens come from ``tokens_per_s * step_time_s`` when both are
    there (right under ``padding=longest``), else ``micro_batch_size * seq_len``."""
    shape = _row_shape(row)
    mb = int(float(_row_value(row, "micro_batch_size", "micro_batch")))
    seq = int(float(_row_value(row, "seq_len")))
    accum = int(float(_row_value(row, "grad_accum_steps") or 1))
    step, rate = _row_value(row, "step_time_s"), _row_value(row, "tokens_per_s")
    step_s = float(step) if step is not None else mb * seq * accum / float(rate)
    tokens = float(rate) * step_s / accum if step is not None and rate is not None else float(mb * seq)
    if not (step_s > 0 and tokens > 0):
        raise ValueError(f"rows: step time {step_s!r} s with {tokens!r} tokens is not a measurement")
    seq_eff = tokens / mb
    precision = str(_row_value(row, "precision") or "mixed_bf16")
    grad_ckpt = _truthy(_row_value(row, "grad_ckpt") or False)
    lora = int(float(_row_value(row, "lora_rank") or 0)) > 0
    optimizer = str(_row_value(row, "optimizer") or "adamw")
    flops = micro_batch_flops(shape, tokens, seq_eff, grad_ckpt=grad_ckpt, lora=lora) * accum
    optimizer_s = shape.trainable * OPTIMIZER_BYTES_PER_PARAM.get(optimizer, 32.0) \
        / (gpu.memory_bandwidth * HBM_EFFICIENCY)
    compute_s = max(step_s - optimizer_s, 0.05 * step_s)
    peak = gpu.flops_for(precision)
    if peak <= 0:
        raise ValueError(f"rows: {gpu.key} has no {precision} peak FLOP/s in the catalogue")
    return MeasuredPoint(str(_row_value(row, "model") or "?"), tokens, float(shape.hidden_size),
                         flops / (compute_s * peak), step_s)


def _fit_one(points: list[MeasuredPoint], prior: Efficiency) -> tuple[float, float]:
    """(e_max, tokens_half) by least squares on the linear form 1/y = 1/e_max + (tokens_half/e_max) * 1/T,
    y = efficiency / width factor. With one token count (or a fit that would make efficiency fall with the
    micro-batch) ``tokens_half`` keeps its prior and ``e_max`` is the median that matches the points."""
    xs = [p.tokens for p in points]
    ys = [p.efficiency / (p.width / (p.width + prior.width_half)) for p in points]
    if len(set(xs)) >= 2:
        u, v = [1.0 / x for x in xs], [1.0 / y for y in ys]
        mu, mv = statistics.fmean(u), statistics.fmean(v)
        suu = sum((a - mu) ** 2 for a in u)
        slope = sum((a - mu) * (b - mv) for a, b in zip(u, v, strict=True)) / suu
        intercept = mv - slope * mu
        if intercept > 0 and slope >= 0:
            return min(1.0, 1.0 / intercept), slope / intercept
    k = prior.tokens_half
    return min(1.0, statistics.median(y * (x + k) / x for x, y in zip(xs, ys, strict=True))), k


def usable_row(row: dict) -> str:
    """Why a harness row cannot calibrate compute efficiency ('' if it can)."""
    if str(row.get("method", "")) != "single" or str(row.get("world_size") or "1") not in ("1", "1.0"):
        return "not a single-GPU run"
    if _truthy(row.get("emulated", False)) or str(row.get("measured_by") or "real_run") != "real_run":
        return "emulated rank or fake trace (no timing)"
    if any(str(row.get(k) or "ok") != "ok" for k in ("status", "run_status", "rank_status")):
        return "failed run"
    if str(row.get("gpu_key") or "") in SKIPPED_GPU_KEYS or not row.get("gpu_key"):
        return "no GPU"
    if _row_value(row, "step_time_s", "tokens_per_s") is None:
        return "no step time"
    if str(_row_value(row, "precision") or "mixed_bf16") not in FIT_PRECISIONS:
        return "fp32 (the fit is for 16-bit tensor-core matmuls)"
    if int(float(_row_value(row, "num_alloc_retries") or 0)) > 0:
        return "allocator retries (cache flushes slow the step)"
    return ""


def fit_efficiency(rows: list[dict], *, out_dir: Path | None = None, gpu_lookup=None,
                   sources: list[str] | None = None) -> dict[str, dict]:
    """Fit ``e_max`` and ``tokens_half`` per GPU type from the harness's single-GPU rows.

    Rows are dicts (``csv.DictReader`` over ``data/measurements/<gpu-key>/*.csv``, schema in
    ``harness/table.py``): ``gpu_key``, ``method``, ``world_size``, ``step_time_s`` (or ``tokens_per_s``),
    ``micro_batch_size``, ``seq_len``, ``precision``, ``grad_ckpt``, ``lora_rank``, ``optimizer``,
    ``grad_accum_steps``, ``model``; parameter counts come from the estimator for ``model`` unless the row
    has ``params``, ``num_layers`` and ``hidden_size``. Rows :func:`usable_row` rejects are skipped and
    counted. Returns ``{gpu_key: fit}``; with ``out_dir``, writes ``throughput_<gpu-key>.json`` there (what
    :func:`load_efficiency` reads). ``sources`` (input file names) go into the provenance.
    """
    lookup = gpu_lookup or gpu_perf
    groups: dict[str, list[dict]] = {}
    skipped: dict[str, int] = {}
    for row in rows:
        why = usable_row(row)
        if why:
            skipped[why] = skipped.get(why, 0) + 1
            continue
        groups.setdefault(str(row["gpu_key"]), []).append(row)
    result: dict[str, dict] = {}
    for key, group in sorted(groups.items()):
        gpu = lookup(key)
        prior = prior_efficiency(gpu)
        points = [measured_point(row, gpu) for row in group]
        e_max, k = _fit_one(points, prior)
        fitted = Efficiency(key, e_max, k, prior.width_half, True)
        rel = [abs(fitted.at(p.tokens, p.width) - p.efficiency) / p.efficiency for p in points]
        one_x = len({p.tokens for p in points}) < 2
        result[key] = {
            "schema_version": SCHEMA_VERSION, "gpu_key": key, "target": "compute_efficiency",
            "form": "e_max * T/(T + tokens_half) * w/(w + width_half); T = micro-batch tokens, w = hidden/tp",
            "e_max": round(e_max, 6), "tokens_half": round(k, 3), "width_half": prior.width_half,
            "calibrated": True,
            "fitted": ["e_max"] + ([] if one_x else ["tokens_half"]),
            "priors": {"width_half": prior.width_half, **({"tokens_half": k} if one_x else {})},
            "fit": {"n_rows": len(points), "tokens_range": [min(p.tokens for p in points),
                                                            max(p.tokens for p in points)],
                    "median_abs_rel_error": round(statistics.median(rel), 4), "max_abs_rel_error": round(max(rel), 4),
                    "skipped_rows": dict(sorted(skipped.items()))},
            "points": [{"model": p.model, "tokens": p.tokens, "measured": round(p.efficiency, 4),
                        "fitted": round(fitted.at(p.tokens, p.width), 4), "step_time_s": round(p.step_s, 6)}
                       for p in sorted(points, key=lambda p: (p.model, p.tokens))],
            "provenance": {"kind": "fit", "written": _dt.date.today().isoformat(),
                           "command": "python -m estimator.planning.throughput fit", "inputs": sorted(sources or []),
                           "models": sorted({p.model for p in points})},
            "description": "Fraction of the precision's peak FLOP/s reached by single-GPU harness runs: training "
                           "FLOPs (estimator.planning.throughput.micro_batch_flops) over the measured step time minus the "
                           "predicted optimizer update. width_half (TP narrowing) stays a prior: single-GPU runs "
                           "cannot see it.",
        }
        if out_dir is not None:
            out = Path(out_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"throughput_{key}.json").write_text(json.dumps(result[key], indent=2, sort_keys=True) + "\n")
    return result


def default_measurements_dir() -> Path:
    """``data/measurements`` of the checkout this package runs from (else of the working directory)."""
    repo = Path(__file__).resolve().parents[2] / "data" / "measurements"
    return repo if repo.is_dir() else Path.cwd() / "data" / "measurements"


def read_measurements(paths: list[Path]) -> tuple[list[dict], list[str]]:
    """Rows of the given CSV files, or of every ``<dir>/<gpu-key>/*.csv`` for a directory."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files += sorted(path.glob("*/*.csv")) + sorted(path.glob("*.csv"))
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"csv: {path} does not exist")
    rows: list[dict] = []
    for path in files:
        with path.open(newline="") as handle:
            rows.extend(csv.DictReader(handle))
    return rows, [str(p) for p in files]


def main(argv: list[str] | None = None) -> int:
    """``python -m estimator.planning.throughput fit [CSV or DIR ...] [--out-dir DIR] [--dry-run]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["fit"]:
        argv = argv[1:]
    parser = argparse.ArgumentParser(prog="python -m estimator.planning.throughput fit",
                                     description="Fit the planner's compute efficiency per GPU type from the "
                                                 "harness's single-GPU step times.")
    parser.add_argument("inputs", nargs="*", type=Path,
                        help="measurement CSVs or directories (default: data/measurements/*/*.csv)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where to write throughput_<gpu-key>.json (default: the package's coefficients/)")
    parser.add_argument("--dry-run", action="store_true", help="print the fit, write nothing")
    args = parser.parse_args(argv)
    try:
        rows, sources = read_measurements(args.inputs or [default_measurements_dir()])
        out_dir = None if args.dry_run else (args.out_dir or coefficients_dir())
        fitted = fit_efficiency(rows, out_dir=out_dir, sources=sources)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not fitted:
        print(f"error: no usable rows in {len(sources)} file(s) (need real single-GPU runs with a step time)",
              file=sys.stderr)
        return 2
    for key, data in fitted.items():
        fit = data["fit"]
        print(f"{key}: e_max={data['e_max']:.3f} tokens_half={data['tokens_half']:.0f} "
              f"({fit['n_rows']} runs, median error {100 * fit['median_abs_rel_error']:.1f} %, "
              f"fitted: {', '.join(data['fitted'])}; priors: {', '.join(data['priors'])})"
              + ("" if args.dry_run else f" -> {(out_dir / f'throughput_{key}.json')}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
