"""FSDP1's reserved level (estimator.reserved.fsdp1): the rank's generated stream against a real CPU run on the fake
process group (built as the harness builds it: the model on the host, ``FullyShardedDataParallel`` per decoder
layer then the root), event for event; its allocated level against the estimator's."""

import contextlib
import dataclasses
import json

import pytest

pytest.importorskip("torch")

from estimator import api  # noqa: E402
from estimator.hardware.residuals import load_coefficients  # noqa: E402
from estimator.reserved import rank as reserved_rank  # noqa: E402
from estimator.reserved.timeline import INT64, run_requests  # noqa: E402
from estimator.spec import Fsdp1Spec, ParallelSpec, RunSpec, TrainingSpec  # noqa: E402
from tests.estimator.test_reserved_fsdp import (  # noqa: E402
    LLAMA,
    STEPS,
    B,
    S,
    StorageResizes,
    _assert_same_runs,
    _in_fresh_process,
    _runs,
    load_profile,
)

ALL_SIX = "down_proj,gate_proj,k_proj,q_proj,up_proj,v_proj"  # fsdp_qlora's "all": the layer ends in an adapter


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("reserved_fsdp1") / "config.json"
    path.write_text(json.dumps(LLAMA))
    return str(path)


def _spec(path: str, training: TrainingSpec, world: int, strategy: str = "FULL_SHARD", orig_params: bool = True,
          cpu_offload: bool = False) -> RunSpec:
    """``strategy``: a sharding strategy; ``HYBRID_SHARD:N`` shards over N ranks per node; a ``+prefetch`` suffix
    turns on forward prefetch."""
    strategy, prefetch, _ = strategy.partition("+prefetch")
    strategy, _, per_node = strategy.partition(":")
    options = Fsdp1Spec(sharding_strategy=strategy, use_orig_params=orig_params, cpu_offload=cpu_offload,
                        forward_prefetch=bool(prefetch), **({"gpus_per_node": int(per_node)} if per_node else {}))
    return RunSpec(model=path, training=training,
                   parallel=ParallelSpec(method="fsdp1", world_size=world, fsdp1=options))


def _generated(path: str, training: TrainingSpec, world: int, rank: int, strategy: str, orig_params: bool = True
               ) -> list[tuple]:
    """Setup (without the host-to-device moves, which a CPU run does not make) and ``STEPS`` optimizer steps of
    ``training.grad_accum_steps`` micro-batches."""
    spec = _spec(path, training, world, strategy, orig_params)
    arch, profile = load_profile(path, training)
    table, regime = api._param_table(profile, arch.num_layers), api._regime(profile, training.micro_batch_size, S)
    events = reserved_rank._events(spec, regime, arch.num_layers)  # every-k: the merged list
    expansion = reserved_rank._expansion(events, arch.num_layers, training.loop)
    plan = reserved_rank._plan(spec, events, expansion, table, arch.num_layers, training.micro_batch_size, S,
                               workspace_bytes=8 << 20, workspaces=0, rank=rank)
    setup = reserved_rank._setup(profile, table, arch.num_layers, "fsdp1", training.precision.startswith("mixed_"),
                                 world, spec, rank)
    frees = dict(setup.frees_after)
    names = [name for name, _ in setup.allocations]
    out = []
    for i, (name, nbytes) in enumerate(setup.allocations):
        if not name.startswith(("buffers", "moved.", "quant_state.")):  # the CPU run builds these before wrapping
            out.append(("alloc", ("setup", i), nbytes, 0))
        out.extend(("free", ("setup", j)) for j in frees.get(i, ()) if not names[j].startswith("moved."))
    return out + run_requests(plan, STEPS, training.grad_accum_steps)


