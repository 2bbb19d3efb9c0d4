"""The allocator cap (``TrainingSpec.memory_cap_bytes``, torch.cuda.set_per_process_memory_fraction): the spec
field, the reserved replay under it (release-and-retry, out of memory), the CLI flags and ``--from-run``."""

import json

import pytest

from estimator.api import estimate
from estimator.columns import spec_columns, spec_from_columns
from estimator.hardware.gpus import cap_from_fraction, get_gpu
from estimator.io.cli import main
from estimator.spec import RunSpec, TrainingSpec

GIB = 1024**3
# LLMem Table 2's fp16 setting (data/measurements/h200-141gb/paper_table2.csv: 16 GiB cap on the H200)
PAPER = TrainingSpec(micro_batch_size=4, seq_len=512, precision="mixed_fp16", attn="eager", grad_ckpt=True)
BLOOM = RunSpec(model="bigscience/bloom-560m", gpu="h200-141gb", training=PAPER)


def _capped(spec: RunSpec, cap_bytes: int, **training) -> RunSpec:
    return spec.replace(**{"training.memory_cap_bytes": cap_bytes, **{f"training.{k}": v for k, v in training.items()}})


@pytest.mark.parametrize("value", [-1, True, 1.5, "16"])
def test_spec_rejects_a_bad_cap(value):
    with pytest.raises(ValueError, match="^memory_cap_bytes: "):
        TrainingSpec(memory_cap_bytes=value)


def test_cap_leaves_uncapped_ids_alone_and_round_trips_through_the_columns():
    capped = _capped(BLOOM, 16 * GIB)
    assert "memory_cap_bytes" not in BLOOM._canonical_dict()["training"]
    assert capped.spec_id != BLOOM.spec_id
    row = {**spec_columns(BLOOM), "world_size": 1}  # an identity column in the tables
    assert row["memory_cap_bytes"] is None  # empty cell: none, as the harness tables wrote it
    assert spec_from_columns({**spec_columns(capped), "world_size": 1}) == capped
    assert spec_from_columns({**row, "memory_cap_bytes": float("nan")}) == BLOOM  # pandas' empty cell
    assert spec_from_columns({**row, "memory_cap_bytes": 16.0 * GIB}) == capped  # pandas' float column


def test_fraction_is_torch_total_times_fraction():
    gpu = get_gpu("h200-141gb")
    assert cap_from_fraction("h200-141gb", 0.5) == int(0.5 * gpu.torch_total_bytes)
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match="^memory_fraction: "):
            cap_from_fraction("h200-141gb", bad)


def test_capped_run_fits_through_release_and_retry():
    """BLOOM-560m b4 under the 16 GiB cap (measured: one retry, reserved below the cap): the replay reaches the
    cap, releases its cache and retries, and reports the capped level, below the uncapped one."""
    free, capped = estimate(BLOOM), estimate(_capped(BLOOM, 16 * GIB))
    assert free.peak_reserved_bytes > 16 * GIB and not free.ranks[0].num_alloc_retries
    rank = capped.ranks[0]
    assert rank.reserved_source == "replayed" and rank.num_alloc_retries >= 1 and not rank.allocator_oom
    assert capped.peak_allocated_bytes <= capped.peak_reserved_bytes <= 16 * GIB < free.peak_reserved_bytes
    assert capped.capacity_bytes == 16 * GIB + capped.peak_device_bytes - capped.peak_reserved_bytes
    assert any("fit only through release-and-retry" in n for n in capped.notes)
    assert capped.to_dict()["memory_cap_bytes"] == 16 * GIB


def test_capped_run_ooms_where_the_gpu_alone_fits():
    spec = BLOOM.replace(**{"training.micro_batch_size": 8})
    free, capped = estimate(spec), estimate(_capped(spec, 16 * GIB))
    assert free.fits
    assert capped.ranks[0].allocator_oom and not capped.fits
    assert capped.peak_reserved_bytes == free.peak_reserved_bytes  # what the run needs, reported uncapped
    assert any("OUT OF MEMORY under the cap" in n for n in capped.notes)


def test_cap_above_the_gpu_changes_nothing():
    big = estimate(_capped(BLOOM, 200 * GIB))
    assert big.peak_reserved_bytes == estimate(BLOOM).peak_reserved_bytes
    assert big.capacity_bytes == get_gpu("h200-141gb").capacity_bytes and any("no effect" in n for n in big.notes)


