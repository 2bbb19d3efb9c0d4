"""LoRA on the routed experts past dense first layers under the multi-rank methods (issue 17): the forward-only
first layers run in the prefix under ddp, ZeRO-1/2/3 and FSDP2 too. Sharded states count every layer's
parameters; ZeRO-3 and FSDP2 gather each forward-only layer in the prefix and never again; the refusal that stays
(tp, pp, cp) comes from the config, before any trace; adapters on the fused experts cannot run at all under ep or
FSDP1 (peft's wrapper), refused for that. No torch: tables and segments built here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from estimator.models.params import ParamInfo
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec, ZeroSpec
from tests.estimator.test_moe_lora import _segments as segments_of_ten_byte_layers

ROOT = Path(__file__).resolve().parents[2]
DEEPSEEK = ROOT / "benchmarks" / "configs" / "deepseek_v2_tiny.json"
EXPERTS = "gate_proj,up_proj,down_proj"


def _table(dense_adapter: bool) -> list[ParamInfo]:
    """A 4-layer model: a dense first layer (its MLP with a LoRA adapter or none), then 3 expert layers whose
    experts carry adapters (``target_parameters``); frozen embeddings and head."""
    rows = [ParamInfo("model.embed_tokens.weight", (100, 8), 800, 2, False, "embedding", None)]
    rows += [ParamInfo("model.layers.0.self_attn.q_proj.weight", (8, 8), 64, 2, False, "linear", 0),
             ParamInfo("model.layers.0.mlp.gate_proj.weight", (32, 8), 256, 2, False, "linear", 0)]
    if dense_adapter:
        rows.append(ParamInfo("model.layers.0.mlp.gate_proj.lora_A.default.weight", (2, 8), 16, 2, True, "linear", 0))
    for i in (1, 2, 3):  # attention, the fused experts with their adapter, an fp32 router (DeepSeek's)
        rows += [ParamInfo(f"model.layers.{i}.self_attn.q_proj.weight", (8, 8), 64, 2, False, "linear", i),
                 ParamInfo(f"model.layers.{i}.mlp.experts.gate_up_proj", (4, 16, 8), 512, 2, False, "other", i),
                 ParamInfo(f"model.layers.{i}.mlp.experts.lora_A.default.weight", (8, 8), 64, 2, True, "other", i),
                 ParamInfo(f"model.layers.{i}.mlp.gate.weight", (4, 8), 32, 4, False, "other", i)]
    return rows + [ParamInfo("lm_head.weight", (100, 8), 800, 2, False, "linear", None)]


def test_the_forward_only_layers_are_read_off_the_parameter_table():
    from estimator.models.params import forward_only_layers

    assert forward_only_layers(_table(dense_adapter=False)) == 1
    assert forward_only_layers(_table(dense_adapter=True)) == 0
    trained_embeddings = [ParamInfo(p.name, p.shape, p.numel, p.elem_bytes, True, p.module_kind, p.layer)
                          if p.module_kind == "embedding" else p for p in _table(dense_adapter=False)]
    assert forward_only_layers(trained_embeddings) == 0  # backward reaches layer 0 through the embeddings' input


def test_a_layer_without_gradients_keeps_the_recorded_backward_order():
    """ZeRO-1/2 reduce in the order backward finishes the gradients: a forward-only dense layer has none, and the
    expert layers keep the recorded order (it was dropped for the whole model before)."""
    from estimator.models.params import backward_order

    row = {"shape": [8, 8], "numel": 64, "elem_bytes": 2, "kind": "other", "tied": []}
    dense = [{**row, "name": "mlp.gate_proj.weight", "trainable": False}]
    experts = [{**row, "name": "mlp.experts.lora_A", "trainable": True},
               {**row, "name": "mlp.experts.lora_B", "trainable": True}]
    params = {"layer_prefix": "model.layers", "non_layer": [], "per_layer": experts,
              "layer_kinds": {"rows": [dense, experts], "of_layer": [0, 1, 1, 1]},
              "grad_order": [[2, "mlp.experts.lora_B"], [2, "mlp.experts.lora_A"],
                             [1, "mlp.experts.lora_B"], [1, "mlp.experts.lora_A"],
                             [0, "mlp.experts.lora_B"], [0, "mlp.experts.lora_A"]]}
    order = backward_order(params, 4)
    assert [key for key, _ in sorted(order.items(), key=lambda kv: kv[1])] == [
        (3, "mlp.experts.lora_B"), (3, "mlp.experts.lora_A"), (2, "mlp.experts.lora_B"), (2, "mlp.experts.lora_A"),
        (1, "mlp.experts.lora_B"), (1, "mlp.experts.lora_A")]


def test_zero3_gathers_a_forward_only_layer_in_the_prefix_and_never_keeps_it():
    """ZeRO-3's gathered parameters per (segment, repetition): the layer segments stand for layers 2-4 (1-based).
    A layer is held from its forward to its backward only where backward runs it: not the dense layer (320
    elements), gathered once in the prefix; in layer 2 (the first backward reaches) only the experts (576 of 672:
    its attention and router read an input without a gradient). The frozen, untied embedding (800) is released
    after its forward too; the head (800) is used again by backward."""
    from estimator.methods.state import _zero3_gathered

    zero = ZeroSpec(stage3_param_persistence_threshold=10, stage3_prefetch_bucket_size=100,
                    stage3_max_live_parameters=10**9)
    frozen = _zero3_gathered(zero, _table(dense_adapter=False), 2)
    trained = _zero3_gathered(zero, _table(dense_adapter=True), 2)
    embed, dense, adapter, layer, experts, head, bucket = 800, 320, 16, 672, 576, 800, 100
    assert frozen("fw_first", 0) == 2 * (layer + bucket)  # layer 2 runs whole in forward, nothing held before it
    assert trained("fw_first", 0) == 2 * (dense + adapter + bucket)  # layer 1: the dense one, with its adapter
    assert frozen("bw_last", 0) == 2 * experts  # layer 2's backward: its experts only
    assert frozen("bw_first", 0) == 2 * (experts + layer + layer)  # layers 2 (experts), 3 held, 4 running
    assert frozen("mid_bw", 0) == 2 * (experts + 2 * layer + head)
    # with the dense layer's adapter every layer is reached whole: the dense layer and layer 2's attention and router
    assert trained("mid_bw", 0) - frozen("mid_bw", 0) == 2 * (dense + adapter + layer - experts)
    assert frozen("prefix", 0) == trained("prefix", 0) == 2 * (embed + bucket)
    narrow = [ParamInfo(p.name, p.shape, 200, 2, False, p.module_kind, None) if p.module_kind == "embedding"
              else p for p in _table(dense_adapter=False)]
    assert _zero3_gathered(zero, narrow, 2)("prefix", 0) == 2 * (dense + bucket)  # the dense layer's forward
    checkpointed = _zero3_gathered(zero, _table(dense_adapter=False), 2, checkpointed=True)
    assert checkpointed("mid_bw", 0) - frozen("mid_bw", 0) == 2 * (embed + layer - experts)  # measured held


def test_zero3_saves_no_frozen_input_before_the_first_layer_backward_reaches():
    """zero.Init's linear saves a frozen Linear's input only where the input or a parameter needs a gradient: in
    the forward-only layer nothing does, nor in the first expert layer before its experts (the attention reads
    the dense layer's output, which carries no gradient). Later layers save the attention's input (16 B a token)
    and the fp32 router's cast input (32)."""
    from estimator.methods.state import zero3_saved_linear_inputs

    per_layer, head = zero3_saved_linear_inputs(_table(dense_adapter=False), 0.0, True, attention_view=True)
    assert per_layer == [0.0, 0.0, 48.0, 48.0] and head == 16.0
    per_layer, _ = zero3_saved_linear_inputs(_table(dense_adapter=True), 0.0, True, attention_view=True)
    assert per_layer == [0.0, 48.0, 48.0, 48.0]  # layer 0's adapter gives layer 1's input a gradient


def _segments() -> dict:
    return segments_of_ten_byte_layers(prefix_bytes=100.0)


def _fsdp_sizes():
    from estimator.methods.fsdp_replay import FsdpSizes, LayerGroup

    dense, expert = LayerGroup(400.0, 400.0, 0.0, 0.0), LayerGroup(1000.0, 1000.0, 8.0, 4.0)
    return FsdpSizes(root_bytes=10.0, root_gather_bytes=10.0, layer_bytes=1000.0, layer_gather_bytes=1000.0,
                     layer_rs_in_bytes=8.0, layer_rs_out_bytes=4.0, root_rs_in_bytes=0.0, root_rs_out_bytes=0.0,
                     layers=(dense, expert, expert, expert))


def _states(events: list) -> list[dict]:
    """The overlay state after each of a segment's boundary events."""
    from estimator.methods.fsdp_replay import BUFFERS, GRADS

    state, out = dict.fromkeys(BUFFERS + GRADS, 0.0), []
    for event in events:
        event(state)
        out.append(dict(state))
    return out


def test_fsdp2_runs_the_forward_only_layer_in_the_prefix_and_prefetches_it_last():
    """FSDP2 over 4 layers, the first forward only (the regime's ``frozen_layers``: ``loop_segments`` repeats the
    layer segments for 3). The dense unit is gathered and resharded in the prefix; the first expert layer's
    forward frees the dense layer's all-gather output only after its own all-gather; the last backward (layer 1)
    still prefetches the dense unit in post-forward order (its backward never comes); the suffix reduce-scatters
    layer 1's gradients, not layer 0's (it has none)."""
    from estimator.methods.fsdp_replay import FIRST, _boundary_events, forward_only_layers, replay_fsdp
    from estimator.methods.timeline import loop_segments

    regime = {"segments": _segments(), "segments_manual": _segments(), "frozen_layers": 1}
    segments = loop_segments(regime, "trainer", 4)
    assert forward_only_layers(segments, 4) == 1 and forward_only_layers(_segments(), 4) == 0
    sizes = _fsdp_sizes()
    prefix = _states(_boundary_events("prefix", 4, sizes, FIRST, None, first=1))
    assert max(st["gather"] + st["layer_params"] for st in prefix) == 10.0 + 400.0 + 400.0
    assert prefix[-1]["layer_params"] == 400.0 and prefix[-1]["root_params"] == 10.0
    assert _states(_boundary_events("prefix", 4, sizes, FIRST, None))[-1]["layer_params"] == 0.0
    fw_first = _states(_boundary_events("fw_first", 4, sizes, FIRST, 1, first=1))
    assert max(st["gather"] for st in fw_first) == 400.0 + 1000.0  # the dense all-gather output, then layer 1's
    assert _states(_boundary_events("bw_last", 4, sizes, FIRST, 1, first=1))[-1]["gather"] == 400.0
    assert _states(_boundary_events("bw_last", 4, sizes, FIRST, 0))[-1]["gather"] == 0.0
    suffix = _states(_boundary_events("suffix", 4, sizes, FIRST, None, first=1))
    assert suffix[-1]["grad_shards"] == 4.0  # layer 1's shard (the dense layer's would be 0)
    mine = replay_fsdp(segments, 4, 1, 64, sizes)
    assert mine.end_grad_bytes == 12.0 and mine.end_act_bytes == 100.0  # 3 expert layers' shards; acts handed back


def test_fsdp2_without_forward_only_layers_is_unchanged_by_the_split():
    """The same sizes replayed with every layer reached by backward (no ``frozen_layers``): 4 layers' activations,
    the dense layer's forward in fw_first (root and dense gathers together), no prefetch past layer 0."""
    from estimator.methods.fsdp_replay import replay_fsdp
    from estimator.methods.timeline import loop_segments

    sizes = _fsdp_sizes()
    plain = replay_fsdp(loop_segments({"segments": _segments(), "segments_manual": _segments()}, "trainer", 4),
                        4, 1, 64, sizes)
    assert plain.end_act_bytes == 100.0 and plain.end_grad_bytes == 12.0  # the dense layer has no gradient shard
    frozen = replay_fsdp(loop_segments({"segments": _segments(), "segments_manual": _segments(),
                                        "frozen_layers": 1}, "trainer", 4), 4, 1, 64, sizes)
    assert plain.peak_bytes - frozen.peak_bytes == 10.0  # one layer's activations fewer at the backward peak


@pytest.mark.parametrize("method", ["ddp", "zero1", "zero2", "zero3", "fsdp"])
def test_the_methods_that_split_the_layers_no_longer_refuse(method):
    from estimator.models.moe import check_forward_only_layers

    spec = RunSpec(model="x", parallel=ParallelSpec(method=method, world_size=2), training=TrainingSpec(lora_rank=8))
    check_forward_only_layers(spec, {"params": {"frozen_layers": 1}})


@pytest.mark.parametrize("parallel", [
    ParallelSpec(method="fsdp1", world_size=2),
    ParallelSpec(method="fsdp", world_size=2, ep=2),
    ParallelSpec(method="single", world_size=2, pp=2),
])
def test_the_layouts_left_refuse_forward_only_first_layers(parallel):
    from estimator.models.moe import check_forward_only_layers

    spec = RunSpec(model="x", parallel=parallel, training=TrainingSpec(lora_rank=8))
    with pytest.raises(ValueError, match="backward never reaches the first 1 decoder layer"):
        check_forward_only_layers(spec, {"params": {"frozen_layers": 1}})


@pytest.mark.parametrize("update, expected", [
    ({}, 1),                                                     # first_k_dense_replace 1
    ({"first_k_dense_replace": 3, "num_hidden_layers": 6}, 3),   # DeepSeek-V3's
    ({"first_k_dense_replace": 1, "moe_layer_freq": 2}, 2),      # every second layer an MoE one, from layer 1
    ({"first_k_dense_replace": 0}, 0),
    ({"n_routed_experts": None}, None),                          # no experts: a dense model
])
def test_the_dense_first_layers_come_from_a_deepseek_config(update, expected):
    from estimator.models.moe import dense_leading_layers

    config = {**json.loads(DEEPSEEK.read_text()), **update}
    assert dense_leading_layers(config) == expected


@pytest.mark.parametrize("update, expected", [
    ({"mlp_only_layers": [0]}, 1),
    ({"mlp_only_layers": [0, 1]}, 2),
    ({"mlp_only_layers": [], "decoder_sparse_step": 2}, 1),      # layers 1, 3, ... hold experts
    ({"mlp_only_layers": [], "decoder_sparse_step": 1}, 0),
])
def test_the_dense_first_layers_come_from_a_qwen_moe_config(update, expected):
    from estimator.models.moe import dense_leading_layers

    config = json.loads((ROOT / "benchmarks" / "configs" / "qwen3_moe_tiny.json").read_text())
    assert dense_leading_layers({**config, **update}) == expected


@pytest.mark.parametrize("targets, expected", [
    (EXPERTS, 1), ("down_proj", 1), ("q_proj," + EXPERTS, 0), ("all-linear", 0), ("auto", 0)])
def test_the_forward_only_layers_are_predicted_from_the_targets_and_the_config(targets, expected):
    from estimator.models.moe import predicted_forward_only_layers

    config = json.loads(DEEPSEEK.read_text())
    assert predicted_forward_only_layers(TrainingSpec(lora_rank=8, lora_targets=targets), config) == expected
    assert predicted_forward_only_layers(TrainingSpec(lora_targets=targets), config) == 0  # full fine-tuning
    mixtral = json.loads((ROOT / "benchmarks" / "configs" / "mixtral_tiny.json").read_text())
    assert predicted_forward_only_layers(TrainingSpec(lora_rank=8, lora_targets=targets), mixtral) == 0


def test_a_layout_left_refuses_before_any_profile_is_loaded(tmp_path, monkeypatch):
    """With an empty cache, the refusal must not wait for a trace: the config states the dense first layer."""
    import estimator.api as api

    def traced(*_args, **_kwargs):
        raise AssertionError("a profile was loaded (or traced) before the refusal")

    monkeypatch.setenv("LLMEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(api, "load_model_profile", traced)
    spec = RunSpec(model=str(DEEPSEEK), parallel=ParallelSpec(method="fsdp", world_size=2, ep=2),
                   training=TrainingSpec(precision="bf16", lora_rank=8, lora_targets=EXPERTS))
    # the experts' adapters cannot run under ep or FSDP1 at all (attention adapters or not): refused for that
    for parallel in (spec.parallel, ParallelSpec(method="fsdp1", world_size=2)):
        for targets in (EXPERTS, "q_proj," + EXPERTS):
            with pytest.raises(ValueError, match="fused routed experts .* cannot run under"):
                api.estimate(spec.replace(parallel=parallel, **{"training.lora_targets": targets}))
    with pytest.raises(AssertionError, match="a profile was loaded"):  # attention adapters only: estimated
        api.estimate(spec.replace(**{"training.lora_targets": "q_proj,v_proj"}))


@pytest.mark.parametrize("parallel, runs", [
    (ParallelSpec(method="fsdp", world_size=2, ep=2), False), (ParallelSpec(method="fsdp1", world_size=2), False),
    (ParallelSpec(method="fsdp", world_size=2), True), (ParallelSpec(method="zero3", world_size=2), True)])
def test_adapters_on_the_fused_experts_are_refused_where_peft_cannot_run_them(parallel, runs):
    """peft's expert wrapper under transformers' EP (one delta for every expert on a rank's DTensor share) and under
    FSDP1 (the adapter units never gathered: their Linear modules are not called): refused, from the targets
    before a trace and from the traced table after one; attention adapters are not refused for it."""
    from estimator.models.moe import (
        adapts_fused_experts,
        fused_expert_adapters_refusal,
        predicted_fused_expert_adapters,
    )

    spec = RunSpec(model="x", parallel=parallel, training=TrainingSpec(lora_rank=8, lora_targets="w1,w2,w3"))
    mixtral = json.loads((ROOT / "benchmarks" / "configs" / "mixtral_tiny.json").read_text())
    assert predicted_fused_expert_adapters(spec.training, mixtral)
    assert (fused_expert_adapters_refusal(spec, True) is None) is runs
    assert fused_expert_adapters_refusal(spec, False) is None
    attention = TrainingSpec(lora_rank=8, lora_targets="q_proj,v_proj")
    assert not predicted_fused_expert_adapters(attention, mixtral)
    assert not predicted_fused_expert_adapters(TrainingSpec(lora_targets="w1,w2,w3"), mixtral)  # full fine-tuning
    assert predicted_fused_expert_adapters(TrainingSpec(lora_rank=8, lora_targets=EXPERTS),
                                           json.loads(DEEPSEEK.read_text()))
    row = {"name": "mlp.experts.lora_A.default.weight", "trainable": True}
    assert adapts_fused_experts({"params": {"per_layer": [row]}})
    shared = {"name": "mlp.shared_expert.gate_proj.lora_A.default.weight", "trainable": True}
    assert not adapts_fused_experts({"params": {"per_layer": [shared, {**row, "trainable": False}]}})
    kinds = {"rows": [[shared], [row]], "of_layer": [0, 1]}
    assert adapts_fused_experts({"params": {"per_layer": [shared], "layer_kinds": kinds}})


def test_cp_refuses_expert_lora_past_dense_first_layers_before_a_trace():
    """The cp rank is estimated as FSDP2 at its local sequence (``parallel.cp`` set to 1 for it), but the
    forward-only first layers are checked against the asked layout: refused in one line, as under tp, pp, ep."""
    from estimator.api import estimate

    spec = RunSpec(model=str(ROOT / "benchmarks" / "configs" / "qwen3_moe_tiny.json"),
                   parallel=ParallelSpec(method="fsdp", world_size=2, cp=2),
                   training=TrainingSpec(precision="bf16", attn="sdpa", seq_len=256, lora_rank=8,
                                         lora_targets=EXPERTS))
    with pytest.raises(ValueError, match="backward never reaches the first 1 decoder layer"):
        estimate(spec, allow_build=False)


@pytest.mark.parametrize("family, runs", [("qwen3_moe", False), ("mixtral", False), ("deepseek_v2", True)])
def test_zero3_refuses_adapters_on_the_experts_inside_deepspeed_s_leaf_moe_blocks(family, runs):
    """DeepSpeed makes Mixtral's, Qwen2-MoE's and Qwen3-MoE's MoE blocks ZeRO-3 leaf modules by default: the block's
    parameters, peft's expert adapters among them, are released once its input gradients are done, before the
    adapters' gradients arrive (the harness's run fails: moe_methods.csv). DeepSeek-V2's block is not one, and its
    run is estimated within 0.4 %."""
    from estimator.models.moe import check_forward_only_layers_before_trace

    config = json.loads((ROOT / "benchmarks" / "configs" / f"{family}_tiny.json").read_text())
    targets = "w1,w2,w3" if family == "mixtral" else EXPERTS
    spec = RunSpec(model="x", parallel=ParallelSpec(method="zero3", world_size=2),
                   training=TrainingSpec(lora_rank=8, lora_targets=targets))
    if runs:
        check_forward_only_layers_before_trace(spec, config)
    else:
        with pytest.raises(ValueError, match=f"cannot run under zero3 on {family}: the experts sit in a ZeRO-3 leaf"):
            check_forward_only_layers_before_trace(spec, config)
        cleared = spec.replace(**{"parallel.zero": ZeroSpec(leaf_classes=())})  # DeepSpeed's leaf_module.classes []
        check_forward_only_layers_before_trace(cleared, config)
    attention = spec.replace(**{"training.lora_targets": "q_proj,v_proj"})
    check_forward_only_layers_before_trace(attention, config)