def _real_fsdp1_events(training: TrainingSpec, world: int, rank: int, strategy: str, keep_marks: bool = False,
                       orig_params: bool = True) -> list[tuple[bool, object, int]]:
    """``rank`` of a real CPU run on the fake process group: the model built on the host, wrapped as
    ``harness.fake.wrap.wrap_model`` wraps it, then ``STEPS`` steps. Resized flat parameters are recorded as
    blocks (``StorageResizes``); setup's full flat parameter as freed where ``shard`` resizes its storage to 0
    (without use_orig_params the modules' views keep the storage object, not its memory, to the first forward).
    Left out: the host tensors (the model as built, which a GPU run copies in; FSDP's dtype-size probe, made on the
    default device), Adam's host-side step counters, zero-byte storages and what the run's end frees."""
    import torch
    from torch.distributed.fsdp import _flat_param as flat_param_mod
    from transformers import masking_utils

    from estimator.profiler import build
    from estimator.profiler.fake_pg import fake_process_group
    from estimator.profiler.trace import StorageRecorder
    from harness.fake.wrap import build_method_optimizer, build_training, make_mesh, wrap_model

    spec = _spec("tiny", training, world, strategy, orig_params)
    rec = StorageRecorder()
    resizes = StorageResizes(rec)
    alloc_storage, free_storage = flat_param_mod._alloc_storage, flat_param_mod._free_storage

    def alloc_recorded(tensor, size):
        resizes.allocated(tensor, size.numel() * tensor.itemsize)
        alloc_storage(tensor, size)

    def free_recorded(tensor):
        resizes.freed(tensor)
        free_storage(tensor)

    handle_cls = flat_param_mod.FlatParamHandle
    get_shard = handle_cls.__dict__["_get_shard"]

    def get_shard_recorded(tensor, shard_rank, shard_world):
        # ``shard`` resizes the full flat parameter's storage to 0 as this returns (no allocation between), which
        # frees its memory while, without use_orig_params, the modules' views still hold the storage object
        shard = get_shard.__func__(tensor, shard_rank, shard_world)
        resizes.freed(tensor)
        return shard

    ignore_mask = masking_utils._ignore_causal_mask_sdpa
    nf4 = build.NF4
    if training.qlora:  # fsdp_qlora's Linear4bit(quant_storage=torch_dtype): packed values FSDP1 can flatten
        build.NF4 = {**nf4, "quant_storage": build.param_dtype(training.precision)}
    masking_utils._ignore_causal_mask_sdpa = lambda padding_mask, *a, **k: ignore_mask(None, *a, **k)
    flat_param_mod._alloc_storage, flat_param_mod._free_storage = alloc_recorded, free_recorded
    handle_cls._get_shard = staticmethod(get_shard_recorded)
    try:
        with fake_process_group(rank, world, ("test_reserved_fsdp1", rank, world)):
            mesh = make_mesh(spec, "cpu")
            torch.manual_seed(0)
            model = build.build_model(LLAMA, build_training(spec), "cpu")
            held = build.HeldOutputs(training.loop, training.outputs_fp32)
            with rec:
                for p in model.parameters():
                    rec.track(p)
                rec.mark("wrap")
                model = wrap_model(model, spec, mesh, LLAMA, fake=True, device="cpu")
                optimizer = build_method_optimizer(model, spec)
                for _ in range(STEPS):
                    for micro in range(training.grad_accum_steps):
                        batch = build.synthetic_batch(training.micro_batch_size, S, 1000)
                        # grad_sync last: no_sync() on every micro-batch but the last, as accelerate runs it
                        unsynced = training.grad_sync == "last" and micro < training.grad_accum_steps - 1
                        with model.no_sync() if unsynced else contextlib.nullcontext():
                            build.forward_backward(model, batch, training, held=held)
                    rec.mark("optimizer")
                    optimizer.step()
                    rec.mark("zero_grad")
                    optimizer.zero_grad(set_to_none=True)
                rec.mark("end")
    finally:
        masking_utils._ignore_causal_mask_sdpa = ignore_mask
        build.NF4 = nf4
        flat_param_mod._alloc_storage, flat_param_mod._free_storage = alloc_storage, free_storage
        handle_cls._get_shard = get_shard
    events, sizes = rec.timeline.events, rec.timeline.sizes
    host, phase = set(), None
    marks = [i for i, e in enumerate(events) if e[0] == "m"]
    for i in range(marks[0] + 1, len(events) - 1):  # the dtype-size probe: a scalar dropped at once
        if events[i][0] == "a" and events[i][2] <= 4 and events[i + 1] == ("f", events[i][1]):
            host.add(events[i][1])
    out: list[tuple[bool, object, int]] = []
    for event in events:
        if event[0] == "m":
            phase = event[1]
            if phase == "end":
                break
            if keep_marks:
                out.append(("m", phase, 0))
            continue
        if event[0] == "a":
            if phase is None or event[2] == 0 or (phase == "optimizer" and event[2] == 4) or event[1] in host:
                host.add(event[1])
                continue
            out.append((True, event[1], event[2]))
        elif event[1] not in host:
            out.append((False, event[1], sizes[event[1]]))
    return out


