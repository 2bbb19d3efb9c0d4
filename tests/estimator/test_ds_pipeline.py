"""DeepSpeed's pipeline engine (issue 18, ``--pp-engine deepspeed``): the spec, the layer split and the schedule
against DeepSpeed's own, the estimate against committed rows of the counted CPU oracle
(benchmarks/ds_pipeline_table.py), the command line."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.table_csv import read_rows
from estimator.methods.ds_pipeline import (
    allreduce_bucket_bytes,
    ds_stage,
    num_pipe_buffers,
    partition_balanced,
    train_schedule_actions,
)
from estimator.methods.pipeline import rank_actions
from estimator.models.params import ParamInfo
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec
from tests.estimator.oracle_rows import assert_rows_reproduced

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "benchmarks" / "configs" / "llama_pp_tiny.json"
TABLE = REPO / "docs" / "error_matrix" / "pipeline_deepspeed.csv"
BF16_MODE_TABLE = REPO / "docs" / "error_matrix" / "pipeline_deepspeed_bf16_mode.csv"  # DeepSpeed's bf16 mode
FP16_MODE_TABLE = REPO / "docs" / "error_matrix" / "pipeline_deepspeed_fp16_mode.csv"  # its fp16 mode
DP_TABLE = REPO / "docs" / "error_matrix" / "pipeline_deepspeed_dp.csv"  # 2 data-parallel ranks per stage
TINY_WEIGHTS = [262144] + [147712] * 8 + [262272]  # llama_pp_tiny: embedding, 8 decoder layers, norm + head


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="fsdp", world_size=8, pp=4, pp_engine="deepspeed"), "pp_engine: DeepSpeed's pipeline engine is "
                                                                      "modelled with ZeRO stage 0"),
    (dict(method="zero1", world_size=8, pp=4, pp_engine="deepspeed"), "pp_engine: DeepSpeed's pipeline engine is "
                                                                       "modelled with ZeRO stage 0"),
    (dict(method="ddp", world_size=6, pp=4, pp_engine="deepspeed"), "pp: world size 6 is not divisible by pp 4"),
    (dict(method="single", world_size=4, pp=4, pp_engine="deepspeed", pp_schedule="gpipe"),
     "pp_engine: DeepSpeed's pipeline engine runs its own TrainSchedule"),
    (dict(method="single", pp_engine="deepspeed"), "pp: pipeline settings"),
    (dict(method="single", world_size=2, pp=2, pp_engine="megatron"), "pp_engine: 'megatron' is not one of"),
])
def test_spec_refuses_with_one_line(kwargs, message):
    with pytest.raises(ValueError) as err:
        ParallelSpec(**kwargs)
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


def test_fewer_micro_batches_than_stages_and_spec_ids():
    """DeepSpeed's TrainSchedule runs M < stages (torch's 1F1B refuses it); the engine stays out of the id of a
    torch pipeline (earlier ids unchanged) and is in a DeepSpeed one's."""
    par = ParallelSpec(method="single", world_size=4, pp=4, pp_engine="deepspeed", pp_microbatches=2)
    assert par.microbatches == 2
    torch_spec = RunSpec(model="meta-llama/Llama-3.1-8B", parallel=ParallelSpec(method="single", world_size=4, pp=4))
    ds_spec = torch_spec.replace(**{"parallel.pp_engine": "deepspeed"})
    assert "pp_engine" not in torch_spec._canonical_dict()["parallel"]
    assert ds_spec._canonical_dict()["parallel"]["pp_engine"] == "deepspeed"
    assert ds_spec.spec_id != torch_spec.spec_id
    assert RunSpec.from_dict(ds_spec.to_dict()) == ds_spec


