import json

import pytest

from estimator.models.arch import arch_from_config, catalogue_models, load_config, resolve_arch
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec


def test_lora_dropout_has_one_profile_for_every_probability_above_zero():
    from estimator.models.profiles import variant_key

    keys = {p: variant_key(TrainingSpec(lora_rank=8, lora_dropout=p)) for p in (0.0, 0.05, 0.3)}
    assert keys[0.05] == keys[0.3] == keys[0.0] + "-dropout"
    # run directories are keyed by spec_id: a dropout above zero is another run, zero keeps the ids of old runs
    ids = {p: RunSpec(training=TrainingSpec(lora_rank=8, lora_dropout=p)).spec_id for p in (0.0, 0.05)}
    assert ids[0.0] != ids[0.05]


def test_qlora_with_fsdp_or_tp_is_refused():
    qlora = TrainingSpec(lora_rank=8, qlora=True)
    for method, tp in (("fsdp", 1), ("tp", 4), ("dp_tp", 2)):
        with pytest.raises(ValueError, match="^qlora: "):
            RunSpec(model="m", training=qlora, parallel=ParallelSpec(method=method, world_size=4, tp=tp))
    RunSpec(model="m", training=qlora, parallel=ParallelSpec(method="zero3", world_size=4))


def test_qlora_with_fsdp1_is_modelled_for_fsdp_qlora_recipe_only():
    """FSDP1 shards Params4bit as fsdp_qlora builds them (lora_dtype model: no kbit preparation, everything bf16);
    peft's kbit recipe keeps its refusal, which names the recipe FSDP1 needs, not FSDP2's limit."""
    qlora = TrainingSpec(lora_rank=8, qlora=True)
    with pytest.raises(ValueError, match=r"^qlora: fsdp1 .*docs/fsdp1_qlora\.md") as err:
        RunSpec(model="m", training=qlora, parallel=ParallelSpec(method="fsdp1", world_size=2))
    assert "\n" not in str(err.value)
    plain = TrainingSpec(lora_rank=8, qlora=True, lora_dtype="model", precision="bf16")
    assert RunSpec(model="m", training=plain, parallel=ParallelSpec(method="fsdp1", world_size=2)).training.qlora


@pytest.mark.parametrize("kwargs, field", [
    ({"micro_batch_size": 0}, "micro_batch_size"), ({"seq_len": -1}, "seq_len"),
    ({"precision": "fp8"}, "precision"), ({"optimizer": "lion"}, "optimizer"), ({"attn": "xformers"}, "attn"),
    ({"lora_rank": -2}, "lora_rank"), ({"qlora": True}, "qlora"), ({"attn": "flash", "precision": "fp32"}, "attn"),
    ({"lora_dropout": 0.1}, "lora_dropout"), ({"lora_rank": 8, "lora_dropout": 1.0}, "lora_dropout"),
    ({"lora_rank": 8, "lora_dropout": -0.1}, "lora_dropout"), ({"lora_rank": 8, "lora_dropout": "0.1"}, "lora_dropout"),
])
def test_training_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        TrainingSpec(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"method": "pipeline"}, "method"), ({"method": "ddp", "world_size": 0}, "world_size"),
    ({"method": "dp_tp", "world_size": 6, "tp": 4}, "tp"), ({"method": "tp", "world_size": 4, "tp": 2}, "tp"),
    ({"method": "single", "world_size": 2}, "world_size"), ({"method": "ddp", "world_size": 2, "tp": 2}, "tp"),
])
def test_parallel_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        ParallelSpec(**kwargs)


def test_json_round_trip_and_stable_id():
    spec = RunSpec(model="facebook/opt-125m", parallel=ParallelSpec(method="zero3", world_size=8),
                   training=TrainingSpec(micro_batch_size=4, grad_ckpt=True))
    again = RunSpec.from_json(spec.to_json())
    assert again == spec and again.spec_id == spec.spec_id
    assert spec.replace(**{"training.seq_len": 1024}).spec_id != spec.spec_id


def test_unknown_field_is_named():
    data = json.loads(RunSpec().to_json())
    data["training"]["batchsize"] = 3
    with pytest.raises(ValueError, match=r"^training\.batchsize: unknown field"):
        RunSpec.from_dict(data)


def test_catalogue_has_paper_and_current_models():
    names = set(catalogue_models())
    for name in ("facebook/opt-125m", "facebook/opt-2.7b", "bigscience/bloom-3b", "Salesforce/codegen-2B-nl",
                 "microsoft/BioGPT-Large", "bigcode/gpt_bigcode-santacoder", "EleutherAI/gpt-neo-1.3B",
                 "huggyllama/llama-7b", "meta-llama/Llama-3.1-8B", "mistralai/Mistral-7B-v0.1", "Qwen/Qwen2.5-7B"):
        assert name in names


def test_arch_facts_come_from_config_not_name(tmp_path):
    config = dict(load_config("meta-llama/Llama-3.1-8B"), _name_or_path="facebook/opt-125m")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    arch = resolve_arch(str(path))
    assert (arch.model_type, arch.num_kv_heads, arch.vocab_size) == ("llama", 8, 128256)


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"), ("[1, 2]", "JSON object"),
    ('{"model_type": "t5", "d_model": 512}', "not a decoder-only"),
    ('{"model_type": "llama", "hidden_size": 64}', "num_hidden_layers"),
])
def test_bad_config_files(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        resolve_arch(str(path))


def test_unknown_model_suggests_close_names():
    with pytest.raises(ValueError, match="did you mean.*opt-1.3b"):
        resolve_arch("facebook/opt-1.3")


def test_case_insensitive_and_bare_names():
    assert arch_from_config(load_config("OPT-125M")).hidden_size == 768