@pytest.mark.parametrize("precision, world, rank, ckpt, strategy", [
    ("mixed_bf16", 2, 0, False, "FULL_SHARD"),
    ("bf16", 3, 2, False, "FULL_SHARD"),  # padded flat parameters (zeros in backward), the last rank's pieces
    ("mixed_bf16", 2, 0, False, "SHARD_GRAD_OP"),  # layers unsharded from forward to post-backward
    ("mixed_bf16", 2, 1, False, "NO_SHARD"),  # the flat parameter kept whole, its 16-bit copy made per use
    ("bf16", 4, 3, False, "HYBRID_SHARD:2"),  # sharded within a node of 2, the last rank of the second node
    pytest.param("fp32", 3, 2, True, "NO_SHARD", marks=pytest.mark.slow),
    pytest.param("fp32", 4, 0, False, "FULL_SHARD", marks=pytest.mark.slow),
    pytest.param("mixed_bf16", 3, 0, False, "FULL_SHARD", marks=pytest.mark.slow),
    pytest.param("bf16", 4, 3, True, "FULL_SHARD", marks=pytest.mark.slow),
    pytest.param("bf16", 3, 2, True, "SHARD_GRAD_OP", marks=pytest.mark.slow),
    # every-k (``ckpt`` the policy): the merged event list, FSDP1's events at its segment boundaries
    pytest.param("mixed_bf16", 2, 0, "every-k:2", "FULL_SHARD", marks=pytest.mark.slow),
    pytest.param("bf16", 3, 2, "every-k:3", "FULL_SHARD", marks=pytest.mark.slow),
    pytest.param("fp32", 2, 1, "every-k:2", "SHARD_GRAD_OP", marks=pytest.mark.slow),
], ids=lambda v: str(v))
def test_generated_stream_equals_a_real_fsdp1_run(llama_path, precision, world, rank, ckpt, strategy):
    """Setup and three steps: the same allocations in the same order, the same tensors freed between two."""
    training = TrainingSpec(precision=precision, attn="eager", micro_batch_size=B, seq_len=S, grad_ckpt=bool(ckpt),
                            ckpt_policy=ckpt if isinstance(ckpt, str) else "")
    generated = _runs(_generated(llama_path, training, world, rank, strategy), True)
    real = _runs(_in_fresh_process(_real_fsdp1_events, training, world, rank, strategy), False)
    _assert_same_runs(generated, real)


@pytest.mark.parametrize("precision, world, rank, ckpt, strategy", [
    # liger_kernel's rows: mixed_bf16, non-reentrant checkpointing, 4 ranks
    ("mixed_bf16", 4, 0, True, "FULL_SHARD+prefetch"),
    ("bf16", 3, 2, False, "FULL_SHARD+prefetch"),  # padded flat parameters, the last rank
    pytest.param("fp32", 2, 1, True, "FULL_SHARD+prefetch", marks=pytest.mark.slow),
    pytest.param("mixed_bf16", 2, 0, False, "SHARD_GRAD_OP+prefetch", marks=pytest.mark.slow),
    pytest.param("bf16", 4, 3, True, "HYBRID_SHARD:2+prefetch", marks=pytest.mark.slow),
], ids=lambda v: str(v))
def test_forward_prefetch_stream_equals_a_real_fsdp1_run(llama_path, precision, world, rank, ckpt, strategy):
    """``forward_prefetch``: from the second step each pre-forward gathers the next unit after its own, and each
    layer's post-backward comes one layer later; the first step (no pre-forward order recorded yet) gathers each
    unit in its own pre-forward. Setup and three steps, as above."""
    training = TrainingSpec(precision=precision, attn="eager", micro_batch_size=B, seq_len=S, grad_ckpt=ckpt)
    generated = _runs(_generated(llama_path, training, world, rank, strategy), True)
    real = _runs(_in_fresh_process(_real_fsdp1_events, training, world, rank, strategy), False)
    _assert_same_runs(generated, real)


