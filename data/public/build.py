"""Rebuild ``measurements.csv`` from the copies under ``sources/``: ``python data/public/build.py``.

Deterministic: the same source files give a byte-identical table. Standard library only.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import extract_answerai_fsdp_qlora  # noqa: E402
import extract_deepspeed_chat  # noqa: E402
import extract_fms_acceleration  # noqa: E402
import extract_liger_kernel  # noqa: E402
import extract_litgpt  # noqa: E402
import extract_ms_swift_benchmark  # noqa: E402
import extract_peft_accelerate_docs  # noqa: E402
import extract_peft_experiments  # noqa: E402
import extract_peft_metamathqa  # noqa: E402
import extract_universal_llm_trainer  # noqa: E402

EXTRACTORS = [extract_answerai_fsdp_qlora, extract_deepspeed_chat, extract_fms_acceleration, extract_liger_kernel,
              extract_litgpt, extract_ms_swift_benchmark, extract_peft_accelerate_docs,
              extract_peft_experiments, extract_peft_metamathqa, extract_universal_llm_trainer]


def build(path: Path = common.HERE / "measurements.csv") -> list[dict]:
    rows = [r for module in EXTRACTORS for r in module.extract()]
    common.write_csv(rows, path)
    return rows


def main() -> None:
    rows = build()
    complete = [r for r in rows if r["complete"] and r["in_scope"]]
    sources = sorted({r["source"] for r in complete})
    gpus = sorted({r["gpu"] for r in complete})
    print(f"{len(rows)} rows, {len(complete)} complete and in scope, from {len(sources)} sources "
          f"({', '.join(sources)}) on {len(gpus)} GPU types ({', '.join(gpus)})")


if __name__ == "__main__":
    main()
