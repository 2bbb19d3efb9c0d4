"""A real CPU run of a model config (harness, every storage counted) against the estimate, for configs whose
memory a fake-tensor trace cannot be trusted on alone (mixture-of-experts: issue 17).

    PYTHONPATH=. .venv/bin/python benchmarks/moe_cpu_check.py CONFIG.json [hydra overrides ...]
    e.g. training.precision=fp32 training.attn=eager training.micro_batch_size=2 training.seq_len=256

Prints the measured peak allocated, the estimate minus the cuBLAS workspace (a CPU run has none) and their
difference. The run goes to a temporary folder. ``backend=fake`` runs the harness's fake-tensor tracer instead.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

CONF = Path(__file__).resolve().parents[1] / "conf"


def main(argv: list[str]) -> int:
    if not argv or not Path(argv[0]).is_file():
        print("error: give a model config.json as the first argument", file=sys.stderr)
        return 2
    from hydra import compose, initialize_config_dir

    import harness.config  # noqa: F401 - registers the schema
    from estimator.api import estimate
    from harness.config import to_run
    from harness.environment import CPU_DEVICE
    from harness.files import read_json
    from harness.launch import run_point
    from harness.records import rank_from_dict

    root = Path(tempfile.mkdtemp(prefix="moe-cpu-"))
    overrides = ["model=custom", f"model.name={Path(argv[0]).resolve()}", "data=synthetic",
                 "launcher.isolation=subprocess", f"paths.root_dir={root}", f"paths.cache_dir={root}/cache",
                 *argv[1:]]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        spec, opts = to_run(compose("measure", overrides=overrides))
    record = run_point(spec, opts, device=CPU_DEVICE)
    run_dir = next((root / "runs/default").glob(f"*/{record.run_id}"))  # cpu, or fake with backend=fake
    rank0 = rank_from_dict(read_json(run_dir / "rank0.json"))
    if record.status != "ok":
        print(f"error: the run ended {record.status}: {rank0.error}", file=sys.stderr)
        return 1
    est = estimate(spec.replace(gpu="h100-80gb"))
    predicted = est.traced_allocated_bytes
    measured = rank0.peak_allocated_bytes
    print(f"measured {measured} B  estimate {predicted} B  {100 * (predicted - measured) / measured:+.2f} %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
