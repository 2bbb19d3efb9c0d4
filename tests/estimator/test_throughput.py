"""The throughput model's equations, term by term, and its calibration hook."""

from __future__ import annotations

import json

import pytest

from estimator.planning import throughput as T

GPU = T.GpuPerf(key="test-gpu", name="Test GPU", capacity_bytes=80 * 1024**3,
                peak_flops={"bf16": 200e12, "fp16": 200e12, "fp32": 20e12}, memory_bandwidth=2e12,
                family="ampere", link="nvlink", link_bandwidth=100e9, host_bandwidth=20e9)
SHAPE = T.ModelShape(params=1_000_000_000, matmul_params=900_000_000, layers=20, hidden_size=2048,
                     head_params=100_000_000, replicated_params=200_000_000)
EFF = T.Efficiency("test-gpu", e_max=0.5, tokens_half=512.0, width_half=256.0)
LINK = T.Link("nvlink", 100e9, "test")


@pytest.fixture
def no_latency(monkeypatch):
    monkeypatch.setattr(T, "LATENCY_S", {k: 0.0 for k in T.LATENCY_S})
    monkeypatch.setattr(T, "SHARDING_OVERHEAD_S", {})


def step(method, *, world=4, tp=1, mb=4, seq=512, accum=1, ckpt=False, precision="mixed_bf16", shape=SHAPE, **kw):
    setup = T.Setup(method=method, world_size=world, tp=tp, micro_batch=mb, seq_len=seq, grad_accum=accum,
                    grad_ckpt=ckpt, precision=precision, **kw)
    return T.step_time(shape, setup, GPU, EFF, dp_link=LINK, tp_link=LINK)


def test_flops_6pt_plus_attention_and_recompute():
    tokens, seq = 4096, 1024
    attention = 12 * SHAPE.layers * SHAPE.hidden_size * seq * tokens
    assert T.micro_batch_flops(SHAPE, tokens, seq, grad_ckpt=False, lora=False) == 6 * 900e6 * tokens + attention
    ckpt = T.micro_batch_flops(SHAPE, tokens, seq, grad_ckpt=True, lora=False)
    assert ckpt == pytest.approx(8 * 900e6 * tokens + attention * 16 / 12)        # x4/3
    lora = T.micro_batch_flops(SHAPE, tokens, seq, grad_ckpt=False, lora=True)
    assert lora == pytest.approx(4 * 900e6 * tokens + attention)                  # no weight gradients


def test_tp_splits_the_layers_not_the_lm_head():
    full = T.micro_batch_flops(SHAPE, 2048, 512, grad_ckpt=False, lora=False)
    split = T.micro_batch_flops(SHAPE, 2048, 512, grad_ckpt=False, lora=False, tp=4)
    head = 6 * SHAPE.head_params * 2048
    assert split == pytest.approx((full - head) / 4 + head)


def test_efficiency_saturates_in_tokens_and_width():
    assert EFF.at(512, 256) == pytest.approx(0.5 * 0.5 * 0.5)
    values = [EFF.at(t, 2048) for t in (128, 512, 2048, 8192)]
    assert values == sorted(values) and values[-1] < 0.5
    assert EFF.at(2048, 2048 / 4) < EFF.at(2048, 2048)


def test_compute_time_is_flops_over_efficient_peak(no_latency):
    s = step("ddp", world=1)
    flops = T.micro_batch_flops(SHAPE, 4 * 512, 512, grad_ckpt=False, lora=False)
    assert s.compute_s == pytest.approx(flops / (200e12 * EFF.at(2048, 2048)))


