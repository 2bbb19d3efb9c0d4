"""Composition: every config group file, the schema, and errors that name the key."""

import dataclasses

import pytest
from omegaconf.errors import OmegaConfBaseException

from estimator.spec import ParallelSpec, RunSpec, TrainingSpec, ZeroSpec
from harness.__main__ import config_error_line
from harness.config import MeasureConf, ModelConf, ParallelConf, TrainingConf, ZeroConf, to_run
from harness.options import HarnessOptions, ModelOptions
from tests.harness.conftest import CONF, compose

MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml") if p.stem != "custom")
METHODS = sorted(p.stem for p in (CONF / "method").glob("*.yaml"))


def test_schemas_mirror_the_spec():
    for conf, spec in ((ZeroConf, ZeroSpec), (ParallelConf, ParallelSpec), (TrainingConf, TrainingSpec)):
        assert [f.name for f in dataclasses.fields(conf)] == [f.name for f in dataclasses.fields(spec)]


def test_schema_mirrors_the_harness_options():
    names = [f.name for f in dataclasses.fields(MeasureConf)]
    assert names[:4] == ["model", "parallel", "training", "gpu"] and names[-1] == "local"
    assert names[4:-1] == [f.name for f in dataclasses.fields(HarnessOptions) if f.name != "model"]
    assert [f.name for f in dataclasses.fields(ModelConf)] == [f.name for f in dataclasses.fields(ModelOptions)]


def test_default_config_is_the_default_spec():
    spec, opts = to_run(compose(), gpu_key="h100-80gb")
    assert spec == RunSpec(model="facebook/opt-125m", gpu="h100-80gb")
    assert (opts.steps.warmup, opts.steps.measured, opts.backend) == (0, 2, "auto")


def test_every_model_file_becomes_a_spec():
    from harness.models import load_model_config

    for name in MODELS:
        spec, opts = to_run(compose(f"model={name}"), gpu_key="cpu")
        assert load_model_config(spec.model)["model_type"], name


@pytest.mark.parametrize("method", METHODS)
def test_every_method_file(method):
    world_size = 1 if method == "single" else 4
    spec, _ = to_run(compose(f"method={method}", f"parallel.world_size={world_size}"), gpu_key="cpu")
    assert spec.parallel.method == method and spec.parallel.world_size == world_size
    assert spec.parallel.tp == {"tp": 4, "dp_tp": 2}.get(method, 1)


def test_emulate_world_size_is_the_jobs_world_size():
    spec, opts = to_run(compose("method=tp", "emulate.world_size=8"), gpu_key="cpu")
    assert (spec.parallel.world_size, spec.parallel.tp, opts.emulated) == (8, 8, True)
    spec, opts = to_run(compose("method=fsdp", "parallel.world_size=4", "emulate.enabled=true"), gpu_key="cpu")
    assert (spec.parallel.world_size, opts.emulated) == (4, True)
    with pytest.raises(ValueError, match="^emulate.world_size:"):
        to_run(compose("method=fsdp", "parallel.world_size=4", "emulate.world_size=8"))


def test_training_presets():
    spec, opts = to_run(compose("training=paper", "data=paper"), gpu_key="cpu")
    assert (spec.training.precision, spec.training.grad_ckpt, spec.training.seq_len) == ("mixed_fp16", True, 512)
    assert (opts.data.padding, opts.data.keep) == ("longest", "full_batches")


def test_batch_follows_the_data_unless_set():
    """Rows cut at seq_len or packed are full length; keeping shorter rows pads them (the mask path)."""
    def batch(*overrides):
        return to_run(compose(*overrides), gpu_key="cpu")[0].training.batch

    assert batch() == "full"
    assert batch("data.keep=packed") == "full"
    assert batch("data=paper") == "padded"
    assert batch("data.keep=all") == "padded"
    assert batch("data=paper", "training.batch=full") == "full"


def config_error(*overrides):
    with pytest.raises(Exception) as info:
        compose(*overrides)
    return info.value


