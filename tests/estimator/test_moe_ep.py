"""Expert parallelism (issue 17): the layout checks, what a rank holds (its experts' shard, the experts' own FSDP2
unit), the skewed-routing bound, and the estimate against a real run of transformers' EP on gloo ranks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from estimator.methods.fsdp_replay import experts_levels
from estimator.models.moe_ep import INT64, EpLayout
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec

REPO = Path(__file__).resolve().parents[2]
QWEN3 = "Qwen/Qwen3-30B-A3B"  # shipped profiles: no torch in these tests


def _spec(ep: int = 1, imbalance: float = 1.0, model: str = QWEN3, gpus: int = 8, b: int = 2,
          grad_ckpt: bool = True) -> RunSpec:
    return RunSpec(model=model, gpu="h100-80gb",
                   parallel=ParallelSpec(method="fsdp", world_size=gpus, ep=ep, moe_imbalance=imbalance),
                   training=TrainingSpec(micro_batch_size=b, seq_len=2048, grad_ckpt=grad_ckpt))


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "ddp", "world_size": 4, "ep": 2}, "ep: expert parallelism runs with FSDP2"),
    ({"method": "fsdp", "world_size": 6, "ep": 4}, "ep: world size 6 is not divisible by ep 4"),
    ({"method": "fsdp", "world_size": 4, "ep": 0}, "ep: must be a positive integer"),
    ({"method": "fsdp", "world_size": 4, "ep": 2, "moe_imbalance": 0.5}, "moe_imbalance: must be a number >= 1"),
])
def test_layouts_transformers_refuses_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelSpec(**kwargs)


def test_specs_without_ep_keep_their_ids():
    """ep and moe_imbalance at their defaults stay out of the canonical JSON: every recorded run keeps its id."""
    spec = RunSpec(parallel=ParallelSpec(method="fsdp", world_size=4))
    assert "ep" not in spec._canonical_dict()["parallel"]
    assert "moe_imbalance" not in spec._canonical_dict()["parallel"]
    assert spec.replace(**{"parallel.ep": 2}).spec_id != spec.spec_id


def test_ep_needs_experts_that_split_evenly():
    from estimator.api import estimate

    with pytest.raises(ValueError, match="^ep: expert parallelism needs a mixture-of-experts model"):
        estimate(RunSpec(model="meta-llama/Llama-3.2-1B", parallel=ParallelSpec(method="fsdp", world_size=4, ep=2)),
                 allow_build=False)
    with pytest.raises(ValueError, match="^ep: 128 routed experts cannot be split evenly over ep=3"):
        estimate(_spec(ep=3, gpus=6), allow_build=False)


def test_a_rank_stores_the_same_shard_and_gathers_only_its_experts():
    """Each rank stores 1 / world of every expert tensor either way (num_experts / ep experts sharded over
    world / ep ranks), but gathers only its own experts for compute."""
    from estimator.api import estimate

    plain, ep = (estimate(_spec(ep=e), allow_build=False) for e in (1, 8))
    for part in ("weights", "optimizer_states"):
        assert ep.breakdown[part] == plain.breakdown[part]
    assert ep.peak_allocated_bytes < plain.peak_allocated_bytes
    assert any(n.startswith("ep: 8 expert-parallel ranks, 16 of 128 experts each") for n in ep.notes)


def test_skewed_routing_bounds_grow_until_one_rank_receives_every_row():
    from estimator.api import estimate

    peaks = [estimate(_spec(ep=8, imbalance=f, b=1, grad_ckpt=False), allow_build=False).peak_allocated_bytes
             for f in (1, 2, 8, 16)]
    assert peaks[0] < peaks[1] < peaks[2]
    # 16 experts of 128 per rank, 8 per token: a rank receives at most ep x T x 8 rows, 8 x its own
    assert peaks[3] == peaks[2]


def test_received_rows_factor_is_capped_by_the_rows_a_rank_can_receive():
    layout = EpLayout(ep=4, world=8, experts=16, top_k=4, moe_layers=3, hidden=128, expert_ffn=64, imbalance=8)
    assert layout.experts_per_rank == 4 and layout.efsdp == 2
    assert layout.received_rows_factor() == 4  # every token's top-4 on one rank: ep x T x k rows
    few = EpLayout(ep=8, world=8, experts=16, top_k=4, moe_layers=3, hidden=128, expert_ffn=64, imbalance=8)
    assert few.received_rows_factor() == 4  # 2 experts per rank: a token sends it at most 2 of its 4 rows
    assert EpLayout(ep=1, world=8, experts=16, top_k=4, moe_layers=3, hidden=128, expert_ffn=64,
                    imbalance=8).received_rows_factor() == 1  # one device runs every expert: dropless


def test_a_received_row_keeps_what_the_ep_experts_save():
    """bf16, hidden 128, expert ffn 64: the routed row (128), gate/up (128), activation (64), product (64), unit
    weight (1) in bf16, two int64 indices and the bool mask: 787 bytes, as the real run's skewed peak shows
    (tiny Qwen3-MoE, 2 ranks, ep 2, b2 s64: 1,208,832 bytes more than balanced over 3 MoE layers of 512 extra
    rows)."""
    layout = EpLayout(ep=2, world=2, experts=16, top_k=4, moe_layers=3, hidden=128, expert_ffn=64, imbalance=4)
    assert layout.row_bytes(2) == 2 * (128 + 4 * 64 + 1) + 2 * INT64 + 1 == 787
    assert layout.skew_bytes(128, 2) == 3 * 512 * 787 == 1_208_832


def test_grouped_mm_saves_its_input_only_for_the_weight_gradient():
    """What ``EpLayout.row_bytes`` rests on for frozen experts (LoRA elsewhere): autograd's ``GroupedMmBackward0``
    keeps the weight and the offsets, and the input only when the weight needs a gradient."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("no grouped_mm in this torch")

    def saved_shapes(weight_grad: bool) -> list[tuple]:
        rows = torch.randn(32, 16, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.randn(4, 16, 8, dtype=torch.bfloat16, requires_grad=weight_grad)
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: shapes.append(tuple(x.shape)) or x, lambda x: x):
            torch.nn.functional.grouped_mm(rows, weight, offs=torch.tensor([8, 16, 24, 32], dtype=torch.int32))
        return shapes

    assert (32, 16) in saved_shapes(True)
    assert (32, 16) not in saved_shapes(False) and (4, 16, 8) in saved_shapes(False)


