"""Pipeline parallelism against real CPU runs of torch.distributed.pipelining on gloo ranks (issue 18).

    PYTHONPATH=. .venv/bin/python benchmarks/pipeline_table.py [--config CONFIG.json] [--schedules gpipe 1f1b
        interleaved_1f1b] [--pp 2 4] [--microbatches 4 8] [--points 1x64 2x32] [--dp 1 2]
        [--precision bf16|fp32|mixed_bf16] [--grad-ckpt [--ckpt-policy every-k:K]] [--lora-rank R]
        [--tp T [--dp D]] [--csv docs/error_matrix/pipeline.csv] [--trace [--ops "B 6 1" ...]
        [--drop-waited-sends]]
    PYTHONPATH=. .venv/bin/python benchmarks/pipeline_table.py --rescore docs/error_matrix/pipeline.csv [CSV ...]

Each point runs ``pp x dp x tp`` gloo ranks in freshly spawned interpreters (``harness.pipeline``: the transformers
model split into stages, torch's PipelineStage and schedule, AdamW over each rank's stages, FSDP2 over the dp ranks
of a stage, with ``--tp`` every decoder layer split over the tp ranks first (mesh (pp, dp, tp), torchtitan's); ``--grad-ckpt``: transformers' non-reentrant checkpointing of every decoder layer, as the harness
applies it). Every live storage is counted after every operator (``harness.fake.live_storage``, DTensors by their
local shard; gloo's reduce-scatter clone left out, as in ``benchmarks/moe_ep_table.py``) over two steady steps
after a warm-up step (which also runs torch's shape inference); each rank's peak is compared with the estimate's
``traced_allocated_bytes`` for that rank (first, middle and last pipeline rank). ``--trace`` prints each rank's
live bytes around every forward and backward action (to find what a model leaves out); ``--ops KIND STAGE MB``
also prints every operator's live bytes inside those actions (``"B 6 1"``: stage 6's backward of micro-batch 1), and
``--drop-waited-sends`` (a diagnostic, not torch's behaviour) clears each list of works the schedule waits, to show
what its send works keep. ``--rescore``: the
estimate of every row of committed tables again (the measurements as they are; no run), written back in place and
merged into the ``--csv`` file when one is given.
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


def _rank(rank: int, world: int, pp: int, schedule: str, microbatches: int, virtual: int, config: dict,
          precision: str, b: int, s: int, port: int, out: str, trace: bool, grad_ckpt: bool,
          variant: dict, tp: int = 1, probe: dict | None = None) -> None:
    sys.path.insert(0, str(REPO))
    import gc

    from benchmarks.gloo_ranks import join, nccl_live_storages_class

    dist = join(rank, world, port)
    import torch

    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        from harness import pipeline as hp

        dp = world // (pp * tp)
        tp_mesh = None
        if tp > 1:  # TP inside each stage, as torchtitan builds pp x tp (mesh (pp, tp)) and pp x dp x tp (mesh
            # (pp, dp, tp): FSDP2 over dp of the TP-split stages; dp and tp sub-meshes of one root, as FSDP2 needs)
            from torch.distributed.device_mesh import init_device_mesh

            shape, names = ((pp, dp, tp), ("pp", "dp", "tp")) if dp > 1 else ((pp, tp), ("pp", "tp"))
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            pp_group, dp_mesh, tp_mesh = mesh.get_group("pp"), mesh["dp"] if dp > 1 else None, mesh["tp"]
            pp_rank = mesh.get_local_rank("pp")
        elif dp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
            pp_group, dp_mesh = mesh.get_group("pp"), mesh["dp"]
            pp_rank = mesh.get_local_rank("pp")
        else:
            pp_group, dp_mesh, pp_rank = None, None, rank
        fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
        hf = AutoConfig.for_model(config["model_type"], **fields)
        hf.use_cache = False
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32  # mixed_bf16: fp32 shards, bf16 compute
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf, dtype=dtype, attn_implementation="sdpa")
        model.train()
        from estimator.profiler.build import apply_lora, enable_grad_ckpt
        from estimator.spec import TrainingSpec

        training = TrainingSpec(precision=precision, grad_ckpt=grad_ckpt, **variant)
        if grad_ckpt:  # every decoder layer, or every k-th (ckpt_policy), as the harness applies it
            enable_grad_ckpt(model, training)
        if training.lora:  # peft's LoRA (fp32 adapters on the frozen base); the stages take its base model's modules
            model = apply_lora(model, training)
        if tp_mesh is not None:  # every decoder layer split over the tp ranks (the harness's and profiler's plan)
            from estimator.profiler.tp import apply_tp

            apply_tp(model, tp_mesh, config)
        mp_policy = None
        if precision == "mixed_bf16":  # as the harness's FSDP2 paths: param bf16, reduce fp32
            from torch.distributed.fsdp import MixedPrecisionPolicy

            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        modules, runner = hp.build(model, pp, virtual, pp_rank, pp_group, torch.device("cpu"), microbatches,
                                   schedule, dp_mesh=dp_mesh, mp_policy=mp_policy)
        del model
        gc.collect()
        params = [p for m in modules for p in m.parameters() if p.requires_grad]
        if tp_mesh is not None and dp_mesh is None:  # one foreach AdamW per kind (DTensor, plain), as the harness's
            # tp method builds it (under FSDP2 every parameter is a DTensor: one AdamW, as dp_tp builds it)
            from estimator.profiler.tp import build_tp_optimizer

            optimizer = build_tp_optimizer(params, training)
        else:
            optimizer = torch.optim.AdamW(params, lr=1e-5, foreach=True)
        num_stages = pp * virtual
        mine = hp.stages_of_rank(pp_rank, pp, virtual)
        first, last = 0 in mine, num_stages - 1 in mine
        vocab = int(config["vocab_size"])
        generator = torch.Generator().manual_seed(1)  # the same batch on every rank of a pipeline

        def step() -> None:
            ids = torch.randint(0, vocab, (microbatches * b, s), generator=generator)
            hp.train_step(runner, first, last, ids, optimizer)

        step()  # warm-up: torch's shape inference and the recv buffers; optimizer states from here on
        gc.collect()
        probe = probe or {}
        if probe.get("drop_waited_sends"):
            _drop_waited_sends()
        mode = (_operator_log(nccl_live_storages_class()) if probe.get("ops") else nccl_live_storages_class())()
        for obj in gc.get_objects():  # parameters (local shards), optimizer states, recv buffers
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                mode.add(obj)
        mode.peak_bytes = mode.live_bytes()
        events: list = []
        if trace:
            _trace(runner, mode, events, set(probe.get("ops") or ()))
        with mode:
            step()
            step()
        Path(out, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "peak_bytes": mode.peak_bytes,
                                                             "events": events}))
    finally:
        dist.destroy_process_group()


def _trace(runner, mode, events: list, ops: set[str] = frozenset()) -> None:
    """Record live bytes before and after, and the peak within, each stage's forward, backward and gradient
    reduction (F, B, P); for the actions named in ``ops`` (``"KIND STAGE MB"``) also every operator's live bytes
    (an event ``["ops", action, [[operator, live bytes], ...]]`` after the action's own)."""
    stages = getattr(runner, "_stages", None) or [runner._stage]
    for stage in stages:
        for name in ("forward_one_chunk", "backward_one_chunk", "perform_reduce_grad"):
            original = getattr(stage, name)

            def wrapped(chunk, *args, _original=original, _name=name, _stage=stage.stage_index, **kwargs):
                # chunk: the micro-batch (perform_reduce_grad: its gradient scale factor)
                before = mode.live_bytes()
                mode.peak_bytes, outer = before, mode.peak_bytes
                action = f"{_name[0].upper()} {_stage} {chunk}"
                if action in ops:
                    mode.op_log = []
                result = _original(chunk, *args, **kwargs)
                events.append([_name[0].upper(), _stage, chunk, before, mode.peak_bytes, mode.live_bytes()])
                if action in ops:
                    events.append(["ops", action, mode.op_log])
                    mode.op_log = None
                mode.peak_bytes = max(outer, mode.peak_bytes)
                return result

            setattr(stage, name, wrapped)


def _operator_log(cls):
    """``cls`` (a live-storage counter) that also appends ``[operator, live bytes]`` to ``op_log`` when it is a
    list."""

    class OperatorLog(cls):
        op_log: list | None = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self.op_log is not None:
                self.op_log.append([str(func), self.live_bytes()])
            return out

    return OperatorLog


def _drop_waited_sends() -> None:
    """Diagnostic: torch's schedules wait a list of works (``_wait_batch_p2p(send_work)``) and keep the list; a gloo
    send work holds the tensor it sent. Clearing each waited list shows what those works keep."""
    from torch.distributed.pipelining import schedules

    wait = schedules._wait_batch_p2p

    def wait_and_drop(works):
        wait(works)
        if isinstance(works, list):
            works.clear()

    schedules._wait_batch_p2p = wait_and_drop


def measured(config: dict, pp: int, dp: int, schedule: str, microbatches: int, virtual: int, precision: str,
             b: int, s: int, trace: bool = False, grad_ckpt: bool = False, variant: dict | None = None,
             tp: int = 1, probe: dict | None = None) -> list[dict]:
    """Each rank's peak live bytes (and, with ``trace``, its per-action events). ``variant``: TrainingSpec fields
    beyond precision and checkpointing (``lora_rank``, ``ckpt_policy``). ``probe``: ``ops`` (actions whose
    operators ``trace`` logs), ``drop_waited_sends`` (``_drop_waited_sends``)."""
    import torch.multiprocessing as mp

    from benchmarks.gloo_ranks import free_port

    world = pp * dp * tp
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(world, pp, schedule, microbatches, virtual, config, precision, b, s,
                                        free_port(), out, trace, grad_ckpt, variant or {}, tp, probe), nprocs=world,
                           start_method="spawn")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def estimated(path: Path, pp: int, dp: int, schedule: str, microbatches: int, virtual: int, precision: str,
              b: int, s: int, grad_ckpt: bool = False, variant: dict | None = None, tp: int = 1) -> dict[int, int]:
    """The estimate's traced allocated bytes per reported rank."""
    from estimator.api import estimate
    from estimator.spec import ParallelSpec, RunSpec, TrainingSpec

    spec = RunSpec(model=str(path), gpu="h100-80gb",
                   parallel=ParallelSpec(method=_method(dp, tp),
                                         world_size=pp * dp * tp, pp=pp, tp=tp,
                                         pp_schedule=schedule, pp_microbatches=microbatches, pp_virtual=virtual),
                   training=TrainingSpec(precision=precision, attn="sdpa", micro_batch_size=b, seq_len=s,
                                         grad_ckpt=grad_ckpt, **(variant or {})))
    est = estimate(spec, replay_reserved=False)
    return {r.rank: r.traced_allocated_bytes for r in est.ranks}


