"""ZeRO-3's gradient hooks for biased ``nn.Linear``s: DeepSpeed's memory-efficient linear
(``LinearFunctionForZeroStage3``, ``F.linear`` under ``zero.Init``) finishes a weight's gradient before its bias's,
torch's linear (the profile's step) the bias first, so the IPG bucket's flushes group one bias differently
(``estimator.reserved.zero3._Step3.hook``). Transformers' ``Conv1D`` (GPT-2) calls ``torch.addmm`` and keeps
torch's order.

The fast tests drive the pure replay; the slow one compares the reduction stream with real DeepSpeed runs on CPU
of tiny OPT, GPT-NeoX and BLOOM (``benchmarks/zero3_arch_replay.py``, ``docs/error_matrix/zero3_arch_cpu.csv``).
"""

from __future__ import annotations

import json

import pytest

from estimator.models.params import ParamInfo
from estimator.profiler.expand import alloc_on
from estimator.reserved.fsdp import _Builder
from estimator.reserved.zero import REDUCTION
from estimator.reserved.zero3 import _Step3, linear_weight_of_bias, unsaved_by_recomputation

BUCKET = 20_000


def _layer(conv1d: bool) -> list[ParamInfo]:
    """An OPT-like MLP (fc1 64 -> 256, fc2 256 -> 64, a LayerNorm), weights as a Linear ``(out, in)`` or a
    Conv1D ``(in, out)`` stores them, in ``model.parameters()`` order."""
    def p(name: str, shape: tuple, kind: str) -> ParamInfo:
        numel = shape[0] * (shape[1] if len(shape) > 1 else 1)
        return ParamInfo(name=name, shape=shape, numel=numel, elem_bytes=2, trainable=True, module_kind=kind,
                         layer=0)

    def weight(out_features: int, in_features: int) -> tuple:
        return (in_features, out_features) if conv1d else (out_features, in_features)

    return [p("layers.0.ln.weight", (64,), "norm"), p("layers.0.ln.bias", (64,), "norm"),
            p("layers.0.fc1.weight", weight(256, 64), "linear"), p("layers.0.fc1.bias", (256,), "linear"),
            p("layers.0.fc2.weight", weight(64, 256), "linear"), p("layers.0.fc2.bias", (64,), "linear")]


def _flush_elements(table: list[ParamInfo], hooked: list[str]) -> list[int]:
    """Elements of each flush's concatenation on the reduction stream, the gradients hooked in ``hooked``'s
    order (torch's: each Linear's bias before its weight)."""
    build = _Builder(0, 0)
    grad_of = {id(p): (1000 + k, 0) for k, p in enumerate(table)}
    step = _Step3(build, table, 2, 2, BUCKET, grad_of, True, "adamw")
    by_name = {p.name.rsplit(".", 2)[-2] + "." + p.name.rsplit(".", 1)[-1]: p for p in table}
    out: list = []
    for name in hooked:
        step.hook(out, by_name[name])
    step.epilogue(out)
    return [build.sizes[op[2]] // 2 for op in out if op[0] == alloc_on(REDUCTION)]


TORCH_ORDER = ["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight", "ln.weight", "ln.bias"]


def test_a_linears_bias_joins_the_flush_after_its_weight():
    # weight first: fc2's 16,384 + 64, then fc1's weight overflows the 20,000-element bucket
    assert _flush_elements(_layer(conv1d=False), TORCH_ORDER) == [16_448, 16_384 + 256 + 128]


def test_a_conv1d_keeps_torchs_order():
    # torch's order: fc1's bias joins fc2's flush before fc1's weight overflows it
    assert _flush_elements(_layer(conv1d=True), TORCH_ORDER) == [64 + 16_384 + 256, 16_384 + 128]


def test_a_recomputation_saves_a_linears_bias_not_a_conv1ds():
    """A checkpointed layer's recomputation saves what backward reads: the memory-efficient linear its input,
    weight and bias, ``torch.addmm`` (a Conv1D) its two matrices only, so a Conv1D's bias gathered by the
    recomputation goes at its release; with it, a tiny GPT-2's allgather stream is a real run's
    (``zero3_arch_ckpt_cpu.csv``). In the emulation: the bias's gathered copy freed at the recomputed module's
    release, not at its backward's."""
    from estimator.reserved.zero3_gathers import Module, recomputed_before_fetch

    assert unsaved_by_recomputation(_layer(conv1d=False)) == frozenset()
    assert unsaved_by_recomputation(_layer(conv1d=True)) == {"layers.0.fc1.bias", "layers.0.fc2.bias"}
    table = _layer(conv1d=True)
    forward = [Module("layers.0", ()), Module("layers.0.ln", ("layers.0.ln.weight", "layers.0.ln.bias")),
               Module("layers.0.fc1", ("layers.0.fc1.weight", "layers.0.fc1.bias")),
               Module("layers.0.fc2", ("layers.0.fc2.weight", "layers.0.fc2.bias"))]
    backward = [Module("layers.0", ()), *reversed(forward[1:])]
    trace, owners = recomputed_before_fetch(forward, backward, frozenset({0}))
    assert [m.name for m in trace] == ["layers.0", "layers.0.ln", "layers.0.fc1", "layers.0.fc2", "layers.0.fc2",
                                       "layers.0.fc1", "layers.0.ln"]
    assert owners == {5: 8, 6: 8, 7: 8}

    from estimator.reserved.zero3_gathers import emulate

    recorded = ([(m.name, m.params, 1) for m in forward], [m.name for m in backward])

    def most_bias_copies(unsaved: frozenset[str]) -> int:
        """The most gathered copies of fc1's bias (256 16-bit elements, its own storage) live at once."""
        ops = emulate(table, 2, steps=1, persistence=1, checkpointed=frozenset({0}), recorded=recorded,
                      dropped_out=True, unsaved=unsaved)
        live, most = 0, 0
        for sign, _, nbytes in ops.steps[0]:
            if nbytes == 256 * 2:
                live += sign
                most = max(most, live)
        return most

    assert most_bias_copies(frozenset()) == 2  # the recomputation's copy kept beside the backward's
    assert most_bias_copies(unsaved_by_recomputation(table)) == 1


def test_the_biased_linears_of_the_shipped_profiles():
    from estimator import api
    from estimator.spec import TrainingSpec

    training = TrainingSpec(precision="mixed_bf16", micro_batch_size=2, seq_len=1024)
    for model, per_layer in (("facebook/opt-1.3b", 6), ("EleutherAI/pythia-1b", 4), ("bigscience/bloom-1b1", 4)):
        arch, profile = api.load_model_profile(model, training, 1, allow_build=False)
        table = api._param_table(profile, arch.num_layers)
        weights = list(linear_weight_of_bias(table).values())
        assert len(weights) == per_layer * arch.num_layers, model  # every decoder Linear; no norm, no head
        assert all(w.layer is not None and w.module_kind == "linear" for w in weights), model


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["opt", "gpt_neox", "bloom", "gpt2"])
def test_the_reduction_stream_is_a_real_runs(tmp_path, arch):
    """A real DeepSpeed ZeRO-3 run on CPU of a tiny model (rank 0 of 2, three steps): the generated reduction
    and allgather streams are the run's, request by request, in every step."""
    pytest.importorskip("deepspeed")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import zero3_arch_replay

    row = zero3_arch_replay.point(tmp_path, arch, 2)
    assert row["source"] == "replayed"
    assert [d for d in json.loads(row["first_differences"]) if d[0] in (1, 2)] == []
    assert row["recorded_three_streams_mib"] == row["generated_three_streams_mib"]
