"""The planner: for a model on N GPUs of one type, the fastest method and micro-batch that fit.

Pure standard library. For every candidate (each method the estimator knows, every dp x tp split of N,
ZeRO-Offload and ZeRO-3 with the optimizer -- and for ZeRO-Infinity also the parameters -- on the CPU, each
with and without gradient checkpointing) it searches the largest micro-batch whose *calibrated safety
bound* (``Estimate.upper_bound_bytes``) fits the GPU, predicts its throughput with
:mod:`estimator.planning.throughput`, and ranks the candidates by tokens/s per job. Offload layouts report the host
RAM of a node (and do not fit when it exceeds ``host_ram_gb``). With a global batch it counts
gradient-accumulation steps. When nothing fits it says what would: offload, how many GPUs, LoRA, a shorter
sequence -- from profiles already shipped or cached, never by building one.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from estimator.methods.long_context import technique_name
from estimator.models.moe import routed_experts
from estimator.planning import throughput as tput
from estimator.planning.shape import ModelShape, model_facts, model_shape
from estimator.spec import FSDP_METHODS, Fsdp1Spec, ParallelSpec, RunSpec, TrainingSpec, ZeroSpec

GIB = 1024**3
MAX_MICRO_BATCH = 4096          # search ceiling (reported as ">= cap" when reached)
MAX_GPUS = 4096                 # the largest N the planner (and its "how many GPUs" advice) considers
ADVICE_LORA_RANK = 16
# The planner's layouts: the estimator's methods, plus ZeRO-3 with CPU offload (a ``zero3`` spec with
# ``ZeroSpec.offload_optimizer`` / ``offload_param``: DeepSpeed's "ZeRO-3 Offload" and ZeRO-Infinity on the CPU).
METHOD_ORDER = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp1", "tp", "dp_tp", "zero_offload",
                "zero3_offload", "zero_infinity")
METHOD_RANK = {m: i for i, m in enumerate(METHOD_ORDER)}   # simpler first, for ties
OFFLOAD_METHODS = ("zero_offload", "zero3_offload", "zero_infinity")
# Layouts a methods filter names that are weighed only when named: DeepSpeed's pipeline engine (ZeRO stage 0; its
# candidates are method single, one rank per stage, or ddp over each stage's data-parallel ranks, pp_engine deepspeed)
DS_PIPELINE = "ds_pipeline"
FILTER_ONLY = (DS_PIPELINE,)
# What each layout is, in the terms of the framework that runs it (printed with the recommendation).
RUN_AS = {
    "single": "one GPU, plain PyTorch",
    "ddp": "PyTorch DDP",
    "zero1": "DeepSpeed ZeRO stage 1",
    "zero2": "DeepSpeed ZeRO stage 2",
    "zero3": "DeepSpeed ZeRO stage 3",
    "fsdp": "PyTorch FSDP2 (fully_shard per decoder layer)",
    "fsdp1": "PyTorch FSDP1 (FullyShardedDataParallel per decoder layer, FULL_SHARD, use_orig_params)",
    "tp": "DTensor tensor parallelism over every GPU",
    "dp_tp": "DTensor tensor parallelism inside, FSDP2 over the data-parallel axis",
    "zero_offload": "DeepSpeed ZeRO-Offload: stage 2, offload_optimizer cpu",
    "zero3_offload": "DeepSpeed ZeRO stage 3, offload_optimizer cpu",
    "zero_infinity": "DeepSpeed ZeRO-Infinity: stage 3, offload_optimizer cpu + offload_param cpu",
}

EstimateFn = Callable[[RunSpec], Any]


def run_as(cand: Candidate) -> str:
    """What the layout is, in the terms of the framework that runs it (``RUN_AS``, plus context parallelism)."""
    if cand.pp_engine == "deepspeed":
        return ("DeepSpeed's pipeline engine (PipelineModule split by parameter count, PipelineEngine's TrainSchedule), "
                "ZeRO stage 0")
    text = RUN_AS[cand.method]
    return text + (f" + torch context_parallel (ring attention) over groups of {cand.cp} ranks" if cand.cp > 1
                   else "")


def _check_tp(arch, tp: int) -> None:
    try:
        from estimator.models.tp_plans import check_tp
    except ImportError:
        if arch.num_heads % tp:
            raise ValueError(f"tp: {tp} does not divide the {arch.num_heads} attention heads") from None
        return
    check_tp(arch, tp)


def _checked_imbalance(moe_imbalance: float) -> float:
    """``moe_imbalance`` as ``ParallelSpec`` validates it (``ValueError("moe_imbalance: ...")``)."""
    return ParallelSpec(method="fsdp", world_size=2, moe_imbalance=moe_imbalance).moe_imbalance


# --- candidates -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    method: str                  # one of METHOD_ORDER (the planner's layout name)
    world_size: int
    tp: int = 1
    grad_ckpt: bool = False
    ep: int = 1                  # expert parallelism of a MoE model (fsdp only)
    cp: int = 1                  # context parallelism (fsdp, dp_tp): ring attention over cp ranks
    pp: int = 1                  # pipeline stages (single: pp = world size; fsdp: FSDP2 over world / pp; tp: TP
    #                              inside each stage; dp_tp: both, mesh (pp, dp, tp))
    pp_engine: str = "torch"     # torch's pipelining, or DeepSpeed's pipeline engine (method single, pp = world)

    @property
    def dp(self) -> int:
        """Data-parallel degree: the sequences a step runs side by side (cp ranks share one; pp stages split
        the layers)."""
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def offload(self) -> bool:
        return self.method in OFFLOAD_METHODS

    def parallel_spec(self) -> ParallelSpec:
        """The estimator's spec for this layout (ZeRO-3 offload: ``zero3`` with ZeroSpec offload flags)."""
        if self.method in ("zero3_offload", "zero_infinity"):
            zero = ZeroSpec(offload_optimizer=True, offload_param=self.method == "zero_infinity")
            return ParallelSpec(method="zero3", world_size=self.world_size, zero=zero)
        return ParallelSpec(method=self.method, world_size=self.world_size, tp=self.tp, ep=self.ep, cp=self.cp,
                            pp=self.pp, pp_engine=self.pp_engine)

    @property
    def label(self) -> str:
        if self.pp_engine == "deepspeed":
            return f"pp{self.pp} deepspeed" if self.dp == 1 else f"pp{self.pp} x dp{self.dp} deepspeed"
        if self.pp > 1 and self.method == "dp_tp":
            return f"pp{self.pp} x dp{self.dp} x tp{self.tp}"
        if self.method == "dp_tp" and self.cp > 1:
            return f"dp{self.dp} cp{self.cp} tp{self.tp}"
        if self.method == "dp_tp":
            return f"dp_tp {self.dp}x{self.tp}"
        if self.cp > 1:
            return f"fsdp cp{self.cp}"
        if self.ep > 1:
            return f"fsdp ep{self.ep}"
        if self.pp > 1 and self.tp > 1:
            return f"pp{self.pp} x tp{self.tp}"
        if self.pp > 1:
            return f"pp{self.pp} 1f1b" if self.method == "single" else f"pp{self.pp} x fsdp{self.dp}"
        return self.method


def pp_layouts(world_size: int, num_layers: int, ckpt_options: Iterable[bool] = (False,),
               tp_degrees: Iterable[int] = ()) -> list[Candidate]:
    """Pipeline layouts on ``world_size`` GPUs (torch's 1F1B, pp micro-batches): pp alone (single, pp = world
    size) and pp x FSDP2, each pp >= 2 dividing the GPUs and at most the decoder layers, then pp x tp (TP inside
    each stage, pp x tp = the GPUs: method tp) for each of ``tp_degrees`` that leaves such a pp; each with and
    without checkpointing each stage's decoder layers as ``ckpt_options`` says (as torchtitan checkpoints under
    pp)."""
    out = []
    for pp in range(2, min(world_size, num_layers) + 1):
        if world_size % pp == 0:
            out += [Candidate("single" if pp == world_size else "fsdp", world_size, grad_ckpt=ckpt, pp=pp)
                    for ckpt in ckpt_options]
    for tp in sorted(set(tp_degrees), reverse=True):  # the pipeline's degree rising, as above
        pp = world_size // tp
        if 1 < tp < world_size and world_size % tp == 0 and pp <= num_layers:
            out += [Candidate("tp", world_size, tp=tp, grad_ckpt=ckpt, pp=pp) for ckpt in ckpt_options]
    return out


def pp_dp_tp_layouts(world_size: int, num_layers: int, ckpt_options: Iterable[bool] = (False,),
                     tp_degrees: Iterable[int] = ()) -> list[Candidate]:
    """pp x dp x tp layouts (method dp_tp under pp, torchtitan's mesh (pp, dp, tp)): for each of ``tp_degrees``
    and each pp >= 2 (at most the decoder layers) with pp x tp dividing the GPUs and leaving dp >= 2, pp rising,
    then tp falling; each with and without checkpointing as ``ckpt_options`` says."""
    out = []
    for pp in range(2, min(world_size, num_layers) + 1):
        for tp in sorted(set(tp_degrees), reverse=True):
            if tp > 1 and world_size % (pp * tp) == 0 and world_size // (pp * tp) >= 2:
                out += [Candidate("dp_tp", world_size, tp=tp, grad_ckpt=ckpt, pp=pp) for ckpt in ckpt_options]
    return out


