"""The estimator's DeepSpeed ZeRO accounting against real DeepSpeed runs on CPU (storages counted).

DeepSpeed cannot run on fake tensors, so this is the check of ``estimator.methods.state.zero``: emulated ranks 0 and
N-1 of a real DeepSpeed job on the fake process group, every storage counted in 512-byte blocks
(``memory_source counted-cpu``), against ``estimate()`` less the cuBLAS workspace CPU runs do not have. Small
buckets make the tiny model span several of them, as real models do with the defaults; the default buckets
check that they are allocated in full. The grid on a bigger model: ``benchmarks/zero_cpu_check.py``.
"""

from __future__ import annotations

import pytest

from estimator.spec import RunSpec
from harness.environment import CPU_DEVICE
from harness.files import read_json
from tests.harness.conftest import run_point

pytest.importorskip("deepspeed")

SMALL_BUCKETS = ("parallel.zero.reduce_bucket_size=20000", "parallel.zero.allgather_bucket_size=20000",
                 "parallel.zero.stage3_prefetch_bucket_size=20000",
                 "parallel.zero.stage3_param_persistence_threshold=100")


@pytest.mark.parametrize("method,buckets,precision", [
    ("zero1", SMALL_BUCKETS, "mixed_bf16"), ("zero2", SMALL_BUCKETS, "mixed_bf16"),
    ("zero3", SMALL_BUCKETS, "mixed_bf16"), ("zero2", (), "mixed_bf16"),
    # pure bf16: DeepSpeed's bf16 master weights, gradients and optimizer states (harness/methods/deepspeed.py)
    ("zero2", SMALL_BUCKETS, "bf16"), ("zero3", SMALL_BUCKETS, "bf16")])
def test_zero_estimate_matches_deepspeed_on_cpu(tmp_path, method, buckets, precision):
    from estimator.api import estimate

    # Fresh worker processes: a fork of this (multi-threaded, after other tests) process can deadlock.
    record = run_point(tmp_path, "model=tiny-llama", "data=synthetic", "training.seq_len=64",
                       "training.micro_batch_size=2", f"training.precision={precision}", "training.attn=eager",
                       f"method={method}", "parallel.world_size=2", "emulate.enabled=true", "backend=cpu",
                       "launcher.isolation=subprocess", *buckets, device=CPU_DEVICE)
    assert record.status == "ok", record.error
    run_dir = tmp_path / "runs/default/cpu" / record.run_id
    est = estimate(RunSpec.from_json((run_dir / "spec.json").read_text()).replace(gpu="h100-80gb"))
    for rank, mine in zip((0, 1), est.ranks):
        predicted = mine.traced_allocated_bytes
        rank_record = read_json(run_dir / f"rank{rank}.json")
        assert rank_record["memory_source"] == "counted-cpu"
        measured = rank_record["peak_allocated_bytes"]
        assert abs(predicted - measured) / measured < 0.005, (rank, predicted, measured, mine.breakdown)

