"""The planner against a fake estimator whose memory is a simple function of the spec."""

from __future__ import annotations

import argparse
import json
import random
from types import SimpleNamespace

import pytest

from estimator.io.plan_cli import add_plan_arguments, format_plan, run_plan
from estimator.models.arch import arch_from_config
from estimator.planning import plan as P
from estimator.planning import throughput as T

GIB = 1024**3
MODEL = "fake/llama-1b"
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
          "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8,
          "intermediate_size": 8192, "vocab_size": 32000, "max_position_embeddings": 4096,
          "tie_word_embeddings": False}
ARCH = arch_from_config(CONFIG, name=MODEL)
PARAMS = 1_200_000_000
GPU = T.GpuPerf(key="test-16gb", name="Test GPU 16GB", capacity_bytes=16 * GIB,
                peak_flops={"bf16": 100e12, "fp16": 100e12, "fp32": 20e12}, memory_bandwidth=1e12,
                family="ampere", link="nvlink", link_bandwidth=100e9, host_bandwidth=20e9)


def state_bytes(method: str, dp: int, tp: int, lora: bool) -> float:
    """ZeRO-paper model states (16 B/param) with each method's sharding; LoRA keeps only 2 B/param."""
    psi = PARAMS
    if lora:
        return 2 * psi / (tp if method in ("tp", "dp_tp") else 1) / (dp if method in ("zero3", "fsdp", "fsdp1") else 1)
    return {"single": 16 * psi, "ddp": 16 * psi, "zero1": 4 * psi + 12 * psi / dp, "zero2": 2 * psi + 14 * psi / dp,
            "zero3": 16 * psi / dp, "fsdp": 16 * psi / dp, "fsdp1": 16 * psi / dp, "tp": 16 * psi / tp,
            "dp_tp": 16 * psi / tp,
            "zero_offload": 2 * psi + 2 * psi / dp, "zero3_offload": 4 * psi / dp, "zero_infinity": 2 * psi / dp,
            }[method]


def layout(par) -> str:
    """The planner's layout name of a spec (ZeRO-3 offload layouts are ``zero3`` specs with offload flags)."""
    zero = getattr(par, "zero", None)
    if par.method == "zero3" and zero is not None and zero.offload_optimizer:
        return "zero_infinity" if zero.offload_param else "zero3_offload"
    return par.method


def fake_memory(spec) -> int:
    par, tr = spec.parallel, spec.training
    per_sample = tr.seq_len * (2_000 if tr.grad_ckpt else 40_000)
    states = state_bytes(layout(par), par.dp, par.tp, tr.lora_rank > 0)
    return int(states + per_sample * tr.micro_batch_size * 1024 / par.tp + 0.5 * GIB)


def make_fake(memory=fake_memory, calls: list | None = None, capacity: int = 16 * GIB):
    def estimate(spec):
        if calls is not None:
            calls.append(spec)
        peak = memory(spec)
        return SimpleNamespace(peak_device_bytes=peak, upper_bound_bytes=int(peak * 1.1), capacity_bytes=capacity,
                               host_ram_bytes=12 * PARAMS, calibrated=False)
    return estimate


@pytest.fixture(autouse=True)
def fake_model(monkeypatch):
    monkeypatch.setattr(P, "model_facts", lambda model: {"arch": ARCH})
    shapes = {}

    def shape(model, lora_rank=0, lora_targets="auto", **_):
        if (lora_rank, lora_targets) not in shapes:
            vh = ARCH.vocab_size * ARCH.hidden_size
            shapes[(lora_rank, lora_targets)] = T.ModelShape(
                params=PARAMS, matmul_params=PARAMS - vh, layers=ARCH.num_layers, hidden_size=ARCH.hidden_size,
                head_params=vh, replicated_params=2 * vh, trainable_params=4_000_000 if lora_rank else None)
        return shapes[(lora_rank, lora_targets)]
    monkeypatch.setattr(P, "model_shape", shape)


def run(gpus=4, **kwargs):
    kwargs.setdefault("estimate_fn", make_fake())
    return P.plan(MODEL, gpus=gpus, gpu=GPU.key, gpu_info=GPU, **kwargs)


def scan(fits, cap=P.MAX_MICRO_BATCH) -> int:
    """The linear scan the search replaces (valid for memory non-decreasing in the micro-batch)."""
    best = 0
    while best < cap and fits(best + 1):
        best += 1
    return best


def brute_max(memory, spec_for, capacity):
    return scan(lambda b: memory(spec_for(b)) * 1.1 <= capacity)


