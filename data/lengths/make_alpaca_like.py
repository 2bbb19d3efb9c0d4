"""Write ``alpaca_like_synthetic.txt``: the token-length histogram of an Alpaca-sized set of synthetic records.

The records are the harness's deterministic Alpaca-format generator (``harness.data.synthetic_records``; no
dataset is downloaded), formatted with Stanford Alpaca's prompt template + EOS and tokenized with the byte-level
BPE the harness trains on them offline (``harness.data.bpe_tokenizer``) -- exactly what ``data=synthetic``
feeds a harness run. The lengths are the generator's, not the real Alpaca's. Rebuild (a few seconds, CPU):

    PYTHONPATH=. .venv/bin/python data/lengths/make_alpaca_like.py
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

from harness.data import bpe_tokenizer, synthetic_records, tokenize_example

RECORDS = 52_002            # the size of tatsu-lab/alpaca
SEED = 0
LONG_WORDS = 512            # a tail of long responses (3 % of the records, 512-640 words)
LONG_FRACTION = 0.03
BPE_VOCAB = 8000            # conf/data/alpaca.yaml bpe_vocab_size
OUT = Path(__file__).with_name("alpaca_like_synthetic.txt")


def main() -> int:
    records = synthetic_records(RECORDS, seed=SEED, long_words=LONG_WORDS, long_fraction=LONG_FRACTION)
    tok = bpe_tokenizer(records, BPE_VOCAB, cache_dir=None)
    lengths = [tokenize_example(r, tok, None, BPE_VOCAB - 1)[2] for r in records]
    counts = collections.Counter(lengths)
    header = [f"# Token lengths of {RECORDS} synthetic Alpaca-format records (harness.data.synthetic_records, seed "
              f"{SEED}, long_words {LONG_WORDS}, long_fraction {LONG_FRACTION}),",
              f"# Stanford Alpaca prompt + response + EOS, byte-level BPE of {tok.vocab_size} tokens trained on them.",
              "# Not the real Alpaca's lengths. Rebuild: PYTHONPATH=. python data/lengths/make_alpaca_like.py",
              "# length count"]
    OUT.write_text("\n".join(header + [f"{n} {c}" for n, c in sorted(counts.items())]) + "\n")
    ordered = sorted(lengths)
    print(f"{OUT}: {len(lengths)} samples, p50 {ordered[len(ordered) // 2]}, "
          f"p90 {ordered[int(0.9 * len(ordered))]}, max {ordered[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
