"""``TrainingSpec.vocab_size``: the embedding resized by the training script (``model.resize_token_embeddings(N)``),
its profile derived from the configured model's (``estimator.profiler.vocab``)."""

import csv
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from estimator.columns import spec_columns, spec_from_columns
from estimator.models.arch import cached_arch, spec_arch
from estimator.models.profiles import profile_key
from estimator.profiler.vocab import resize_vocab
from estimator.spec import RunSpec, TrainingSpec

ROOT = Path(__file__).resolve().parents[2]
FMS_ROW = "fms_acceleration:9239802cc91a:none:Mistral-7B-v0.1:full:x1:b8:nvml"


def test_zero_keeps_spec_ids_and_profile_keys_and_older_tables():
    plain = RunSpec()
    resized = RunSpec(training=TrainingSpec(vocab_size=32001))
    assert dataclasses.replace(plain, training=TrainingSpec(vocab_size=0)).spec_id == plain.spec_id
    assert resized.spec_id != plain.spec_id
    assert profile_key("abc", resized.training) == profile_key("abc", plain.training)  # the configured model's
    row = {k: ("" if v is None else str(v)) for k, v in spec_columns(resized).items()}
    row["world_size"] = "1"
    assert spec_from_columns(row).training.vocab_size == 32001
    del row["vocab_size"]  # a table written before the column: the config's vocabulary
    assert spec_from_columns(row).training.vocab_size == 0


@pytest.mark.parametrize("value", [-1, True, 1.5, "32001"])
def test_bad_vocab_size_names_the_field(value):
    with pytest.raises(ValueError, match="^vocab_size: must be a positive integer"):
        TrainingSpec(vocab_size=value)


