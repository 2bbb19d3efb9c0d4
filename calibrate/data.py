"""Reading and validating the harness's measurement tables (``data/measurements/<gpu-key>/<campaign>.csv``).

Cells are read as text and converted column by column, so a hex run id never turns into a float and a
malformed cell is reported, not guessed. Every problem names the file and its line numbers (the header
is line 1, the first row line 2): a table that fails validation is never fitted.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from estimator.columns import ADDED_SPEC_FIELDS, SPEC_INPUT_COLUMNS, spec_from_columns
from estimator.hardware.gpus import get_gpu

# Keys whose rows hold no GPU memory to fit: CPU runs, and fake-tensor traces (allocated bytes only, device
# independent). The report still reads them.
NON_GPU_KEYS = ("cpu", "fake")
RUN_STATUSES = ("ok", "oom", "error", "timeout")
IDENTITY_COLUMNS = ["run_id", "gpu_key", "rank", "world_size", "run_status", "rank_status", "emulated",
                    "measured_by", "memory_source"]
LEVEL_COLUMNS = ["peak_allocated_bytes", "peak_reserved_bytes", "peak_device_bytes"]
REQUIRED_COLUMNS = list(dict.fromkeys(IDENTITY_COLUMNS + [c for c in SPEC_INPUT_COLUMNS if c not in ADDED_SPEC_FIELDS]
                                      + LEVEL_COLUMNS + ["device_total_bytes"]))
# Read when present (older tables may lack them): added as empty columns otherwise.
OPTIONAL_COLUMNS = ["spec_id", "campaign", "memory_cap_bytes", "num_alloc_retries", "tokens_per_s", "step_time_s",
                    "oom_step", "peak_active_bytes", "cuda_context_bytes", "cuda_context_after_warmup_bytes",
                    "torch_version", "driver_version", "cuda_version", "gpu_name", "padding", "data_keep",
                    "effective_attn", *ADDED_SPEC_FIELDS]
NUMERIC_COLUMNS = ["rank", "world_size", "micro_batch_size", "seq_len", "device_total_bytes", "memory_cap_bytes",
                   "num_alloc_retries", "tokens_per_s", "step_time_s", "oom_step", "peak_active_bytes",
                   "cuda_context_bytes", "cuda_context_after_warmup_bytes"] + LEVEL_COLUMNS
BYTES_COLUMNS = [c for c in NUMERIC_COLUMNS if c.endswith("_bytes")]
MAX_LINES_SHOWN = 10


class ValidationError(ValueError):
    """The tables cannot be fitted; ``problems`` holds one line per problem (file, lines, what)."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(problems[0] if len(problems) == 1 else f"{len(problems)} problems: {problems[0]} ...")


@dataclass
class Table:
    """The rows of every file read, with ``_file`` / ``_line`` naming where each came from."""

    rows: pd.DataFrame
    files: list[dict] = field(default_factory=list)   # {"path", "sha256", "rows", "gpu_key"}


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def display_path(path: Path) -> str:
    """Repo-relative when under the working directory (what provenance records and tests compare)."""
    path = Path(path).resolve()
    try:
        return path.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return path.as_posix()


def discover(data: list[Path], gpu_keys: list[str] | None = None) -> list[tuple[Path, str | None]]:
    """(csv file, expected gpu key) pairs. A directory is a measurements root (``<key>/*.csv``) or one key's
    folder (``*.csv`` directly inside: the folder name is the key); a CSV file stands alone (key from its rows)."""
    found: list[tuple[Path, str | None]] = []
    for root in data:
        root = Path(root)
        if root.is_file():
            found.append((root, None))
            continue
        if not root.is_dir():
            raise ValidationError([f"{root}: no such file or directory"])
        direct = sorted(root.glob("*.csv"))
        folders = [(root, direct)] if direct else [(d, sorted(d.glob("*.csv"))) for d in sorted(root.iterdir())
                                                   if d.is_dir()]
        for folder, files in folders:
            found.extend((f, folder.name) for f in files)
    if gpu_keys:
        wanted = set(gpu_keys)
        found = [(f, key) for f, key in found if key is None or key in wanted]
    return found


def _lines(index: list[int]) -> str:
    lines = [i + 2 for i in index]  # header is line 1
    shown = ", ".join(map(str, lines[:MAX_LINES_SHOWN]))
    more = f" (+{len(lines) - MAX_LINES_SHOWN} more)" if len(lines) > MAX_LINES_SHOWN else ""
    return f"line{'s' if len(lines) > 1 else ''} {shown}{more}"


def _as_bool(text: str) -> bool | None:
    """The harness writes Python's ``True``/``False``; anything else is not a truth value."""
    return {"true": True, "false": False, "1": True, "0": False}.get(str(text).strip().lower())


