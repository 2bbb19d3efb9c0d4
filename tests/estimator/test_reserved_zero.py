"""The ZeRO-1/2 replay's event stream (``estimator.reserved.zero``) against real DeepSpeed runs on CPU: rank r of a
world on torch's fake process group, built and stepped as the harness runs it (``harness.methods.deepspeed``),
every storage recorded in order."""

import dataclasses
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from estimator import api  # noqa: E402
from estimator.models.profiles import adapters_in_16bit  # noqa: E402
from estimator.reserved import rank as reserved_rank  # noqa: E402
from estimator.reserved.timeline import run_requests  # noqa: E402
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec, ZeroSpec  # noqa: E402

# Tied embeddings, as Llama-3.2-1B: the tensor's gradient is finished last, from two uses.
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 160,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
         "max_position_embeddings": 512, "tie_word_embeddings": True}
B, S, STEPS = 2, 64, 3
# Below this a storage is a scalar of DeepSpeed's bookkeeping (norms, overflow flags, loss scale): the small pool
# serves them, and the replay leaves them out.
SCALAR_BYTES = 512


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("reserved_zero") / "config.json"
    path.write_text(json.dumps(LLAMA))
    return str(path)


def _spec(path: str, method: str, world: int, training: TrainingSpec, bucket: int, overlap: bool = False) -> RunSpec:
    zero = ZeroSpec(reduce_bucket_size=bucket, allgather_bucket_size=bucket, overlap_comm=overlap)
    return RunSpec(model=path, training=training, parallel=ParallelSpec(method=method, world_size=world, zero=zero))


def _generated(spec: RunSpec, rank: int) -> list[tuple]:
    training = spec.training
    arch, profile = api.load_model_profile(spec.model, training, 1,
                                           adapters_16bit=adapters_in_16bit(training, spec.parallel.method))
    table, regime = api._param_table(profile, arch.num_layers), api._regime(profile, B, S)
    expansion = reserved_rank._expansion(regime["events"], arch.num_layers, training.loop)
    plan = reserved_rank._plan(spec, regime["events"], expansion, table, arch.num_layers, B, S,
                               workspace_bytes=8 << 20, workspaces=0, rank=rank)
    setup = reserved_rank._setup(profile, table, arch.num_layers, spec.parallel.method, False,
                                 spec.parallel.world_size, spec)
    return generated_requests(setup, plan, training)


def generated_requests(setup, plan, training: TrainingSpec) -> list[tuple]:
    """The setup's allocations and frees (module buffers left out, as the real-run recorder leaves them), then
    ``STEPS`` steps of the plan."""
    frees = dict(setup.frees_after)
    out: list[tuple] = []
    for i, (name, n) in enumerate(setup.allocations):
        if not name.startswith("buffers"):
            out.append(("alloc", ("setup", i), n, 0))
        out.extend(("free", ("setup", j)) for j in frees.get(i, ()))
    return out + run_requests(plan, STEPS, training.grad_accum_steps)


