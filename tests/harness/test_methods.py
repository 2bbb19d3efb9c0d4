"""Method wiring that needs no process group: the generated DeepSpeed config and the registry."""

from estimator.spec import METHODS, ParallelSpec, RunSpec, TrainingSpec, ZeroSpec
from harness.methods import WRAPPERS
from harness.methods.deepspeed import ds_config


def spec(method="zero2", precision="mixed_bf16", optimizer="adamw", world_size=4, **zero):
    return RunSpec(parallel=ParallelSpec(method=method, world_size=world_size, zero=ZeroSpec(**zero)),
                   training=TrainingSpec(micro_batch_size=3, grad_accum_steps=2, precision=precision,
                                         optimizer=optimizer))


def test_every_method_has_a_wrapper():
    assert set(WRAPPERS) == set(METHODS)


def test_batch_and_zero_sections():
    config = ds_config(spec("zero3", reduce_bucket_size=1234, overlap_comm=None))
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"]) == (3, 2, 24)
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["reduce_bucket_size"] == 1234 and zero["overlap_comm"] is True
    assert "offload_optimizer" not in zero
    assert ds_config(spec("zero1"))["zero_optimization"]["overlap_comm"] is False


def test_offload_and_optimizer():
    config = ds_config(spec("zero_offload"))
    assert config["zero_optimization"]["stage"] == 2
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert config["zero_force_ds_cpu_optimizer"] is False
    assert config["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True, "foreach": True}}
    assert "optimizer" not in ds_config(spec(optimizer="sgd"))  # a client optimizer instead
    z3 = ds_config(spec("zero3", offload_param=True, pin_memory=True))["zero_optimization"]
    assert z3["offload_param"] == {"device": "cpu", "pin_memory": True}


def test_precision_blocks():
    assert ds_config(spec(precision="mixed_fp16"))["fp16"] == {"enabled": True}
    assert ds_config(spec(precision="mixed_bf16"))["bf16"] == {"enabled": True}
    assert ds_config(spec(precision="bf16"))["bf16"]["bf16_master_weights_and_grads"] is True
    for precision in ("fp32", "amp_bf16"):
        config = ds_config(spec(precision=precision))
        assert "fp16" not in config and "bf16" not in config


def test_user_config_keeps_its_settings_but_takes_the_spec_batch():
    config = ds_config(spec(), {"zero_optimization": {"stage": 2}, "train_batch_size": "auto"})
    assert config["zero_optimization"] == {"stage": 2} and config["train_batch_size"] == 24
