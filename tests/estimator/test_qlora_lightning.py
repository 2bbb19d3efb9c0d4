"""LitGPT's QLoRA: Lightning's quantization (``qlora_quantizer`` lightning: every Linear, the head included, from
fp16) and bitsandbytes before 0.43.2 (``qlora_bnb``: each 4-bit Linear keeps its input, ``estimator.profiler.
bnb_041``); what is refused in one line; the kept bytes of a traced tiny Llama against the count made from
bitsandbytes 0.41.1's source (``benchmarks/qlora_bf16_check.py``)."""

import json

import pytest

from estimator.columns import spec_columns, spec_from_columns
from estimator.io.cli import _training, build_parser
from estimator.models.profiles import profile_key
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec, bnb_keeps_4bit_inputs, bnb_release

LIGHTNING = {"precision": "bf16", "lora_rank": 8, "lora_targets": "q_proj,v_proj", "qlora": True,
             "lora_dtype": "model", "qlora_quantizer": "lightning"}


@pytest.mark.parametrize("version, release, keeps", [
    ("0.41.1", (0, 41, 1), True), ("0.43.1", (0, 43, 1), True), ("0.43.2", (0, 43, 2), False),
    ("0.43", (0, 43, 0), True), ("0.50.2", (0, 50, 2), False), ("0.44.0.dev0", (0, 44, 0), False),
    ("1.0", (1, 0, 0), False), ("latest", None, False)])
def test_bitsandbytes_before_0_43_2_keeps_the_4bit_inputs(version, release, keeps):
    assert bnb_release(version) == release
    assert bnb_keeps_4bit_inputs(release) is keeps


def test_the_declared_release_decides_and_only_for_qlora():
    assert TrainingSpec(**LIGHTNING, qlora_bnb="0.41.1").qlora_keeps_inputs
    assert not TrainingSpec(**LIGHTNING, qlora_bnb="0.43.2").qlora_keeps_inputs
    assert not TrainingSpec(precision="bf16", lora_rank=8).qlora_keeps_inputs


@pytest.mark.parametrize("fields, field, message", [
    ({**LIGHTNING, "qlora_quantizer": "torchao"}, "qlora_quantizer", "is not one of"),
    ({**LIGHTNING, "lora_dtype": "auto"}, "qlora_quantizer", "without kbit preparation"),
    ({**LIGHTNING, "qlora": False, "lora_dtype": "auto"}, "qlora_quantizer", "without kbit preparation"),
    ({**LIGHTNING, "qlora_bnb": "new"}, "qlora_bnb", "0.41.1"),
    ({"precision": "bf16", "lora_rank": 8, "qlora_bnb": "0.41.1"}, "qlora_bnb", "QLoRA only"),
])
def test_refusals_are_one_line(fields, field, message):
    with pytest.raises(ValueError) as err:
        TrainingSpec(**fields)
    assert str(err.value).startswith(field) and message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("method, extra, field", [
    ("fsdp1", {}, "qlora_quantizer"),
    ("fsdp1", {"qlora_quantizer": "transformers", "qlora_bnb": "0.41.1"}, "qlora_bnb"),
    ("ddp", {"qlora_bnb": "0.41.1"}, None)])
def test_lightning_and_kept_inputs_are_modelled_on_one_gpu_or_ddp(method, extra, field):
    def spec():
        return RunSpec(model="meta-llama/Llama-2-7b-hf", gpu="a100-40gb",
                       parallel=ParallelSpec(method=method, world_size=2), training=TrainingSpec(**{**LIGHTNING,
                                                                                                    **extra}))
    if field is None:
        assert spec().training.qlora_keeps_inputs
        return
    with pytest.raises(ValueError) as err:
        spec()
    assert str(err.value).startswith(field) and "\n" not in str(err.value)


def test_profile_keys_name_the_quantizer_and_the_kept_inputs():
    plain = TrainingSpec(**{**LIGHTNING, "qlora_quantizer": "transformers"}, qlora_bnb="0.50.2")
    assert profile_key("0" * 16, plain, 1, True).endswith("qlora8-q_proj,v_proj-a16")
    lightning = TrainingSpec(**LIGHTNING, qlora_bnb="0.41.1")
    assert profile_key("0" * 16, lightning, 1, True).endswith("qlora8-q_proj,v_proj-a16-lightning-keepin")


def test_spec_ids_stay_at_the_defaults_and_columns_round_trip():
    base = RunSpec(model="meta-llama/Llama-2-7b-hf", gpu="a100-40gb", training=TrainingSpec(
        **{**LIGHTNING, "qlora_quantizer": "transformers"}))
    assert not {"qlora_quantizer", "qlora_bnb"} & set(base._canonical_dict()["training"])
    lit = base.replace(**{"training.qlora_quantizer": "lightning", "training.qlora_bnb": "0.41.1"})
    assert lit.spec_id != base.spec_id
    row = {k: "" if v is None else str(v) for k, v in spec_columns(lit).items()}
    row["world_size"] = "1"  # an identity column (spec_columns leaves it to the caller)
    back = spec_from_columns(row).training
    assert (back.qlora_quantizer, back.qlora_bnb) == ("lightning", "0.41.1")
    row["qlora_quantizer"], row["qlora_bnb"] = "", ""  # a table written before the columns
    back = spec_from_columns(row).training
    assert (back.qlora_quantizer, back.qlora_bnb) == ("transformers", "")


def test_cli_flags_reach_the_spec():
    args = build_parser().parse_args(["--model", "meta-llama/Llama-2-7b-hf", "--gpu", "a100-40gb", "--precision",
                                      "bf16", "--lora-rank", "8", "--qlora", "--lora-dtype", "model",
                                      "--qlora-quantizer", "lightning", "--qlora-bnb", "0.41.1"])
    training = _training(args, TrainingSpec())
    assert (training.qlora_quantizer, training.qlora_bnb, training.qlora_keeps_inputs) == ("lightning", "0.41.1",
                                                                                           True)


def test_public_rows_take_the_release_from_their_bitsandbytes_version():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "data" / "public"))
    from common import row

    fields = {"row_id": "x", "quantity": "max_allocated", "scope": "per_gpu", "loop": "manual", "padding": "",
              "bitsandbytes_version": "0.41.1"}
    assert row(**fields, qlora=True)["qlora_bnb"] == "0.41.1"
    assert row(**fields, qlora=False)["qlora_bnb"] == ""


@pytest.mark.slow
@pytest.mark.parametrize("lightning", [False, True])
def test_kept_inputs_are_what_bitsandbytes_0_41_1_keeps(tmp_path, lightning):
    """The traced difference 0.41.1 - 0.43.2 equals the count from 0.41.1's source (dropout: no adapter saves a
    4-bit Linear's input itself); Lightning's head is 4-bit and keeps the final norm's output too."""
    import sys
    from pathlib import Path

    from estimator.api import estimate

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from qlora_bf16_check import CONFIG, kept_input_count, spec_for

    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    peaks = {bnb: estimate(spec_for(path, 2, 64, False, "sdpa", "auto", dropout=0.05, lightning=lightning,
                                    bnb=bnb)).ranks[0].traced_allocated_bytes for bnb in ("0.41.1", "0.43.2")}
    assert peaks["0.41.1"] - peaks["0.43.2"] == kept_input_count(2, 64, False, lightning)
