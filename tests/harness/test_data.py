"""Alpaca formatting, loaders, tokenizers and batching (offline)."""

import json

import pytest

from harness.data import (
    IGNORE_INDEX,
    PROMPT_DICT,
    DataError,
    bpe_tokenizer,
    build_batches,
    collate,
    format_prompt,
    load_records,
    read_records_file,
    select_batches,
    synthetic_records,
    tokenize_example,
)
from harness.options import DataOptions


def test_prompt_is_stanford_alpaca():
    with_input = format_prompt({"instruction": "Add.", "input": "1 2", "output": "3"})
    assert with_input == PROMPT_DICT["prompt_input"].format(instruction="Add.", input="1 2")
    assert with_input.endswith("### Input:\n1 2\n\n### Response:")
    assert format_prompt({"instruction": "Hi.", "input": "", "output": "x"}).endswith(
        "### Instruction:\nHi.\n\n### Response:")


def test_synthetic_records_are_deterministic_flagged_and_long_enough():
    a = synthetic_records(20, seed=1, long_words=300)
    assert a == synthetic_records(20, seed=1, long_words=300)
    assert a != synthetic_records(20, seed=2, long_words=300)
    assert all(r["synthetic"] is True and {"instruction", "input", "output"} <= set(r) for r in a)
    assert sum(len(r["output"].split()) >= 300 for r in a) >= 5


def test_offline_auto_falls_back_to_synthetic_and_says_why():
    records, info = load_records(DataOptions(), num_needed=4, long_words=64, online=False)
    assert info["source"] == "synthetic" and records[0]["synthetic"]
    assert any("offline" in note for note in info["notes"])
    with pytest.raises(DataError, match="^data.source:"):
        load_records(DataOptions(source="hub"), num_needed=4, long_words=64, online=False)


def test_local_json_and_jsonl(tmp_path):
    records = [{"instruction": "a", "input": "", "output": "b"}]
    (tmp_path / "a.json").write_text(json.dumps(records))
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records * 2))
    assert read_records_file(tmp_path / "a.json") == records
    assert len(read_records_file(tmp_path / "a.jsonl")) == 2
    (tmp_path / "bad.json").write_text('[{"x": 1}]')
    with pytest.raises(DataError, match="^data.path:"):
        read_records_file(tmp_path / "bad.json")
    _, info = load_records(DataOptions(path=str(tmp_path / "a.json")), num_needed=1, long_words=8, online=False)
    assert info["source"] == "file"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return bpe_tokenizer(synthetic_records(200, long_words=64), 500, tmp_path_factory.mktemp("cache"))


def test_bpe_respects_the_vocab_cap_and_is_cached(tokenizer, tmp_path):
    assert tokenizer.vocab_size <= 500 and tokenizer.eos_id == tokenizer.pad_id
    records = synthetic_records(50, long_words=64)
    first = bpe_tokenizer(records, 400, tmp_path)
    assert list(tmp_path.rglob("bpe-*.json"))
    assert bpe_tokenizer(records, 400, tmp_path).encode("hello world") == first.encode("hello world")


def test_prompt_tokens_are_masked_and_eos_appended(tokenizer):
    record = {"instruction": "Say hi.", "input": "", "output": "hi there"}
    ids, labels, length = tokenize_example(record, tokenizer, seq_len=512, max_id=10**6)
    prompt_len = len(tokenizer.encode(format_prompt(record)))
    assert labels[:prompt_len] == [IGNORE_INDEX] * prompt_len
    assert labels[prompt_len:] == ids[prompt_len:] and ids[-1] == tokenizer.eos_id and length == len(ids)
    clamped, _, _ = tokenize_example(record, tokenizer, seq_len=8, max_id=5)
    assert len(clamped) == 8 and max(clamped) <= 5


def test_collate_pads_right_with_ignored_labels():
    batch = [([1, 2, 3], [IGNORE_INDEX, 2, 3], 3), ([4], [4], 1)]
    out = collate(batch, seq_len=5, padding="max_length", pad_id=0)
    assert out["input_ids"][1] == [4, 0, 0, 0, 0] and out["labels"][1] == [4] + [IGNORE_INDEX] * 4
    assert out["attention_mask"][0] == [1, 1, 1, 0, 0]
    assert len(collate(batch, seq_len=5, padding="longest", pad_id=0)["input_ids"][0]) == 3


def examples(lengths):
    return iter([([7] * min(n, 8), [7] * min(n, 8), n) for n in lengths])


def test_keep_modes():
    full = select_batches(examples([8, 3, 9, 10, 2, 8]), micro_batch_size=2, seq_len=8, keep="full_rows",
                          num_batches=2, dp_rank=0, dp_size=1)
    assert all(len(ids) == 8 for batch in full for ids, _, _ in batch)
    paper = select_batches(examples([3, 4, 8, 2]), micro_batch_size=2, seq_len=8, keep="full_batches",
                           num_batches=1, dp_rank=0, dp_size=1)
    assert [e[2] for e in paper[0]] == [8, 2]  # the first batch never reaches seq_len: skipped
    packed = select_batches(examples([3, 3, 3, 3, 3, 3]), micro_batch_size=1, seq_len=8, keep="packed",
                            num_batches=2, dp_rank=0, dp_size=1)
    assert [len(b[0][0]) for b in packed] == [8, 8]
    with pytest.raises(DataError, match="^data.keep:"):
        select_batches(examples([1, 2]), micro_batch_size=1, seq_len=8, keep="full_rows", num_batches=1,
                       dp_rank=0, dp_size=1)


def test_data_parallel_ranks_get_disjoint_batches():
    def mine(rank):
        return select_batches(iter([([i], [i], 8) for i in range(8)]), micro_batch_size=1, seq_len=8, keep="all",
                              num_batches=2, dp_rank=rank, dp_size=2)
    assert [b[0][0] for b in mine(0)] == [[0], [2]] and [b[0][0] for b in mine(1)] == [[1], [3]]


def test_build_batches_offline_full_length(tmp_path):
    built = build_batches(DataOptions(), model_name="facebook/opt-125m", tokenizer_name=None, model_vocab=1000,
                          micro_batch_size=2, seq_len=128, num_batches=3, cache_dir=str(tmp_path), online=False)
    assert len(built.batches) == 3 and built.info["synthetic"] is True
    for batch in built.batches:
        assert all(len(row) == 128 and max(row) < 1000 for row in batch["input_ids"])
        assert all(all(m == 1 for m in row) for row in batch["attention_mask"])  # full rows: no padding
        assert all(any(label != IGNORE_INDEX for label in row) for row in batch["labels"])


def test_packed_rows_shorter_than_the_prompt_still_train(tmp_path):
    # The Alpaca prompt alone is longer than 16 tokens: truncated examples are all prompt and train nothing,
    # so packing works on whole examples and keeps the rows that hold response tokens.
    built = build_batches(DataOptions(keep="packed"), model_name="facebook/opt-125m", tokenizer_name=None,
                          model_vocab=1000, micro_batch_size=1, seq_len=16, num_batches=2, cache_dir=str(tmp_path),
                          online=False)
    for batch in built.batches:
        assert all(len(row) == 16 for row in batch["input_ids"])
        assert all(any(label != IGNORE_INDEX for label in row) for row in batch["labels"])