def read_file(path: Path, expected_key: str | None) -> tuple[pd.DataFrame, list[str]]:
    """One CSV as a typed frame plus its problems (empty when the file is fit to use)."""
    where = display_path(path)
    try:
        raw = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (OSError, UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as err:
        return pd.DataFrame(), [f"{where}: cannot read it as CSV ({err.__class__.__name__})"]
    missing = [c for c in REQUIRED_COLUMNS if c not in raw.columns]
    if missing:
        return raw, [f"{where}: missing column{'s' if len(missing) > 1 else ''} {', '.join(missing)}"]
    for column in OPTIONAL_COLUMNS:
        if column not in raw.columns:
            raw[column] = ""
    problems: dict[str, list[int]] = defaultdict(list)
    df = raw.copy()
    for column in NUMERIC_COLUMNS:
        text = raw[column].str.strip()
        values = pd.to_numeric(text.where(text != ""), errors="coerce")
        for i in raw.index[(text != "") & values.isna()]:
            problems[f"{column} is not a number"].append(i)
        df[column] = values
    df["emulated"] = [_as_bool(v) for v in raw["emulated"]]
    unreadable = {i for idx in problems.values() for i in idx}  # already reported: no second message
    _check_rows(df, problems, unreadable)
    if expected_key is not None:
        other = df.index[df["gpu_key"] != expected_key].tolist()
        if other:
            problems[f"gpu_key is not {expected_key!r} (the folder's key)"] += other
    elif df["gpu_key"].nunique() > 1:
        first = df["gpu_key"].iloc[0]
        problems[f"mixed gpu_key in one file (first row says {first!r})"] += df.index[df["gpu_key"] != first].tolist()
    for key in sorted(set(df["gpu_key"]) - set(NON_GPU_KEYS) - {""}):
        if _canonical_gpu(key) != key:
            problems[f"gpu_key {key!r} is not a GPU key of the estimator (python -m estimator --list-gpus)"] += \
                df.index[df["gpu_key"] == key].tolist()
    dup = df.index[df.duplicated(["run_id", "rank"], keep="first")].tolist()
    if dup:
        problems["duplicate (run_id, rank)"] += dup
    df["_file"] = where
    df["_line"] = df.index + 2
    return df, [f"{where}: {_lines(sorted(set(idx)))}: {what}" for what, idx in problems.items()]


def _canonical_gpu(key: str) -> str | None:
    try:
        return get_gpu(key).key
    except ValueError:
        return None


def _check_rows(df: pd.DataFrame, problems: dict[str, list[int]], unreadable: set[int]) -> None:
    """Row rules: identity present, statuses known, spec rebuildable, peaks non-negative and possible."""
    for column in ("run_id", "gpu_key", "run_status", "rank_status", "measured_by", "memory_source"):
        for i in df.index[df[column].str.strip() == ""]:
            problems[f"{column} is empty"].append(i)
    for column in ("rank", "world_size"):
        for i in df.index[df[column].isna()]:
            problems[f"{column} is empty"].append(i)
    for i in df.index[df["emulated"].isna()]:
        problems["emulated is not True/False"].append(i)
    for column in ("run_status", "rank_status"):
        for i in df.index[~df[column].isin(RUN_STATUSES) & (df[column] != "")]:
            problems[f"{column} is not one of {', '.join(RUN_STATUSES)}"].append(i)
    for i in df.index:
        if df.at[i, "rank"] == -1 or i in unreadable:
            continue  # a run that failed before any rank wrote needs no spec cells; unreadable cells are reported
        try:
            spec_from_columns(df.loc[i].to_dict())
        except (ValueError, TypeError, KeyError) as err:
            problems[f"spec cells do not make a RunSpec ({str(err).splitlines()[0]})"].append(i)
    for column in BYTES_COLUMNS:
        for i in df.index[df[column] < 0]:
            problems[f"{column} is negative"].append(i)
    measured = (df["rank_status"] == "ok") & (df["run_status"] == "ok")
    cuda = df["memory_source"] == "cuda"
    for column in LEVEL_COLUMNS + ["device_total_bytes"]:
        for i in df.index[measured & cuda & df[column].isna()]:
            problems[f"{column} is empty on an ok CUDA row"].append(i)
    for i in df.index[measured & (df["memory_source"] == "fake_tensor_trace") & df["peak_allocated_bytes"].isna()]:
        problems["peak_allocated_bytes is empty on an ok fake-trace row"].append(i)
    impossible = [
        ("peak_allocated_bytes", "peak_reserved_bytes", "peak_allocated_bytes exceeds peak_reserved_bytes"),
        ("peak_reserved_bytes", "device_total_bytes", "peak_reserved_bytes exceeds device_total_bytes"),
        ("peak_device_bytes", "device_total_bytes", "peak_device_bytes exceeds device_total_bytes"),
        ("peak_reserved_bytes", "memory_cap_bytes", "peak_reserved_bytes exceeds memory_cap_bytes (the allocator cap)"),
    ]
    for low, high, what in impossible:
        for i in df.index[df[low] > df[high]]:  # NaN compares False: only rows with both cells are judged
            problems[what].append(i)


def load(data: list[Path], gpu_keys: list[str] | None = None) -> Table:
    """Every table under ``data``, validated. Raises ``ValidationError`` listing every problem."""
    pairs = discover(data, gpu_keys)
    frames, problems, files = [], [], []
    for path, key in pairs:
        df, file_problems = read_file(path, key)
        problems += file_problems
        if not file_problems:
            frames.append(df)
            keys = sorted(set(df["gpu_key"])) if len(df) else ([key] if key else [])
            files.append({"path": display_path(path), "sha256": sha256_file(path), "rows": int(len(df)),
                          "gpu_key": keys[0] if keys else None})
    if problems:
        raise ValidationError(problems)
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=REQUIRED_COLUMNS
                                                                             + OPTIONAL_COLUMNS)
    if gpu_keys:
        rows = rows[rows["gpu_key"].isin(gpu_keys)].reset_index(drop=True)
    return Table(rows=rows, files=files)