@pytest.mark.parametrize("precision, world, rank, ckpt, strategy", [
    ("bf16", 2, 0, False, "FULL_SHARD"),  # a frozen embedding: layer 0 resharded after the root, at backward's end
    ("bf16", 2, 1, True, "FULL_SHARD"),  # the recompute gathers each adapter again, resharding a prefetched one
    pytest.param("fp32", 3, 2, False, "FULL_SHARD", marks=pytest.mark.slow),  # padded adapters; input-buffer sums
    pytest.param("fp32", 3, 2, True, "FULL_SHARD", marks=pytest.mark.slow),
    pytest.param("bf16", 4, 3, False, "HYBRID_SHARD:2", marks=pytest.mark.slow),
], ids=lambda v: str(v))
def test_lora_stream_equals_a_real_fsdp1_run(llama_path, precision, world, rank, ckpt, strategy):
    """LoRA as the HF Trainer wraps a PEFT model (peft's ``fsdp_auto_wrap_policy``: each lora_A / lora_B Linear
    its own unit inside its frozen decoder layer's): the adapters' gathers around their forward (and the
    recompute), their pre-backward prefetches, each adapter's post-backward as its gradient is made, the
    optimizer over the adapters' pieces. Setup and three steps, as above."""
    training = TrainingSpec(precision=precision, attn="eager", micro_batch_size=B, seq_len=S, grad_ckpt=ckpt,
                            lora_rank=8)
    generated = _runs(_generated(llama_path, training, world, rank, strategy), True)
    real = _runs(_in_fresh_process(_real_fsdp1_events, training, world, rank, strategy), False)
    _assert_same_runs(generated, real)


@pytest.mark.parametrize("training, world, rank, strategy", [
    (TrainingSpec(precision="mixed_bf16", grad_accum_steps=3), 2, 0, "FULL_SHARD"),
    (TrainingSpec(precision="bf16", lora_rank=8, grad_ckpt=True, grad_accum_steps=2), 3, 2, "FULL_SHARD"),
    pytest.param(TrainingSpec(precision="bf16", grad_accum_steps=2), 3, 2, "SHARD_GRAD_OP", marks=pytest.mark.slow),
    pytest.param(TrainingSpec(precision="mixed_bf16", grad_ckpt=True, grad_accum_steps=2), 4, 3, "HYBRID_SHARD:2",
                 marks=pytest.mark.slow),
    # no_sync on all but the last micro-batch (accelerate's and the HF Trainer's way)
    (TrainingSpec(precision="mixed_bf16", grad_accum_steps=3, grad_sync="last"), 2, 0, "FULL_SHARD"),
    pytest.param(TrainingSpec(precision="bf16", grad_accum_steps=2, grad_sync="last"), 2, 0, "FULL_SHARD",
                 marks=pytest.mark.slow),
    pytest.param(TrainingSpec(precision="fp32", grad_ckpt=True, grad_accum_steps=2, grad_sync="last"), 3, 2,
                 "FULL_SHARD", marks=pytest.mark.slow),  # 1-D tensors wholly in the shard: their views as they are
    pytest.param(TrainingSpec(precision="mixed_bf16", grad_ckpt=True, grad_accum_steps=2, grad_sync="last"), 4, 3,
                 "HYBRID_SHARD:2", marks=pytest.mark.slow),
], ids=lambda v: str(v) if not isinstance(v, TrainingSpec) else
   f"{v.precision}-lora{v.lora_rank}-ckpt{int(v.grad_ckpt)}-k{v.grad_accum_steps}-{v.grad_sync}")
def test_gradient_accumulation_stream_equals_a_real_fsdp1_run(llama_path, training, world, rank, strategy):
    """Three optimizer steps of k micro-batches. ``grad_sync`` every (each micro-batch reduce-scatters): the
    cycle's first new shards are kept, a later micro-batch's are added into them and freed in its post-backward,
    the next cycle's first root pre-forward drops them. ``grad_sync`` last (``no_sync()`` but on the last): the
    flat gradients are held from the cycle's first micro-batch (each tensor without a gradient given
    ``empty_like`` itself before its view), a middle one's added and dropped, the last reduces them."""
    training = dataclasses.replace(training, attn="eager", micro_batch_size=B, seq_len=S)
    generated = _runs(_generated(llama_path, training, world, rank, strategy), True)
    real = _runs(_in_fresh_process(_real_fsdp1_events, training, world, rank, strategy), False)
    _assert_same_runs(generated, real)