def test_a_frozen_expert_keeps_only_what_its_input_gradient_needs():
    """LoRA on attention, experts frozen: an extra received row keeps the gate/up halves (128), the activation
    (64) and the unit weight in bf16, the two int64 indices and the mask: 403 bytes, the real run's skewed minus
    balanced level per extra row (tiny Qwen3-MoE, 2 ranks, ep 2, b1 s64: 103,168 bytes a MoE layer over 256 extra
    rows; b2 s128: 1,238,016 over 3,072). In forward the experts function still holds its routed rows (R h a) at
    the un-permute, though nothing saved them; its backward holds the product's gradient and both factors'."""
    frozen = EpLayout(ep=2, world=2, experts=16, top_k=4, moe_layers=3, hidden=128, expert_ffn=64, imbalance=4,
                      experts_trainable=False)
    trained = EpLayout(ep=2, world=2, experts=16, top_k=4, moe_layers=3, hidden=128, expert_ffn=64, imbalance=4)
    assert frozen.row_bytes(2) == 2 * (3 * 64 + 1) + 2 * INT64 + 1 == 403
    assert frozen.layer_skew_bytes(64, 2) == 256 * 403 == 103_168
    assert frozen.skew_bytes(128, 2) == 3 * 512 * 403
    # the frozen experts' routed rows at the un-permute (R h a), the block's input held (T h a)
    assert frozen.unpermute_forward_bytes(64, 2) - trained.unpermute_forward_bytes(64, 2) == 512 * 256
    assert trained.forward_transient_bytes(64, 2) < frozen.forward_transient_bytes(64, 2)
    mixtral = EpLayout(ep=2, world=2, experts=8, top_k=2, moe_layers=2, hidden=128, expert_ffn=256, imbalance=4,
                       experts_trainable=False)
    first, _, last = mixtral.backward_bumps(64, 2)
    assert first == 128 * (3 * 256 * 2 - (INT64 + 2))  # the product's backward on 128 extra rows: 3 ffn a
    assert last == -128 * (INT64 + 2)