def test_the_engine_round_trips_through_the_measurement_columns():
    """A harness row of a DeepSpeed pipeline reads back as one (a table without the column: torch's pipelining)."""
    from estimator.columns import spec_columns, spec_from_columns

    spec = RunSpec(model=str(CONFIG), parallel=ParallelSpec(method="single", world_size=2, pp=2,
                                                            pp_engine="deepspeed", pp_microbatches=4),
                   training=TrainingSpec(precision="bf16", micro_batch_size=2, seq_len=128))
    row = {**{k: "" if v is None else str(v) for k, v in spec_columns(spec).items()}, "world_size": "2"}
    assert spec_from_columns(row) == spec
    del row["pp_engine"]
    assert spec_from_columns(row).parallel.pp_engine == "torch"


def test_layers_are_split_by_parameter_count():
    """DeepSpeed's partition_balanced (values printed by deepspeed.runtime.utils.partition_balanced): the
    embedding and the head weigh about two decoder layers each, so the first and last of 4 stages get one."""
    assert partition_balanced(TINY_WEIGHTS, 4) == [0, 2, 5, 8, 10]
    assert partition_balanced(TINY_WEIGHTS, 2) == [0, 5, 10]
    assert partition_balanced([1, 1, 1], 4) == [0, 1, 2, 3, 3]  # fewer layers than stages: uniform
    first, middle, last = (ds_stage([0, 2, 5, 8, 10], s, 8) for s in (0, 2, 3))
    assert (first.first, first.last, first.layers) == (True, False, range(0, 1))
    assert (middle.first, middle.last, middle.layers) == (False, False, range(4, 7))
    assert (last.first, last.last, last.layers) == (False, True, range(7, 8))


def test_train_schedule_is_torchs_1f1b_order_and_runs_fewer_micro_batches():
    for pp, m in ((2, 4), (4, 4), (4, 8), (3, 7)):
        for stage in range(pp):
            assert train_schedule_actions(stage, pp, m) == rank_actions("1f1b", stage, pp, m)
    # 4 stages, 2 micro-batches: the first stage runs both forwards first, the last alternates
    assert [(a.kind, a.microbatch) for a in train_schedule_actions(0, 4, 2)] == [("F", 0), ("F", 1), ("B", 0),
                                                                                 ("B", 1)]
    assert [(a.kind, a.microbatch) for a in train_schedule_actions(3, 4, 2)] == [("F", 0), ("B", 0), ("F", 1),
                                                                                 ("B", 1)]
    assert [num_pipe_buffers(s, 4, 8) for s in range(4)] == [4, 3, 2, 2]
    assert [num_pipe_buffers(s, 4, 1) for s in range(4)] == [2, 2, 2, 2]


def _param(numel: int, elem_bytes: int) -> ParamInfo:
    return ParamInfo(name="w", shape=(numel,), numel=numel, elem_bytes=elem_bytes, trainable=True,
                     module_kind="linear", layer=0)


def test_reduce_grads_buckets_cast_16_bit_gradients_to_fp32():
    """ReduceGrads' flat bucket, plus its fp32 copy for 16-bit gradients; a new bucket after 500 M elements."""
    assert allreduce_bucket_bytes([_param(1000, 4)]) == 4000
    assert allreduce_bucket_bytes([_param(1000, 2)]) == 2000 + 4000
    big = [_param(300_000_000, 2), _param(300_000_000, 2), _param(10, 2)]
    assert allreduce_bucket_bytes(big) == 600_000_000 * 6  # the first two close a bucket; the last is small