def _stage_tp_degrees(arch: Any, gpus: int) -> list[int]:
    """The TP degrees of a pp x tp layout on ``gpus`` GPUs that the TP estimate can split ``arch`` by (the
    attention and key/value heads, the MLP and hidden widths: ``_check_tp``)."""
    out = []
    for tp in range(2, gpus):
        if gpus % tp == 0:
            try:
                _check_tp(arch, tp)
            except ValueError:
                continue
            out.append(tp)
    return out


def _pipeline_candidates(model: str, arch: Any, training: TrainingSpec, gpus: int,
                         ckpt_options: tuple[bool, ...], with_tp: bool = True) -> tuple[list[Candidate], str]:
    """The pipeline layouts the pipeline estimate covers for ``training`` (bf16 / fp32; mixed_bf16 as FSDP2's
    MixedPrecisionPolicy, so pp x fsdp and pp x dp x tp only; Llama-style decoders, untied embeddings, LoRA, every-k
    checkpointing, ...; checkpointing is each candidate's own, checked with it; pp x tp and pp x dp x tp where
    ``with_tp`` and TP splits the model), and a note naming the first refusal when none is covered."""
    from estimator.methods.pipeline_rank import check_pipeline

    covered, refusals = [], []
    tp_degrees = _stage_tp_degrees(arch, gpus) if with_tp else []
    for cand in pp_layouts(gpus, arch.num_layers, ckpt_options, tp_degrees) + \
            pp_dp_tp_layouts(gpus, arch.num_layers, ckpt_options, tp_degrees):
        try:
            staged = dataclasses.replace(training, grad_ckpt=cand.grad_ckpt or training.grad_ckpt)
            check_pipeline(RunSpec(model=model, training=staged, parallel=cand.parallel_spec()),
                           getattr(arch, "model_type", ""), bool(getattr(arch, "tie_word_embeddings", False)))
            covered.append(cand)
        except ValueError as err:
            refusals.append(str(err))
    return covered, "" if covered or not refusals else f"pipeline layouts not weighed: {refusals[0]}"


def ds_pipeline_candidates(model: str, arch: Any, training: TrainingSpec, gpus: int,
                            ckpt_options: tuple[bool, ...]) -> tuple[list[Candidate], str]:
    """DeepSpeed's pipeline engine on ``gpus`` GPUs at ZeRO stage 0: every pp of 2 .. the decoder layers that divides
    them, the gpus / pp data-parallel ranks of each stage replicas of it (method ddp; single at one rank per
    stage), where the DeepSpeed pipeline estimate covers ``training`` (``check_ds_pipeline``: no checkpointing,
    LoRA, ...); else a note naming the refusal."""
    from estimator.methods.ds_pipeline import check_ds_pipeline, torch_pipeline_twin
    from estimator.methods.pipeline_rank import check_pipeline

    stage_counts = [pp for pp in range(2, min(gpus, arch.num_layers) + 1) if gpus % pp == 0]
    if not stage_counts:
        return [], (f"{DS_PIPELINE} not weighed: a pipeline of 2 .. {arch.num_layers} stages needs a number of GPUs "
                    f"they divide, not {gpus}")
    refusals = []
    for ckpt in ckpt_options:
        cands = [Candidate("single" if pp == gpus else "ddp", gpus, grad_ckpt=ckpt, pp=pp, pp_engine="deepspeed")
                 for pp in stage_counts]
        spec = RunSpec(model=model, training=dataclasses.replace(training, grad_ckpt=ckpt or training.grad_ckpt),
                       parallel=cands[0].parallel_spec())
        try:
            check_ds_pipeline(spec)
            check_pipeline(torch_pipeline_twin(spec), getattr(arch, "model_type", ""),
                           bool(getattr(arch, "tie_word_embeddings", False)))
            return cands, ""
        except ValueError as err:
            refusals.append(str(err))
    return [], f"{DS_PIPELINE} not weighed: {refusals[0]}"


def _pipelines_of_methods(piped: list[Candidate], methods: Iterable[str] | None) -> list[Candidate]:
    """The pipeline layouts a ``methods`` filter asks for: pp alone and pp x fsdp with single or fsdp, pp x tp with
    tp, pp x dp x tp with dp_tp (all without a filter)."""
    if methods is None:
        return piped
    wanted = set(methods)
    return [c for c in piped if (c.method in ("single", "fsdp") and {"single", "fsdp"} & wanted)
            or (c.method in ("tp", "dp_tp") and c.method in wanted)]


def ep_degrees(world_size: int, experts: int | None) -> list[int]:
    """The expert-parallel degrees transformers can run on ``world_size`` GPUs (ep dividing the FSDP size and
    the routed experts, above 1); none for a dense model."""
    if not experts:
        return []
    return [d for d in range(2, world_size + 1) if world_size % d == 0 and experts % d == 0]


def cp_degrees(world_size: int, training: TrainingSpec) -> list[int]:
    """The context-parallel degrees torch's ring attention can run for ``training`` on ``world_size`` GPUs (cp
    dividing the GPUs, the sequence in 2 cp load-balanced chunks; ``estimator.methods.context_parallel``)."""
    from estimator.spec import check_cp

    degrees = []
    for cp in range(2, world_size + 1):
        try:
            check_cp(cp, "fsdp", world_size, training.seq_len, training.precision, training.attn,
                     qlora=training.qlora, padded=training.batch == "padded")
        except ValueError:
            continue
        degrees.append(cp)
    return degrees


