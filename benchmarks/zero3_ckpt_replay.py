"""ZeRO-3 with activation checkpointing: the estimate's reserved level (replayed on DeepSpeed's three streams) and
the prior it replaces, beside real DeepSpeed runs on CPU of tiny Llamas.

    PYTHONPATH=. .venv/bin/python benchmarks/zero3_ckpt_replay.py [--worlds 2 4] [--llama-1b]
    PYTHONPATH=. .venv/bin/python benchmarks/zero3_ckpt_replay.py --lora [--accum 1 2 4] [--precisions ...] \
        [--ckpt plain ckpt] [--recordings DIR] [--csv PATH]

``--lora`` (peft LoRA r8 on q/v; ``--accum``: micro-steps per optimizer step, each with and without full
non-reentrant checkpointing): the recording marks each allocation's stream as a GPU run makes it
(``test_reserved_zero._StreamMarks``), so both streams are also replayed on DeepSpeed's three streams, and each
stream's requests are compared in order, step by step (``first_differences``; each run of frees as a set).
``--ckpt ckpt``: the checkpointed points only (docs/error_matrix/zero3_lora_ckpt_cpu.csv); ``--targets``: the
adapters' ``lora_targets`` (``q_proj,v_proj`` by default; ``all-linear``: docs/error_matrix/zero3_lora_mlp_ckpt_cpu.csv); ``--recordings``: keep
each point's recorded events there and reuse them (the generated side is rebuilt every time).

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
json.dump(t._real_zero_events(config, spec, 0, marked=len(sys.argv) > 4), open(out, "w"))
"""


def _config(hidden: int) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
            "intermediate_size": hidden * 5 // 2, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 1024,
            "tie_word_embeddings": True}


def _spec(path: str, config: dict, world: int, b: int, s: int, ckpt: bool, precision: str = "mixed_bf16",
          accum: int = 1, lora: bool = False, offload: bool = False, targets: str = "q_proj,v_proj"):
    from estimator.spec import ParallelSpec, RunSpec, TrainingSpec, ZeroSpec

    hidden, inter = config["hidden_size"], config["intermediate_size"]
    layer_numel = 2 * hidden * hidden + 2 * hidden * hidden // 2 + 3 * hidden * inter
    zero = ZeroSpec(reduce_bucket_size=20_000, allgather_bucket_size=20_000,
                    stage3_prefetch_bucket_size=int(0.8 * layer_numel), stage3_param_persistence_threshold=hidden + 1,
                    offload_optimizer=offload)
    training = TrainingSpec(precision=precision, attn="eager", micro_batch_size=b, seq_len=s, grad_ckpt=ckpt,
                            grad_accum_steps=accum, lora_rank=8 if lora else 0, lora_targets=targets if lora else "auto")
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


def _record(work: Path, config: dict, spec, marked: bool, keep: Path | None = None) -> list[tuple]:
    """Rank 0's events of a real run on CPU, in a subprocess (``marked``: with steps and streams); ``keep``: a
    file to reuse the events from (or to write them to)."""
    if keep is not None and keep.exists():
        return [tuple(e) for e in json.loads(keep.read_text())]
    out = keep or work / "events.json"
    subprocess.run([sys.executable, "-c", _RECORD, json.dumps(config), spec.to_json(), str(out)]
                   + (["marked"] if marked else []), cwd=ROOT, check=True, capture_output=True, text=True)
    return [tuple(e) for e in json.loads(out.read_text())]


def recorded_steps(events: list[tuple]) -> list[list[tuple]]:
    """A marked recording's requests (each allocation on the stream a GPU run makes it on): the setup, then one
    list per optimizer step."""
    parts: list[list[tuple]] = [[]]
    for event in events:
        if event == ("step",):
            parts.append([])
        else:
            parts[-1].append(("alloc", event[1], event[2], event[3]) if event[0] else ("free", event[1]))
    return parts


