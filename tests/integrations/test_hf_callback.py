"""The HF callback inside a real ``Trainer`` run on CPU: a tiny Llama built from its config, synthetic rows, the
harness's counted-cpu storage counter standing in for CUDA's allocator statistics (the integration takes any
memory reader, so it never imports the harness)."""

import json
import logging
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from estimator.integrations.guard import WillNotFitError  # noqa: E402
from estimator.integrations.hf import MemoryEstimatorCallback  # noqa: E402
from harness.fake.counter import StorageCounter  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "harness" / "assets" / "models" / "tiny-llama.json"
SEQ, BATCH = 32, 2


class CountedCpuReader:
    """The harness's live-storage counter (512-byte blocks, as the CUDA allocator rounds) as a memory reader."""

    source = "counted-cpu"

    def __init__(self):
        self.counter = StorageCounter(round_to=512)

    def start(self, model):
        self.counter.__enter__()
        self.counter.retag(list(model.parameters()) + list(model.buffers()), "Parameter")
        self.reset()

    def reset(self):
        self.counter.max_total = self.counter.current

    def read(self):
        return {"peak_allocated_bytes": int(self.counter.max_total), "peak_reserved_bytes": None,
                "peak_device_bytes": None, "device_total_bytes": None}

    def close(self):
        while self.counter._depth:
            self.counter.__exit__(None, None, None)


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(3, 1000, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": ids.clone()}


def _model():
    config = transformers.AutoConfig.for_model(**json.loads(TINY.read_text()))
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _train(tmp_path, callback, steps=4):
    model = _model()
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH,
                                          max_steps=steps, use_cpu=True, report_to=[], save_strategy="no",
                                          logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)  # what CUDA runs by default
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[callback],
                                   optimizers=(optimizer, None))
    trainer.train()
    return trainer


def test_callback_predicts_and_records_inside_a_real_trainer(tmp_path, caplog):
    records = tmp_path / "records"
    callback = MemoryEstimatorCallback(records, seq_len=SEQ, memory_reader=CountedCpuReader(), campaign="tiny")
    with caplog.at_level(logging.INFO, logger="estimator.integrations"):
        _train(tmp_path, callback)
    est = callback.guard.estimate
    assert est is not None and est.spec.training.micro_batch_size == BATCH and est.spec.training.seq_len == SEQ
    assert est.spec.training.precision == "fp32" and est.spec.training.optimizer == "adamw"
    assert est.spec.parallel.method == "single" and est.spec.training.loop == "trainer"
    rows = list((records / "cpu").glob("tiny.rank0.csv"))
    assert len(rows) == 1
    import csv

    (row,) = list(csv.DictReader(rows[0].open()))
    assert row["memory_source"] == "counted-cpu" and row["gpu_key"] == "cpu" and row["run_status"] == "ok"
    measured = int(row["peak_allocated_bytes"])
    # CPU runs compare at the allocated level less the cuBLAS workspace, which CPU runs lack (estimator CLI).
    predicted = est.traced_allocated_bytes
    assert measured == pytest.approx(predicted, rel=0.05), (measured, predicted)  # -0.5 % when written
    assert "measured peak" in caplog.text and "predicted peak" in caplog.text
    (detail,) = list((records / "runs").glob("*/rank0.json"))
    saved = json.loads(detail.read_text())
    assert saved["prediction"]["peak_allocated_bytes"] == est.peak_allocated_bytes
    assert len(saved["steps"]) == 3 and saved["steps"][0]["warmup"]


def test_records_validate_as_a_calibrate_table(tmp_path):
    pytest.importorskip("pandas")
    from calibrate.data import load

    records = tmp_path / "records"
    _train(tmp_path, MemoryEstimatorCallback(records, seq_len=SEQ, memory_reader=CountedCpuReader()))
    table = load([records])
    assert len(table.rows) == 1 and table.rows.iloc[0]["memory_source"] == "counted-cpu"
    from calibrate.cli import main as calibrate_main

    assert calibrate_main(["report", "--data", str(records), "--out", str(tmp_path / "report"), "--no-plan"]) == 0
    # A CPU row (spec gpu "cpu", as the harness writes CPU runs) is read and named; only GPU rows are estimated.
    assert "cpu/my-runs.rank0.csv" in (tmp_path / "report" / "report.md").read_text()
    assert calibrate_main(["fit", "--data", str(records), "--dry-run"]) == 2  # no GPU rows to fit


def test_stop_if_oom_stops_before_the_first_step(tmp_path):
    steps = []

    class Count(transformers.TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            steps.append(1)

    # A batch of 4096 rows of 2048 tokens cannot fit a 16 GB T4: the check raises before any step runs.
    callback = MemoryEstimatorCallback(seq_len=2048, stop_if_oom=True, gpu="t4-16gb")
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "o"), per_device_train_batch_size=4096,
                                          max_steps=2, use_cpu=True, report_to=[], save_strategy="no",
                                          disable_tqdm=True)
    trainer = transformers.Trainer(model=_model(), args=args, train_dataset=Rows(), callbacks=[callback, Count()])
    with pytest.raises(WillNotFitError, match="run out of GPU memory"):
        trainer.train()
    assert steps == [] and not callback.guard.estimate.fits