# --- search -------------------------------------------------------------------------------------------------
CURVES = {
    "affine": lambda base, slope: (lambda b: base + slope * b),
    "flat_then_affine": lambda base, slope: (lambda b: max(base + 40 * slope, base + slope * b)),
    "steps": lambda base, slope: (lambda b: base + slope * b + 30 * slope * (b // 16)),
    "convex": lambda base, slope: (lambda b: base + slope * b + b * b // 3),
}


@pytest.mark.parametrize("curve", sorted(CURVES))
def test_search_finds_the_true_maximum(curve):
    rng = random.Random(curve)
    for _ in range(300):
        f = CURVES[curve](rng.randint(0, 1000), rng.randint(1, 200))
        capacity = rng.randint(0, 200_000)
        cap = rng.choice([1, 2, 3, 64, 1000, 4096])
        calls = []
        got = P.search_max_micro_batch(lambda b, f=f, calls=calls: calls.append(b) or f(b), capacity, cap)
        truth = scan(lambda b, f=f, capacity=capacity: f(b) <= capacity, cap)
        assert got == truth
        assert len(calls) == len(set(calls)), "a micro-batch was estimated twice"
        assert len(calls) <= 2 * max(cap, 2).bit_length() + 4   # logarithmic, not a scan


def test_search_solves_an_affine_curve_in_four_probes():
    calls = []
    got = P.search_max_micro_batch(lambda b: calls.append(b) or 1000 + 37 * b, 1000 + 37 * 123 + 5, 4096)
    assert got == 123 and len(calls) == 4


def test_search_when_nothing_fits_and_at_the_cap():
    assert P.search_max_micro_batch(lambda b: 100 * b, 99) == 0
    assert P.search_max_micro_batch(lambda b: 1, 10, cap=50) == 50


def test_plan_search_matches_brute_force_for_every_candidate():
    result = run()
    for r in result.results:
        if r.status == "invalid":
            continue
        c = r.candidate
        spec = lambda b, c=c: SimpleNamespace(  # noqa: E731
            parallel=SimpleNamespace(method=c.method, dp=c.parallel_spec().dp, tp=c.tp),
            training=SimpleNamespace(seq_len=512, grad_ckpt=c.grad_ckpt, micro_batch_size=b, lora_rank=0))
        assert r.max_micro_batch == brute_max(fake_memory, spec, 16 * GIB), c


def test_the_plan_uses_the_safety_bound_not_the_mean():
    # mean fits at every batch, bound (x1.1) does not: with upper_bound = 1.1 x 15 GiB > 16 GiB nothing fits
    est = make_fake(memory=lambda spec: 15 * GIB)
    result = run(estimate_fn=est, advise=False)
    assert result.best is None and all(r.status != "ok" for r in result.results)


# --- candidates and ranking ---------------------------------------------------------------------------------
def test_candidates_cover_every_method_and_factorisation():
    labels = {(c.method, c.tp, c.grad_ckpt) for c in P.enumerate_candidates(12)}
    assert {(m, 1) for m in ("ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp1", "zero_offload")} <= {
        (m, t) for m, t, _ in labels}
    assert {t for m, t, _ in labels if m == "dp_tp"} == {2, 3, 4, 6}
    assert ("tp", 12, True) in labels and ("tp", 12, False) in labels
    assert {m for m, _, _ in labels} >= {"zero_offload", "zero3_offload", "zero_infinity"}
    assert len(labels) == 2 * (6 + 1 + 4 + 3)
    assert {c.method for c in P.enumerate_candidates(1)} == {"single", "zero_offload", "zero3_offload",
                                                               "zero_infinity"}


def test_offload_layouts_are_deepspeeds():
    """ZeRO-Offload = stage 2 + optimizer on the CPU (no parameter offload); ZeRO-3 offload and ZeRO-Infinity are
    stage-3 specs (DeepSpeed accepts offload_param only with stage 3)."""
    z2 = P.Candidate("zero_offload", 4).parallel_spec()
    assert z2.method == "zero_offload" and z2.zero_stage == 2 and not z2.zero.offload_param
    z3 = P.Candidate("zero3_offload", 4).parallel_spec()
    assert z3.zero_stage == 3 and z3.zero.offload_optimizer and not z3.zero.offload_param
    inf = P.Candidate("zero_infinity", 4).parallel_spec()
    assert inf.zero_stage == 3 and inf.zero.offload_optimizer and inf.zero.offload_param
    for spec in (z2, z3, inf):
        assert spec.zero.pin_memory is False                 # DeepSpeed's offload_*.pin_memory default


def test_methods_without_a_layout_on_n_gpus_are_an_error():
    with pytest.raises(ValueError, match=r"^methods: no layout on 4 GPU\(s\) for single \(it is the 1-GPU"):
        run(gpus=4, methods=["single"])
    with pytest.raises(ValueError, match=r"^methods: no layout on 1 GPU\(s\) for ddp \(it needs 2 or more"):
        run(gpus=1, methods=["ddp"])
    with pytest.raises(ValueError, match=r"^methods: no layout on 3 GPU\(s\) for dp_tp"):
        run(gpus=3, methods=["dp_tp"])
    with pytest.raises(ValueError, match=r"^methods: 'magic' is not one of"):
        run(methods=["magic"])
    with pytest.raises(ValueError, match=r"^ckpt_options:"):
        run(ckpt_options=())


def test_invalid_tp_is_skipped_with_the_reason():
    result = run(gpus=32)       # 16 heads: tp=32 cannot split them
    tp = [r for r in result.results if r.candidate.method == "tp"]
    assert tp and all(r.status == "invalid" and "32" in r.reason and "heads" in r.reason for r in tp)
    by_tp = {r.candidate.tp: r for r in result.results if r.candidate.method == "dp_tp"}
    assert by_tp[8].status != "invalid"
    assert by_tp[16].status == "invalid" and "key/value heads" in by_tp[16].reason   # 8 kv heads


def test_ranking_is_by_predicted_tokens_per_second():
    result = run()
    ranked = sorted((r for r in result.results if r.rank), key=lambda r: r.rank)
    assert ranked and ranked[0] is result.best
    assert [r.rank for r in ranked] == list(range(1, len(ranked) + 1))
    speeds = [r.tokens_per_s for r in ranked]
    assert speeds == sorted(speeds, reverse=True)
    for r in ranked[1:]:
        assert "x the best" in r.reason
    for r in result.results:
        if r.status == "oom":
            assert r.reason.startswith("does not fit at micro-batch 1")


def test_tokens_per_second_is_the_job_rate():
    result = run()
    for r in result.results:
        if r.time:
            c = r.candidate
            assert r.tokens_per_s == pytest.approx(c.dp * r.micro_batch * r.grad_accum * 512 / r.time.step_s)


# --- global batch -------------------------------------------------------------------------------------------
def test_micro_batch_for_global_batch():
    assert P.micro_batch_for_global(96, 4, 9) == (8, 3)
    assert P.micro_batch_for_global(96, 4, 5) == (4, 6)
    assert P.micro_batch_for_global(96, 4, 100) == (24, 1)
    assert P.micro_batch_for_global(7, 1, 3) == (1, 7)
    assert P.micro_batch_for_global(6, 4, 9) == (0, 0)


def test_global_batch_counts_accumulation_steps():
    result = run(global_batch=96)
    for r in result.results:
        if r.fits:
            dp = r.candidate.dp
            assert r.micro_batch <= r.max_micro_batch
            assert 96 % (dp * r.micro_batch) == 0 and r.grad_accum == 96 // (dp * r.micro_batch)
            assert all(96 % (dp * m) for m in range(r.micro_batch + 1, r.max_micro_batch + 1))


def test_global_batch_not_divisible_by_a_layouts_dp_marks_that_layout():
    result = run(global_batch=6)                 # dp=4 layouts cannot split 6; tp (dp=1) and dp_tp 2x2 can
    for r in result.results:
        if r.candidate.dp == 4:
            assert r.status == "invalid" and "not divisible by dp=4" in r.reason
    assert result.best is not None and result.best.candidate.dp in (1, 2)


def test_global_batch_no_layout_can_split_is_an_error():
    with pytest.raises(ValueError, match=r"^global_batch: 5 is not divisible"):
        run(gpus=4, global_batch=5, methods=["ddp", "zero3"])
    # dp=32 cannot split 48, and tp=32 (dp=1) cannot split 16 heads: an input error, not "nothing fits"
    with pytest.raises(ValueError, match=r"^global_batch: 48 is not divisible .*dp=32.*cannot run \(tp: 32"):
        run(gpus=32, global_batch=48, methods=["ddp", "tp"])


# --- advice ---------------------------------------------------------------------------------------------------
def test_advice_when_nothing_fits_counts_the_gpus_needed():
    def memory(spec):   # a fat model: nothing fits on 4, not even offloaded
        return fake_memory(spec) + (14 if layout(spec.parallel) in P.OFFLOAD_METHODS else 11) * GIB
    est = make_fake(memory=memory)
    result = run(estimate_fn=est)
    assert result.best is None
    text = " | ".join(result.advice)
    assert "no GPU-resident method fits" in text
    line = next(a for a in result.advice if a.startswith("more GPUs"))
    needed = int(line.split()[2])

    def zero3_fits(n):
        spec = SimpleNamespace(parallel=SimpleNamespace(method="zero3", dp=n, tp=1),
                               training=SimpleNamespace(seq_len=512, grad_ckpt=True, micro_batch_size=1, lora_rank=0))
        return (fake_memory(spec) + 11 * GIB) * 1.1 <= 16 * GIB
    assert zero3_fits(needed) and not zero3_fits(needed - 1)
    assert any(a.startswith("LoRA: --lora-rank 16 fits") for a in result.advice)
    assert any(a.startswith("offload: even zero_infinity needs") for a in result.advice)   # the least memory


def test_advice_probes_never_build_a_profile(monkeypatch):
    """The advice's what-ifs use only shipped/cached profiles: a missing one is said, not built (minutes)."""
    main, probed = make_fake(memory=lambda s: fake_memory(s) + 14 * GIB), []

    def probe(spec):                               # the estimator with allow_build=False
        probed.append(spec)
        if spec.training.lora_rank:
            raise ValueError("model: no cached profile for this architecture and variant (x_lora16-auto)")
        return main(spec)
    monkeypatch.setattr(P, "_default_estimate", lambda allow_build=True, **_options: main if allow_build else probe)
    result = P.plan(MODEL, gpus=4, gpu=GPU.key, gpu_info=GPU)
    assert result.best is None and probed
    assert any(s.training.lora_rank for s in probed)
    assert any(a.startswith("LoRA: not checked (no LoRA profile") for a in result.advice)
    assert any(a.startswith("more GPUs:") for a in result.advice)


def test_advice_with_checkpointing_excluded_probes_without_it():
    seen = []

    def est(spec):
        seen.append(spec.training.grad_ckpt)
        return make_fake(memory=lambda s: fake_memory(s) + 14 * GIB)(spec)
    result = run(estimate_fn=est, ckpt_options=(False,))
    assert result.best is None and set(seen) == {False}     # no what-if asked for a checkpointing profile
    assert "checkpointing was not considered" in result.advice[0]
    assert any(a.startswith("more GPUs:") for a in result.advice)


def test_host_ram_limit_rules_out_offload_layouts():
    def memory(spec):
        return fake_memory(spec) + (0 if layout(spec.parallel) in P.OFFLOAD_METHODS else 100 * GIB)
    result = run(estimate_fn=make_fake(memory), host_ram_gb=10, ckpt_options=(True,))   # each needs 4 x 12 x P
    offload = [r for r in result.results if r.candidate.offload]
    assert offload and all(r.status == "oom" and r.reason.startswith("host RAM: the offloaded states need")
                           for r in offload)
    assert result.best is None
    assert any("would fit the GPU but not the host" in a for a in result.advice)
    with pytest.raises(ValueError, match="^host_ram: must be a positive number"):
        run(host_ram_gb=0)


def test_advice_when_only_offload_fits():
    def memory(spec):
        return fake_memory(spec) + (0 if spec.parallel.method == "zero_offload" else 100 * GIB)
    result = run(estimate_fn=make_fake(memory))
    assert result.best.candidate.method == "zero_offload"
    line = next(a for a in result.advice if a.startswith("offload: zero_offload (DeepSpeed ZeRO-Offload"))
    assert f"host RAM ~{12 * PARAMS * 4 / GIB:.0f} GiB per node" in line        # 4 ranks' partitions
    text = format_plan(result)
    assert "host GiB" in text.splitlines()[2]
    row = next(r for r in text.splitlines() if r.startswith("zero_offload") and " yes " in r[17:30])
    assert f"{12 * PARAMS * 4 / GIB:.1f}" in row


def test_advice_when_only_checkpointing_fits():
    def memory(spec):
        return fake_memory(spec) + (0 if spec.training.grad_ckpt else 100 * GIB)
    result = run(estimate_fn=make_fake(memory))
    assert result.best.candidate.grad_ckpt
    assert any("only gradient checkpointing" in a for a in result.advice)


# --- errors and output ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"gpus": 0}, r"^gpus: must be a positive integer"),
    ({"gpus": 100_000}, r"^gpus: 100000 GPUs is more"),
    ({"seq_len": 8192}, r"^seq_len: 8192 is longer than the model's 4096 positions"),
    ({"global_batch": 0}, r"^global_batch: must be a positive integer"),
    ({"bandwidth_gbs": -1.0}, r"^bandwidth: must be a positive number"),
    ({"interconnect": "ethernet"}, r"^interconnect: 'ethernet' is not one of"),
])
def test_bad_input_raises_one_line_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        run(**kwargs)
    assert "\n" not in str(err.value)


def test_an_error_every_candidate_shares_is_the_users():
    def estimate(spec):
        raise ValueError("precision: not on this GPU")
    with pytest.raises(ValueError, match="^precision: not on this GPU$"):
        run(estimate_fn=estimate)


def test_table_and_json(capsys):
    result = run(global_batch=64)
    text = format_plan(result)
    assert "Recommendation:" in text and "Throughput model:" in text
    header = text.splitlines()[2]
    for column in ("method", "tp", "ckpt", "fits", "max mb", "accum", "peak GiB", "tokens/s", "why lost"):
        assert column in header
    data = json.loads(json.dumps(result.to_dict()))
    assert data["recommendation"]["method"] == result.best.candidate.method
    assert len(data["candidates"]) == len(result.results)
    assert data["throughput_model"]["compute_efficiency"]["calibrated"] is False


def _cli_args(argv):
    return add_plan_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_cli_unknown_gpu_exits_2_with_one_line(capsys):
    code = run_plan(_cli_args(["--model", MODEL, "--gpus", "4", "--gpu", "no-such-gpu"]))
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: gpu: unknown GPU 'no-such-gpu'") and err.count("\n") == 1


def test_cli_json_and_errors(monkeypatch, capsys):
    real = P.plan
    monkeypatch.setattr(P, "plan", lambda model, **kw: real(model, estimate_fn=make_fake(), gpu_info=GPU, **kw))
    assert run_plan(_cli_args(["--model", MODEL, "--gpus", "4", "--gpu", "x", "--json"])) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recommendation"] and data["world_size"] == 4
    assert run_plan(_cli_args(["--model", MODEL, "--gpus", "4", "--gpu", "x", "--global-batch", "5",
                               "--methods", "ddp"])) == 2
    assert capsys.readouterr().err.startswith("error: global_batch: 5")
    assert run_plan(_cli_args(["--model", MODEL, "--gpus", "4", "--gpu", "x", "--methods", "magic"])) == 2
    assert capsys.readouterr().err.startswith("error: methods: magic")


def test_cli_rejects_impossible_gpu_counts():
    with pytest.raises(SystemExit) as exit_:
        _cli_args(["--model", MODEL, "--gpus", "0", "--gpu", "x"])
    assert exit_.value.code == 2


# --- the real estimator ------------------------------------------------------------------------------------------
def test_end_to_end_on_a_catalogue_model(monkeypatch):
    api = pytest.importorskip("estimator.api")
    monkeypatch.undo()                                  # the real model facts
    from estimator.hardware.gpus import get_gpu  # noqa: F401  (the catalogue must exist)

    def estimate(spec):
        return api.estimate(spec, allow_build=False)    # shipped profiles only: no torch in a unit test
    try:
        result = P.plan("HuggingFaceTB/SmolLM2-135M", gpus=2, gpu="a100-80gb", ckpt_options=(False,),
                        estimate_fn=estimate)
    except ValueError as err:
        if "no cached profile" in str(err):
            pytest.skip(f"profile not shipped: {err}")
        raise
    assert result.best is not None and result.best.fits
    assert result.best.bound_bytes <= result.best.capacity_bytes
    assert result.best.max_micro_batch >= 1
    assert "Recommendation:" in format_plan(result)


# --- LLMem's Algorithm 1 baseline ---------------------------------------------------------------------------------
def test_algorithm1_scores_and_tie_order():
    from estimator.baselines.llmem_select import OFFLOAD, select
    method, scores = select({"CDP": 2, "ADP": 3, "TP": 0, "DP+TP": 0}, gpus=4, dp_of_dptp=2)
    assert scores == {"CDP": 12.0, "ADP": 12, "TP": 0.0, "DP+TP": 0} and method == "CDP"   # tie -> CDP first
    assert select({"CDP": 0, "ADP": 0, "TP": 4, "DP+TP": 2}, gpus=4, dp_of_dptp=2)[0] == "TP"
    assert select({"CDP": 0, "ADP": 1, "TP": 9, "DP+TP": 5}, gpus=4, dp_of_dptp=2)[0] == "DP+TP"
    assert select({"CDP": 0, "ADP": 0, "TP": 0, "DP+TP": 0}, gpus=4, dp_of_dptp=2)[0] == OFFLOAD


def test_algorithm1_uses_the_memory_source(monkeypatch):
    from estimator.baselines import llmem_select as L
    seen = {}

    def batches(model, layouts, gpus, gpu, seq_len):
        seen.update(layouts)
        return {"CDP": 0, "ADP": 5, "TP": 9, "DP+TP": 4}, "test equations", {}
    monkeypatch.setattr(L, "_llmem_batches", batches)
    choice = L.algorithm1("any", gpus=4)
    assert seen == {"CDP": ("ddp", 1), "ADP": ("zero3", 1), "TP": ("tp", 4), "DP+TP": ("dp_tp", 2)}
    assert choice.method == "ADP" and choice.batch == 5 and choice.scores["ADP"] == 20
    assert "test equations" in choice.describe()
    single = L.algorithm1("any", gpus=1)
    assert set(single.reasons) == {"CDP", "ADP", "TP", "DP+TP"}


def test_table3_models_are_in_the_catalogue():
    from estimator.baselines.llmem_select import TABLE3
    from estimator.models.arch import catalogue_models
    assert set(TABLE3) <= set(catalogue_models())
    assert TABLE3["facebook/opt-2.7b"][1]["4DP"] is None and TABLE3["facebook/opt-1.3b"][0] == "4DP"


def test_comparison_explains_agreement_and_differences():
    from estimator.baselines.llmem_select import Comparison, LlmemChoice, explain
    alg = LlmemChoice("m", 4, "TP", 6, {"CDP": 0, "ADP": 0, "TP": 6, "DP+TP": 4}, {"CDP": 0, "ADP": 0, "TP": 6,
                                                                                   "DP+TP": 2}, "test")
    columns = {"4DP": {"layout": "zero3", "fits": True, "status": "ok", "micro_batch": 3, "tokens_per_s": 9000.0,
                       "reason": "", "why_slower": ""},
               "2DP+2TP": {"layout": "dp_tp 2x2", "fits": False, "status": "invalid", "micro_batch": 0,
                           "tokens_per_s": None, "reason": "tp: nope", "why_slower": ""},
               "4TP": {"layout": "tp", "fits": True, "status": "ok", "micro_batch": 8, "tokens_per_s": 6000.0,
                       "reason": "", "why_slower": "0.67x the best: tp=4 narrows the GEMMs (efficiency 0.18 vs 0.23)"}}
    ours = {"method": "zero3", "label": "zero3", "tp": 1, "column": "4DP", "micro_batch": 3,
            "tokens_per_s": 9000.0, "bound_gib": 15.0}
    comp = Comparison("m", "4TP", {"4DP": None, "2DP+2TP": 900, "4TP": 600}, alg, ours, ours, columns, [])
    text = " ".join(explain(comp))
    assert "reproduces the paper's pick 4TP" in text
    assert "the paper measured 4TP fastest" in text and "0.67x the throughput" in text
    assert "(tp=4 narrows the GEMMs (efficiency 0.18 vs 0.23))" in text               # the throughput model's why
    assert "4DP: ours fits zero3 at micro-batch 3 where the paper measured OOM" in text
    assert "LLMem's own equations give ADP batch 0, agreeing with the paper" in text
    assert "2DP+2TP: not a candidate for ours (tp: nope)" in text
    assert "LLMem scores TP by its batch alone" in text


def test_comparison_derives_what_algorithm1_would_need():
    """A disagreement with the paper's pick is explained by the batch Algorithm 1's own rule would need."""
    from estimator.baselines.llmem_select import Comparison, LlmemChoice, explain, select
    batches = {"CDP": 0, "ADP": 2, "TP": 6, "DP+TP": 4}
    method, scores = select(batches, gpus=4, dp_of_dptp=2)
    assert method == "ADP" and scores == {"CDP": 0.0, "ADP": 8, "TP": 6.0, "DP+TP": 8}   # the tie goes to ADP
    alg = LlmemChoice("m", 4, "ADP", 2, scores, batches, "test")
    columns = {k: {"layout": k, "fits": False, "status": "oom", "micro_batch": 0, "tokens_per_s": None,
                   "reason": "does not fit", "why_slower": ""} for k in ("4DP", "2DP+2TP", "4TP")}
    comp = Comparison("m", "4TP", {"4DP": None, "2DP+2TP": 900, "4TP": 600}, alg, None, None, columns, [])
    text = " ".join(explain(comp))
    # TP's score is 6: ADP (earlier in the tie order, x4) must score below it, DP+TP (later, x2) at most equal it
    assert ("For Algorithm 1 to pick TP (score 6) it needs ADP's batch <= 1 (these equations give 2) and "
            "DP+TP's batch <= 3 (these equations give 4)") in text
    assert "Ours: nothing fits" in text
    # where ours runs out of memory in a layout the paper ran: the numbers say whether only the margin is at fault
    columns["4TP"]["layout"] = "tp"
    columns["4TP"]["detail"] = {"layout": "tp", "batch": 1, "phase": "optimizer_step", "peak_gib": 15.3,
                                "bound_gib": 17.6, "capacity_gib": 16.0,
                                "top": [("optimizer_states", 5.7), ("master_weights", 2.9), ("gradients", 2.6)]}
    columns["2DP+2TP"]["detail"] = {**columns["4TP"]["detail"], "peak_gib": 16.5, "bound_gib": 19.0}
    text = " ".join(explain(comp))
    assert ("4TP: ours says tp does not fit at micro-batch 1 but the paper ran it: the mean estimate 15.3 GiB fits; "
            "only the uncalibrated safety bound 17.6 GiB exceeds 16.0 GiB; the peak is in the optimizer_step "
            "(optimizer_states 5.7, master_weights 2.9, gradients 2.6 GiB)") in text
    assert "2DP+2TP: ours says 2DP+2TP does not fit at micro-batch 1 but the paper ran it: device peak 16.5 GiB" in text
    columns["4TP"]["detail"].update(replicated_params=642_000_000, replicated_share=0.52)
    text = " ".join(explain(comp))
    assert "our TP keeps the 642M embedding/LM-head parameters whole on every rank (52% of each rank's" in text


def test_comparison_time_ratio_mismatch_is_explained():
    from estimator.baselines.llmem_select import Comparison, LlmemChoice, explain
    alg = LlmemChoice("m", 4, "ADP", 9, {"CDP": 0, "ADP": 36, "TP": 9, "DP+TP": 18},
                      {"CDP": 0, "ADP": 9, "TP": 9, "DP+TP": 9}, "test")
    columns = {"4DP": {"layout": "fsdp", "fits": True, "status": "ok", "micro_batch": 9, "tokens_per_s": 1000.0,
                       "reason": "", "why_slower": ""},
               "2DP+2TP": {"layout": "dp_tp 2x2", "fits": True, "status": "ok", "micro_batch": 9,
                           "tokens_per_s": 800.0, "reason": "", "why_slower": "0.80x the best: tp=2 narrows"},
               "4TP": {"layout": "tp", "fits": True, "status": "ok", "micro_batch": 9, "tokens_per_s": 500.0,
                       "reason": "", "why_slower": "0.50x the best: exposed communication 90 ms/step"}}
    ours = {"method": "fsdp", "label": "fsdp", "tp": 1, "column": "4DP", "micro_batch": 9, "tokens_per_s": 1000.0}
    comp = Comparison("m", "4DP", {"4DP": 100, "2DP+2TP": 250, "4TP": 210}, alg, ours, ours, columns, [])
    text = " ".join(explain(comp))
    assert "Time relative to 4DP (measured/predicted): 4DP 1.00/1.00, 2DP+2TP 2.50/1.25, 4TP 2.10/2.00" in text
    assert "2DP+2TP: ours under-predicts its slowdown (1.25x vs 2.50x measured)" in text and "tp=2 narrows" in text
    assert "4TP: ours" not in text                                  # 2.00 vs 2.10 is within the tolerance


def test_the_plan_says_whether_efficiency_is_a_prior_or_fitted(tmp_path, monkeypatch):
    monkeypatch.setattr(T, "coefficients_dir", lambda: tmp_path)
    prior = run()
    assert "compute efficiency PRIOR" in format_plan(prior)
    assert any(n.startswith("throughput: compute efficiency is a prior") for n in prior.notes)
    (tmp_path / f"throughput_{GPU.key}.json").write_text(json.dumps(
        {"e_max": 0.6, "tokens_half": 100.0, "width_half": 256.0, "calibrated": True, "fit": {"n_rows": 7}}))
    fitted = run()
    text = format_plan(fitted)
    assert "compute efficiency FITTED [fitted to 7 single-GPU runs" in text
    assert not any(n.startswith("throughput: compute efficiency is a prior") for n in fitted.notes)
    assert fitted.assumptions["compute_efficiency"]["calibrated"] is True
    assert fitted.best.tokens_per_s > prior.best.tokens_per_s              # 0.6 beats the 0.45 ampere prior


def test_cli_bad_inputs_are_one_line_exit_2(capsys):
    from estimator.io.plan_cli import main
    for argv in (["--gpus", "0"], ["--gpus", "-2"], ["--gpus", "2.5"], ["--gpus", "four"], ["--gpus", "4", "--seq-len", "0"],
                 ["--gpus", "4", "--global-batch", "-8"], ["--gpus", "4", "--host-ram", "x"]):
        with pytest.raises(SystemExit) as exit_:
            main(["--model", MODEL, "--gpu", GPU.key, *argv])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, argv


def test_expandable_note_names_the_fastest_layout_it_rescues(monkeypatch):
    """Layouts out of memory at micro-batch 1 are replayed with expandable segments fastest first, and only while
    they would beat the recommendation; the first that fits is named and ends the search."""
    fastest, fast, slow = P.Candidate("ddp", 4, 1), P.Candidate("zero2", 4, 1), P.Candidate("zero3", 4, 1)
    speed = {fastest: 300.0, fast: 200.0, slow: 50.0}
    fits = {fastest: False, fast: True, slow: True}
    asked = []

    def estimate(spec):
        asked.append(spec)
        return SimpleNamespace(reserved_source="replayed", fits=fits[spec])

    monkeypatch.setattr(P, "_default_estimate", lambda **kw: estimate)
    ctx = SimpleNamespace(spec=lambda cand, mb: cand,
                          step_time=lambda cand, mb, accum: SimpleNamespace(tokens_per_s=speed[cand]))
    best = P.CandidateResult(P.Candidate("fsdp", 4, 1), time=SimpleNamespace(tokens_per_s=100.0))
    results = [best] + [P.CandidateResult(c, status="oom") for c in (slow, fast, fastest)]
    result = SimpleNamespace(results=results, best=best, global_batch=None)
    notes = P._expandable_notes(ctx, result, "")
    assert asked == [fastest, fast] and len(notes) == 1
    assert fast.label in notes[0] and "expandable_segments:True" in notes[0] and "faster than" in notes[0]
    asked.clear()
    fits[fast] = False
    assert P._expandable_notes(ctx, result, "") == [] and asked == [fastest, fast]  # slow cannot beat fsdp
    asked.clear()
    result.best = None
    note = P._expandable_notes(ctx, result, "")[0]
    assert slow.label in note and asked == [fastest, fast, slow]
    assert P._expandable_notes(ctx, result, "expandable_segments:True") == []


def test_layouts_that_do_not_fit_report_lower_bounds():
    """The plan's replays stop once a layout's reserved level proves it does not fit (``decide_fit``): such a
    layout's peak and bound are lower bounds, marked in the result, the reason and the table, and the full
    estimate agrees that it does not fit, at a bound no lower."""
    from estimator.api import estimate
    from estimator.spec import RunSpec, TrainingSpec

    p = P.plan("facebook/opt-2.7b", gpus=4, gpu="v100-16gb", seq_len=512, methods=["fsdp", "fsdp1"])
    # cp layouts keep the reserved prior (no ring events to replay): their peaks are not lower bounds
    oom = [r for r in p.results if r.status == "oom" and r.candidate.cp == 1]
    assert oom and all(r.peak_lower_bound for r in oom)
    assert all(">= " in r.reason and r.to_dict()["peak_lower_bound"] for r in oom)
    text = format_plan(p)
    assert ">= GiB: lower bounds" in text
    for r in oom:
        training = TrainingSpec(micro_batch_size=1, seq_len=512, grad_ckpt=r.candidate.grad_ckpt,
                                precision=p.precision, optimizer=p.optimizer)
        full = estimate(RunSpec(model=p.model, gpu="v100-16gb", training=training,
                                parallel=r.candidate.parallel_spec()))
        assert not full.fits and full.upper_bound_bytes >= r.bound_bytes
        assert not any(rank.reserved_lower_bound for rank in full.ranks)


def test_reentrant_checkpointing_goes_to_the_checkpointed_layouts_only():
    calls: list = []
    run(estimate_fn=make_fake(calls=calls), lora_rank=16, ckpt_reentrant=True, methods=["fsdp1", "ddp"])
    assert {(s.training.grad_ckpt, s.training.ckpt_reentrant) for s in calls} == {(True, True), (False, False)}
    plain: list = []
    run(estimate_fn=make_fake(calls=plain), lora_rank=16, methods=["fsdp1"])
    assert not any(s.training.ckpt_reentrant for s in plain)



def test_a_lora_plan_weighs_cp_x_tp_layouts():
    """LoRA under cp x tp is checked (docs/error_matrix/context_parallel_tp_lora.csv): a LoRA plan weighs the
    dp_tp layouts with cp a full fine-tuning plan weighs."""
    def cp_tp_labels(lora_rank: int) -> set[str]:
        result = run(gpus=8, seq_len=4096, precision="bf16", lora_rank=lora_rank, advise=False,
                     try_techniques=False)
        return {r.candidate.label for r in result.results if r.candidate.cp > 1 and r.candidate.tp > 1}

    assert {"dp2 cp2 tp2", "dp1 cp4 tp2"} <= cp_tp_labels(8) == cp_tp_labels(0)
