"""FSDP1 LoRA with the adapters inside their decoder layer's unit (``parallel.fsdp1.lora_wrap=layer``, Lightning's
``FSDPStrategy(auto_wrap_policy={Block})`` as LitGPT's LoRA scripts run it) against real CPU runs.

    PYTHONPATH=. .venv/bin/python benchmarks/fsdp1_lora_layer_wrap.py [--model small-llama] [--worlds 2]
        [--accum 2] [--csv out.csv]

Each point is a real harness run (``backend=cpu``, ranks 0 and N-1 on torch's fake process group, every live
storage counted: ``benchmarks/zero_cpu_check.py``): LoRA r 8 on q and v (dropout 0.05), pure bf16 (the adapters
built in bf16, as bf16-true builds them), non-reentrant checkpointing of every layer, FSDP1 FULL_SHARD with
use_orig_params, ``grad_accum_steps`` micro-batches reduced on every one or under ``no_sync`` on all but the last
(``training.grad_sync``). With ``use_orig_params`` the layer's flat parameter requires a gradient, so every
frozen weight gets one; under ``no_sync`` each rank holds every layer's unsharded gradient, about the whole
model, beside its shards. The peer: peft's wrap (``lora_wrap=adapter``), whose frozen layer units make no
gradient. Compared with ``estimate()``'s allocated peak less the cuBLAS workspace (``traced_allocated_bytes``).

Measured 2026-11-28 (small-llama, x2, b2 s64, accumulation 2; ranks 0 / 1, MiB measured vs estimated):
layer + last 23.219 / 23.086 vs 23.204 / 23.079 (-0.07 / -0.03 %); layer + every 20.170 / 16.989 vs 20.155 /
16.981 (-0.08 / -0.04 %; rank 1's shard holds no adapter element, so its sharded gradients are dropped at the
next pre-forward: ``Fsdp1Sizes.keeps_grad_shard``, +17.9 % before it was modelled); adapter + every 17.200 /
17.200 vs 17.185 / 17.185 (-0.09 %).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from table_csv import write_rows  # noqa: E402
from zero_cpu_check import compare, run_point  # noqa: E402

LORA = ["training.lora_rank=8", "training.lora_targets='q_proj,v_proj'", "training.lora_dropout=0.05",
        "training.grad_ckpt=true"]


def point_extra(wrap: str, sync: str, accum: int) -> list[str]:
    return LORA + [f"parallel.fsdp1.lora_wrap={wrap}", f"training.grad_sync={sync}",
                   f"training.grad_accum_steps={accum}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2])
    parser.add_argument("--wraps", nargs="+", default=["layer", "adapter"])
    parser.add_argument("--syncs", nargs="+", default=["last", "every"])
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--csv", type=Path)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world, wrap, sync in itertools.product(args.worlds, args.wraps, args.syncs):
            if wrap == "adapter" and sync == "last":  # not modelled (estimator.methods.fsdp1: grad_sync)
                continue
            run = run_point(args.model, "fsdp1", world, "bf16", "default", Path(tmp), args.batch, args.seq,
                            point_extra(wrap, sync, args.accum))
            for row in compare(run):
                row.update(wrap=wrap, sync=sync, accum=args.accum, model=args.model)
                rows.append(row)
                print(f"{args.model} x{world} rank {row['rank']} wrap={wrap} sync={sync}: measured "
                      f"{row['measured_mib']:.3f} MiB, estimated {row['estimated_mib']:.3f} MiB "
                      f"({row['error_pct']:+.2f} %), phases {row['measured_phase']} / {row['estimated_phase']}",
                      flush=True)
    if args.csv and rows:
        write_rows(args.csv, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
