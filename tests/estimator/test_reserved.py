"""The reserved level from each rank's own event stream (estimator.reserved): the profile's event list expanded
to the full depth and checked against deeper traces and a real CPU run, event by event; the replay's allocated
level against the estimator's; the API, CLI and plan plumbing."""

import dataclasses
import json

import pytest

pytest.importorskip("torch")

from estimator import api  # noqa: E402
from estimator.hardware.residuals import load_coefficients  # noqa: E402
from estimator.io.cli import main as cli_main  # noqa: E402
from estimator.profiler.expand import ExpansionError, expand, step_sizes  # noqa: E402
from estimator.reserved import rank as reserved_rank  # noqa: E402
from estimator.reserved.timeline import INT64, StepPlan, step_requests  # noqa: E402
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec, ZeroSpec  # noqa: E402

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 160,
         "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
         "max_position_embeddings": 512, "tie_word_embeddings": False}
OPT = {"model_type": "opt", "architectures": ["OPTForCausalLM"], "hidden_size": 64, "ffn_dim": 256,
       "num_hidden_layers": 6, "num_attention_heads": 4, "vocab_size": 1000, "max_position_embeddings": 512,
       "word_embed_proj_dim": 64}
# CodeGen's eager attention multiplies query and key upcast to fp32: (b, heads, s, s) fp32 scores, mask sum, scaled
# copy and softmax, then a 16-bit copy, all made again in each checkpointed layer's recompute; rotary on a slice
CODEGEN = {"model_type": "codegen", "architectures": ["CodeGenForCausalLM"], "n_embd": 64, "n_layer": 4, "n_head": 4,
           "rotary_dim": 8, "n_positions": 512, "n_ctx": 512, "vocab_size": 1000, "activation_function": "gelu_new",
           "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": False}
B, S = 2, 64


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("reserved") / "config.json"
    path.write_text(json.dumps(LLAMA))
    return str(path)


def _profile(path: str, training: TrainingSpec):
    arch, profile = api.load_model_profile(path, training)
    return arch, profile, api._param_table(profile, arch.num_layers), api._regime(profile, B, S)


@pytest.mark.parametrize("config, training", [
    (LLAMA, TrainingSpec(precision="mixed_bf16")),
    pytest.param(OPT, TrainingSpec(precision="fp32", attn="eager"), marks=pytest.mark.slow),
    pytest.param(LLAMA, TrainingSpec(precision="bf16", lora_rank=8), marks=pytest.mark.slow),
    pytest.param(LLAMA, TrainingSpec(precision="bf16", grad_ckpt=True), marks=pytest.mark.slow),
    # LoRA on the MLP only: layer 0's frozen attention saves nothing, so layer 1's backward frees the rotary cos/sin
    (LLAMA, TrainingSpec(precision="bf16", lora_rank=8, lora_targets="gate_proj,up_proj,down_proj")),
    # LoRA with checkpointing: the embedding output is a leaf the trace keeps (freed with the loss, compared apart)
    (LLAMA, TrainingSpec(precision="bf16", lora_rank=8, grad_ckpt=True)),
])
def test_expansion_to_four_layers_equals_a_four_layer_trace(config, training):
    """The profiler's depth check: the 3-layer event list expanded to 4 layers against a real 4-layer trace,
    event by event (kind, bytes and which tensor is freed), for the steady step and the first optimizer step."""
    from estimator.profiler.profile import build_profile

    profile = build_profile(config, training)
    for regime in profile["regimes"]:
        check = regime["layer_check"]
        assert "events_error" not in check, check
        assert check["events_steady"] > 500
        assert check["events_first_mismatch"] is None and check["events_first_optimizer_mismatch"] is None