def test_bf16_mode_holds_fp32_masters_and_a_bf16_accumulation_buffer_beside_the_weights():
    """DeepSpeed's bf16 mode (BF16_Optimizer under a pipeline): the flat group padded to 2 elements; fp32 masters
    and Adam states over it, the bf16 accumulation buffer; the step holds the module's bf16 gradients, the fp32 cast
    of the buffer and foreach AdamW's sqrt temporary; ReduceGrads reduces the flat buffer in place."""
    from estimator.methods.ds_pipeline import _reduce_bytes, _state_model

    params = [_param(1001, 2), _param(2000, 2)]
    spec = RunSpec(model=str(CONFIG), parallel=ParallelSpec(method="single", world_size=2, pp=2,
                                                            pp_engine="deepspeed"),
                   training=TrainingSpec(precision="mixed_bf16"))
    model = _state_model(spec, params)
    flat = 3002  # 3001 elements padded to BF16_Optimizer's alignment of 2
    assert model.resident == {"weights": 2 * 3001 + 2, "master_weights": 4 * flat, "optimizer_states": 8 * flat,
                              "gradients": 2 * flat}
    assert (model.step_grads, model.step_temp) == (2 * 3001 + 4 * flat, 4 * flat)
    assert _reduce_bytes(spec, params) == 0.0
    assert _reduce_bytes(spec.replace(**{"training.precision": "bf16"}), params) == 2 * 3001 + 4 * 3001


def test_fp16_mode_holds_fp32_masters_per_tensor_and_reduces_the_fp16_gradients_uncast():
    """DeepSpeed's fp16 mode around torch's AdamW (FP16_UnfusedOptimizer): fp32 masters and Adam states per tensor
    (no padding); the step holds the fp16 gradients and their fp32 copies beside AdamW's sqrt; ReduceGrads'
    bucket is a flat fp16 copy (the communication dtype is fp16)."""
    from estimator.methods.ds_pipeline import _reduce_bytes, _state_model

    params = [_param(1001, 2), _param(2000, 2)]
    spec = RunSpec(model=str(CONFIG), parallel=ParallelSpec(method="single", world_size=2, pp=2,
                                                            pp_engine="deepspeed"),
                   training=TrainingSpec(precision="mixed_fp16"))
    model = _state_model(spec, params)
    assert model.resident == {"weights": 2 * 3001, "master_weights": 4 * 3001, "optimizer_states": 8 * 3001}
    assert (model.step_grads, model.step_temp) == (2 * 3001 + 4 * 3001, 4 * 3001)
    assert _reduce_bytes(spec, params) == 2 * 3001


def _rows() -> list[dict]:
    return read_rows(TABLE)


def _row_spec(row: dict) -> RunSpec:
    pp, dp = int(row["pp"]), int(row.get("dp") or 1)
    par = ParallelSpec(method="ddp" if dp > 1 else "single", world_size=pp * dp, pp=pp, pp_engine="deepspeed",
                       pp_microbatches=int(row["microbatches"]))
    return RunSpec(model=str(REPO / "benchmarks" / "configs" / row["config"]), parallel=par,
                   training=TrainingSpec(precision=row["precision"], attn="sdpa",
                                         micro_batch_size=int(row["micro_batch_size"]), seq_len=int(row["seq_len"])))


@pytest.mark.parametrize("table", [TABLE, BF16_MODE_TABLE, FP16_MODE_TABLE])
def test_the_committed_table_covers_its_points_and_is_within_1_pct(table):
    rows = read_rows(table)
    assert {int(r["pp"]) for r in rows} == {2, 4}
    assert len({r["microbatches"] for r in rows}) >= 2
    assert len({(r["micro_batch_size"], r["seq_len"]) for r in rows}) >= 2
    assert {r["rank"] for r in rows if r["pp"] == "4"} == {"0", "2", "3"}  # first, middle, last stage
    assert max(abs(float(r["error_pct"])) for r in rows) <= 1.0


def test_the_estimate_reproduces_every_committed_row():
    """The tiny Llama config's shipped profile (no torch) against the counted runs of DeepSpeed's engine: every
    row's estimate as committed, within 1 % of its measurement."""
    assert assert_rows_reproduced(TABLE, _row_spec) == 40
    assert assert_rows_reproduced(BF16_MODE_TABLE, _row_spec) == 30
    assert assert_rows_reproduced(FP16_MODE_TABLE, _row_spec) == 20


