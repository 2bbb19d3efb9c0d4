"""ZeRO-3 with LoRA and non-reentrant checkpointing: the allgather stream's recomputation
(``estimator.reserved.zero3_gathers``: ``update_recompute_parameters`` ties the frozen weights a recomputation
fetches to the backward module that triggered it; a trainable weight the recomputation saved keeps its gathered
storage until its backward; ``enable_input_require_grads`` puts the embedding and the first layer in backward),
against real DeepSpeed 0.19 runs on CPU whose allocations are marked with the stream a GPU run makes them on
(``benchmarks/zero3_ckpt_replay.py --lora --ckpt ckpt``; the table: docs/error_matrix/zero3_lora_ckpt_cpu.csv).
The fast tests build a 2-layer peft Llama table (no torch); the slow one runs DeepSpeed."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from estimator.reserved.zero3_gathers import emulate, modules_of
from tests.estimator.test_zero3_lora import _peft_llama, lora_zero3_spec

WORLD = 4
BOTH = frozenset({0, 1})


def _layer(name: str) -> str:
    return f"base_model.model.model.layers.1.{name}"


def _gathered(ops, step: int) -> Counter:
    return Counter(n for c in ops.calls[step] if c[0] == "G" for n in c[1])


def test_checkpointing_puts_the_embedding_and_the_first_layer_in_backward():
    """peft turns on ``enable_input_require_grads`` under checkpointing: the frozen embedding's output needs a
    gradient, so DeepSpeed hooks its backward and that of what reads it (the first layer's input norm, k_proj,
    q's and v's base layers)."""
    table = _peft_llama()
    plain = {m.name for m in modules_of(table)[1]}
    hooked = {m.name for m in modules_of(table, inputs_need_grad=True)[1]}
    first = "base_model.model.model.layers.0."
    wanted = {"base_model.model.model.embed_tokens", first + "input_layernorm", first + "self_attn.k_proj",
              first + "self_attn.q_proj.base_layer"}
    assert wanted <= hooked - plain
    assert plain <= hooked


def test_a_recomputation_ties_its_frozen_weights_to_the_module_that_triggered_it():
    """From the second step forward keeps every weight to its backward (``stage3_max_reuse_distance``); under
    checkpointing the trigger's (down_proj's) backward release drops every frozen weight the layer's
    recomputation fetched, so each one but down_proj's is gathered again for its own backward: twice per step,
    the trainable adapters once."""
    table = _peft_llama()
    plain, ckpt = (_gathered(emulate(table, WORLD, steps=2, persistence=0, checkpointed=c), 1)
                   for c in (frozenset(), BOTH))
    frozen = [p.name for p in table if p.layer == 1 and not p.trainable]
    assert all(plain[n] == 1 for n in frozen)
    assert {n: ckpt[n] for n in frozen} == {n: 1 if "down_proj" in n else 2 for n in frozen}
    assert all(ckpt[p.name] == 1 for p in table if p.layer == 1 and p.trainable)


def test_the_tie_releases_at_the_triggers_backward_release():
    """The tied weights are released right after the recomputation ends (down_proj's backward release), before
    the next backward module (up_proj) fetches anything."""
    ops = emulate(_peft_llama(), WORLD, steps=2, persistence=0, checkpointed=BOTH)
    calls = ops.calls[1]
    down = calls.index(("R", _layer("mlp.down_proj.weight")))
    regather = next(k for k, c in enumerate(calls) if c == ("G", (_layer("mlp.up_proj.weight"),)))
    released = {c[1] for c in calls[down:regather] if c[0] == "R"}
    assert {_layer("self_attn.k_proj.weight"), _layer("mlp.gate_proj.weight"),
            _layer("self_attn.q_proj.base_layer.weight")} <= released


def test_a_recomputed_adapter_keeps_its_storage_until_its_backward():
    """In the trace-recording step every module releases its weights after its forward, the recomputation's too;
    a trainable weight's gathered storage stays though (the checkpoint saved a detached alias of it), freed at
    its module's backward, after its backward gather: lora_B's recomputed copy and its backward copy live
    together."""
    ops = emulate(_peft_llama(), WORLD, steps=2, persistence=0, checkpointed=BOTH)
    b_bytes = next(-(-p.numel // WORLD) * WORLD * p.elem_bytes for p in _peft_llama()
                   if p.name == _layer("self_attn.v_proj.lora_B.default.weight"))
    live, most = set(), 0
    for sign, buffer, nbytes in ops.steps[0]:
        if nbytes != b_bytes:
            continue
        (live.add if sign > 0 else live.discard)(buffer)
        most = max(most, len(live))
    plain = emulate(_peft_llama(), WORLD, steps=2, persistence=0)
    assert most >= 2
    assert len(ops.steps[0]) > len(plain.steps[0])


def test_zero3_lora_with_checkpointing_refusals():
    from estimator.reserved.zero3 import why_not_zero3
    spec = lora_zero3_spec
    assert "reentrant" in why_not_zero3(spec(grad_ckpt=True, ckpt_reentrant=True))
    assert "optimizer offload" in why_not_zero3(spec(offload=True, grad_ckpt=True))


@pytest.mark.slow
@pytest.mark.parametrize("targets", ["q_proj,v_proj", "all-linear"])
def test_the_checkpointed_lora_runs_allgather_stream_is_generated(tmp_path, targets):
    """A real run (tiny Llama hidden 64, LoRA r8 on q/v or on every Linear, full non-reentrant checkpointing,
    three optimizer steps), each allocation on the stream a GPU run makes it on: the allgather and reduction
    streams are the generated ones request for request (each run of frees as a set), every step."""
    pytest.importorskip("deepspeed")
    from benchmarks.zero3_ckpt_replay import (
        _config,
        _record,
        _sized,
        _spec,
        first_differences,
        generated_steps,
        recorded_steps,
    )

    config = _config(64)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    spec = _spec(str(path), config, 2, 2, 64, True, "mixed_bf16", 1, lora=True, targets=targets)
    recorded = recorded_steps(_record(tmp_path, config, spec, True))
    generated = generated_steps(spec, 2, 64, len(recorded) - 1)
    assert [len(_sized(p, 2)) for p in recorded[1:]] == [len(_sized(p, 2)) for p in generated[1:]]
    assert all(at is None for stream, _step, at, _ in first_differences(recorded, generated) if stream in (1, 2))


def _peft_llama_on_down_proj() -> list:
    """``_peft_llama`` with an adapter on each layer's ``mlp.down_proj`` too (its weight peft's ``base_layer``)."""
    import dataclasses

    out = []
    for p in _peft_llama():
        if p.name.endswith("mlp.down_proj.weight"):
            pre = p.name.removesuffix("weight")
            out += [dataclasses.replace(p, name=pre + "base_layer.weight"),
                    dataclasses.replace(p, name=pre + "lora_A.default.weight", shape=(16, p.shape[1]),
                                        numel=16 * p.shape[1], elem_bytes=4, trainable=True),
                    dataclasses.replace(p, name=pre + "lora_B.default.weight", shape=(p.shape[0], 16),
                                        numel=16 * p.shape[0], elem_bytes=4, trainable=True)]
        else:
            out.append(p)
    return out


def test_a_wrapped_mlp_output_projection_is_recomputed_at_its_lora_B():
    """peft's ``down_proj`` wrapper fetches its external ``lora_A`` but its backward unpacks nothing: the layer's
    recomputation follows ``lora_B``'s backward fetch, and the recomputed wrapper, inside which it stops, never
    releases (its hold on ``lora_A`` is the backward wrapper's: one module)."""
    from estimator.reserved.zero3_gathers import _with_external, external_params, with_recomputation

    table = _peft_llama_on_down_proj()
    forward, backward = modules_of(table, inputs_need_grad=True)
    external = external_params(forward)
    down = _layer("mlp.down_proj")
    assert external[down] == (down + ".lora_A.default.weight",)
    forward, backward = _with_external(forward, external), _with_external(backward, external)
    out, moved = with_recomputation(forward, backward, frozenset({1}), external)
    names = [m.name for m in out]
    trigger = names.index(down + ".lora_B.default")
    assert names[trigger - 1] == down and names[trigger + 1] == _layer("input_layernorm")
    assert moved[len(forward) + trigger] is not None
    at_wrapper, _ = with_recomputation(forward, backward, frozenset({1}))  # the wrapper taken for the trigger
    assert [m.name for m in at_wrapper].index(_layer("input_layernorm")) == names.index(down) + 1


def test_a_wrapped_mlp_output_projections_lora_A_is_released_once_after_its_base_layer():
    """From the second step the recomputation releases nothing of ``down_proj``'s: its ``lora_A`` goes at the
    wrapper's backward release, after ``base_layer``'s backward gather (real CPU runs:
    docs/error_matrix/zero3_lora_mlp_ckpt_cpu.csv)."""
    table = _peft_llama_on_down_proj()
    ops = emulate(table, WORLD, steps=2, persistence=0, checkpointed=BOTH)
    calls = ops.calls[1]
    lora_a, base = _layer("mlp.down_proj.lora_A.default.weight"), _layer("mlp.down_proj.base_layer.weight")
    released = [k for k, c in enumerate(calls) if c == ("R", lora_a)]
    regathered = [k for k, c in enumerate(calls) if c == ("G", (base,))]
    assert len(released) == 1 and regathered and released[0] > regathered[-1]
    # its gathered storage goes there too, not at the step's end (as a copy the recomputation saved would)
    nbytes = next(-(-p.numel // WORLD) * WORLD * p.elem_bytes for p in table if p.name == lora_a)
    last_alloc = max(k for k, op in enumerate(ops.steps[1]) if op[0] > 0)
    assert not [op for op in ops.steps[1][last_alloc:] if op[0] < 0 and op[2] == nbytes]


def test_a_wrapped_mlp_output_projections_recomputation_stops_after_lora_B_made_its_output():
    """The memory-efficient linear makes ``lora_B``'s output (in the adapter's dtype) before it saves its input,
    the layer's last: that output is the stopped recomputation's (``_recompute_output_made_then_dropped``)."""
    from estimator.reserved.zero3 import _last_projection, _stopping_linear

    plain, wrapped = _peft_llama(), _peft_llama_on_down_proj()
    assert _stopping_linear(plain, _last_projection(plain, 0)).name.endswith("mlp.down_proj.weight")
    stop = _stopping_linear(wrapped, _last_projection(wrapped, 0))
    assert stop.name.endswith("mlp.down_proj.lora_B.default.weight") and stop.elem_bytes == 4


def test_zero3_lora_on_the_mlp_with_checkpointing_is_replayed():
    """An adapter on the MLP (its output projection peft's wrapper) is replayed with checkpointing, as attention
    adapters are."""
    from estimator.reserved.zero3 import why_not_zero3

    assert why_not_zero3(lora_zero3_spec(grad_ckpt=True), _peft_llama_on_down_proj()) is None