def test_the_last_moe_layer_s_forward_holds_what_the_busiest_rank_held():
    """The busiest rank's last MoE layer in forward, above the layer's end-of-forward level, at its two moments,
    from rank 0's live storages op by op (tiny Qwen3-MoE, 2 gloo ranks, ep 2, b1 s64, skewed: 512 rows received,
    256 sent; a throwaway probe, docs/error_matrix/README.md, helper moeep). Measured above the layer's end:
    LoRA on attention 1,150,624 B at the un-permute and 960,128 at the per-token sum, full fine-tuning 974,496 and
    915,072; of which the layer's and its experts' gathered parameters 524,928 (LoRA) and 496,256 (counted apart,
    ``forward_gathered_bytes``) and the oracle's forced routing indices, T top_k int64 = 2,048 B (the harness's
    router hook returns a clone a real run does not make). Besides what the experts make, the block holds the
    router's logits (T E a) to its return, and under LoRA its input (T h a), which nothing that trains saved;
    the layer's output takes its post-attention residual's place (the ~620 B a token the estimate missed)."""
    frozen = EpLayout(ep=2, world=2, experts=16, top_k=4, moe_layers=3, hidden=128, expert_ffn=64, imbalance=4,
                      experts_trainable=False, block_input_saved=False)
    trained = EpLayout(ep=2, world=2, experts=16, top_k=4, moe_layers=3, hidden=128, expert_ffn=64, imbalance=4)
    clone = 64 * 4 * INT64
    assert frozen.block_held_bytes(64, 2) == 64 * 16 * 2 + 64 * 128 * 2
    assert trained.block_held_bytes(64, 2) == 64 * 16 * 2
    held = {frozen: frozen.block_held_bytes(64, 2), trained: trained.block_held_bytes(64, 2)}
    gathered = {frozen: 524_928, trained: 496_256}
    for layout, unpermute, combine in ((frozen, 1_150_624, 960_128), (trained, 974_496, 915_072)):
        assert layout.unpermute_forward_bytes(64, 2) + held[layout] == unpermute - gathered[layout] - clone
        assert layout.combine_forward_bytes(64, 2) + held[layout] == combine - gathered[layout] - clone
        assert layout.forward_transient_bytes(64, 2) == unpermute - gathered[layout] - clone
    deepseek = EpLayout(ep=2, world=2, experts=16, top_k=4, moe_layers=3, hidden=128, expert_ffn=64, imbalance=4,
                        router_fp32=True)
    assert deepseek.block_held_bytes(64, 2) == 64 * 16 * 4  # fp32 logits; its fp32 weights make the sum fp32
    assert deepseek.combine_forward_bytes(64, 2) - trained.combine_forward_bytes(64, 2) == (256 + 64) * 128 * 2


def test_the_block_s_input_is_saved_when_something_in_the_block_trains():
    from estimator.methods.expert_parallel import block_input_saved
    from estimator.models.params import ParamInfo

    def param(name: str, trainable: bool) -> ParamInfo:
        return ParamInfo(name=name, shape=(4,), numel=4, elem_bytes=2, trainable=trainable, module_kind="linear",
                         layer=1)

    experts = param("base_model.model.model.layers.1.mlp.experts.gate_up_proj", False)
    router = param("base_model.model.model.layers.1.mlp.gate.weight", False)
    adapter = param("base_model.model.model.layers.1.self_attn.q_proj.lora_A.default.weight", True)
    assert not block_input_saved([experts, router, adapter])  # LoRA on attention: the block's input unsaved
    assert block_input_saved([experts, param(router.name, True), adapter])
    shared = param("base_model.model.model.layers.1.mlp.shared_experts.gate_proj.lora_A.default.weight", True)
    assert block_input_saved([experts, router, shared])


