"""every-k checkpointing in the reserved replay (estimator.reserved.every_k): the plain and the checkpointed
profile's event lists merged layer by layer. The replay's requested peak against the analytic allocated estimate
of the same spec (``methods.long_context.mixed_layers``), and the generated request stream against a real CPU run
of the tiny Llama with torch's non-reentrant checkpoint on layers K-1, 2K-1, ..., event by event."""

import dataclasses
import json

import pytest

pytest.importorskip("torch")

from estimator import api  # noqa: E402
from estimator.hardware.residuals import load_coefficients  # noqa: E402
from estimator.profiler.expand import ExpansionError, expand, step_sizes  # noqa: E402
from estimator.reserved import rank as reserved_rank  # noqa: E402
from estimator.reserved.every_k import mixed_events  # noqa: E402
from estimator.reserved.timeline import INT64, StepPlan, step_requests  # noqa: E402
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec  # noqa: E402
from tests.estimator.test_reserved import (  # noqa: E402
    LLAMA,
    _in_fresh_process,
    _real_cpu_events,
    assert_same_stream,
)

MIB = 1024 * 1024
GIB = 1024 * MIB


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("every_k") / "config.json"
    path.write_text(json.dumps(LLAMA))
    return str(path)


def _spec(path: str, precision: str, every: int, b: int, s: int, method: str = "single", world: int = 1,
          **training) -> RunSpec:
    policy = f"every-k:{every}" if every else ""
    return RunSpec(model=path, training=TrainingSpec(precision=precision, grad_ckpt=True, ckpt_policy=policy,
                                                     micro_batch_size=b, seq_len=s, **training),
                   parallel=ParallelSpec(method=method, world_size=world, tp=world if method == "tp" else 1))


def _requested_less_estimate(spec: RunSpec) -> int:
    """The replay's requested peak less the estimate's allocated peak (less its block rounding, plus the three
    batch tensors the estimator does not count); the estimate's reserved level must be the replay's."""
    training = spec.training
    b, s = training.micro_batch_size, training.seq_len
    est = api.estimate(spec, alloc_conf="")
    every = int(training.ckpt_policy.split(":")[1]) if training.ckpt_policy else None
    tp = spec.parallel.tp
    arch, profile = (api.every_k_profile(spec.model, training, tp, every) if every
                     else api.load_model_profile(spec.model, training, tp))
    regime, table = api._regime(profile, b, s), api._param_table(profile, arch.num_layers)
    assert reserved_rank.why_not(spec, regime, arch.num_layers, table) is None
    coeffs = load_coefficients(est.gpu_key)
    replayed = reserved_rank.replay_reserved(spec, profile, regime, table, arch.num_layers,
                                             workspace_bytes=coeffs.cublas_workspace_bytes,
                                             workspaces=coeffs.cublas_workspaces, allowed_bytes=None, conf_text="")
    rounding = est.breakdown.get("allocator_rounding", 0)
    assert rounding == replayed.peak_allocated_bytes - replayed.peak_requested_bytes
    assert est.reserved_source == "replayed" and replayed.steady
    assert est.peak_reserved_bytes == replayed.peak_reserved_bytes
    return replayed.peak_requested_bytes - (est.peak_allocated_bytes - rounding + 3 * b * s * INT64)


@pytest.mark.parametrize("precision", ["fp32", "mixed_bf16"])
@pytest.mark.parametrize("method, world", [("single", 1), ("ddp", 2), ("zero1", 2)])
@pytest.mark.parametrize("every", [2, 3])
@pytest.mark.parametrize("b, s", [(8, 256), (4, 512), (2, 128)])
def test_replayed_requested_peak_equals_the_estimate(llama_path, precision, method, world, every, b, s):
    """Where the activations peak, the replay's requested peak is the analytic estimate to the byte."""
    assert _requested_less_estimate(_spec(llama_path, precision, every, b, s, method, world)) == 0


@pytest.mark.parametrize("method", ["ddp", "zero2"])
def test_gradient_accumulation_requested_peak_equals_the_estimate(llama_path, method):
    """Two micro-batches a step (DDP under no_sync, ZeRO-2's own micro-steps): the merged step accumulates too."""
    spec = _spec(llama_path, "mixed_bf16", 2, 8, 256, method, 2, grad_accum_steps=2)
    assert _requested_less_estimate(spec) == 0


