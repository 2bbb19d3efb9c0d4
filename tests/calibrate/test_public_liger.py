"""The liger_kernel source (data/public/extract_liger_kernel.py): the committed logs map to the runs' specs."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from estimator.columns import SPEC_INPUT_COLUMNS, spec_from_columns

PUBLIC = Path(__file__).resolve().parents[2] / "data" / "public"
MISTRAL_LOG = "examples/huggingface/results/mistral_use_liger_False_patching_type_None.log"


def _liger():
    sys.path.insert(0, str(PUBLIC))
    try:
        spec = importlib.util.spec_from_file_location("public_liger_kernel", PUBLIC / "extract_liger_kernel.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(PUBLIC))


def _log_values(module, path: str, key: str) -> list[float]:
    """``key``'s value on every line of a committed log, read with a plain regex (not the extractor's parser)."""
    entry = next(e for e in module.manifest(module.SOURCE).values()
                 if e["path"] == path and e["commit"].startswith("38411af"))
    lines = (module.SOURCES / module.SOURCE / entry["file"]).read_text().splitlines()
    steps = "\n".join(line for line in lines if "train_runtime" not in line)  # the summary repeats the last step
    return [float(v) for v in re.findall(rf"'{key}': ([0-9.]+)", steps)]


def test_mistral_rows_are_the_runs_largest_step_peaks_in_mib():
    mod = _liger()
    rows = {r["row_id"]: r for r in mod.extract()}
    allocated = rows["liger_kernel:Mistral-7B-v0.1:full:x4:b32:max_allocated"]
    reserved = rows["liger_kernel:Mistral-7B-v0.1:full:x4:b32:max_reserved"]
    assert allocated["value"] == max(_log_values(mod, MISTRAL_LOG, "step_peak_memory_allocated_MB")) == 34547.91
    assert reserved["value"] == max(_log_values(mod, MISTRAL_LOG, "step_peak_memory_reserved_MB")) == 58180.0
    assert allocated["unit"] == "MiB" and allocated["value_bytes"] == round(34547.91 * 2**20)
    assert allocated["complete"] and reserved["complete"] and allocated["in_scope"]


def test_mistral_row_maps_to_the_runs_fsdp1_spec():
    row = next(r for r in _liger().extract() if r["row_id"] == "liger_kernel:Mistral-7B-v0.1:full:x4:b32:max_allocated")
    spec = spec_from_columns({c: row[c] for c in SPEC_INPUT_COLUMNS})
    assert (spec.model, spec.gpu, spec.parallel.method, spec.parallel.world_size) == (
        "mistralai/Mistral-7B-v0.1", "a100-80gb", "fsdp1", 4)
    assert (spec.training.micro_batch_size, spec.training.seq_len, spec.training.precision) == (32, 512, "mixed_bf16")
    assert (spec.training.grad_ckpt, spec.training.ckpt_reentrant, spec.training.attn) == (True, False, "sdpa")
    assert (spec.training.batch, spec.training.outputs_fp32, spec.training.grad_accum_steps) == ("padded", True, 1)
    assert (row["fsdp1_forward_prefetch"], row["fsdp1_use_orig_params"], row["fsdp1_gpus_per_node"]) == (True, True, 4)


def test_llama_rows_are_incomplete_because_the_peak_is_not_at_the_length_cap():
    mod = _liger()
    rows = [r for r in mod.extract() if "Llama-3" in r["row_id"]]
    assert len(rows) == 2 and not any(r["complete"] for r in rows)
    assert all(r["missing"].startswith("seq_len") for r in rows)
    allocated = _log_values(mod, "examples/huggingface/results/llama_use_liger_False_patching_type_None.log",
                            "step_peak_memory_allocated_MB")
    lines = [{"v": v} for v in allocated]
    assert mod.distinct_levels(lines, "v") == 4 and mod.peak_count(lines, "v") == 3


def test_batch_check_refuses_a_log_of_another_batch_size():
    mod = _liger()
    summary = {"train_runtime": 10.0, "train_samples_per_second": 128.0}  # 1,280 samples = 10 x 4 x 32
    good = [{"loss": 1.0, "num_input_tokens_seen": 32 * 16 * n} for n in (60, 130)] + [summary]
    mod.check_batch(good, "log")
    with pytest.raises(ValueError, match="not batch 32"):
        mod.check_batch([{"loss": 1.0, "num_input_tokens_seen": 24 * 16 * 59}, summary], "log")
    with pytest.raises(ValueError, match="samples"):
        mod.check_batch([{"train_runtime": 10.0, "train_samples_per_second": 96.0}], "log")


def test_mistral_step_lengths_file_is_the_logs_token_increments():
    """The committed lengths file is what the extractor derives from the log: every step's token increment over
    4 ranks x 32 rows, rounded up to the padding multiple (16); the Mistral rows name it for the re-score."""
    mod = _liger()
    seen = _log_values(mod, MISTRAL_LOG, "num_input_tokens_seen")
    increments = [after - before for before, after in zip([0.0] + seen, seen)]
    data = json.loads((PUBLIC.parents[1] / mod.LENGTHS).read_text())
    assert data["kind"] == "steps" and data["rows"] == 32 and len(data["padded_lengths"]) == 10 == len(increments)
    for padded, tokens in zip(data["padded_lengths"], increments):
        assert padded % 16 == 0 and 0 <= padded * 128 - tokens < 16 * 128
    entry = next(e for e in mod.manifest(mod.SOURCE).values()
                 if e["path"] == MISTRAL_LOG and e["commit"].startswith("38411af"))
    lines = mod.log_lines((mod.SOURCES / mod.SOURCE / entry["file"]).read_text())
    assert mod.lengths_file(entry, lines) == data
    rows = [r for r in mod.extract() if "Mistral" in r["row_id"]]
    assert all(r["lengths"] == mod.LENGTHS and r["rescore_lengths"] for r in rows)


def test_calibrate_replays_the_rows_steps_at_their_longest():
    from calibrate.public import _scored_spec, step_lengths

    mod = _liger()
    row = next(r for r in mod.extract() if r["row_id"] == "liger_kernel:Mistral-7B-v0.1:full:x4:b32:max_reserved")
    row = {k: str(v) for k, v in row.items()}
    steps = step_lengths(row)
    assert steps[:3] == ((32, 320), (32, 304), (32, 320)) and len(steps) == 10
    spec, sequence = _scored_spec(row)
    assert sequence.shapes == steps and spec.training.seq_len == max(n for _rows, n in steps) == 384
    assert step_lengths({**row, "lengths": "tatsu-lab/alpaca truncated to 512"}) is None


def test_a_missing_or_unusable_lengths_file_is_a_one_line_error(tmp_path, monkeypatch):
    from calibrate import public

    with pytest.raises(ValueError, match="^lengths: no such file 'data/public/lengths/none.json'$"):
        public.step_lengths({"lengths": "data/public/lengths/none.json"})
    # a file of the dataset's length statistics is no step sequence: row_epoch reads it (ms-swift's rows)
    assert public.step_lengths({"lengths": "data/public/lengths/ms_swift_cls_fudan_news_zh.json"}) is None
    empty = tmp_path / "data" / "public" / "lengths" / "empty_steps.json"
    empty.parent.mkdir(parents=True)
    empty.write_text('{"kind": "steps", "rows": 32, "padded_lengths": []}')
    monkeypatch.setattr(public, "REPO", tmp_path)
    with pytest.raises(ValueError, match="^lengths: .* holds no per-step padded lengths"):
        public.step_lengths({"lengths": "data/public/lengths/empty_steps.json"})