@pytest.mark.parametrize("training, world, strategy", [
    (TrainingSpec(precision="mixed_bf16"), 2, "FULL_SHARD"),
    (TrainingSpec(precision="bf16", lora_rank=8), 2, "FULL_SHARD"),
    (TrainingSpec(precision="mixed_bf16", grad_accum_steps=2), 2, "FULL_SHARD"),
    (TrainingSpec(precision="bf16", lora_rank=8, grad_ckpt=True, grad_accum_steps=3), 3, "FULL_SHARD"),
    (TrainingSpec(precision="fp32", grad_accum_steps=4, loop="manual"), 4, "HYBRID_SHARD:2"),
    (TrainingSpec(precision="mixed_bf16", grad_accum_steps=3, grad_sync="last"), 2, "FULL_SHARD"),
    (TrainingSpec(precision="bf16", grad_accum_steps=2, grad_sync="last", loop="manual"), 4, "HYBRID_SHARD:2"),
    (TrainingSpec(precision="fp32", lora_rank=8, grad_ckpt=True), 3, "FULL_SHARD"),
    (TrainingSpec(precision="bf16"), 3, "FULL_SHARD"),
    (TrainingSpec(precision="fp32", grad_ckpt=True), 4, "FULL_SHARD"),
    (TrainingSpec(precision="mixed_bf16", loop="manual"), 2, "FULL_SHARD"),
    (TrainingSpec(precision="mixed_bf16"), 3, "SHARD_GRAD_OP"),
    (TrainingSpec(precision="bf16", grad_ckpt=True), 2, "SHARD_GRAD_OP"),
    (TrainingSpec(precision="mixed_bf16"), 2, "NO_SHARD"),
    (TrainingSpec(precision="bf16"), 3, "NO_SHARD"),
    (TrainingSpec(precision="mixed_bf16"), 4, "HYBRID_SHARD:2"),
    # every-k: the merged event list with FSDP1's events at its segment boundaries
    (TrainingSpec(precision="mixed_bf16", grad_ckpt=True, ckpt_policy="every-k:2"), 2, "FULL_SHARD"),
    (TrainingSpec(precision="bf16", grad_ckpt=True, ckpt_policy="every-k:3"), 3, "FULL_SHARD"),
    (TrainingSpec(precision="fp32", grad_ckpt=True, ckpt_policy="every-k:2", grad_accum_steps=2), 4, "FULL_SHARD"),
    (TrainingSpec(precision="mixed_bf16", grad_ckpt=True, ckpt_policy="every-k:3"), 2, "SHARD_GRAD_OP"),
    (TrainingSpec(precision="bf16", grad_ckpt=True, ckpt_policy="every-k:2"), 4, "HYBRID_SHARD:2"),
    # forward prefetch: the next layer gathered in each pre-forward, the post-backwards a layer later
    (TrainingSpec(precision="mixed_bf16", grad_ckpt=True), 4, "FULL_SHARD+prefetch"),
    (TrainingSpec(precision="bf16"), 3, "FULL_SHARD+prefetch"),
])
def test_fsdp1_replayed_allocated_level_equals_the_estimate(llama_path, training, world, strategy):
    """The requested bytes alive at once in the replayed stream = the estimator's FSDP1 allocated peak + the
    batch, to the byte, on the first and the last rank; the reserved level is the replay's."""
    _assert_replayed_allocated_level(llama_path, training, world, strategy, True)