@pytest.mark.parametrize("every", [2, 3])
def test_tensor_parallel_requested_peak_equals_the_estimate(llama_path, every):
    """TP's rank profiles (local shards, replicated parts) merge the same way."""
    assert _requested_less_estimate(_spec(llama_path, "mixed_bf16", every, 8, 256, "tp", 2)) == 0


@pytest.mark.parametrize("precision", ["fp32", "mixed_bf16"])
@pytest.mark.parametrize("every", [2, 3])
def test_an_optimizer_step_peak_differs_as_without_every_k(llama_path, precision, every):
    """Where the optimizer step peaks (a small batch), the replay is 4 bytes under the estimate with or without
    checkpointing (a pre-existing scalar of the optimizer step, not every-k's): every-k differs by the same."""
    b, s = 1, 32
    mixed = _requested_less_estimate(_spec(llama_path, precision, every, b, s))
    full = _requested_less_estimate(_spec(llama_path, precision, 0, b, s))
    plain = _requested_less_estimate(dataclasses.replace(_spec(llama_path, precision, 0, b, s),
                                                         training=TrainingSpec(precision=precision,
                                                                               micro_batch_size=b, seq_len=s)))
    assert mixed == full == plain


@pytest.mark.parametrize("precision", ["fp32", "mixed_bf16"])
@pytest.mark.parametrize("every", [2, 3])
@pytest.mark.parametrize("b, s", [(8, 256), (4, 512)])
def test_zero2_replay_less_estimate_is_full_checkpointings(llama_path, precision, every, b, s):
    """ZeRO-2's replay sits a fixed amount under its analytic estimate under full checkpointing (its gradient
    partition's timing, not every-k's); every-k inherits exactly that difference where activations peak."""
    mixed = _requested_less_estimate(_spec(llama_path, precision, every, b, s, "zero2", 2))
    assert mixed == _requested_less_estimate(_spec(llama_path, precision, 0, b, s, "zero2", 2))


@pytest.mark.parametrize("every, layers", [(2, 6), (3, 6), (2, 5), (3, 3), (4, 6)])
def test_merged_events_expand_for_any_depth(llama_path, every, layers):
    """The merge holds for a checkpointed last layer or not, and the lowest checkpointed layer first, generic
    or last; a step of the merged list frees everything it makes but what the optimizer keeps."""
    spec = _spec(llama_path, "fp32", every, 2, 64)
    _, profile = api.every_k_profile(llama_path, spec.training, 1, every)
    events = mixed_events(spec, api._regime(profile, 2, 64), layers)
    kinds = [(i + 1) % every == 0 for i in range(layers)]
    names = [name for name in events["segments"] if name.endswith("+release")]
    assert names == [("bw_first" if kinds.index(True) == layers - 1 else "bw") + "+ckpt+release"]
    plain = api.load_model_profile(llama_path, dataclasses.replace(spec.training, ckpt_policy="", grad_ckpt=False))
    plain_events = api._regime(plain[1], 2, 64)["events"]

    def allocs(ops: list) -> int:
        return sum(kind == 0 for kind, _, _ in ops)

    def per_layer(segments: dict, suffix: str) -> int:  # a generic layer's allocations, forward and backward
        return sum(code >= 0 for name in ("fw", "bw") for code in segments[name + suffix])

    more = per_layer(events["segments"], "+ckpt") - per_layer(events["segments"], "")
    assert allocs(expand(events, layers).steady.ops) == \
        allocs(expand(plain_events, layers).steady.ops) + sum(kinds) * more


def test_zero3_replays_every_k(llama_path):
    """ZeRO-3 replays every-k checkpointing: the merged event list on the default stream, the checkpointed layers'
    recomputation fetches on the allgather stream (tests/estimator/test_zero3_recompute.py)."""
    spec = _spec(llama_path, "mixed_bf16", 2, 2, 64, "zero3", 2)
    arch, profile = api.every_k_profile(llama_path, spec.training, 1, 2)
    regime = api._regime(profile, 2, 64)
    assert reserved_rank.why_not(spec, regime, arch.num_layers, api._param_table(profile, arch.num_layers)) is None
    assert api.estimate(spec, alloc_conf="").ranks[0].reserved_source == "replayed"


def test_profiles_that_differ_outside_the_layers_are_refused():
    plain = {"optimizer": "adamw", "held": [], "segments": {}}
    with pytest.raises(ExpansionError, match="^every-k: the two profiles' steps differ"):
        from estimator.reserved.every_k import merge_events
        merge_events(plain, {**plain, "optimizer": "sgd"}, 4, 2)


