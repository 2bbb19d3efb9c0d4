"""The CPU oracle (harness.fake.trace_run) on small configs: sane per-rank invariants, repeatability, errors.

Fast tests use an opt-125m-wide copy with 2 layers (b=2, s=128) and tiny configs of each TP family.
Slow tests (-m slow) trace full-size catalogue models and run the real 2-process gloo TP parity check.
"""

import json
import os
import subprocess
import sys

import pytest

from estimator.models.arch import load_config
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec
from tests.oracle.tiny import FAMILIES, tiny_config

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from estimator.models.tp_plans import param_shard_dim  # noqa: E402
from estimator.profiler.build import build_model, with_num_layers  # noqa: E402
from harness.fake import trace_run  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")  # OPT layers return a view; harmless

OPT = "facebook/opt-125m"
TRAIN = TrainingSpec(micro_batch_size=2, seq_len=128, precision="fp32")
PHASE_KEYS = {"forward", "backward", "optimizer", "peak"}


def _spec(method, ws=1, tp=1, model=OPT, training=TRAIN):
    return RunSpec(model=model, parallel=ParallelSpec(method=method, world_size=ws, tp=tp), training=training)


def _expected_local_numel(config, training, tp):
    """Parameters one TP rank holds, from estimator.models.tp_plans.param_shard_dim over the meta model."""
    model = build_model(config, training, "cpu", meta=True)
    return sum(p.numel() // tp if param_shard_dim(config["model_type"], n, tp) is not None else p.numel()
               for n, p in model.named_parameters())


def _param_bytes(config, training):
    model = build_model(config, training, "cpu", meta=True)
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


@pytest.fixture(scope="module")
def opt2():
    return with_num_layers(load_config(OPT), 2)


@pytest.fixture(scope="module")
def traces(opt2):
    out = {}
    for method, ws, tp in (("single", 1, 1), ("ddp", 2, 1), ("fsdp", 2, 1), ("tp", 2, 2)):
        out[method] = trace_run(_spec(method, ws, tp), config=opt2)
    return out


def test_result_shape(traces):
    for method, result in traces.items():
        assert result["measured_by"] == "fake_tensor_trace"
        assert isinstance(result["trace_s"], float) and result["notes"]
        expected_ranks = [0] if method == "single" else [0, 1]
        assert sorted(result["per_rank"]) == expected_ranks
        for rec in result["per_rank"].values():
            assert len(rec["step_peaks"]) == 2
            for step in rec["step_peaks"]:
                assert set(step) == PHASE_KEYS
                assert step["peak"] == max(step["forward"], step["backward"], step["optimizer"])
            assert rec["peak_allocated_bytes"] > 0
            # the breakdown is a copy of the category totals at that peak: it sums to it
            assert sum(rec["breakdown_at_peak"].values()) == rec["peak_allocated_bytes"]
    assert not torch.distributed.is_initialized()


def test_symmetric_ranks_agree(traces):
    for method in ("ddp", "fsdp", "tp"):
        ranks = traces[method]["per_rank"]
        assert ranks[0]["step_peaks"] == ranks[1]["step_peaks"], method


def test_single_step_two_holds_adam_state(traces, opt2):
    rec = traces["single"]["per_rank"][0]
    param_bytes = _param_bytes(opt2, TRAIN)
    # step 2 starts with two fp32 AdamW states per parameter; foreach AdamW adds ~one param copy of temps
    assert rec["step_peaks"][1]["peak"] >= rec["step_peaks"][0]["peak"]
    assert rec["breakdown_at_peak"]["Optstate"] >= 2 * param_bytes
    assert rec["breakdown_at_peak"]["Parameter"] >= param_bytes


def test_ddp_adds_gradient_buckets(traces, opt2):
    single = traces["single"]["per_rank"][0]["peak_allocated_bytes"]
    ddp = traces["ddp"]["per_rank"][0]
    buckets = _param_bytes(opt2, TRAIN)  # gradient_as_bucket_view=False: buckets hold a copy of every grad
    assert ddp["peak_allocated_bytes"] >= single + buckets
    assert ddp["breakdown_at_peak"]["DDP Bucket"] >= buckets
    assert ddp["local_param_numel"] == traces["single"]["per_rank"][0]["local_param_numel"]


def test_fsdp_shards_and_saves_memory(traces):
    single = traces["single"]["per_rank"][0]
    fsdp = traces["fsdp"]["per_rank"][0]
    assert fsdp["peak_allocated_bytes"] < single["peak_allocated_bytes"]
    full = single["local_param_numel"]
    assert full / 2 <= fsdp["local_param_numel"] <= full / 2 + 2 * 64  # dim-0 padding only
    assert fsdp["peak_step"] == 2
    assert any("steady state" in note for note in traces["fsdp"]["notes"])
    # DTensor metadata propagation is not counted: step 1 no longer depends on which trace ran first
    assert fsdp["step_peaks"][0]["peak"] <= fsdp["step_peaks"][1]["peak"]


