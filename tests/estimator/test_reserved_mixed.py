"""The reserved replay of decoder stacks whose first layer is of another kind (a dense MLP before mixture-of-experts
layers: DeepSeek-V2/V3's ``first_k_dense_replace``, Qwen3-MoE's ``mlp_only_layers``): the event list expands with
layer 0's events from the traced layer 0 and the generic expert layer's repeated (``estimator.profiler.expand``),
its requested peak equals the analytic allocated estimate, and its expansion to 4 layers equals a 4-layer trace."""

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from estimator import api  # noqa: E402
from estimator.hardware.residuals import load_coefficients  # noqa: E402
from estimator.methods.state import fp32_kept_params  # noqa: E402
from estimator.profiler.expand import ExpansionError, expand  # noqa: E402
from estimator.reserved import rank as reserved_rank  # noqa: E402
from estimator.reserved.timeline import INT64  # noqa: E402
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec  # noqa: E402

QWEN3_TINY = "benchmarks/configs/qwen3_moe_tiny.json"     # 4 layers, mlp_only_layers [0]
DEEPSEEK_TINY = "benchmarks/configs/deepseek_v2_tiny.json"  # 3 layers, first_k_dense_replace 1, fp32 routers
LITE = "deepseek-ai/DeepSeek-V2-Lite"                       # shipped profile: 27 layers, the first dense


def _spec(model: str, method: str, world: int, b: int, s: int, precision: str = "bf16") -> RunSpec:
    parallel = ParallelSpec() if method == "single" else ParallelSpec(method=method, world_size=world)
    return RunSpec(model=model, training=TrainingSpec(precision=precision, micro_batch_size=b, seq_len=s),
                   parallel=parallel)


def _over_the_estimate(spec: RunSpec) -> tuple[int, object, list]:
    """(the replay's requested peak less the analytic allocated peak + the batch, the estimate, the table)."""
    training = spec.training
    b, s = training.micro_batch_size, training.seq_len
    est = api.estimate(spec, alloc_conf="")
    arch, profile = api.load_model_profile(spec.model, training)
    table = api._param_table(profile, arch.num_layers)
    coeffs = load_coefficients(est.gpu_key)
    replayed = reserved_rank.replay_reserved(spec, profile, api._regime(profile, b, s), table, arch.num_layers,
                                             workspace_bytes=coeffs.cublas_workspace_bytes,
                                             workspaces=coeffs.cublas_workspaces, allowed_bytes=None, conf_text="")
    rounding = est.breakdown.get("allocator_rounding", 0)
    assert rounding == replayed.peak_allocated_bytes - replayed.peak_requested_bytes
    assert est.reserved_source == "replayed" and replayed.steady
    assert est.peak_reserved_bytes == replayed.peak_reserved_bytes
    return replayed.peak_requested_bytes - (est.peak_allocated_bytes - rounding + 3 * b * s * INT64), est, table


def _the_layers(model: str, training: TrainingSpec):
    arch, profile = api.load_model_profile(model, training)
    return arch, profile["params"]["layer_kinds"]["of_layer"], api._regime(profile, 2, 128)["events"]


@pytest.mark.parametrize("model", [QWEN3_TINY, DEEPSEEK_TINY])
def test_the_tiny_configs_have_a_dense_first_layer_and_expand(model):
    arch, kinds, events = _the_layers(model, TrainingSpec(precision="bf16"))
    assert kinds[0] != kinds[1] and len(set(kinds[1:])) == 1
    expansion = expand(events, arch.num_layers)
    # every layer's forward allocates its own tensors: layer 0 fewer than the expert layers (the dense MLP)
    deeper = expand(events, arch.num_layers + 3)
    assert deeper.steady.keys > expansion.steady.keys


@pytest.mark.parametrize("model", [QWEN3_TINY, DEEPSEEK_TINY])
@pytest.mark.parametrize("method, world", [("single", 1), ("ddp", 2), ("fsdp", 2), ("fsdp", 8)])
@pytest.mark.parametrize("b, s", [(2, 128), (4, 256), (4, 512)])
def test_replayed_requested_peak_equals_the_analytic_estimate(model, method, world, b, s):
    """The requested bytes alive at once in the replayed stream = the analytic allocated peak + the batch, to
    the byte, for every layer's own tensors (layer 0's dense MLP, the expert layers' routed experts)."""
    over, _est, _table = _over_the_estimate(_spec(model, method, world, b, s))
    assert over == 0


@pytest.mark.parametrize("model, method", [(QWEN3_TINY, "single"), (QWEN3_TINY, "ddp"), (DEEPSEEK_TINY, "single"),
                                           (DEEPSEEK_TINY, "ddp")])
