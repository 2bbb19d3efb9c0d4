"""Expert parallelism against real CPU runs on gloo ranks, with the routing forced balanced and skewed (issue 17).

    PYTHONPATH=. .venv/bin/python benchmarks/moe_ep_table.py [--configs CONFIG.json ...] [--layouts 2x2 4x2 4x4]
        [--points 1x64 2x128] [--precision bf16|mixed_bf16] [--grad-ckpt] [--lora-targets q_proj,v_proj]
        [--csv docs/error_matrix/moe_ep.csv]
    PYTHONPATH=. .venv/bin/python benchmarks/moe_ep_table.py --rescore docs/error_matrix/moe_ep*.csv

A layout ``WxE`` is W gloo ranks with ep_size E (``harness.ep.distribute``: transformers' own expert sharding and
all-to-all dispatch, experts FSDP2-sharded on the efsdp mesh, dense FSDP2 per decoder layer + root). Each rank counts
every live storage after every operator (``harness.fake.live_storage``, DTensors by their local shard, less the
clone of the whole input gloo's reduce-scatter makes, which NCCL does not) over two steady steps after a warm-up
step; its peak is reported. The routers' choice is forced: ``balanced`` (every EP rank
receives its own T x top_k rows) or ``skewed`` (every token to experts 0..k-1: rank 0 receives its whole group's
rows). The estimate is ``traced_allocated_bytes`` of ``--method fsdp --gpus W --ep E`` with ``--moe-imbalance``
1 (balanced) or num_experts / top_k (skewed: the busiest expert's load), compared with the busiest rank.
Each point runs in freshly spawned interpreters (no torch in this process before the estimate). ``--rescore``: the
committed rows estimated again, their measurements kept. ``--lora-targets``: LoRA rank 8 on those modules, applied as
the estimator's profiler applies it (``estimator.profiler.build.apply_lora``: fp32 adapters) to the model on the meta
device before it is sharded, so transformers' ``ep_plan`` still finds the experts (peft renames only what it wraps;
adapters on the fused experts cannot run under EP at all: docs/error_matrix/README.md, helper moe28).
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
CONFIGS = [HERE / "configs" / f"{name}_tiny.json" for name in ("qwen3_moe", "mixtral", "qwen2_moe")]
LORA_RANK = 8


def lora_column(targets: str) -> dict:
    """The LoRA targets of a row, a column only in tables run with them (the older tables keep their columns)."""
    return {"lora_targets": targets} if targets else {}


def _rank(rank: int, world: int, ep: int, config: dict, precision: str, b: int, s: int, routing: str, port: int,
          out: str, grad_ckpt: bool = False, lora_targets: str = "") -> None:
    sys.path.insert(0, str(REPO))
    from benchmarks.gloo_ranks import join, nccl_live_storages_class

    dist = join(rank, world, port)
    import torch

    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        from harness import ep as hep

        fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
        hf = AutoConfig.for_model(config["model_type"], **fields)
        hf.use_cache = False
        # mixed_bf16: fp32 shards, bf16 compute (transformers' FSDP2 mixed precision, as the harness runs it)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf, dtype=dtype, attn_implementation="eager")
        if grad_ckpt:  # non-reentrant, on every decoder layer, as HF enables it
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        wrapped = None
        if lora_targets:  # peft wraps the model in place: shard the inner model, train through the wrapper
            from estimator.profiler.build import apply_lora
            from estimator.spec import TrainingSpec

            wrapped = apply_lora(model, TrainingSpec(lora_rank=LORA_RANK, lora_targets=lora_targets))
        model = hep.distribute(model, world, ep, precision)
        if wrapped is not None:
            model = wrapped
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                getattr(p, "_local_tensor", p).normal_(0, 0.02)
        model.train()
        if not hep.force_routing(model, hep.ROUTINGS[routing]):
            raise ValueError("no top-k router found in the model")
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, foreach=True)
        vocab = int(config["vocab_size"])

        def step(bb: int, ss: int) -> None:
            ids = torch.randint(0, min(vocab, 1000), (bb, ss))
            model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step(1, 16)  # the optimizer states exist from here on, as in steady state
        import gc

        gc.collect()
        mode = nccl_live_storages_class()()
        for obj in gc.get_objects():  # parameters (their local shards), optimizer states
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                mode.add(obj)
        mode.peak_bytes = mode.live_bytes()
        with mode:
            step(b, s)
            step(b, s)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "peak_bytes": mode.peak_bytes}))
    finally:
        dist.destroy_process_group()


def measured_bytes(config: dict, world: int, ep: int, precision: str, b: int, s: int, routing: str,
                   grad_ckpt: bool = False, lora_targets: str = "") -> list[int]:
    """Each rank's peak live bytes."""
    import torch.multiprocessing as mp

    from benchmarks.gloo_ranks import free_port

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(world, ep, config, precision, b, s, routing, free_port(), out, grad_ckpt,
                                        lora_targets),
                           nprocs=world, start_method="spawn")
        return [json.loads(Path(out, f"rank{r}.json").read_text())["peak_bytes"] for r in range(world)]


