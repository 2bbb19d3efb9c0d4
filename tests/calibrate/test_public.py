"""``python -m calibrate public`` and the published-measurement table (data/public/)."""

import csv
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from calibrate import public as P
from calibrate.cli import main
from estimator import RunSpec, TrainingSpec, estimate
from estimator.columns import SPEC_INPUT_COLUMNS, spec_columns
from estimator.spec import ParallelSpec

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = ROOT / "data" / "public"
MODEL = "facebook/opt-125m"  # shipped profiles: no build in these tests


def _common():
    return _load("public_common", "common.py")


def _load(name: str, file_name: str):
    """A module of data/public (not a package): its siblings importable while it loads."""
    sys.path.insert(0, str(PUBLIC))
    try:
        spec = importlib.util.spec_from_file_location(name, PUBLIC / file_name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(PUBLIC))


def _row(common, row_id, spec, quantity, value_bytes, **extra):
    cols = spec_columns(spec)
    fields = {c: cols[c] for c in SPEC_INPUT_COLUMNS if c in cols}
    fields["world_size"] = spec.parallel.world_size
    base = dict(row_id=row_id, source=extra.pop("source", "synthetic"), quantity=quantity, scope="per_gpu",
                framework="transformers", value=value_bytes, unit="B", **fields)
    base.update(extra)
    return common.row(**base)


@pytest.fixture
def synthetic_csv(tmp_path):
    common = _common()
    single = RunSpec(model=MODEL, gpu="a100-40gb", training=TrainingSpec(micro_batch_size=2, seq_len=256,
                                                                         precision="bf16"))
    est = estimate(single, allow_build=False)
    rows = [
        _row(common, "s:exact", single, "max_allocated", est.peak_allocated_bytes),
        _row(common, "s:reserved", single, "max_reserved", est.peak_reserved_bytes, source="other"),
        _row(common, "s:off", single, "max_allocated", int(est.peak_allocated_bytes / 1.2)),
        _row(common, "s:unknown", single, "unknown", 123),
        _row(common, "s:incomplete", single, "max_allocated", 123, complete=False, missing="no batch size"),
        _row(common, "s:out", single, "max_allocated", 123, in_scope=False),
    ]
    path = tmp_path / "measurements.csv"
    common.write_csv(rows, path)
    return path, est


def test_table_columns_mirror_the_spec_columns():
    assert _common().SPEC == SPEC_INPUT_COLUMNS


def test_scoring_uses_the_measured_quantity_and_skips_what_it_cannot_score(synthetic_csv):
    path, est = synthetic_csv
    rows = P.load(path)
    scored = {s.row["row_id"]: s for s in P.score(rows, allow_build=False, with_baselines=False)}
    assert set(scored) == {"s:exact", "s:reserved", "s:off"}
    assert scored["s:exact"].err_pct == pytest.approx(0.0)
    assert scored["s:reserved"].predicted_bytes == est.peak_reserved_bytes
    assert scored["s:off"].err_pct == pytest.approx(20.0, abs=0.01)
    assert [s.row["row_id"] for s in P.outliers(list(scored.values()))] == ["s:off"]
    overall = P.summary(list(scored.values()))[0]
    assert overall["key"] == "all" and overall["ours"]["n"] == 3 and overall["ours"]["max_abs_pct"] == 20.0


def test_summed_values_are_compared_with_world_size_times_the_rank(tmp_path):
    common = _common()
    ddp = RunSpec(model=MODEL, gpu="a100-40gb", training=TrainingSpec(micro_batch_size=1, seq_len=128,
                                                                      precision="bf16"))
    ddp = ddp.replace(**{"parallel.method": "ddp", "parallel.world_size": 2})
    per_rank = estimate(ddp, allow_build=False).peak_allocated_bytes
    path = tmp_path / "m.csv"
    common.write_csv([_row(common, "d:sum", ddp, "max_allocated", 2 * per_rank, scope="sum")], path)
    [item] = P.score(P.load(path), allow_build=False, with_baselines=False)
    assert item.predicted_bytes == 2 * per_rank and item.err_pct == pytest.approx(0.0)


def test_cli_writes_the_report(synthetic_csv, tmp_path, capsys):
    path, _ = synthetic_csv
    out = tmp_path / "report"
    code = main(["public", "--data", str(path), "--out", str(out), "--no-build", "--no-baselines"])
    assert code == 0
    text = (out / "public.md").read_text()
    assert "`s:off`" in text and "Rows beyond 8 %" in text
    assert "3 rows scored" in capsys.readouterr().out