def test_tp_splits_params(traces, opt2):
    tp = traces["tp"]["per_rank"][0]
    assert tp["local_param_numel"] == _expected_local_numel(opt2, TRAIN, 2)
    assert tp["local_param_numel"] < traces["single"]["per_rank"][0]["local_param_numel"]
    assert tp["peak_allocated_bytes"] < traces["single"]["per_rank"][0]["peak_allocated_bytes"]


def test_trace_run_is_repeatable(traces, opt2):
    again = trace_run(_spec("fsdp", 2), config=opt2)
    for rank in (0, 1):
        assert again["per_rank"][rank]["step_peaks"] == traces["fsdp"]["per_rank"][rank]["step_peaks"]
    assert not torch.distributed.is_initialized()


def test_dp_tp_and_lora_and_precisions(opt2):
    lora = TrainingSpec(micro_batch_size=1, seq_len=64, precision="mixed_bf16", lora_rank=8, grad_ckpt=True)
    result = trace_run(_spec("dp_tp", 4, 2, training=lora), [3], config=opt2)
    rec = result["per_rank"][3]
    assert rec["peak_allocated_bytes"] > 0
    # LoRA: only adapters have gradients and optimizer state
    assert rec["breakdown_at_peak"].get("Optstate", 0) < rec["breakdown_at_peak"]["Parameter"] / 10
    for precision in ("mixed_fp16",):
        training = TrainingSpec(micro_batch_size=1, seq_len=64, precision=precision, attn="eager")
        assert trace_run(_spec("fsdp", 2, training=training), [1], config=opt2)["per_rank"][1][
            "peak_allocated_bytes"] > 0


def test_matches_torch_memtracker():
    from tests.oracle.crosscheck import memtracker_step2_peak

    config = tiny_config("llama", num_layers=2)
    for method, ws in (("single", 1), ("fsdp", 2)):
        spec = _spec(method, ws, model="llama-tiny", training=TrainingSpec(micro_batch_size=2, seq_len=64,
                                                                          precision="fp32"))
        ours = trace_run(spec, [0], config=config, round_to=1)["per_rank"][0]["step_peaks"][1]["peak"]
        assert ours == memtracker_step2_peak(spec, config), method


@pytest.mark.parametrize("family", FAMILIES)
def test_tp_every_family_on_two_fake_ranks(family):
    config = tiny_config(family, num_layers=2)
    training = TrainingSpec(micro_batch_size=1, seq_len=32, precision="bf16", attn="eager")
    result = trace_run(_spec("tp", 2, 2, model=family, training=training), [1], config=config, steps=1)
    rec = result["per_rank"][1]
    assert rec["local_param_numel"] == _expected_local_numel(config, training, 2)
    assert rec["step_peaks"][0]["optimizer"] > 0


def test_refusals_are_one_line_value_errors(opt2):
    with pytest.raises(ValueError, match="^method: .*DeepSpeed"):
        trace_run(_spec("zero2", 2))
    with pytest.raises(ValueError, match="^tp: gpt_bigcode with multi_query=True"):
        trace_run(_spec("tp", 2, 2, model="bigcode/gpt_bigcode-santacoder"))
    with pytest.raises(ValueError, match="^ranks: "):
        trace_run(_spec("ddp", 2), ranks=[2], config=opt2)
    assert not torch.distributed.is_initialized()


