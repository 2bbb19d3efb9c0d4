"""ZeRO-3 with activation checkpointing: the parameter coordinator's gathers and releases of a checkpointed layer's
recomputation (``estimator.reserved.zero3_gathers.with_recomputation``) against real DeepSpeed 0.19.8 runs on CPU.

The fast tests read the coordinator's calls recorded from real runs (``data/zero3_coordinator_calls.json``: a
4-layer Llama, hidden 64, world 2, rank 0, 3 steps, stage-3 knobs scaled so a prefetch spans about a layer and the
norms are persistent), no torch. The slow test records them again live. Regenerate the file with

    PYTHONPATH=. .venv/bin/python -m tests.estimator.test_zero3_recompute

Reentrant checkpointing (``use_reentrant=True``, every layer): ``data/zero3_reentrant_calls.json``, the same model
and knobs, regenerated with ``... -m tests.estimator.test_zero3_recompute --reentrant``.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

import pytest

from estimator.methods.long_context import checkpointed
from estimator.models.params import ParamInfo
from estimator.reserved.zero3_gathers import emulate, modules_of, with_recomputation

DATA = pathlib.Path(__file__).parent / "data" / "zero3_coordinator_calls.json"
REENTRANT_DATA = DATA.with_name("zero3_reentrant_calls.json")
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 160,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
         "max_position_embeddings": 512, "tie_word_embeddings": True}
WORLD, B, S, STEPS = 2, 2, 64, 3
# A layer holds 43,008 elements, the model 238,464. "wide": DeepSpeed's reuse distance and live limit (1e9),
# larger than the model, so nothing gathered in forward is released before its backward; "tight": both scaled to
# about a layer (as 1e9 is to Llama-3.2-1B's 1.24e9 elements), so the recomputation fetches again.
KNOBS = {"wide": {"stage3_prefetch_bucket_size": 35_000, "stage3_param_persistence_threshold": 100},
         "tight": {"stage3_prefetch_bucket_size": 35_000, "stage3_param_persistence_threshold": 100,
                   "stage3_max_reuse_distance": 50_000, "stage3_max_live_parameters": 150_000}}
POLICIES = ("none", "full", "every-k:2")
CASES = [(knobs, policy) for knobs in KNOBS for policy in POLICIES]


def _recomputed(policy: str, num_layers: int) -> frozenset[int]:
    """``policy``: none, full, every-k:K or reentrant (every layer, ``use_reentrant=True``)."""
    if policy == "none":
        return frozenset()
    every = policy.startswith("every-k")
    on = checkpointed(num_layers, int(policy.split(":")[1])) if every else [True] * num_layers
    return frozenset(i for i, layer_on in enumerate(on) if layer_on)


def _table(rows: list[dict]) -> list[ParamInfo]:
    return [ParamInfo(**{**row, "shape": tuple(row["shape"]), "tied_names": tuple(row["tied_names"])})
            for row in rows]


def _comparable(calls: list[list], table: list[ParamInfo], persistence: int = 100) -> list[list[tuple]]:
    """Per step, the gathers and releases the allgather stream sees: from the second step on, the persistent
    tensors' releases at ``release_and_reset_all`` are left out (they were gathered on the default stream, by
    ``_post_step``: ``estimator.reserved.zero3``)."""
    persistent = {p.name for p in table if p.numel < persistence}
    return [[(c[0], tuple(c[1]) if c[0] == "G" else c[1]) for c in step
             if not (k and c[0] == "R" and c[1] in persistent)] for k, step in enumerate(calls)]


def _emulation(table: list[ParamInfo], knobs: str, policy: str):
    num_layers = 1 + max(p.layer for p in table if p.layer is not None)
    k = KNOBS[knobs]
    return emulate(table, WORLD, steps=STEPS, prefetch_bucket=k["stage3_prefetch_bucket_size"],
                   persistence=k["stage3_param_persistence_threshold"],
                   max_reuse=k.get("stage3_max_reuse_distance", 1_000_000_000),
                   max_live=k.get("stage3_max_live_parameters", 1_000_000_000),
                   checkpointed=_recomputed(policy, num_layers), reentrant=policy == "reentrant")


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(DATA.read_text())


@pytest.mark.parametrize("knobs, policy", CASES)
def test_the_emulated_coordinator_makes_the_real_runs_calls(recorded, knobs, policy):
    """Every gather call (which tensors, in one call) and every release of three steps, in order: the first
    step's recorded trace with each checkpointed layer's recomputation in backward (no prefetch), and the two
    prefetching steps that follow that trace."""
    table = _table(recorded["table"])
    assert _emulation(table, knobs, policy).calls == _comparable(recorded["calls"][knobs][policy], table)


def test_the_recomputation_enters_the_backward_trace_at_the_layers_first_fetch(recorded):
    """Each checkpointed layer's forward modules (not the layer itself) come right after the backward's fetch of
    its last MLP projection; that projection's release waits for the recomputation, whose own fetch of it is
    never released (early stop)."""
    table = _table(recorded["table"])
    forward, backward = modules_of(table)
    out, moved = with_recomputation(forward, backward, frozenset({1}))
    names = [m.name for m in out]
    at = names.index("model.layers.1.mlp.down_proj")
    recompute = [m.name for m in forward if m.name.startswith("model.layers.1.")]
    assert names[at + 1:at + 1 + len(recompute)] == recompute
    assert len(out) == len(backward) + len(recompute)
    first, last = len(forward) + at, len(forward) + at + len(recompute)
    assert moved == {first: last, last: None}
    assert with_recomputation(forward, backward, frozenset()) == (backward, {})


def test_what_the_recomputation_adds_to_the_allgather_stream(recorded):
    """The record step gathers each checkpointed layer again for its recomputation (two norms and seven
    projections, less the MLP's last projection, still gathered for its backward). In the steps that follow the
    trace, a reuse distance wider than the model keeps every tensor gathered from its forward to its backward, so
    the recomputation fetches nothing; scaled to about a layer, full checkpointing fetches tensors again (every
    other layer, here, not: what the recomputation needs is still within reach). The tiny model's allgather pool
    is one 2 MiB segment either way."""
    from estimator.allocator.requests import simulate
    from estimator.reserved.zero3_gathers import pool_requests

    table = _table(recorded["table"])
    ops = {case: _emulation(table, *case) for case in CASES}
    gathered = {case: [sum(len(c[1]) for c in step if c[0] == "G") for step in o.calls] for case, o in ops.items()}
    assert gathered["wide", "full"][0] - gathered["wide", "none"][0] == 4 * 8
    assert gathered["wide", "every-k:2"][0] - gathered["wide", "none"][0] == 2 * 8
    assert gathered["wide", "full"][1:] == gathered["wide", "none"][1:] == [29, 29]
    assert gathered["tight", "none"][1:] == gathered["tight", "every-k:2"][1:] == [46, 46]
    assert gathered["tight", "full"][1:] == [51, 51]
    assert {simulate(pool_requests(o))["peak_reserved_bytes"] for o in ops.values()} == {2 << 20}


def test_the_stopped_recomputations_output_goes_before_the_layers_first_gradient(recorded):
    """The MLP output a recomputation makes before it stops: allocated and freed right after the last allocation
    before the layer's first gradient (the recomputation's last activation, the projection's input), whatever
    frees come between; the op indices after it move by two. Its size: the ``b * s`` polynomial of
    ``hidden x 2`` bytes, or in a micro-batch-1 regime the ``s`` one."""
    from estimator.profiler.expand import ALLOC, FREE
    from estimator.reserved.fsdp import _Builder
    from estimator.reserved.zero3 import _recompute_output_made_then_dropped, _stopped_output_size_index

    table = _table(recorded["table"])
    hidden_bytes = LLAMA["hidden_size"] * 2
    assert _stopped_output_size_index(table, [[8, 0, 0, 0, 0, 0], [0, 0, 0, 0, hidden_bytes, 0]]) == 1
    assert _stopped_output_size_index(table, [[0, hidden_bytes, 0, 0, 0, 0], [hidden_bytes, 0, 0, 0, 0, 0]]) == 0
    down = next(p for p in table if p.name == "model.layers.1.mlp.down_proj.weight")
    grad_of = {id(down): (50, 7)}
    body = [(ALLOC, 1, 3), (ALLOC, 2, 3), (FREE, 9, 4), (ALLOC, 50, 7), (FREE, 1, 3)]
    moved = {0: 0, 1: 1, 2: 2, 3: 3, 4: 4}
    build = _Builder(100, 20)
    _recompute_output_made_then_dropped(body, moved, 1, table, grad_of, 5, build)
    assert body == [(ALLOC, 1, 3), (ALLOC, 2, 3), (ALLOC, 100, 5), (FREE, 100, 5), (FREE, 9, 4), (ALLOC, 50, 7),
                    (FREE, 1, 3)]
    assert moved == {0: 0, 1: 1, 2: 4, 3: 5, 4: 6} and build.next_key == 101


def test_zero3_replays_checkpointing_reentrant_too(tmp_path):
    """Full and every-k non-reentrant checkpointing are replayed, and reentrant checkpointing on a Llama-style
    decoder without LoRA (checked against real runs: ``test_the_reentrant_recomputation_...``)."""
    from estimator.reserved.zero3 import why_not_zero3
    from estimator.spec import ParallelSpec, RunSpec, TrainingSpec

    def spec(**training) -> RunSpec:
        return RunSpec(model="meta-llama/Llama-3.2-1B",
                       training=TrainingSpec(precision="mixed_bf16", micro_batch_size=1, seq_len=1024, **training),
                       parallel=ParallelSpec(method="zero3", world_size=4))

    assert why_not_zero3(spec(grad_ckpt=True)) is None
    assert why_not_zero3(spec(grad_ckpt=True, ckpt_policy="every-k:2")) is None
    assert why_not_zero3(spec(grad_ckpt=True, ckpt_reentrant=True)) is None
    assert why_not_zero3(spec(grad_ckpt=True, ckpt_reentrant=True, lora_rank=8)).startswith(
        "zero3 with LoRA and reentrant")
    assert why_not_zero3(spec(grad_ckpt=True, ckpt_policy="selective-ops")).startswith("zero3 with selective-ops")


@pytest.mark.parametrize("b, policy", [(1, ""), (4, ""), (1, "every-k:4")])
def test_llama_1b_with_checkpointing_is_replayed(b, policy):
    """Llama-3.2-1B ZeRO-3 x 4 s1024 with checkpointing, from the shipped profiles: replayed, not the prior;
    the recomputation's re-gathers grow the allgather pool (2.05 -> 2.62 GiB), so the reserved level sits further
    above the allocated one than without checkpointing."""
    from estimator.api import estimate
    from estimator.spec import ParallelSpec, RunSpec, TrainingSpec

    def rank(grad_ckpt: bool):
        training = TrainingSpec(precision="mixed_bf16", micro_batch_size=b, seq_len=1024, grad_ckpt=grad_ckpt,
                                ckpt_policy=policy if grad_ckpt else "")
        spec = RunSpec(model="meta-llama/Llama-3.2-1B", gpu="h200-141gb", training=training,
                       parallel=ParallelSpec(method="zero3", world_size=4))
        result = estimate(spec, allow_build=False)
        return result.reserved_source, result.ranks[0]

    (source, ckpt), (_, plain) = rank(True), rank(False)
    assert source == "replayed"
    assert ckpt.peak_allocated_bytes < plain.peak_allocated_bytes
    assert (ckpt.peak_reserved_bytes - ckpt.peak_allocated_bytes
            > plain.peak_reserved_bytes - plain.peak_allocated_bytes)


@pytest.mark.parametrize("knobs", KNOBS)
def test_the_reentrant_recomputation_makes_the_real_runs_calls(knobs):
    """Reentrant checkpointing: every gather and release of three steps of a real run. Each layer's
    recomputation comes before its first backward fetch and runs the whole forward, each module released as in
    forward; the backward then fetches every module again (``zero3_gathers.emulate(reentrant=True)``)."""
    recorded = json.loads(REENTRANT_DATA.read_text())
    table = _table(recorded["table"])
    assert _emulation(table, knobs, "reentrant").calls == _comparable(recorded["calls"][knobs]["reentrant"], table)
    plain = _emulation(table, knobs, "full").calls[0]
    assert _emulation(table, knobs, "reentrant").calls[0] != plain  # the non-reentrant trace is not it


def test_a_reentrant_checkpoint_keeps_its_inputs_and_output_to_its_backwards_end():
    """``_reentrant_lifetimes`` on a one-layer body: the layer's incoming gradient (made in ``mid_bw``), its
    hidden-states input (the earliest tensor of the hidden size made before the layer's forward) and the
    recomputed output go at the end of the layer's backward; the keyword inputs (a mask of the same size, a
    rotary table) after backward's last allocation; every other op keeps its order."""
    from estimator.profiler.expand import ALLOC, FREE
    from estimator.reserved.zero3 import _reentrant_lifetimes

    hidden, mask, cos, act, logits, grad, recomputed, out, grad_in, emb = 1, 2, 3, 4, 10, 11, 12, 21, 13, 14
    body = [(ALLOC, hidden, 5), (ALLOC, mask, 5), (ALLOC, cos, 6),                      # prefix
            (ALLOC, act, 7), (FREE, act, 7),                                             # fw_first
            (ALLOC, logits, 8),                                                          # mid_fw
            (ALLOC, grad, 5), (FREE, logits, 8),                                         # mid_bw
            (ALLOC, recomputed, 7), (ALLOC, 20, 5), (ALLOC, out, 5), (FREE, 20, 5),      # bw_last
            (FREE, grad, 5), (ALLOC, grad_in, 5), (FREE, mask, 5), (FREE, cos, 6), (FREE, hidden, 5),
            (FREE, recomputed, 7),
            (ALLOC, emb, 9), (FREE, grad_in, 5)]                                         # suffix
    marks = (("prefix", None, 0), ("fw_first", 0, 3), ("mid_fw", None, 5), ("mid_bw", None, 6),
             ("bw_last", 0, 8), ("suffix", None, 18), ("optimizer_pre", None, 20), ("optimizer", None, 20))
    moved = {i: i for i in range(21)}
    _reentrant_lifetimes(body, moved, marks, {0: out}, 5, 20)
    assert body[:12] == [(ALLOC, hidden, 5), (ALLOC, mask, 5), (ALLOC, cos, 6), (ALLOC, act, 7), (FREE, act, 7),
                         (ALLOC, logits, 8), (ALLOC, grad, 5), (FREE, logits, 8), (ALLOC, recomputed, 7),
                         (ALLOC, 20, 5), (ALLOC, out, 5), (FREE, 20, 5)]
    assert body[12:] == [(ALLOC, grad_in, 5), (FREE, recomputed, 7),
                         (FREE, grad, 5), (FREE, hidden, 5), (FREE, out, 5),
                         (ALLOC, emb, 9), (FREE, mask, 5), (FREE, cos, 6), (FREE, grad_in, 5)]
    assert moved[18] == 17 and moved[20] == 21


@pytest.mark.slow
def test_a_reentrant_runs_three_streams_are_generated(tmp_path):
    """A real run (tiny Llama hidden 64, every layer checkpointed reentrantly, rank 0 of 2, three optimizer
    steps), each allocation on the stream a GPU run makes it on: every stream's requests are the generated ones in
    every step, each run of frees and of allocations as a set (a CPU run's Linear backward makes its input gradient
    before its weight gradient, as in the non-reentrant control), and the three-stream reserved peaks equal."""
    pytest.importorskip("deepspeed")
    from benchmarks import zero3_arch_replay as arch
    from benchmarks.zero3_ckpt_replay import _record, first_differences, generated_steps, recorded_steps
    from estimator.allocator.requests import simulate

    path = tmp_path / "config_llama.json"
    path.write_text(json.dumps(arch.ARCHS["llama"]))
    spec = arch.arch_spec(str(path), 2, ckpt=True, reentrant=True)
    assert spec.training.ckpt_reentrant
    recorded = recorded_steps(_record(tmp_path, arch.ARCHS["llama"], spec, True))
    generated = generated_steps(spec, arch.B, arch.S, len(recorded) - 1)
    assert all(at is None for _stream, _step, at, _ in first_differences(recorded, generated, allocs_sorted=True))
    assert (simulate([r for p in recorded for r in p])["peak_reserved_bytes"]
            == simulate([r for p in generated for r in p])["peak_reserved_bytes"])


def _real_coordinator_calls(config: dict, knobs: str, policy: str) -> tuple[list[dict], list[list]]:
    """(the parameter table, per step the coordinator's gather calls and releases) of a real DeepSpeed ZeRO-3 run
    on CPU (fake process group, rank 0), built and stepped as the harness runs it."""
    import torch
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc
    from transformers import masking_utils

    from estimator import api
    from estimator.profiler import build
    from estimator.spec import ParallelSpec, RunSpec, TrainingSpec, ZeroSpec
    from harness import distributed
    from harness.methods import deepspeed as ds_method
    from harness.methods.base import WrapContext
    from harness.options import HarnessOptions

    path = pathlib.Path(__import__("tempfile").mkdtemp()) / "config.json"
    path.write_text(json.dumps(config))
    training = TrainingSpec(precision="mixed_bf16", attn="eager", micro_batch_size=B, seq_len=S,
                            grad_ckpt=policy != "none", ckpt_reentrant=policy == "reentrant",
                            ckpt_policy="" if policy in ("none", "full", "reentrant") else policy)
    zero = ZeroSpec(reduce_bucket_size=20_000, allgather_bucket_size=20_000, **KNOBS[knobs])
    spec = RunSpec(model=str(path), training=training,
                   parallel=ParallelSpec(method="zero3", world_size=WORLD, zero=zero))
    plain = dataclasses.replace(training, grad_ckpt=False, ckpt_policy="", ckpt_reentrant=False)
    arch, profile = api.load_model_profile(str(path), plain, 1)
    table = api._param_table(profile, arch.num_layers)

    coordinator = ppc.PartitionedParameterCoordinator
    gather_name, release_name = ("_PartitionedParameterCoordinator__all_gather_params",
                                 "_PartitionedParameterCoordinator__release_param")
    gather, release = getattr(coordinator, gather_name), getattr(coordinator, release_name)
    names: dict[int, str] = {}
    steps: list[list] = []

    def logged_gather(self, params, forward):
        todo = [names[p.ds_id] for p in sorted(params, key=lambda p: p.ds_id) if p.ds_status.name == "NOT_AVAILABLE"]
        if todo:
            steps[-1].append(["G", todo])
        return gather(self, params, forward)

    def logged_release(self, param, *args, **kwargs):
        was = param.ds_status.name
        out = release(self, param, *args, **kwargs)
        if was == "AVAILABLE" and param.ds_status.name == "NOT_AVAILABLE":
            steps[-1].append(["R", names[param.ds_id]])
        return out

    orig_mask = masking_utils._ignore_causal_mask_sdpa
    masking_utils._ignore_causal_mask_sdpa = lambda padding_mask, *a, **k: orig_mask(None, *a, **k)
    setattr(coordinator, gather_name, logged_gather)
    setattr(coordinator, release_name, logged_release)
    steps.append([])  # the setup's own gathers (the gradient hooks' registration): not compared
    dist_ctx = distributed.init(method="zero3", rank=0, world_size=WORLD, local_rank=0, device=torch.device("cpu"),
                                emulated=True)
    try:
        trainer = ds_method.wrap(WrapContext(spec=spec, options=HarnessOptions(), dist=dist_ctx, config=config))
        names.update({p.ds_id: n for n, p in trainer.engine.module.named_parameters()})
        for _ in range(STEPS):
            steps.append([])
            loss = trainer.forward(build.synthetic_batch(B, S, config["vocab_size"]))
            trainer.backward(loss)
            del loss
            trainer.step()
        trainer.close()
    finally:
        setattr(coordinator, gather_name, gather)
        setattr(coordinator, release_name, release)
        masking_utils._ignore_causal_mask_sdpa = orig_mask
        distributed.teardown()
    return [dataclasses.asdict(p) for p in table], steps[1:]


@pytest.mark.slow
@pytest.mark.parametrize("knobs, policy", CASES)
def test_the_emulation_against_a_live_run(knobs, policy):
    pytest.importorskip("deepspeed")
    from tests.estimator.test_reserved import _in_fresh_process

    rows, calls = _in_fresh_process(_real_coordinator_calls, LLAMA, knobs, policy)
    table = _table(rows)
    assert _emulation(table, knobs, policy).calls == _comparable(calls, table)


def _generated(spec) -> list[tuple]:
    """``test_reserved_zero._generated`` through every-k's merged event list where the spec asks for it."""
    from estimator import api
    from estimator.reserved import rank as reserved_rank
    from estimator.spec import ckpt_every
    from tests.estimator import test_reserved_zero as zero_tests

    training = spec.training
    every = ckpt_every(training.ckpt_policy)
    if every is None:
        return zero_tests._generated(spec, 0)
    arch, profile = api.every_k_profile(spec.model, training, 1, every)
    table, regime = api._param_table(profile, arch.num_layers), api._regime(profile, B, S)
    events = reserved_rank._events(spec, regime, arch.num_layers)
    expansion = reserved_rank._expansion(events, arch.num_layers, training.loop)
    plan = reserved_rank._plan(spec, events, expansion, table, arch.num_layers, B, S, workspace_bytes=8 << 20,
                               workspaces=0, rank=0)
    setup = reserved_rank._setup(profile, table, arch.num_layers, "zero3", False, WORLD, spec)
    return zero_tests.generated_requests(setup, plan, training)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "every-k:2"])