@pytest.mark.parametrize("value", ["-3", "many"])
def test_cli_error_is_one_line_exit_2(value):
    result = subprocess.run([sys.executable, "-m", "estimator", "--model", "facebook/opt-125m", "--vocab-size", value],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_cli_and_configs_carry_it(capsys):
    from estimator.io.cli import main

    assert main(["--model", "facebook/opt-125m", "--method", "single", "--vocab-size", "50300", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["spec"]["training"]["vocab_size"] == 50300


def test_spec_arch_is_the_config_with_the_new_row_count():
    arch = cached_arch("mistralai/Mistral-7B-v0.1")
    resized = spec_arch("mistralai/Mistral-7B-v0.1", arch.vocab_size + 1)
    assert resized.vocab_size == arch.vocab_size + 1 and resized.config_sha != arch.config_sha
    assert spec_arch("mistralai/Mistral-7B-v0.1", 0) is arch
    assert spec_arch("mistralai/Mistral-7B-v0.1", arch.vocab_size) is arch


def _fms_spec() -> RunSpec:
    with open(ROOT / "data" / "public" / "measurements.csv") as handle:
        row = next(r for r in csv.DictReader(handle) if r["row_id"] == FMS_ROW)
    return spec_from_columns(row)


def test_parameter_bytes_follow_the_vocabulary_exactly():
    """Mistral-7B (untied head) from its shipped profile, no torch: every added row is one embedding row and one
    head row, and the weights, gradients and AdamW states grow by exactly those rows' bytes."""
    from estimator.api import estimate

    spec = _fms_spec()
    arch = cached_arch(spec.model)
    plain = estimate(spec.replace(**{"training.vocab_size": 0}), allow_build=False)
    added = 3
    resized = estimate(spec.replace(**{"training.vocab_size": arch.vocab_size + added}), allow_build=False)
    rows = 1 if arch.tie_word_embeddings else 2
    assert resized.params - plain.params == added * rows * arch.hidden_size
    element = 2  # the row's bf16 weights, gradients and optimizer states
    growth = {k: resized.ranks[0].breakdown[k] - plain.ranks[0].breakdown[k] for k in plain.ranks[0].breakdown}
    assert growth["weights"] == growth["gradients"] == added * rows * arch.hidden_size * element
    assert growth["optimizer_states"] == 2 * growth["weights"]


def test_resized_estimate_differs_in_the_logits_sized_requests():
    """fms-hf-tuning's 32,001 rows: the fp32 logits and the shifted logits no longer fill the same 2 MiB-rounded
    segments, so the reserved level moves while the allocated peak (the optimizer step) grows by the rows alone."""
    from estimator.api import estimate

    spec = _fms_spec()
    plain = estimate(spec.replace(**{"training.vocab_size": 0}), allow_build=False)
    resized = estimate(spec.replace(**{"training.vocab_size": cached_arch(spec.model).vocab_size + 1}),
                       allow_build=False)
    grown = sum(resized.ranks[0].breakdown.values()) - sum(plain.ranks[0].breakdown.values())
    assert resized.peak_allocated_bytes - plain.peak_allocated_bytes == grown
    assert abs(resized.peak_reserved_bytes - plain.peak_reserved_bytes) > 64 * grown


def test_only_vocabulary_sized_storages_change():
    from estimator.profiler.cache import load_model_profile

    spec = _fms_spec()
    arch, profile = load_model_profile(spec.model, dataclasses.replace(spec.training, vocab_size=0), allow_build=False)
    new = arch.vocab_size + 8
    resized = resize_vocab(profile, arch.vocab_size, new)
    for before, after in zip(profile["regimes"], resized["regimes"]):
        old_sizes = [before["events"]["polys"][k] for k in before["events"]["size"]]
        new_sizes = [after["events"]["polys"][k] for k in after["events"]["size"]]
        changed = [(o, n) for o, n in zip(old_sizes, new_sizes) if o != n]
        assert changed  # the logits, the head and embedding, their gradients and states
        for old, now in changed:
            assert all(x * new == y * arch.vocab_size for x, y in zip(old, now))
    heads = [r for r in resized["params"]["non_layer"] if r["shape"][0] == new]
    assert len(heads) == (1 if arch.tie_word_embeddings else 2)


def test_a_vocabulary_a_layer_dimension_shares_is_refused():
    params = {"per_layer": [{"name": "mlp.up_proj.weight", "shape": [256, 64], "numel": 16384}], "non_layer": []}
    with pytest.raises(ValueError, match="^vocab_size: .*cannot be told apart"):
        resize_vocab({"params": params, "regimes": []}, 512, 520)


torch = pytest.importorskip("torch")

from estimator.profiler.profile import build_profile  # noqa: E402

from .test_matches_trace import TINY  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(TINY))
def test_resized_profile_is_the_trace_of_the_resized_model(family):
    """Re-sizing the configured model's profile gives what tracing the resized config gives (llama: untied head;
    opt: tied), summaries included."""
    config = TINY[family]
    training = TrainingSpec(precision="bf16")
    new = config["vocab_size"] + 3
    traced = json.loads(json.dumps(build_profile({**config, "vocab_size": new}, training, check=False)))  # as stored
    derived = resize_vocab(build_profile(config, training, check=False), config["vocab_size"], new)
    assert derived["params"] == traced["params"]
    for mine, theirs in zip(derived["regimes"], traced["regimes"]):
        for key in ("events", "segments", "segments_manual", "outputs_held", "outputs_held_16bit"):
            assert mine[key] == theirs[key], key


@pytest.mark.slow  # real torch modules in this process: a later fork-isolated harness test hangs after them
def test_harness_build_is_resize_token_embeddings():
    """The harness builds the resized model from the resized config: the same parameters (and tie) as
    transformers' ``resize_token_embeddings`` leaves, without an old-and-new pair on the device."""
    from estimator.profiler.build import build_model

    config = TINY["opt"]
    training = TrainingSpec(precision="fp32", attn="eager")
    new = config["vocab_size"] + 5
    built = build_model(config, dataclasses.replace(training, vocab_size=new))
    reference = build_model(config, training)
    reference.resize_token_embeddings(new, mean_resizing=False)
    shapes = {name: tuple(p.shape) for name, p in built.named_parameters()}
    assert shapes == {name: tuple(p.shape) for name, p in reference.named_parameters()}
    assert built.get_input_embeddings().weight.shape[0] == new
    assert (built.get_output_embeddings().weight is built.get_input_embeddings().weight) == \
        (reference.get_output_embeddings().weight is reference.get_input_embeddings().weight)
    assert built.config.vocab_size == reference.config.vocab_size == new
