"""The GPU campaign runner (``harness/campaign.py``) on the CPU: every chunk of ``campaigns/chunks.yaml`` expands
into valid, plannable points; the budget logic stops, cuts and resumes (a stub executor on a fake clock); and a
real fork-isolated run of tiny CPU points packs its run dirs and merges back into the tables."""

import json
import tarfile

import pytest

from estimator.spec import RunSpec
from harness import campaign
from harness.environment import CPU_DEVICE
from harness.files import write_json
from harness.launch import plan_point, prepare
from harness.records import RunRecord, to_dict
from harness.sweep import JobComposer
from harness.table import read_rows, upsert_rows

CHUNKS = campaign.load_chunks()
TINY_CHUNK = """
chunks:
  - name: tiny
    experiment: gpu_single
    overrides: [backend=cpu, model=tiny-llama, training.precision=fp32, campaign=test_campaign]
    sweeps:
      - {training.seq_len: "64,128", training.micro_batch_size: "1,2,4,8"}
  - name: tiny_emulated
    experiment: gpu_emulated
    overrides: [backend=cpu, model=tiny-llama, training.precision=fp32, training.seq_len=64, campaign=test_campaign]
    sweeps:
      - {method: fsdp, parallel.world_size: 2, training.micro_batch_size: 2}
"""


def covering(jobs):
    """A subset in which every swept value appears at least once (greedy, in order)."""
    seen, chosen = set(), []
    for job in jobs:
        if set(job.overrides) - seen:
            chosen.append(job)
            seen |= set(job.overrides)
    return chosen


def runner_overrides(tmp_path):
    return campaign._runner_overrides(tmp_path / "work", "fork", 150)


def test_chunk_file_is_well_formed():
    names = [c.name for c in CHUNKS]
    assert len(names) == len(set(names)) and "smoke" in names
    queued = campaign.select_chunks(CHUNKS, ["all"])
    assert [c.name for c in queued] == [c.name for c in CHUNKS if c.queue] and "smoke" not in [c.name for c in queued]
    assert [c.name for c in campaign.select_chunks(CHUNKS, ["smoke", "all", "smoke"])][0] == "smoke"
    for chunk in CHUNKS:
        assert (campaign.CONF_DIR / "experiment" / f"{chunk.experiment}.yaml").is_file(), chunk.name
        for sweep in chunk.sweeps:  # the OOM stop needs ascending micro-batches, listed last
            if campaign.MB_KEY in sweep:
                assert list(sweep)[-1] == campaign.MB_KEY, chunk.name
                values = [int(v) for v in str(sweep[campaign.MB_KEY]).split(",")]
                assert values == sorted(values), chunk.name
    with pytest.raises(ValueError, match="not in the chunk file"):
        campaign.select_chunks(CHUNKS, ["nope"])


@pytest.mark.parametrize("name", [c.name for c in CHUNKS])
def test_chunk_points_are_valid_specs(name, tmp_path):
    chunk = next(c for c in CHUNKS if c.name == name)
    jobs = campaign.expand_chunk(chunk)
    assert jobs and all(job.overrides[0] == f"experiment={chunk.experiment}" for job in jobs)
    series: dict = {}
    for job in jobs:  # within a series, ascending micro-batch
        assert job.micro_batch is None or job.micro_batch >= series.get(job.series, 0)
        series[job.series] = job.micro_batch or 0
    planned, invalid = campaign.plan_jobs(covering(jobs), runner_overrides(tmp_path), device=CPU_DEVICE,
                                          check_device=False)
    assert not invalid, invalid[:3]
    for p in planned:
        assert isinstance(p.spec, RunSpec) and p.point.opts.backend == "cuda" and p.estimate_s > 0
        assert p.point.opts.launcher.isolation == "fork"
        assert str(p.point.run_dir).startswith(str(tmp_path / "work" / "runs"))
    assert len({p.point.run_id for p in planned}) == len(planned)


def test_model_shortcut_composes_what_hydra_composes(tmp_path):
    jobs = [j for c in CHUNKS if c.name in ("a1_core_small", "b1_emulated_llama1b", "c1_paper_table2", "d1_lora", "m1_moe")
            for j in covering(campaign.expand_chunk(c))[:2]]
    plain = JobComposer("measure")
    from harness.config import to_run

    with campaign.hydra_context():
        lean = campaign.composer()
        for job in jobs:
            overrides = [*job.overrides, *runner_overrides(tmp_path)]
            assert to_run(lean.compose(overrides)) == to_run(plain.compose(overrides)), job.overrides