def cp_tp_pairs(world_size: int, training: TrainingSpec, tp_degrees: Iterable[int]) -> list[tuple[int, int]]:
    """(cp, tp) of the cp x tp layouts (dp_tp: torchtitan's (dp_shard, cp, tp) mesh) torch's ring attention can run
    for ``training`` on ``world_size`` GPUs, for each TP degree of ``tp_degrees`` (those TP splits the model by)."""
    from estimator.spec import check_cp

    pairs = []
    for tp in tp_degrees:
        for cp in range(2, world_size // tp + 1):
            try:
                check_cp(cp, "dp_tp", world_size, training.seq_len, training.precision, training.attn, tp=tp,
                         qlora=training.qlora, padded=training.batch == "padded")
            except ValueError:
                continue
            pairs.append((cp, tp))
    return pairs


def enumerate_candidates(world_size: int, ckpt_options: Iterable[bool] = (False, True),
                         methods: Iterable[str] | None = None, experts: int | None = None,
                         cps: Iterable[int] = (), cp_tps: Iterable[tuple[int, int]] = ()) -> list[Candidate]:
    """Every (method, tp, ep, cp, checkpointing) the estimator knows for ``world_size`` GPUs; ``experts``: the
    routed experts of a MoE model (its FSDP2 layouts with expert parallelism join); ``cps``: context-parallel
    degrees (``cp_degrees``) for FSDP2 layouts; ``cp_tps``: (cp, tp) of cp x tp layouts (``cp_tp_pairs``).
    ``methods`` limits them; raises ``ValueError("methods: ...")`` when none of the wanted methods has a layout
    on ``world_size``."""
    if world_size == 1:
        layouts = [("single", 1, 1, 1)]
    else:
        layouts = [(m, 1, 1, 1) for m in ("ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp1")] \
            + [("tp", world_size, 1, 1)]
        layouts += [("dp_tp", t, 1, 1) for t in range(2, world_size) if world_size % t == 0]
        layouts += [("fsdp", 1, e, 1) for e in ep_degrees(world_size, experts)]
        layouts += [("fsdp", 1, 1, c) for c in cps if c > 1 and world_size % c == 0]
        layouts += [("dp_tp", t, 1, c) for c, t in cp_tps if c > 1 and world_size % (c * t) == 0]
    layouts += [(m, 1, 1, 1) for m in OFFLOAD_METHODS]
    wanted = set(methods) if methods is not None else None
    cands = [Candidate(m, world_size, t, ckpt, e, c) for m, t, e, c in layouts for ckpt in ckpt_options
             if wanted is None or m in wanted]
    if not cands and wanted:
        why = {"single": "it is the 1-GPU layout", "dp_tp": "it needs a tp degree with 1 < tp < N dividing N"}
        names = ", ".join(f"{m} ({why.get(m, 'it needs 2 or more GPUs')})" for m in sorted(wanted, key=METHOD_RANK.get))
        raise ValueError(f"methods: no layout on {world_size} GPU(s) for {names}")
    return cands


# --- micro-batch search ---------------------------------------------------------------------------------
RELATIVE_SEARCH_TOLERANCE = 16  # below the bound, stop once the bracket is within 1/16 of what fits


def search_below_bound(bytes_at: Callable[[int], int], floor_at: Callable[[int], int], capacity: int,
                       bound: int, exact: bool = False) -> int:
    """A large ``mb`` in ``[1, bound]`` with ``bytes_at(mb) <= capacity``, where ``floor_at`` (cheap) never
    exceeds ``bytes_at`` (expensive, memoised by the caller) and ``bound`` is the largest micro-batch whose
    floor fits: ``bound`` itself when it fits (one expensive probe), else one within 1/16 of the largest that
    fits (the replayed reserved level is not monotonic in the micro-batch to the last row: the allocator's
    segments jump; ``exact``: the largest, for a monotonic ``bytes_at``). First guess: the overshoot at ``bound``
    carried over to the floor; then interpolation between the bracket's ends, bisecting whenever a probe did not
    halve the bracket."""
    if bound < 1 or bytes_at(bound) <= capacity:
        return max(bound, 0)
    lo, hi, halved = 0, bound, True  # bytes_at(lo) fits (0: trivially), bytes_at(hi) does not
    while hi - lo > (1 if exact else max(1, lo // RELATIVE_SEARCH_TOLERANCE)):
        if lo == 0:
            over = bytes_at(hi) - floor_at(hi)
            probe = search_max_micro_batch(lambda mb, over=over: floor_at(mb) + over, capacity, hi - 1)
        elif not halved:
            probe = (lo + hi) // 2
        else:
            low, high = bytes_at(lo), bytes_at(hi)
            probe = lo + int((capacity - low) * (hi - lo) / max(high - low, 1))
        probe = min(hi - 1, max(lo + 1, probe))
        width = hi - lo
        if bytes_at(probe) <= capacity:
            lo = probe
        else:
            hi = probe
        halved = 2 * (hi - lo) <= width
    return lo


def search_max_micro_batch(bytes_at: Callable[[int], int], capacity: int, cap: int = MAX_MICRO_BATCH) -> int:
    """Largest ``mb`` in ``[1, cap]`` with ``bytes_at(mb) <= capacity`` (0 if none), for ``bytes_at``
    non-decreasing in ``mb``.

    Exponential search up to the first micro-batch that does not fit, then binary search inside the
    bracket. Memory is (piecewise) affine in the micro-batch, so both phases step to the secant's
    prediction when they have one (an affine memory curve is solved in four probes); the bracket phase
    falls back to halving whenever a step fails to halve the bracket, so it never needs more than about
    twice the probes of plain bisection.
    """
    memo: dict[int, int] = {}

    def fits(mb: int) -> bool:
        if mb not in memo:
            memo[mb] = int(bytes_at(mb))
        return memo[mb] <= capacity

    if cap < 1 or not fits(1):
        return 0
    prev, lo, hi = 1, 1, None
    while hi is None:                                    # exponential phase
        if lo >= cap:
            return cap
        slope = (memo[lo] - memo[prev]) / (lo - prev) if lo != prev else 0.0
        probe = lo + int((capacity - memo[lo]) // slope) + 1 if slope > 0 else 2 * lo
        probe = min(cap, max(lo + 1, probe))
        if fits(probe):
            prev, lo = lo, probe
        else:
            hi = probe
    halve = checked = False
    while hi - lo > 1:                                   # binary phase
        width = hi - lo
        if halve:
            probe = (lo + hi) // 2
        else:
            probe = lo + (capacity - memo[lo]) * width // (memo[hi] - memo[lo])
        probe = min(hi - 1, max(lo + 1, probe))
        secant_fit = not halve and fits(probe)
        lo, hi = (probe, hi) if secant_fit or (halve and fits(probe)) else (lo, probe)
        if secant_fit and not checked and hi - lo > 2:
            # Both ends on one affine piece make the secant exact: try its neighbour once before halving.
            checked = True
            lo, hi = (lo + 1, hi) if fits(lo + 1) else (lo, lo + 1)
        halve = (hi - lo) * 2 > width
    return lo


def micro_batch_for_global(global_batch: int, dp: int, max_mb: int) -> tuple[int, int]:
    """Largest micro-batch <= ``max_mb`` with ``global_batch % (dp * mb) == 0``; (mb, accumulation)."""
    for mb in range(min(max_mb, global_batch // dp), 0, -1):
        if global_batch % (dp * mb) == 0:
            return mb, global_batch // (dp * mb)
    return 0, 0


# --- results --------------------------------------------------------------------------------------------
@dataclass
class CandidateResult:
    candidate: Candidate
    status: str = "ok"                 # ok | oom | invalid
    reason: str = ""                   # why it is invalid / does not fit / lost
    max_micro_batch: int = 0
    micro_batch: int = 0
    grad_accum: int = 0
    peak_bytes: int | None = None      # estimate's peak device bytes (worst rank) at micro_batch (or 1 if OOM)
    bound_bytes: int | None = None     # calibrated safety bound at the same point
    # peak and bound are lower bounds: the reserved replay stopped once it proved the layout does not fit
    peak_lower_bound: bool = False
    capacity_bytes: int | None = None
    host_ram_bytes: int | None = None  # CPU RAM one rank's offloaded states need (estimator); 0 without offload
    time: tput.StepTime | None = None
    rank: int | None = None

    @property
    def host_ram_node_bytes(self) -> int | None:
        """Host RAM of one node: every rank on it holds its own offloaded partition."""
        if not self.host_ram_bytes:
            return None
        return self.host_ram_bytes * min(self.candidate.world_size, tput.GPUS_PER_NODE)

    @property
    def fits(self) -> bool:
        return self.status == "ok"

    @property
    def tokens_per_s(self) -> float:
        return self.time.tokens_per_s if self.time else 0.0

    def to_dict(self) -> dict[str, Any]:
        c = self.candidate
        return {"method": c.method, "label": c.label, "world_size": c.world_size, "dp": c.dp, "tp": c.tp, "cp": c.cp,
                "grad_ckpt": c.grad_ckpt, "status": self.status, "fits": self.fits, "reason": self.reason,
                "max_micro_batch": self.max_micro_batch, "micro_batch": self.micro_batch,
                "grad_accum": self.grad_accum, "peak_bytes": self.peak_bytes, "bound_bytes": self.bound_bytes,
                "peak_lower_bound": self.peak_lower_bound, "capacity_bytes": self.capacity_bytes, "host_ram_bytes": self.host_ram_bytes,
                "host_ram_node_bytes": self.host_ram_node_bytes, "run_as": run_as(c),
                "tokens_per_s": round(self.tokens_per_s, 1) if self.time else None,
                "step_time": self.time.to_dict() if self.time else None, "rank": self.rank}


@dataclass
class Plan:
    model: str
    gpu_key: str
    gpu_name: str
    world_size: int
    seq_len: int
    precision: str
    optimizer: str
    global_batch: int | None
    lora_rank: int
    loop: str
    results: list[CandidateResult]
    best: CandidateResult | None
    advice: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    assumptions: dict[str, Any] = field(default_factory=dict)
    memory_calibrated: bool | None = None
    estimates: int = 0
    elapsed_s: float = 0.0
    epoch: dict[str, Any] | None = None    # with sample lengths: the recommendation's epoch summary
    grad_sync: str = "every"
    # The long-context technique the results were planned with ("" none): the user's, or the first of
    # TECHNIQUE_LADDER that made a GPU-resident layout fit when none did without one.
    technique: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "gpu": self.gpu_key, "gpu_name": self.gpu_name,
                "world_size": self.world_size, "seq_len": self.seq_len, "precision": self.precision,
                "optimizer": self.optimizer, "global_batch": self.global_batch, "lora_rank": self.lora_rank,
                "loop": self.loop, "grad_sync": self.grad_sync, "technique": self.technique,
                "recommendation": self.best.to_dict() if self.best else None,
                "candidates": [r.to_dict() for r in self.results], "advice": self.advice, "notes": self.notes,
                "throughput_model": self.assumptions, "memory_calibrated": self.memory_calibrated,
                "estimates": self.estimates, "elapsed_s": round(self.elapsed_s, 4),
                **({"epoch": self.epoch} if self.epoch is not None else {})}


# --- the planner ----------------------------------------------------------------------------------------

@dataclass
class _Context:
    model: str
    gpu: tput.GpuPerf
    training: TrainingSpec
    estimate_fn: EstimateFn
    eff: tput.Efficiency
    interconnect: str | None
    bandwidth_gbs: float | None
    probe_fn: EstimateFn | None = None     # for the advice's what-ifs: never builds a profile (default estimator)
    ckpt_options: tuple[bool, ...] = (False, True)
    host_ram_bytes: int | None = None      # the user's host RAM per node (offload layouts), if given
    fsdp1: Fsdp1Spec = field(default_factory=Fsdp1Spec)  # the fsdp1 layout's settings
    moe_imbalance: float = 1.0             # the busiest expert's load relative to balanced (EP layouts)
    ckpt_reentrant: bool = False           # the checkpointed layouts' checkpointing re-enters (TrainingSpec's)
    # Sample lengths (estimator.batching.epoch.EpochSource): memory at each micro-batch's worst batch, step time
    # at its mean padded length, tokens/s in real tokens.
    epoch: Any = None
    global_batch: int | None = None
    cache: dict = field(default_factory=dict)
    shapes: dict = field(default_factory=dict)
    calibrated: bool | None = None
    # "full": the estimator as given; with the default estimator also "floor" (reserved = allocated: no replay can
    # fit less) and "prior" (the reserved prior, no replay), for layouts that cannot be the fastest
    mode: str = "full"

    def shape(self, lora_rank: int, lora_targets: str) -> ModelShape:
        """Parameter counts from this plan's first estimate with the same LoRA setting, when it has them."""
        key = (lora_rank, lora_targets)
        if key not in self.shapes:
            est = next((e for (_, _, extra, _mode), e in self.cache.items()
                        if dict(extra).get("lora_rank", self.training.lora_rank) == lora_rank), None)
            params = getattr(est, "params", None)
            trainable = getattr(est, "trainable_params", None)
            self.shapes[key] = model_shape(self.model, lora_rank, lora_targets,
                                           params=int(params) if isinstance(params, int) else None,
                                           trainable=int(trainable) if isinstance(trainable, int) else None)
        return self.shapes[key]

    def held_accumulation(self, cand: Candidate, mb: int) -> int:
        """The micro-batches per step ``cand`` runs at ``mb`` when that changes its memory: FSDP holding its
        unsharded gradients between micro-batches (``grad_sync="last"``); else 1 (the plan sizes one)."""
        if self.global_batch is None or self.training.grad_sync != "last" or cand.method not in FSDP_METHODS \
                or cand.pp > 1:
            return 1
        return max(1, -(-self.global_batch // (cand.dp * mb)))

    def spec(self, cand: Candidate, mb: int, **training: Any) -> RunSpec:
        training.setdefault("grad_accum_steps", self.held_accumulation(cand, mb))
        training.setdefault("ckpt_reentrant", self.ckpt_reentrant and cand.grad_ckpt and not self.training.ckpt_policy)
        train = dataclasses.replace(self.training, micro_batch_size=mb, grad_ckpt=cand.grad_ckpt, **training)
        parallel = cand.parallel_spec()
        if cand.method == "fsdp1":
            parallel = dataclasses.replace(parallel, fsdp1=self.fsdp1)
        if cand.ep > 1:
            parallel = dataclasses.replace(parallel, moe_imbalance=self.moe_imbalance)
        return RunSpec(model=self.model, gpu=self.gpu.key, training=train, parallel=parallel)

    def estimate(self, cand: Candidate, mb: int, *, probe: bool = False, **training: Any):
        """The estimate of ``cand`` at micro-batch ``mb`` (memoised). ``probe``: an advice what-if, which must
        not build a profile (seconds to minutes of torch): it raises ``ValueError`` naming the missing profile."""
        key = (cand, mb, tuple(sorted(training.items())), self.mode)
        if key not in self.cache:
            fn = self._fn(probe)
            est = fn(self.spec(cand, mb, **training)) if self.epoch is None else \
                self._epoch_estimate(fn, cand, mb, training)
            self.cache[key] = est
            if self.calibrated is None:
                self.calibrated = bool(getattr(est, "calibrated", False))
        return self.cache[key]

    def _fn(self, probe: bool) -> EstimateFn:
        fn = self.probe_fn if probe and self.probe_fn is not None else self.estimate_fn
        return fn if self.mode == "full" else getattr(fn, self.mode)

    def _epoch_estimate(self, fn: EstimateFn, cand: Candidate, mb: int, training: dict[str, Any]):
        """The estimate at the epoch's worst batch for micro-batch ``mb`` (``seq_len`` truncates the samples)."""
        shapes = self.epoch.shapes(mb, cand.dp, training.get("seq_len", self.training.seq_len))
        other = {k: v for k, v in training.items() if k != "seq_len"}
        estimates = [fn(self.spec(cand, rows, seq_len=length, batch=batch, **other))
                     for rows, length, batch in shapes.worst]
        return max(estimates, key=lambda e: e.upper_bound_bytes)

    def links(self, cand: Candidate) -> tuple[tput.Link, tput.Link, tput.Link]:
        """The links of the data-parallel, tensor-parallel and expert-parallel groups."""
        return tuple(tput.resolve_link(self.gpu, span, self.interconnect, self.bandwidth_gbs)
                     for span in (cand.world_size, cand.tp, cand.ep))

    def step_time(self, cand: Candidate, mb: int, accum: int, **training: Any) -> tput.StepTime:
        dp_link, tp_link, ep_link = self.links(cand)
        train = {**self.training.__dict__, **training}
        shapes = self.epoch.shapes(mb, cand.dp, train["seq_len"]) if self.epoch is not None else None
        if cand.pp > 1:  # the pipeline's micro-batches: pp of them, or the global batch's split when larger
            accum = max(accum, cand.pp)
        setup = tput.Setup(method=cand.method, world_size=cand.world_size, tp=cand.tp, cp=cand.cp, pp=cand.pp,
                           ep=cand.ep, micro_batch=mb,
                           seq_len=shapes.mean_padded_len if shapes else train["seq_len"], grad_accum=accum, grad_ckpt=cand.grad_ckpt,
                           precision=train["precision"], optimizer=train["optimizer"],
                           lora=train["lora_rank"] > 0, moe_imbalance=self.moe_imbalance)
        shape = self.shape(train["lora_rank"], train["lora_targets"])
        time = tput.step_time(shape, setup, self.gpu, self.eff, dp_link=dp_link, tp_link=tp_link, ep_link=ep_link)
        if shapes is None:
            return time
        return dataclasses.replace(time, tokens_per_s=time.tokens_per_s * shapes.real_per_padded)

    def max_micro_batch(self, cand: Candidate, cap: int, *, probe: bool = False, **training: Any
                        ) -> tuple[int, int]:
        """(largest fitting micro-batch, capacity bytes). With a cheap lower bound of the estimate (the default
        estimator's ``floor_bytes``: reserved = allocated), the search runs on it first; the full estimate (the
        reserved replay) is then asked only at that micro-batch, and below it only if it does not fit there."""
        def upper(mb: int) -> int:
            return int(self.estimate(cand, mb, probe=probe, **training).upper_bound_bytes)

        fn = self.probe_fn if probe and self.probe_fn is not None else self.estimate_fn
        floor_fn = getattr(fn, "floor_bytes", None)
        if floor_fn is None or self.epoch is not None or self.mode == "floor":
            capacity = int(self.estimate(cand, 1, probe=probe, **training).capacity_bytes)
            return search_max_micro_batch(upper, capacity, cap), capacity
        capacity = int(fn.prior(self.spec(cand, 1, **training)).capacity_bytes)

        def floor(mb: int) -> int:
            return int(floor_fn(self.spec(cand, mb, **training)))

        bound = search_max_micro_batch(floor, capacity, cap)
        # the prior is monotonic and near-affine: searched to the exact micro-batch from the floor's answer down
        exact = self.mode == "prior"
        return search_below_bound(upper, floor, capacity, bound, exact=exact), capacity

    @property
    def advice_ckpt(self) -> bool:
        """Checkpointing setting of the advice's what-ifs: on, unless the plan excluded it (no profile then)."""
        return True in self.ckpt_options


def _evaluate(ctx: _Context, cand: Candidate, global_batch: int | None) -> CandidateResult:
    res = CandidateResult(cand)
    if global_batch is not None and global_batch % cand.dp:
        res.status, res.reason = "invalid", f"global batch {global_batch} is not divisible by dp={cand.dp}"
        return res
    cap = MAX_MICRO_BATCH if global_batch is None else min(MAX_MICRO_BATCH, global_batch // cand.dp)
    if ctx.epoch is not None:   # a micro-batch larger than a rank's share of the epoch never runs
        cap = min(cap, ctx.epoch.rows_per_rank(cand.dp, ctx.training.seq_len))
    try:
        if cand.tp > 1:
            _check_tp(model_facts(ctx.model)["arch"], cand.tp)
        best, capacity = ctx.max_micro_batch(cand, cap)
    except ValueError as err:
        res.status, res.reason = "invalid", str(err)
        return res
    res.capacity_bytes, res.max_micro_batch = capacity, best
    if best == 0:
        est = ctx.estimate(cand, 1)
        res.status = "oom"
        res.peak_bytes, res.bound_bytes = int(est.peak_device_bytes), int(est.upper_bound_bytes)
        res.peak_lower_bound = any(getattr(r, "reserved_lower_bound", False) for r in getattr(est, "ranks", ()))
        res.host_ram_bytes = getattr(est, "host_ram_bytes", None)
        res.reason = (f"does not fit at micro-batch 1: bound {'>= ' if res.peak_lower_bound else ''}"
                      f"{res.bound_bytes / GIB:.1f} GiB > {capacity / GIB:.1f} GiB")
        return res
    if global_batch is None:
        mb, accum = best, 1
    else:
        mb, accum = micro_batch_for_global(global_batch, cand.dp, best)
    if cand.pp > 1:  # a pipeline runs its pp micro-batches per step (or the global batch's split): the step's rows
        accum = max(accum, cand.pp)
    est = ctx.estimate(cand, mb)
    res.micro_batch, res.grad_accum = mb, accum
    res.peak_bytes, res.bound_bytes = int(est.peak_device_bytes), int(est.upper_bound_bytes)
    res.host_ram_bytes = getattr(est, "host_ram_bytes", None)
    node_ram = res.host_ram_node_bytes
    if ctx.host_ram_bytes and node_ram and node_ram > ctx.host_ram_bytes:
        res.status = "oom"
        res.reason = (f"host RAM: the offloaded states need {node_ram / GIB:.1f} GiB per node > "
                      f"{ctx.host_ram_bytes / GIB:.1f} GiB")
        return res
    try:
        res.time = ctx.step_time(cand, mb, accum)
    except ValueError as err:
        res.status, res.reason = "invalid", str(err)
    return res


def _evaluate_all(ctx: _Context, cands: list[Candidate], global_batch: int | None
                  ) -> tuple[list[CandidateResult], int | None]:
    """Every layout's result, replaying the reserved level only where it can decide the answer: each layout is
    first sized on its allocated floor (no replay can fit more), then the layouts are replayed in ``_rank``'s order
    of their floors, each only while its floor would still rank before the best replayed (a tie on speed is decided
    by the bound, which the floor under-states); the rest take the reserved prior. Returns the
    results and how many layouts were replayed (None: the estimator has no floor, every layout ran in full)."""
    if getattr(ctx.estimate_fn, "floor", None) is None or ctx.epoch is not None:
        return [_evaluate(ctx, c, global_batch) for c in cands], None
    floor_ctx = dataclasses.replace(ctx, mode="floor", cache={})
    optimistic = [_evaluate(floor_ctx, c, global_batch) for c in cands]

    def key(res: CandidateResult) -> tuple | None:
        """``_rank``'s order; the floor's key never ranks after the replayed one's (speed only falls, the bound
        only rises)."""
        return _rank_key(res) if res.fits and res.time else None

    results: list[CandidateResult | None] = [None] * len(cands)
    prior_ctx = dataclasses.replace(ctx, mode="prior", cache={})
    best, replayed = None, 0
    order = sorted((i for i in range(len(cands)) if key(optimistic[i]) is not None), key=lambda i: key(optimistic[i]))
    for i in order:
        if best is None or key(optimistic[i]) < best:
            results[i] = _evaluate(ctx, cands[i], global_batch)
            replayed += 1
            mine = key(results[i])
            best = mine if best is None or (mine is not None and mine < best) else best
        else:
            results[i] = _evaluate(prior_ctx, cands[i], global_batch)
    for i in range(len(cands)):
        if results[i] is None:  # does not fit even on its floor
            results[i] = _evaluate(prior_ctx, cands[i], global_batch)
    ctx.cache.update(prior_ctx.cache)
    if ctx.calibrated is None:
        ctx.calibrated = prior_ctx.calibrated if prior_ctx.calibrated is not None else floor_ctx.calibrated
    return results, replayed


def _per_token(res: CandidateResult) -> dict[str, float]:
    t = res.time
    tokens = res.tokens_per_s * t.step_s
    return {"compute": t.compute_s / tokens, "comm": t.exposed_comm_s / tokens,
            "offload": t.offload_s / tokens, "optimizer": t.optimizer_s / tokens}


def _loss_reason(res: CandidateResult, best: CandidateResult) -> str:
    """Why ``res`` ranks below ``best``: the per-token cost term with the largest gap."""
    ratio = res.tokens_per_s / best.tokens_per_s
    if ratio > 0.995:
        return f"{ratio:.2f}x the best: a tie on predicted speed, ranked below on peak memory or simplicity"
    mine, theirs = _per_token(res), _per_token(best)
    term = max(mine, key=lambda k: mine[k] - theirs[k])
    c, w, a, b = res.candidate, best.candidate, res.time, best.time
    ms = 1e3 * {"compute": a.compute_s, "comm": a.exposed_comm_s, "offload": a.offload_s,
                "optimizer": a.optimizer_s}[term]
    if term == "compute":
        if c.grad_ckpt and not w.grad_ckpt:
            why = "checkpointing recomputes the forward (+1/3 FLOPs)"
        elif c.tp > w.tp:
            why = f"tp={c.tp} narrows the GEMMs (efficiency {a.efficiency:.2f} vs {b.efficiency:.2f})"
        else:
            why = f"micro-batch {res.micro_batch} vs {best.micro_batch} (efficiency {a.efficiency:.2f} vs " \
                  f"{b.efficiency:.2f})"
    elif term == "comm":
        why = f"exposed communication {ms:.0f} ms/step"
    elif term == "offload":
        why = f"PCIe transfers + CPU Adam {ms:.0f} ms/step"
    else:
        sharded = c.method in ("zero1", "zero2", "zero3", "fsdp", "fsdp1", "dp_tp")
        why = f"optimizer update {ms:.0f} ms/step ({'sharded' if sharded else 'not sharded'})"
    return f"{ratio:.2f}x the best: {why}"


def _rank_key(r: CandidateResult) -> tuple:
    """Fastest first; on a tie the smaller bound, then the simpler method, no checkpointing, less TP."""
    return (-round(r.tokens_per_s, 6), r.bound_bytes or 0, METHOD_RANK[r.candidate.method], r.candidate.grad_ckpt,
            r.candidate.tp, r.candidate.ep, r.candidate.cp, r.candidate.pp)


def _rank(results: list[CandidateResult]) -> CandidateResult | None:
    ok = [r for r in results if r.fits and r.time]
    ok.sort(key=_rank_key)
    for i, r in enumerate(ok, 1):
        r.rank = i
    if not ok:
        return None
    for r in ok[1:]:
        r.reason = _loss_reason(r, ok[0])
    ok[0].reason = "recommended"
    return ok[0]


# The long-context techniques the plan tries, in order, when no GPU-resident layout fits micro-batch 1 without
# one: each removes more memory than the one before for little or no compute (the loss's logits first: at long
# sequences they are the largest tensors; then the checkpointed layer inputs to the host).
TECHNIQUE_LADDER = (
    ("chunked cross-entropy (torchtune's LinearCrossEntropyLoss, 8 chunks: --ce chunked)",
     {"ce": "chunked", "ce_chunks": 8}),
    ("Liger's fused linear cross-entropy (--ce fused_linear)", {"ce": "fused_linear"}),
    ("Liger's fused linear cross-entropy + activation offload to the host (--ce fused_linear "
     "--activation-offload)", {"ce": "fused_linear", "activation_offload": True}),
)


def _uses_technique(training: TrainingSpec) -> bool:
    return training.ce != "standard" or training.activation_offload or bool(training.ckpt_policy)


# What a rung of TECHNIQUE_LADDER can take off the GPU at the plain step's peak: the loss's logits and their copies
# (chunked / fused cross-entropy), the activations saved for backward (offload), the transients of forward and
# backward. The model's states at any moment of the step (weights, gradients, optimizer states, master weights,
# gathered parameters, communication buffers) are the same under every rung, and so is the optimizer step's own
# scratch (``temporaries`` at an ``optimizer_step`` peak).
TECHNIQUE_REMOVES = ("activations", "outputs_held", "allocator_rounding")


def _technique_floor_bytes(est: Any) -> float | None:
    """A lower bound of the upper bound of ``est``'s spec under any rung of TECHNIQUE_LADDER: what its plain
    step holds at its peak besides what a rung can remove, with what lies outside the allocator (the CUDA context,
    NCCL) and reserved >= allocated, scaled by the estimate's bound ratio. None: no breakdown to tell."""
    breakdown = getattr(est, "breakdown", None)
    if not breakdown or not est.peak_device_bytes:
        return None
    removes = TECHNIQUE_REMOVES + (() if est.phase.startswith("optimizer_step") else ("temporaries",))
    kept = sum(v for k, v in breakdown.items() if k not in removes)
    outside = est.peak_device_bytes - est.peak_reserved_bytes
    return (outside + kept) * est.upper_bound_bytes / est.peak_device_bytes


def _no_technique_can_fit(ctx: _Context, cands: list[Candidate]) -> bool:
    """Whether no rung of TECHNIQUE_LADDER can make any of ``cands`` fit micro-batch 1: each layout's plain step
    holds at its peak, besides everything a rung removes (``_technique_floor_bytes``), more than its GPU, and a
    rung's step holds at least that at the same moment; a layout the plain step cannot be planned for (an invalid
    layout: no flash attention for ring attention) is no more valid under a rung, which changes the loss and where
    activations live only. Then the ladder would find nothing, and its profiles (torch: tens of seconds each for
    a 2-7B model) are not traced: a short sequence whose model states do not fit. False without the default
    estimator's prior estimates (its ``prior``) or a breakdown: the ladder decides."""
    prior = getattr(ctx.estimate_fn, "prior", None)
    if prior is None or ctx.epoch is not None or not cands:
        return False
    for cand in cands:
        try:
            est = prior(ctx.spec(cand, 1))
        except ValueError:
            continue
        floor = _technique_floor_bytes(est)
        if floor is None or floor <= est.capacity_bytes:
            return False
    return True


def _on_gpu_fits(results: list[CandidateResult]) -> bool:
    return any(r.fits and not r.candidate.offload for r in results)


def _with_techniques(ctx: _Context, cands: list[Candidate], global_batch: int | None, results: list,
                     replayed: int | None) -> tuple[_Context, list, int | None, str]:
    """When no GPU-resident layout fits, the first rung of TECHNIQUE_LADDER under which one does: (context,
    results, replayed, the rung's label); the inputs unchanged when none does, or the spec already runs one.
    A rung's profiles are traced on first use (torch): without torch the rung is skipped."""
    if _on_gpu_fits(results) or _uses_technique(ctx.training) or ctx.training.lora or ctx.training.outputs_fp32:
        return ctx, results, replayed, ""
    cands_gpu = [c for c in cands if not c.offload and c.tp == 1]  # no fused loss over a TP head
    if _no_technique_can_fit(ctx, cands_gpu):
        return ctx, results, replayed, ""  # what the ladder would return, without tracing its profiles
    for label, fields in TECHNIQUE_LADDER:
        if fields.get("ce") == "fused_linear" and ctx.training.precision.startswith("amp_"):
            continue
        trial = dataclasses.replace(ctx, training=dataclasses.replace(ctx.training, **fields), cache={})
        try:
            trial_results, trial_replayed = _evaluate_all(trial, cands_gpu, global_batch)
        except ValueError:
            continue
        if _on_gpu_fits(trial_results):
            return trial, trial_results, trial_replayed, label
        if trial_results and all(r.status == "invalid" for r in trial_results):
            reason = trial_results[0].reason  # e.g. no torch here to trace the technique's profiles
            return ctx, results, replayed, f"(not tried: {reason})"
    return ctx, results, replayed, ""


def _cp_note(results: list, best: CandidateResult | None, seq_len: int) -> list[str]:
    """Say so when context parallelism is what made the recommendation fit (no GPU-resident layout without it
    fits micro-batch 1), or that it was weighed."""
    if best is None or best.candidate.cp == 1:
        return []
    c = best.candidate
    others = [r for r in results if r.fits and r.candidate.cp == 1 and not r.candidate.offload]
    why = "made it fit: no GPU-resident layout without it fits micro-batch 1" if not others else \
        "is the fastest layout that fits"
    tp = f"; TP {c.tp} inside, splitting each rank's heads and the ring's k|v" if c.tp > 1 else ""
    return [f"long context: context parallelism ({c.label}: torch's ring attention, context_parallel, over "
            f"{c.cp} ranks, each holding {seq_len // c.cp} of the {seq_len} tokens{tp}; FSDP2 over "
            f"{c.world_size // c.tp} (dp x cp) GPUs{' of each TP position' if c.tp > 1 else ''}) {why}"]


def _default_precision(gpu: tput.GpuPerf) -> str:
    return "mixed_bf16" if gpu.supports_bf16() else "mixed_fp16"


def _validate(world_size: Any, seq_len: Any, global_batch: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"gpus: must be a positive integer, got {world_size!r}")
    if world_size > MAX_GPUS:
        raise ValueError(f"gpus: {world_size} GPUs is more than the planner considers ({MAX_GPUS})")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len: must be a positive integer, got {seq_len!r}")
    if global_batch is not None and (isinstance(global_batch, bool) or not isinstance(global_batch, int)
                                     or global_batch < 1):
        raise ValueError(f"global_batch: must be a positive integer, got {global_batch!r}")


def _default_estimate(allow_build: bool = True, alloc_conf: str | None = None) -> EstimateFn:
    """The estimator, replaying the reserved level only where it can decide the answer: a spec whose allocated
    level alone (plus the CUDA context and NCCL, times the bound's ratio) already exceeds the GPU gets the prior
    estimate (the replayed reserved is never below allocated), and so does a method the replay does not cover
    (its estimate with the replay on would be the same numbers)."""
    from estimator.api import estimate
    from estimator.reserved.rank import METHODS

    priors: dict[RunSpec, Any] = {}

    def prior_of(spec: RunSpec):
        if spec not in priors:
            if len(priors) > 4096:
                priors.clear()
            priors[spec] = estimate(spec, allow_build=allow_build, replay_reserved=False)
        return priors[spec]

    def floor_bytes(spec: RunSpec) -> float:
        """A lower bound of the replayed estimate's upper bound: the device level with reserved = allocated,
        scaled as the bound scales the device level (the replayed reserved is never below allocated)."""
        prior = prior_of(spec)
        floor = prior.peak_device_bytes - prior.peak_reserved_bytes + prior.peak_allocated_bytes
        return floor * prior.upper_bound_bytes / prior.peak_device_bytes

    def fn(spec: RunSpec):
        prior = prior_of(spec)
        if spec.parallel.method not in METHODS or floor_bytes(spec) > prior.capacity_bytes:
            return prior
        # the plan asks only whether a spec fits: a replay stops once its reserved level proves it does not
        return estimate(spec, allow_build=allow_build, alloc_conf=alloc_conf, decide_fit=True)
    def floor(spec: RunSpec):
        """The prior estimate with the upper bound at its floor: what no replay can go below."""
        return dataclasses.replace(prior_of(spec), upper_bound_bytes=int(floor_bytes(spec)))

    fn.floor_bytes = floor_bytes  # type: ignore[attr-defined]
    fn.prior = prior_of  # type: ignore[attr-defined]
    fn.floor = floor  # type: ignore[attr-defined]
    return fn


def _check_options(methods: Iterable[str] | None, ckpt_options: tuple[bool, ...], host_ram_gb: Any) -> None:
    if methods is not None:
        unknown = [m for m in methods if m not in METHOD_RANK and m not in FILTER_ONLY]
        if unknown:
            raise ValueError(f"methods: {unknown[0]!r} is not one of {', '.join(METHOD_ORDER + FILTER_ONLY)}")
    if not ckpt_options or any(not isinstance(c, bool) for c in ckpt_options):
        raise ValueError(f"ckpt_options: need a non-empty set of true/false, got {ckpt_options!r}")
    if host_ram_gb is not None and (isinstance(host_ram_gb, bool) or not isinstance(host_ram_gb, (int, float))
                                    or not 0 < host_ram_gb < float("inf")):
        raise ValueError(f"host_ram: must be a positive number of GiB, got {host_ram_gb!r}")


def plan(model: str, *, gpus: int, gpu: str, seq_len: int = 512, global_batch: int | None = None,
         precision: str | None = None, optimizer: str = "adamw", attn: str = "sdpa", lora_rank: int = 0,
         lora_targets: str = "auto", lora_dropout: float = 0.0, ckpt_options: Iterable[bool] = (False, True),
         methods: Iterable[str] | None = None, interconnect: str | None = None,
         bandwidth_gbs: float | None = None, host_ram_gb: float | None = None, advise: bool = True,
         estimate_fn: EstimateFn | None = None, gpu_info: tput.GpuPerf | None = None, loop: str = "trainer",
         epoch: Any = None, alloc_conf: str | None = None, batch: str = "full",
         fsdp1: Fsdp1Spec | None = None, outputs_fp32: bool = False, grad_sync: str = "every",
         model_code: str = "", techniques: dict[str, Any] | None = None, try_techniques: bool = True,
         moe_imbalance: float = 1.0, ckpt_reentrant: bool = False, memory_cap_bytes: int = 0) -> Plan:
    """Search, rank and advise. Raises ``ValueError("field: ...")`` for bad input (unknown GPU or model,
    impossible N, a global batch no candidate can split, a method with no layout on N GPUs).

    ``host_ram_gb``: host RAM per node (GiB); offload layouts whose offloaded states need more do not fit.
    The advice's what-ifs (LoRA, more GPUs, shorter sequences) never build a profile: with the default
    estimator they use only profiles already shipped or cached, and say so when one is missing.
    ``epoch``: sample lengths (``estimator.batching.epoch.EpochSource``); ``seq_len`` then truncates them, and
    each batch's padding decides its ``batch`` (else ``batch``: "full" or "padded", ``TrainingSpec.batch``).
    ``alloc_conf``: the ``PYTORCH_CUDA_ALLOC_CONF`` the reserved replay uses (default: the environment's).
    ``fsdp1``: the settings of the fsdp1 layout (default: FULL_SHARD, use_orig_params, BACKWARD_PRE).
    ``outputs_fp32``: the forward returns fp32 copies of its 16-bit outputs (``TrainingSpec.outputs_fp32``).
    ``grad_sync``: when FSDP reduces under gradient accumulation (``TrainingSpec.grad_sync``).
    ``moe_imbalance``: the busiest expert's load relative to balanced routing (``ParallelSpec.moe_imbalance``):
    the EP layouts' memory and step time follow their busiest rank.
    ``model_code``: the transformers release whose model code runs (``TrainingSpec.model_code``).
    ``ckpt_reentrant``: the checkpointed layouts checkpoint reentrantly (``TrainingSpec.ckpt_reentrant``).
    ``memory_cap_bytes``: every rank's caching allocator is capped there (``TrainingSpec.memory_cap_bytes``): a
    layout fits under the cap plus the context.
    ``techniques``: TrainingSpec fields of long-context techniques every layout runs (``ce``, ``ce_chunks``,
    ``activation_offload``, ``ckpt_policy``: a policy plans the checkpointed layouts only). Without them and
    with ``try_techniques``, when no GPU-resident layout fits, the layouts are planned again under each rung of
    ``TECHNIQUE_LADDER`` until one fits; the plan names the rung (``Plan.technique``)."""
    started = time.perf_counter()
    from estimator.api import resolve_alloc_conf

    alloc_conf = resolve_alloc_conf(alloc_conf)
    _validate(gpus, seq_len, global_batch)
    ckpt_options = tuple(ckpt_options)
    _check_options(methods, ckpt_options, host_ram_gb)
    gpu_perf = gpu_info or tput.gpu_perf(gpu)
    arch = model_facts(model)["arch"]
    if arch.max_positions and seq_len > arch.max_positions:
        raise ValueError(f"seq_len: {seq_len} is longer than the model's {arch.max_positions} positions")
    precision = precision or _default_precision(gpu_perf)
    training = TrainingSpec(micro_batch_size=1, seq_len=seq_len, precision=precision, optimizer=optimizer,
                            attn=attn, lora_rank=lora_rank, lora_targets=lora_targets, lora_dropout=lora_dropout,
                            loop=loop, batch=batch, outputs_fp32=outputs_fp32, grad_sync=grad_sync,
                            model_code=model_code, memory_cap_bytes=memory_cap_bytes,
                            # a policy plans the checkpointed layouts only: the base spec checkpoints too
                            grad_ckpt=bool((techniques or {}).get("ckpt_policy")), **(techniques or {}))
    if training.ckpt_policy:
        ckpt_options = (True,)  # the policy says how the checkpointed layouts checkpoint
    if not any(gpu_perf.peak_flops.values()) or not gpu_perf.capacity_bytes:
        raise ValueError(f"gpu: {gpu_perf.key!r} has no capacity or peak FLOP/s in the catalogue; "
                         "the planner needs a known GPU type")
    if gpu_perf.flops_for(precision) <= 0:
        raise ValueError(f"precision: {gpu_perf.name} has no {precision} tensor throughput; use mixed_fp16")
    tput.resolve_link(gpu_perf, gpus, interconnect, bandwidth_gbs)          # validates the override
    ctx = _Context(model=model, gpu=gpu_perf, training=training,
                   estimate_fn=estimate_fn or _default_estimate(alloc_conf=alloc_conf),
                   eff=tput.load_efficiency(gpu_perf), interconnect=interconnect, bandwidth_gbs=bandwidth_gbs,
                   probe_fn=None if estimate_fn else _default_estimate(allow_build=False, alloc_conf=alloc_conf),
                   ckpt_options=ckpt_options,
                   host_ram_bytes=int(host_ram_gb * GIB) if host_ram_gb is not None else None, epoch=epoch,
                   fsdp1=fsdp1 or Fsdp1Spec(), global_batch=global_batch,
                   moe_imbalance=_checked_imbalance(moe_imbalance), ckpt_reentrant=ckpt_reentrant)
    if gpus % ctx.fsdp1.shard_size(gpus):
        raise ValueError(f"gpus_per_node: HYBRID_SHARD needs whole nodes: {gpus} GPUs is not a multiple of "
                         f"{ctx.fsdp1.gpus_per_node}")
    # cp layouts for fixed-shape steps only: an epoch of mixed batch shapes under cp is not modelled; cp x tp is a
    # dp_tp layout, so its TP degrees are worked out only where dp_tp is weighed
    with_cp_tp = epoch is None and (methods is None or "dp_tp" in methods)
    layout_methods = None if methods is None else [m for m in methods if m not in FILTER_ONLY]
    cands = enumerate_candidates(gpus, ckpt_options, layout_methods, routed_experts(arch.config),
                                 cp_degrees(gpus, training) if epoch is None else (),
                                 cp_tp_pairs(gpus, training, _stage_tp_degrees(arch, gpus)) if with_cp_tp else ()) \
        if layout_methods != [] else []
    pipeline_note = ""
    if gpus > 1 and (methods is None or {"single", "fsdp", "tp", "dp_tp"} & set(methods)):
        piped, pipeline_note = _pipeline_candidates(model, arch, training, gpus, ckpt_options,
                                                    with_tp=methods is None or bool({"tp", "dp_tp"} & set(methods)))
        cands += _pipelines_of_methods(piped, methods)
    if methods is not None and DS_PIPELINE in methods:
        ds_piped, ds_note = ds_pipeline_candidates(model, arch, training, gpus, ckpt_options)
        cands += ds_piped
        pipeline_note = "; ".join(n for n in (pipeline_note, ds_note) if n)
        if not cands:
            raise ValueError(f"methods: {ds_note}")
    if global_batch is not None and all(global_batch % c.dp for c in cands):
        dps = sorted({c.dp for c in cands}, reverse=True)
        raise ValueError(f"global_batch: {global_batch} is not divisible by the data-parallel degree of any "
                         f"layout on {gpus} GPUs (dp in {', '.join(map(str, dps))})")
    results, replayed = _evaluate_all(ctx, cands, global_batch)
    _raise_if_all_invalid(results, global_batch)
    technique = technique_name(training)
    skipped = ""
    if try_techniques:
        ctx, results, replayed, rung = _with_techniques(ctx, cands, global_batch, results, replayed)
        skipped = rung if rung.startswith("(not tried") else ""
        technique = "" if skipped else (rung or technique)
    best = _rank(results)
    dp_link, tp_link, _ = ctx.links(Candidate("dp_tp" if gpus > 1 else "single", gpus, 1))
    result = Plan(model=model, gpu_key=gpu_perf.key, gpu_name=gpu_perf.name, world_size=gpus, seq_len=seq_len,
                  precision=precision, optimizer=optimizer, global_batch=global_batch, lora_rank=lora_rank,
                  loop=loop, grad_sync=grad_sync, results=results, best=best,
                  assumptions=tput.assumptions(gpu_perf, ctx.eff, dp_link, tp_link), technique=technique)
    if technique and ctx.training is not training:
        result.notes.append(f"long context: no GPU-resident layout fits micro-batch 1 with the model's own loss "
                            f"and activations on the GPU; {technique} made it fit: every layout below is planned "
                            "with it")
    result.notes += _cp_note(results, best, seq_len)
    if memory_cap_bytes:
        result.notes.append(f"memory cap: every rank's caching allocator is capped at {memory_cap_bytes / GIB:.2f} GiB "
                            "(set_per_process_memory_fraction): a layout fits under the cap plus the CUDA context "
                            "and NCCL buffers, or the GPU's memory where smaller")
    if skipped:
        result.notes.append(f"long context: the techniques (chunked / fused cross-entropy, activation offload) "
                            f"were not planned {skipped}")
    result.notes += _notes(ctx, result)
    if pipeline_note:
        result.notes.append(pipeline_note)
    elif best is not None and best.candidate.pp > 1:
        others = any(r.fits for r in results if r.candidate.pp == 1)
        schedule = "DeepSpeed's TrainSchedule" if best.candidate.pp_engine == "deepspeed" else "torch's 1F1B"
        result.notes.append(f"pp: {best.candidate.label} ({schedule}, {best.candidate.pp} micro-batches per step "
                            "or the global batch's split) " + ("is the fastest that fits" if others else
                            "made the run fit: no layout without pipeline parallelism fits")
                            + "; its step time is a prior (the 1F1B bubble, point-to-point sends not counted)")
    if replayed is not None:
        result.notes.append(f"reserved: the allocator replay ran for the {replayed} layout(s) that could be the "
                            "fastest; the others, slower even at the micro-batch their allocated level allows, "
                            "keep the reserved prior")
    if estimate_fn is None:
        result.notes += _expandable_notes(ctx, result, alloc_conf)
    if epoch is not None and best is not None:
        result.epoch = epoch.shapes(best.micro_batch, best.candidate.dp, seq_len).summary
    if advise:
        result.advice = _advice(ctx, result)
    result.memory_calibrated = ctx.calibrated
    result.estimates = len(ctx.cache)
    result.elapsed_s = time.perf_counter() - started
    return result


def _expandable_notes(ctx: _Context, result: Plan, alloc_conf: str) -> list[str]:
    """The fastest layout that does not fit at micro-batch 1 but would with ``expandable_segments:True`` (the
    reserved replay without the fragmentation of fixed segments) and would then beat the recommendation. The
    candidates are replayed fastest first, until one fits: a slower one would not be the answer, and a layout
    slower at micro-batch 1 than the best one that fits changes nothing."""
    if "expandable_segments" in alloc_conf.replace(" ", ""):
        return []
    conf = ",".join(x for x in (alloc_conf, "expandable_segments:True") if x)
    estimate = _default_estimate(allow_build=False, alloc_conf=conf)
    speeds = {}
    for res in result.results:
        if res.status == "oom":
            speed = _speed_at_one(ctx, res.candidate, result)
            if speed is not None and (result.best is None or speed > result.best.tokens_per_s):
                speeds[res.candidate] = speed
    for cand in sorted(speeds, key=lambda c: (-speeds[c], METHOD_RANK[c.method], c.grad_ckpt)):
        try:
            est = estimate(ctx.spec(cand, 1))
        except ValueError:  # no profile for this layout's variant: nothing to say
            continue
        if getattr(est, "reserved_source", "prior") == "replayed" and est.fits:
            label = cand.label + (" (ckpt)" if cand.grad_ckpt else "")
            faster = "the fastest layout that does not fit without it" if result.best is None else \
                "faster than the recommendation"
            return [f"PYTORCH_CUDA_ALLOC_CONF={conf} makes {label} fit at micro-batch 1 (reserved replay); {faster}"]
    return []


def _speed_at_one(ctx: _Context, cand: Candidate, result: Plan) -> float | None:
    """``cand``'s tokens/s at micro-batch 1 (None: it cannot run)."""
    accum = 1 if result.global_batch is None else max(result.global_batch // cand.dp, 1)
    try:
        return ctx.step_time(cand, 1, accum).tokens_per_s
    except ValueError:
        return None


def _raise_if_all_invalid(results: list[CandidateResult], global_batch: int | None) -> None:
    """No candidate can even be evaluated: that is the user's input, not a plan. One line, as an error."""
    if not results or any(r.status != "invalid" for r in results):
        return
    split = sorted({r.candidate.dp for r in results if r.reason.startswith("global batch")}, reverse=True)
    others = [r.reason for r in results if not r.reason.startswith("global batch")]
    if split:
        rest = f"; the other layouts cannot run ({others[0]})" if others else ""
        raise ValueError(f"global_batch: {global_batch} is not divisible by the data-parallel degree "
                         f"(dp={', '.join(map(str, split))}){rest}")
    raise ValueError(others[0])


def _notes(ctx: _Context, result: Plan) -> list[str]:
    notes = []
    if not ctx.eff.calibrated:
        notes.append(f"throughput: compute efficiency is a prior for {ctx.gpu.family} GPUs (no measured step "
                     f"times for {ctx.gpu.key} yet); rankings between methods with similar compute are "
                     "reliable, absolute tokens/s are not")
    if ctx.calibrated is False:
        notes.append("memory: the estimator's coefficients for this GPU are uncalibrated priors")
    best = result.best
    if best and result.global_batch and best.micro_batch < best.max_micro_batch:
        notes.append(f"global batch {result.global_batch} forces micro-batch {best.micro_batch} "
                     f"(up to {best.max_micro_batch} fits) with {best.grad_accum} accumulation steps")
    if best and best.max_micro_batch >= MAX_MICRO_BATCH:
        notes.append(f"the micro-batch search stops at {MAX_MICRO_BATCH}")
    if ctx.training.lora:
        notes.append("LoRA: compute counted as 4*P*tokens (no weight gradients for the frozen base)")
    if ctx.epoch is not None:
        notes.append("lengths: each micro-batch's memory is the estimate at its epoch's worst batch; step time at "
                     "the epoch's mean padded length, tokens/s in real (unpadded) tokens")
    notes += _grad_sync_notes(ctx, result)
    notes += _ep_notes(result, ctx.moe_imbalance)
    if best and best.micro_batch:  # the model code it describes and, for MoE, the experts and routing, as estimated
        est = ctx.estimate(best.candidate, best.micro_batch)
        notes += [n for n in getattr(est, "notes", ()) if n.startswith(("model code:", "moe", "ep"))]
    return notes


def _ep_notes(result: Plan, moe_imbalance: float) -> list[str]:
    """Which expert-parallel layouts were weighed, under which routing, and what was picked."""
    weighed = sorted({r.candidate.ep for r in result.results if r.candidate.ep > 1})
    if not weighed:
        return []
    best = result.best
    picked = (f"picked {best.candidate.label}" if best and best.candidate.ep > 1 else
              f"picked {best.candidate.label} (no expert parallelism)" if best else "none fits")
    routing = "balanced routing" if moe_imbalance == 1 else \
        f"the busiest expert at {moe_imbalance:g}x its balanced load: memory and time of the busiest rank"
    return [f"ep: weighed FSDP2 with expert parallelism ep in {{{', '.join(map(str, weighed))}}} ({routing}; the "
            f"time model adds each layout's all-to-all exchanges and gathers only its experts over world / ep "
            f"ranks); {picked}"]


def _grad_sync_notes(ctx: _Context, result: Plan) -> list[str]:
    """What held FSDP gradients cost, where a layout held them (``TrainingSpec.grad_sync``)."""
    held = [r for r in result.results if r.candidate.method in FSDP_METHODS and r.grad_accum > 1
            and r.candidate.pp == 1]  # a pipeline's micro-batches are its schedule's, not grad_sync's
    if ctx.training.grad_sync != "last" or not held:
        return []
    t = ctx.training
    elem = 4 if t.precision.startswith("mixed_") or t.precision == "fp32" else 2
    trainable = ctx.shape(t.lora_rank, t.lora_targets).trainable
    return [f"grad_sync: last — FSDP layouts with accumulation hold the unsharded gradients between micro-batches "
            f"(~{trainable * elem / GIB:.1f} GiB per rank, the HF Trainer's default); accelerate's "
            "sync_each_batch=True (--grad-sync every) reduce-scatters each micro-batch instead"]


# --- advice ---------------------------------------------------------------------------------------------
UNPROFILED = "no cached profile"     # estimator.models.profiles' message when a probe would need a profile build


class _Unprofiled(Exception):
    """An advice what-if needs a profile that is not shipped or cached (building it would take minutes)."""


def _probe_fits(ctx: _Context, cand: Candidate, **training: Any) -> bool:
    """Does ``cand`` fit micro-batch 1 (safety bound)? An invalid layout does not; a missing profile raises. A
    layout whose allocated floor does not fit is answered without the reserved replay."""
    try:
        floor = getattr(ctx.probe_fn, "floor", None)
        if floor is not None and not floor(ctx.spec(cand, 1, **training)).fits:
            return False
        est = ctx.estimate(cand, 1, probe=True, **training)
    except ValueError as err:
        if UNPROFILED in str(err):
            raise _Unprofiled(str(err)) from None
        return False
    return est.upper_bound_bytes <= est.capacity_bytes


def _ckpt_words(ckpt: bool) -> str:
    return "with checkpointing" if ckpt else "without checkpointing"


def _min_gpus(ctx: _Context, start: int) -> tuple[int, Candidate] | None:
    """Fewest GPUs (> start) on which ZeRO-3 or FSDP fits micro-batch 1 (checkpointing on unless the plan
    excluded it); assumes the per-rank bound falls as GPUs are added (sharded states)."""
    found: list[tuple[int, Candidate]] = []
    ckpt = ctx.advice_ckpt
    for method in ("zero3", "fsdp"):
        def fits(n: int, method: str = method) -> bool:
            return _probe_fits(ctx, Candidate(method, n, 1, ckpt))
        lo, hi = start, start + 1
        while hi < MAX_GPUS and not fits(hi):        # exponential
            lo, hi = hi, min(MAX_GPUS, hi * 2)
        if hi >= MAX_GPUS and not fits(MAX_GPUS):
            continue
        while hi - lo > 1:                           # binary
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if not fits(mid) else (lo, mid)
        found.append((hi, Candidate(method, hi, 1, ckpt)))
    return min(found, key=lambda f: f[0]) if found else None


def _max_seq_len(ctx: _Context, cand: Candidate) -> int:
    """Longest sequence (multiple of 64) at which ``cand`` fits micro-batch 1; 0 if none."""
    lo, hi = 0, ctx.training.seq_len // 64
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _probe_fits(ctx, cand, seq_len=64 * mid) else (lo, mid)
    return 64 * lo if lo and _probe_fits(ctx, cand, seq_len=64 * lo) else 0


def _offload_advice(result: Plan) -> list[str]:
    fitting = [r for r in result.results if r.fits and r.candidate.offload]
    if fitting:
        best = max(fitting, key=lambda r: r.tokens_per_s)
        node = best.host_ram_node_bytes
        ram = f"; host RAM ~{node / GIB:.0f} GiB per node" if node else ""
        return [f"offload: {best.candidate.label} ({RUN_AS[best.candidate.method]}) fits up to micro-batch "
                f"{best.max_micro_batch}, ~{best.tokens_per_s:,.0f} tokens/s{ram}"]
    tried = [r for r in result.results if r.candidate.offload and r.bound_bytes]
    if not tried:
        return []
    least = min(tried, key=lambda r: r.bound_bytes or 0)
    if least.reason.startswith("host RAM"):
        return [f"offload: {least.candidate.label} would fit the GPU but not the host ({least.reason})"]
    return [f"offload: even {least.candidate.label} needs {least.bound_bytes / GIB:.1f} GiB per GPU at "
            "micro-batch 1"]


def _advice(ctx: _Context, result: Plan) -> list[str]:
    advice: list[str] = []
    n = result.world_size
    on_gpu = [r for r in result.results if r.fits and not r.candidate.offload]
    if on_gpu:
        if not any(r.candidate.grad_ckpt is False for r in on_gpu) and any(
                r.candidate.grad_ckpt is False for r in result.results):
            advice.append("only gradient checkpointing makes it fit (every method without it runs out of memory)")
        return advice
    capacity = next((r.capacity_bytes for r in result.results if r.capacity_bytes), ctx.gpu.capacity_bytes)
    cap = f"{ctx.gpu.name} ({capacity / GIB:.1f} GiB)"
    even = ", even with checkpointing" if ctx.advice_ckpt else " (checkpointing was not considered: --ckpt off)"
    advice.append(f"no GPU-resident method fits {n} x {cap} at micro-batch 1{even}")
    advice += _offload_advice(result)
    ckpt = ctx.advice_ckpt
    try:
        more = _min_gpus(ctx, n)
        if more:
            count, cand = more
            split = (f"; --global-batch must then be a multiple of {count}"
                     if result.global_batch and result.global_batch % count else "")
            advice.append(f"more GPUs: {count} x {ctx.gpu.name} fit {cand.method} {_ckpt_words(ckpt)} at "
                          f"micro-batch 1 (fewest that fit; bound falls as states shard){split}")
        else:
            advice.append(f"more GPUs: no sharded method fits micro-batch 1 on up to {MAX_GPUS} GPUs of this "
                          "type (activations or replicated tensors alone exceed the GPU)")
    except _Unprofiled:
        advice.append("more GPUs: not checked (needs a profile this plan did not build)")
    if ctx.training.lora_rank == 0:
        advice += _lora_advice(ctx, n)
    method = "zero3" if n > 1 else "single"
    try:
        shortest = _max_seq_len(ctx, Candidate(method, n, 1, ckpt))
    except _Unprofiled:
        shortest = 0
    if 0 < shortest < ctx.training.seq_len:
        advice.append(f"shorter sequences: {method} {_ckpt_words(ckpt)} fits micro-batch 1 up to --seq-len "
                      f"{shortest}")
    return advice


def _lora_advice(ctx: _Context, n: int) -> list[str]:
    methods = ("ddp", "zero3") if n > 1 else ("single",)
    ckpt = ctx.advice_ckpt
    best: tuple[float, Candidate, int] | None = None
    for method in methods:
        cand = Candidate(method, n, 1, ckpt)
        try:
            mb, _ = ctx.max_micro_batch(cand, MAX_MICRO_BATCH, probe=True, lora_rank=ADVICE_LORA_RANK)
            if mb == 0:
                continue
            speed = ctx.step_time(cand, mb, 1, lora_rank=ADVICE_LORA_RANK).tokens_per_s
        except ValueError as err:
            if UNPROFILED in str(err):
                return [f"LoRA: not checked (no LoRA profile shipped or cached for this model; "
                        f"`--lora-rank {ADVICE_LORA_RANK}` plans it, after building the profile once)"]
            continue
        if best is None or speed > best[0]:
            best = (speed, cand, mb)
    if best is None:
        return [f"LoRA (r={ADVICE_LORA_RANK}) {_ckpt_words(ckpt)} does not fit either"]
    speed, cand, mb = best
    return [f"LoRA: --lora-rank {ADVICE_LORA_RANK} fits {cand.method} {_ckpt_words(ckpt)} up to micro-batch {mb} "
            f"(~{speed:,.0f} tokens/s)"]