def test_garbage_collection_under_the_cap_replaces_the_retry():
    """PyTorch collects cached blocks above ``garbage_collection_threshold`` x the cap only when a memory fraction
    is set: under the 16 GiB cap BLOOM-560m's retry gives way to collections; without a cap the setting is inert."""
    gc = "garbage_collection_threshold:0.6"
    capped = estimate(_capped(BLOOM, 16 * GIB), alloc_conf=gc)
    rank = capped.ranks[0]
    assert rank.gc_released_bytes > 0 and rank.num_alloc_retries == 0 and not rank.allocator_oom
    assert capped.peak_reserved_bytes < estimate(_capped(BLOOM, 16 * GIB)).peak_reserved_bytes
    assert any("garbage collection" in n and "without a release-and-retry" in n for n in capped.notes)
    free = estimate(BLOOM, alloc_conf=gc)
    assert free.ranks[0].gc_released_bytes == 0
    assert free.peak_reserved_bytes == estimate(BLOOM).peak_reserved_bytes


@pytest.mark.parametrize("flags", [["--memory-fraction", "0"], ["--memory-fraction", "1.5"],
                                   ["--memory-cap-gib", "-1"], ["--memory-cap-gib", "nan"],
                                   ["--memory-cap-gib", "16", "--memory-fraction", "0.5"]])
def test_cli_bad_cap_is_one_line_exit_2(flags, capsys):
    assert main(["--model", "facebook/opt-125m", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: memory_") and err.count("\n") == 1


def test_cli_cap_flags_reach_the_spec(capsys):
    assert main(["--model", "facebook/opt-125m", "--gpu", "h200-141gb", "--memory-cap-gib", "0.5", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["memory_cap_bytes"] == GIB // 2 and data["spec"]["training"]["memory_cap_bytes"] == GIB // 2
    assert main(["--model", "facebook/opt-125m", "--gpu", "h200-141gb", "--memory-fraction", "0.25", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_cap_bytes"] == cap_from_fraction("h200-141gb", 0.25)


def test_plan_cli_passes_the_cap_and_rejects_a_bad_one(monkeypatch, capsys):
    import argparse

    from estimator.io.plan_cli import add_plan_arguments, run_plan
    from estimator.planning import plan as planner

    seen = {}

    def fake_plan(model, **kw):
        seen.update(kw)
        raise ValueError("stop: planned")

    monkeypatch.setattr(planner, "plan", fake_plan)
    parse = add_plan_arguments(argparse.ArgumentParser()).parse_args
    base = ["--model", "facebook/opt-125m", "--gpus", "1", "--gpu", "h200-141gb"]
    assert run_plan(parse([*base, "--memory-cap-gib", "16"])) == 2
    assert seen["memory_cap_bytes"] == 16 * GIB and "stop: planned" in capsys.readouterr().err
    seen.clear()
    assert run_plan(parse([*base, "--memory-fraction", "2"])) == 2
    err = capsys.readouterr().err
    assert not seen and err.startswith("error: memory_fraction: ") and err.count("\n") == 1


def _run_dir(tmp_path, spec, rank_cap=None, options_cap_gib=None):
    (tmp_path / "spec.json").write_text(spec.to_json())
    if options_cap_gib is not None:
        (tmp_path / "harness.json").write_text(json.dumps({"memory": {"cap_gib": options_cap_gib}}))
    if rank_cap is not None:
        (tmp_path / "rank0.json").write_text(json.dumps({"rank": 0, "memory_cap_bytes": rank_cap}))
    return tmp_path


def test_from_run_reads_the_cap_the_run_applied(tmp_path, capsys):
    """The harness applies memory.cap_gib outside the spec: --from-run takes the cap from the rank records (what the
    worker set), else the options; a flag overrides it."""
    spec = RunSpec(model="facebook/opt-125m", gpu="h200-141gb")
    run = _run_dir(tmp_path, spec, rank_cap=3 * GIB, options_cap_gib=16)
    assert main(["--from-run", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_cap_bytes"] == 3 * GIB
    (run / "rank0.json").unlink()
    assert main(["--from-run", str(run / "spec.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_cap_bytes"] == 16 * GIB
    assert main(["--from-run", str(run), "--memory-cap-gib", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_cap_bytes"] == 2 * GIB
    (run / "harness.json").unlink()
    assert main(["--from-run", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_cap_bytes"] is None