def _real_zero_events(config: dict, spec: RunSpec, rank: int, marked: bool = False) -> list[tuple]:
    """Rank ``rank`` of a real DeepSpeed run on CPU (fake process group): setup and ``STEPS`` steps; storages on
    the meta device (DeepSpeed's shape bookkeeping) and the module buffers left out. ``marked``: a ``("step",)``
    event before each step, and each allocation's stream as a GPU run would make it (``_StreamMarks``)."""
    import torch
    from transformers import masking_utils

    from estimator.profiler import build
    from estimator.profiler.trace import StorageRecorder
    from harness import distributed
    from harness.methods import deepspeed as ds_method
    from harness.methods.base import WrapContext
    from harness.options import HarnessOptions

    class Recorder(StorageRecorder):
        def track(self, tensor):
            if tensor.device.type != "meta":
                super().track(tensor)

    orig = masking_utils._ignore_causal_mask_sdpa
    masking_utils._ignore_causal_mask_sdpa = lambda padding_mask, *a, **k: orig(None, *a, **k)
    build_on_device = ds_method.build_on_device

    def built_then_marked(ctx, training):
        model = build_on_device(ctx, training)
        rec.mark("built")
        return model

    ds_method.build_on_device = built_then_marked
    streams = _StreamMarks(lambda label: rec.mark(label)) if marked else None
    world = spec.parallel.world_size
    device = torch.device("cpu")
    dist_ctx = distributed.init(method=spec.parallel.method, rank=rank, world_size=world, local_rank=0,
                                device=device, emulated=True)
    rec = Recorder()
    try:
        with rec:
            trainer = ds_method.wrap(WrapContext(spec=spec, options=HarnessOptions(), dist=dist_ctx, config=config))
            buffers = {rec.sid(b.untyped_storage()) for b in trainer.engine.module.buffers()}
            for _ in range(STEPS):
                rec.mark("step")
                for _micro in range(spec.training.grad_accum_steps):
                    batch = build.synthetic_batch(B, S, config["vocab_size"])
                    loss = trainer.forward(batch)
                    trainer.backward(loss)  # DeepSpeed's step() off the boundary, as the harness calls it
                    del loss
                trainer.step()
            trainer.close()
    finally:
        if streams is not None:
            streams.restore()
        masking_utils._ignore_causal_mask_sdpa = orig
        ds_method.build_on_device = build_on_device
        distributed.teardown()
    out: list[tuple] = []
    sizes = rec.timeline.sizes
    small = {sid for sid, n in sizes.items() if n < SCALAR_BYTES} | buffers
    # The construction's own transients (a tied head made, then replaced by the embedding) are the single-GPU
    # setup's business (tests/estimator/test_reserved.py), not DeepSpeed's.
    built = rec.timeline.events.index(("m", "built"))
    small |= {event[1] for event in rec.timeline.events[:built] if event[0] == "f"}
    stream = 0
    for event in rec.timeline.events:
        if event[0] == "m" and event[1] == "step" and marked:
            out.append(("step",))
        if event[0] == "m" and event[1].startswith("stream:"):
            stream = int(event[1].split(":")[1])
        if event[0] == "m" or event[1] in small:
            continue
        if event[0] == "a":
            out.append((True, event[1], event[2], stream) if marked else (True, event[1], event[2]))
        else:
            out.append((False, event[1], sizes[event[1]]))
    return out


class _StreamMarks:
    """DeepSpeed's ``with get_accelerator().stream(s)`` blocks marked in the recording, by call site (the CPU
    accelerator has no streams: every ``s`` is None): stage 3's reduce-and-partition stream (1, as
    ``estimator.reserved.zero.REDUCTION``) and the parameter coordinator's allgather stream (2, as
    ``estimator.reserved.zero3.ALLGATHER``); ``stream:0`` when the block ends."""

    FILES = {"stage3.py": 1, "partitioned_param_coordinator.py": 2}

    def __init__(self, mark) -> None:
        import contextlib
        import sys

        from deepspeed.accelerator import get_accelerator

        self.cls = type(get_accelerator())
        self.original = self.cls.stream
        files = self.FILES

        @contextlib.contextmanager
        def stream(_self, _stream):
            caller = sys._getframe(2).f_code.co_filename.rsplit("/", 1)[-1]
            mark(f"stream:{files.get(caller, 0)}")
            try:
                yield
            finally:
                mark("stream:0")

        self.cls.stream = stream

    def restore(self) -> None:
        self.cls.stream = self.original


def _requests(stream: list[tuple], generated: bool) -> list[tuple]:
    """Allocator requests on one stream (a CPU run has one: the reduction stream's share of ``overlap_comm`` is
    DeepSpeed's reading, not this test's), scalars left out (the generated stream's own: the loss and its kin)."""
    out: list[tuple] = []
    scalars: set = set()
    for event in stream:
        if generated:
            if event[0] == "alloc" and event[2] < SCALAR_BYTES:
                scalars.add(event[1])
            elif event[0] == "alloc":
                out.append((*event[:3], 0))
            elif event[1] not in scalars:
                out.append(event)
        else:
            out.append(("alloc", event[1], event[2], 0) if event[0] else ("free", event[1]))
    return out


def _phases(requests: list[tuple], setup_end: int) -> tuple[list[int], list[int]]:
    """(the setup's allocation sizes in order, every step's allocation sizes sorted)."""
    sizes = [r[2] for r in requests if r[0] == "alloc"]
    return sizes[:setup_end], sorted(sizes[setup_end:])


def _in_fresh_process(fn, *args):
    from tests.estimator.test_reserved import _in_fresh_process as run

    return run(fn, *args)