@pytest.mark.slow
@pytest.mark.parametrize("precision, every", [
    ("fp32", 2), ("fp32", 3),
    # mixed precision: the plain layers free their input in their forward, the model keeps the embedding output
    # bound to the forward's end and the last layer's input past its hook (checkpointed last layer: K 2; plain: K 4)
    ("mixed_bf16", 2), ("mixed_bf16", 4),
])
def test_generated_stream_equals_a_real_cpu_run(llama_path, precision, every):
    """Setup, three steps of the tiny Llama (6 layers) with layers K-1, 2K-1, ... under torch's non-reentrant
    checkpoint (the profiler's build, ``techniques.apply_layer_policy``), the real run in a spawned process: the
    same sizes in the same order, the same tensor freed, to the event."""
    b, s = 2, 64
    spec = _spec(llama_path, precision, every, b, s, attn="eager")
    arch, profile = api.every_k_profile(llama_path, spec.training, 1, every)
    regime, table = api._regime(profile, b, s), api._param_table(profile, arch.num_layers)
    events = mixed_events(spec, regime, arch.num_layers)
    setup = reserved_rank._setup(profile, table, arch.num_layers, "single", precision.startswith("mixed_"))
    plan = StepPlan(expand(events, arch.num_layers), step_sizes(events["polys"], b, s), b * s * INT64, 0, 0)
    generated = [("alloc", i, n, 0) for i, (name, n) in enumerate(setup.allocations)
                 if not name.startswith("buffers")]
    for step in range(3):
        generated += step_requests(plan, step, len(setup.allocations))
    assert arch.num_layers == LLAMA["num_hidden_layers"]
    real = _in_fresh_process(_real_cpu_events, spec.training, 3)
    assert_same_stream(generated, real)


# DeepSeek-V2-Lite's first 3 layers at full width (a dense first layer, then expert layers) with checkpointing
# every-k:2, b8 s1024, on an H200 (torch 2.11, transformers 5.17); its snapshot is in
# data/measurements/h200-141gb/snapshots/
DENSE_FIRST_RUN = "f5cf7c580d4ba11d-c862afd8"


def _dense_first_row() -> dict:
    import csv
    from pathlib import Path

    table = Path(__file__).resolve().parents[2] / "data" / "measurements" / "h200-141gb" / "gpu_snapshots.csv"
    with table.open(newline="") as handle:
        return next(r for r in csv.DictReader(handle) if r["run_id"] == DENSE_FIRST_RUN)


@pytest.fixture(scope="module")
def dense_first():
    """(spec, regime, table, num_layers, profile) of the H200 run, its profiles those of the model code it ran."""
    from estimator.columns import measured_spec_from_columns

    spec = measured_spec_from_columns(_dense_first_row())
    training = spec.training
    arch, profile = api.every_k_profile(spec.model, training, 1, 2)
    regime = api._regime(profile, training.micro_batch_size, training.seq_len)
    return spec, regime, api._param_table(profile, arch.num_layers), arch.num_layers, profile


def test_dense_first_every_k_requested_peak_is_the_h200_runs(dense_first):
    """Every-k over a dense first layer: the merged event list pairs the first layer's crossing tensors apart
    from the generic layer's and puts the checkpoints' shared tensors where the first layer lets them go,
    counted from its backward's end. The replay's requested peak is the snapshot's (36,810,085,636 B, the
    kernels' own scratch aside: 196,604 B); its reserved level is not yet (the prior stays: ``why_not``)."""
    spec, regime, table, num_layers, profile = dense_first
    assert "first layer of another kind" in reserved_rank.why_not(spec, regime, num_layers, table)
    coeffs = load_coefficients("h200-141gb")
    replayed = reserved_rank.replay_reserved(spec, profile, regime, table, num_layers,
                                             workspace_bytes=coeffs.cublas_workspace_bytes,
                                             workspaces=coeffs.cublas_workspaces, allowed_bytes=None, conf_text="")
    measured = int(_dense_first_row()["peak_requested_bytes"])
    assert measured == 36_810_085_636
    assert abs(replayed.peak_requested_bytes - measured) / measured < 1e-5