def test_cli_user_errors_are_one_line(tmp_path, capsys):
    assert main(["public", "--data", str(tmp_path / "nope.csv")]) == 2
    bad = tmp_path / "bad.csv"
    bad.write_text("row_id,source\nx,y\n")
    assert main(["public", "--data", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("error: data: no such file") and "lacks column" in err[1]


def test_committed_table_is_what_build_writes(tmp_path):
    sys.path.insert(0, str(PUBLIC))
    try:
        spec = importlib.util.spec_from_file_location("public_build", PUBLIC / "build.py")
        build = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(build)
        rows = build.build(tmp_path / "rebuilt.csv")
    finally:
        sys.path.remove(str(PUBLIC))
    assert (tmp_path / "rebuilt.csv").read_bytes() == (PUBLIC / "measurements.csv").read_bytes()
    with (PUBLIC / "measurements.csv").open() as fh:
        assert len(list(csv.DictReader(fh))) == len(rows)
    for r in rows:  # every row spells out what it had to assume or what is missing
        assert r["assumptions"] or r["missing"]


def test_reserved_rows_get_a_profile_with_events(tmp_path, monkeypatch):
    """A cached profile traced before event lists were kept is re-traced for a reserved row, so the row is scored
    with the replayed reserved level; allocated rows and --no-build leave it alone."""
    import json

    from estimator.models import profiles
    from estimator.models.arch import cached_arch
    from estimator.profiler import profile as profiler

    common = _common()
    training = TrainingSpec(micro_batch_size=1, seq_len=128, precision="bf16", lora_rank=3, lora_targets="q_proj")
    spec = RunSpec(model=MODEL, gpu="a100-40gb", training=training)
    sha = cached_arch(MODEL).config_sha
    stale = json.loads(json.dumps(profiles.find_profile(profiles.profile_key(sha, TrainingSpec(
        micro_batch_size=1, seq_len=128, precision="bf16")))))
    for regime in stale["regimes"]:
        regime.pop("events", None)
    monkeypatch.setenv("LLMEM_CACHE_DIR", str(tmp_path / "cache"))
    key = profiles.profile_key(sha, training)
    profiles.save_profile(key, stale)
    rows = [_row(common, "r:res", spec, "max_reserved", 1), _row(common, "r:alloc", spec, "max_allocated", 1)]
    path = tmp_path / "m.csv"
    common.write_csv(rows, path)
    traced = []
    monkeypatch.setattr(profiler, "build_profile", lambda config, training: traced.append(training) or
                        {**stale, "regimes": [{**r, "events": {}} for r in stale["regimes"]]})
    try:
        assert P.refresh_cached_profiles(P.load(path), allow_build=False) == []
        assert P.refresh_cached_profiles(P.load(path)) == [key] and traced == [training]
        assert profiles.has_events(json.loads((profiles.user_cache_dir() / f"{key}.json").read_text()))
        assert P.refresh_cached_profiles(P.load(path)) == []  # now it has them
    finally:
        profiles._read.cache_clear()


def test_litgpt_rows_carry_accumulation_and_refuse_runs_below_their_model_states():
    rows = {r["row_id"]: r for r in _load("public_litgpt", "extract_litgpt.py").extract()}
    tiny = rows["litgpt:config-hub:tiny-llama/full.yaml:1xA10G"]
    assert tiny["grad_accum_steps"] == 8 and tiny["complete"]  # global 32 // 1 device // micro-batch 4
    assert rows["litgpt:resource-tables:single:Llama2-7B:None:mb2:x1"]["grad_accum_steps"] == 64
    for name in ("llama-3.2-1b", "llama-3.2-3b"):
        row = rows[f"litgpt:config-hub:{name}/full.yaml:1xA10G"]
        assert not row["complete"] and "below the model states" in row["missing"]


def test_litgpt_fsdp_rows_run_fsdp1_over_blocks_holding_gradients_under_no_sync():
    """finetune/lora.py at 8641822: FSDPStrategy(auto_wrap_policy={Block}) and no_backward_sync on every
    micro-batch but the last; single-GPU rows keep the defaults."""
    rows = {r["row_id"]: r for r in _load("public_litgpt", "extract_litgpt.py").extract()}
    multi = rows["litgpt:resource-tables:multi:Llama2-7B:None:mb1:x2"]
    assert (multi["method"], multi["grad_sync"], multi["fsdp1_lora_wrap"]) == ("fsdp1", "last", "layer")
    single = rows["litgpt:resource-tables:single:Llama2-7B:None:mb1:x1"]
    assert (single["method"], single["grad_sync"], single["fsdp1_lora_wrap"]) == ("single", "every", "adapter")


def test_litgpt_lora_rows_build_their_adapters_in_bf16_and_qlora_rows_are_lightnings_recipe():
    """finetune/lora.py at both commits makes the LoRA tensors under ``fabric.init_module``: ``bf16-true`` builds
    them in bf16 (``lora_dtype`` model), QLoRA's too; Lightning quantizes every Linear incl. the head
    (``qlora_quantizer`` lightning) with the row's bitsandbytes (0.41.1: inputs kept)."""
    from estimator.columns import spec_from_columns
    from estimator.models.profiles import run_adapters_in_16bit

    rows = {r["row_id"]: r for r in _load("public_litgpt", "extract_litgpt.py").extract()}
    tiny = rows["litgpt:config-hub:tiny-llama/lora.yaml:1xA10G"]
    assert (tiny["lora_dtype"], tiny["lora_rank"], tiny["lora_dropout"]) == ("model", 32, 0.05)
    assert tiny["lora_targets"] == "down_proj,gate_proj,k_proj,lm_head,o_proj,q_proj,up_proj,v_proj"
    for row_id in ("litgpt:resource-tables:single:Llama2-7B:None:mb1:x1",
                   "litgpt:resource-tables:multi:Llama2-7B:None:mb1:x2"):
        assert rows[row_id]["lora_dtype"] == "model"
    qlora = rows["litgpt:resource-tables:single:Llama2-7B:bnb.nf4-dq:mb1:x1"]
    assert (qlora["lora_dtype"], qlora["qlora_quantizer"], qlora["qlora_bnb"]) == ("model", "lightning", "0.41.1")
    assert qlora["in_scope"]
    spec = spec_from_columns({k: "" if v is None else str(v) for k, v in qlora.items()})
    assert spec.training.qlora_keeps_inputs and not spec.training.qlora_kbit_prep
    assert rows["litgpt:resource-tables:single:Llama2-7B:None:mb1:x1"]["qlora_bnb"] == ""  # LoRA: no 4-bit matmul
    assert rows["litgpt:config-hub:tiny-llama/full.yaml:1xA10G"]["lora_dtype"] == "auto"
    as_read = {k: "" if v is None else str(v) for k, v in tiny.items()}  # measurements.csv's strings
    assert run_adapters_in_16bit(spec_from_columns(as_read))


def test_universal_trainer_bf16_loss_path_is_out_of_scope_and_qlora_is_not():
    rows = {r["row_id"]: r for r in _load("public_universal", "extract_universal_llm_trainer.py").extract()}
    assert not rows["universal_llm_trainer:H100:llm_llama3.1_lora"]["in_scope"]
    assert "loss outside the model" in rows["universal_llm_trainer:H100:llm_llama3.1_full"]["assumptions"]
    assert rows["universal_llm_trainer:H100:llm_llama3.1_qlora"]["in_scope"]



def test_answerai_rows_read_the_page_and_bring_sharded_qlora_in_as_qlora_without_kbit_preparation():
    rows = {r["row_id"]: r for r in _load("public_answerai", "extract_answerai_fsdp_qlora.py").extract()}
    lora = {k: r for k, r in rows.items() if ":lora:" in k}
    assert len(lora) == 10 and all(r["in_scope"] and r["complete"] for r in lora.values())
    qlora = {k: r for k, r in rows.items() if ":qlora:" in k}
    # fsdp_qlora's QLoRA is qlora + lora_dtype model; Yi-34B and Mistral-7B-v0.2 stay out (not in the catalogue)
    assert {k for k, r in qlora.items() if r["in_scope"]} == {k for k in qlora if "Llama-2" in k} != set()
    assert all(r["lora_dtype"] == "model" and r["qlora"] for r in qlora.values())
    # peft 0.8-0.10 (the runs' llama-recipes install) casts new adapters to the base layer's bf16: LoRA's too
    assert all(r["lora_dtype"] == "model" and not r["qlora"] for r in lora.values())
    b1 = rows["answerai_fsdp_qlora:3090:Llama-2-7b-hf:lora:b1:s512:allocated"]
    assert b1["quantity"] == "max_allocated" and b1["value"] == 8.28 and b1["value_bytes"] == round(8.28 * 2**30)
    assert rows["answerai_fsdp_qlora:3090:Llama-2-7b-hf:lora:b1:s2048:allocated"]["value"] == 9.16
    ddp = rows["answerai_fsdp_qlora:4090:Llama-2-7b-hf:lora:b4:s2048:ddp:reserved"]
    assert (ddp["method"], ddp["fsdp1_sharding_strategy"], ddp["fsdp1_use_orig_params"]) == ("fsdp1", "NO_SHARD", False)
    off = rows["answerai_fsdp_qlora:4090:Llama-2-7b-hf:lora:b10:s2048:offload:reserved"]
    assert off["fsdp1_cpu_offload"] and off["gpu"] == "rtx4090-24gb" and off["quantity"] == "max_reserved"
    assert (off["lora_rank"], off["lora_dropout"], off["loop"], off["model_code"]) == (64, 0.1, "manual", "4.44")
    assert "o_proj" not in off["lora_targets"]



def test_answerai_rows_have_profiles_of_their_versions_shipped():
    """answer.ai's in-scope rows ask for transformers 4.44's model code (their 4.37-4.39 Llama returns fp32 logits)
    with bf16 adapters (peft 0.8-0.10 casts them to the base's dtype): those profiles ship, traced with that release
    and a peft building the adapters in bf16, so the report needs no torch and no fallback to today's model code."""
    import json

    from estimator.columns import spec_from_columns
    from estimator.models.arch import resolve_arch
    from estimator.models.profiles import profile_key, run_adapters_in_16bit, traced_release

    rows = [r for r in P.load(PUBLIC / "measurements.csv")
            if r["source"] == "answerai_fsdp_qlora" and r["in_scope"] == "True"]
    specs = [spec_from_columns(r) for r in rows]
    keys = {profile_key(resolve_arch(s.model).config_sha, s.training, s.parallel.tp, run_adapters_in_16bit(s))
            for s in specs}
    assert len(rows) == 20 and len(keys) == 3 and all(k.endswith("-a16_tf4.44") for k in keys)
    for key in keys:
        provenance = json.loads((ROOT / "estimator" / "profiles" / f"{key}.json").read_text())["provenance"]
        assert traced_release({"provenance": provenance}) == "4.44" and provenance["peft"] == "0.12.0"


def _peft_experiments():
    return _load("public_peft_experiments", "extract_peft_experiments.py")


def _log_peaks(module, path: str, key: str) -> list[float]:
    """``key``'s value on every line of a committed torchtune-style log, read with a plain regex."""
    entry = next(e for e in module.manifest(module.SOURCE).values() if e["path"] == path)
    text = (module.SOURCES / module.SOURCE / entry["file"]).read_text()
    return [float(v) for v in re.findall(rf"{key}:([0-9.]+)", text)]


def test_peft_experiments_rows_take_the_maximum_after_the_loading_step():
    mod = _peft_experiments()
    rows = {r["row_id"]: r for r in mod.extract()}
    fsdp_log = "torchtune/llama3-lora-fsdp/log_peft.txt"
    reserved = _log_peaks(mod, fsdp_log, "peak_memory_reserved")
    row = rows["peft_experiments:lora-fsdp1-2gpu:max_reserved"]
    # the first line holds model loading and FSDP wrapping (no reset before the loop): above every training step
    assert reserved[0] > max(reserved[1:]) and row["value"] == max(reserved[1:])
    assert row["value_bytes"] == round(max(reserved[1:]) * 1e9) and row["unit"] == "GB"
    allocated = _log_peaks(mod, "torchtune/llama3-lora-single-device/log_peft.txt", "peak_memory_alloc")
    assert rows["peft_experiments:lora-1gpu:max_allocated"]["value"] == max(allocated[1:])


def test_peft_experiments_unit_is_gb_because_gib_would_exceed_the_board():
    mod = _peft_experiments()
    board_gib = mod.RTX4090_TORCH_TOTAL_BYTES / 2**30
    mod._check_unit([{"peak_memory_reserved": board_gib + 0.5}], "log")  # too big as GiB, fits as GB
    with pytest.raises(ValueError, match="exceeds an RTX 4090"):
        mod._check_unit([{"peak_memory_reserved": mod.RTX4090_TORCH_TOTAL_BYTES / 1e9 + 0.5}], "log")


def test_peft_experiments_plateau_counts_lines_at_the_maximum():
    mod = _peft_experiments()
    lines = [{"peak_memory_alloc": v} for v in (1.0, 3.0, 2.0, 3.0, 3.0)]
    assert mod.plateau_count(lines) == 3
    assert mod.plateau_count([{"peak_memory_alloc": 1.0}, {"peak_memory_alloc": 2.0}]) == 1
    steps = [{"step": i, "peak_memory_reserved": v} for i, v in enumerate((1.0, 2.0, 1.5, 1.5, 2.5), start=1)]
    assert mod.reserved_drops(steps) == [(3, 2.0, 1.5)]


def test_peft_experiments_scope_takes_bf16_qlora_and_keeps_torchtune_code_out():
    """The single-GPU QLoRA notebook runs without kbit preparation (``qlora_prep`` none), its adapters fp32 (peft
    1b16753a leaves them so on a uint8-stored base): ``lora_dtype`` auto."""
    rows = _peft_experiments().extract()
    scored = {r["row_id"]: r for r in rows if r["in_scope"]}
    assert sorted(scored) == sorted(f"peft_experiments:{run}:{q}" for run in (
        "lora-1gpu", "lora-fsdp1-2gpu", "qlora-1gpu-bnb0.43.2", "qlora-1gpu-bnb0.43.3")
        for q in ("max_allocated", "max_reserved"))
    for q in ("max_allocated", "max_reserved"):
        qlora = scored[f"peft_experiments:qlora-1gpu-bnb0.43.3:{q}"]
        assert (qlora["qlora"], qlora["qlora_prep"], qlora["lora_dtype"], qlora["precision"], qlora["method"]) == (
            True, "none", "auto", "bf16", "single")
        assert scored[f"peft_experiments:lora-1gpu:{q}"]["lora_dtype"] == "auto"
    fsdp = scored["peft_experiments:lora-fsdp1-2gpu:max_allocated"]
    assert (fsdp["method"], fsdp["world_size"], fsdp["fsdp1_sharding_strategy"], fsdp["fsdp1_use_orig_params"]) == (
        "fsdp1", 2, "FULL_SHARD", False)
    assert (fsdp["grad_accum_steps"], fsdp["grad_ckpt"], fsdp["lora_targets"], fsdp["loop"]) == (
        4, False, "q_proj,v_proj", "trainer")
    for r in rows:
        if r["in_scope"]:
            continue
        assert "torchtune" in r["row_id"] or "fsdp1-offload" in r["row_id"]


def test_peft_experiments_rows_estimate_from_shipped_profiles():
    rows = [r for r in P.load(PUBLIC / "measurements.csv") if r["source"] == "peft_experiments"]
    scored = P.score(rows, allow_build=False, with_baselines=False)
    assert len(scored) == 8
    for item in scored:  # the empty test cache: a profile traced with the rows' model code ships
        assert not item.error and item.model_code == "4.45", (item.row["row_id"], item.error)
        assert item.reserved_source == "replayed"


def test_deepspeed_chat_row_reads_the_log_and_its_command():
    rows = _load("public_ds_chat", "extract_deepspeed_chat.py").extract()
    assert len(rows) == 1
    r = rows[0]
    assert (r["method"], r["world_size"], r["micro_batch_size"], r["seq_len"]) == ("zero2", 16, 8, 512)
    assert (r["precision"], r["optimizer"], r["grad_ckpt"], r["gpu"]) == ("mixed_fp16", "adamw_fused", False,
                                                                          "v100-32gb")
    assert r["quantity"] == "max_allocated" and r["unit"] == "GiB" and r["value"] == 22.95 and r["in_scope"]


# --- calibrate public --fit ---------------------------------------------------------------------------------
def _points(source, allocated_gib, ratio, offset_bytes):
    from calibrate.public_fit import Point

    return [Point(source, a * 2**30, a * 2**30 * (1 + ratio) + offset_bytes,
                  {"row_id": f"{source}:{a}", "world_size": "1", "micro_batch_size": "2", "seq_len": "512",
                   "lora_rank": "0", "method": "single", "precision": "bf16", "optimizer": "adamw", "attn": "sdpa"})
            for a in allocated_gib]


def test_fit_recovers_the_allocator_residual():
    from calibrate.public_fit import fit_slack

    ratio, offset = fit_slack(_points("a", [10, 20, 40], 0.05, 300 * 2**20))
    assert ratio == pytest.approx(0.05, abs=1e-6) and offset == pytest.approx(300 * 2**20, rel=1e-4)


def test_fit_needs_two_sources_and_must_beat_the_prior():
    from calibrate.public_fit import judge

    prior = (0.10, 64 * 2**20)
    one = judge("a100-80gb", _points("a", [10, 20], 0.02, 0), prior)
    assert not one.accepted and "needs 2 sources" in one.refused
    agree = judge("a100-80gb", _points("a", [10, 20], 0.02, 0) + _points("b", [15, 30], 0.02, 0), prior)
    assert agree.accepted and agree.loso_median_pct < agree.prior_median_pct
    # Sources that disagree: the term fitted on one misses the other by more than the prior does -> refused.
    clash = judge("a100-80gb", _points("a", [10, 20], 0.0, 0) + _points("b", [10, 20], 0.25, 0), (0.12, 0.0))
    assert not clash.accepted and "not better than the prior" in clash.refused


def test_fit_is_refused_when_a_held_out_source_gets_worse():
    """Many rows of one source must not outvote a source the fitted term predicts worse than the prior."""
    from calibrate.public_fit import judge

    many = _points("a", [10, 12, 14, 16, 18], 0.30, 0) + _points("b", [11, 13, 15], 0.30, 0)  # the fit helps
    one = _points("one", [30], 0.10, 0)                                                        # the prior's
    fit = judge("a100-80gb", many + one, (0.1, 0.0))
    assert fit.loso_median_pct < fit.prior_median_pct
    assert not fit.accepted and fit.refused.startswith("held out, one is predicted worse")


def test_accepted_fit_ships_a_valid_file_the_estimator_names(tmp_path):
    from calibrate.public_fit import judge, write_accepted
    from estimator.hardware.residuals import load_coefficients, provenance_notes

    data = tmp_path / "m.csv"
    data.write_text("x\n")
    fit = judge("a100-80gb", _points("a", [10, 20], 0.02, 0) + _points("b", [15, 30], 0.02, 0), (0.1, 0.0))
    [path] = write_accepted([fit], data, tmp_path / "new")  # a folder that does not exist yet
    coeffs = load_coefficients("a100-80gb", path)
    assert coeffs.calibrated and coeffs.reserved_slack_ratio == pytest.approx(0.02, abs=1e-6)
    assert coeffs.provenance["sources"] == ["a", "b"] and len(coeffs.provenance["data_sha256"]) == 64
    [note] = provenance_notes(coeffs)
    assert "calibrated on published measurements (4 rows, sources a, b" in note


def test_cli_fit_refuses_a_single_source_key(tmp_path, capsys):
    """One source's reserved rows on a path the estimator does not replay (ZeRO-3): the formula's slack is not
    identified by one source. (Rows the estimator replays never feed the formula.)"""
    common = _common()
    zero3 = RunSpec(model=MODEL, gpu="a100-40gb", parallel=ParallelSpec(method="zero3", world_size=2),
                    training=TrainingSpec(micro_batch_size=2, seq_len=256, precision="mixed_bf16"))
    est = estimate(zero3, allow_build=False)
    assert est.reserved_source == "prior"
    path = tmp_path / "measurements.csv"
    common.write_csv([_row(common, f"z:{i}", zero3, "max_reserved", int(est.peak_reserved_bytes * f), source="one")
                      for i, f in enumerate((1.1, 1.2))], path)
    out = tmp_path / "report"
    code = main(["public", "--data", str(path), "--out", str(out), "--no-build", "--no-baselines", "--fit",
                 "--coefficients-out", str(tmp_path)])
    assert code == 0 and not list(tmp_path.glob("*.json"))
    assert "needs 2 sources" in capsys.readouterr().out
    assert "## Fit" in (out / "public.md").read_text()


def test_html_tables_expand_rowspans():
    module = _load("swift", "extract_ms_swift_benchmark.py")
    text = ("## A\n### LoRA\n<table><tr><td>Model Type [LoRA]</td><td>Max Length</td></tr>"
            "<tr><td rowspan=\"2\">m</td><td>512</td></tr><tr><td>1024</td></tr></table>")
    [(heading, body)] = module.html_tables(text)
    assert heading == "A / LoRA" and body == [{"Model Type [LoRA]": "m", "Max Length": "512"},
                                              {"Model Type [LoRA]": "m", "Max Length": "1024"}]


def test_fms_acceleration_rows_read_the_source_as_it_ran():
    rows = {r["row_id"]: r for r in _load("public_fms", "extract_fms_acceleration.py").extract()}
    base = "fms_acceleration:{}:none:{}:{}:x{}:b{}:{}"
    # packed rows: the run's own tokens/s x runtime gives 4096 for Mistral, 2048 for SantaCoder (its tokenizer)
    assert rows[base.format("24bdadb228e2", "Mistral-7B-v0.1", "full", 1, 4, "alloc")]["seq_len"] == 4096
    assert rows[base.format("24bdadb228e2", "gpt_bigcode-santacoder", "full", 1, 4, "nvml")]["seq_len"] == 2048
    # --bf16 under FSDP: fp32 shards for full fine-tuning, the frozen base stays bf16 with LoRA
    assert rows[base.format("4e81c64453ec", "Mistral-7B-v0.1", "full", 2, 2, "alloc")]["precision"] == "mixed_bf16"
    assert rows[base.format("4e81c64453ec", "Mistral-7B-v0.1", "lora", 2, 2, "alloc")]["precision"] == "bf16"
    assert rows[base.format("24bdadb228e2", "Mistral-7B-v0.1", "full", 2, 2, "alloc")]["method"] == "fsdp1"
    nvml = rows[base.format("24bdadb228e2", "Mistral-7B-v0.1", "full", 1, 4, "nvml")]
    assert nvml["quantity"] == "nvml_used" and nvml["unit"] == "MiB" and nvml["in_scope"]
    # runs without a train_loss did not train (OOM) and give no row; fp16 weights are out of scope
    assert not any(":Llama-2-70b-hf:full:" in k for k in rows)
    assert not any(r["in_scope"] for k, r in rows.items() if k.split(":")[1] in ("c3a069c842f2", "b6c1455bf12b"))


def test_peft_accelerate_docs_rows_take_the_guides_figures_as_gib_and_keep_qlora_out():
    rows = {r["row_id"]: r for r in _load("public_peft_docs", "extract_peft_accelerate_docs.py").extract()}
    z3 = rows["peft_accelerate_docs:deepspeed:lora:Llama-2-70b-hf:x8"]
    assert (z3["method"], z3["world_size"], z3["micro_batch_size"], z3["grad_accum_steps"]) == ("zero3", 8, 8, 4)
    assert z3["value_bytes"] == 64 * 2**30 and z3["quantity"] == "nvml_used" and z3["in_scope"]
    fsdp = rows["peft_accelerate_docs:fsdp:lora:Llama-2-70b-hf:x8"]
    assert fsdp["value"] == 72 and "FULL_STATE_DICT" in fsdp["assumptions"]  # 72 while training, 80 saving
    qlora = [r for k, r in rows.items() if ":qlora:" in k]
    assert len(qlora) == 3 and not any(r["in_scope"] or r["complete"] for r in qlora)



def _metamath_run(name, max_gib, cap=768, slope_gib=0.0236, intercept_gib=6.1, jitter=None):
    """A MetaMathQA result file whose 20 windows' mean reserved is ``intercept + slope x tokens per sample``."""
    means = [200 + 0.7 * i for i in range(20)]
    windows = [{"step": 250 * (i + 1), "train samples": 1000 * (i + 1), "train time": 30.0,
                "tokens / sec": m * 1000 / 30.0,
                "mem reserved avg": (intercept_gib + slope_gib * m + (jitter or [0] * 20)[i]) * 2**30}
               for i, m in enumerate(means)]
    train = {"max_seq_length": cap, "batch_size": 4, "max_steps": 5000, "query_template": "Q: {query}",
             "model_id": "meta-llama/Llama-3.2-3B"}
    return {"run_info": {"experiment_name": name, "train_config": train},
            "meta_info": {"dataset_info": {"metamath": {"sha": "d"}}, "model_info": {"sha": "m"}},
            "train_info": {"status": "success", "metrics": windows, "cuda_memory_max": int(max_gib * 2**30)}}


def test_metamathqa_runs_own_windows_refute_the_length_cap():
    mod = _load("public_peft_metamathqa", "extract_peft_metamathqa.py")
    short = mod.cap_line(_metamath_run("short", 20.74))
    assert short["tokens_at_max"] == pytest.approx((20.74 - 6.1) / 0.0236, rel=1e-6)
    assert short["max_gib"] < short["at_cap_gib"]  # the max lies below any batch at the cap: cap refuted
    reached = mod.cap_line(_metamath_run("reached", 6.1 + 0.0236 * 768))
    assert reached["max_gib"] > reached["at_cap_gib"]  # a max at the cap's line is consistent with the cap
    noisy = mod.cap_line(_metamath_run("noisy", 20.74, jitter=[0.3 * (-1) ** i for i in range(20)]))
    assert noisy is None  # windows not linear in the length (cache emptied every 10 steps): no evidence
    evidence = mod._cap_evidence([_metamath_run("short", 20.74), _metamath_run("reached", 24.2)])
    (why,) = evidence.values()
    assert "1 runs on the same batches" in why and "cap was not reached" in why
    assert not mod._cap_evidence([_metamath_run("reached", 24.2)])


def test_metamathqa_rows_without_their_longest_batch_are_incomplete():
    rows = _load("public_peft_metamathqa", "extract_peft_metamathqa.py").extract()
    capped = [r for r in rows if r["max_length"] == 768]
    assert capped and not any(r["complete"] for r in capped)
    assert all(r["missing"].startswith(("the longest training batch", "run status")) for r in capped)

def _context_points(source, device_gib, context_bytes):
    """nvml_used rows whose device level is the estimate's base (less its context) + ``context_bytes``."""
    from calibrate.public_fit import Point

    return [Point(source, d * 2**30, d * 2**30 + context_bytes,
                  {"row_id": f"{source}:{d}", "world_size": "2", "micro_batch_size": "4", "seq_len": "4096",
                   "lora_rank": "16", "method": "fsdp", "precision": "bf16", "optimizer": "adamw", "attn": "flash"})
            for d in device_gib]


def test_the_cuda_context_is_fitted_from_device_rows_and_ships_without_turning_the_replay_off(tmp_path):
    """nvml_used rows pin the CUDA context: recovered from agreeing sources, refused from one, and a file that
    fitted only the context keeps the reserved replay (its reserved terms are still the priors)."""
    from calibrate.public_fit import CONTEXT, fit_context, judge, write_accepted
    from estimator import api
    from estimator.hardware.residuals import load_coefficients, provenance_notes
    from estimator.spec import RunSpec, TrainingSpec

    real = 700 * 2**20
    (context,) = fit_context(_context_points("a", [20, 40, 60], real))
    assert context == pytest.approx(real, rel=1e-9)
    prior = (float(load_coefficients("a100-80gb").cuda_context_bytes),)
    one = judge("a100-80gb", _context_points("a", [20, 40], real), prior, CONTEXT)
    assert not one.accepted and "needs 2 sources" in one.refused
    fit = judge("a100-80gb", _context_points("a", [20, 40], real) + _context_points("b", [30, 50], real), prior,
                CONTEXT)
    assert fit.accepted and fit.loso_median_pct < fit.prior_median_pct
    data = tmp_path / "m.csv"
    data.write_text("x\n")
    [path] = write_accepted([fit], data, tmp_path / "coeffs")
    coeffs = load_coefficients("a100-80gb", path)
    assert coeffs.calibrated and coeffs.cuda_context_bytes == pytest.approx(real, abs=1)
    assert coeffs.reserved_slack_ratio == load_coefficients("a100-80gb").reserved_slack_ratio
    assert "fitted: cuda_context_bytes" in provenance_notes(coeffs)[0]
    spec = RunSpec(model="Qwen/Qwen2.5-0.5B", gpu="a100-80gb",
                   training=TrainingSpec(precision="bf16", micro_batch_size=2, seq_len=512))
    calibrated, shipped = api.estimate(spec, path, allow_build=False), api.estimate(spec, allow_build=False)
    assert calibrated.reserved_source == shipped.reserved_source == "replayed"
    assert calibrated.peak_reserved_bytes == shipped.peak_reserved_bytes
    assert calibrated.peak_device_bytes - shipped.peak_device_bytes == coeffs.cuda_context_bytes - int(prior[0])


def test_device_rows_are_predicted_at_the_level_the_steps_hold_after_a_retry():
    """fms-acceleration's Mistral-7B full fine-tuning on one A100-80GB: at b8 the replay reaches the capacity,
    releases its cache and retries, and every later step holds less (a 1 s nvidia-smi sampler of a 100-step
    run reads that level: the published b8 figure is below the b4 one); at b4 it never retries. ``nvml_used``
    rows take the held level, ``max_allocated`` rows stay on the peak."""
    rows = {r["row_id"]: r for r in P.load(P.DEFAULT_DATA)}
    head = "fms_acceleration:9239802cc91a:none:Mistral-7B-v0.1:full:x1"
    picked = [rows[f"{head}:{b}:{q}"] for b in ("b4", "b8") for q in ("nvml", "alloc")]
    scored = {s.row["row_id"]: s for s in P.score(picked, allow_build=False, with_baselines=False)}
    for b, retries in (("b4", False), ("b8", True)):
        est = estimate(P.spec_from_columns(rows[f"{head}:{b}:nvml"]), allow_build=False)
        assert (est.held_device_bytes < est.peak_device_bytes) is retries
        assert (est.ranks[0].num_alloc_retries > 0) is retries
        assert scored[f"{head}:{b}:nvml"].predicted_bytes == est.held_device_bytes
        assert scored[f"{head}:{b}:alloc"].predicted_bytes == est.peak_allocated_bytes
    # the held level is below the capacity the peak reached, and above the allocated peak
    b8 = estimate(P.spec_from_columns(rows[f"{head}:b8:nvml"]), allow_build=False)
    assert b8.peak_allocated_bytes < b8.held_device_bytes < b8.capacity_bytes
    assert abs(scored[f"{head}:b8:nvml"].err_pct) < P.OUTLIER_PCT


def test_full_range_slices_follow_the_rows_torch_release():
    """torch 2.4 and before record a SliceBackward for a full-range ``:`` (TrainingSpec.full_range_slices)."""
    common = _common()
    assert common.records_full_range_slices("2.4.1") and common.records_full_range_slices("2.1.0+cu121")
    assert not common.records_full_range_slices("2.11.0+cu130") and not common.records_full_range_slices("")
    with open(PUBLIC / "measurements.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert all(r["full_range_slices"] == str(common.records_full_range_slices(r["torch_version"])) for r in rows)


SWIFT_YI = "ms_swift_benchmark:LoRA:yi-6b-chat:max_length="


def test_swift_rows_rescore_over_their_epoch_of_deleted_lengths():
    """ms-swift's benchmark: batch-1 samples of cls-fudan-news-zh (4,959 rows, 3234 +- 2548 tokens), those past
    max_length deleted, 1,000 sampled above 2048, in random order: the rows are scored over that epoch."""
    rows = {r["row_id"]: r for r in P.load(P.DEFAULT_DATA)}
    lengths, options, what = P.row_epoch(rows[SWIFT_YI + "512"], 512)
    assert len(lengths) == 4959 and options.truncation == "delete" and options.batching == "random"
    assert sum(n <= 512 for n in lengths) == 53 and "delete past 512" in what
    lengths, _, _ = P.row_epoch(rows[SWIFT_YI + "4096"], 4096)
    assert len(lengths) == 1000
    assert P.row_epoch({**rows[SWIFT_YI + "512"], "rescore_lengths": "False"}, 512) is None
    spec, sequence = P._scored_spec(rows[SWIFT_YI + "512"])  # statistics, not a step sequence: the epoch scores it
    assert sequence is None and spec.training.seq_len == 512


@pytest.mark.slow
def test_swift_512_row_reserves_more_over_its_epoch_than_over_identical_steps():
    rows = {r["row_id"]: r for r in P.load(P.DEFAULT_DATA)}
    # no shipped Yi profile: traced once (torch, meta device) into the cache
    [item] = P.score([rows[SWIFT_YI + "512"]], with_baselines=False)
    same = estimate(P.spec_from_columns(rows[SWIFT_YI + "512"]))
    assert "53" not in item.epoch and "4959 lognormal lengths" in item.epoch
    # the same allocated peak (the longest kept sample reaches 512); the cache holds blocks of 53 distinct lengths
    assert item.allocated_bytes == pytest.approx(same.peak_allocated_bytes, rel=0.01)
    assert item.predicted_bytes > same.peak_reserved_bytes + 2**30
