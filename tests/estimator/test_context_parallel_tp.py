"""Context parallelism x tensor parallelism (issue 18): the layout (method dp_tp with cp, torchtitan's
(dp_shard, cp, tp) mesh), each rank's place in it, the head split the ring attention runs with, the committed
oracle table (benchmarks/context_parallel_table.py --tp) and the plan's cp x tp layouts. Torch-free but for the
slow rescore."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from estimator.methods.context_parallel import ring_of
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec

REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "docs" / "error_matrix" / "context_parallel_tp.csv"
LORA_TABLE = REPO / "docs" / "error_matrix" / "context_parallel_tp_lora.csv"
LLAMA = "meta-llama/Llama-3.1-8B"  # its tp 2 profiles ship


def test_cp_x_tp_is_a_dp_tp_layout():
    """FSDP2 shards over the dp x cp ranks of each TP position: the spec's dp axis is world / tp."""
    parallel = ParallelSpec(method="dp_tp", world_size=8, tp=2, cp=4)
    assert parallel.dp == 4
    spec = RunSpec(parallel=parallel, training=TrainingSpec(seq_len=4096, precision="bf16"))
    assert RunSpec.from_json(spec.to_json()) == spec


def test_lora_under_cp_x_tp_is_a_layout():
    """Checked against the oracle (context_parallel_tp_lora.csv): the spec takes it; QLoRA stays refused."""
    parallel = ParallelSpec(method="dp_tp", world_size=4, tp=2, cp=2)
    spec = RunSpec(parallel=parallel, training=TrainingSpec(seq_len=4096, precision="bf16", lora_rank=8))
    assert spec.parallel.cp == 2 and spec.training.lora
    with pytest.raises(ValueError, match="cp: QLoRA under context parallelism is not modelled"):
        RunSpec(parallel=parallel, training=TrainingSpec(seq_len=4096, precision="bf16", lora_rank=8, qlora=True))


