"""Method wiring that needs no process group: the generated DeepSpeed config and the registry; and (slow) one
DeepSpeed engine on a one-rank gloo group."""

import pytest

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
    assert ds_config(spec(precision="mixed_fp16"))["fp16"] == {"enabled": True, "initial_scale_power": 0}
    assert ds_config(spec(precision="mixed_bf16"))["bf16"] == {"enabled": True}
    assert ds_config(spec(precision="bf16"))["bf16"]["bf16_master_weights_and_grads"] is True
    for precision in ("fp32", "amp_bf16"):
        config = ds_config(spec(precision=precision))
        assert "fp16" not in config and "bf16" not in config


def test_user_config_keeps_its_settings_but_takes_the_spec_batch():
    config = ds_config(spec(), {"zero_optimization": {"stage": 2}, "train_batch_size": "auto"})
    assert config["zero_optimization"] == {"stage": 2} and config["train_batch_size"] == 24


@pytest.mark.slow
def test_deepspeed_updates_once_per_step_under_gradient_accumulation(monkeypatch):
    """The worker calls forward/backward per micro-batch and the optimizer phase once; DeepSpeed counts
    micro-batches in engine.step(), so the trainer must call it off the boundary too."""
    import torch

    from harness import distributed
    from harness.methods import WrapContext, wrap
    from harness.models import load_model_config
    from harness.options import HarnessOptions

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)  # set by distributed.init; restored afterwards
    run = RunSpec(model="harness/assets/models/tiny-llama.json", parallel=ParallelSpec(method="zero2", world_size=1),
                  training=TrainingSpec(micro_batch_size=2, seq_len=32, precision="fp32", grad_accum_steps=2))
    dist = distributed.init(method="zero2", rank=0, world_size=1, local_rank=0, device=torch.device("cpu"),
                            emulated=False)
    try:
        trainer = wrap(WrapContext(spec=run, options=HarnessOptions(), dist=dist, config=load_model_config(run.model)))
        ids = torch.randint(0, 64, (2, 32))
        for _ in range(2):
            for index in range(2):
                with trainer.micro_batch(is_last=index == 1):
                    trainer.backward(trainer.forward({"input_ids": ids, "labels": ids}), 0.5)
            trainer.step()
        assert trainer.engine.global_steps == 2
        trainer.close()
    finally:
        distributed.teardown()