def test_frozen_experts_keep_their_extra_rows_through_the_layer_s_backward():
    """``ep_segments`` with the experts frozen (LoRA on attention): each MoE layer's forward keeps its dispatch
    and extra rows (403 bytes a row), its backward releases them and holds the product's backward on the extra
    rows before the layer's first gradient; a dense layer is left alone. Checkpointing keeps the trace's."""
    from estimator.methods.expert_parallel import ep_segments, experts_trainable
    from estimator.models.params import ParamInfo

    def param(name: str, layer: int, trainable: bool) -> ParamInfo:
        return ParamInfo(f"model.layers.{layer}.{name}", (8, 8), 64, 2, trainable, "linear", layer)

    table = [param("mlp.down_proj.weight", 0, False), param("self_attn.q_proj.lora_A.weight", 0, True),
             *(param(n, i, t) for i in (1, 2) for n, t in (("mlp.experts.gate_up_proj", False),
                                                          ("self_attn.q_proj.lora_A.weight", True)))]
    assert not experts_trainable(table)
    layout = EpLayout(ep=2, world=2, experts=16, top_k=4, moe_layers=2, hidden=128, expert_ffn=64, imbalance=4,
                      experts_trainable=False)
    segments = {name: {"net_act": [1000.0], "candidates": [([500.0], 0.0)], "net_grad": 0.0}
                for name in ("fw_first", "fw", "fw_last", "bw_first", "bw", "bw_last")}
    out = ep_segments(segments, {}, table, layout, TrainingSpec(precision="bf16", lora_rank=8), 3, 1, 64, {})
    extra = 256 * (INT64 + 1) + 256 * 403
    assert out["fw_first"] == segments["fw_first"] and out["bw_last"] == segments["bw_last"]  # layer 0: dense
    assert out["fw"]["net_act"] == [1000.0 + extra] and out["bw"]["net_act"] == [1000.0 - extra]
    assert out["bw"]["experts_saved_extra"] == extra
    assert out["bw"]["experts_bw_bumps"][0] == 256 * (3 * 64 * 2 - (INT64 + 2))
    ckpt = ep_segments(segments, {}, table, layout, TrainingSpec(precision="bf16", lora_rank=8, grad_ckpt=True),
                       3, 1, 64, {})
    assert ckpt == segments


def test_the_experts_post_backward_sits_before_the_router_s_gradient():
    """A backward layer segment: the experts' two gradients, an activation saved in forward freed, a tensor of
    the router's backward, then the router's gradient (and a tensor after it, which does not count). The
    un-permute's level is the one before the experts' first gradient."""
    events = {"polys": [[100, 0, 0, 0, 0, 0], [30, 0, 0, 0, 0, 0], [5, 0, 0, 0, 0, 0], [20, 0, 0, 0, 0, 0]],
              "size": [0, 1, 1, 3, 2, 3], "grads": [1, 2, 4],
              "segments": {"bw": [1, 2, ~0, 3, 4, 5]}}
    assert experts_levels(events, {"bw": 60.0}, 1, 1) == {"bw": (0, -100 + 20)}
    assert experts_levels(events, {"bw": 0.0}, 1, 1) == {}
    # a shared expert after the routed ones in forward: its gradient (30) first, a tensor of the combine's
    # backward (20), then the experts' gradient (30)
    shared_first = {**events, "segments": {"bw": [1, 3, 2, ~0, 4]}}
    assert experts_levels(shared_first, {"bw": 30.0}, 1, 1, {"bw": 30.0}) == {"bw": (20, 20 - 100)}


def test_a_router_kept_in_fp32_is_a_unit_of_its_own():
    """transformers gives each module a 16-bit model keeps in fp32 (DeepSeek's router) an FSDP2 group of its own;
    the experts' pre-backward prefetches it, so the previous layer's all-gather waits for their post-backward."""
    from estimator.methods.state import fp32_kept_params
    from estimator.models.params import ParamInfo

    layer = [ParamInfo("model.layers.1.mlp.gate.weight", (8, 128), 1024, 4, True, "linear", 1),
             ParamInfo("model.layers.1.mlp.experts.down_proj", (8, 128, 64), 65536, 2, True, "other", 1),
             ParamInfo("model.layers.1.self_attn.o_proj.weight", (128, 128), 16384, 2, True, "linear", 1)]
    assert [p.name for p in fp32_kept_params(layer, "bf16")] == ["model.layers.1.mlp.gate.weight"]
    assert fp32_kept_params(layer, "mixed_bf16") == []  # fp32 weights: one dtype, one group


