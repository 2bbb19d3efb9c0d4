"""``TrainingSpec.model_code``: which transformers release's model code the estimate describes."""

import csv
import dataclasses
import json

import pytest

from estimator.columns import spec_columns, spec_from_columns
from estimator.models.profiles import installed_version, profile_key, versions_note
from estimator.spec import RunSpec, TrainingSpec, model_code_release


def test_model_code_is_a_release_and_defaults_to_the_shipped_one():
    assert TrainingSpec().model_code == ""
    assert TrainingSpec(model_code="4.45.2").model_code == "4.45.2"
    for bad in ("4", "four.45", "latest", 4.45):
        with pytest.raises(ValueError, match="^model_code: must be a transformers release such as 4.45"):
            TrainingSpec(model_code=bad)
    assert [model_code_release(v) for v in ("4.45.2", "5.0.0rc1", "4.48.1+cu", "4.x")] == ["4.45", "5.0", "4.48", None]


def test_the_default_keeps_spec_ids_and_columns_and_older_tables_mean_the_default():
    plain = RunSpec()
    assert dataclasses.replace(plain, training=TrainingSpec(model_code="")).spec_id == plain.spec_id
    assert RunSpec(training=TrainingSpec(model_code="4.45")).spec_id != plain.spec_id
    row = {k: ("" if v is None else str(v)) for k, v in spec_columns(RunSpec(training=TrainingSpec(model_code="4.45")))
           .items()}
    row["world_size"] = "1"
    assert spec_from_columns(row).training.model_code == "4.45"
    del row["model_code"]
    assert spec_from_columns(row).training.model_code == ""


def test_profile_keys_name_the_release_only_when_one_is_asked_for():
    default = profile_key("abc", TrainingSpec())
    assert profile_key("abc", TrainingSpec(model_code="4.45.2")) == default + "_tf4.45"
    assert profile_key("abc", TrainingSpec(model_code="4.45"), tp=2) == default + "_tp2_tf4.45"


def test_the_note_says_which_model_code_the_estimate_describes():
    profile = {"provenance": {"transformers": "5.23.0", "torch": "2.13.0+cpu"}}
    assert versions_note(profile, model_code="5.23").endswith("(the model code of transformers 5.23, as asked)")
    missing = versions_note(profile, model_code="4.45.2")
    assert "no profile of transformers 4.45's model code" in missing and missing.endswith("the estimate is for 5.23.0")
    assert "as asked" not in versions_note(profile, installed_transformers="5.24.0")


def test_shipped_release_profiles_follow_each_release_s_loss_path():
    """Mistral-7B with LoRA under the fms-acceleration rows' releases. 4.45's ``forward`` upcasts the logits to fp32
    (the 16-bit ones are freed) and the loss takes a shifted fp32 copy; 4.48 keeps the 16-bit logits in the output
    and its ``loss_function`` upcasts them and shifts the copy: one 16-bit logits tensor more at the forward's end.
    Both profiles are shipped, so no torch is needed, and each estimate names its model code."""
    from estimator.api import estimate

    base = TrainingSpec(micro_batch_size=4, seq_len=4096, precision="bf16", attn="flash", grad_ckpt=True,
                        lora_rank=16, lora_targets="k_proj,o_proj,q_proj,v_proj", lora_dropout=0.1)
    spec = RunSpec(model="mistralai/Mistral-7B-v0.1", gpu="a100-80gb", training=base)
    est = {code: estimate(dataclasses.replace(spec, training=dataclasses.replace(base, model_code=code)),
                          allow_build=False) for code in ("4.45.2", "4.48.1")}
    logits_16bit = 4 * 4096 * 32000 * 2
    assert est["4.48.1"].peak_allocated_bytes - est["4.45.2"].peak_allocated_bytes == pytest.approx(logits_16bit,
                                                                                                     rel=0.01)
    assert all(e.phase.startswith("forward") for e in est.values())
    assert any("traced with transformers 4.45.2" in n and "4.45, as asked" in n for n in est["4.45.2"].notes)


def test_a_release_without_a_profile_falls_back_to_the_default_and_says_so():
    from estimator.api import estimate

    spec = RunSpec(model="mistralai/Mistral-7B-v0.1", training=TrainingSpec(model_code="3.9"))
    est = estimate(spec, allow_build=True)  # 3.9 is not installed: nothing is traced, the default stands in
    assert est.peak_allocated_bytes == estimate(RunSpec(model="mistralai/Mistral-7B-v0.1")).peak_allocated_bytes
    assert any("no profile of transformers 3.9's model code" in n for n in est.notes)


def test_the_installed_release_is_traced_under_its_own_key(tmp_path):
    pytest.importorskip("torch")
    from estimator.api import estimate

    from .test_matches_trace import TINY

    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY["llama"]))
    release = model_code_release(installed_version("transformers"))
    training = TrainingSpec(precision="bf16", micro_batch_size=2, seq_len=64)
    spec = RunSpec(model=str(path), gpu="h100-80gb", training=training)
    asked = estimate(dataclasses.replace(spec, training=dataclasses.replace(training, model_code=release)))
    assert any(f"transformers {release}, as asked" in n for n in asked.notes)
    assert asked.peak_allocated_bytes == estimate(spec).peak_allocated_bytes  # the same code, traced twice