def test_at_an_optimizer_step_peak_the_difference_is_the_scalar_and_the_fp32_routers(model, method):
    """At (1, 64) the peak is the optimizer step's. Two differences, explained: the analytic peak still counts
    the profile's activation level there (a 4-byte scalar, as ``test_reserved_ep``); and DeepSeek's routers are
    kept in fp32 in a bf16 model: Adam's foreach runs them as a group of their own whose temporaries (one per
    router weight, every expert layer's: ``_repeated``) are alive while the bf16 group's are made, which the
    analytic step temporaries do not count."""
    over, est, table = _over_the_estimate(_spec(model, method, 2, 1, 64))
    optimizer_level = est.breakdown["activations"]
    assert "temporaries" in est.breakdown and optimizer_level <= 8
    routers = sum(p.nbytes for p in fp32_kept_params(table, "bf16"))
    assert over == routers - optimizer_level
    assert (routers > 0) == (model == DEEPSEEK_TINY)


@pytest.mark.parametrize("method, world, b, s", [("single", 1, 8, 4096), ("ddp", 2, 8, 4096), ("fsdp", 8, 8, 4096),
                                                 ("fsdp", 8, 4, 8192)])
def test_the_shipped_deepseek_v2_lite_profile_replays_to_the_estimate(method, world, b, s):
    over, _est, _table = _over_the_estimate(_spec(LITE, method, world, b, s))
    assert over == 0


def test_the_shipped_deepseek_v2_lite_routers_at_its_optimizer_peak():
    """Every expert layer's fp32 router temporary (26 of 27 layers), as the tiny configs'."""
    over, est, table = _over_the_estimate(_spec(LITE, "single", 1, 1, 512))
    routers = sum(p.nbytes for p in fp32_kept_params(table, "bf16"))
    assert routers == 26 * 64 * 2048 * 4
    assert over == routers - est.breakdown["activations"]


def test_a_two_layer_mixed_stack_is_refused_with_its_reason():
    """With two layers the last (an expert layer) frees its predecessor's output, which is the dense layer 0's:
    no generic layer is there to stand for it."""
    arch, _kinds, events = _the_layers(QWEN3_TINY, TrainingSpec(precision="bf16"))
    with pytest.raises(ExpansionError, match="no counterpart in the first layer"):
        expand(events, 2)


def test_layers_after_the_first_of_two_kinds_keep_the_prior(tmp_path):
    """Two dense layers first (DeepSeek-V3's first_k_dense_replace 3 is the same case): the trace's generic layer
    is dense, the expert layers have no traced segment; the reserved level is the prior, and says why."""
    config = json.loads(Path(DEEPSEEK_TINY).read_text())
    config.update(first_k_dense_replace=2, num_hidden_layers=4)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    est = api.estimate(_spec(str(path), "single", 1, 2, 128), alloc_conf="")
    assert est.reserved_source == "prior"
    assert any(n.startswith("reserved: prior") and "layer 2 is of another kind than layer 1" in n for n in est.notes)


@pytest.mark.parametrize("model, training", [
    (QWEN3_TINY, TrainingSpec(precision="bf16")),
    pytest.param(QWEN3_TINY, TrainingSpec(precision="mixed_bf16"), marks=pytest.mark.slow),
    pytest.param(DEEPSEEK_TINY, TrainingSpec(precision="bf16"), marks=pytest.mark.slow),
])
def test_expansion_to_four_layers_equals_a_four_layer_trace(model, training):
    """The profiler's depth check (``profile._check_depth``) on a dense first layer: the 3-layer event list
    expanded to 4 layers against a 4-layer trace, event by event (kind, bytes and which tensor is freed), the
    steady step and the first optimizer step. A real CPU run cannot stand in here: its expert block runs the CPU
    kernels, which keep other tensors than the CUDA path the trace takes (uniform expert stacks alike)."""
    from estimator.profiler.profile import build_profile

    profile = build_profile(json.loads(Path(model).read_text()), training)
    for regime in profile["regimes"]:
        check = regime["layer_check"]
        assert "events_error" not in check, check
        assert check["events_steady"] > 1000
        assert check["events_first_mismatch"] is None and check["events_first_optimizer_mismatch"] is None


def test_every_k_checkpointing_of_a_mixed_stack_keeps_the_prior_and_says_why():
    """Full checkpointing replays (the checkpointed profile's own event list); every-k's merged list pairs the
    plain and checkpointed layer's crossing tensors for alike layers only."""
    training = TrainingSpec(precision="bf16", micro_batch_size=4, seq_len=256, grad_ckpt=True)
    full = api.estimate(RunSpec(model=QWEN3_TINY, training=training), alloc_conf="")
    assert full.reserved_source == "replayed"
    every = api.estimate(RunSpec(model=QWEN3_TINY, training=TrainingSpec(
        precision="bf16", micro_batch_size=4, seq_len=256, grad_ckpt=True, ckpt_policy="every-k:2")), alloc_conf="")
    assert every.reserved_source == "prior"
    assert any(n.startswith("reserved: prior") and "first layer of another kind" in n for n in every.notes)
