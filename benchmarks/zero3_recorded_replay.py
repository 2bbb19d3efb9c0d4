"""How much of DeepSpeed ZeRO-3's reserved memory its request sequence alone explains.

    PYTHONPATH=. .venv/bin/python benchmarks/zero3_recorded_replay.py [--model meta-llama/Llama-3.2-1B]
        [--worlds 2 4 8] [-b 1] [-s 1024] [--precision mixed_bf16] [--steps 2]
        [--measured data/measurements/h200-141gb/gpu_emulated.csv]

Each world: rank 0 of a real DeepSpeed ZeRO-3 run on CPU (torch's fake process group, built under transformers'
``zero.Init`` as the harness and the HF Trainer build it), every storage recorded in order
(``tests/estimator/test_reserved_zero._real_zero_events``: scalars under 512 B and module buffers left out), then
the recorded allocations and frees replayed on one stream through the allocator model. Printed beside it: the
estimate (its reserved level replayed on ZeRO-3's three streams: ``estimator.reserved.zero3``) and the GPU row with the same spec in ``--measured``.
What the one-stream replay still misses is what the streams add: the CPU accelerator has one, CUDA's allgather
and reduce-scatter streams keep pools of their own. Real compute of the full-size model: minutes per world and
about 16 GB of host memory for Llama-3.2-1B at two ranks.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_RECORD = """
import json, sys
from tests.estimator import test_reserved_zero as t
from estimator.spec import RunSpec
config, spec, steps, out = json.loads(sys.argv[1]), RunSpec.from_json(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
t.B, t.S, t.STEPS = spec.training.micro_batch_size, spec.training.seq_len, steps
json.dump(t._real_zero_events(config, spec, 0), open(out, "w"))
"""


def _spec(config_path: str, world: int, b: int, s: int, precision: str):
    from estimator.spec import ParallelSpec, RunSpec, TrainingSpec, ZeroSpec

    training = TrainingSpec(precision=precision, attn="sdpa", micro_batch_size=b, seq_len=s)
    return RunSpec(model=config_path, training=training,
                   parallel=ParallelSpec(method="zero3", world_size=world, zero=ZeroSpec()))


def _measured(path: str | None, model: str, world: int, b: int, s: int, precision: str) -> dict | None:
    if not path or not Path(path).exists():
        return None
    with open(path) as handle:
        for row in csv.DictReader(handle):
            if (row["model"], row["method"], row["world_size"], row["micro_batch_size"], row["seq_len"],
                    row["precision"], row["rank"]) == (model, "zero3", str(world), str(b), str(s), precision, "0"):
                return row
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="meta-llama/Llama-3.2-1B")
    parser.add_argument("--worlds", nargs="*", type=int, default=[2, 4, 8])
    parser.add_argument("-b", type=int, default=1)
    parser.add_argument("-s", type=int, default=1024)
    parser.add_argument("--precision", default="mixed_bf16")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--measured", default="data/measurements/h200-141gb/gpu_emulated.csv")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from estimator.allocator.requests import simulate
    from estimator.api import estimate
    from harness.fake.memtracker import load_model_config
    from tests.estimator.test_reserved_zero import _requests

    config = load_model_config(args.model)
    work = Path(tempfile.mkdtemp())
    config_path = work / "config.json"
    config_path.write_text(json.dumps(config))
    gib = 2**30
    print(f"{'world':>5} {'recorded alloc GiB':>19} {'one-stream reserved GiB':>24} {'estimate alloc/res GiB':>23} "
          f"{'measured alloc/res GiB':>23}")
    for world in args.worlds:
        spec = _spec(str(config_path), world, args.b, args.s, args.precision)
        out = work / f"events_w{world}.json"
        subprocess.run([sys.executable, "-c", _RECORD, json.dumps(config), spec.to_json(), str(args.steps),
                        str(out)], cwd=ROOT, check=True, capture_output=True, text=True)
        replay = simulate(_requests([tuple(e) for e in json.loads(out.read_text())], False))
        rank = estimate(spec).ranks[0]
        row = _measured(args.measured, args.model, world, args.b, args.s, args.precision)
        measured = (f"{int(row['peak_allocated_bytes']) / gib:.2f} / {int(row['peak_reserved_bytes']) / gib:.2f}"
                    if row else "-")
        print(f"{world:>5} {replay['peak_allocated_bytes'] / gib:>19.2f} {replay['peak_reserved_bytes'] / gib:>24.2f} "
              f"{rank.peak_allocated_bytes / gib:>11.2f} / {rank.peak_reserved_bytes / gib:<9.2f} {measured:>23}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