def test_a_broken_reader_never_stops_training(tmp_path, caplog):
    class Broken(CountedCpuReader):
        def read(self):
            raise RuntimeError("reader exploded")

    callback = MemoryEstimatorCallback(tmp_path / "r", seq_len=SEQ, memory_reader=Broken())
    with caplog.at_level(logging.WARNING, logger="estimator.integrations"):
        trainer = _train(tmp_path, callback, steps=3)
    assert trainer.state.global_step == 3
    assert "reader exploded" in caplog.text and not callback.guard.active


def test_an_unknown_model_is_logged_not_raised(tmp_path, caplog):
    callback = MemoryEstimatorCallback(seq_len=SEQ)
    with caplog.at_level(logging.WARNING, logger="estimator.integrations"):
        assert callback.guard.check(object(), None, settings={"seq_len": SEQ}) is None
    assert "memory check skipped" in caplog.text


@pytest.mark.gpu
def test_cuda_records_are_estimated_by_the_report(tmp_path):
    """On a GPU: the default CUDA reader fills every level calibrate needs, and the report estimates the row."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from calibrate.cli import main as calibrate_main
    from calibrate.data import load

    records = tmp_path / "records"
    model = _model().cuda()
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH,
                                          max_steps=4, report_to=[], save_strategy="no", disable_tqdm=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    transformers.Trainer(model=model, args=args, train_dataset=Rows(), optimizers=(optimizer, None),
                         callbacks=[MemoryEstimatorCallback(records, seq_len=SEQ)]).train()
    row = load([records]).rows.iloc[0]
    assert row["memory_source"] == "cuda" and row["peak_reserved_bytes"] >= row["peak_allocated_bytes"] > 0
    assert calibrate_main(["report", "--data", str(records), "--out", str(tmp_path / "report"), "--no-plan"]) == 0
    assert "could not be estimated" not in (tmp_path / "report" / "report.md").read_text()


_FSDP1_LIVE = r"""
import json, os, sys
import torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from estimator.integrations.guard import MemoryGuard
from tests.integrations.test_hf_callback import _model
model = _model()
layer = type(model.model.layers[0])
wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({layer}), backward_prefetch=BackwardPrefetch.BACKWARD_POST,
               forward_prefetch=True, use_orig_params=False, device_id=torch.device("cpu"))
spec, _, _ = MemoryGuard(None)._spec(wrapped, None, None, {"seq_len": 64, "micro_batch_size": 1})
print(json.dumps([spec.parallel.method, spec.parallel.fsdp1.__dict__]))
dist.destroy_process_group()
"""


def test_the_guard_reads_fsdp1_settings_from_the_live_units():
    """A real FullyShardedDataParallel (gloo, one rank, in its own process): the spec is fsdp1 with the
    settings the units run (one rank: FSDP1 runs NO_SHARD whatever it was given)."""
    import random
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FSDP1_LIVE, str(random.randint(20000, 40000))],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    method, settings = json.loads(out.stdout.strip().splitlines()[-1])
    assert method == "fsdp1"
    assert settings == {"sharding_strategy": "NO_SHARD", "use_orig_params": False, "cpu_offload": False,
                        "backward_prefetch": "BACKWARD_POST", "forward_prefetch": True, "limit_all_gathers": True,
                        "gpus_per_node": 8, "lora_wrap": "adapter"}


_ACCELERATE_LIVE = r"""
import json
import torch
from accelerate import Accelerator
from estimator.integrations import live
from tests.integrations.test_hf_callback import _model
plain = _model()
before = live.outputs_fp32(plain)
prepared = Accelerator(mixed_precision="bf16", cpu=True).prepare(_model())
print(json.dumps([before, live.outputs_fp32(prepared)]))
"""


def test_the_guard_sees_accelerates_fp32_output_wrapper():
    """Accelerator.prepare under bf16 mixed precision wraps the forward (fp32 outputs); a plain model is not
    wrapped (its own process: accelerate's state is process-wide)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _ACCELERATE_LIVE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [None, True]


def test_the_guard_reads_lora_rank_targets_and_dropout_off_the_peft_model():
    from peft import LoraConfig, get_peft_model

    from estimator.integrations import live

    model = get_peft_model(_model(), LoraConfig(r=4, lora_dropout=0.1, target_modules=["q_proj", "v_proj"],
                                                task_type="CAUSAL_LM"))
    facts = live.model_facts(model)
    assert (facts["lora_rank"], facts["lora_targets"], facts["lora_dropout"]) == (4, "q_proj,v_proj", 0.1)
