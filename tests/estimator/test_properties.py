"""Property tests over the spec space: only clean one-line errors, and memory is monotone."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from estimator.api import estimate
from estimator.spec import ATTENTIONS, METHODS, OPTIMIZERS, PRECISIONS, ParallelSpec, RunSpec, TrainingSpec

MODEL = "facebook/opt-125m"
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _build(kwargs):
    try:
        return RunSpec(model=kwargs.pop("model"), gpu=kwargs.pop("gpu"),
                       parallel=ParallelSpec(method=kwargs.pop("method"), world_size=kwargs.pop("world"),
                                             tp=kwargs.pop("tp")), training=TrainingSpec(**kwargs))
    except ValueError as err:
        assert ":" in str(err) and "\n" not in str(err)
        return None


@SETTINGS
@given(st.fixed_dictionaries({
    "model": st.sampled_from([MODEL, "nope/model", ""]), "gpu": st.sampled_from(["h100-80gb", "A100", "x"]),
    "method": st.sampled_from(METHODS + ("bad",)), "world": st.integers(-1, 16), "tp": st.integers(0, 8),
    "micro_batch_size": st.integers(-1, 64), "seq_len": st.integers(-1, 4096),
    "precision": st.sampled_from(PRECISIONS), "optimizer": st.sampled_from(OPTIMIZERS),
    "attn": st.sampled_from(ATTENTIONS), "grad_ckpt": st.booleans(), "lora_rank": st.integers(-1, 16),
}))
def test_only_clean_errors(kwargs):
    spec = _build(dict(kwargs))
    if spec is None:
        return
    try:
        est = estimate(spec, allow_build=False)
    except ValueError as err:
        assert ":" in str(err) and "\n" not in str(err)
        return
    assert est.peak_allocated_bytes > 0


@SETTINGS
@given(st.sampled_from(["single", "ddp", "zero1", "zero2", "zero3", "fsdp"]), st.integers(1, 16),
       st.integers(16, 1024), st.booleans())
def test_more_batch_or_seq_never_less_memory(method, batch, seq, ckpt):
    world = 1 if method == "single" else 4
    base = RunSpec(model=MODEL, parallel=ParallelSpec(method=method, world_size=world),
                   training=TrainingSpec(micro_batch_size=batch, seq_len=seq, grad_ckpt=ckpt))
    est = estimate(base)
    for bigger in (base.replace(**{"training.micro_batch_size": batch + 1}),
                   base.replace(**{"training.seq_len": seq + 64})):
        other = estimate(bigger)
        assert other.traced_allocated_bytes >= est.traced_allocated_bytes
        # The allocator's block rounding is not monotone (a larger tensor may fit its block more tightly), as
        # on the GPU: the allocated level may dip, by no more than the smaller run's rounding.
        assert other.peak_allocated_bytes >= est.peak_allocated_bytes - est.breakdown.get("allocator_rounding", 0)


@SETTINGS
@given(st.sampled_from(["zero3", "fsdp"]), st.integers(2, 64))
def test_more_ranks_never_more_model_state(method, world):
    def model_state(n):
        est = estimate(RunSpec(model=MODEL, parallel=ParallelSpec(method=method, world_size=n)))
        return sum(est.breakdown.get(k, 0) for k in ("weights", "optimizer_states", "master_weights"))
    assert model_state(world + 1) <= model_state(world)