def _method(dp: int, tp: int) -> str:
    """The estimate's method of a pipeline layout: pp alone, pp x fsdp, pp x tp or pp x dp x tp."""
    if tp > 1:
        return "dp_tp" if dp > 1 else "tp"
    return "fsdp" if dp > 1 else "single"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--schedules", nargs="*", default=["gpipe", "1f1b", "interleaved_1f1b"])
    parser.add_argument("--pp", nargs="*", type=int, default=[2, 4])
    parser.add_argument("--microbatches", nargs="*", type=int, default=[4, 8])
    parser.add_argument("--points", nargs="*", default=["1x64", "2x32"])
    parser.add_argument("--dp", nargs="*", type=int, default=[1])
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32", "mixed_bf16"),
                        help="mixed_bf16: fp32 model, FSDP2 MixedPrecisionPolicy(bf16, fp32) (with --dp 2)")
    parser.add_argument("--grad-ckpt", action="store_true", help="checkpoint every decoder layer")
    parser.add_argument("--ckpt-policy", default="", help="every-k:K: checkpoint every K-th layer (with --grad-ckpt)")
    parser.add_argument("--lora-rank", type=int, default=0, help="peft LoRA of this rank on the frozen model")
    parser.add_argument("--tp", type=int, default=1, help="TP degree inside each stage (pp x tp; with --dp 2, pp x dp x tp)")
    parser.add_argument("--csv", type=Path, default=None)
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--ops", nargs="*", default=[], help='with --trace: actions ("B 6 1") whose operators to log')
    parser.add_argument("--drop-waited-sends", action="store_true",
                        help="diagnostic: clear each list of works the schedule waits (what its send works keep)")
    parser.add_argument("--rescore", nargs="*", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.rescore:
        return rescore(args.rescore, args.csv)
    config = json.loads(args.config.read_text())
    variant = _variant(args.lora_rank, args.ckpt_policy)
    rows = []
    started = time.perf_counter()
    for schedule in args.schedules:
        virtual = 2 if schedule == "interleaved_1f1b" else 1
        for pp in args.pp:
            for dp in args.dp:
                for m in args.microbatches:
                    for point in args.points:
                        b, s = (int(x) for x in point.split("x"))
                        predicted = estimated(args.config, pp, dp, schedule, m, virtual, args.precision, b, s,
                                              args.grad_ckpt, variant, args.tp)
                        ranks = measured(config, pp, dp, schedule, m, virtual, args.precision, b, s, args.trace,
                                         args.grad_ckpt, variant, args.tp,
                                         {"ops": args.ops, "drop_waited_sends": args.drop_waited_sends})
                        for rank, est in sorted(predicted.items()):
                            got = ranks[rank]["peak_bytes"]
                            rows.append({"config": args.config.name, "precision": args.precision,
                                         **({"grad_ckpt": True} if args.grad_ckpt else {}), **variant,
                                         "schedule": schedule,
                                         "pp": pp, "dp": dp, **({"tp": args.tp} if args.tp > 1 else {}),
                                         "virtual": virtual,
                                         "microbatches": m, "micro_batch_size": b, "seq_len": s, "rank": rank,
                                         "measured_bytes": got, "estimate_bytes": est,
                                         "error_pct": round(100 * (est - got) / got, 4)})
                            print(f"{schedule:<17}pp{pp} dp{dp} tp{args.tp} M{m:<3}b{b} s{s:<5}rank {rank}: measured {got:>11} "
                                  f"estimate {est:>11} {rows[-1]['error_pct']:+8.3f} %", flush=True)
                            if args.trace:
                                for event in ranks[rank]["events"]:
                                    if event[0] != "ops":
                                        print("    ", event)
                                        continue
                                    start = event[2][0][1] if event[2] else 0
                                    for op, live in event[2]:
                                        print(f"         {event[1]}: {live - start:+9d} {op}")
    errors = sorted(abs(r["error_pct"]) for r in rows)
    print(f"rows {len(rows)}  median |error| {errors[len(errors) // 2]:.3f} %  max {errors[-1]:.3f} %  "
          f"elapsed {time.perf_counter() - started:.0f} s")
    if args.csv:
        write_rows(args.csv, rows)
    return 0


def _variant(lora_rank: int, ckpt_policy: str) -> dict:
    """The TrainingSpec fields a table's rows add (only those set: the older tables' rows have neither column)."""
    return {**({"lora_rank": lora_rank} if lora_rank else {}), **({"ckpt_policy": ckpt_policy} if ckpt_policy else {})}


def rescore(paths: list[Path], out: Path | None) -> int:
    """Re-estimate committed rows (their measurements kept); each file written back, all merged into ``out``."""
    merged: list[dict] = []
    for path in paths:
        rows = read_rows(path)
        cache: dict[tuple, dict[int, int]] = {}
        for row in rows:
            key = (row["config"], row["precision"], row["schedule"], int(row["pp"]), int(row["dp"]),
                   int(row["virtual"]), int(row["microbatches"]), int(row["micro_batch_size"]), int(row["seq_len"]),
                   row.get("grad_ckpt") == "True", int(row.get("lora_rank") or 0), row.get("ckpt_policy") or "",
                   int(row.get("tp") or 1))
            if key not in cache:
                config, precision, schedule, pp, dp, virtual, m, b, s, ckpt, lora_rank, policy, tp = key
                cache[key] = estimated(HERE / "configs" / config, pp, dp, schedule, m, virtual, precision, b, s,
                                       ckpt, _variant(lora_rank, policy), tp)
            est, got = cache[key][int(row["rank"])], int(row["measured_bytes"])
            row["estimate_bytes"], row["error_pct"] = est, round(100 * (est - got) / got, 4)
        write_rows(path, rows)
        merged += rows
    if out is not None:
        write_rows(out, merged)
    errors = sorted(abs(float(r["error_pct"])) for r in merged)
    print(f"rows {len(merged)}  median |error| {errors[len(errors) // 2]:.3f} %  max {errors[-1]:.3f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
