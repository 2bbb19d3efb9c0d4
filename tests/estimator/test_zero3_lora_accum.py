"""ZeRO-3 with LoRA: the allgather stream's peft-specific requests (``estimator.reserved.zero3_gathers``: a
coalesced gather's flat tensor per dtype, ``lora_A`` an external parameter of its wrapper) and the replay under
gradient accumulation, against real DeepSpeed 0.19 runs on CPU whose allocations are marked with the stream a GPU
run makes them on (``benchmarks/zero3_ckpt_replay.py --lora``; the table: docs/error_matrix/zero3_lora_accum_cpu.csv).
The fast tests build a 2-layer peft Llama table (no torch); the slow one runs DeepSpeed."""

from __future__ import annotations

import json

import pytest

from estimator.reserved.zero3_gathers import emulate, external_params, modules_of
from tests.estimator.test_zero3_lora import _peft_llama, lora_zero3_spec

WORLD = 4


def _wrapper(layer: int, projection: str = "q_proj") -> str:
    return f"base_model.model.model.layers.{layer}.self_attn.{projection}"


def _sizes(table) -> dict[str, int]:
    return {p.name: -(-p.numel // WORLD) * WORLD * p.elem_bytes for p in table}


def test_each_wrapper_holds_its_lora_A_as_an_external_parameter():
    """peft's LoRA forward reads ``lora_A.weight.dtype`` before lora_A runs: the wrapper owns it from then on."""
    forward, _ = modules_of(_peft_llama())
    external = external_params(forward)
    assert set(external) == {_wrapper(layer, proj) for layer in (0, 1) for proj in ("q_proj", "v_proj")}
    assert external[_wrapper(1)] == (f"{_wrapper(1)}.lora_A.default.weight",)


def test_the_first_forward_gathers_no_lora_A_on_the_allgather_stream():
    """In the trace-recording step ``ZeROOrderedDict.__getitem__`` gathers each lora_A on the default stream, so
    the allgather stream's first forward gathers every parameter but those; its backward (the wrapper's fetch)
    and every later step gather them."""
    table = _peft_llama()
    ops = emulate(table, WORLD, steps=2, persistence=0)
    lora_a = {p.name for p in table if ".lora_A." in p.name}
    forward, _ = modules_of(table)
    fetches = sum(1 for m in forward if m.params and not lora_a.issuperset(m.params))
    gathers = [c[1] for c in ops.calls[0] if c[0] == "G"]
    assert not lora_a & {n for names in gathers[:fetches] for n in names}
    assert lora_a <= {n for names in gathers[fetches:] for n in names}
    gathered_later = {n for c in ops.calls[1] if c[0] == "G" for n in c[1]}
    assert lora_a <= gathered_later


def test_a_lora_A_stays_gathered_until_its_wrappers_release():
    """``__release_param`` skips a parameter another active module holds: lora_A's own release leaves it for the
    wrapper's, which comes after lora_B's in forward (and after base_layer's in backward)."""
    table = _peft_llama()
    ops = emulate(table, WORLD, steps=2, persistence=0)
    calls = ops.calls[1]
    a, b = f"{_wrapper(1)}.lora_A.default.weight", f"{_wrapper(1)}.lora_B.default.weight"
    releases = [c[1] for c in calls if c[0] == "R"]
    assert releases.index(b) < releases.index(a)


def test_a_coalesced_gather_makes_one_flat_tensor_per_dtype():
    """``_all_gather_coalesced`` groups by dtype (``sort_dtypes``: bfloat16 before float32): a prefetch holding
    16-bit base weights and fp32 adapters allocates two flat tensors, the 16-bit one first, each the sum of its
    parameters' padded sizes."""
    table = _peft_llama()
    sizes, by_name = _sizes(table), {p.name: p for p in table}
    ops = emulate(table, WORLD, steps=2, persistence=0, prefetch_bucket=10**9)
    mixed = [c[1] for c in ops.calls[1] if c[0] == "G" and len({by_name[n].elem_bytes for n in c[1]}) == 2]
    assert mixed
    allocations = [nbytes for sign, _, nbytes in ops.steps[1] if sign > 0]
    for names in mixed:
        bf16 = sum(sizes[n] for n in names if by_name[n].elem_bytes == 2)
        fp32 = sum(sizes[n] for n in names if by_name[n].elem_bytes == 4)
        at = allocations.index(bf16)
        assert allocations[at + 1] == fp32


def test_zero3_lora_with_accumulation_or_checkpointing_is_replayed():
    from estimator.reserved.zero3 import why_not_zero3
    spec = lora_zero3_spec
    assert why_not_zero3(spec(grad_accum_steps=4)) is None
    assert why_not_zero3(spec(grad_ckpt=True)) is None  # tests/estimator/test_zero3_lora_ckpt.py
    assert "optimizer offload" in why_not_zero3(spec(offload=True, grad_accum_steps=2))


@pytest.mark.slow
@pytest.mark.parametrize("precision, world, accum", [("mixed_bf16", 2, 2), ("bf16", 4, 4)])
def test_the_accumulating_lora_run_replays_as_generated(tmp_path, precision, world, accum):
    """A real run (tiny Llama, LoRA r8 on q/v, three optimizer steps), each allocation on the stream a GPU run
    makes it on: replayed on the three streams it reserves what the generated stream reserves; its reduction
    stream is the generated one request for request, and the steps make as many requests as generated."""
    pytest.importorskip("deepspeed")
    from benchmarks.zero3_ckpt_replay import (
        _config,
        _record,
        _spec,
        first_differences,
        generated_steps,
        recorded_steps,
    )
    from estimator.allocator.requests import simulate

    config = _config(64)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    spec = _spec(str(path), config, world, 2, 64, False, precision, accum, lora=True)
    recorded = recorded_steps(_record(tmp_path, config, spec, True))
    generated = generated_steps(spec, 2, 64, len(recorded) - 1)
    flat = [[r for part in parts for r in part] for parts in (recorded, generated)]
    assert simulate(flat[0])["peak_reserved_bytes"] == simulate(flat[1])["peak_reserved_bytes"]
    # after the first optimizer step (whose first forward gathers each lora_A on the default stream, not generated)
    allocations = [[sum(r[0] == "alloc" for r in p) for p in parts[2:]] for parts in (recorded, generated)]
    assert allocations[0] == allocations[1]  # (the recording's last step ends with the engine's teardown frees)
    assert all(at is None for stream, step, at, _ in first_differences(recorded, generated)
               if stream == 1 or (stream == 2 and step > 0))