def test_cli_takes_model_code_and_rejects_a_bad_one(capsys):
    from estimator.io.cli import main

    assert main(["--model", "mistralai/Mistral-7B-v0.1", "--model-code", "4.45", "--precision", "bf16",
                 "--attn", "flash", "--grad-ckpt", "--seq-len", "4096", "--micro-batch-size", "4"]) == 0
    assert "as asked" in capsys.readouterr().out
    assert main(["--model", "mistralai/Mistral-7B-v0.1", "--model-code", "latest"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model_code" in err[0]


def test_ship_lists_one_spec_per_profile_of_a_release(tmp_path):
    from estimator.profiler.ship import specs_of_release

    rows = []
    for b, code in ((4, "4.45.2"), (8, "4.45.2"), (4, "4.48.1")):
        row = {k: ("" if v is None else str(v)) for k, v in spec_columns(RunSpec(
            model="mistralai/Mistral-7B-v0.1", training=TrainingSpec(micro_batch_size=b, model_code=code))).items()}
        rows.append(row | {"world_size": "1", "complete": "True", "in_scope": "True"})
    table = tmp_path / "rows.csv"
    with table.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    assert [s.training.micro_batch_size for s in specs_of_release(table, "4.45")] == [4]
    assert len(specs_of_release(table, "4.48")) == 1 and specs_of_release(table, "4.50") == []


def test_the_plan_names_the_model_code_it_describes(tmp_path):
    pytest.importorskip("torch")
    from estimator.planning.plan import plan

    from .test_matches_trace import TINY

    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY["llama"]))
    result = plan(str(path), gpus=1, gpu="h100-80gb", seq_len=64, methods=["single"], ckpt_options=(False,),
                  model_code="3.9")
    assert any(n.startswith("model code:") and "no profile of transformers 3.9's model code" in n
               for n in result.notes)



def test_a_profile_traced_from_an_asset_config_names_its_catalogue_model(tmp_path):
    """A harness asset (a few layers of a catalogue model) labels itself 'X, first N layers'; its profile is keyed
    by the catalogue model's fingerprint and serves that model, so it is named after it. A config of no catalogue
    model keeps its own name."""
    import json

    from estimator.models.arch import load_config, resolve_arch
    from estimator.profiler.ship import catalogue_name

    asset = resolve_arch("harness/assets/models/mixtral-8x7b-2l.json")
    assert asset.name != "mistralai/Mixtral-8x7B-v0.1"
    assert catalogue_name(asset) == "mistralai/Mixtral-8x7B-v0.1"
    assert catalogue_name(resolve_arch("meta-llama/Llama-3.2-1B")) == "meta-llama/Llama-3.2-1B"
    other = {**load_config("meta-llama/Llama-3.2-1B"), "hidden_size": 1024, "_name_or_path": "mine/llama-narrow"}
    (tmp_path / "config.json").write_text(json.dumps(other))
    assert catalogue_name(resolve_arch(str(tmp_path))) == "mine/llama-narrow"


def test_ship_lists_the_plain_and_checkpointed_profiles_of_an_every_k_row(tmp_path):
    from estimator.models.arch import resolve_arch
    from estimator.profiler.ship import _row_profile_key, specs_of_release

    spec = RunSpec(model="mistralai/Mistral-7B-v0.1",
                   training=TrainingSpec(grad_ckpt=True, ckpt_policy="every-k:2", model_code="4.45.2"))
    row = {k: ("" if v is None else str(v)) for k, v in spec_columns(spec).items()}
    table = tmp_path / "rows.csv"
    with table.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(row) + ["world_size", "complete", "in_scope"])
        writer.writeheader()
        writer.writerow(row | {"world_size": "1", "complete": "True", "in_scope": "True"})
    specs = specs_of_release(table, "4.45")
    sha = resolve_arch(spec.model).config_sha
    tokens = [set(_row_profile_key(s, sha).split("_")) for s in specs]
    assert len(specs) == 2 and {"ckpt"} <= tokens[1] and {"nockpt"} <= tokens[0]
    assert all(not s.training.ckpt_policy for s in specs)


@pytest.mark.parametrize("training", [
    TrainingSpec(precision="mixed_bf16", attn="sdpa", grad_ckpt=True, micro_batch_size=16, seq_len=2048),
    TrainingSpec(precision="mixed_fp16", attn="eager", grad_ckpt=True, micro_batch_size=32, seq_len=512),
], ids=["mixed_bf16-sdpa", "mixed_fp16-eager"])
def test_checkpointed_codegen_under_5_17_has_its_own_profile(training):
    """CodeGen's attention differs by release: 5.17's ``_attn`` has no SDPA path (fp32 scores, the mask sum, then
    the division), 5.24 runs SDPA or an eager path that scales first. The H200's checkpointed CodeGen rows ran
    5.17; their estimates must not fall back to the 5.24 profile (reserved -29 % at mb16 s2048 with SDPA's
    profile, +18 % for LLMem's mb32 point with the 5.24 eager one). Shipped profiles: no torch needed."""
    from estimator.api import estimate

    spec = RunSpec(model="Salesforce/codegen-350M-nl", gpu="h200-141gb",
                   training=dataclasses.replace(training, model_code="5.17.0"))
    est = estimate(spec, allow_build=False)
    default = estimate(dataclasses.replace(spec, training=training), allow_build=False)
    assert est.model_code == "5.17" and not any("no profile of transformers" in n for n in est.notes)
    assert any("has no sdpa path; estimated as eager" in n for n in est.notes) == (training.attn == "sdpa")
    assert est.peak_reserved_bytes != default.peak_reserved_bytes