@pytest.mark.parametrize("training, parallel", [
    (TrainingSpec(precision="mixed_bf16", micro_batch_size=B, seq_len=S), ParallelSpec()),
    (TrainingSpec(precision="fp32", micro_batch_size=B, seq_len=S, loop="manual"), ParallelSpec()),
    (TrainingSpec(precision="mixed_bf16", micro_batch_size=B, seq_len=S, loop="manual", outputs_fp32=True),
     ParallelSpec()),
    (TrainingSpec(precision="bf16", micro_batch_size=B, seq_len=S, grad_ckpt=True),
     ParallelSpec(method="ddp", world_size=2)),
    # gradient accumulation: the analytic "every gradient held + the one in flight" and the event stream agree
    (TrainingSpec(precision="mixed_bf16", micro_batch_size=B, seq_len=S, grad_accum_steps=3), ParallelSpec()),
    (TrainingSpec(precision="bf16", micro_batch_size=B, seq_len=S, loop="manual", grad_accum_steps=2),
     ParallelSpec()),
    (TrainingSpec(precision="mixed_bf16", micro_batch_size=B, seq_len=S, grad_accum_steps=2),
     ParallelSpec(method="ddp", world_size=2)),
    # QLoRA: each NF4 weight's packed values and quantization state as one block of the setup
    (TrainingSpec(precision="bf16", micro_batch_size=B, seq_len=S, lora_rank=8, qlora=True, grad_ckpt=True),
     ParallelSpec()),
])
def test_replayed_allocated_level_equals_the_estimate(llama_path, training, parallel):
    """The requested bytes alive at once in the replayed stream = the estimator's allocated peak less its block
    rounding + the batch (which the estimator does not count), to the byte."""
    spec = RunSpec(model=llama_path, training=training, parallel=parallel)
    est = api.estimate(spec, alloc_conf="")
    arch, profile, table, regime = _profile(llama_path, training)
    coeffs = load_coefficients(est.gpu_key)
    replayed = reserved_rank.replay_reserved(spec, profile, regime, table, arch.num_layers,
                                             workspace_bytes=coeffs.cublas_workspace_bytes,
                                             workspaces=coeffs.cublas_workspaces, allowed_bytes=None, conf_text="")
    # the estimate adds the replay's block rounding (what max_memory_allocated counts beyond the requests)
    rounding = est.breakdown.get("allocator_rounding", 0)
    assert rounding == replayed.peak_allocated_bytes - replayed.peak_requested_bytes
    assert replayed.peak_requested_bytes == est.peak_allocated_bytes - rounding + 3 * B * S * INT64
    assert est.reserved_source == "replayed" and replayed.steady
    assert est.peak_reserved_bytes == replayed.peak_reserved_bytes >= replayed.peak_allocated_bytes


def _in_fresh_process(fn, *args):
    """Real CPU kernels start OpenMP threads; a process forked after that can deadlock (the campaign's
    fork-isolation test), so real compute runs in a spawned interpreter, not in the pytest process."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _real_cpu_events(training: TrainingSpec, steps: int, accum: int = 1, config: dict = LLAMA):
    """A real CPU run (real tensors) of the tiny model (Llama unless ``config``): the model moved to the device (``to_empty``), the
    optimizer, ``steps`` steps with a new batch each; every storage recorded. Left out: the module buffers (the
    profile keeps their bytes, not their tensors), Adam's host-side step counters and the scalar it adds to them
    (CPU tensors on a GPU), and, by the same patch the profiler uses, transformers' data-dependent mask check."""
    import torch
    from transformers import masking_utils

    from estimator.profiler import build
    from estimator.profiler.trace import StorageRecorder

    torch.manual_seed(0)
    model = build.build_model(config, training, meta=True)
    rec = StorageRecorder()
    orig = masking_utils._ignore_causal_mask_sdpa
    masking_utils._ignore_causal_mask_sdpa = lambda padding_mask, *a, **k: orig(None, *a, **k)
    try:
        with rec:
            model.to_empty(device="cpu")
            model.tie_weights()
            buffers = {rec.sid(b.untyped_storage()) for b in model.buffers()}
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_(0, 0.02)
            opt = build.build_optimizer(model.parameters(), training)
            batch = None
            for _ in range(steps):
                for _micro in range(accum):
                    batch = build.synthetic_batch(B, S, config["vocab_size"])
                    build.forward_backward(model, batch, training)  # the detached loss is dropped at once
                rec.mark("step")
                opt.step()
                rec.mark("step_end")
                opt.zero_grad(set_to_none=True)
    finally:
        masking_utils._ignore_causal_mask_sdpa = orig
    timeline = rec.timeline
    host = {rec.sid(st["step"].untyped_storage()) for st in getattr(opt, "inner", opt).state.values()}
    inside = False
    for event in timeline.events:
        if event[0] == "m":
            inside = event[1] == "step"
        elif inside and event[0] == "a" and timeline.sizes[event[1]] == 4:
            host.add(event[1])
    return [(e[0] == "a", e[1], timeline.sizes[e[1]]) for e in timeline.events
            if e[0] != "m" and e[1] not in buffers and e[1] not in host]


