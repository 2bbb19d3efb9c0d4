"""Reading a config file into a plain dict, without executing anything from it.

JSON with the standard library; YAML with PyYAML's ``safe_load`` only (plain data: no Python tags, no object
construction), imported when a YAML file is read. Pickled files (Trainer's ``training_args.bin``, anything
``torch.save`` wrote) are refused from their first bytes: unpickling runs code chosen by the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Pickle protocol 2+ starts with PROTO (0x80); torch.save writes a zip archive ("PK\x03\x04") holding a pickle.
_PICKLE_MAGIC = (b"\x80", b"PK\x03\x04")
_YAML_SUFFIXES = (".yaml", ".yml")
_MAX_BYTES = 4 * 1024 * 1024


def _fail(path: str, message: str) -> None:
    raise ValueError(f"config: {path}: {message}")


def load_mapping(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a JSON or YAML config file. One-line ``ValueError`` on anything else."""
    name = str(path)
    file = Path(path).expanduser()
    if not file.is_file():
        _fail(name, "no such file")
    raw = file.read_bytes()[: _MAX_BYTES + 1]
    if len(raw) > _MAX_BYTES:
        _fail(name, f"larger than {_MAX_BYTES // 1024 // 1024} MiB; not a training config")
    if raw.startswith(_PICKLE_MAGIC) or file.suffix in (".bin", ".pt", ".pkl", ".pickle"):
        _fail(name, "a pickled file (e.g. Trainer's training_args.bin) is never loaded: unpickling runs code. "
                    "Save the arguments as JSON instead (TrainingArguments.to_json_string()) and pass that")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        _fail(name, "not a UTF-8 text file")
    data = _parse_yaml(name, text) if file.suffix.lower() in _YAML_SUFFIXES else _parse_json_or_yaml(name, text)
    if not isinstance(data, dict):
        _fail(name, f"must hold a mapping of settings at the top level, got {type(data).__name__}")
    return data


def _parse_json_or_yaml(name: str, text: str) -> Any:
    if text.lstrip().startswith(("{", "[")):
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            _fail(name, f"not valid JSON (line {err.lineno}: {err.msg})")
    return _parse_yaml(name, text)


def _parse_yaml(name: str, text: str) -> Any:
    try:
        import yaml
    except ImportError:
        _fail(name, "reading YAML needs PyYAML (pip install pyyaml)")
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        _fail(name, f"not valid YAML ({where}{problem})")