def _tiny_spec(precision: str, dp: int) -> RunSpec:
    par = ParallelSpec(method="ddp" if dp > 1 else "single", world_size=2 * dp, pp=2, pp_engine="deepspeed",
                       pp_microbatches=4)
    return RunSpec(model=str(CONFIG), parallel=par, training=TrainingSpec(precision=precision, attn="sdpa",
                                                                          micro_batch_size=1, seq_len=64))


def test_data_parallel_stages_hold_a_lone_stages_bytes_except_bf16_modes_split_masters():
    """ZeRO stage 0 over 2 data-parallel ranks per stage: every rank all-reduces its full gradients in the same
    buckets, so each stage's first rank (global rank stage x dp) holds what the stage holds alone; in DeepSpeed's
    bf16 mode BF16_Optimizer keeps fp32 masters and Adam states of its half of the flat group only."""
    from estimator.api import estimate

    def ranks(precision: str, dp: int) -> dict:
        est = estimate(_tiny_spec(precision, dp), replay_reserved=False, allow_build=False)
        return {r.rank: r for r in est.ranks}

    alone, replicated = ranks("bf16", 1), ranks("bf16", 2)
    assert list(alone) == [0, 1] and list(replicated) == [0, 2]
    assert [r.traced_allocated_bytes for r in alone.values()] == \
        [r.traced_allocated_bytes for r in replicated.values()]
    alone, split = ranks("mixed_bf16", 1), ranks("mixed_bf16", 2)
    for stage in (0, 1):
        a, s = alone[stage].breakdown, split[2 * stage].breakdown
        for key in ("master_weights", "optimizer_states"):
            assert abs(s[key] - a[key] / 2) <= 2 * 4 * 3, (key, a[key], s[key])  # half, padded to 2 x dp elements
        assert s["weights"] == a["weights"] and split[2 * stage].peak_allocated_bytes < \
            alone[stage].peak_allocated_bytes


def test_the_data_parallel_table_covers_first_middle_and_last_stages():
    rows = read_rows(DP_TABLE)
    assert {r["dp"] for r in rows} == {"2"} and {"bf16", "mixed_bf16"} <= {r["precision"] for r in rows}
    assert {r["rank"] for r in rows if r["pp"] == "4"} == {"0", "4", "6"}  # first, middle, last stage
    assert max(abs(float(r["error_pct"])) for r in rows) <= 1.0
    assert assert_rows_reproduced(DP_TABLE, _row_spec) == len(rows)


