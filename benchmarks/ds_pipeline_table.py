"""DeepSpeed's pipeline engine against real CPU runs on gloo ranks (issue 18).

    PYTHONPATH=. .venv/bin/python benchmarks/ds_pipeline_table.py [--config CONFIG.json] [--pp 2 4]
        [--microbatches 4 8] [--points 1x64 2x32] [--precision fp32] [--csv docs/error_matrix/pipeline_deepspeed.csv]
        [--trace]
    PYTHONPATH=. .venv/bin/python benchmarks/ds_pipeline_table.py --rescore docs/error_matrix/pipeline_deepspeed.csv

Each point runs ``pp`` gloo ranks in freshly spawned interpreters: the transformers model as a
``deepspeed.pipe.PipelineModule`` (``harness.ds_pipeline``: embedding, one layer per decoder layer, norm + head;
``partition_method="parameters"``, DeepSpeed's default), ``deepspeed.initialize`` with torch's foreach AdamW as the
client optimizer and ZeRO stage 0, ``engine.train_batch`` over ``--microbatches`` micro-batches. Every live storage
is counted after every operator (``harness.fake.live_storage``, as ``benchmarks/pipeline_table.py`` counts torch's
pipelining) over two steady steps after a warm-up step (which allocates the engine's receive buffers and the
optimizer states); each rank's peak is compared with the estimate's ``traced_allocated_bytes`` for that rank
(first, middle and last pipeline rank). ``--trace`` prints each rank's live bytes around every instruction of the
engine's schedule.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.table_csv import read_rows, write_rows

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CONFIG = HERE / "configs" / "llama_pp_tiny.json"


def _rank(rank: int, world: int, pp: int, microbatches: int, config: dict, precision: str, b: int, s: int,
          port: int, out: str, trace: bool, ckpt_interval: int = 0, zero_stage: int = 0) -> None:
    sys.path.insert(0, str(REPO))
    import gc

    from benchmarks.gloo_ranks import join, nccl_live_storages_class

    dist = join(rank, world, port)
    import torch

    try:
        import deepspeed
        from transformers import AutoConfig

        from harness import ds_pipeline as dsp
        from harness.methods.deepspeed import patch_deepspeed

        patch_deepspeed(fake_pg=False)
        if precision == "mixed_fp16":
            # DeepSpeed's CPU accelerator allows fp16 only where oneDNN has fp16 kernels; torch's CPU fp16 ops run
            # without them (slower), and the engine's allocations do not depend on it
            from deepspeed.accelerator import get_accelerator

            get_accelerator().is_fp16_supported = lambda: True
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
        hf = AutoConfig.for_model(config["model_type"], **fields)
        hf._attn_implementation = "sdpa"
        vocab = int(config["vocab_size"])
        torch.manual_seed(0)
        engine, module = dsp.build_engine(hf, pp, precision, b, microbatches, dp=world // pp,
                                          ckpt_interval=ckpt_interval, zero_stage=zero_stage)
        optimizer = engine.optimizer
        gc.collect()
        generator = torch.Generator().manual_seed(1)  # the same batches on every rank of the pipeline

        def batches():
            while True:
                ids = torch.randint(0, vocab, (b, s), generator=generator)
                yield ids, ids

        data = batches()
        engine.train_batch(data)  # warm-up: receive buffers, optimizer states
        gc.collect()
        mode = nccl_live_storages_class()()
        for obj in gc.get_objects():  # parameters, optimizer states, the engine's buffers
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                mode.add(obj)
        mode.peak_bytes = mode.live_bytes()
        if trace:
            _resident(module, optimizer, mode)
            for name, items in engine.pipe_buffers.items():
                print("    pipe_buffers", name, [None if x is None else (tuple(x.shape) if hasattr(x, "shape")
                                                                      else type(x).__name__) for x in items])
            print("    grad_layer_buf", [tuple(x.shape) for x in engine._grad_layer_buf], flush=True)
        events: list = []
        if trace:
            _trace(engine, mode, events)
        with mode:
            engine.train_batch(data)
            engine.train_batch(data)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "peak_bytes": mode.peak_bytes,
                                                             "events": events,
                                                             "parts": list(map(int, module.parts))}))
    finally:
        dist.destroy_process_group()


def _resident(module, optimizer, mode) -> None:
    """Print the counted storages that are neither parameters nor optimizer states (at the step's start)."""
    import torch

    known = {p.untyped_storage()._cdata for p in module.parameters()}
    known |= {v.untyped_storage()._cdata for st in optimizer.state.values() for v in st.values()
              if isinstance(v, torch.Tensor)}
    import gc

    where = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            where.setdefault(obj.untyped_storage()._cdata, []).append(
                (tuple(obj.shape), obj.requires_grad, type(obj.grad_fn).__name__, obj.grad is not None))
    for key, ref in mode.storages.items():
        storage = ref()
        if storage is not None and key not in known and storage.nbytes() > 1024:
            print("    resident", storage.nbytes(), where.get(key), flush=True)


def _trace(engine, mode, events: list) -> None:
    """Live bytes before and after, and the peak within, each instruction the engine executes
    (``_exec_schedule`` binds ``_INSTRUCTION_MAP[type(cmd)]`` to the engine: an instance-level map of wrapped
    functions replaces the class's)."""
    wrapped_map = {}
    for cls, function in type(engine)._INSTRUCTION_MAP.items():
        def wrapped(self, _function=function, _cls=cls, **kwargs):
            before = mode.live_bytes()
            mode.peak_bytes, outer = before, mode.peak_bytes
            result = _function(self, **kwargs)
            events.append([_cls.__name__, kwargs.get("buffer_id"), before, mode.peak_bytes, mode.live_bytes()])
            mode.peak_bytes = max(outer, mode.peak_bytes)
            return result

        wrapped_map[cls] = wrapped
    engine._INSTRUCTION_MAP = wrapped_map


def measured(config: dict, pp: int, microbatches: int, precision: str, b: int, s: int,
             trace: bool = False, ckpt_interval: int = 0, dp: int = 1, zero_stage: int = 0) -> list[dict]:
    """Each rank's peak live bytes (and, with ``trace``, its per-instruction events), over world = pp x dp ranks
    (DeepSpeed's ``PipeDataParallelTopology``: global rank = stage x dp + data-parallel rank)."""
    import torch.multiprocessing as mp

    from benchmarks.gloo_ranks import free_port

    world = pp * dp
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(world, pp, microbatches, config, precision, b, s, free_port(), out, trace,
                                                 ckpt_interval, zero_stage),
                           nprocs=world, start_method="spawn")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def estimated(path: Path, pp: int, microbatches: int, precision: str, b: int, s: int, dp: int = 1,
              zero_stage: int = 0) -> dict[int, int]:
    """The estimate's traced allocated bytes per pipeline stage (its reported ranks are the stages)."""
    from estimator.api import estimate
    from estimator.spec import ParallelSpec, RunSpec, TrainingSpec

    spec = RunSpec(model=str(path), gpu="h100-80gb",
                   parallel=ParallelSpec(method=_method(dp, zero_stage), world_size=pp * dp, pp=pp,
                                         pp_engine="deepspeed",
                                         pp_microbatches=microbatches),
                   training=TrainingSpec(precision=precision, attn="sdpa", micro_batch_size=b, seq_len=s))
    est = estimate(spec, replay_reserved=False)
    return {r.rank: r.traced_allocated_bytes for r in est.ranks}


