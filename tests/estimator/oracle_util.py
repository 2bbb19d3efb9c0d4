"""A direct full-depth fake-tensor trace of two training steps: the reference the estimator must match."""

from __future__ import annotations


def traced_peak_bytes(config: dict, training, kernels: str = "cuda") -> int:
    """``kernels``: "cuda" traces the kernels a GPU runs (the estimator's reference), "cpu" the CPU's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from estimator.profiler import build
    from estimator.profiler.trace import StorageRecorder

    model = build.build_model(config, training, meta=True)
    recorder = StorageRecorder()
    with FakeTensorMode(allow_non_fake_inputs=True), recorder:
        build.materialize_fake(model)
        optimizer = build.build_optimizer(model.parameters(), training)
        batch = build.synthetic_batch(training.micro_batch_size, training.seq_len, min(config["vocab_size"], 1000))
        recorder.mark("start")  # params exist before: count from here, add them below
        held = build.HeldOutputs(training.loop, training.outputs_fp32)
        # a full-length batch as the GPU runs it (see the functions)
        program = build.as_on_gpu(training.batch) if kernels == "cuda" \
            else build.full_length_attention_mask(padded=training.batch != "full")
        with program:
            for _ in range(2):
                build.train_step(model, optimizer, batch, training, held=held)
    timeline = recorder.timeline
    start = timeline.events.index(("m", "start"))
    live_before = 0
    freed = set()
    for event in timeline.events[:start]:
        if event[0] == "a":
            live_before += event[2]
        elif event[0] == "f":
            live_before -= timeline.sizes[event[1]]
            freed.add(event[1])
    running = peak = live_before
    for event in timeline.events[start:]:
        if event[0] == "a":
            running += event[2]
        elif event[0] == "f":
            running -= timeline.sizes[event[1]]
        peak = max(peak, running)
    return peak