def test_cli_deepspeed_pipeline_and_its_refusals():
    base = [sys.executable, "-m", "estimator", "--model", "meta-llama/Llama-3.1-8B", "--precision", "bf16",
            "--seq-len", "4096", "--method", "single", "--gpus", "4", "--pp", "4", "--pp-engine", "deepspeed"]
    ok = subprocess.run([*base, "--pp-microbatches", "2"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert ok.returncode == 0, ok.stderr
    assert "(DeepSpeed's pipeline engine)" in ok.stdout
    assert "split by parameter count" in ok.stdout and "embedding + 7 decoder layers" in ok.stdout
    mixed = subprocess.run([*base, "--pp-microbatches", "2", "--precision", "mixed_bf16"], capture_output=True,
                           text=True, timeout=120, cwd=REPO)
    assert mixed.returncode == 0, mixed.stderr
    assert "DeepSpeed's bf16 mode (BF16_Optimizer" in mixed.stdout
    replicated = [*base[:base.index("--method")], "--method", "ddp", "--gpus", "8", "--pp", "4", "--pp-engine",
                  "deepspeed", "--pp-microbatches", "2", "--precision", "mixed_bf16"]
    dp = subprocess.run(replicated, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert dp.returncode == 0, dp.stderr
    assert "split over the 2 data-parallel ranks of each stage" in dp.stdout
    assert [line.split()[0] for line in dp.stdout.splitlines() if line[:1].isdigit()] == ["0", "4", "6"]
    for extra, message in ((["--grad-ckpt"], "pp_engine: DeepSpeed's activation checkpointing"),
                           (["--precision", "amp_bf16"], "pp_engine: DeepSpeed's pipeline engine is not modelled "
                                                         "in precision amp_bf16 yet"),
                           (["--pp-schedule", "gpipe"], "pp_engine: DeepSpeed's pipeline engine runs its own")):
        result = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], result.stderr


@pytest.mark.slow
def test_the_ports_match_deepspeeds_own_partition_and_schedule():
    """partition_balanced and TrainSchedule's order (by buffer id) against DeepSpeed's own code."""
    import random

    from deepspeed.runtime.pipe import schedule as S
    from deepspeed.runtime.utils import partition_balanced as ds_partition

    rng = random.Random(0)
    for _ in range(20):
        weights = [rng.randrange(1, 1000) for _ in range(rng.randrange(3, 20))]
        parts = rng.randrange(2, 6)
        assert partition_balanced(weights, parts) == [int(x) for x in ds_partition(weights, parts)]
    for pp in (2, 3, 4, 8):
        for m in (1, 2, 3, 4, 8):
            for stage in range(pp):
                theirs = [("F" if isinstance(c, S.ForwardPass) else "B", c.buffer_id)
                          for cmds in S.TrainSchedule(micro_batches=m, stages=pp, stage_id=stage).steps()
                          for c in cmds if isinstance(c, (S.ForwardPass, S.BackwardPass))]
                buffers = num_pipe_buffers(stage, pp, m)
                assert [(a.kind, a.microbatch % buffers) for a in train_schedule_actions(stage, pp, m)] == theirs


@pytest.mark.slow
def test_the_estimate_matches_deepspeeds_engine_on_gloo_ranks(tmp_path):
    """The oracle (benchmarks/ds_pipeline_table.py): the tiny Llama config on 2 pipeline stages of DeepSpeed's
    engine, every live storage counted, each rank in a spawned interpreter."""
    import os

    out = tmp_path / "ds_pp.csv"
    result = subprocess.run([sys.executable, "benchmarks/ds_pipeline_table.py", "--pp", "2", "--microbatches", "2",
                             "--points", "2x128", "--csv", str(out)], capture_output=True, text=True, timeout=900,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-2000:]
    with out.open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["rank"] for r in rows] == ["0", "1"]
    assert all(abs(float(r["error_pct"])) <= 1.0 for r in rows)


@pytest.mark.slow
def test_the_estimate_matches_deepspeeds_engine_with_data_parallel_stages(tmp_path):
    """The oracle with 2 data-parallel ranks per stage (world 4) in DeepSpeed's bf16 mode: both ranks of a stage
    measure the same, and the first of each is within 1 % of the estimate (masters and states split)."""
    import os

    out = tmp_path / "ds_pp_dp.csv"
    result = subprocess.run([sys.executable, "benchmarks/ds_pipeline_table.py", "--pp", "2", "--dp", "2",
                             "--microbatches", "2", "--points", "1x64", "--precision", "mixed_bf16", "--csv",
                             str(out)], capture_output=True, text=True, timeout=900, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-2000:]
    with out.open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["rank"] for r in rows] == ["0", "2"]
    assert all(abs(float(r["error_pct"])) <= 1.0 for r in rows)