def test_zero_communication_volumes_match_the_zero_paper(no_latency):
    n, psi = 4, SHAPE.params * 2
    ddp = step("ddp", world=n)
    assert ddp.parts["dp_allreduce"] == pytest.approx(2 * (n - 1) / n * psi / 100e9)       # 2 Psi
    z2 = step("zero2", world=n)
    assert z2.parts["dp_reduce_scatter"] + z2.parts["dp_all_gather"] == pytest.approx(ddp.parts["dp_allreduce"])
    z3 = step("zero3", world=n)
    assert z3.parts["dp_gather_scatter"] == pytest.approx(1.5 * ddp.parts["dp_allreduce"])  # 3 Psi
    assert step("fsdp", world=n).parts["dp_gather_scatter"] == pytest.approx(z3.parts["dp_gather_scatter"])
    assert step("zero1", world=n).parts["dp_allreduce"] == pytest.approx(ddp.parts["dp_allreduce"])
    assert step("ddp", world=n, precision="fp32").parts["dp_allreduce"] == pytest.approx(
        2 * ddp.parts["dp_allreduce"])                                                       # 4-byte grads


def test_tp_all_reduces_per_layer(no_latency):
    tp, mb, seq = 4, 2, 512
    act = mb * seq * SHAPE.hidden_size * 2
    one = 2 * (tp - 1) / tp * act / 100e9
    assert step("tp", world=tp, tp=tp, mb=mb).parts["tp_allreduce"] == pytest.approx(4 * SHAPE.layers * one)
    assert step("tp", world=tp, tp=tp, mb=mb, ckpt=True).parts["tp_allreduce"] == pytest.approx(6 * SHAPE.layers * one)
    hybrid = step("dp_tp", world=8, tp=tp, mb=mb)
    psi_rank = SHAPE.trainable_per_rank(tp) * 2
    assert hybrid.parts["tp_allreduce"] == pytest.approx(4 * SHAPE.layers * one)
    assert hybrid.parts["dp_gather_scatter"] == pytest.approx(3 * (2 - 1) / 2 * psi_rank / 100e9)   # FSDP over dp


def test_overlap_hides_dp_communication_behind_backward(no_latency):
    s = step("ddp", world=4)
    bwd = s.compute_s * T.backward_fraction(grad_ckpt=False, lora=False)
    assert s.exposed_comm_s == pytest.approx(max(0.0, s.parts["dp_allreduce"] - T.OVERLAP["ddp"] * bwd))
    # DeepSpeed ZeRO-1/2 overlap only when overlap_comm is on (off by default)
    off, on = step("zero2", world=4), step("zero2", world=4, overlap_comm=True)
    assert off.exposed_comm_s == pytest.approx(off.comm_s) and on.exposed_comm_s < off.exposed_comm_s
    # TP is never overlapped
    t = step("tp", world=4, tp=4)
    assert t.exposed_comm_s == pytest.approx(t.parts["tp_allreduce"])


def test_accumulation_sync_once_per_step_for_ddp(no_latency):
    one, four = step("ddp", world=4, mb=1), step("ddp", world=4, mb=1, accum=4)
    assert four.compute_s == pytest.approx(4 * one.compute_s)
    assert four.comm_s == pytest.approx(one.comm_s)                       # no_sync until the last micro-batch
    assert four.tokens_per_s == pytest.approx(4 * 1 * 4 * 512 / four.step_s)
    z3 = step("zero3", world=4, mb=1, accum=4)
    assert z3.comm_s == pytest.approx(4 * step("zero3", world=4, mb=1).comm_s)   # gathers every micro-batch


def test_offload_adds_pcie_and_cpu_adam(no_latency):
    s = step("zero_offload", world=4)
    shard = SHAPE.params / 4
    assert s.parts["cpu_adam"] == pytest.approx(shard * 4 / T.CPU_ADAM_PARAMS_PER_S)
    assert s.parts["offload_params_h2d"] == pytest.approx(shard * 2 / (20e9 * T.PAGEABLE_FACTOR))
    assert s.optimizer_s == 0 and s.offload_s >= s.parts["cpu_adam"]


def test_optimizer_update_is_sharded_by_zero(no_latency):
    assert step("zero2", world=4).optimizer_s == pytest.approx(step("ddp", world=4).optimizer_s / 4)


