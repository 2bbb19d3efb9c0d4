"""DeepSpeed ZeRO-3 leaf modules (``zero_optimization.leaf_module``): the spec's fields, where they come from (a
DeepSpeed JSON, the command line), which modules they make leaves, and what a leaf changes (its gradients wait for
its backward; the coordinator fetches it whole). Measured: docs/error_matrix/zero3_leaf_cpu.csv."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from estimator.configs.deepspeed_json import spec_from_deepspeed
from estimator.models.params import ParamInfo
from estimator.models.zero3_leaf import leaf_holds_adapted_experts, leaf_modules
from estimator.spec import DEFAULT_LEAF_MODULE_CLASSES, ParallelSpec, RunSpec, TrainingSpec, ZeroSpec

ROOT = Path(__file__).resolve().parents[2]
# a Qwen3-MoE's parameter names: a dense first layer, then MoE layers (router + fused routed experts)
QWEN3 = (["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"]
         + [n for i in (1, 2) for n in (f"model.layers.{i}.self_attn.q_proj.weight", f"model.layers.{i}.mlp.gate.weight",
                                         f"model.layers.{i}.mlp.experts.gate_up_proj",
                                         f"model.layers.{i}.mlp.experts.down_proj")]
         + ["model.norm.weight", "lm_head.weight"])


def test_the_default_class_list_is_the_installed_deepspeed_s():
    config = pytest.importorskip("deepspeed.runtime.zero.leaf_module_config")
    assert tuple(config.DEFAULT_LEAF_MODULE_CLASSES) == DEFAULT_LEAF_MODULE_CLASSES
    assert ZeroSpec().leaf_names == tuple(config.DEFAULT_LEAF_MODULE_NAMES)
    assert ZeroSpec().leaf_name_suffixes == tuple(config.DEFAULT_LEAF_MODULE_NAME_SUFFIXES)


def test_the_default_makes_the_moe_blocks_of_its_families_leaves_and_nothing_elsewhere():
    assert leaf_modules(ZeroSpec(), QWEN3, "qwen3_moe") == ("model.layers.1.mlp", "model.layers.2.mlp")
    assert leaf_modules(ZeroSpec(), QWEN3, "deepseek_v2") == ()  # DeepSeek's block is not in the list
    assert leaf_modules(ZeroSpec(leaf_classes=()), QWEN3, "qwen3_moe") == ()


def test_names_suffixes_and_classes_resolve_to_the_outermost_modules():
    named = ZeroSpec(leaf_classes=(), leaf_names=("model.layers.2.mlp",))
    assert leaf_modules(named, QWEN3, "qwen3_moe") == ("model.layers.2.mlp",)
    experts = ZeroSpec(leaf_classes=("Qwen3MoeExperts",))
    assert leaf_modules(experts, QWEN3, "qwen3_moe") == ("model.layers.1.mlp.experts", "model.layers.2.mlp.experts")
    # a suffix inside a leaf changes nothing: no hooks reach it
    nested = ZeroSpec(leaf_name_suffixes=("mlp.experts", "layers.0"))
    assert leaf_modules(nested, QWEN3, "qwen3_moe") == ("model.layers.0", "model.layers.1.mlp", "model.layers.2.mlp")
    layers = ZeroSpec(leaf_classes=("transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeDecoderLayer",))
    assert leaf_modules(layers, QWEN3, "qwen3_moe") == ("model.layers.0", "model.layers.1", "model.layers.2")


@pytest.mark.parametrize("zero, message", [
    (ZeroSpec(leaf_names=("model.layers.7.mlp",)), "zero.leaf_names: 'model.layers.7.mlp' names no module"),
    (ZeroSpec(leaf_name_suffixes=("block_sparse_moe",)), "zero.leaf_name_suffixes: 'block_sparse_moe' ends no"),
    (ZeroSpec(leaf_classes=("MyBlock",)), "zero.leaf_classes: 'MyBlock' is not a class the estimator can find")])
def test_a_name_that_matches_nothing_is_a_one_line_error(zero, message):
    with pytest.raises(ValueError, match=message) as err:
        leaf_modules(zero, QWEN3, "qwen3_moe")
    assert "\n" not in str(err.value)


def test_the_spec_fields_take_deepspeed_s_forms_and_keep_ids_at_the_default():
    assert ZeroSpec(leaf_names="model.layers.1.mlp").leaf_names == ("model.layers.1.mlp",)  # a lone string
    assert ZeroSpec(leaf_classes=["A", "A", "B"]).leaf_classes == ("A", "B")  # DeepSpeed dedupes in order
    with pytest.raises(ValueError, match="zero.leaf_names: must be a list of module names"):
        ZeroSpec(leaf_names=[3])
    spec = RunSpec(parallel=ParallelSpec(method="zero3", world_size=2))
    cleared = spec.replace(**{"parallel.zero": ZeroSpec(leaf_classes=())})
    assert "leaf_classes" not in spec._canonical_dict()["parallel"]["zero"]
    assert cleared.spec_id != spec.spec_id
    assert RunSpec.from_json(cleared.to_json()) == cleared


def test_columns_keep_a_cleared_list_apart_from_an_empty_cell():
    from estimator.columns import spec_columns, spec_from_columns

    spec = RunSpec(parallel=ParallelSpec(method="zero3", world_size=2,
                                         zero=ZeroSpec(leaf_classes=(), leaf_names=("model.layers.1.mlp",))))
    row = {k: "" if v is None else str(v) for k, v in spec_columns(spec).items()} | {"world_size": "2"}
    assert row["zero_leaf_classes"] == "[]"
    assert spec_from_columns(row) == spec
    old_table = {**row, "zero_leaf_classes": "", "zero_leaf_names": ""}  # written before the columns existed
    assert spec_from_columns(old_table).parallel.zero.leaf_classes == DEFAULT_LEAF_MODULE_CLASSES


def test_a_deepspeed_json_s_leaf_module_is_read():
    base = RunSpec(parallel=ParallelSpec(method="zero2", world_size=2))
    spec = spec_from_deepspeed({"zero_optimization": {"stage": 3, "leaf_module": {
        "classes": [], "names": "model.layers.1.mlp"}}}, base, 128)
    zero = spec.parallel.zero
    assert (zero.leaf_classes, zero.leaf_names, zero.leaf_name_suffixes) == ((), ("model.layers.1.mlp",), ())
    suffixes = spec_from_deepspeed({"zero_optimization": {"stage": 3, "leaf_module": {"name_suffixes": ["mlp"]}}},
                                   base, 128).parallel.zero
    assert suffixes.leaf_classes == DEFAULT_LEAF_MODULE_CLASSES and suffixes.leaf_name_suffixes == ("mlp",)
    assert spec_from_deepspeed({"zero_optimization": {"stage": 3}}, base, 128).parallel.zero == ZeroSpec()
    for bad, key in (({"class": []}, "leaf_module.class: unknown key"), (3, "leaf_module: must be an object"),
                     ({"names": [1]}, "leaf_module.names: must be a list of strings")):
        with pytest.raises(ValueError, match=f"deepspeed: zero_optimization.{key}"):
            spec_from_deepspeed({"zero_optimization": {"stage": 3, "leaf_module": bad}}, base, 128)


def test_the_harness_writes_leaf_module_only_where_it_is_not_deepspeed_s_default():
    from harness.methods.deepspeed import zero_section

    spec = RunSpec(parallel=ParallelSpec(method="zero3", world_size=2))
    assert "leaf_module" not in zero_section(spec)
    cleared = spec.replace(**{"parallel.zero": ZeroSpec(leaf_classes=(), leaf_name_suffixes=("mlp",))})
    assert zero_section(cleared)["leaf_module"] == {"classes": [], "names": [], "name_suffixes": ["mlp"]}
    assert not {"leaf_classes", "leaf_names", "leaf_name_suffixes"} & set(zero_section(cleared))


def test_the_command_line_sets_the_leaf_modules_for_zero3_only():
    from estimator.io.cli import build_parser, spec_from_args

    args = build_parser().parse_args(["--model", "x", "--method", "zero3", "--gpus", "2", "--zero3-leaf-classes",
                                      "none", "--zero3-leaf-names", "model.layers.1.mlp,model.layers.3.mlp"])
    zero = spec_from_args(args)[0].parallel.zero
    assert zero.leaf_classes == () and zero.leaf_names == ("model.layers.1.mlp", "model.layers.3.mlp")
    args = build_parser().parse_args(["--model", "x", "--method", "fsdp", "--gpus", "2", "--zero3-leaf-classes", ""])
    with pytest.raises(ValueError, match="--zero3-leaf-classes: ZeRO-3 leaf modules apply to --method zero3"):
        spec_from_args(args)


def _grad(name: str, numel: int) -> ParamInfo:
    return ParamInfo(name=name, shape=(numel,), numel=numel, elem_bytes=2, trainable=True, module_kind="linear",
                     layer=0)


def test_a_leaf_s_gradients_wait_for_its_last_one():
    """Without a leaf, each gradient that fits the bucket is freed by its own hook; in a leaf, every gradient of the
    module is alive until its last arrives (DeepSpeed reduces them in the module's full backward hook)."""
    from estimator.methods.state import _leaf_held, _stage2_held

    order = [_grad("m.layers.0.mlp.experts.down_proj", 10), _grad("m.layers.0.mlp.experts.gate_up_proj", 20),
             _grad("m.layers.0.mlp.gate.weight", 4), _grad("m.layers.0.self_attn.q_proj.weight", 8)]
    plain_arrival, plain_after = _stage2_held(order, bucket=100)
    assert plain_arrival == [0, 20, 40, 8, 16] and plain_after == [0] * 5
    arrival, after = _leaf_held(order, 100, ("m.layers.0.mlp",))
    assert arrival == [0, 20, 60, 68, 16]  # all three at the router's gradient, then freed together
    assert after == [0, 20, 60, 0, 0]
    assert _leaf_held(order, 100, ()) == (plain_arrival, plain_after)


def test_the_coordinator_fetches_a_leaf_whole_and_nothing_inside_it():
    from estimator.reserved.zero3_gathers import Module, with_leaves

    forward = [Module("m.layers.0", ()), Module("m.layers.0.mlp", ()), Module("m.layers.0.mlp.gate", ("g",)),
               Module("m.layers.0.mlp.experts", ("gu", "d")), Module("m.norm", ("n",))]
    backward = [Module("m.norm", ("n",)), Module("m.layers.0.mlp.experts", ("gu", "d")),
                Module("m.layers.0.mlp.gate", ("g",)), Module("m.layers.0.mlp", (), released_in_backward=True)]
    fw, bw = with_leaves(forward, backward, ("m.layers.0.mlp",))
    assert [(m.name, m.params) for m in fw] == [("m.layers.0", ()), ("m.layers.0.mlp", ("g", "gu", "d")),
                                                ("m.norm", ("n",))]
    assert [(m.name, m.params) for m in bw] == [("m.norm", ("n",)), ("m.layers.0.mlp", ("g", "gu", "d"))]
    assert with_leaves(forward, backward, ()) == (forward, backward)


@pytest.mark.parametrize("zero, in_leaf", [
    (ZeroSpec(), True), (ZeroSpec(leaf_classes=()), False),
    (ZeroSpec(leaf_classes=(), leaf_names=("model.layers.2.mlp",)), True),
    (ZeroSpec(leaf_classes=(), leaf_names=("model.layers.2.self_attn",)), False),
    (ZeroSpec(leaf_classes=(), leaf_name_suffixes=("experts",)), True),
    (ZeroSpec(leaf_classes=(), leaf_name_suffixes=("self_attn",)), False)])
def test_expert_adapters_are_refused_under_zero3_where_a_leaf_holds_them(zero, in_leaf):
    """The harness's run fails where the experts' adapters sit in a leaf (moe_methods.csv, zero3+lora-experts on
    Qwen3-MoE); with the leaf classes cleared it runs (docs/LOG.md session 32: within 0.2 %)."""
    from estimator.models.moe import fused_expert_adapters_refusal

    adapters = ["mlp.experts.lora_A.default.weight", "mlp.experts.lora_B.default.weight"]
    assert leaf_holds_adapted_experts(zero, "qwen3_moe", "model.layers", adapters) is in_leaf
    spec = RunSpec(model="x", parallel=ParallelSpec(method="zero3", world_size=2, zero=zero),
                   training=TrainingSpec(lora_rank=8, lora_targets="gate_proj,up_proj,down_proj"))
    refusal = fused_expert_adapters_refusal(spec, True, "qwen3_moe", in_leaf)
    assert (refusal is not None) is in_leaf


@pytest.mark.slow  # traces the tiny model's profile where the cache has none
def test_the_estimate_refuses_a_leaf_name_the_model_has_not():
    from estimator.api import estimate

    spec = RunSpec(model=str(ROOT / "benchmarks" / "configs" / "qwen3_moe_tiny.json"),
                   parallel=ParallelSpec(method="zero3", world_size=2,
                                         zero=ZeroSpec(leaf_names=("model.layers.9.mlp",))),
                   training=TrainingSpec(precision="bf16", attn="eager", micro_batch_size=1, seq_len=64))
    with pytest.raises(ValueError, match="zero.leaf_names: 'model.layers.9.mlp' names no module of qwen3_moe"):
        estimate(spec)
    named = dataclasses.replace(spec.parallel.zero, leaf_names=("model.layers.1.mlp",))
    assert estimate(spec.replace(**{"parallel.zero": named})).peak_allocated_bytes > 0