@pytest.mark.slow
def test_every_point_of_every_chunk_is_valid_and_each_queued_chunk_fits_8_minutes(tmp_path):
    for chunk in CHUNKS:
        planned, invalid = campaign.plan_jobs(campaign.expand_chunk(chunk),
                                              [*runner_overrides(tmp_path), "gpu=h100-80gb"], device=CPU_DEVICE,
                                              check_device=False)
        assert not invalid, (chunk.name, invalid[:3])
        campaign.predict_fits(planned)
        minutes = sum(p.estimate_s for p in campaign.expected_points(planned)) / 60
        assert minutes <= 8.0 or not chunk.queue, (chunk.name, minutes)


# --------------------------------------------------------------------------------------------- budget logic

class Clock:
    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now


class Stub:
    """Stands in for run_point: takes ``seconds`` of the fake clock, writes result.json (so resume sees it).
    ``oom``: (seq_len, micro_batch) points at or above which OOM; ``status``: a fixed status (error, timeout)."""

    def __init__(self, clock, seconds=10.0, oom=(128, 4), status=None):
        self.clock, self.seconds, self.oom, self.status = clock, seconds, oom, status
        self.calls = []

    def __call__(self, spec, opts, extra):
        point = plan_point(spec, opts, CPU_DEVICE)
        prepare(point)
        self.calls.append((spec.training.seq_len, spec.training.micro_batch_size, opts.launcher.timeout_s))
        self.clock.now += self.seconds
        t = spec.training
        status = self.status or ("oom" if (t.seq_len, t.micro_batch_size) >= self.oom and
                                 t.seq_len == self.oom[0] else "ok")
        record = RunRecord(spec_id=spec.spec_id, run_id=point.run_id, campaign=point.opts.campaign,
                           gpu_key=point.gpu_key, status=status, world_size=1)
        write_json(point.run_dir / "result.json", to_dict(record))
        return record


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "chunks.yaml"
    path.write_text(TINY_CHUNK)
    chunks = campaign.load_chunks(path)

    def plan(work):
        overrides = campaign._runner_overrides(work, "fork", 150)
        planned, invalid = campaign.plan_jobs(campaign.expand_chunk(chunks[0]), overrides, device=CPU_DEVICE)
        assert not invalid
        for p in planned:
            p.estimate_s = 10.0
        return planned
    return plan


def test_budget_stops_before_the_deadline_and_the_sweep_resumes(tiny, tmp_path):
    planned = tiny(tmp_path / "work")
    clock = Clock()
    stub = Stub(clock)
    runner = campaign.Runner(until=clock.now + 35, out=None, execute=stub, clock=clock, log=lambda line: None)
    report = runner.run_chunk("tiny", planned)
    # 12.5 s (10 x the default drift 1.25) fits at t=0, then 10 s each (drift 1.0 once measured): three points
    assert [c[:2] for c in stub.calls] == [(64, 1), (64, 2), (64, 4)] and clock.now <= 1000 + 35
    assert report.counts == {"ok": 3, "left": 5} and not report.finished
    assert all(timeout <= 150 for *_, timeout in stub.calls)

    # the same (warm) machine: result.json says done; the OOM at (128, 4) stops its series
    stub2 = Stub(clock)
    runner2 = campaign.Runner(until=clock.now + 10**6, out=None, execute=stub2, clock=clock, log=lambda line: None)
    report2 = runner2.run_chunk("tiny", planned)
    assert [c[:2] for c in stub2.calls] == [(64, 8), (128, 1), (128, 2), (128, 4)]
    assert report2.counts == {"done": 3, "ok": 3, "oom": 1, "beyond-oom": 1} and report2.finished

    # a fresh machine: the committed table says done (and where the OOM was)
    tables = tmp_path / "data"
    rows = [{"run_id": p.point.run_id, "run_status": "oom" if (p.spec.training.seq_len,
             p.spec.training.micro_batch_size) == (128, 4) else "ok"} for p in planned
            if (p.spec.training.seq_len, p.spec.training.micro_batch_size) != (128, 8)]
    upsert_rows(campaign.Path(tables / "cpu" / "test_campaign.csv"), rows)
    fresh = tiny(tmp_path / "fresh")
    stub3 = Stub(clock)
    runner3 = campaign.Runner(until=clock.now + 10**6, out=None, execute=stub3, clock=clock, log=lambda line: None,
                              done=campaign.done_statuses(tables, fresh))
    assert runner3.run_chunk("tiny", fresh).counts == {"done": 7, "beyond-oom": 1} and not stub3.calls


