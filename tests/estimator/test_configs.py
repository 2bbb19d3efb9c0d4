"""Users' training configs read into the spec: each tool's documented format (real example configs written in
tests/estimator/config_examples/) gives the same spec, hence the same estimate, as the equivalent flags;
unknown keys are reported; bad input is one line and exit 2."""

import json
from pathlib import Path

import pytest

from estimator.configs import detect_tool, read_config, spec_from_configs
from estimator.configs.load import load_mapping
from estimator.io import cli

EXAMPLES = Path(__file__).parent / "config_examples"


def _flag_spec(argv):
    spec, compare_all = cli.spec_from_args(cli.build_parser().parse_args(argv))
    assert not compare_all
    return spec


def _config_spec(files, argv=()):
    from estimator.configs.cli import explicit_flags

    return spec_from_configs([str(EXAMPLES / f) for f in files], explicit_flags(cli.build_parser, list(argv)))


# (config files, flags given with them, the equivalent flags alone)
CASES = {
    "trl_sft": (["trl_sft_lora.yaml"], [],
                "--model Qwen/Qwen2.5-0.5B --micro-batch-size 2 --seq-len 2048 --precision bf16 --optimizer "
                "adamw_fused --grad-ckpt --attn sdpa --lora-rank 16 --lora-targets q_proj,k_proj,v_proj,o_proj "
                "--lora-dropout 0.05 --grad-accum-steps 8 --outputs-fp32"),
    "accelerate_fsdp2": (["accelerate_fsdp2.yaml"], ["--model", "facebook/opt-125m"],
                         "--model facebook/opt-125m --method fsdp --gpus 8 --micro-batch-size 1 --precision "
                         "mixed_bf16 --grad-ckpt --loop manual --outputs-fp32"),
    "accelerate_fsdp1": (["accelerate_fsdp1.yaml"], ["--model", "facebook/opt-125m"],
                         "--model facebook/opt-125m --method fsdp1 --gpus 4 --micro-batch-size 1 --precision "
                         "mixed_bf16 --loop manual --fsdp-backward-prefetch NONE --outputs-fp32"),
    "accelerate_fsdp2_with_trainer_args": (
        ["accelerate_fsdp2.yaml", "trl_sft_lora.yaml"], ["--model", "facebook/opt-125m"],
        "--model facebook/opt-125m --method fsdp --gpus 8 --micro-batch-size 2 --seq-len 2048 --precision mixed_bf16 "
        "--optimizer adamw_fused --grad-ckpt --lora-rank 16 --lora-targets q_proj,k_proj,v_proj,o_proj "
        "--lora-dropout 0.05 --grad-accum-steps 8 --grad-sync last --outputs-fp32"),
    "torchtune_full": (["torchtune_llama3_2_1b_full.yaml"], ["--gpus", "4"],
                       "--model meta-llama/Llama-3.2-1B --method fsdp --gpus 4 --micro-batch-size 4 --seq-len 1024 "
                       "--precision bf16 --optimizer adamw_fused --grad-ckpt --attn sdpa"),
    "torchtune_lora": (["torchtune_llama3_2_1b_lora.yaml"], [],
                       "--model meta-llama/Llama-3.2-1B --micro-batch-size 4 --seq-len 512 --precision bf16 "
                       "--optimizer adamw_fused --grad-ckpt --lora-rank 64 --lora-targets "
                       "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --grad-accum-steps 8"),
    "axolotl": (["axolotl_qlora.yaml"], [],
                "--model meta-llama/Llama-3.2-1B --micro-batch-size 2 --seq-len 1024 --precision bf16 --optimizer "
                "adamw_8bit --grad-ckpt --attn flash --lora-rank 32 --lora-targets all-linear --lora-dropout 0.05 --qlora "
                "--grad-accum-steps 4 --outputs-fp32"),
    "llamafactory": (["llamafactory_lora_sft.yaml"], ["--gpus", "2"],
                     "--model meta-llama/Llama-3.2-1B --method ddp --gpus 2 --micro-batch-size 1 --seq-len 2048 "
                     "--precision bf16 --optimizer adamw_fused --grad-ckpt --lora-rank 8 --lora-targets all-linear "
                     "--grad-accum-steps 8 --outputs-fp32"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_gives_the_spec_of_the_equivalent_flags(case):
    files, extra, flags = CASES[case]
    spec, _ = _config_spec(files, extra)
    assert spec == _flag_spec(flags.split())


def test_deepspeed_through_trainer_args_equals_the_deepspeed_flag():
    argv = ["--model", "facebook/opt-1.3b", "--gpus", "4"]
    spec, report = _config_spec(["hf_training_args.json"], argv)
    flags = argv + ["--micro-batch-size", "4", "--grad-accum-steps", "2", "--grad-ckpt", "--precision", "mixed_bf16",
                    "--deepspeed", str(EXAMPLES / "ds_zero2.json")]
    assert spec == _flag_spec(flags)
    assert spec.parallel.method == "zero2" and spec.parallel.zero.allgather_bucket_size == 200_000_000


def test_accelerate_deepspeed_plugin_equals_the_same_deepspeed_json(tmp_path):
    ds = {"fp16": {"enabled": True}, "gradient_accumulation_steps": 4,
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    spec, _ = _config_spec(["accelerate_deepspeed.yaml"], ["--model", "facebook/opt-1.3b"])
    assert spec == _flag_spec(["--model", "facebook/opt-1.3b", "--gpus", "8", "--precision", "mixed_fp16",
                               "--loop", "manual", "--micro-batch-size", "1",
                               "--deepspeed", str(tmp_path / "ds.json")])
    assert spec.parallel.method == "zero3" and spec.parallel.zero.offload_param


@pytest.mark.parametrize("files, argv, flags", [
    (["hf_training_args.json"], ["--model", "facebook/opt-1.3b", "--gpus", "4"],
     ["--model", "facebook/opt-1.3b", "--gpus", "4", "--micro-batch-size", "4", "--grad-accum-steps", "2",
      "--grad-ckpt", "--precision", "mixed_bf16", "--deepspeed", str(EXAMPLES / "ds_zero2.json")]),
    (["accelerate_fsdp2.yaml"], ["--model", "facebook/opt-125m"],
     ["--model", "facebook/opt-125m", "--method", "fsdp", "--gpus", "8", "--micro-batch-size", "1", "--precision",
      "mixed_bf16", "--grad-ckpt", "--loop", "manual", "--outputs-fp32"]),
])
def test_the_cli_prints_the_same_estimate(files, argv, flags, capsys):
    config_args = [a for f in files for a in ("--config", str(EXAMPLES / f))] + argv
    assert cli.main(config_args + ["--json"]) == 0
    from_config = json.loads(capsys.readouterr().out)
    assert cli.main(flags + ["--json"]) == 0
    from_flags = json.loads(capsys.readouterr().out)
    assert from_config.pop("configs")["files"]
    assert from_config == from_flags


def test_explicit_flags_override_the_config():
    spec, report = _config_spec(["trl_sft_lora.yaml"], ["--seq-len", "512", "--optimizer", "adamw"])
    assert spec.training.seq_len == 512 and spec.training.optimizer == "adamw"
    assert any("--seq-len" in line for line in report.used)


def test_unknown_keys_are_printed_with_the_estimate(capsys):
    name = EXAMPLES / "hf_training_args.json"
    assert cli.main(["--config", str(name), "--model", "facebook/opt-125m"]) == 0
    assert f"not understood (ignored): {name}: my_custom_flag" in capsys.readouterr().out


def test_unknown_keys_are_reported_for_every_tool():
    _, report = _config_spec(["axolotl_qlora.yaml"])
    assert any(line.endswith("axolotl_qlora.yaml: my_unknown_option") for line in report.unknown)
    _, report = _config_spec(["torchtune_llama3_2_1b_lora.yaml"])
    assert report.unknown == []


def test_every_key_of_every_example_is_accounted_for():
    """Each key is used, assumed around, marked not modelled, known to have no effect, or reported."""
    for path in sorted(EXAMPLES.iterdir()):
        reading = read_config(str(path))
        data = load_mapping(path)
        sources = " ".join(s.source for s in reading.settings.values())
        accounted = " ".join(reading.unknown + reading.unmodelled + reading.no_effect) + " " + sources
        tool_keys = set(data) - {"lora_alpha", "lora_dropout"}  # no-effect keys handled inside a section
        missing = [k for k in tool_keys if k not in accounted and not isinstance(data[k], dict)]
        assert not missing, (path.name, missing)


def test_accelerate_fsdp1_config_is_the_fsdp1_method_with_accelerates_defaults():
    spec, report = _config_spec(["accelerate_fsdp1.yaml"], ["--model", "facebook/opt-125m"])
    assert spec.parallel.method == "fsdp1"
    # accelerate's plugin prefetches nothing unless told; the old key name is read by nobody and said so
    assert spec.parallel.fsdp1.backward_prefetch == "NONE" and spec.parallel.fsdp1.use_orig_params
    assert any("backward_prefetch_policy" in line and "no longer reads" in line for line in report.not_modelled)


FSDP1_OPTIONS = {"fsdp_sharding_strategy": "HYBRID_SHARD", "fsdp_backward_prefetch": "BACKWARD_POST",
                 "fsdp_forward_prefetch": True, "fsdp_use_orig_params": False, "fsdp_offload_params": True,
                 "fsdp_limit_all_gathers": False}
FSDP1_FLAGS = ["--method", "fsdp1", "--fsdp-sharding", "HYBRID_SHARD", "--fsdp-backward-prefetch", "BACKWARD_POST",
               "--fsdp-forward-prefetch", "--fsdp-use-orig-params", "false", "--fsdp-offload",
               "--fsdp-limit-all-gathers", "false"]


def _write_yaml(path, data):
    import yaml

    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_every_fsdp1_setting_of_an_accelerate_config_equals_its_flag(tmp_path):
    config = {"distributed_type": "FSDP", "num_processes": 16, "num_machines": 2, "mixed_precision": "bf16",
              "fsdp_config": {"fsdp_version": 1, **FSDP1_OPTIONS}}
    spec, report = spec_from_configs([_write_yaml(tmp_path / "acc.yaml", config)],
                                     {"model": "facebook/opt-125m"})
    flags = ["--model", "facebook/opt-125m", "--gpus", "16", "--precision", "mixed_bf16", "--loop", "manual",
             "--outputs-fp32",
             "--micro-batch-size", "1", "--gpus-per-node", "8", *FSDP1_FLAGS]
    assert spec == _flag_spec(flags)
    assert not report.not_modelled and not report.unknown


def test_trainer_fsdp_config_version_1_equals_the_flags(tmp_path):
    args = {"per_device_train_batch_size": 2, "bf16": True, "fsdp": "shard_grad_op auto_wrap offload",
            "fsdp_config": {"version": 1, "backward_prefetch": "backward_pre", "forward_prefetch": "true"}}
    path = tmp_path / "args.yaml"
    path.write_text(json.dumps(args))
    spec, _ = spec_from_configs([str(path)], {"model": "facebook/opt-125m", "world_size": 4})
    flags = ["--model", "facebook/opt-125m", "--gpus", "4", "--micro-batch-size", "2", "--precision", "mixed_bf16",
             "--method", "fsdp1", "--fsdp-sharding", "SHARD_GRAD_OP", "--fsdp-offload", "--fsdp-forward-prefetch",
             "--optimizer", "adamw_fused", "--outputs-fp32"]
    assert spec == _flag_spec(flags)
    # transformers 5 runs FSDP2 by default: the same config without version is the fsdp method
    args["fsdp_config"].pop("version")
    path.write_text(json.dumps(args))
    spec, report = spec_from_configs([str(path)], {"model": "facebook/opt-125m", "world_size": 4})
    assert spec.parallel.method == "fsdp" and any("offload" in line for line in report.not_modelled)


def test_axolotl_fsdp_defaults_to_fsdp1_and_lora_stays_fsdp1_but_not_under_mixed_precision(tmp_path):
    base = {"base_model": "facebook/opt-125m", "micro_batch_size": 1, "sequence_len": 512, "bf16": True,
            "fsdp": ["full_shard", "auto_wrap"], "fsdp_config": {"fsdp_sharding_strategy": "NO_SHARD"}}
    spec, _ = spec_from_configs([_write_yaml(tmp_path / "ax.yaml", base)], {"world_size": 2})
    assert spec.parallel.method == "fsdp1" and spec.parallel.fsdp1.sharding_strategy == "NO_SHARD"
    lora = {**base, "adapter": "lora", "lora_r": 8, "lora_target_linear": True}
    spec, report = spec_from_configs([_write_yaml(tmp_path / "ax_lora.yaml", lora)], {"world_size": 2})
    assert spec.training.precision == "mixed_bf16"  # FSDP1's MixedPrecision would cast the adapters too
    assert spec.parallel.method == "fsdp" and any("fsdp1 with LoRA" in line for line in report.not_modelled)
    assert spec.parallel.fsdp1.backward_prefetch == "NONE"  # and no prefetch is another reason
    prefetch = {**lora, "fsdp_config": {"fsdp_backward_prefetch": "BACKWARD_PRE"}}
    spec, report = spec_from_configs([_write_yaml(tmp_path / "ax_lora.yaml", prefetch)],
                                     {"world_size": 2, "precision": "bf16"})
    assert spec.parallel.method == "fsdp1" and not any("fsdp1 with LoRA" in line for line in report.not_modelled)


def test_hybrid_shard_zero2_is_estimated_as_hybrid_shard_and_said(tmp_path):
    config = {"distributed_type": "FSDP", "num_processes": 8, "fsdp_config": {"fsdp_sharding_strategy": 5}}
    spec, report = spec_from_configs([_write_yaml(tmp_path / "acc.yaml", config)], {"model": "facebook/opt-125m"})
    assert spec.parallel.fsdp1.sharding_strategy == "HYBRID_SHARD"
    assert any("HYBRID_SHARD_ZERO2" in line for line in report.not_modelled)


def test_fsdp1_flags_override_the_config_one_by_one_and_need_fsdp1():
    spec, report = _config_spec(["accelerate_fsdp1.yaml"], ["--model", "facebook/opt-125m", "--fsdp-sharding",
                                                            "shard_grad_op"])
    assert (spec.parallel.fsdp1.sharding_strategy, spec.parallel.fsdp1.backward_prefetch) == ("SHARD_GRAD_OP", "NONE")
    assert any("--fsdp-sharding" in line for line in report.used)
    with pytest.raises(ValueError, match="^--fsdp-sharding: FSDP1 settings apply to --method fsdp1"):
        _config_spec(["accelerate_fsdp2.yaml"], ["--model", "facebook/opt-125m", "--fsdp-sharding", "NO_SHARD"])


def test_a_bad_fsdp1_value_names_the_file_and_key(tmp_path):
    config = {"distributed_type": "FSDP", "num_processes": 2, "fsdp_config": {"fsdp_backward_prefetch": "SOMETIMES"}}
    with pytest.raises(ValueError, match=r"acc\.yaml: fsdp_config\.fsdp_backward_prefetch: 'SOMETIMES'"):
        spec_from_configs([_write_yaml(tmp_path / "acc.yaml", config)], {"model": "facebook/opt-125m"})


LLAMAFACTORY_LORA = {"model_name_or_path": "meta-llama/Llama-3.2-1B", "stage": "sft", "finetuning_type": "lora"}


@pytest.mark.parametrize(("name", "config", "expected"), [
    ("llamafactory.yaml", {**LLAMAFACTORY_LORA, "lora_dropout": 0.1}, 0.1),
    ("llamafactory.yaml", LLAMAFACTORY_LORA, 0.0),
    ("axolotl.yaml", {"base_model": "meta-llama/Llama-3.2-1B", "adapter": "lora", "lora_dropout": "0.05"}, 0.05),
    ("trl.yaml", {"model_name_or_path": "meta-llama/Llama-3.2-1B", "use_peft": True, "max_length": 512}, 0.05),
    ("trl.yaml", {"model_name_or_path": "meta-llama/Llama-3.2-1B", "use_peft": True, "lora_dropout": 0.0}, 0.0),
    ("torchtune.yaml", {"model": {"_component_": "torchtune.models.llama3_2.lora_llama3_2_1b",
                                  "lora_attn_modules": ["q_proj", "v_proj"], "lora_dropout": 0.1}}, 0.1),
])
def test_lora_dropout_is_read_from_each_tool_or_its_default(tmp_path, name, config, expected):
    spec, _ = spec_from_configs([_write_yaml(tmp_path / name, config)], {})
    assert spec.training.lora_rank > 0 and spec.training.lora_dropout == expected


HF_CKPT = {"model_name_or_path": "meta-llama/Llama-3.2-1B", "per_device_train_batch_size": 1,
           "gradient_checkpointing": True}


@pytest.mark.parametrize(("name", "config", "expected"), [
    ("args.yaml", {**HF_CKPT, "gradient_checkpointing_kwargs": {"use_reentrant": True}}, True),
    ("args.yaml", {**HF_CKPT, "gradient_checkpointing_kwargs": '{"use_reentrant": false}'}, False),
    ("args.yaml", {**HF_CKPT, "activation_checkpointing_kwargs": {"use_reentrant": "true"}}, True),
    ("args.yaml", HF_CKPT, False),  # transformers 5's default
    ("args.yaml", {**HF_CKPT, "gradient_checkpointing": False,
                   "gradient_checkpointing_kwargs": {"use_reentrant": True}}, False),  # nothing re-enters
    ("trl.yaml", {"model_name_or_path": "meta-llama/Llama-3.2-1B", "max_length": 512,
                  "gradient_checkpointing_use_reentrant": True}, True),
    ("axolotl.yaml", {"base_model": "meta-llama/Llama-3.2-1B", "gradient_checkpointing": True,
                      "gradient_checkpointing_kwargs": {"use_reentrant": True}}, True),
])
def test_reentrant_checkpointing_is_read_from_the_checkpointing_kwargs(tmp_path, name, config, expected):
    spec, report = spec_from_configs([_write_yaml(tmp_path / name, config)], {})
    assert spec.training.ckpt_reentrant is expected
    assert not any("use_reentrant" in key for key in report.unknown)


def test_the_reentrant_flag_overrides_the_config(tmp_path):
    config = {**HF_CKPT, "gradient_checkpointing_kwargs": {"use_reentrant": False}}
    spec, _ = spec_from_configs([_write_yaml(tmp_path / "args.yaml", config)], {"ckpt_reentrant": True})
    assert spec.training.ckpt_reentrant is True


def test_bad_checkpointing_kwargs_name_the_file_and_key(tmp_path):
    config = {**HF_CKPT, "gradient_checkpointing_kwargs": "use_reentrant"}
    with pytest.raises(ValueError, match=r"args\.yaml: gradient_checkpointing_kwargs: must be a mapping"):
        spec_from_configs([_write_yaml(tmp_path / "args.yaml", config)], {})


def test_a_bad_lora_dropout_names_the_file_and_key(tmp_path):
    config = {**LLAMAFACTORY_LORA, "lora_dropout": 1.5}
    with pytest.raises(ValueError, match=r"lf\.yaml: lora_dropout: must be a probability in \[0, 1\), got 1\.5"):
        spec_from_configs([_write_yaml(tmp_path / "lf.yaml", config)], {})


def test_files_that_disagree_are_named():
    spec, report = _config_spec(["accelerate_deepspeed.yaml", "trl_sft_lora.yaml"])
    assert any(line.startswith("half:") and "using the latter" in line for line in report.notes)


@pytest.mark.parametrize("tool, name", [("accelerate", "accelerate_fsdp2.yaml"), ("deepspeed", "ds_zero2.json"),
                                        ("torchtune", "torchtune_llama3_2_1b_lora.yaml"),
                                        ("axolotl", "axolotl_qlora.yaml"),
                                        ("llamafactory", "llamafactory_lora_sft.yaml"),
                                        ("hf", "trl_sft_lora.yaml"), ("hf", "hf_training_args.json")])
def test_tools_are_recognised(tool, name):
    assert detect_tool(load_mapping(EXAMPLES / name)) == tool


@pytest.mark.parametrize("content, suffix, expected", [
    ("a: [1, 2\n", ".yaml", "not valid YAML"),
    ('{"per_device_train_batch_size": 4,', ".json", "not valid JSON"),
    (b"\x80\x04\x95 pickled", ".bin", "pickled file"),
    ("- just\n- a list\n", ".yaml", "must hold a mapping"),
    ("hello: world\n", ".yaml", "cannot tell which tool"),
    ("base_model: no-such/model-anywhere\nsequence_len: 512\n", ".yaml", "model: unknown model"),
    ("!!python/object/apply:os.system ['echo hi']\n", ".yaml", "not valid YAML"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, content, suffix, expected):
    path = tmp_path / f"config{suffix}"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert cli.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err


def test_plan_reads_configs(capsys):
    from estimator.io.plan_cli import main as plan_main

    argv = ["--config", str(EXAMPLES / "accelerate_fsdp2.yaml"), "--model", "facebook/opt-125m",
            "--methods", "fsdp,ddp", "--ckpt", "on", "--json"]
    assert plan_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 8 and out["configs"]["files"]
    assert plan_main(["--gpus", "2"]) == 2
    assert "required" in capsys.readouterr().err


def test_reading_configs_stays_on_the_pure_path():
    """--config with JSON files imports no torch/transformers/numpy, and not even PyYAML."""
    import subprocess
    import sys

    code = ("import sys; from estimator.configs import spec_from_configs;"
            f"spec_from_configs([{str(EXAMPLES / 'hf_training_args.json')!r}], {{'model': 'facebook/opt-125m'}});"
            "bad = [m for m in ('torch', 'transformers', 'numpy', 'yaml', 'harness') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_plan_gives_its_fsdp1_row_the_configs_fsdp1_settings_and_the_flags_over_them(monkeypatch):
    from estimator.io import plan_cli

    seen = {}

    def fake_plan(*args, **kwargs):
        seen["fsdp1"] = kwargs["fsdp1"]
        raise ValueError("stop here")

    monkeypatch.setattr(plan_cli.planner, "plan", fake_plan)
    argv = ["--config", str(EXAMPLES / "accelerate_fsdp1.yaml"), "--model", "facebook/opt-125m", "--gpu", "a100-80gb",
            "--fsdp-sharding", "SHARD_GRAD_OP"]
    assert plan_cli.run_plan(plan_cli.build_parser().parse_args(argv), argv) == 2
    assert (seen["fsdp1"].sharding_strategy, seen["fsdp1"].backward_prefetch) == ("SHARD_GRAD_OP", "NONE")