def _method(dp: int, zero_stage: int) -> str:
    """The estimator's method of a DeepSpeed pipeline over ``dp`` data-parallel ranks per stage."""
    return "zero1" if zero_stage else ("ddp" if dp > 1 else "single")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--pp", nargs="*", type=int, default=[2, 4])
    parser.add_argument("--microbatches", nargs="*", type=int, default=[4, 8])
    parser.add_argument("--points", nargs="*", default=["1x64", "2x32"])
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32", "mixed_bf16", "mixed_fp16"))
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks per stage (world = pp x dp)")
    parser.add_argument("--zero-stage", type=int, default=0, choices=(0, 1))
    parser.add_argument("--csv", type=Path, default=None)
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--ckpt-interval", type=int, default=0,
                        help="PipelineModule's activation_checkpoint_interval (measure-only: not estimated)")
    parser.add_argument("--measure-only", action="store_true", help="print the measurements, no estimate")
    parser.add_argument("--rescore", type=Path, default=None, help="re-estimate a committed table in place")
    args = parser.parse_args(argv)
    if args.rescore:
        return rescore(args.rescore)
    config = json.loads(args.config.read_text())
    rows = []
    started = time.perf_counter()
    for pp in args.pp:
        for m in args.microbatches:
            for point in args.points:
                b, s = (int(x) for x in point.split("x"))
                ranks = measured(config, pp, m, args.precision, b, s, args.trace, args.ckpt_interval, args.dp,
                                 args.zero_stage)
                # keyed by global rank: the first data-parallel rank of each reported stage
                predicted = ({stage * args.dp: None for stage in range(pp)}
                             if args.measure_only or args.ckpt_interval
                             else estimated(args.config, pp, m, args.precision, b, s, args.dp, args.zero_stage))
                for rank, est in sorted(predicted.items()):
                    if args.dp > 1:
                        print(f"    stage {rank // args.dp} data-parallel ranks' peaks "
                              f"{[ranks[rank + d]['peak_bytes'] for d in range(args.dp)]}")
                    got = ranks[rank]["peak_bytes"]
                    err = None if est is None else round(100 * (est - got) / got, 4)
                    rows.append({"config": args.config.name, "precision": args.precision, "engine": "deepspeed",
                                 "pp": pp, "dp": args.dp, "zero_stage": args.zero_stage, "microbatches": m, "micro_batch_size": b, "seq_len": s, "rank": rank,
                                 "measured_bytes": got, "estimate_bytes": est, "error_pct": err})
                    print(f"pp{pp} M{m:<3}b{b} s{s:<5}rank {rank} parts {ranks[rank]['parts']}: measured {got:>11} "
                          f"estimate {est} {err} %", flush=True)
                    if args.trace:
                        for event in ranks[rank]["events"]:
                            print("    ", event)
    errors = sorted(abs(r["error_pct"]) for r in rows if r["error_pct"] is not None)
    if errors:
        print(f"rows {len(rows)}  median |error| {errors[len(errors) // 2]:.3f} %  max {errors[-1]:.3f} %  "
              f"elapsed {time.perf_counter() - started:.0f} s")
    if args.csv:
        write_rows(args.csv, rows)
    return 0


def rescore(path: Path) -> int:
    """Re-estimate committed rows (their measurements kept), written back in place."""
    rows = read_rows(path)
    cache: dict[tuple, dict[int, int]] = {}
    for row in rows:
        key = (row["config"], int(row["pp"]), int(row["microbatches"]), row["precision"],
               int(row["micro_batch_size"]), int(row["seq_len"]), int(row.get("dp") or 1),
               int(row.get("zero_stage") or 0))
        if key not in cache:
            config, pp, m, precision, b, s, dp, zero_stage = key
            cache[key] = estimated(HERE / "configs" / config, pp, m, precision, b, s, dp, zero_stage)
        est, got = cache[key][int(row["rank"])], int(row["measured_bytes"])
        row["estimate_bytes"], row["error_pct"] = est, round(100 * (est - got) / got, 4)
    write_rows(path, rows)
    errors = sorted(abs(float(r["error_pct"])) for r in rows)
    print(f"rows {len(rows)}  median |error| {errors[len(errors) // 2]:.3f} %  max {errors[-1]:.3f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
