"""DeepSpeed JSON -> RunSpec (estimator.configs.deepspeed_json): stages, offload, precision, batches, "auto", bad values."""

from __future__ import annotations

import json

import pytest

from estimator.configs.deepspeed_json import parse_count, parse_flag, spec_from_deepspeed
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec, ZeroSpec

BASE = RunSpec(model="facebook/opt-1.3b", parallel=ParallelSpec(method="ddp", world_size=4),
               training=TrainingSpec(micro_batch_size=3, grad_accum_steps=2, precision="mixed_bf16"))
HIDDEN = 2048

# The ZeRO-3 template from the Hugging Face DeepSpeed integration guide.
HF_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "none", "pin_memory": True},
        "offload_param": {"device": "none", "pin_memory": True},
        "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def ds(config, base=BASE, hidden=HIDDEN) -> RunSpec:
    return spec_from_deepspeed(config, base, hidden)


def test_hf_zero3_template_resolves_auto_like_transformers():
    spec = ds(HF_ZERO3)
    assert spec.parallel.method == "zero3" and spec.parallel.world_size == 4
    zero = spec.parallel.zero
    assert zero.reduce_bucket_size == 2048 * 2048                    # hidden^2
    assert zero.stage3_prefetch_bucket_size == int(0.9 * 2048 * 2048) == 3_774_873
    assert zero.stage3_param_persistence_threshold == 10 * 2048
    assert zero.stage3_max_live_parameters == 10**9 and zero.sub_group_size == 10**9
    assert zero.overlap_comm is True and not zero.offload_optimizer and not zero.offload_param
    # "auto" micro batch, accumulation and precision keep the base's values
    assert (spec.training.micro_batch_size, spec.training.grad_accum_steps) == (3, 2)
    assert spec.training.precision == "mixed_bf16"
    assert spec.model == BASE.model and spec.training.seq_len == BASE.training.seq_len


def test_stage3_auto_keys_below_stage3_keep_deepspeed_defaults():
    spec = ds({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "allgather_bucket_size": "auto",
                                     "stage3_prefetch_bucket_size": "auto",
                                     "stage3_param_persistence_threshold": "auto"}})
    zero = spec.parallel.zero
    assert spec.parallel.method == "zero2"
    assert zero.reduce_bucket_size == HIDDEN**2                  # HF fills this one at every stage
    assert zero.allgather_bucket_size == 500_000_000            # HF never fills it: DeepSpeed drops "auto"
    assert zero.stage3_prefetch_bucket_size == 50_000_000       # filled by HF only for stage 3
    assert zero.stage3_param_persistence_threshold == 100_000


def test_empty_config_is_deepspeed_defaults():
    spec = ds({})
    assert spec.parallel == ParallelSpec(method="ddp", world_size=4, zero=ZeroSpec())    # stage 0 -> ddp
    assert spec.training.precision == "fp32"                                             # neither fp16 nor bf16
    single = ds({}, base=BASE.replace(parallel=ParallelSpec()))
    assert single.parallel.method == "single"


def test_deepspeed_defaults_match_the_installed_deepspeed():
    """ZeroSpec's defaults are DeepSpeed's (deepspeed/runtime/zero/config.py, offload_config.py)."""
    config = pytest.importorskip("deepspeed.runtime.zero.config")
    offload = pytest.importorskip("deepspeed.runtime.zero.offload_config")
    theirs = config.DeepSpeedZeroConfig()
    ours = ds({"zero_optimization": {"stage": 1}}).parallel.zero
    assert ours.reduce_bucket_size == theirs.reduce_bucket_size
    assert ours.allgather_bucket_size == theirs.allgather_bucket_size
    assert ours.contiguous_gradients == theirs.contiguous_gradients and ours.reduce_scatter == theirs.reduce_scatter
    assert ours.stage3_prefetch_bucket_size == theirs.prefetch_bucket_size
    assert ours.stage3_param_persistence_threshold == theirs.param_persistence_threshold
    assert ours.stage3_max_live_parameters == theirs.max_live_parameters
    assert ours.stage3_max_reuse_distance == theirs.max_reuse_distance
    assert ours.sub_group_size == theirs.sub_group_size
    assert ours.overlap_comm_for(1) == theirs.overlap_comm is False
    assert config.DeepSpeedZeroConfig(stage=3).overlap_comm is True and ours.overlap_comm_for(3)
    assert offload.DeepSpeedZeroOffloadOptimizerConfig().pin_memory is True
    on = ds({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}).parallel.zero
    assert on.pin_memory is True


@pytest.mark.parametrize("value", [5e8, "5e8", "5E8", 500000000, "500000000", 500000000.0])
def test_numbers_as_deepspeed_writes_them(value):
    assert ds({"zero_optimization": {"stage": 2, "reduce_bucket_size": value}}).parallel.zero.reduce_bucket_size \
        == 500_000_000


