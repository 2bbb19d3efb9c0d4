"""Cross-check of the oracle's storage counter against torch's MemTracker / FSDPMemTracker (step 2 peak).

Used by tests/oracle/test_oracle.py; runnable as a script: ``python tests/oracle/crosscheck.py``.
"""

from __future__ import annotations

import contextlib

from estimator.spec import RunSpec


def memtracker_step2_peak(spec: RunSpec, config: dict) -> int:
    """Run the oracle's program for ``spec`` (rank 0) and return the peak Total that torch's MemTracker
    (single/ddp/tp) or FSDPMemTracker (fsdp) reports for step 2 (step 1 untracked), in bytes, unrounded."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from estimator.profiler.build import (
        HeldOutputs,
        as_on_gpu,
        build_model,
        forward_backward,
        materialize_fake,
        synthetic_batch,
    )
    from harness.fake.trace import _device_mesh_untracked
    from harness.fake.wrap import build_method_optimizer, build_training, make_mesh, wrap_model

    n = spec.parallel.world_size
    if n > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        mesh = make_mesh(spec, "cpu")
        meta = build_model(config, build_training(spec), "cpu", meta=True)
        with contextlib.ExitStack() as stack:
            stack.enter_context(_device_mesh_untracked(None))
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(as_on_gpu(spec.training.batch))  # the same program as the oracle's
            model = wrap_model(materialize_fake(meta), spec, mesh, config, fake=True)
            opt = build_method_optimizer(model, spec)
            batch = synthetic_batch(spec.training.micro_batch_size, spec.training.seq_len,
                                    config["vocab_size"], "cpu")

            held = HeldOutputs(spec.training.loop, spec.training.outputs_fp32)

            def step():
                forward_backward(model, batch, spec.training, "cpu", held=held)
                opt.step()
                opt.zero_grad(set_to_none=True)

            step()
            if spec.parallel.method == "fsdp":
                tracker = FSDPMemTracker(model, opt)
                tracker.track_inputs(tuple(batch.values()))
            else:
                tracker = MemTracker()
                tracker.track_external(model, opt, *batch.values())
            with tracker:
                step()
            peak = tracker.get_tracker_snapshot("peak")
            return int(sum(dev["Total"] for dev in peak.values()))
    finally:
        if n > 1 and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    from estimator.models.arch import load_config
    from estimator.profiler.build import with_num_layers
    from estimator.spec import ParallelSpec, TrainingSpec
    from harness.fake import trace_run

    cfg = with_num_layers(load_config("facebook/opt-125m"), 2)
    for method, ws in (("single", 1), ("fsdp", 2)):
        spec = RunSpec(model="facebook/opt-125m", parallel=ParallelSpec(method=method, world_size=ws),
                       training=TrainingSpec(micro_batch_size=2, seq_len=128, precision="fp32"))
        ours = trace_run(spec, [0], config=cfg, round_to=1)["per_rank"][0]["step_peaks"][1]["peak"]
        theirs = memtracker_step2_peak(spec, cfg)
        print(method, ours, theirs, ours - theirs)