def generated_steps(spec, b: int, s: int, steps: int) -> list[list[tuple]]:
    """The estimator's requests for the same spec on its three streams, split as ``recorded_steps``: the setup
    (module buffers left out, as the recorder leaves them), then each optimizer step's micro-steps; scalars
    (under 512 B: the loss and its kin, which the recorder leaves out too) dropped."""
    from estimator import api
    from estimator.models.profiles import adapters_in_16bit
    from estimator.reserved import rank as reserved_rank
    from estimator.reserved.timeline import micro_step_requests, micro_steps, step_requests
    from tests.estimator.test_reserved_zero import SCALAR_BYTES

    training, accum = spec.training, spec.training.grad_accum_steps
    arch, profile = api.load_model_profile(spec.model, training, 1,
                                           adapters_16bit=adapters_in_16bit(training, spec.parallel.method))
    table, regime = api._param_table(profile, arch.num_layers), api._regime(profile, b, s)
    expansion = reserved_rank._expansion(regime["events"], arch.num_layers, training.loop)
    plan = reserved_rank._plan(spec, regime["events"], expansion, table, arch.num_layers, b, s,
                               workspace_bytes=8 << 20, workspaces=0, rank=0)
    setup = reserved_rank._setup(profile, table, arch.num_layers, "zero3", False, spec.parallel.world_size, spec)
    frees = dict(setup.frees_after)
    parts: list[list[tuple]] = [[]]
    for i, (name, n) in enumerate(setup.allocations):
        if not name.startswith("buffers"):
            parts[0].append(("alloc", ("setup", i), n, 0))
        parts[0].extend(("free", ("setup", j)) for j in frees.get(i, ()))
    micro = micro_steps(plan.expansion) if accum > 1 else None
    for step in range(steps):
        parts.append([r for m in range(step * accum, (step + 1) * accum)
                      for r in (micro_step_requests(plan, micro, accum, m, 0) if micro else step_requests(plan, m, 0))])
    scalars: set = set()
    kept = []
    for part in parts:
        kept.append([])
        for r in part:
            if r[0] == "alloc" and r[2] < SCALAR_BYTES:
                scalars.add(r[1])
            elif r[0] == "alloc" or r[1] not in scalars:
                kept[-1].append(r)
    return kept


def on_one_stream(requests: list[tuple]) -> list[tuple]:
    return [(*r[:3], 0) if r[0] == "alloc" else r for r in requests]


def first_differences(recorded: list[list[tuple]], generated: list[list[tuple]], allocs_sorted: bool = False
                      ) -> list[tuple]:
    """Per stream (0 default, 1 reduction, 2 allgather) and step (the setup left out: a CPU run keeps
    ``zero.Init``'s construction partitions there), the index of the first request whose kind or size differs,
    with the two requests (None: the step's requests agree on that stream). ``allocs_sorted``: each run of
    allocations between two frees sorted too (``_runs_sorted``)."""
    out = []
    for stream in (0, 1, 2):
        for step, (rec, gen) in enumerate(zip(recorded[1:], generated[1:])):
            a, b = _sized(rec, stream), _sized(gen, stream)
            if allocs_sorted:
                a, b = _runs_sorted(a, "a"), _runs_sorted(b, "a")
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else
                      min(len(a), len(b)))
            out.append((stream, step, at, None if at is None else (a[at:at + 1], b[at:at + 1])))
    return out


def _sized(requests: list[tuple], stream: int) -> list[tuple]:
    """One stream's requests as (kind, bytes), each run of frees between two allocations sorted: DeepSpeed
    releases a module's parameters in the order of a Python set of tensors (``release_sub_module``), which
    follows their ids, and frees in a row leave the pool the same in any order."""
    size: dict = {}
    out = []
    for r in requests:
        if r[0] == "alloc":
            size[r[1]] = (r[2], r[3])
            if r[3] == stream:
                out.append(("a", r[2]))
        elif r[1] in size and size[r[1]][1] == stream:
            out.append(("f", size[r[1]][0]))
    return _frees_sorted(out)


def _frees_sorted(sized: list[tuple]) -> list[tuple]:
    return _runs_sorted(sized, "f")


def _runs_sorted(sized: list[tuple], kind: str) -> list[tuple]:
    """``sized`` with each run of consecutive requests of ``kind`` ("a" or "f") sorted. Allocations: on CPU a
    Linear's backward makes its input gradient before its weight gradient, a GPU run (and the profile) the other
    way round; the tiny Llama's control run without reentrancy differs from the generated stream by exactly
    these swaps (docs/error_matrix/zero3_reentrant_cpu.csv)."""
    out: list[tuple] = []
    run: list[tuple] = []
    other = "a" if kind == "f" else "f"
    for r in sized + [(other, None)]:
        if r[0] == kind:
            run.append(r)
            continue
        out += sorted(run)
        run = []
        if r[1] is not None:
            out.append(r)
    return out