def test_deepspeed_itself_takes_the_json_number_5e8():
    config = pytest.importorskip("deepspeed.runtime.zero.config")
    assert config.DeepSpeedZeroConfig(reduce_bucket_size=5e8).reduce_bucket_size == parse_count("k", 5e8)


def test_stage3_aliases_and_other_fields():
    spec = ds({"zero_optimization": {"stage": "3", "prefetch_bucket_size": 1e6, "param_persistence_threshold": 0,
                                     "max_live_parameters": "2e8", "stage3_max_reuse_distance": 0,
                                     "allgather_bucket_size": 2e8, "overlap_comm": "false",
                                     "contiguous_gradients": 0, "reduce_scatter": "no", "sub_group_size": 1e8}})
    zero = spec.parallel.zero
    assert spec.parallel.method == "zero3"
    assert (zero.stage3_prefetch_bucket_size, zero.stage3_param_persistence_threshold) == (10**6, 0)
    assert (zero.stage3_max_live_parameters, zero.stage3_max_reuse_distance) == (2 * 10**8, 0)
    assert zero.allgather_bucket_size == 2 * 10**8 and zero.sub_group_size == 10**8
    assert (zero.overlap_comm, zero.contiguous_gradients, zero.reduce_scatter) == (False, False, False)


@pytest.mark.parametrize("zero, method, opt, param, pin", [
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, "zero_offload", True, False, True),
    ({"stage": 1, "offload_optimizer": {"device": "nvme", "pin_memory": False}}, "zero_offload", True, False, False),
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}, "zero3", True, True,
     True),
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, "zero3", True, False, True),  # ZeRO-3 Offload
    ({"stage": 3, "offload_param": {"device": "nvme", "pin_memory": "false"}}, "zero3", False, True, False),
    ({"stage": 2, "cpu_offload": True}, "zero_offload", True, False, True),          # deprecated spelling
    ({"stage": 3, "cpu_offload_param": True, "cpu_offload_use_pin_memory": False}, "zero3", False, True, False),
])
def test_offload_keeps_the_stage(zero, method, opt, param, pin):
    """Stage 1/2 + optimizer offload is ZeRO-Offload; stage 3 keeps stage 3 (ZeRO-3 Offload, ZeRO-Infinity)."""
    spec = ds({"zero_optimization": zero})
    assert spec.parallel.method == method
    assert spec.parallel.zero_stage == min(max(zero["stage"], 2), 3)
    flags = spec.parallel.zero
    assert (flags.offload_optimizer, flags.offload_param, flags.pin_memory) == (opt, param, pin)


def test_offload_device_none_or_auto_is_off():
    spec = ds({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "auto"}}})
    assert spec.parallel.method == "zero2" and not spec.parallel.zero.offload_optimizer


@pytest.mark.parametrize("config, base_precision, expected", [
    ({"fp16": {"enabled": True}}, "mixed_bf16", "mixed_fp16"),
    ({"bf16": {"enabled": "true"}}, "fp32", "mixed_bf16"),
    ({"bfloat16": {"enabled": True}}, "fp32", "mixed_bf16"),               # DeepSpeed's older key
    ({"fp16": {"enabled": False}, "bf16": {"enabled": False}}, "mixed_bf16", "fp32"),
    ({"fp16": {}}, "mixed_fp16", "fp32"),                                   # enabled defaults to false
    ({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}, "mixed_fp16", "mixed_fp16"),
    ({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}, "amp_bf16", "mixed_bf16"),
    ({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}, "fp32", "fp32"),
    ({"fp16": {"enabled": "auto"}}, "bf16", "mixed_bf16"),                  # accelerate adds the bf16 section
    ({"fp16": {"enabled": "auto"}, "bf16": {"enabled": False}}, "mixed_bf16", "fp32"),
])
def test_precision(config, base_precision, expected):
    base = BASE.replace(**{"training.precision": base_precision})
    assert ds(config, base=base).training.precision == expected


@pytest.mark.parametrize("config, micro, accum", [
    ({"train_micro_batch_size_per_gpu": 8}, 8, 2),                  # accumulation stays the base's
    ({"train_micro_batch_size_per_gpu": "4", "gradient_accumulation_steps": 16}, 4, 16),
    ({"train_batch_size": 32}, 8, 1),                               # 32 / 4 GPUs, accumulation 1
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, 4, 4),
    ({"train_batch_size": 64, "gradient_accumulation_steps": 2}, 8, 2),
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
      "gradient_accumulation_steps": "auto"}, 3, 2),
])
def test_batch_sizes(config, micro, accum):
    spec = ds(config)
    assert (spec.training.micro_batch_size, spec.training.grad_accum_steps) == (micro, accum)


