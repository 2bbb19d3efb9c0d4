"""answer.ai fsdp_qlora's rows (data/public/extract_answerai_fsdp_qlora.py) scored with the model code they ask for
(transformers 4.44, standing in for the runs' unpinned 4.37-4.39: the shipped ``..._tf4.44`` profiles) and with
today's (the installed transformers, traced on demand): what the release's Llama forward and loss change in each
row's prediction, the spec otherwise the row's (bf16 adapters, peft 0.8-0.10).

    PYTHONPATH=. python benchmarks/answerai_model_code.py --csv docs/error_matrix/answerai_model_code.csv
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from calibrate.public import DEFAULT_DATA, load, score

GIB = 2**30
SOURCE = "answerai_fsdp_qlora"


def rows_with_model_code(rows: list[dict], model_code: str) -> list[dict]:
    return [dict(row, model_code=model_code) for row in rows]


def table(rows: list[dict]) -> list[dict]:
    """One line per row: published, and predicted (allocated peak, quantity, error) under each model code."""
    by_code = {code or "today": {s.row["row_id"]: s for s in score(rows_with_model_code(rows, code),
                                                                     with_baselines=False)}
               for code in sorted({r["model_code"] for r in rows}) + [""]}
    out = []
    for row in rows:
        line = {"row_id": row["row_id"], "quantity": row["quantity"],
                "published_gib": round(float(row["value_bytes"]) / GIB, 3)}
        for code, scored in by_code.items():
            s = scored[row["row_id"]]
            if s.predicted_bytes is None:
                raise SystemExit(f"{row['row_id']}: not estimated with model code {code}: {s.error}")
            line |= {f"tf_{code}": s.model_code, f"allocated_gib_{code}": round(s.allocated_bytes / GIB, 3),
                     f"predicted_gib_{code}": round(s.predicted_bytes / GIB, 3),
                     f"err_pct_{code}": round(s.err_pct, 1), f"reserved_{code}": s.reserved_source}
        out.append(line)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--csv", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = [r for r in load(args.data) if r["source"] == SOURCE and r["complete"] == "True"
            and r["in_scope"] == "True"]
    if not rows:
        raise SystemExit(f"no complete in-scope {SOURCE} rows in {args.data}")
    lines = table(rows)
    if args.csv:
        with args.csv.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(lines[0]))
            writer.writeheader()
            writer.writerows(lines)
    for line in lines:
        print("  ".join(str(v) for v in line.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