def test_cli(capsys):
    from harness.fake.__main__ import main

    assert main(["--model", "bigcode/gpt_bigcode-santacoder", "--method", "tp", "--gpus", "2"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: tp: ")
    assert main(["--model", OPT, "--method", "fsdp", "--gpus", "2", "--num-layers", "1", "--seq-len", "32",
                 "--precision", "bf16", "--ranks", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["per_rank"]) == ["1"] and out["measured_by"] == "fake_tensor_trace"


def test_import_has_no_side_effects():
    code = ("import sys, harness.fake; "
            "sys.exit(1 if 'torch' in sys.modules or 'torch.testing._internal.distributed.fake_pg' "
            "in sys.modules else 0)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True).returncode == 0


# ------------------------------------------------------------------------------------------------ slow

@pytest.mark.slow
def test_slow_full_size_opt13b_single():
    spec = _spec("single", model="facebook/opt-1.3b",
                 training=TrainingSpec(micro_batch_size=4, seq_len=512, precision="fp32"))
    rec = trace_run(spec)["per_rank"][0]
    params = 1_315_758_080 * 4
    # at the optimizer step: params + grads + 2 AdamW states + one foreach temporary copy
    assert abs(rec["peak_allocated_bytes"] - 5 * params) < 0.01 * params
    assert rec["peak_phase"] == "optimizer"


@pytest.mark.slow
def test_slow_full_size_llama7b_fsdp8():
    spec = _spec("fsdp", 8, model="huggyllama/llama-7b",
                 training=TrainingSpec(micro_batch_size=1, seq_len=512, precision="mixed_bf16"))
    result = trace_run(spec)
    r0, r7 = result["per_rank"][0], result["per_rank"][7]
    assert r0["step_peaks"] == r7["step_peaks"]
    sharded = 6_738_415_616 * 4 / 8
    assert r0["breakdown_at_peak"]["Parameter"] >= sharded
    assert r0["peak_allocated_bytes"] < 6_738_415_616 * 4  # far below one fp32 copy of the model


@pytest.mark.slow
def test_slow_full_size_llama31_8b_dp_tp():
    spec = _spec("dp_tp", 8, 2, model="meta-llama/Llama-3.1-8B",
                 training=TrainingSpec(micro_batch_size=1, seq_len=1024, precision="bf16", grad_ckpt=True))
    result = trace_run(spec)
    assert result["per_rank"][0]["step_peaks"] == result["per_rank"][7]["step_peaks"]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["meta-llama/Llama-3.2-1B", "mistralai/Mistral-7B-v0.1", "Qwen/Qwen2.5-0.5B",
                                   "facebook/opt-125m", "microsoft/BioGPT-Large", "EleutherAI/gpt-neo-1.3B",
                                   "EleutherAI/pythia-1b", "bigscience/bloom-560m", "Salesforce/codegen-350M-nl"])
def test_slow_tp_catalogue_three_layer_copies(model):
    config = with_num_layers(load_config(model), 3)
    tp = 5 if config["model_type"] == "biogpt" else 2  # BioGPT-Large has 25 heads
    training = TrainingSpec(micro_batch_size=1, seq_len=256, precision="bf16")
    result = trace_run(_spec("tp", tp, tp, model=model, training=training), config=config)
    assert result["per_rank"][0]["local_param_numel"] == _expected_local_numel(config, training, tp)
    assert result["per_rank"][0]["step_peaks"] == result["per_rank"][tp - 1]["step_peaks"]


@pytest.mark.slow
def test_slow_tp_loss_matches_single_process_on_gloo(tmp_path):
    """Real 2-process gloo run (torchrun): TP losses over 3 AdamW steps equal the single-process losses."""
    out = tmp_path / "parity.json"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    names = list(FAMILIES) + ["llama:lora", "opt:lora", "codegen:lora"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29537",
           os.path.join(root, "tests", "oracle", "tp_parity_worker.py"), str(out), *names]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for name in names:
        tp_losses, single = result[name]["tp"], result[name]["single"]
        assert max(abs(a - b) for a, b in zip(tp_losses, single)) < 1e-4, (name, tp_losses, single)
        assert result[name]["local_numel"] < result[name]["full_numel"]


def test_attention_and_checkpointing_change_activations():
    config = tiny_config("llama", num_layers=4)

    def forward_peak(precision="bf16", **kw):
        # bf16: CUDA's flash kernel (fp32 with grouped-query heads runs the math kernel: eager's memory)
        training = TrainingSpec(micro_batch_size=4, seq_len=256, precision=precision, **kw)
        rec = trace_run(_spec("single", model="llama-tiny", training=training), config=config, steps=1)
        return rec["per_rank"][0]["step_peaks"][0]["forward"]

    sdpa, eager = forward_peak(attn="sdpa"), forward_peak(attn="eager")
    assert eager > 1.5 * sdpa  # eager keeps the (b, heads, s, s) attention probabilities per layer
    # checkpointing keeps only the layer inputs (fp32: activations, not bf16 weights, dominate the forward)
    assert forward_peak("fp32", grad_ckpt=True) < 0.5 * forward_peak("fp32", attn="sdpa")   # checkpointing keeps only the layer inputs


@pytest.mark.parametrize("method, ws, tp, family, options", [
    ("single", 1, 1, "llama", dict(precision="fp32")),
    ("ddp", 2, 1, "opt", dict(precision="mixed_bf16", attn="eager", grad_accum_steps=2)),
    ("fsdp", 2, 1, "llama", dict(precision="amp_bf16", grad_ckpt=True, lora_rank=4)),
    ("tp", 2, 2, "bloom", dict(precision="bf16")),
    ("dp_tp", 4, 2, "gpt_neox", dict(precision="mixed_fp16", attn="eager")),
])
def test_fake_tensors_match_real_cpu_tensors(method, ws, tp, family, options):
    """The same program on real CPU tensors (same fake process group) allocates exactly what the fake trace
    reports: fake-only artefacts (HF's traced-mask path, DTensor meta propagation, stale DTensor caches) are
    all neutralised."""
    config = tiny_config(family, num_layers=2)
    spec = _spec(method, ws, tp, model=family, training=TrainingSpec(micro_batch_size=2, seq_len=32, **options))
    rank = ws - 1
    fake = trace_run(spec, [rank], config=config, kernels="cpu")["per_rank"][rank]
    real = trace_run(spec, [rank], config=config, fake_tensors=False)["per_rank"][rank]
    assert fake["step_peaks"] == real["step_peaks"]
    assert fake["breakdown_at_peak"] == real["breakdown_at_peak"]
