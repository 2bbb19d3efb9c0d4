"""``TrainingSpec.lora_dtype``: LoRA adapters built in the model's dtype (Lightning's ``bf16-true``, LitGPT;
``get_peft_model(..., autocast_adapter_dtype=False)``) read the profile traced with 16-bit adapters whatever the
method; ``auto`` keeps each method's rule (peft's fp32 adapters unless DeepSpeed or FSDP casts them)."""

import pytest

from estimator.columns import spec_columns, spec_from_columns
from estimator.io.cli import _training, build_parser
from estimator.models.profiles import adapters_in_16bit, profile_key
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec

LORA = {"lora_rank": 8, "lora_targets": "q_proj,v_proj"}


@pytest.mark.parametrize("method, precision, lora_dtype, expected", [
    ("single", "bf16", "auto", False),  # peft's default: fp32 adapters beside the bf16 model
    ("single", "bf16", "model", True),  # LitGPT bf16-true: adapters bf16
    ("single", "amp_bf16", "model", False),  # autocast over fp32 weights: the model's dtype is fp32
    ("single", "fp32", "model", False),  # the model's dtype is fp32: nothing 16-bit
    ("single", "mixed_bf16", "model", False),  # mixed precision keeps fp32 weights, adapters too
    ("ddp", "bf16", "model", True),
    ("zero3", "bf16", "model", True),  # built in bf16 before zero.Init: nothing to skip
    ("zero3", "mixed_bf16", "auto", False),
])
def test_adapters_in_the_model_dtype_are_16_bit_in_a_16_bit_run(method, precision, lora_dtype, expected):
    training = TrainingSpec(precision=precision, lora_dtype=lora_dtype, **LORA)
    assert adapters_in_16bit(training, method) is expected
    assert profile_key("0" * 16, training, 1, adapters_in_16bit(training, method)).endswith("-a16") is expected


@pytest.mark.parametrize("fields, message", [
    ({"lora_dtype": "bf16", **LORA}, "lora_dtype"),
    ({"lora_dtype": "model"}, "need LoRA"),
    ({"lora_dtype": "model", "qlora": True, **LORA}, "QLoRA"),
])
def test_lora_dtype_refusals_are_one_line(fields, message):
    with pytest.raises(ValueError) as err:
        TrainingSpec(precision="bf16", **fields)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_auto_leaves_spec_ids_as_they_were_and_model_changes_them():
    auto = RunSpec(model="facebook/opt-125m", gpu="h100-80gb", parallel=ParallelSpec(),
                   training=TrainingSpec(precision="bf16", **LORA))
    model = RunSpec(model=auto.model, gpu=auto.gpu, parallel=auto.parallel,
                    training=TrainingSpec(precision="bf16", lora_dtype="model", **LORA))
    assert "lora_dtype" not in auto._canonical_dict()["training"]
    assert model._canonical_dict()["training"]["lora_dtype"] == "model" and model.spec_id != auto.spec_id


def test_columns_round_trip_and_tables_without_the_column_read_auto():
    spec = RunSpec(model="facebook/opt-125m", gpu="h100-80gb", parallel=ParallelSpec(),
                   training=TrainingSpec(precision="bf16", lora_dtype="model", **LORA))
    row = {k: str(v) for k, v in spec_columns(spec).items()}
    row["world_size"] = "1"
    assert spec_from_columns(row).training.lora_dtype == "model"
    row["lora_dtype"] = ""  # a table written before the column
    assert spec_from_columns(row).training.lora_dtype == "auto"


def test_cli_flag_sets_the_adapter_dtype():
    args = build_parser().parse_args(["--model", "facebook/opt-125m", "--gpu", "h100-80gb", "--precision", "bf16",
                                      "--lora-rank", "8", "--lora-dtype", "model"])
    assert _training(args, TrainingSpec()).lora_dtype == "model"
