"""Do the estimate and plan outputs stay the same across a speed change? Records the ``--json`` output of a set of
``python -m estimator`` / ``python -m estimator plan`` commands, or compares them with a recording.

    python benchmarks/same_outputs.py record /tmp/before.json     # on the old code
    python benchmarks/same_outputs.py compare /tmp/before.json    # on the new code: exit 1 on any difference

All commands run in one process, in order, so the in-process caches (expansions, setups, replay results) are
exercised across models, methods, allocator settings and plans as a user's session would. Timing fields
(``elapsed_s``) are dropped. The reserved replay decides many of these numbers: single, DDP (bucket rebuild,
allocator OOM under the cap), TP, both loops, expandable segments and ``max_split_size_mb``.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys

H100_7B = ["--gpu", "h100-80gb", "--precision", "bf16", "--micro-batch-size", "2", "--seq-len", "1024"]
COMMANDS: list[list[str]] = [
    ["--model", "meta-llama/Llama-2-7b-hf", "--method", "single", *H100_7B],
    ["--model", "meta-llama/Llama-2-7b-hf", "--method", "ddp", "--gpus", "8", *H100_7B],
    ["--model", "meta-llama/Llama-3.1-8B", "--method", "ddp", "--gpus", "8", *H100_7B],
    ["--model", "meta-llama/Llama-3.1-8B", "--method", "single", *H100_7B,
     "--alloc-conf", "expandable_segments:True"],
    ["--model", "meta-llama/Llama-3.2-1B", "--gpu", "a100-80gb", "--precision", "mixed_bf16",
     "--micro-batch-size", "8", "--seq-len", "2048", "--method", "single"],
    ["--model", "meta-llama/Llama-3.2-1B", "--gpu", "a100-80gb", "--precision", "mixed_bf16",
     "--micro-batch-size", "4", "--seq-len", "1024", "--method", "all", "--gpus", "4"],
    ["--model", "Qwen/Qwen2.5-0.5B", "--gpu", "a100-80gb", "--precision", "bf16", "--micro-batch-size", "8",
     "--seq-len", "2048", "--method", "single", "--alloc-conf", "max_split_size_mb:128,roundup_power2_divisions:4"],
    ["--model", "Qwen/Qwen2.5-0.5B", "--gpu", "a100-80gb", "--precision", "bf16", "--micro-batch-size", "1",
     "--seq-len", "512", "--method", "ddp", "--gpus", "2", "--loop", "manual"],
    ["--model", "meta-llama/Llama-3.2-1B", "--gpu", "a100-40gb", "--precision", "mixed_bf16", "--micro-batch-size",
     "4", "--seq-len", "1024", "--method", "tp", "--gpus", "2", "--tp", "2"],
    ["--model", "Qwen/Qwen2.5-0.5B", "--gpu", "a10-24gb", "--precision", "mixed_bf16", "--micro-batch-size", "4",
     "--seq-len", "2048", "--method", "single"],
    ["plan", "--model", "meta-llama/Llama-3.2-1B", "--gpus", "8", "--gpu", "h100-80gb"],
    ["plan", "--model", "meta-llama/Llama-2-7b-hf", "--gpus", "8", "--gpu", "h100-80gb", "--precision", "bf16"],
    ["plan", "--model", "facebook/opt-2.7b", "--gpus", "4", "--gpu", "v100-16gb", "--seq-len", "512"],
    ["plan", "--model", "Salesforce/codegen-350M-nl", "--gpus", "4", "--gpu", "v100-16gb", "--seq-len", "512"],
    ["plan", "--model", "huggyllama/llama-7b", "--gpus", "4", "--gpu", "v100-16gb", "--seq-len", "512"],
    ["plan", "--model", "Qwen/Qwen2.5-0.5B", "--gpus", "1", "--gpu", "rtx4090-24gb", "--seq-len", "2048",
     "--alloc-conf", "expandable_segments:True"],
]
VOLATILE = ("elapsed_s",)
# estimate() over a grid, every rank's replayed numbers: (model, precision, gpu) x method x (b, s) x allocator conf
GRID_MODELS = (("meta-llama/Llama-3.2-1B", "mixed_bf16", "a100-40gb"), ("Qwen/Qwen2.5-0.5B", "bf16", "l4-24gb"),
               ("meta-llama/Llama-2-7b-hf", "bf16", "h100-80gb"))
GRID_METHODS = (("single", 1, 1), ("ddp", 4, 1), ("tp", 2, 2))
GRID_SHAPES = ((1, 256), (3, 1024), (8, 2048))
GRID_CONFS = ("", "expandable_segments:True")


def _strip(value):
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def run_all() -> dict[str, object]:
    from estimator.io.cli import main

    outputs: dict[str, object] = {}
    for argv in COMMANDS:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([*argv, "--json"])
        text = out.getvalue()
        outputs[" ".join(argv)] = {"exit": code, "stderr": err.getvalue().strip().splitlines()[-1:],
                                   "json": _strip(json.loads(text)) if text.strip() else None}
    outputs.update(_grid())
    return outputs


def _grid() -> dict[str, object]:
    from estimator.api import estimate
    from estimator.spec import ParallelSpec, RunSpec, TrainingSpec

    outputs: dict[str, object] = {}
    for model, precision, gpu in GRID_MODELS:
        for method, world, tp in GRID_METHODS:
            for b, s in GRID_SHAPES:
                for conf in GRID_CONFS:
                    spec = RunSpec(model=model, gpu=gpu, parallel=ParallelSpec(method=method, world_size=world, tp=tp),
                                   training=TrainingSpec(precision=precision, micro_batch_size=b, seq_len=s))
                    key = f"estimate {model} {precision} {gpu} {method}x{world} b{b} s{s} {conf or 'defaults'}"
                    try:
                        outputs[key] = [_strip(rank.__dict__) for rank in estimate(spec, alloc_conf=conf).ranks]
                    except ValueError as err:
                        outputs[key] = f"error: {err}"
    return outputs


def _first_difference(a, b, path: str = "") -> str | None:
    if type(a) is not type(b):
        return f"{path}: {a!r} != {b!r}"
    if isinstance(a, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{path}/{key}: only in {'after' if key not in a else 'before'}"
            found = _first_difference(a[key], b[key], f"{path}/{key}")
            if found:
                return found
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} items != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if a == b else f"{path}: {a!r} != {b!r}"


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("record", "compare"):
        print("usage: same_outputs.py record|compare FILE", file=sys.stderr)
        return 2
    outputs = run_all()
    if argv[0] == "record":
        with open(argv[1], "w") as handle:
            json.dump(outputs, handle, indent=1, sort_keys=True)
        print(f"recorded {len(outputs)} commands in {argv[1]}")
        return 0
    with open(argv[1]) as handle:
        before = json.load(handle)
    differ = 0
    for key in before:
        found = _first_difference(before[key], json.loads(json.dumps(outputs.get(key))))
        differ += found is not None
        if found:
            print(f"DIFFERENT  {key}\n    {found}")
    print(f"{len(before) - differ} of {len(before)} commands and estimates give the same output")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
