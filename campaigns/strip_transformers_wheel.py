"""Shrink a transformers wheel to the model code one GPU call needs, so it fits the device tool's carry limit.

    python3 campaigns/strip_transformers_wheel.py IN.whl OUT_DIR [--keep mistral,llama,auto,bloom,whisper]

Drops every TensorFlow / Flax modeling file and the PyTorch modeling files of the models not kept, and their
lines of RECORD (pip installs the rest unchanged). transformers imports model code lazily, so a kept model, its
configuration classes and every model's ``__init__`` still import. Keep bloom and whisper with peft 0.13.x: its
``constants`` and ``peft_model`` import ``BloomPreTrainedModel`` and ``WhisperForConditionalGeneration``.
Session 30 (campaigns/gpu_session.md): transformers 4.48.1 9.7 MB -> 4.9 MB.
"""

from __future__ import annotations

import argparse
import re
import sys
import zipfile
from pathlib import Path

DEFAULT_KEEP = "mistral,llama,auto,bloom,whisper"


def dropped(name: str, keep: set[str]) -> bool:
    """Whether ``name`` (a path inside the wheel) is model code outside ``keep``."""
    base = name.rsplit("/", 1)[-1]
    if base.startswith(("modeling_tf_", "modeling_flax_")):
        return True
    match = re.fullmatch(r"transformers/models/([^/]+)/modeling_[^/]+\.py", name)
    return bool(match) and match.group(1) not in keep


def strip_wheel(source: Path, out_dir: Path, keep: set[str]) -> Path:
    target = out_dir / source.name
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if dropped(info.filename, keep):
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not dropped(line.split(",", 1)[0], keep)).encode()
            zout.writestr(info, data)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--keep", default=DEFAULT_KEEP, help=f"models whose PyTorch code stays (default {DEFAULT_KEEP})")
    args = parser.parse_args(argv)
    if not args.wheel.is_file() or not zipfile.is_zipfile(args.wheel):
        print(f"strip_transformers_wheel: {args.wheel} is not a wheel", file=sys.stderr)
        return 2
    if args.out_dir.resolve() == args.wheel.parent.resolve():
        print("strip_transformers_wheel: OUT_DIR must differ from the wheel's folder", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    target = strip_wheel(args.wheel, args.out_dir, {m.strip() for m in args.keep.split(",") if m.strip()})
    print(f"{target}: {args.wheel.stat().st_size:,} -> {target.stat().st_size:,} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