def test_lora_moves_only_adapter_gradients(no_latency):
    lora = T.ModelShape(**{**SHAPE.__dict__, "trainable_params": 10_000_000})
    assert step("ddp", shape=lora, lora=True).parts["dp_allreduce"] == pytest.approx(
        step("ddp").parts["dp_allreduce"] * 10e6 / 1e9)


def test_no_bf16_on_volta_is_an_error():
    volta = T.GpuPerf(**{**GPU.__dict__, "peak_flops": {"bf16": 0.0, "fp16": 125e12, "fp32": 15e12}})
    with pytest.raises(ValueError, match="^precision:"):
        T.step_time(SHAPE, T.Setup("ddp", 4, 1, 1, 512), volta, EFF, dp_link=LINK, tp_link=LINK)


# --- links and the GPU catalogue ----------------------------------------------------------------------------------
def test_links_presets_catalogue_and_override():
    assert T.resolve_link(GPU, 8).bandwidth == 100e9                       # the GPU's own link within a node
    assert T.resolve_link(GPU, 16).name == "infiniband"                     # across nodes
    assert T.resolve_link(GPU, 4, "pcie").bandwidth == T.INTERCONNECTS["pcie"]["ampere"]
    custom = T.resolve_link(GPU, 4, bandwidth_gbs=50)
    assert custom.bandwidth == 50e9 and custom.source == "user override"
    with pytest.raises(ValueError, match="^interconnect:"):
        T.resolve_link(GPU, 4, "carrier-pigeon")


def test_catalogue_adapter():
    pytest.importorskip("estimator.hardware.gpus")
    v100 = T.gpu_perf("v100-16gb")
    assert v100.family == "volta" and v100.flops_for("mixed_fp16") == 125e12 and not v100.supports_bf16()
    assert v100.link == "nvlink" and v100.link_bandwidth == pytest.approx(150e9 * T.LINK_EFFICIENCY["nvlink"])
    with pytest.raises(ValueError, match="^gpu: unknown GPU"):
        T.gpu_perf("no-such-gpu")


def test_gpu_family_patterns():
    assert T.gpu_family("h100-80gb") == "hopper" and T.gpu_family("a100-40gb") == "ampere"
    assert T.gpu_family("v100-16gb") == "volta" and T.gpu_family("whatever") == "generic"


# --- calibration ----------------------------------------------------------------------------------------------
def _rows(e_max, tokens_half, *, gpu_key="test-gpu"):
    """Synthetic single-GPU rows generated by the forward model with known coefficients."""
    truth = T.Efficiency(gpu_key, e_max, tokens_half)
    rows = []
    for mb in (1, 2, 4, 8):
        for seq in (256, 1024):
            tokens = mb * seq
            flops = T.micro_batch_flops(SHAPE, tokens, seq, grad_ckpt=False, lora=False)
            optimizer = SHAPE.params * 32.0 / (GPU.memory_bandwidth * T.HBM_EFFICIENCY)
            step_s = flops / (200e12 * truth.at(tokens, SHAPE.hidden_size)) + optimizer
            rows.append({"gpu_key": gpu_key, "method": "single", "status": "ok", "step_time_s": str(step_s),
                         "micro_batch_size": str(mb), "seq_len": str(seq), "precision": "mixed_bf16",
                         "params": str(SHAPE.params), "matmul_params": str(SHAPE.matmul_params),
                         "num_layers": str(SHAPE.layers), "hidden_size": str(SHAPE.hidden_size)})
    rows.append({**rows[0], "method": "ddp"})                             # ignored: not single-GPU
    rows.append({**rows[0], "status": "oom"})                             # ignored: failed
    rows.append({**rows[0], "run_status": "ok", "rank_status": "oom"})     # ignored: the harness's columns
    rows.append({**rows[0], "emulated": "True"})                          # ignored: CPU fake run
    return rows