def test_reads_a_file_and_json_text(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(HF_ZERO3))
    assert ds(path) == ds(str(path)) == ds(json.dumps(HF_ZERO3)) == ds(HF_ZERO3)
    assert HF_ZERO3["zero_optimization"]["reduce_bucket_size"] == "auto"      # the caller's dict is untouched


@pytest.mark.parametrize("config, message", [
    ({"zero_optimization": {"stage": 4}}, r"zero_optimization\.stage: must be 0, 1, 2 or 3, got 4"),
    ({"zero_optimization": {"stage": "two"}}, r"zero_optimization\.stage: must be a number, got 'two'"),
    ({"zero_optimization": {"stage": True}}, r"zero_optimization\.stage: must be a number, got True"),
    ({"zero_optimization": {"reduce_bucket_size": 0}}, r"zero_optimization\.reduce_bucket_size: must be >= 1"),
    ({"zero_optimization": {"reduce_bucket_size": "lots"}}, r"zero_optimization\.reduce_bucket_size: must be a number, got 'lots'"),
    ({"zero_optimization": {"allgather_bucket_size": 2.5e3 + 0.5}}, r"zero_optimization\.allgather_bucket_size: must be a whole number"),
    ({"zero_optimization": {"sub_group_size": -1}}, r"zero_optimization\.sub_group_size: must be >= 0, got -1"),
    ({"zero_optimization": {"stage3_prefetch_bucket_size": float("inf")}}, r"zero_optimization\.stage3_prefetch_bucket_size: must be a whole"),
    ({"zero_optimization": {"overlap_comm": "maybe"}}, r"zero_optimization\.overlap_comm: must be true or false"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}},
     r"zero_optimization\.offload_optimizer\.device: must be one of none, cpu, nvme, got 'gpu'"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": "cpu"}}, r"zero_optimization\.offload_optimizer: must be an object"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     r"zero_optimization\.offload_param: parameter offload needs stage 3, got stage 2"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, r"zero_optimization\.offload_optimizer: .*got stage 0"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, r"fp16\.enabled: fp16 and bf16 cannot both"),
    ({"bf16": {"enabled": "sometimes"}}, r"bf16\.enabled: must be true or false"),
    ({"fp16": True}, r"fp16: must be an object"),
    ({"train_micro_batch_size_per_gpu": 0}, r"train_micro_batch_size_per_gpu: must be >= 1, got 0"),
    ({"gradient_accumulation_steps": 1.5}, r"gradient_accumulation_steps: must be a whole number"),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
     r"train_batch_size: 30 is not train_micro_batch_size_per_gpu x gradient_accumulation_steps x 4 GPUs"),
    ({"zero_optimization": [3]}, r"zero_optimization: must be an object"),
])
def test_bad_values_name_the_key(config, message):
    with pytest.raises(ValueError, match=rf"^deepspeed: {message}") as err:
        ds(config)
    assert "\n" not in str(err.value)


def test_auto_needs_a_hidden_size():
    with pytest.raises(ValueError, match=r"^deepspeed: zero_optimization\.reduce_bucket_size: 'auto' needs the "
                                         r"model's hidden size"):
        ds({"zero_optimization": {"reduce_bucket_size": "auto"}}, hidden=0)
    assert ds({"zero_optimization": {"reduce_bucket_size": 7}}, hidden=0).parallel.zero.reduce_bucket_size == 7


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="^deepspeed: no such config file"):
        ds("/nonexistent/ds.json")
    with pytest.raises(ValueError, match=r"^deepspeed: config is not valid JSON \(line 1"):
        ds("{oops")
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    with pytest.raises(ValueError, match="^deepspeed: config must be a JSON object"):
        ds(listing)
    with pytest.raises(ValueError, match="^deepspeed: expected a dict or a JSON file path"):
        ds(42)
    with pytest.raises(ValueError, match=r"^deepspeed: zero_optimization: the base spec has tensor parallelism"):
        ds({}, base=BASE.replace(parallel=ParallelSpec(method="tp", world_size=2, tp=2)))


def test_deprecated_boolean_zero_section():
    assert ds({"zero_optimization": True}).parallel.method == "zero1"
    assert ds({"zero_optimization": False}).parallel.method == "ddp"


def test_scalar_parsers():
    assert parse_count("k", " 12 ") == 12 and parse_count("k", 1e3) == 1000
    assert parse_flag("k", "Yes") is True and parse_flag("k", 0) is False
    with pytest.raises(ValueError, match="^deepspeed: k: must be true or false, got 2"):
        parse_flag("k", 2)