def _streams_point(work: Path, hidden: int, world: int, b: int, s: int, ckpt: bool, precision: str, accum: int,
                   offload: bool, keep: Path | None = None, targets: str = "q_proj,v_proj") -> dict:
    from estimator.allocator.requests import simulate
    from estimator.api import estimate

    config = _config(hidden)
    path = work / f"config_h{hidden}.json"
    path.write_text(json.dumps(config))
    spec = _spec(str(path), config, world, b, s, ckpt, precision, accum, lora=True, offload=offload, targets=targets)
    recorded = recorded_steps(_record(work, config, spec, True, keep))
    generated = generated_steps(spec, b, s, len(recorded) - 1)
    flat_rec, flat_gen = [r for p in recorded for r in p], [r for p in generated for r in p]
    replayed, prior = estimate(spec).ranks[0], estimate(spec, replay_reserved=False).ranks[0]
    return {"recorded_one_stream": simulate(on_one_stream(flat_rec))["peak_reserved_bytes"],
            "recorded_three_streams": simulate(flat_rec)["peak_reserved_bytes"],
            "generated_one_stream": simulate(on_one_stream(flat_gen))["peak_reserved_bytes"],
            "generated_three_streams": simulate(flat_gen)["peak_reserved_bytes"],
            "estimate": replayed.peak_reserved_bytes, "source": replayed.reserved_source,
            "prior": prior.peak_reserved_bytes, "differences": first_differences(recorded, generated)}


COLUMNS = ("point", "recorded_one_stream", "recorded_three_streams", "generated_one_stream",
           "generated_three_streams", "estimate", "source", "prior", "first_differences")


def _lora_points(work: Path, args, argv: list[str] | None) -> int:
    rows = []
    print(f"{'point':<36} {'recorded 1/3 streams':>21} {'generated 1/3 streams':>22} {'estimate':>9} {'prior':>8}"
          "  (MiB)  first differences")
    for hidden in args.hidden:
        b, s = (2, 64) if hidden == 64 else (2, 256)
        for world in args.worlds:
            for precision in args.precisions:
                for accum in args.accum:
                    for ckpt in (mode == "ckpt" for mode in args.ckpt):
                        label = (f"h{hidden} x{world} {precision} k{accum} {'ckpt' if ckpt else 'plain'}"
                                 f"{' offload' if args.offload else ''}"
                                 f"{'' if args.targets == 'q_proj,v_proj' else ' ' + args.targets}")
                        keep = Path(args.recordings) / f"{label.replace(' ', '_')}.json" if args.recordings else None
                        r = _streams_point(work, hidden, world, b, s, ckpt, precision, accum, args.offload, keep,
                                           args.targets)
                        diffs = "; ".join(f"s{st} step{step} @{at} {pair[0]} vs {pair[1]}"
                                          for st, step, at, pair in r["differences"] if at is not None)
                        rows.append({"point": label, **{k: r[k] for k in COLUMNS[1:-1]},
                                     "first_differences": diffs or "none"})
                        print(f"{label:<36} {r['recorded_one_stream'] / MIB:>9.2f} / {r['recorded_three_streams'] / MIB:<9.2f}"
                              f" {r['generated_one_stream'] / MIB:>10.2f} / {r['generated_three_streams'] / MIB:<9.2f}"
                              f" {r['estimate'] / MIB:>9.2f} {r['prior'] / MIB:>8.2f}  {diffs or 'none'}", flush=True)
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("# PYTHONPATH=. .venv/bin/python benchmarks/zero3_ckpt_replay.py "
                    + " ".join(argv if argv is not None else sys.argv[1:]) + "\n")
            f.write("# bytes; rank 0 of a real DeepSpeed run on CPU (fake process group) vs the estimator's generated "
                    "stream; one stream / three streams replayed through the allocator model; the estimate's own "
                    "three-stream level; the prior (allocated x 1.1 + 64 MiB); each stream's first differing "
                    "request per step (s0 default, s1 reduction, s2 allgather)\n")
            f.write(",".join(COLUMNS) + "\n")
            for row in rows:
                f.write(",".join(str(row[c]).replace(",", " ") for c in COLUMNS) + "\n")
    return 0


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
    parser.add_argument("--lora", action="store_true", help="LoRA points, compared stream by stream")
    parser.add_argument("--accum", nargs="*", type=int, default=[1, 2])
    parser.add_argument("--precisions", nargs="*", default=["mixed_bf16", "bf16"])
    parser.add_argument("--offload", action="store_true", help="with offload_optimizer")
    parser.add_argument("--ckpt", nargs="*", choices=["plain", "ckpt"], default=["plain", "ckpt"])
    parser.add_argument("--targets", default="q_proj,v_proj", help="the LoRA points' lora_targets")
    parser.add_argument("--csv", help="write the LoRA points here")
    parser.add_argument("--recordings", help="a folder to keep each LoRA point's recorded events in (reused)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    work = Path(tempfile.mkdtemp())
    if args.lora:
        return _lora_points(work, args, argv)
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