def test_ring_ranks_follow_torchtitans_mesh():
    """TP innermost: a cp group is every tp-th rank of a block of cp x tp, as the oracle's process groups are
    built (``harness.fake.context_parallel.cp_group_ranks``); each rank's ring runs its own heads."""
    from harness.fake.context_parallel import cp_group_ranks

    ring = ring_of(4, 32, 8, 128, tp=2)
    assert (ring.heads, ring.kv_heads, ring.tp) == (16, 4, 2)
    assert [ring.cp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert ring.reported_ranks(8) == [0, 4, 6, 7] and ring.reported_ranks(16) == [0, 4, 6, 15]
    groups = cp_group_ranks(16, 4, 2)
    assert sorted(r for g in groups for r in g) == list(range(16))
    for group in groups:
        assert [ring.cp_rank(r) for r in group] == [0, 1, 2, 3]
        assert len({r % 2 for r in group}) == 1  # one TP position per cp group
    assert cp_group_ranks(4, 2) == [[0, 1], [2, 3]]  # tp 1: consecutive ranks, as before


def test_the_half_step_ranks_output_copy_is_one_tp_rank_s_heads():
    """Llama-3.1-8B (shipped tp 2 profiles), cp 4 x tp 2 at 64k tokens: the cp ranks whose last ring step is a half
    step hold one more (b, s / cp, hidden / tp) bf16 attention output per layer than the last cp rank; the last
    global rank is a last cp rank."""
    from estimator.api import estimate

    spec = RunSpec(model=LLAMA, gpu="h100-80gb", parallel=ParallelSpec(method="dp_tp", world_size=8, tp=2, cp=4),
                   training=TrainingSpec(micro_batch_size=1, seq_len=65536, precision="mixed_bf16"))
    got = estimate(spec, allow_build=False, replay_reserved=False)
    ranks = {r.rank: r.traced_allocated_bytes for r in got.ranks}
    assert sorted(ranks) == [0, 4, 6, 7]
    assert ranks[0] - ranks[6] == 32 * 16384 * (4096 // 2) * 2
    assert ranks[0] == ranks[4] and ranks[6] == ranks[7]
    assert any("tp 2 splits the heads" in n for n in got.notes)


def _rows(table: Path = TABLE) -> list[dict]:
    with open(table) as handle:
        return list(csv.DictReader(handle))


def test_committed_rows_meet_the_bar_and_cover_the_layouts():
    """benchmarks/context_parallel_table.py --tp: every rank row within 1 % of the oracle, cp 2 and 4 x tp 2, bf16
    and mixed_bf16, with and without checkpointing, two configs, two points, ranks first, middle and last."""
    rows = _rows()
    assert max(abs(float(r["error_pct"])) for r in rows) <= 1.0
    layouts = {(r["model"], r["precision"], int(r["cp"]), int(r["tp"]), r["grad_ckpt"]) for r in rows}
    assert layouts >= {(m, p, cp, 2, ckpt) for m in ("attn-mha", "attn-gqa2") for p in ("bf16", "mixed_bf16")
                       for cp in (2, 4) for ckpt in ("False", "True")}
    points = {(r["micro_batch_size"], r["seq_len"]) for r in rows}
    assert len(points) >= 2
    cp4 = {int(r["cp_rank"]) for r in rows if r["cp"] == "4"}
    assert cp4 == {0, 2, 3}
    for row in rows:  # the global rank's place in the (dp, cp, tp) mesh
        rank, cp, tp = int(row["rank"]), int(row["cp"]), int(row["tp"])
        assert (int(row["cp_rank"]), int(row["tp_rank"])) == (rank // tp % cp, rank % tp)


def test_committed_lora_rows_meet_the_bar_and_cover_the_layouts():
    """benchmarks/context_parallel_table.py --tp --lora: peft's LoRA r8 (q/k/v/o and all linear layers, bf16) under
    cp 2 and 4 x tp 2, with and without checkpointing, two configs, every rank row within 1 % of the oracle, ranks
    first, middle and last of the cp group and both TP positions."""
    rows = _rows(LORA_TABLE)
    assert max(abs(float(r["error_pct"])) for r in rows) <= 1.0
    layouts = {(r["model"], r["technique"], int(r["cp"]), int(r["tp"]), r["grad_ckpt"]) for r in rows}
    assert layouts >= {(m, t, cp, 2, ckpt) for m in ("attn-mha", "attn-gqa2")
                       for t in ("lora8-qkvo", "lora8-all-linear") for cp in (2, 4) for ckpt in ("False", "True")}
    assert {r["precision"] for r in rows} == {"bf16"}
    assert {int(r["cp_rank"]) for r in rows if r["cp"] == "4"} == {0, 2, 3}
    assert {int(r["tp_rank"]) for r in rows} == {0, 1}
    for row in rows:
        rank, cp, tp = int(row["rank"]), int(row["cp"]), int(row["tp"])
        assert (int(row["cp_rank"]), int(row["tp_rank"])) == (rank // tp % cp, rank % tp)


@pytest.mark.slow
def test_one_lora_point_against_the_oracle():
    """A middle cp rank of cp 4 x tp 2 with LoRA on every linear layer and checkpointing: the oracle (fake
    tensors, torch's ring attention on the fake process group) still measures the committed bytes, and the
    estimate is within 1 % of them."""
    import json
    import tempfile

    sys.path.insert(0, str(REPO / "benchmarks"))
    from context_parallel_table import LORA_VARIANTS, _models

    from estimator.api import estimate
    from harness.fake.context_parallel import tp_peak_bytes

    row = next(r for r in _rows(LORA_TABLE) if r["model"] == "attn-gqa2" and r["technique"] == "lora8-all-linear"
               and r["cp"] == "4" and r["grad_ckpt"] == "True" and r["cp_rank"] == "2")
    config, fields = _models()["attn-gqa2"], dict(LORA_VARIANTS)["lora8-all-linear"]
    b, s, rank = int(row["micro_batch_size"]), int(row["seq_len"]), int(row["rank"])
    measured = tp_peak_bytes(config, "bf16", 8, 4, 2, rank, b, s, grad_ckpt=True, **fields)
    assert measured == int(row["measured_bytes"])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "attn-gqa2.json"
        path.write_text(json.dumps(config))
        training = TrainingSpec(micro_batch_size=b, seq_len=s, precision="bf16", grad_ckpt=True, **fields)
        spec = RunSpec(model=str(path), training=training,
                       parallel=ParallelSpec(method="dp_tp", world_size=8, tp=2, cp=4))
        got = {r.rank: r for r in estimate(spec, replay_reserved=False).ranks}[rank].traced_allocated_bytes
    assert abs(got - measured) <= 0.01 * measured


@pytest.mark.slow
def test_estimate_of_the_committed_rows_is_unchanged():
    """The committed rows estimated again (their derived configs' profiles traced on fake tensors)."""
    result = subprocess.run([sys.executable, "benchmarks/context_parallel_table.py", "--rescore", str(TABLE)],
                            cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_plan_weighs_cp_x_tp_layouts():
    from estimator.planning.plan import Candidate, _cp_note, cp_tp_pairs, enumerate_candidates

    training = TrainingSpec(seq_len=65536, precision="mixed_bf16")
    assert cp_tp_pairs(8, training, [2, 4]) == [(2, 2), (4, 2), (2, 4)]
    assert cp_tp_pairs(8, TrainingSpec(seq_len=65536, precision="fp32"), [2, 4]) == []
    # LoRA (context_parallel_tp_lora.csv) weighs the same layouts; QLoRA none (FSDP2 cannot shard 4-bit weights)
    assert cp_tp_pairs(8, TrainingSpec(seq_len=65536, precision="bf16", lora_rank=8), [2, 4]) == [(2, 2), (4, 2),
                                                                                                  (2, 4)]
    assert cp_tp_pairs(8, TrainingSpec(seq_len=65536, precision="bf16", lora_rank=8, qlora=True), [2, 4]) == []
    cands = enumerate_candidates(8, (True,), cp_tps=cp_tp_pairs(8, training, [2]))
    cp4 = [c for c in cands if c.cp == 4]
    assert len(cp4) == 1 and cp4[0].label == "dp1 cp4 tp2" and cp4[0].dp == 1
    assert cp4[0].parallel_spec() == ParallelSpec(method="dp_tp", world_size=8, tp=2, cp=4)

    class Result:
        def __init__(self, cand, fits):
            self.candidate, self.fits = cand, fits

    best = Result(Candidate("dp_tp", 8, tp=2, grad_ckpt=True, cp=4), True)
    note = _cp_note([best, Result(Candidate("fsdp", 8, grad_ckpt=True), False)], best, 65536)[0]
    assert "made it fit" in note and "16384 of the 65536 tokens; TP 2 inside" in note
    assert "FSDP2 over 4 (dp x cp) GPUs of each TP position" in note


def test_a_cp_rank_s_ring_traffic_is_its_own_heads():
    """Under tp each rank rotates the k|v of its kv_heads / tp heads; the ring's term holds the ring alone (the TP
    all-reduce has its own)."""
    from estimator.planning import throughput as tput
    from estimator.planning.shape import ModelShape

    shape = ModelShape(params=8_000_000_000, matmul_params=7_000_000_000, layers=32, hidden_size=4096,
                       kv_dim=1024)
    gpu = tput.gpu_perf("h100-80gb")
    eff = tput.load_efficiency(gpu)
    link = tput.resolve_link(gpu, 8, None, None)

    def parts(method: str, tp: int) -> dict:
        setup = tput.Setup(method=method, world_size=8, tp=tp, cp=4, micro_batch=1, seq_len=65536)
        return tput.step_time(shape, setup, gpu, eff, dp_link=link, tp_link=link).parts

    alone, split = parts("fsdp", 1), parts("dp_tp", 2)
    assert split["cp_ring"] < alone["cp_ring"]
    assert split["tp_allreduce"] > 0


def test_the_harness_refuses_cp_x_tp_it_would_not_run():
    """The GPU harness's dp_tp worker has no context parallelism: a cp x tp spec is refused, not run as dp_tp."""
    from harness.launch import _check_launch
    from harness.options import HarnessOptions

    opts = HarnessOptions()
    opts.backend = "cuda"
    spec = RunSpec(model="HuggingFaceTB/SmolLM2-135M", parallel=ParallelSpec(method="dp_tp", world_size=4, tp=2, cp=2),
                   training=TrainingSpec(seq_len=4096, precision="mixed_bf16"))
    with pytest.raises(ValueError, match="parallel.cp: the harness runs context parallelism with method fsdp only"):
        _check_launch(spec, opts, None)