@pytest.mark.parametrize("variant", [
    {"precision": "fp32"},
    pytest.param({"precision": "mixed_bf16"}, marks=pytest.mark.slow),
    # LoRA with checkpointing: the embedding output becomes a leaf (enable_input_require_grads) that the trace's
    # module tracker keeps; the real run frees it and its .grad with the graph, just before the loss
    {"precision": "bf16", "lora_rank": 8, "grad_ckpt": True},
], ids=lambda v: "-".join(f"{k}={v[k]}" for k in v))
def test_generated_stream_equals_a_real_cpu_run(llama_path, variant):
    """Setup (parameters in their real order, fp32 masters), three steps (batches, the first step's Adam states,
    the steady steps): the same sizes in the same order, the same tensor freed, to the event."""
    # eager attention: the kernels a real CPU run executes are CUDA's too (SDPA's are not: the profile traces
    # CUDA's choice, estimator.profiler.cuda_path)
    precision = variant["precision"]
    training = TrainingSpec(attn="eager", micro_batch_size=B, seq_len=S, **variant)
    spec = RunSpec(model=llama_path, training=training)
    arch, profile, table, regime = _profile(llama_path, training)
    setup = reserved_rank._setup(profile, table, arch.num_layers, "single", precision.startswith("mixed_"))
    plan = StepPlan(expand(regime["events"], arch.num_layers), step_sizes(regime["events"]["polys"], B, S),
                    B * S * INT64, 0, 0)
    names = [name for name, _ in setup.allocations]
    generated = [("alloc", i, n, 0) for i, (name, n) in enumerate(setup.allocations) if not name.startswith("buffers")]
    for step in range(3):
        generated += step_requests(plan, step, len(setup.allocations))
    assert not any(r[1] < len(names) and names[r[1]].startswith("buffers") for r in generated)
    real = _in_fresh_process(_real_cpu_events, spec.training, 3)
    assert_same_stream(generated, real)


