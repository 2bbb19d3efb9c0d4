"""ZeRO-3 on architectures other than Llama: the estimator's generated request stream (the coordinator's module
trace recorded in the profile, ``estimator.profiler.modules``) beside real DeepSpeed runs on CPU of tiny models
built from config, request by request on each of DeepSpeed's three streams.

    PYTHONPATH=. .venv/bin/python benchmarks/zero3_arch_replay.py [--archs opt gpt_neox bloom gpt2] \
        [--worlds 2 4] [--ckpt] [--recordings DIR] [--csv docs/error_matrix/zero3_arch_cpu.csv]   # llama: the control

Per point (mixed_bf16, micro-batch 2, seq 64, 3 steps, eager attention; stage-3 knobs scaled to the tiny model: a
prefetch of 0.8 of a layer's elements, the tensors of at most ``hidden`` elements persistent, 20,000-element
buckets): rank 0 of a real run on CPU, every storage recorded with the stream a GPU run makes it on
(``test_reserved_zero._real_zero_events(marked=True)``, in a subprocess), and the estimator's requests for the
same spec (``zero3_ckpt_replay.generated_steps``). ``first_differences``: per stream and step (setup left out: a
CPU run keeps ``zero.Init``'s construction partitions there), the first request whose kind or size differs
(None: all agree). The peaks: each stream list replayed on the three streams, and the estimate's own.
``--ckpt``: with full non-reentrant activation checkpointing (``docs/error_matrix/zero3_arch_ckpt_cpu.csv``);
``--reentrant`` (with ``--ckpt``): reentrant checkpointing (``use_reentrant=True``: the spec's ``ckpt_reentrant``,
which the harness's model build passes on), with the streams compared again with each run of allocations sorted
(``docs/error_matrix/zero3_reentrant_cpu.csv``); every table (since session 33) also compares the streams with
each run of allocations sorted (a CPU run's Linear backward makes its input gradient first) and gives the steps'
live peaks;
``--recordings``: keep each point's recorded events there and reuse them (the generated side is rebuilt).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from zero3_ckpt_replay import _record, first_differences, generated_steps, recorded_steps  # noqa: E402

MIB = 2**20
B, S = 2, 64
ARCHS = {
    # the control: Llama's trace is derived from its table (zero3_gathers.modules_of), checked on H100 snapshots
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 160, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 1000, "max_position_embeddings": 512, "tie_word_embeddings": True},
    "opt": {"model_type": "opt", "architectures": ["OPTForCausalLM"], "hidden_size": 64, "ffn_dim": 256,
            "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 1000, "max_position_embeddings": 512,
            "word_embed_proj_dim": 64, "do_layer_norm_before": True, "tie_word_embeddings": True},
    "gpt_neox": {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "hidden_size": 64,
                 "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 1000,
                 "max_position_embeddings": 512, "rotary_pct": 0.25, "use_parallel_residual": True,
                 "tie_word_embeddings": False},
    "bloom": {"model_type": "bloom", "architectures": ["BloomForCausalLM"], "hidden_size": 64, "n_layer": 4,
              "n_head": 4, "vocab_size": 1000, "tie_word_embeddings": True},
    "gpt2": {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 4, "n_head": 4,
             "vocab_size": 1000, "n_positions": 512, "tie_word_embeddings": True},
}
# (since session 33) the streams compared again with each run of allocations sorted (``_runs_sorted``), and the
# steps' live peaks recorded and generated (from the steps' start: the setup's zero.Init partitions left out)
COLUMNS = ("arch", "world", "recorded_three_streams_mib", "generated_three_streams_mib", "estimate_mib", "source",
           "prior_mib", "streams_agreeing", "first_differences", "streams_agreeing_allocs_sorted",
           "recorded_step_live_mib", "generated_step_live_mib")


def arch_spec(path: str, world: int, ckpt: bool = False, lora: bool = False, reentrant: bool = False):
    """The point's spec: stage-3 knobs from the profile's table (a layer's elements, the hidden size);
    ``ckpt``: every layer checkpointed (non-reentrant unless ``reentrant``); ``lora``: peft LoRA r8 on the architecture's default
    targets."""
    from estimator import api
    from estimator.models.profiles import adapters_in_16bit
    from estimator.spec import ParallelSpec, RunSpec, TrainingSpec, ZeroSpec

    training = TrainingSpec(precision="mixed_bf16", attn="eager", micro_batch_size=B, seq_len=S, grad_ckpt=ckpt,
                            lora_rank=8 if lora else 0, ckpt_reentrant=ckpt and reentrant)
    arch, profile = api.load_model_profile(path, training, 1, adapters_16bit=adapters_in_16bit(training, "zero3"))
    table = api._param_table(profile, arch.num_layers)
    layer_numel = sum(p.numel for p in table if p.layer == 0)
    zero = ZeroSpec(reduce_bucket_size=20_000, allgather_bucket_size=20_000,
                    stage3_prefetch_bucket_size=int(0.8 * layer_numel),
                    stage3_param_persistence_threshold=arch.hidden_size + 1)
    return RunSpec(model=path, training=training, parallel=ParallelSpec(method="zero3", world_size=world, zero=zero))


def point(work: Path, arch: str, world: int, ckpt: bool = False, keep: Path | None = None,
          lora: bool = False, reentrant: bool = False) -> dict:
    from estimator.allocator.requests import simulate
    from estimator.api import estimate

    config = ARCHS[arch]
    path = work / f"config_{arch}.json"
    path.write_text(json.dumps(config))
    spec = arch_spec(str(path), world, ckpt, lora, reentrant)
    recorded = recorded_steps(_record(work, config, spec, True, keep))
    generated = generated_steps(spec, B, S, len(recorded) - 1)
    flat_rec, flat_gen = [r for p in recorded for r in p], [r for p in generated for r in p]
    replayed, prior = estimate(spec).ranks[0], estimate(spec, replay_reserved=False).ranks[0]
    differences = first_differences(recorded, generated)
    sorted_differences = first_differences(recorded, generated, allocs_sorted=True)
    return {"arch": arch, "world": world,
            "streams_agreeing_allocs_sorted": f"{sum(d[2] is None for d in sorted_differences)}/{len(differences)}",
            "recorded_step_live_mib": round(_steps_live_peak(recorded) / MIB, 3),
            "generated_step_live_mib": round(_steps_live_peak(generated) / MIB, 3),
            "recorded_three_streams_mib": round(simulate(flat_rec)["peak_reserved_bytes"] / MIB, 3),
            "generated_three_streams_mib": round(simulate(flat_gen)["peak_reserved_bytes"] / MIB, 3),
            "estimate_mib": round(replayed.peak_reserved_bytes / MIB, 3), "source": replayed.reserved_source,
            "prior_mib": round(prior.peak_reserved_bytes / MIB, 3),
            "streams_agreeing": f"{sum(d[2] is None for d in differences)}/{len(differences)}",
            "first_differences": json.dumps([d for d in differences if d[2] is not None])}


def _steps_live_peak(parts: list[list[tuple]]) -> int:
    """The highest live bytes over the steps' requests, on top of what the setup left live (the setup's own
    transients left out: a CPU run keeps ``zero.Init``'s construction partitions there)."""
    size: dict = {}
    live = peak = base = 0
    for k, part in enumerate(parts):
        for r in part:
            if r[0] == "alloc":
                size[r[1]] = r[2]
                live += r[2]
            elif r[1] in size:
                live -= size.pop(r[1])
            if k:
                peak = max(peak, live - base)
        if not k:
            base = live  # measured from the steps' start
    return peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--archs", nargs="*", default=list(ARCHS))
    parser.add_argument("--worlds", nargs="*", type=int, default=[2, 4])
    parser.add_argument("--ckpt", action="store_true", help="every layer checkpointed (non-reentrant)")
    parser.add_argument("--lora", action="store_true", help="peft LoRA r8 on the default targets")
    parser.add_argument("--reentrant", action="store_true",
                        help="with --ckpt: reentrant checkpointing (use_reentrant=True, the spec's ckpt_reentrant)")
    parser.add_argument("--recordings", help="a folder to keep each point's recorded events in (reused)")
    parser.add_argument("--csv")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs:
            for world in args.worlds:
                keep = (Path(args.recordings) / f"{arch}_x{world}{'_ckpt' if args.ckpt else ''}"
                        f"{'_reentrant' if args.reentrant else ''}{'_lora' if args.lora else ''}.json"
                        if args.recordings else None)
                rows.append(point(Path(tmp), arch, world, args.ckpt, keep, args.lora, args.reentrant))
                print(" ".join(f"{k}={rows[-1][k]}" for k in COLUMNS), flush=True)
    if args.csv:
        import csv

        with open(args.csv, "w", newline="") as f:
            f.write("# PYTHONPATH=. .venv/bin/python benchmarks/zero3_arch_replay.py --archs "
                    f"{' '.join(args.archs)} --worlds {' '.join(map(str, args.worlds))}"
                    f"{' --ckpt' if args.ckpt else ''}{' --reentrant' if args.reentrant else ''}"
                    f"{' --lora' if args.lora else ''} --csv {args.csv}\n")
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
