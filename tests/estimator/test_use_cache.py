"""``TrainingSpec.use_cache``: the model's key/value cache left on in training, traced with the model code that ran."""

import dataclasses

import pytest

from estimator.columns import spec_columns, spec_from_columns
from estimator.models.profiles import profile_key
from estimator.spec import RunSpec, TrainingSpec


def test_off_by_default_keeps_spec_ids_profile_keys_and_older_tables():
    plain = RunSpec()
    assert TrainingSpec().use_cache is False
    assert dataclasses.replace(plain, training=TrainingSpec(use_cache=False)).spec_id == plain.spec_id
    on = RunSpec(training=TrainingSpec(use_cache=True))
    assert on.spec_id != plain.spec_id
    assert profile_key("abc", TrainingSpec(use_cache=True)) == profile_key("abc", TrainingSpec()) + "_kvcache"
    row = {k: ("" if v is None else str(v)) for k, v in spec_columns(on).items()}
    row["world_size"] = "1"
    assert spec_from_columns(row).training.use_cache is True
    del row["use_cache"]  # a table written before the column: the default
    assert spec_from_columns(row).training.use_cache is False
    with pytest.raises(ValueError, match="^use_cache: must be true or false"):
        TrainingSpec(use_cache="yes")


def _santacoder(use_cache: bool, batch: int = 8) -> RunSpec:
    return RunSpec(model="bigcode/gpt_bigcode-santacoder", gpu="a100-80gb", training=TrainingSpec(
        micro_batch_size=batch, seq_len=2048, precision="bf16", attn="flash", grad_ckpt=True, model_code="4.45",
        use_cache=use_cache))


def test_gpt_bigcode_keeps_every_layer_s_fused_qkv_output_until_the_loss():
    """transformers 4.45's GPTBigCode never turns the cache off under checkpointing: each layer's present
    key/value is a view of its c_attn output (embed + 2 x kv_dim columns), which lives until the forward returns.
    The shipped 4.45 profiles hold exactly that much more at the forward's peak, no torch needed."""
    from estimator.api import estimate
    from estimator.models.arch import resolve_arch

    arch = resolve_arch("bigcode/gpt_bigcode-santacoder")
    assert arch.num_kv_heads == 1  # multi-query: one key and one value head beside the queries
    fused_qkv = 8 * 2048 * (arch.hidden_size + 2 * arch.head_dim) * 2
    off, on = (estimate(_santacoder(flag), allow_build=False) for flag in (False, True))
    assert on.phase.startswith("forward") and off.phase.startswith("forward")
    assert on.peak_allocated_bytes - off.peak_allocated_bytes == pytest.approx(arch.num_layers * fused_qkv,
                                                                               rel=0.02)


def test_a_manual_loop_frees_the_previous_step_s_per_layer_cache_in_the_replay():
    """A manual loop keeps the output object, and with it one cache tensor per layer, until the next forward:
    the reserved replay frees every layer's copy there (it replays instead of falling back to the prior)."""
    from estimator.api import estimate
    from estimator.models.arch import resolve_arch

    spec = RunSpec(model="meta-llama/Llama-3.2-3B", gpu="l40s-48gb", training=TrainingSpec(
        micro_batch_size=4, seq_len=768, precision="bf16", attn="sdpa", lora_rank=32, lora_targets="q_proj,v_proj",
        loop="manual", batch="padded", model_code="4.52", use_cache=True))
    est = estimate(spec, allow_build=False)
    assert est.reserved_source == "replayed"
    off = estimate(dataclasses.replace(spec, training=dataclasses.replace(spec.training, use_cache=False)),
                   allow_build=False)
    # 4.52 appends each layer's unrepeated post-RoPE keys and values, which SDPA (after repeat_kv) does not save
    arch = resolve_arch(spec.model)
    keys_and_values = arch.num_layers * 2 * 4 * 768 * arch.num_kv_heads * arch.head_dim * 2
    assert est.peak_allocated_bytes - off.peak_allocated_bytes == pytest.approx(keys_and_values, rel=0.05)


def test_the_caches_freed_as_the_loop_drops_the_outputs_are_every_layer_s():
    """The trainer loop drops the output object before backward, and with it every layer's cache: at micro-batch
    4 the peak stays the optimizer step's, as without the cache (the traced step freed three layers' caches
    there; the estimate frees all 24, not 3 of them, leaving 21 alive to the optimizer step)."""
    from estimator.api import estimate

    off, on = (estimate(_santacoder(flag, batch=4), allow_build=False) for flag in (False, True))
    assert off.phase.startswith("optimizer") and on.phase.startswith("optimizer")
    assert on.peak_allocated_bytes == pytest.approx(off.peak_allocated_bytes, rel=1e-3)  # not 21 layers more


def test_at_depth_adds_the_outer_segments_per_layer_share_for_every_generic_layer():
    from estimator.methods.timeline import PROFILED_LAYERS, at_depth, poly

    zero = [0.0] * 6
    per_token = [0.0, 0.0, 0.0, 0.0, 1.0, 0.0]  # b x s bytes
    segments = {"prefix": {"net_act": zero, "net_grad": 0.0, "candidates": [(zero, 0.0)]},
                "mid_fw": {"net_act": [0.0, 0.0, 0.0, 0.0, -3.0, 0.0], "net_grad": 0.0,
                           "candidates": [(zero, 0.0), ([0.0, 0.0, 0.0, 0.0, -3.0, 0.0], 0.0)],
                           "per_layer_act": [-x for x in per_token],
                           "candidates_per_layer": [zero, [-x for x in per_token]]}}
    assert at_depth(segments, PROFILED_LAYERS) is segments
    deep = at_depth(segments, 24)
    assert poly(deep["mid_fw"]["net_act"], 2, 10) == -24 * 2 * 10
    assert [poly(act, 2, 10) for act, _ in deep["mid_fw"]["candidates"]] == [0.0, -24 * 2 * 10]
    assert deep["prefix"] is segments["prefix"]
    pytest.importorskip("torch")
    from estimator.profiler.profile import PROFILE_LAYERS

    assert PROFILE_LAYERS == PROFILED_LAYERS


def test_the_flag_reaches_the_spec_with_or_without_configs():
    from estimator.configs import spec_from_readings
    from estimator.io.cli import build_parser

    spec, report = spec_from_readings([], {"model": "meta-llama/Llama-3.2-1B", "use_cache": True})
    assert spec.training.use_cache is True
    assert any(line.startswith("use_cache = True") for line in report.used)
    args = build_parser().parse_args(["--model", "meta-llama/Llama-3.2-1B", "--use-cache"])
    assert args.use_cache is True
    assert build_parser().parse_args(["--model", "meta-llama/Llama-3.2-1B"]).use_cache is None