@pytest.mark.parametrize("training, world, strategy", [
    (TrainingSpec(precision="mixed_bf16"), 2, "FULL_SHARD"),
    (TrainingSpec(precision="bf16"), 3, "FULL_SHARD"),
    (TrainingSpec(precision="bf16", lora_rank=8, grad_ckpt=True, lora_targets=ALL_SIX), 3, "FULL_SHARD"),
    pytest.param(TrainingSpec(precision="fp32", grad_ckpt=True), 4, "FULL_SHARD", marks=pytest.mark.slow),
    pytest.param(TrainingSpec(precision="bf16", lora_rank=8), 2, "FULL_SHARD", marks=pytest.mark.slow),
    pytest.param(TrainingSpec(precision="bf16", lora_rank=8, grad_ckpt=True), 3, "FULL_SHARD", marks=pytest.mark.slow),
    pytest.param(TrainingSpec(precision="mixed_bf16", loop="manual"), 3, "SHARD_GRAD_OP", marks=pytest.mark.slow),
    pytest.param(TrainingSpec(precision="bf16"), 3, "NO_SHARD", marks=pytest.mark.slow),
    pytest.param(TrainingSpec(precision="mixed_bf16"), 4, "HYBRID_SHARD:2", marks=pytest.mark.slow),
    (TrainingSpec(precision="mixed_bf16", grad_accum_steps=2), 4, "FULL_SHARD"),
])
def test_flat_parameter_replayed_allocated_level_equals_the_estimate(llama_path, training, world, strategy):
    """``use_orig_params=False``, as above."""
    _assert_replayed_allocated_level(llama_path, training, world, strategy, False)


@pytest.mark.parametrize("training, world, orig_params", [
    (TrainingSpec(precision="mixed_bf16"), 4, True),  # the H200 row's settings (15898dcca26c5b27)
    (TrainingSpec(precision="bf16"), 3, False),
    # the answerai fsdp_qlora row's: pure bf16, LoRA on the six Linears, checkpointing, flat parameters
    (TrainingSpec(precision="bf16", lora_rank=8, grad_ckpt=True, lora_targets=ALL_SIX), 2, False),
    (TrainingSpec(precision="fp32", grad_ckpt=True), 2, True),
])
def test_cpu_offload_replayed_allocated_level_equals_the_estimate(llama_path, training, world, orig_params):
    """CPU offload: the shards, their gradients and the step on the host; each gather's device copy of the host
    shard (cast to 16 bits under mixed precision) and the new shards held to backward's end are transient, so the
    replay's allocated level is the estimator's."""
    _assert_replayed_allocated_level(llama_path, training, world, "FULL_SHARD", orig_params, cpu_offload=True)


def _qlora(**fields) -> TrainingSpec:
    """answer.ai fsdp_qlora's recipe: NF4 on every Linear of the decoder, everything else and the adapters bf16 (no
    kbit preparation), LoRA on the six Linears its ``all`` names."""
    return TrainingSpec(**{"precision": "bf16", "lora_rank": 8, "qlora": True, "lora_dtype": "model",
                           "lora_targets": ALL_SIX, **fields})


@pytest.mark.slow
@pytest.mark.parametrize("training, world, rank", [
    (_qlora(), 2, 0),
    (_qlora(grad_ckpt=True), 2, 0),  # the published rows' checkpointing: the recompute dequantizes again
    (_qlora(grad_ckpt=True), 3, 2),  # short chunks of the packed flat parameters, the last rank
], ids=lambda v: str(v) if not isinstance(v, TrainingSpec) else f"qlora-ckpt{int(v.grad_ckpt)}")
def test_qlora_stream_equals_a_real_fsdp1_run(llama_path, training, world, rank):
    """QLoRA as fsdp_qlora runs it (bitsandbytes ``Linear4bit`` NF4 with ``quant_storage`` bf16, so each layer's
    packed weights are ``numel / 4`` bf16 elements of its flat parameter; peft's wrap policy, use_orig_params
    false, FULL_SHARD): the packed units' setup, gathers and reshards, the adapters' units, and the dequantized
    copies each ``MatMul4Bit`` makes in forward, recompute and backward (the profile's trace). The quant states are
    made when the CPU run builds the model, before wrapping, so the comparison leaves them out as it leaves out the
    moved tensors; ``test_qlora_replayed_allocated_level_equals_the_estimate`` counts them. Setup and three steps."""
    training = dataclasses.replace(training, attn="eager", micro_batch_size=B, seq_len=S)
    generated = _runs(_generated(llama_path, training, world, rank, "FULL_SHARD", False), True)
    real = _runs(_in_fresh_process(_real_fsdp1_events, training, world, rank, "FULL_SHARD", False, False), False)
    _assert_same_runs(generated, real)