@pytest.mark.parametrize("layers", [3, 4, 5, 27])
def test_dense_first_merged_events_expand_for_any_depth(dense_first, layers):
    """A checkpointed expert layer above a plain one touches its output through the checkpointed profile's first
    (dense) layer, whose counterpart is the checkpointed generic layer's; every step frees what it makes."""
    spec, regime, _table, _layers, _profile = dense_first
    events = mixed_events(spec, regime, layers)
    assert events["ckpt_alias_first"] != events["ckpt_alias"]
    plain = api.load_model_profile(spec.model, dataclasses.replace(spec.training, ckpt_policy="", grad_ckpt=False))
    plain_events = api._regime(plain[1], spec.training.micro_batch_size, spec.training.seq_len)["events"]

    def allocs(ops: list) -> int:
        return sum(kind == 0 for kind, _, _ in ops)

    def per_layer(segments: dict, suffix: str) -> int:
        return sum(code >= 0 for name in ("fw", "bw") for code in segments[name + suffix])

    checkpointed = sum((i + 1) % 2 == 0 for i in range(layers))
    more = per_layer(events["segments"], "+ckpt") - per_layer(events["segments"], "")
    assert allocs(expand(events, layers).steady.ops) == \
        allocs(expand(plain_events, layers).steady.ops) + checkpointed * more


@pytest.fixture(scope="module")
def dense_first_streams():
    """(generated, its phase starts, recorded, its phase starts) of the H200 run: the estimator's request stream
    (replayed although the estimate keeps the prior) and the snapshot's (``benchmarks/reserved_stream_diff.py``)."""
    from pathlib import Path

    from benchmarks.reserved_stream_diff import _live, generated, recorded

    row = _dense_first_row()
    snapshot = (Path(__file__).resolve().parents[2] / "data" / "measurements" / "h200-141gb" / "snapshots"
                / f"{DENSE_FIRST_RUN}.rank0.snapshot.pickle.gz")
    gen, gen_starts, _result = generated(row, replay_refused=True)
    batch_bytes = int(row["micro_batch_size"]) * int(row["seq_len"]) * INT64
    rec, rec_starts, _snapshot = recorded(snapshot, batch_bytes, _live(gen[:gen_starts[1]]))
    return gen, gen_starts, rec, rec_starts


def _largest_requests(requests: list, lo: int, hi: int, min_bytes: int) -> list[tuple[str, int]]:
    """("A" | "F", size) of the requests lo:hi of at least min_bytes, in their order."""
    sizes = {r[1]: r[2] for r in requests[:hi] if r[0] == "alloc"}
    return [("A" if r[0] == "alloc" else "F", sizes[r[1]]) for r in requests[lo:hi] if sizes[r[1]] >= min_bytes]


def test_dense_first_every_k_largest_requests_are_the_h200_runs(dense_first_streams):
    """Every step's requests of 1 GiB and more (the fp32 logits and the loss's copies of them, 1600 and 3200 MiB;
    the expert layers' 1408 MiB backward tensors) come and go in the generated stream as in the recorded one, in
    the same order: the merge orders the logits and the loss as torch and transformers do. The replay's extra
    3200 MiB segments of step 2 come from where step 1 put the persistent 800 MiB gradients
    (``test_dense_first_every_k_recorded_level_turns_on_one_request``)."""
    gen, gen_starts, rec, rec_starts = dense_first_streams
    for step in (1, 2, 3):
        generated = _largest_requests(gen, gen_starts[step], gen_starts[step + 1], GIB)
        assert len(generated) >= 20
        assert generated == _largest_requests(rec, rec_starts[step], rec_starts[step + 1], GIB)


def test_dense_first_every_k_recorded_level_turns_on_one_request(dense_first_streams):
    """Why the estimate keeps the prior: the recorded stream through the model gives the measured reserved peak,
    but without any one of several 32 MiB requests of step 1 that the generated stream lacks (the cuDNN attention
    output of an MLA layer and its ``transpose(1, 2).contiguous()`` copy: the GPU ran cuDNN where the trace runs
    the memory-efficient kernel) it reserves over 10 % more, about the generated stream's level, which none of the
    generated stream's own unmatched requests moves."""
    from benchmarks.reserved_stream_diff import ablation, trajectory, unmatched, without

    gen, gen_starts, rec, rec_starts = dense_first_streams
    measured = int(_dense_first_row()["peak_reserved_bytes"])
    assert trajectory(rec)[2] == measured
    generated_peak = trajectory(gen)[2]
    assert generated_peak > 1.1 * measured
    step1 = rec_starts[1:3]
    flips = [r for r in unmatched(rec, step1, gen, gen_starts[1:3]) if r[2] == 32 * MIB
             and trajectory(without(rec, {r[1]}))[2] > 1.1 * measured]
    assert len(flips) >= 2
    assert {peak for _size, _count, peak in ablation(gen, gen_starts, rec, rec_starts)} == {generated_peak}