@pytest.mark.slow
def test_checkpointed_fp32_attention_stream_equals_a_real_cpu_run(tmp_path):
    """CodeGen's eager attention with checkpointing (the H200's transformers 5.17 rows ran this path, 5.24 runs it
    for attn="eager"): every recomputed layer's fp32 scores, their sum with the mask, the scaled copy, the softmax
    and its 16-bit copy, allocated while the layer above's gradients are alive, in the real order and freed with
    the real tensor."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CODEGEN))
    training = TrainingSpec(precision="mixed_bf16", attn="eager", grad_ckpt=True, micro_batch_size=B, seq_len=S)
    arch, profile, table, regime = _profile(str(path), training)
    assert profile["attn_effective"] == "eager"
    setup = reserved_rank._setup(profile, table, arch.num_layers, "single", True)
    plan = StepPlan(expand(regime["events"], arch.num_layers), step_sizes(regime["events"]["polys"], B, S),
                    B * S * INT64, 0, 0)
    generated = [("alloc", i, n, 0) for i, (name, n) in enumerate(setup.allocations) if not name.startswith("buffers")]
    for step in range(2):
        generated += step_requests(plan, step, len(setup.allocations))
    scores = 4 * B * CODEGEN["n_head"] * S * S
    assert sum(g[0] == "alloc" and g[2] == scores for g in generated) >= 3 * 2 * CODEGEN["n_layer"]
    real = _in_fresh_process(_real_cpu_events, training, 2, 1, CODEGEN)
    assert_same_stream(generated, real)


def assert_same_stream(generated: list[tuple], real: list[tuple[bool, object, int]]) -> None:
    """The generated requests are the real run's, event for event: alloc or free, bytes, and which tensor (a
    one-to-one map between the generated keys and the real storages)."""
    assert len(real) == len(generated)
    key_of, ident_of = {}, {}
    for i, (gen, (alloc, ident, nbytes)) in enumerate(zip(generated, real)):
        assert (gen[0] == "alloc") == alloc, i
        if alloc:
            assert gen[2] == nbytes, i
        assert key_of.setdefault(gen[1], ident) == ident and ident_of.setdefault(ident, gen[1]) == gen[1], i


def _stream_peaks(stream: list[tuple[bool, object, int]]) -> tuple[int, int]:
    """(requested bytes alive at once, reserved) of a stream of (alloc?, tensor, bytes) through the allocator."""
    from estimator.allocator import CachingAllocator

    allocator, addr, size = CachingAllocator(None), {}, {}
    live = peak = 0
    for alloc, key, nbytes in stream:
        if alloc:
            addr[key], size[key] = allocator.malloc(nbytes), nbytes
            live += nbytes
            peak = max(peak, live)
        else:
            allocator.free(addr.pop(key))
            live -= size.pop(key)
    return peak, allocator.peak_reserved_bytes


def test_gradient_accumulation_stream_matches_a_real_cpu_run(llama_path):
    """Two optimizer steps of 3 micro-batches each: the same allocations in the same order, every free of the
    same tensor, and the same requested and reserved peaks. The one liberty: a re-made gradient's free, which
    the engine runs after routing its node's outputs (sometimes after summing another node's inputs, a few
    events later than the rule places it)."""
    from estimator.reserved.accumulate import micro_steps
    from estimator.reserved.timeline import micro_step_requests

    accum, steps = 3, 2
    training = TrainingSpec(precision="fp32", attn="eager", micro_batch_size=B, seq_len=S)
    arch, profile, table, regime = _profile(llama_path, training)
    setup = reserved_rank._setup(profile, table, arch.num_layers, "single", False)
    expansion = expand(regime["events"], arch.num_layers)
    plan = StepPlan(expansion, step_sizes(regime["events"]["polys"], B, S), B * S * INT64, 0, 0)
    micro = micro_steps(expansion)
    generated = [("alloc", i, n, 0) for i, (name, n) in enumerate(setup.allocations)
                 if not name.startswith("buffers")]
    for step in range(accum * steps):
        generated += micro_step_requests(plan, micro, accum, step, len(setup.allocations))
    real = _in_fresh_process(_real_cpu_events, training, steps, accum)
    assert len(real) == len(generated)
    assert [g[2] for g in generated if g[0] == "alloc"] == [n for alloc, _, n in real if alloc]
    ident_of = dict(zip((g[1] for g in generated if g[0] == "alloc"), (i for alloc, i, _ in real if alloc)))
    real_free_at = {}
    for at, (alloc, ident, _) in enumerate(real):
        if not alloc:
            real_free_at.setdefault(ident, []).append(at)
    moved = 0
    for at, g in enumerate(generated):
        if g[0] == "free":
            where = real_free_at[ident_of[g[1]]].pop(0)
            assert abs(where - at) <= 8, (at, where)
            moved += where != at
    assert moved <= len(generated) // 20  # 224 of 9,612 events, all within a few of their place
    stream = [(g[0] == "alloc", g[1], g[2] if g[0] == "alloc" else 0) for g in generated]
    assert _stream_peaks(stream) == _stream_peaks(real)


def test_expandable_segments_and_bad_alloc_conf(llama_path):
    spec = RunSpec(model=llama_path, training=TrainingSpec(precision="mixed_bf16", micro_batch_size=B, seq_len=S))
    default = api.estimate(spec, alloc_conf="")
    expandable = api.estimate(spec, alloc_conf="expandable_segments:True")
    assert default.reserved_source == expandable.reserved_source == "replayed"
    assert expandable.peak_reserved_bytes != default.peak_reserved_bytes
    assert any(n.startswith("reserved: replayed") and "expandable_segments:True" in n for n in expandable.notes)
    with pytest.raises(ValueError, match="^alloc_conf: .*unknown allocator option 'bogus'"):
        api.estimate(spec, alloc_conf="bogus:1")
    prior = api.estimate(spec, replay_reserved=False)
    # without a replay there is no block rounding to count; everything else of the allocated level is the same
    assert prior.reserved_source == "prior" and "allocator_rounding" not in prior.breakdown
    assert prior.traced_allocated_bytes == default.traced_allocated_bytes


def test_environment_default_and_cli_flag(llama_path, monkeypatch, capsys):
    spec = RunSpec(model=llama_path, training=TrainingSpec(precision="mixed_bf16", micro_batch_size=B, seq_len=S))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert api.estimate(spec).alloc_conf == "expandable_segments:True"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert cli_main(["--model", llama_path, "--method", "single", "--precision", "mixed_bf16", "--alloc-conf",
                     "nonsense:3"]) == 2
    assert "alloc_conf:" in capsys.readouterr().err
    assert cli_main(["--model", llama_path, "--method", "single", "--precision", "mixed_bf16",
                     "--micro-batch-size", "2", "--seq-len", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["reserved_source"] == "replayed" and out["ranks"][0]["replayed_steps"] >= 3


def test_out_of_scope_methods_and_old_profiles_keep_the_prior(llama_path):
    training = TrainingSpec(precision="mixed_bf16", micro_batch_size=B, seq_len=S)
    zero = api.estimate(RunSpec(model=llama_path, training=training,
                                parallel=ParallelSpec(method="zero3", world_size=2)), alloc_conf="")
    assert zero.reserved_source == "replayed"  # tests/estimator/test_zero3_snapshots.py
    checkpointed = api.estimate(RunSpec(model=llama_path, training=dataclasses.replace(training, grad_ckpt=True),
                                        parallel=ParallelSpec(method="zero3", world_size=2)), alloc_conf="")
    assert checkpointed.reserved_source == "replayed"  # tests/estimator/test_zero3_recompute.py
    offloaded_ckpt = api.estimate(RunSpec(model=llama_path, training=dataclasses.replace(
        training, grad_ckpt=True, activation_offload=True), parallel=ParallelSpec(method="zero3", world_size=2)),
        alloc_conf="")
    assert offloaded_ckpt.reserved_source == "prior"
    assert any(n.startswith("reserved: prior") and "zero3" in n for n in offloaded_ckpt.notes)
    offloaded = api.estimate(RunSpec(model=llama_path, training=training, parallel=ParallelSpec(
        method="zero2", world_size=2, zero=ZeroSpec(offload_optimizer=True))), alloc_conf="")
    assert offloaded.reserved_source == "replayed"  # the zero_offload path: tests/estimator/test_zero3_snapshots.py
    offloaded_accum = api.estimate(RunSpec(model=llama_path, training=dataclasses.replace(
        training, grad_accum_steps=2), parallel=ParallelSpec(method="zero_offload", world_size=2)), alloc_conf="")
    assert offloaded_accum.reserved_source == "prior"
    assert any(n.startswith("reserved: prior") and "offload" in n for n in offloaded_accum.notes)
    overlapped = api.estimate(RunSpec(model=llama_path, training=training, parallel=ParallelSpec(
        method="zero2", world_size=2, zero=ZeroSpec(overlap_comm=True))), alloc_conf="")
    assert overlapped.reserved_source == "replayed"
    zero2 = api.estimate(RunSpec(model=llama_path, training=training,
                                 parallel=ParallelSpec(method="zero2", world_size=2)), alloc_conf="")
    assert zero2.reserved_source == "replayed"  # tests/estimator/test_reserved_zero.py
    accumulating = api.estimate(RunSpec(model=llama_path, training=dataclasses.replace(training, grad_accum_steps=2),
                                        parallel=ParallelSpec(method="fsdp", world_size=2)), alloc_conf="")
    assert accumulating.reserved_source == "replayed"  # FSDP2 with accumulation: tests/estimator/test_reserved_fsdp.py
    shipped = api.estimate(RunSpec(model="facebook/opt-125m", training=training), alloc_conf="")
    assert shipped.reserved_source in ("prior", "replayed")  # replayed once the shipped profiles are re-traced


def test_a_non_generic_stack_is_refused():
    events = {"size": [0, 0], "polys": [[512, 0, 0, 0, 0, 0]], "layer_of": [], "held": [], "first_optimizer": [],
              "segments": {"prefix": [], "fw_first": [], "fw": [0], "fw_last": [], "mid_fw": [], "mid_bw": [],
                           "bw_first": [], "bw": [], "bw_last": [~0], "suffix": [], "optimizer": []}}
    with pytest.raises(ExpansionError):
        expand(events, 5)  # layer 1's tensor freed by layer 0's backward: every generic layer's would be