def test_what_checkpointing_adds_to_the_stream_is_what_it_adds_to_a_real_run(tmp_path, policy):
    """Every allocation that checkpointing adds to a ZeRO-3 rank's three steps (the checkpointed run's less the
    plain run's, by size), generated and real: the profile's recomputed activations, the recomputation's
    gathers, and the MLP output each recomputation makes before it stops. The plain streams themselves differ
    on CPU by what the H100 snapshots do not have (the CPU accelerator's setup gathers every tensor once more;
    ``estimator.reserved.zero3``), the same for both runs."""
    pytest.importorskip("deepspeed")
    from collections import Counter

    from estimator.spec import ParallelSpec, RunSpec, TrainingSpec, ZeroSpec
    from tests.estimator import test_reserved_zero as zero_tests

    assert (zero_tests.B, zero_tests.S, zero_tests.STEPS) == (B, S, STEPS)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    counts = {}
    for run in ("none", policy):
        training = TrainingSpec(precision="mixed_bf16", attn="eager", micro_batch_size=B, seq_len=S,
                                grad_ckpt=run != "none", ckpt_policy="" if run in ("none", "full") else run)
        zero = ZeroSpec(reduce_bucket_size=20_000, allgather_bucket_size=20_000, **KNOBS["wide"])
        spec = RunSpec(model=str(path), training=training,
                       parallel=ParallelSpec(method="zero3", world_size=WORLD, zero=zero))
        generated = zero_tests._requests(_generated(spec), True)
        real = zero_tests._requests(zero_tests._in_fresh_process(zero_tests._real_zero_events, LLAMA, spec, 0),
                                    False)
        counts[run] = [Counter(r[2] for r in stream if r[0] == "alloc") for stream in (generated, real)]
    added = [{n: counts[policy][i][n] - counts["none"][i][n] for n in counts[policy][i] | counts["none"][i]
              if counts[policy][i][n] != counts["none"][i][n]} for i in (0, 1)]
    assert added[0] == added[1]
    assert added[0][B * S * LLAMA["hidden_size"] * 2] > 0


def _record(reentrant: bool = False) -> None:
    """Rewrite ``DATA`` from real runs (each in a spawned process: DeepSpeed's groups outlive a teardown);
    ``reentrant``: ``REENTRANT_DATA``, from a reentrant run per knob set."""
    from tests.estimator.test_reserved import _in_fresh_process

    out: dict = {"config": LLAMA, "world": WORLD, "micro_batch_size": B, "seq_len": S, "knobs": KNOBS, "calls": {}}
    for knobs, policy in [(knobs, "reentrant") for knobs in KNOBS] if reentrant else CASES:
        out["table"], out["calls"].setdefault(knobs, {})[policy] = _in_fresh_process(
            _real_coordinator_calls, LLAMA, knobs, policy)
    path = REENTRANT_DATA if reentrant else DATA
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    _record(reentrant="--reentrant" in sys.argv[1:])