def test_fit_efficiency_recovers_planted_coefficients(tmp_path):
    fitted = T.fit_efficiency(_rows(0.42, 700.0), out_dir=tmp_path, gpu_lookup=lambda key: GPU)
    data = fitted["test-gpu"]
    assert data["e_max"] == pytest.approx(0.42, rel=1e-3)
    assert data["tokens_half"] == pytest.approx(700.0, rel=1e-3)
    assert data["calibrated"] is True and data["fit"]["n_rows"] == 8
    written = json.loads((tmp_path / "throughput_test-gpu.json").read_text())
    assert written == data
    loaded = T.load_efficiency(GPU, tmp_path)
    assert loaded.calibrated and loaded.e_max == pytest.approx(0.42, rel=1e-3)


def test_prior_when_no_calibration(tmp_path):
    eff = T.load_efficiency(GPU, tmp_path)
    assert not eff.calibrated and eff.e_max == T.EFFICIENCY_PRIORS["ampere"]["e_max"]


def test_fit_with_one_token_count_keeps_the_prior_half_point():
    rows = [r for r in _rows(0.3, 512.0) if r["micro_batch_size"] == "2" and r["seq_len"] == "256"
            and r["method"] == "single" and r["status"] == "ok"]
    data = T.fit_efficiency(rows, gpu_lookup=lambda key: GPU)["test-gpu"]
    assert data["tokens_half"] == T.EFFICIENCY_PRIORS["ampere"]["tokens_half"]
    assert data["e_max"] == pytest.approx(0.3, rel=1e-3)