@pytest.mark.slow
@pytest.mark.parametrize("training, world, cpu_offload", [
    (_qlora(grad_ckpt=True), 2, False),
    (_qlora(), 3, False),
    (_qlora(grad_ckpt=True), 2, True),  # the quant states stay on the device, the packed shards go to the host
])
def test_qlora_replayed_allocated_level_equals_the_estimate(llama_path, training, world, cpu_offload):
    """The quant states, one setup block per packed weight kept whole on every rank, are the estimate's
    ``Fsdp1Sizes.quant_state_bytes``: the replay's allocated level is the estimator's, to the byte."""
    _assert_replayed_allocated_level(llama_path, training, world, "FULL_SHARD", False, cpu_offload=cpu_offload)


@pytest.mark.slow
def test_qlora_with_orig_params_keeps_the_prior(llama_path):
    """fsdp_qlora's flat parameters are what the real run checks; use_orig_params is not."""
    training = _qlora(micro_batch_size=B, seq_len=S)
    est = api.estimate(_spec(llama_path, training, 2, orig_params=True), alloc_conf="")
    assert est.reserved_source == "prior"
    assert any(n.startswith("reserved: prior") and "QLoRA and use_orig_params" in n for n in est.notes)
    assert api.estimate(_spec(llama_path, training, 2, orig_params=False), alloc_conf="").reserved_source == "replayed"


def _assert_replayed_allocated_level(llama_path: str, training: TrainingSpec, world: int, strategy: str,
                                     orig_params: bool, cpu_offload: bool = False) -> None:
    training = dataclasses.replace(training, micro_batch_size=B, seq_len=S)
    spec = _spec(llama_path, training, world, strategy, orig_params, cpu_offload)
    est = api.estimate(spec, alloc_conf="")
    arch, profile = load_profile(llama_path, training)
    coeffs = load_coefficients(est.gpu_key)
    for rank in est.ranks:
        replayed = reserved_rank.replay_reserved(
            spec, profile, api._regime(profile, B, S), api._param_table(profile, arch.num_layers), arch.num_layers,
            workspace_bytes=coeffs.cublas_workspace_bytes, workspaces=coeffs.cublas_workspaces, allowed_bytes=None,
            conf_text="", rank=rank.rank)
        # the estimate adds the replay's block rounding (what max_memory_allocated counts beyond the requests)
        rounding = rank.breakdown.get("allocator_rounding", 0)
        assert rounding == replayed.peak_allocated_bytes - replayed.peak_requested_bytes
        assert replayed.peak_requested_bytes == rank.peak_allocated_bytes - rounding + 3 * B * S * INT64
        assert rank.reserved_source == "replayed" and replayed.steady
        assert rank.peak_reserved_bytes == replayed.peak_reserved_bytes >= replayed.peak_allocated_bytes


def test_other_fsdp1_settings_keep_the_prior(llama_path):
    training = TrainingSpec(precision="mixed_bf16", micro_batch_size=B, seq_len=S)
    for options, steps, reason in ((Fsdp1Spec(use_orig_params=False), 2, "use_orig_params"),
                                   (Fsdp1Spec(backward_prefetch="BACKWARD_POST"), 1, "prefetching"),
                                   (Fsdp1Spec(forward_prefetch=True), 2, "forward prefetch")):
        # the flat gradients held under no_sync without use_orig_params (reducing every micro-batch is replayed)
        spec = RunSpec(model=llama_path, training=dataclasses.replace(training, grad_accum_steps=steps,
                                                                      grad_sync="last" if steps > 1 else "every"),
                       parallel=ParallelSpec(method="fsdp1", world_size=2, fsdp1=options))
        est = api.estimate(spec, alloc_conf="")
        assert est.reserved_source == "prior"
        assert any(n.startswith("reserved: prior") and reason in n for n in est.notes)
    accumulating = api.estimate(_spec(llama_path, dataclasses.replace(training, grad_accum_steps=2), 2, "NO_SHARD"),
                                alloc_conf="")
    assert accumulating.reserved_source == "prior"
    assert any(n.startswith("reserved: prior") and "accumulation" in n for n in accumulating.notes)
    unsynced = api.estimate(_spec(llama_path, dataclasses.replace(training, grad_accum_steps=2, grad_sync="last"), 2,
                                  "SHARD_GRAD_OP"), alloc_conf="")
    assert unsynced.reserved_source == "prior"
    assert any(n.startswith("reserved: prior") and "no_sync" in n for n in unsynced.notes)
    for offloaded, reason in ((dataclasses.replace(training, grad_ckpt=True), "CPU offload, mixed precision"),
                              (dataclasses.replace(training, grad_accum_steps=2), "CPU offload under gradient"),
                              (training, "CPU offload under SHARD_GRAD_OP")):
        strategy = "SHARD_GRAD_OP" if "SHARD_GRAD_OP" in reason else "FULL_SHARD"
        spec = RunSpec(model=llama_path, training=offloaded, parallel=ParallelSpec(
            method="fsdp1", world_size=2, fsdp1=Fsdp1Spec(sharding_strategy=strategy, cpu_offload=True)))
        est = api.estimate(spec, alloc_conf="")
        assert est.reserved_source == "prior"
        assert any(n.startswith("reserved: prior") and reason in n for n in est.notes)
    lora = dataclasses.replace(training, precision="bf16", lora_rank=8)
    kept = api.estimate(_spec(llama_path, lora, 2, "SHARD_GRAD_OP"), alloc_conf="")
    assert kept.reserved_source == "prior"
    assert any(n.startswith("reserved: prior") and "LoRA" in n for n in kept.notes)