@pytest.mark.parametrize(("override", "key"), [
    ("training.seq_lenn=3", "training.seq_lenn"),
    ("training.seq_len=abc", "training.seq_len"),
    ("parallel.zero.overlap_comm=maybe", "parallel.zero.overlap_comm"),
    ("parallel.fsdp1.forward_prefetch=maybe", "parallel.fsdp1.forward_prefetch"),
    ("memory.cap_gib=lots", "memory.cap_gib"),
])
def test_typos_and_bad_types_fail_at_composition_naming_the_key(override, key):
    err = config_error(override)
    assert isinstance(err.__cause__ or err, OmegaConfBaseException)
    line = config_error_line(err)
    assert line.startswith(f"{key}:") and "\n" not in line


def test_unknown_group_option_lists_the_choices():
    line = config_error_line(config_error("model=opt-999"))
    assert line.startswith("model:") and "opt-125m" in line and "\n" not in line


@pytest.mark.parametrize(("overrides", "key"), [
    (["training.seq_len=-1"], "training.seq_len"),
    (["training.precision=fp8"], "training.precision"),
    (["training.ckpt_reentrant=true"], "training.ckpt_reentrant"),
    (["parallel.zero.reduce_bucket_size=-5"], "parallel.zero.reduce_bucket_size"),
    (["method=dp_tp", "parallel.world_size=2"], "parallel.tp"),
    (["method=single", "parallel.world_size=2"], "parallel.world_size"),
    (["method=fsdp1", "parallel.fsdp1.sharding_strategy=ZERO9"], "parallel.fsdp1.sharding_strategy"),
    (["method=fsdp1", "parallel.world_size=12", "parallel.fsdp1.sharding_strategy=HYBRID_SHARD"],
     "parallel.fsdp1.gpus_per_node"),
])
def test_spec_value_errors_name_the_dotted_key(overrides, key):
    with pytest.raises(ValueError, match=f"^{key}:"):
        to_run(compose(*overrides))


def test_reentrant_checkpointing_reaches_the_spec():
    spec, _ = to_run(compose("method=zero3", "parallel.world_size=2", "training.grad_ckpt=true",
                             "training.ckpt_reentrant=true"), gpu_key="cpu")
    assert spec.training.ckpt_reentrant and spec.training.grad_ckpt
    assert not to_run(compose(), gpu_key="cpu")[0].training.ckpt_reentrant


@pytest.mark.parametrize(("override", "key"), [
    ("backend=tpu", "backend"), ("data.padding=right", "data.padding"), ("steps.measured=0", "steps.measured"),
    ("steps.measured=1", "steps.measured"), ("emulate.ranks=[]", "emulate.ranks"), ("inject_oom=later", "inject_oom"),
])
def test_harness_option_errors_name_the_key(override, key):
    with pytest.raises(ValueError, match=f"^{key}:"):
        to_run(compose(override))


def test_custom_model_needs_a_name():
    with pytest.raises(ValueError, match="^model.name:"):
        to_run(compose("model=custom"))
    spec, _ = to_run(compose("model=custom", "model.name=harness/assets/models/tiny-opt.json"), gpu_key="cpu")
    assert spec.model == "harness/assets/models/tiny-opt.json"


def test_slurm_launchers_compose_with_the_gpu_count_of_the_launch():
    config = compose("launcher=slurm", "parallel.world_size=4", hydra_config=True)
    assert config.hydra.launcher.gpus_per_node == 4 and config.hydra.launcher.tasks_per_node == 1
    _, opts = to_run(compose("launcher=srun"))
    assert (opts.launcher.command, opts.launcher.nnodes) == ("srun", 1)


def test_a_run_measures_the_installed_model_code_only():
    from estimator.models.profiles import installed_version
    from estimator.spec import model_code_release

    release = model_code_release(installed_version("transformers"))
    spec, _ = to_run(compose(f"training.model_code={release}"), gpu_key="cpu")
    assert spec.training.model_code == release
    with pytest.raises(ValueError, match=r"^training.model_code: 3.9 is not the installed transformers"):
        to_run(compose("training.model_code=3.9"), gpu_key="cpu")