def test_a_point_killed_by_the_deadline_is_cut_and_runs_again(tiny, tmp_path):
    planned = tiny(tmp_path / "work")
    clock = Clock()
    stub = Stub(clock, status="timeout")
    runner = campaign.Runner(until=clock.now + 20, out=None, execute=stub, clock=clock, log=lambda line: None)
    outcome = runner.run_one(planned[0])
    assert outcome.status == "cut" and stub.calls[0][2] == 80  # deadline + 60 s grace, below --point-timeout-s
    assert not (planned[0].point.run_dir / "result.json").exists()
    # a timeout under the point's own limit is data (and two failures stop the method)
    clock.now = 0
    runner = campaign.Runner(until=10**6, out=None, execute=Stub(clock, status="timeout"), clock=clock,
                             log=lambda line: None)
    assert runner.run_chunk("tiny", planned).counts == {"timeout": 2, "failing-method": 6}


# --------------------------------------------------------------------------------------------- end to end

def test_fork_isolated_run_packs_and_merge_rebuilds_the_same_rows(tmp_path, capsys):
    chunks = tmp_path / "chunks.yaml"
    chunks.write_text(TINY_CHUNK.replace('"1,2,4,8"', '"1"').replace('"64,128"', '"64"'))
    out, work = tmp_path / "out", tmp_path / "work"
    args = ["--chunks", str(chunks), "--work", str(work), "run", "tiny", "tiny_emulated", "--budget-s", "300",
            "--out", str(out), "--no-done-tables"]
    assert campaign.main(args) == 0
    printed = capsys.readouterr().out
    assert "finished chunks: tiny, tiny_emulated" in printed, printed[-3000:]
    lines = [json.loads(line) for line in (out / "summary.jsonl").read_text().splitlines()]
    points = [line for line in lines if "run_id" in line]
    assert [p["status"] for p in points] == ["ok", "ok"], points
    with tarfile.open(out / "runs.tar") as tar:
        names = tar.getnames()
    assert "measurements/cpu/test_campaign.csv" in names
    for point in points:
        assert f"runs/test_campaign/cpu/{point['run_id']}/result.json" in names
        log = (work / "runs/test_campaign/cpu" / point["run_id"] / "worker.log").read_text()
        assert log.startswith("$ fork: harness.worker.run") and "ok peak_allocated" in log

    data = tmp_path / "data"
    counts = campaign.merge([out], data_dir=data, runs_dir=tmp_path / "runs")
    assert counts == {"ok": 2}
    def key(row):
        return row["run_id"], row["rank"]
    merged = sorted(read_rows(data / "cpu/test_campaign.csv"), key=key)
    launcher = sorted(read_rows(work / "measurements/cpu/test_campaign.csv"), key=key)
    assert merged == launcher and len(merged) == 3  # 1 single rank + emulated ranks 0 and 1
    assert (tmp_path / "runs/test_campaign/cpu" / points[0]["run_id"] / "spec.json").is_file()
    assert json.loads((data / "cpu/test_campaign.meta.json").read_text())["campaign"] == "test_campaign"

    # resume: the same work dir (result.json), then a fresh one against the merged tables: nothing runs
    out2 = tmp_path / "out2"
    assert campaign.main([*args[:-3], "--out", str(out2), "--no-done-tables"]) == 0
    fresh = ["--chunks", str(chunks), "--work", str(tmp_path / "fresh"), "run", "tiny", "tiny_emulated",
             "--budget-s", "300", "--out", str(out2), "--done-tables", str(data)]
    assert campaign.main(fresh) == 0
    assert not [line for line in (out2 / "summary.jsonl").read_text().splitlines() if '"run_id"' in line]


@pytest.mark.parametrize("behaviour", ["hang", "crash"])
def test_fork_isolation_turns_a_hang_or_crash_into_a_record(behaviour, tmp_path, monkeypatch):
    import time

    from harness import worker
    from tests.harness.conftest import TINY_OVERRIDES, run_point

    def misbehave(*args, **kwargs):
        if behaviour == "hang":
            time.sleep(60)
        raise RuntimeError("worker exploded")

    monkeypatch.setattr(worker, "run", misbehave)  # the fork inherits the patched module
    started = time.monotonic()
    record = run_point(tmp_path, *TINY_OVERRIDES, "launcher.isolation=fork", "launcher.timeout_s=2",
                       device=CPU_DEVICE)
    assert time.monotonic() - started < 30
    if behaviour == "hang":
        assert record.status == "timeout" and "timed out after 2 s" in record.error
    else:
        assert record.status == "error" and "worker exploded" in record.stderr_tail