def test_the_un_permute_bump_follows_the_rows_received():
    """The un-permute's backward holds the received rows' gradient, the zeros and the scattered copy (3 R h a)
    above the trace's level before the experts' first gradient, less the S rows of gradient the trace holds,
    plus the S rows' indices and unit weights not yet released: the oracle's tiny DeepSeek-V2, 4 ranks, ep 4,
    b1 s64, bf16: 66,816 bytes balanced, 361,728 with every row on one rank (docs/LOG.md, session 21)."""
    balanced = EpLayout(ep=4, world=4, experts=8, top_k=2, moe_layers=2, hidden=128, expert_ffn=64)
    skewed = EpLayout(ep=4, world=4, experts=8, top_k=2, moe_layers=2, hidden=128, expert_ffn=64, imbalance=4)
    assert balanced.unpermute_bump(64, 2) == 66_816
    assert skewed.unpermute_bump(64, 2) == 361_728
    assert skewed.backward_bumps(64, 2)[0] == balanced.backward_bumps(64, 2)[0]  # the combine: sent rows only


def test_the_recomputation_holds_what_the_all_to_all_path_makes_again():
    """A checkpointed MoE layer's recomputation above the profile's level at its experts' entry, read off the
    oracle's per-operator storages (docs/LOG.md, session 22), 2 ranks, ep 2, b2 s128, bf16. DeepSeek-V2 (a shared
    expert after the experts: the recomputation runs on through the fp32 routing-weight product and its sum):
    the dispatch 144,384 B, the experts' kept rows 534,032 and the combine 786,432. Qwen3-MoE (nothing saved
    after the experts: it stops once the product's inputs are saved): 288,768 + 1,068,064 + 3 S h a (786,432), less
    the one-device profile's copy of the sum's gradient (S h a = 262,144) made before its recomputation."""
    deepseek = EpLayout(ep=2, world=2, experts=8, top_k=2, moe_layers=2, hidden=128, expert_ffn=64)
    assert deepseek.recompute_bytes(256, 2, weights_bytes=4, continues=True) == 144_384 + 534_032 + 786_432
    qwen3 = EpLayout(ep=2, world=2, experts=16, top_k=4, moe_layers=3, hidden=128, expert_ffn=64)
    assert qwen3.recompute_bytes(256, 2, weights_bytes=2, continues=False) == \
        288_768 + 1_068_064 + 786_432 - 262_144
    # fp32 routing weights and no saved tensor after the experts (Mixtral): the layer's gradient cast to fp32 is
    # held by EP's pending product, freed by the one-device copy: S h 4 - T h 4 apart
    mixtral = EpLayout(ep=2, world=2, experts=8, top_k=2, moe_layers=3, hidden=128, expert_ffn=64)
    assert mixtral.recompute_bytes(256, 2, 4, False) - mixtral.recompute_bytes(256, 2, 2, False) == \
        512 * 128 * 2 - 256 * 128 * 4


def test_the_profile_marks_the_experts_entry_in_the_recomputation():
    """The checkpointed profile's backward layer segments carry the level at the routed experts' entry with the
    routing weights' element size, and their exit only where the recomputation gets past them (ModTracker's
    post-forward hook also runs, with no output, when checkpointing's early stop ends the recomputation)."""
    from estimator.api import _regime
    from estimator.profiler.cache import load_model_profile

    for config, weights, done in (("qwen3_moe_tiny.json", "w2", False), ("deepseek_v2_tiny.json", "w4", True)):
        training = TrainingSpec(precision="bf16", attn="eager", micro_batch_size=1, seq_len=64, grad_ckpt=True)
        _, profile = load_model_profile(str(REPO / "benchmarks/configs" / config), training, allow_build=True)
        marks = _regime(profile, 1, 64)["segments"]["bw"]["marks"]
        assert f"moe_experts:{weights}" in marks and ("moe_experts_done" in marks) == done, (config, marks)


