"""Alpaca fine-tuning data, as Stanford Alpaca feeds it, with an offline path.

Records ({instruction, input, output}) come from the hub (``tatsu-lab/alpaca`` via ``datasets``) when online,
from a local JSON/JSONL file, or from a deterministic generator whose records say ``"synthetic": true``.
Each example is PROMPT + output + EOS, tokenized and truncated to seq_len; prompt positions get label -100
(Stanford Alpaca's ``train.py``). Tokenizer: the model's own (``AutoTokenizer``) when reachable, else a
byte-level BPE trained on the records with ``tokenizers`` (cached; vocab <= the model's vocab_size).

Batches: ``padding=max_length`` pads every batch to seq_len, ``longest`` to the longest row. ``keep`` picks
which batches are used (see ``harness.options.KEEPS``); the default keeps only rows that reach seq_len, the
worst case the estimator profiles (every position attended, no padding mask).
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.options import DataOptions

IGNORE_INDEX = -100
# Stanford Alpaca's templates, verbatim (tatsu-lab/stanford_alpaca, train.py).
PROMPT_DICT = {
    "prompt_input": (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
    ),
    "prompt_no_input": (
        "Below is an instruction that describes a task. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Response:"
    ),
}
EOS_TOKEN = "<|endoftext|>"
BPE_TRAIN_CHARS = 1_000_000  # characters of record text a byte-level BPE is trained on, at most
_SYLLABLES = ("ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "de", "ba", "zu", "fe", "go", "hi", "ju", "ve",
              "an", "el", "or", "um", "is", "at", "en", "ol")


class DataError(ValueError):
    """Not enough usable data for the requested batches (a user-facing, one-line error)."""


def format_prompt(record: dict[str, Any]) -> str:
    key = "prompt_input" if record.get("input") else "prompt_no_input"
    return PROMPT_DICT[key].format_map({"instruction": record.get("instruction", ""),
                                        "input": record.get("input", "")})


# --------------------------------------------------------------------------------------------- records

def synthetic_records(num_records: int, *, seed: int = 0, long_words: int = 512,
                      long_fraction: float = 0.5) -> list[dict[str, Any]]:
    """Deterministic Alpaca-format records. ``long_fraction`` of them have responses of at least
    ``long_words`` words (each word is at least one token), so full-length rows exist at any seq_len."""
    rng = random.Random(seed)
    words = [rng.choice(_SYLLABLES) + rng.choice(_SYLLABLES) + rng.choice(("", *_SYLLABLES)) for _ in range(2000)]

    def sentence(num_words: int) -> str:
        return " ".join(rng.choices(words, k=num_words))  # one call per sentence: ~4x faster than per word

    records = []
    for index in range(num_records):
        long = rng.random() < long_fraction
        num_output_words = long_words + rng.randint(0, max(1, long_words // 4)) if long else rng.randint(5, 120)
        records.append({"instruction": sentence(rng.randint(4, 20)).capitalize() + ".",
                        "input": sentence(rng.randint(3, 30)) if rng.random() < 0.4 else "",
                        "output": sentence(num_output_words) + ".",
                        "synthetic": True, "id": index})
    return records


def read_records_file(path: str | Path) -> list[dict[str, Any]]:
    """Alpaca JSON (a list of records, as alpaca_data.json) or JSONL (one record per line)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"data.path: no such file {str(path)!r}")
    text = path.read_text()
    try:
        records = json.loads(text) if text.lstrip().startswith("[") else [
            json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as err:
        raise DataError(f"data.path: {str(path)!r} is not JSON or JSONL ({err.msg} at line {err.lineno})") from None
    if not records or not all(isinstance(r, dict) and "instruction" in r and "output" in r for r in records):
        raise DataError(f"data.path: {str(path)!r} must hold Alpaca records with 'instruction' and 'output'")
    return records


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout_s: float = 3.0) -> bool:
    """One HEAD request to the hub (urllib honours HTTPS_PROXY), once per process; False offline or with
    HF_HUB_OFFLINE set."""
    import os
    import urllib.request

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    request = urllib.request.Request(os.environ.get("HF_ENDPOINT", "https://huggingface.co"), method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            return True
    except Exception:  # noqa: BLE001 - any failure means offline here
        return False


def is_online(opts: DataOptions) -> bool:
    setting = str(opts.online).lower()
    return hub_reachable() if setting == "auto" else setting == "true"


def load_records(opts: DataOptions, *, num_needed: int, long_words: int, online: bool
                 ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Records plus a provenance dict (source, reason for any fallback)."""
    notes: list[str] = []
    if opts.source in ("auto", "hub"):
        if online:
            try:
                return _hub_records(opts), {"source": "hub", "hub_id": opts.hub_id}
            except Exception as err:  # noqa: BLE001 - fall back with the reason recorded
                if opts.source == "hub":
                    raise DataError(f"data.hub_id: could not load {opts.hub_id!r} "
                                    f"({err.__class__.__name__}: {str(err)[:120]})") from None
                notes.append(f"hub {opts.hub_id} failed ({err.__class__.__name__}); falling back")
        elif opts.source == "hub":
            raise DataError(f"data.source: hub dataset {opts.hub_id!r} needs network access (offline here)")
        else:
            notes.append(f"offline: hub dataset {opts.hub_id} not reachable")
    if opts.source == "file" or (opts.source == "auto" and opts.path):
        return read_records_file(opts.path)[:opts.max_records], {"source": "file", "path": str(opts.path),
                                                                 "notes": notes}
    num_records = max(64, 4 * num_needed)
    notes.append(f"synthetic Alpaca-format records (seed {opts.seed}); not the real Alpaca data")
    return (synthetic_records(num_records, seed=opts.seed, long_words=long_words),
            {"source": "synthetic", "seed": opts.seed, "num_records": num_records, "notes": notes})


def _hub_records(opts: DataOptions) -> list[dict[str, Any]]:
    from datasets import load_dataset

    dataset = load_dataset(opts.hub_id, split="train")
    return [dict(dataset[i]) for i in range(min(len(dataset), opts.max_records))]


# --------------------------------------------------------------------------------------------- tokenizers

@dataclass
class TextTokenizer:
    """The little the data pipeline needs from a tokenizer, over HF or raw ``tokenizers`` objects."""

    name: str
    encode_fn: Any
    eos_id: int
    pad_id: int
    vocab_size: int
    notes: list[str] = field(default_factory=list)

    def encode(self, text: str) -> list[int]:
        return list(self.encode_fn(text))


def model_tokenizer(name: str, *, online: bool) -> TextTokenizer | None:
    """The model's own tokenizer from the local HF cache (or the hub when online); None when unavailable."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    for local_only in (True, False) if online else (True,):
        try:
            tok = AutoTokenizer.from_pretrained(name, local_files_only=local_only)
            break
        except Exception:  # noqa: BLE001 - not cached / not reachable: try the next way, then give up
            tok = None
    if tok is None:
        return None
    eos = tok.eos_token_id
    if eos is None:
        return None
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos  # Stanford Alpaca: pad = EOS if none
    return TextTokenizer(name=name, encode_fn=lambda text: tok(text)["input_ids"], eos_id=eos, pad_id=pad,
                         vocab_size=len(tok))


def bpe_tokenizer(records: list[dict[str, Any]], vocab_size: int, cache_dir: str | Path | None) -> TextTokenizer:
    """Byte-level BPE trained on the records (a fraction of a second for a few thousand records), cached by
    the training text and vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = []
    budget = BPE_TRAIN_CHARS  # enough text for the merges; more only costs time (long synthetic rows are ~13k chars)
    for record in records[:5000]:
        if budget <= 0:
            break
        texts.append((format_prompt(record) + record.get("output", ""))[:budget])
        budget -= len(texts[-1])
    digest = hashlib.sha256(("\n".join(texts) + f"|{vocab_size}").encode()).hexdigest()[:16]
    cache = Path(cache_dir).expanduser() / "tokenizers" / f"bpe-{digest}.json" if cache_dir else None
    if cache is not None and cache.is_file():
        tok = Tokenizer.from_file(str(cache))
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer=trainer)
        if cache is not None:
            from harness.files import atomic_write_text

            atomic_write_text(cache, tok.to_str())
    eos = tok.token_to_id(EOS_TOKEN)
    return TextTokenizer(name=f"bpe-{tok.get_vocab_size()}-{digest}", encode_fn=lambda t: tok.encode(t).ids,
                         eos_id=eos, pad_id=eos, vocab_size=tok.get_vocab_size())


def choose_tokenizer(opts: DataOptions, *, model_name: str, tokenizer_name: str | None, model_vocab: int,
                     records: list[dict[str, Any]], online: bool, cache_dir: str | None) -> TextTokenizer:
    if opts.tokenizer not in ("auto", "bpe"):
        tokenizer_name = opts.tokenizer
    if opts.tokenizer != "bpe":
        own = model_tokenizer(tokenizer_name or model_name, online=online)
        if own is not None:
            if own.vocab_size > model_vocab:
                own.notes.append(f"tokenizer has {own.vocab_size} ids > model vocab {model_vocab}: ids clamped")
            return own
        if opts.tokenizer not in ("auto", "bpe"):
            raise DataError(f"data.tokenizer: could not load {opts.tokenizer!r}")
    tok = bpe_tokenizer(records, min(opts.bpe_vocab_size, model_vocab), cache_dir)
    tok.notes.append(f"model tokenizer unavailable: byte-level BPE ({tok.vocab_size} tokens) trained on the data")
    return tok


# --------------------------------------------------------------------------------------------- examples

def tokenize_example(record: dict[str, Any], tok: TextTokenizer, seq_len: int | None, max_id: int,
                     ) -> tuple[list[int], list[int], int]:
    """(input_ids, labels, untruncated length), truncated to seq_len unless it is None (packing: a row's
    response tokens may lie past seq_len). Prompt positions are labelled IGNORE_INDEX."""
    prompt = format_prompt(record)
    source_ids = tok.encode(prompt)
    full_ids = tok.encode(prompt + record.get("output", "")) + [tok.eos_id]
    length = len(full_ids)
    ids = [min(i, max_id) for i in full_ids[:seq_len]]
    num_prompt = min(len(source_ids), len(ids))
    labels = [IGNORE_INDEX] * num_prompt + ids[num_prompt:]
    return ids, labels, length


def _examples(records: Iterable[dict[str, Any]], tok: TextTokenizer, seq_len: int | None, max_id: int
              ) -> Iterator[tuple[list[int], list[int], int]]:
    for record in records:
        yield tokenize_example(record, tok, seq_len, max_id)


def _trains(example: tuple[list[int], list[int], int]) -> bool:
    """A row whose labels are all prompt trains nothing (NaN loss): a prompt that fills seq_len."""
    return any(label != IGNORE_INDEX for label in example[1])


def _packed(examples: Iterator[tuple[list[int], list[int], int]], seq_len: int
            ) -> Iterator[tuple[list[int], list[int], int]]:
    ids: list[int] = []
    labels: list[int] = []
    for example_ids, example_labels, _ in examples:
        ids += example_ids
        labels += example_labels
        while len(ids) >= seq_len:
            yield ids[:seq_len], labels[:seq_len], seq_len
            ids, labels = ids[seq_len:], labels[seq_len:]


def select_batches(examples: Iterator[tuple[list[int], list[int], int]], *, micro_batch_size: int, seq_len: int,
                   keep: str, num_batches: int, dp_rank: int, dp_size: int) -> list[list[tuple]]:
    """This data-parallel rank's share (batch j goes to rank j % dp_size) of the kept batches."""
    if keep == "packed":  # rows packed from several examples: judged after packing
        examples = _packed(examples, seq_len)
    examples = (e for e in examples if _trains(e))
    if keep in ("full_rows", "packed"):
        examples = (e for e in examples if e[2] >= seq_len)
    mine: list[list[tuple]] = []
    batch: list[tuple] = []
    index = 0
    for example in examples:
        batch.append(example)
        if len(batch) < micro_batch_size:
            continue
        if keep != "full_batches" or max(e[2] for e in batch) >= seq_len:
            if index % dp_size == dp_rank:
                mine.append(batch)
                if len(mine) == num_batches:
                    return mine
            index += 1
        batch = []
    raise DataError(f"data.keep: only {len(mine)} of {num_batches} batches of {micro_batch_size} "
                    f"{'full-length ' if keep != 'all' else ''}rows at seq_len {seq_len} for dp rank {dp_rank} "
                    f"(try data.keep=packed or data.source=synthetic)")


def collate(batch: list[tuple], *, seq_len: int, padding: str, pad_id: int) -> dict[str, list[list[int]]]:
    """Right padding; labels padded with IGNORE_INDEX; attention mask 1 on real tokens."""
    width = seq_len if padding == "max_length" else max(len(ids) for ids, _, _ in batch)
    out: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "attention_mask": []}
    for ids, labels, _ in batch:
        pad = width - len(ids)
        out["input_ids"].append(ids + [pad_id] * pad)
        out["labels"].append(labels + [IGNORE_INDEX] * pad)
        out["attention_mask"].append([1] * len(ids) + [0] * pad)
    return out


@dataclass
class Batches:
    batches: list[dict[str, list[list[int]]]]
    info: dict[str, Any]


def build_batches(opts: DataOptions, *, model_name: str, tokenizer_name: str | None, model_vocab: int,
                  micro_batch_size: int, seq_len: int, num_batches: int, dp_rank: int = 0, dp_size: int = 1,
                  cache_dir: str | None = None, online: bool | None = None) -> Batches:
    """``num_batches`` micro-batches (as int lists; the worker makes tensors) for one data-parallel rank."""
    online = is_online(opts) if online is None else online
    num_rows = micro_batch_size * num_batches * dp_size
    records, info = load_records(opts, num_needed=num_rows, long_words=seq_len, online=online)
    tok = choose_tokenizer(opts, model_name=model_name, tokenizer_name=tokenizer_name, model_vocab=model_vocab,
                           records=records, online=online, cache_dir=cache_dir)
    examples = _examples(records, tok, None if opts.keep == "packed" else seq_len, model_vocab - 1)
    chosen = select_batches(examples, micro_batch_size=micro_batch_size, seq_len=seq_len, keep=opts.keep,
                            num_batches=num_batches, dp_rank=dp_rank, dp_size=dp_size)
    batches = [collate(b, seq_len=seq_len, padding=opts.padding, pad_id=min(tok.pad_id, model_vocab - 1))
               for b in chosen]
    info = {**info, "tokenizer": tok.name, "synthetic": info["source"] == "synthetic", "padding": opts.padding,
            "keep": opts.keep, "notes": info.get("notes", []) + tok.notes}
    return Batches(batches=batches, info=info)