CASES = [
    ("zero2", 4, 3, "mixed_bf16", 20_000),   # several flushes; the embedding oversized
    ("zero1", 4, 0, "mixed_bf16", 20_000),
    ("zero2", 2, 0, "mixed_bf16", 500_000_000),  # DeepSpeed's default bucket: one flush
    ("zero2-overlap", 4, 1, "mixed_bf16", 20_000),  # two buckets; reductions in the hooks
    ("zero2-accum3", 2, 0, "mixed_bf16", 20_000),  # three micro-steps per optimizer step
    ("zero1-accum3", 2, 1, "mixed_bf16", 20_000),  # reduced at the boundary only; the bucket lives the cycle
    ("zero2-lora", 2, 1, "mixed_bf16", 20_000),  # the base model, then peft's fp32 adapters cast to 16 bits
    pytest.param("zero1-lora", 3, 2, "fp32", 20_000, marks=pytest.mark.slow),  # fp32 adapters: no cast
    pytest.param("zero2-lora-accum2", 4, 0, "mixed_bf16", 500_000_000, marks=pytest.mark.slow),
    pytest.param("zero2-overlap-accum2", 3, 2, "fp32", 500_000_000, marks=pytest.mark.slow),
    pytest.param("zero1-overlap", 4, 3, "mixed_bf16", 20_000, marks=pytest.mark.slow),
    pytest.param("zero2", 4, 1, "fp32", 20_000, marks=pytest.mark.slow),
    pytest.param("zero2", 3, 2, "mixed_bf16", 20_000, marks=pytest.mark.slow),  # the last rank: padded
    pytest.param("zero1", 4, 0, "fp32", 20_000, marks=pytest.mark.slow),  # one piece: flattened as a view
    pytest.param("zero1", 3, 1, "fp32", 500_000_000, marks=pytest.mark.slow),  # padded partitions
    pytest.param("zero1-accum2", 4, 3, "fp32", 500_000_000, marks=pytest.mark.slow),
    pytest.param("zero1-lora-accum2", 3, 0, "mixed_bf16", 20_000, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("method, world, rank, precision, bucket", CASES)
def test_generated_stream_matches_a_real_deepspeed_run(llama_path, method, world, rank, precision, bucket):
    """Setup (the model, DeepSpeed's flat buffer and master partition) allocation for allocation; three steps
    with the same tensors (sizes), the same requested peak and the same reserved peak through the allocator
    model. Where a gradient's hook runs among backward's nodes is the one thing placed by rule (after the node
    that made it released its inputs): autograd may run another ready node first, which moves that gradient's
    free by a node or two."""
    from estimator.allocator.requests import simulate
    from estimator.reserved.timeline import live_requested_peak

    training = TrainingSpec(precision=precision, attn="eager", micro_batch_size=B, seq_len=S)
    method, *options = method.split("-")
    accum = next((int(o[len("accum"):]) for o in options if o.startswith("accum")), 1)
    training = dataclasses.replace(training, grad_accum_steps=accum, lora_rank=8 if "lora" in options else 0,
                                   lora_targets="all-linear")
    spec = _spec(llama_path, method, world, training, bucket, overlap="overlap" in options)
    generated = _requests(_generated(spec, rank), True)
    real = _requests(_in_fresh_process(_real_zero_events, LLAMA, spec, rank), False)
    setup = sum(1 for name, _ in _setup_of(spec).allocations if not name.startswith("buffers"))
    assert _phases(generated, setup) == _phases(real, setup)
    assert live_requested_peak(generated) == live_requested_peak(real)
    assert simulate(generated)["peak_reserved_bytes"] == simulate(real)["peak_reserved_bytes"]
    # and the estimate's allocated level (LoRA: DeepSpeed casts peft's fp32 adapters to 16 bits; with fp32 ones
    # the estimate was 13 % over, Finding 14 of docs/error_matrix/README.md)
    est = api.estimate(spec)  # a middle rank the estimate does not report: its worst
    traced = next((r for r in est.ranks if r.rank == rank), max(est.ranks, key=lambda r: r.traced_allocated_bytes)
                  ).traced_allocated_bytes
    assert abs(traced - live_requested_peak(real)) / live_requested_peak(real) < 0.01


def _setup_of(spec: RunSpec):
    arch, profile = api.load_model_profile(spec.model, spec.training, 1,
                                           adapters_16bit=adapters_in_16bit(spec.training, spec.parallel.method))
    table = api._param_table(profile, arch.num_layers)
    return reserved_rank._setup(profile, table, arch.num_layers, spec.parallel.method, False,
                                spec.parallel.world_size, spec)
