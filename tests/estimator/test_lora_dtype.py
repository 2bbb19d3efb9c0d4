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
    ({"lora_dtype": "model", "qlora": True, "precision": "mixed_bf16", **LORA}, "pure bf16"),
    ({"lora_dtype": "model", "qlora": True, "precision": "amp_bf16", **LORA}, "pure bf16"),
])
def test_lora_dtype_refusals_are_one_line(fields, message):
    with pytest.raises(ValueError) as err:
        TrainingSpec(**{"precision": "bf16", **fields})
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("method, refused", [("single", False), ("ddp", False), ("zero2", True), ("zero3", True)])
def test_qlora_without_kbit_preparation_is_modelled_on_one_gpu_or_ddp(method, refused):
    def spec():
        return RunSpec(model="facebook/opt-125m", gpu="h100-80gb", parallel=ParallelSpec(method=method, world_size=2
                                                                                           if method != "single" else 1),
                       training=TrainingSpec(precision="bf16", qlora=True, lora_dtype="model", **LORA))
    if not refused:
        assert spec().training.qlora and not spec().training.qlora_kbit_prep
        return
    with pytest.raises(ValueError) as err:
        spec()
    assert str(err.value).startswith("lora_dtype") and "\n" not in str(err.value)


def test_qlora_without_kbit_preparation_has_its_own_16_bit_profile_key():
    """peft's QLoRA (auto) keeps its key; without kbit preparation (model) the QLoRA key with ``-a16``, and
    flash attention reads the SDPA trace as LoRA's does (its attention inputs are bf16, not peft's fp32)."""
    prepared = TrainingSpec(precision="bf16", qlora=True, attn="flash", **LORA)
    plain = TrainingSpec(precision="bf16", qlora=True, attn="flash", lora_dtype="model", **LORA)
    assert prepared.qlora_kbit_prep and not adapters_in_16bit(prepared, "single")
    assert adapters_in_16bit(plain, "single") and adapters_in_16bit(plain, "ddp")
    assert profile_key("0" * 16, prepared) == "0" * 16 + "_bf16_flash_nockpt_qlora8-q_proj,v_proj"
    assert profile_key("0" * 16, plain, 1, True) == "0" * 16 + "_bf16_sdpa_nockpt_qlora8-q_proj,v_proj-a16"


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