@pytest.mark.slow
def test_the_harness_runs_deepspeeds_pipeline_on_cpu(tmp_path):
    """``python -m harness ... parallel.pp_engine=deepspeed backend=cpu``: 2 gloo ranks (torchrun), the allocated
    level counted from live storages in 512-byte blocks, each rank within 1 % of ``--from-run``'s estimate (less the
    cuBLAS workspace a CPU run has none of)."""
    import json
    import os

    from estimator.api import estimate

    result = subprocess.run([sys.executable, "-m", "harness", "model=custom", f"model.name={CONFIG}", "method=single",
                             "parallel.world_size=2", "parallel.pp=2", "parallel.pp_engine=deepspeed",
                             "parallel.pp_microbatches=2", "backend=cpu", "data=synthetic",
                             "training.micro_batch_size=2", "training.seq_len=128", "training.precision=bf16",
                             "training.attn=sdpa", f"paths.results_dir={tmp_path}",
                             f"paths.measurements_dir={tmp_path / 'measurements'}", "campaign=ds_pipe_check"],
                            capture_output=True, text=True, timeout=900, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (run,) = [p.parent for p in tmp_path.glob("ds_pipe_check/cpu/*/spec.json")]
    spec = RunSpec.from_json((run / "spec.json").read_text()).replace(gpu="h100-80gb")  # a CPU run names no GPU
    assert spec.parallel.pp_engine == "deepspeed"
    est = {r.rank: r.traced_allocated_bytes for r in estimate(spec, replay_reserved=False).ranks}
    for rank in (0, 1):
        record = json.loads((run / f"rank{rank}.json").read_text())
        assert record["memory_source"] == "counted-cpu"
        got = record["peak_allocated_bytes"]
        assert abs(est[rank] - got) <= 0.01 * got, (rank, est[rank], got)


def test_the_plan_weighs_deepspeed_pipelines_only_when_the_methods_filter_names_them():
    """``methods=["ds_pipeline"]``: every stage count dividing the GPUs (the rest data parallel), without
    checkpointing (refused), in bf16 and DeepSpeed's bf16 mode; the default plan weighs none; a refused setting
    leaves a one-line note."""
    from estimator.models.arch import cached_arch
    from estimator.planning.plan import ds_pipeline_candidates, plan

    arch = cached_arch(str(CONFIG))
    for precision in ("bf16", "mixed_bf16"):
        cands, note = ds_pipeline_candidates(str(CONFIG), arch, TrainingSpec(precision=precision, seq_len=64), 4,
                                             (False, True))
        assert [(c.label, c.method, c.pp, c.world_size, c.grad_ckpt) for c in cands] == [
            ("pp2 x dp2 deepspeed", "ddp", 2, 4, False), ("pp4 deepspeed", "single", 4, 4, False)]
        assert note == ""
    assert [c.parallel_spec().pp_engine for c in cands] == ["deepspeed", "deepspeed"]
    cands, note = ds_pipeline_candidates(str(CONFIG), arch, TrainingSpec(precision="bf16", seq_len=64), 4, (True,))
    assert cands == [] and note.startswith("ds_pipeline not weighed: pp_engine: DeepSpeed's activation checkpointing")
    lora, note = ds_pipeline_candidates(str(CONFIG), arch, TrainingSpec(precision="bf16", seq_len=64, lora_rank=8), 4,
                                        (False,))
    assert lora == [] and "LoRA" in note and "\n" not in note
    with pytest.raises(ValueError, match="^methods: ds_pipeline not weighed: pp_engine: DeepSpeed's activation"):
        plan(str(CONFIG), gpus=2, gpu="h100-80gb", seq_len=64, precision="bf16", methods=["ds_pipeline"],
             ckpt_options=(True,), advise=False)


@pytest.mark.slow
def test_a_plan_naming_ds_pipeline_estimates_it_beside_torchs_pipelines():
    from estimator.planning.plan import plan

    result = plan(str(CONFIG), gpus=2, gpu="h100-80gb", seq_len=64, precision="bf16",
                  methods=["ds_pipeline", "fsdp", "single"], ckpt_options=(False,), advise=False)
    by_label = {r.candidate.label: r for r in result.results}
    assert {"pp2 deepspeed", "pp2 1f1b", "fsdp"} <= set(by_label)
    piped = by_label["pp2 deepspeed"]
    assert piped.fits and piped.time is not None and piped.grad_accum == 2
    default = plan(str(CONFIG), gpus=2, gpu="h100-80gb", seq_len=64, precision="bf16", methods=["fsdp", "single"],
                   ckpt_options=(False,), advise=False)
    assert all(r.candidate.pp_engine == "torch" for r in default.results)
