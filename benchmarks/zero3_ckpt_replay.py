"""ZeRO-3 with activation checkpointing: the estimate's reserved level (replayed on DeepSpeed's three streams) and
the prior it replaces, beside real DeepSpeed runs on CPU of tiny Llamas.

    PYTHONPATH=. .venv/bin/python benchmarks/zero3_ckpt_replay.py [--worlds 2 4] [--llama-1b]

Per point (tiny Llama, hidden 64 or 256, 4 layers, mixed_bf16, 3 steps; norms persistent, a prefetch about a
layer): rank 0 of a real run on CPU (torch's fake process group, every storage recorded:
``tests/estimator/test_reserved_zero._real_zero_events``, in a subprocess), its requests replayed on one stream
(a CPU run has one), and the estimator's generated stream for the same spec replayed on one stream too; then the
estimate's own reserved level (three streams) and the prior (allocated x 1.1 + 64 MiB). The recorded stream holds
``zero.Init``'s construction partitions, which a GPU run moves to the host (``estimator.reserved.zero3``): the
same few hundred KiB with and without checkpointing. ``--llama-1b``: the estimate for Llama-3.2-1B ZeRO-3 x 4 at
b1 / b4 s1024 (H200), with and without checkpointing, replayed and prior. Real compute of tiny models only: a few
seconds a point.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20

_RECORD = """
import json, sys
from tests.estimator import test_reserved_zero as t
from estimator.spec import RunSpec
config, spec, out = json.loads(sys.argv[1]), RunSpec.from_json(sys.argv[2]), sys.argv[3]
t.B, t.S = spec.training.micro_batch_size, spec.training.seq_len
json.dump(t._real_zero_events(config, spec, 0), open(out, "w"))
"""


def _config(hidden: int) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
            "intermediate_size": hidden * 5 // 2, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 1024,
            "tie_word_embeddings": True}


def _spec(path: str, config: dict, world: int, b: int, s: int, ckpt: bool):
    from estimator.spec import ParallelSpec, RunSpec, TrainingSpec, ZeroSpec

    hidden, inter = config["hidden_size"], config["intermediate_size"]
    layer_numel = 2 * hidden * hidden + 2 * hidden * hidden // 2 + 3 * hidden * inter
    zero = ZeroSpec(reduce_bucket_size=20_000, allgather_bucket_size=20_000,
                    stage3_prefetch_bucket_size=int(0.8 * layer_numel), stage3_param_persistence_threshold=hidden + 1)
    training = TrainingSpec(precision="mixed_bf16", attn="eager", micro_batch_size=b, seq_len=s, grad_ckpt=ckpt)
    return RunSpec(model=path, training=training, parallel=ParallelSpec(method="zero3", world_size=world, zero=zero))


def _tiny_point(work: Path, hidden: int, world: int, b: int, s: int, ckpt: bool) -> dict:
    from estimator.allocator.requests import simulate
    from estimator.api import estimate
    from estimator.reserved.timeline import live_requested_peak
    from tests.estimator import test_reserved_zero as t

    config = _config(hidden)
    path = work / f"config_h{hidden}.json"
    path.write_text(json.dumps(config))
    spec = _spec(str(path), config, world, b, s, ckpt)
    out = work / "events.json"
    subprocess.run([sys.executable, "-c", _RECORD, json.dumps(config), spec.to_json(), str(out)], cwd=ROOT,
                   check=True, capture_output=True, text=True)
    recorded = t._requests([tuple(e) for e in json.loads(out.read_text())], False)
    t.B, t.S = b, s
    generated = t._requests(t._generated(spec, 0), True)
    replayed, prior = estimate(spec).ranks[0], estimate(spec, replay_reserved=False).ranks[0]
    return {"recorded_requested": live_requested_peak(recorded),
            "recorded_one_stream": simulate(recorded)["peak_reserved_bytes"],
            "generated_requested": live_requested_peak(generated),
            "generated_one_stream": simulate(generated)["peak_reserved_bytes"],
            "estimate": replayed.peak_reserved_bytes, "source": replayed.reserved_source,
            "prior": prior.peak_reserved_bytes}


def _llama_1b(b: int, ckpt: bool) -> tuple:
    from estimator.api import estimate
    from estimator.spec import ParallelSpec, RunSpec, TrainingSpec

    spec = RunSpec(model="meta-llama/Llama-3.2-1B", gpu="h200-141gb",
                   training=TrainingSpec(precision="mixed_bf16", micro_batch_size=b, seq_len=1024, grad_ckpt=ckpt),
                   parallel=ParallelSpec(method="zero3", world_size=4))
    replayed, prior = estimate(spec), estimate(spec, replay_reserved=False)
    return (replayed.ranks[0].peak_allocated_bytes, replayed.ranks[0].peak_reserved_bytes,
            replayed.reserved_source, prior.ranks[0].peak_reserved_bytes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", nargs="*", type=int, default=[2, 4])
    parser.add_argument("--hidden", nargs="*", type=int, default=[64, 256])
    parser.add_argument("--llama-1b", action="store_true")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    work = Path(tempfile.mkdtemp())
    print(f"{'point':<28} {'recorded req/1-stream':>22} {'generated req/1-stream':>23} {'estimate (3 streams)':>21} "
          f"{'prior':>8}  (MiB)")
    for hidden in args.hidden:
        b, s = (2, 64) if hidden == 64 else (2, 256)
        for world in args.worlds:
            for ckpt in (False, True):
                r = _tiny_point(work, hidden, world, b, s, ckpt)
                label = f"h{hidden} x{world} b{b} s{s} {'ckpt' if ckpt else 'plain'}"
                print(f"{label:<28} {r['recorded_requested'] / MIB:>10.2f} / {r['recorded_one_stream'] / MIB:<9.2f} "
                      f"{r['generated_requested'] / MIB:>11.2f} / {r['generated_one_stream'] / MIB:<9.2f} "
                      f"{r['estimate'] / MIB:>12.2f} {r['source']:<8} {r['prior'] / MIB:>8.2f}", flush=True)
    if args.llama_1b:
        gib = 2**30
        print(f"\n{'Llama-3.2-1B zero3 x4 H200':<34} {'allocated GiB':>14} {'reserved GiB':>13} {'prior GiB':>10}")
        for b in (1, 4):
            for ckpt in (False, True):
                allocated, reserved, source, prior = _llama_1b(b, ckpt)
                label = f"b{b} s1024 {'ckpt' if ckpt else 'plain'}"
                print(f"{label:<34} {allocated / gib:>14.3f} {reserved / gib:>13.3f} {prior / gib:>10.3f}  "
                      f"{source} ({(prior - reserved) / reserved:+.1%} prior vs replay)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