def _flat(**fields) -> TrainingSpec:
    return TrainingSpec(**{"micro_batch_size": B, **fields})


@pytest.mark.slow
@pytest.mark.parametrize("training, world, rank, strategy, orig_params", [
    (_flat(precision="mixed_bf16"), 2, 0, "FULL_SHARD", False),
    (_flat(precision="bf16"), 3, 2, "FULL_SHARD", False),  # short chunks: padded at setup and before each reduce
    (_flat(precision="bf16", lora_rank=8, grad_ckpt=True), 2, 1, "FULL_SHARD", False),
    # the recompute stops after down_proj's lora_A: lora_B's pre-backward before it, no gather of lora_B in it
    (_flat(precision="bf16", lora_rank=8, grad_ckpt=True, lora_targets=ALL_SIX), 2, 0, "FULL_SHARD", False),
    (_flat(precision="bf16", lora_rank=8, grad_ckpt=True, lora_targets=ALL_SIX), 2, 0, "FULL_SHARD", True),
    # one row: the b = 1 regime's sizes are fitted in s alone
    (_flat(precision="bf16", lora_rank=8, grad_ckpt=True, lora_targets=ALL_SIX, micro_batch_size=1), 2, 0,
     "FULL_SHARD", False),
    (_flat(precision="mixed_bf16"), 3, 2, "SHARD_GRAD_OP", False),
    (_flat(precision="bf16"), 2, 1, "NO_SHARD", False),
    (_flat(precision="bf16", grad_ckpt=True), 4, 3, "HYBRID_SHARD:2", False),
    # accumulation reducing every micro-batch: the kept new shards are .grad, zero_grad frees them
    (_flat(precision="mixed_bf16", grad_accum_steps=2), 4, 3, "FULL_SHARD", False),
    (_flat(precision="bf16", grad_accum_steps=3), 3, 2, "FULL_SHARD", False),
], ids=lambda v: str(v) if not isinstance(v, TrainingSpec) else
   f"{v.precision}-lora{v.lora_rank}-{v.lora_targets}-ckpt{int(v.grad_ckpt)}-b{v.micro_batch_size}-k{v.grad_accum_steps}")
def test_flat_parameter_stream_equals_a_real_fsdp1_run(llama_path, training, world, rank, strategy, orig_params):
    """``use_orig_params=False``: the flat parameter unpadded, a short chunk padded (setup's shard, the
    reduce-scatter's input), the optimizer stepping the flat shards, ``zero_grad`` freeing them. Setup and three
    steps, as above. With LoRA on every Linear of the MLP the checkpointed recompute stops early (either way)."""
    training = dataclasses.replace(training, attn="eager", seq_len=S)
    generated = _runs(_generated(llama_path, training, world, rank, strategy, orig_params), True)
    real = _runs(_in_fresh_process(_real_fsdp1_events, training, world, rank, strategy, False, orig_params), False)
    _assert_same_runs(generated, real)
