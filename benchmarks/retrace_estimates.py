"""Estimates of shipped profiles' specs at a few (b, s) points, to compare a re-trace against the files it replaces.

    PYTHONPATH=. .venv/bin/python benchmarks/retrace_estimates.py FILE.json ... > rows.csv

Each FILE is a profile name under estimator/profiles/ (its model, tp and variant: mixed_fp16 eager with full
checkpointing, the variant issue 14 re-traced); the spec is method ``single`` (tp 1) or ``tp`` on an H200. Run it
once at the old tree (``git archive``) and once at the new, then diff the two CSVs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from estimator.api import estimate
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec

PROFILES = Path(__file__).resolve().parents[1] / "estimator" / "profiles"
POINTS = ((4, 512), (8, 1024), (8, 2048))  # Table 2's size, then where eager attention's scores dominate


def main(names: list[str]) -> int:
    print("file,model,tp,b,s,peak_allocated_bytes,peak_reserved_bytes")
    for name in names:
        profile = json.loads((PROFILES / name).read_text())
        tp = profile.get("tp", 1)
        parallel = ParallelSpec(method="tp", world_size=tp, tp=tp) if tp > 1 else ParallelSpec()
        for b, s in POINTS:
            training = TrainingSpec(precision="mixed_fp16", attn="eager", grad_ckpt=True, micro_batch_size=b,
                                    seq_len=s)
            result = estimate(RunSpec(model=profile["model"], parallel=parallel, training=training,
                                      gpu="h200-141gb"), allow_build=False)
            print(f"{name},{profile['model']},{tp},{b},{s},{result.peak_allocated_bytes},"
                  f"{result.peak_reserved_bytes}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