def estimated_bytes(path: Path, world: int, ep: int, precision: str, b: int, s: int, imbalance: float,
                    grad_ckpt: bool = False, lora_targets: str = "") -> int:
    from estimator.api import estimate
    from estimator.spec import ParallelSpec, RunSpec, TrainingSpec

    spec = RunSpec(model=str(path), gpu="h100-80gb",
                   parallel=ParallelSpec(method="fsdp", world_size=world, ep=ep, moe_imbalance=imbalance),
                   training=TrainingSpec(precision=precision, attn="eager", micro_batch_size=b, seq_len=s,
                                         grad_ckpt=grad_ckpt, lora_rank=LORA_RANK if lora_targets else 0,
                                         lora_targets=lora_targets or "auto"))
    return int(estimate(spec).traced_allocated_bytes)


def main(argv: list[str] | None = None) -> int:
    from harness.ep import ROUTINGS, skew_imbalance

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", type=Path, default=CONFIGS)
    parser.add_argument("--layouts", nargs="*", default=["2x2", "4x2", "4x4"])
    parser.add_argument("--points", nargs="*", default=["1x64", "2x128"])
    parser.add_argument("--precision", default="bf16", choices=("bf16", "mixed_bf16"))
    parser.add_argument("--grad-ckpt", action="store_true", help="non-reentrant checkpointing of every layer")
    parser.add_argument("--lora-targets", default="", help="LoRA rank 8 on these modules (e.g. q_proj,v_proj)")
    parser.add_argument("--csv", type=Path, default=None)
    parser.add_argument("--rescore", nargs="*", type=Path, default=None,
                        help="estimate the rows of committed tables again (their measurements kept), in place")
    args = parser.parse_args(argv)
    if args.rescore:
        return rescore(args.rescore)
    rows = []
    started = time.perf_counter()
    for path in args.configs:
        config = json.loads(path.read_text())
        experts = next(config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in config)
        top_k = config["num_experts_per_tok"]
        for layout in args.layouts:
            world, ep = (int(x) for x in layout.split("x"))
            for point in args.points:
                b, s = (int(x) for x in point.split("x"))
                for routing in ROUTINGS:
                    imbalance = 1.0 if routing == "balanced" else skew_imbalance(experts, top_k)
                    predicted = estimated_bytes(path, world, ep, args.precision, b, s, imbalance, args.grad_ckpt,
                                                args.lora_targets)
                    ranks = measured_bytes(config, world, ep, args.precision, b, s, routing, args.grad_ckpt,
                                           args.lora_targets)
                    measured = max(ranks)
                    rows.append({"family": config["model_type"], "config": path.name, "precision": args.precision,
                                 "grad_ckpt": args.grad_ckpt, **lora_column(args.lora_targets),
                                 "world_size": world, "ep": ep, "micro_batch_size": b, "seq_len": s,
                                 "routing": routing, "moe_imbalance": imbalance,
                                 "measured_ranks_bytes": " ".join(map(str, ranks)), "measured_bytes": measured,
                                 "estimate_bytes": predicted,
                                 "error_pct": round(100 * (predicted - measured) / measured, 4)})
                    print(f"{config['model_type']:<11}w{world} ep{ep} b{b:<2}s{s:<5}{routing:<9}"
                          f"{measured:>11}{predicted:>11}{rows[-1]['error_pct']:>+9.3f} %  ranks {ranks}", flush=True)
    worst = max(abs(r["error_pct"]) for r in rows)
    print(f"rows {len(rows)}  max |error| {worst:.3f} %  elapsed {time.perf_counter() - started:.0f} s")
    if args.csv:
        write_rows(args.csv, rows)
    return 0


def rescore(paths: list[Path]) -> int:
    """Each committed row estimated again with today's estimator; every file written back in place."""
    for path in paths:
        rows = read_rows(path)
        for row in rows:
            est = estimated_bytes(HERE / "configs" / row["config"], int(row["world_size"]), int(row["ep"]),
                                  row["precision"], int(row["micro_batch_size"]), int(row["seq_len"]),
                                  float(row["moe_imbalance"]), row["grad_ckpt"] == "True", row.get("lora_targets", ""))
            got = int(row["measured_bytes"])
            row["estimate_bytes"], row["error_pct"] = est, round(100 * (est - got) / got, 4)
        write_rows(path, rows)
        errors = sorted(abs(float(r["error_pct"])) for r in rows)
        print(f"{path}: rows {len(rows)}  median |error| {errors[len(errors) // 2]:.3f} %  max {errors[-1]:.3f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