def test_fit_cli(tmp_path, capsys):
    import csv
    rows = _rows(0.42, 700.0, gpu_key="a100-80gb")
    path = tmp_path / "runs.csv"
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(k for row in rows for k in row)))
        writer.writeheader()
        writer.writerows(rows)
    pytest.importorskip("estimator.hardware.gpus")
    assert T.main([str(path), "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / "throughput_a100-80gb.json").is_file()
    assert "a100-80gb: e_max=" in capsys.readouterr().out


def test_zero3_offload_layouts(no_latency):
    z3 = step("zero3", world=4, ckpt=True)
    off = step("zero3_offload", world=4, ckpt=True)
    inf = step("zero_infinity", world=4, ckpt=True)
    shard = SHAPE.params / 4
    pcie = 20e9 * T.PAGEABLE_FACTOR                       # pin_memory off: DeepSpeed's default
    for s in (off, inf):                                   # ZeRO-3's collectives, the CPU does the update
        assert s.parts["dp_gather_scatter"] == pytest.approx(z3.parts["dp_gather_scatter"])
        assert s.optimizer_s == 0 and s.parts["cpu_adam"] == pytest.approx(shard * 4 / T.CPU_ADAM_PARAMS_PER_S)
    assert off.parts["offload_params_h2d"] == pytest.approx(shard * 2 / pcie)          # once per step
    assert inf.parts["offload_params_h2d"] == pytest.approx(3 * shard * 2 / pcie)      # every gather (+recompute)
    assert inf.step_s > off.step_s > z3.step_s
    pinned = step("zero3_offload", world=4, ckpt=True, pin_memory=True)
    assert pinned.parts["offload_params_h2d"] == pytest.approx(off.parts["offload_params_h2d"] / 2)


# --- calibration from a harness-shaped table ----------------------------------------------------------------
HARNESS_COLUMNS = ["run_id", "campaign", "gpu_key", "rank", "world_size", "run_status", "rank_status", "emulated",
                   "measured_by", "model", "gpu", "method", "tp", "dp", "micro_batch_size", "seq_len", "precision",
                   "optimizer", "grad_ckpt", "attn", "lora_rank", "lora_targets", "grad_accum_steps", "step_time_s",
                   "tokens_per_s", "num_alloc_retries", "padding"]


def _harness_rows(model, gpu, truth, shape):
    """Rows as harness/table.py writes them, step times from the forward model with planted coefficients."""
    rows = []
    for mb, seq, ckpt in ((1, 256, False), (2, 256, False), (4, 512, True), (8, 512, False), (16, 1024, True)):
        tokens = mb * seq
        flops = T.micro_batch_flops(shape, tokens, seq, grad_ckpt=ckpt, lora=False)
        optimizer = shape.trainable * 32.0 / (gpu.memory_bandwidth * T.HBM_EFFICIENCY)
        step_s = flops / (gpu.flops_for("mixed_bf16") * truth.at(tokens, shape.hidden_size)) + optimizer
        rows.append({"run_id": f"r{mb}-{seq}", "campaign": "c", "gpu_key": gpu.key, "rank": "0", "world_size": "1",
                     "run_status": "ok", "rank_status": "ok", "emulated": "False", "measured_by": "real_run",
                     "model": model, "gpu": gpu.key, "method": "single", "tp": "1", "dp": "1",
                     "micro_batch_size": str(mb), "seq_len": str(seq), "precision": "mixed_bf16", "optimizer": "adamw",
                     "grad_ckpt": str(ckpt), "attn": "sdpa", "lora_rank": "0", "lora_targets": "auto",
                     "grad_accum_steps": "1", "step_time_s": repr(step_s), "tokens_per_s": repr(tokens / step_s),
                     "num_alloc_retries": "0", "padding": "max_length"})
    good = rows[0]
    rows += [{**good, "run_id": "ddp", "method": "ddp", "world_size": "2", "step_time_s": "9"},    # multi-GPU
             {**good, "run_id": "emu", "emulated": "True", "measured_by": "emulated_fake_pg", "step_time_s": "9"},
             {**good, "run_id": "oom", "run_status": "oom", "rank_status": "oom", "step_time_s": "9"},
             {**good, "run_id": "fp32", "precision": "fp32", "step_time_s": "9"},
             {**good, "run_id": "retry", "num_alloc_retries": "3", "step_time_s": "9"},
             {**good, "run_id": "nostep", "step_time_s": "", "tokens_per_s": ""}]
    return rows


def _write_csv(path, rows):
    import csv
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=HARNESS_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def test_fit_cli_on_a_harness_table_recovers_planted_efficiency(tmp_path, capsys):
    pytest.importorskip("estimator.hardware.gpus")
    from estimator.planning.shape import model_shape
    model = "HuggingFaceTB/SmolLM2-135M"
    try:
        shape = model_shape(model)                       # parameter counts from the estimator's profile
    except ValueError as err:
        pytest.skip(f"profile not available: {err}")
    gpu = T.gpu_perf("a100-80gb")
    truth = T.Efficiency(gpu.key, 0.37, 900.0)
    data = tmp_path / "data" / "measurements"
    _write_csv(data / "a100-80gb" / "sweep.csv", _harness_rows(model, gpu, truth, shape))
    _write_csv(data / "cpu" / "smoke.csv", [{**_harness_rows(model, gpu, truth, shape)[0], "gpu_key": "cpu"}])
    out = tmp_path / "coefficients"
    assert T.main(["fit", str(data), "--out-dir", str(out)]) == 0
    assert "a100-80gb: e_max=0.370 tokens_half=900" in capsys.readouterr().out
    fit = json.loads((out / "throughput_a100-80gb.json").read_text())
    assert fit["e_max"] == pytest.approx(0.37, rel=1e-4) and fit["tokens_half"] == pytest.approx(900, rel=1e-3)
    assert fit["fit"]["n_rows"] == 5 and fit["fitted"] == ["e_max", "tokens_half"]
    assert fit["priors"] == {"width_half": T.WIDTH_HALF}
    assert sum(fit["fit"]["skipped_rows"].values()) == 7              # 6 bad rows + the cpu directory's
    assert fit["provenance"]["inputs"] and fit["provenance"]["models"] == [model]
    assert all(p["measured"] == pytest.approx(p["fitted"], rel=1e-3) for p in fit["points"])
    assert not (out / "throughput_cpu.json").exists()
    eff = T.load_efficiency(gpu, out)
    assert eff.calibrated and eff.e_max == pytest.approx(0.37, rel=1e-4) and "fitted to 5" in eff.source
    # --dry-run writes nothing; no usable rows is a one-line error
    assert T.main(["fit", str(data / "a100-80gb"), "--out-dir", str(tmp_path / "dry"), "--dry-run"]) == 0
    assert not (tmp_path / "dry").exists()
    assert T.main(["fit", str(data / "cpu")]) == 2
    assert capsys.readouterr().err.startswith("error: no usable rows")


def test_fit_uses_the_fed_tokens_under_padding_longest():
    rows = [r for r in _rows(0.42, 700.0) if r["method"] == "single" and r["status"] == "ok"
            and "rank_status" not in r and "emulated" not in r]
    padded = []
    for r in rows:            # the same runs, logged with a longer nominal seq_len but the real tokens/s
        tokens_per_s = int(r["micro_batch_size"]) * int(r["seq_len"]) / float(r["step_time_s"])
        padded.append({**r, "seq_len": str(2 * int(r["seq_len"])), "tokens_per_s": repr(tokens_per_s)})
    a = T.fit_efficiency(rows, gpu_lookup=lambda key: GPU)["test-gpu"]
    b = T.fit_efficiency(padded, gpu_lookup=lambda key: GPU)["test-gpu"]
    assert b["e_max"] == pytest.approx(a["e_max"], rel=1e-6) and b["tokens_half"] == pytest.approx(a["tokens_half"])


def test_a_broken_fit_file_is_a_one_line_error(tmp_path):
    (tmp_path / "throughput_test-gpu.json").write_text('{"e_max": 0.3}')
    with pytest.raises(ValueError, match="^coefficients: .* is not a throughput fit"):
        T.load_efficiency(GPU, tmp_path)


def test_links_reject_non_finite_bandwidth():
    with pytest.raises(ValueError, match="^bandwidth:"):
        T.resolve_link(GPU, 4, bandwidth_gbs=float("inf"))


MOE = T.ModelShape(params=1_000_000_000, matmul_params=400_000_000, layers=20, hidden_size=2048,
                   head_params=100_000_000, replicated_params=200_000_000, moe_layers=20, experts=8, top_k=2,
                   expert_params=600_000_000)


def test_expert_parallelism_adds_its_exchanges_and_gathers_only_its_experts(no_latency):
    """Per micro-batch: dispatch and combine of the T x top_k rows in every MoE layer, forward and backward (and
    the recomputation), (ep-1)/ep of them leaving the rank; the experts gathered for experts / ep over world / ep
    ranks, the rest over every rank."""
    tokens, n, ep = 4 * 512, 8, 4
    rows_bytes = tokens * MOE.top_k * MOE.hidden_size * 2
    for ckpt, passes in ((False, 2), (True, 3)):
        a2a = step("fsdp", world=n, shape=MOE, ep=ep, ckpt=ckpt).parts["ep_all_to_all"]
        assert a2a == pytest.approx(2 * passes * MOE.moe_layers * rows_bytes * (ep - 1) / ep / 100e9)
    dense, experts = (MOE.params - MOE.expert_params) * 2, MOE.expert_params * 2
    gathered = step("fsdp", world=n, shape=MOE, ep=ep).parts["dp_gather_scatter"]
    assert gathered == pytest.approx(3 * (dense * (n - 1) / n + experts / ep * (n // ep - 1) / (n // ep)) / 100e9)
    plain = step("fsdp", world=n, shape=MOE)
    assert "ep_all_to_all" not in plain.parts
    assert plain.parts["dp_gather_scatter"] == pytest.approx(3 * (dense + experts) * (n - 1) / n / 100e9)
    assert step("fsdp", world=n, shape=MOE, ep=n).parts["dp_gather_scatter"] == pytest.approx(
        3 * dense * (n - 1) / n / 100e9)                                   # ep = world: no expert is gathered
    assert step("fsdp", world=n, ep=ep).parts.get("ep_all_to_all") is None  # a dense model has no exchanges