def test_ep_on_the_command_line():
    base = [sys.executable, "-m", "estimator", "--model", QWEN3, "--method", "fsdp", "--gpus", "8"]
    for extra, message in ((["--ep", "3"], "ep: world size 8 is not divisible by ep 3"),
                           (["--ep", "8", "--moe-imbalance", "0.5"], "moe_imbalance: must be a number >= 1")):
        result = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], result.stderr
    result = subprocess.run([*base, "--ep", "8", "--json"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["peak_allocated_bytes"] > 0


@pytest.mark.slow
def test_the_estimate_matches_transformers_ep_on_two_gloo_ranks(tmp_path):
    """The oracle (benchmarks/moe_ep_table.py): the tiny Qwen3-MoE config on 2 gloo ranks with ep_size=2, routing
    forced balanced and skewed, every live storage counted; each rank in a spawned interpreter."""
    out = tmp_path / "ep.csv"
    result = subprocess.run([sys.executable, "benchmarks/moe_ep_table.py", "--configs",
                             "benchmarks/configs/qwen3_moe_tiny.json", "--layouts", "2x2", "--points", "1x64",
                             "--csv", str(out)], capture_output=True, text=True, timeout=600, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-2000:]
    rows = out.read_text().splitlines()[1:]
    assert len(rows) == 2
    assert all(abs(float(row.rsplit(",", 1)[1])) <= 1.0 for row in rows)


def test_the_plan_weighs_ep_layouts_for_moe_models_only():
    from estimator.planning.plan import enumerate_candidates, ep_degrees

    assert ep_degrees(8, 64) == [2, 4, 8] and ep_degrees(8, 6) == [2] and ep_degrees(8, None) == []
    labels = {c.label for c in enumerate_candidates(8, (False,), experts=64)}
    assert {"fsdp ep2", "fsdp ep4", "fsdp ep8", "fsdp"} <= labels
    assert not any("ep" in c.label for c in enumerate_candidates(8, (False,)))
    ep4 = next(c for c in enumerate_candidates(8, (False,), experts=64) if c.ep == 4)
    assert ep4.parallel_spec() == ParallelSpec(method="fsdp", world_size=8, ep=4)


def test_skewed_routing_slows_the_busiest_ep_rank_only():
    """The busiest EP rank runs (and exchanges) the rows its experts receive: the step waits for it. Without EP
    every rank runs all its own rows whatever the routing; the factor is capped by what a rank can receive."""
    from estimator.planning import throughput as tput
    from estimator.planning.shape import ModelShape

    shape = ModelShape(params=7_000_000_000, matmul_params=1_300_000_000, layers=16, hidden_size=2048,
                       moe_layers=16, experts=64, top_k=8, expert_params=6_400_000_000)
    gpu = tput.gpu_perf("h100-80gb")
    eff = tput.load_efficiency(gpu)
    link = tput.resolve_link(gpu, 8, None, None)

    def step(ep: int, imbalance: float) -> tput.StepTime:
        setup = tput.Setup(method="fsdp", world_size=8, tp=1, micro_batch=1, seq_len=4096, ep=ep,
                           moe_imbalance=imbalance)
        return tput.step_time(shape, setup, gpu, eff, dp_link=link, tp_link=link)

    assert step(1, 4.0).step_s == step(1, 1.0).step_s
    balanced, skewed, capped = step(4, 1.0), step(4, 2.0), step(4, 100.0)
    assert "ep_busiest_rank_extra_compute" not in balanced.parts
    # one extra balanced share of the routed experts' FLOPs: 6 passes x tokens x top_k x expert_params / experts
    extra = 6 * 4096 * 8 * 6_400_000_000 / 64
    assert skewed.flops_per_step - balanced.flops_per_step == pytest.approx(extra)
    assert skewed.parts["ep_all_to_all"] == pytest.approx(2 * balanced.parts["ep_all_to_all"], rel=0.05)
    # at most every row of the EP group: ep x min(top_k, experts / ep) / top_k = 4
    assert capped.flops_per_step - balanced.flops_per_step == pytest.approx(3 * extra)


def test_the_plan_weighs_ep_layouts_under_the_given_routing():
    from estimator.planning.plan import plan

    kwargs = dict(gpus=8, gpu="h100-80gb", seq_len=4096, ckpt_options=(False,), methods=("fsdp",), advise=False)
    balanced = plan("allenai/OLMoE-1B-7B-0924", **kwargs)
    skewed = plan("allenai/OLMoE-1B-7B-0924", moe_imbalance=3.0, **kwargs)

    def row(result, label):
        return next(r for r in result.results if r.candidate.label == label)
    for label in ("fsdp ep2", "fsdp ep4"):
        assert row(skewed, label).time.tokens_per_s < row(balanced, label).time.tokens_per_s
    assert row(skewed, "fsdp").time.tokens_per_s == row(balanced, "fsdp").time.tokens_per_s
    assert any("busiest expert at 3x" in n for n in skewed.notes)
    with pytest.raises(ValueError, match="moe_imbalance"):
        plan("allenai/OLMoE-1B-7B-0924", moe_imbalance=0.5, **kwargs)


def test_the_plan_says_which_ep_layout_it_picked():
    from estimator.planning.plan import plan

    result = plan("allenai/OLMoE-1B-7B-0924", gpus=8, gpu="h100-80gb", seq_len=4096, ckpt_options=(False,),
                  methods=("fsdp",), advise=False)
    # (the context-parallel layouts join them: cp runs without ep on a MoE model too)
    assert {r.candidate.label for r in result.results} == {"fsdp", "fsdp ep2", "fsdp ep4", "fsdp ep8", "fsdp cp2",
                                                            "fsdp cp4", "fsdp cp8"}
    note = next(n for n in result.notes if n.startswith("ep: weighed FSDP2 with expert parallelism"))
    assert note.endswith(f"picked {result.best.candidate.label}" if result.best.candidate.ep > 1 else
                         f"picked {result.best.candidate.label} (no expert parallelism)")


def test_the_committed_ep_tables_stay_within_their_bounds():
    """Every row of docs/error_matrix/moe_ep.csv and moe_ep_ckpt.csv (transformers' EP on gloo ranks, every live
    storage counted: benchmarks/moe_ep_table.py) estimated again: the estimate of the busiest rank within 1 % of its
    measure. The tiny configs' profiles are traced on fake tensors here once."""
    import csv

    from benchmarks.moe_ep_table import estimated_bytes

    def errors(table: str) -> dict:
        rows = list(csv.DictReader((REPO / "docs/error_matrix" / table).open()))
        assert {r["family"] for r in rows} >= {"qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v2"}
        out = {}
        for r in rows:
            predicted = estimated_bytes(REPO / "benchmarks/configs" / r["config"], int(r["world_size"]),
                                        int(r["ep"]), r["precision"], int(r["micro_batch_size"]), int(r["seq_len"]),
                                        float(r["moe_imbalance"]), r["grad_ckpt"] == "True")
            out[(r["config"], r["world_size"], r["ep"], r["micro_batch_size"], r["routing"])] = \
                100 * (predicted - int(r["measured_bytes"])) / int(r["measured_bytes"])
        return out

    for table in ("moe_ep.csv", "moe_ep_ckpt.csv"):  # without and with checkpointing
        found = errors(table)
        assert max(abs(e) for e in found.values()) <= 1.0, {k: round(e, 3) for k, e in found.items() if abs(e) > 1}


@pytest.mark.slow  # traces the tiny Qwen3-MoE and Mixtral with attention adapters (about 40 s each)
def test_lora_on_attention_under_ep_matches_balanced_and_skewed_routing():
    """docs/error_matrix/moe_ep_lora.csv (LoRA r8 on attention, transformers' EP on 2 gloo ranks: the experts
    frozen): balanced and skewed routing within 1 % (a frozen expert's extra rows: ``EpLayout.row_bytes``,
    ``forward_transient_bytes``, ``backward_bumps``; docs/error_matrix/README.md, helper epskew)."""
    from benchmarks.moe_ep_table import estimated_bytes
    from benchmarks.table_csv import read_rows

    rows = read_rows(REPO / "docs/error_matrix/moe_ep_lora.csv")
    assert {r["family"] for r in rows} >= {"qwen3_moe", "mixtral"} and {r["routing"] for r in rows} == {
        "balanced", "skewed"}
    for r in rows:
        predicted = estimated_bytes(REPO / "benchmarks/configs" / r["config"], int(r["world_size"]), int(r["ep"]),
                                    r["precision"], int(r["micro_batch_size"]), int(r["seq_len"]),
                                    float(r["moe_imbalance"]), r["grad_ckpt"] == "True", r["lora_targets"])
        error = 100 * (predicted - int(r["measured_bytes"])) / int(r["measured_bytes"])
        assert abs(error) <= 1.0, (r["config"], r["micro_batch_size"], r["routing"], error)
