"""Baselines (estimator.baselines.equations) against hand-computed numbers and against DeepSpeed's / accelerate's own code.

Hand numbers use two tables:
* TINY: a 2-layer OPT (hidden 64, ffn 256, vocab 1000, 128 positions). It is built for real in ``tiny_opt`` and
  checked tensor by tensor against the hand-written list, so the DeepSpeed and accelerate cross-checks run on
  the same model.
* BIG: a synthetic table (a 50 Mi-element embedding plus 30 linear weights of 4 Mi), large enough to exercise
  Gemini's chunk search and LLMem's 2 MiB rounding.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from estimator.baselines import equations as B
from estimator.models.arch import arch_from_config, load_config
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec, ZeroSpec

MIB = 1 << 20
Mi = 1 << 20  # elements


@dataclass(frozen=True)
class Row:
    """The fields of ``estimator.models.params.ParamInfo`` the baselines read."""

    name: str
    shape: tuple[int, ...]
    numel: int
    module_kind: str
    layer: int | None = None
    tied_names: tuple[str, ...] = ()

    @property
    def is_bias(self) -> bool:
        return self.name.endswith("bias")


def param_table_from_model(model) -> list[Row]:
    """Test stand-in for model_params.param_table: named_parameters (ties once) + the owning module's type."""
    import torch

    owners: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(param), []).append((f"{module_name}.{name}" if module_name else name, module))
    rows = []
    for name, param in model.named_parameters(remove_duplicate=True):
        module = dict(owners[id(param)])[name]
        kind = ("embedding" if isinstance(module, torch.nn.Embedding) else
                "linear" if isinstance(module, torch.nn.Linear) else
                "norm" if "norm" in type(module).__name__.lower() else "other")
        layer = re.search(r"\.(\d+)\.", name)
        rows.append(Row(name, tuple(param.shape), param.numel(), kind, int(layer.group(1)) if layer else None,
                        tuple(n for n, _ in owners[id(param)] if n != name)))
    return rows


TINY_CONFIG = {**load_config("facebook/opt-125m"), "hidden_size": 64, "ffn_dim": 256, "num_hidden_layers": 2,
               "num_attention_heads": 4, "vocab_size": 1000, "max_position_embeddings": 128,
               "word_embed_proj_dim": 64, "_name_or_path": "tiny-opt"}
TINY_ARCH = arch_from_config(TINY_CONFIG)


def _tiny_rows() -> list[Row]:
    rows = [Row("model.decoder.embed_tokens.weight", (1000, 64), 64_000, "embedding", None, ("lm_head.weight",)),
            Row("model.decoder.embed_positions.weight", (130, 64), 8_320, "embedding"),
            Row("model.decoder.final_layer_norm.weight", (64,), 64, "norm"),
            Row("model.decoder.final_layer_norm.bias", (64,), 64, "norm")]
    for i in range(2):
        p = f"model.decoder.layers.{i}."
        for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):
            rows += [Row(f"{p}self_attn.{proj}.weight", (64, 64), 4096, "linear", i),
                     Row(f"{p}self_attn.{proj}.bias", (64,), 64, "linear", i)]
        rows += [Row(f"{p}self_attn_layer_norm.weight", (64,), 64, "norm", i),
                 Row(f"{p}self_attn_layer_norm.bias", (64,), 64, "norm", i),
                 Row(f"{p}fc1.weight", (256, 64), 16_384, "linear", i), Row(f"{p}fc1.bias", (256,), 256, "linear", i),
                 Row(f"{p}fc2.weight", (64, 256), 16_384, "linear", i), Row(f"{p}fc2.bias", (64,), 64, "linear", i),
                 Row(f"{p}final_layer_norm.weight", (64,), 64, "norm", i),
                 Row(f"{p}final_layer_norm.bias", (64,), 64, "norm", i)]
    return rows


TINY = _tiny_rows()
TINY_P = 172_416          # 64,000 + 8,320 + 2 x 49,984 + 128

BIG_ARCH = arch_from_config({"model_type": "opt", "hidden_size": 1024, "num_hidden_layers": 3,
                             "num_attention_heads": 16, "vocab_size": 51_200, "tie_word_embeddings": True})
BIG = ([Row("embed.weight", (51_200, 1024), 50 * Mi, "embedding", None, ("lm_head.weight",))]
       + [Row(f"layers.{i // 10}.w{i % 10}.weight", (2048, 2048), 4 * Mi, "linear", i // 10) for i in range(30)])


def run(method="single", world=1, tp=1, bs=1, sl=512, gpu="v100-16gb", precision="mixed_fp16", **zero) -> RunSpec:
    return RunSpec(model="x", gpu=gpu, parallel=ParallelSpec(method=method, world_size=world, tp=tp,
                                                             zero=ZeroSpec(**zero)),
                   training=TrainingSpec(micro_batch_size=bs, seq_len=sl, precision=precision))


def module_from_rows(rows: list[Row]):
    """A plain torch module with exactly these tensors (Embedding / Linear / LayerNorm owners, ties kept).

    It stands in for the transformers-built model in the fast tests (importing a transformers model costs
    seconds); ``test_tiny_rows_are_hf_opt`` checks that the rows are the real OPT's."""
    import torch

    root = torch.nn.Module()

    def place(path: str, module: torch.nn.Module) -> torch.nn.Module:
        parent = root
        *parents, leaf = path.split(".")
        for part in parents:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(leaf, module)
        return module

    by_module: dict[str, list[Row]] = {}
    for row in rows:
        by_module.setdefault(row.name.rsplit(".", 1)[0], []).append(row)
    ties = []
    for path, owned in by_module.items():
        weight = owned[0]
        if weight.module_kind == "embedding":
            module = place(path, torch.nn.Embedding(*weight.shape))
        elif weight.module_kind == "linear":
            module = place(path, torch.nn.Linear(weight.shape[1], weight.shape[0], bias=len(owned) > 1))
        else:
            module = place(path, torch.nn.LayerNorm(weight.shape[0]))
        ties += [(name, module.weight) for name in weight.tied_names]
    for name, tensor in ties:
        place(name.rsplit(".", 1)[0], torch.nn.Linear(tensor.shape[1], tensor.shape[0], bias=False)).weight = tensor
    return root


@pytest.fixture(scope="module")
def tiny_opt():
    return module_from_rows(TINY)


def test_tiny_table_round_trips(tiny_opt):
    assert param_table_from_model(tiny_opt) == TINY
    assert B.total_params(TINY) == TINY_P
    assert B.largest_layer_params(TINY) == 64_000      # embed_tokens (and the tied lm_head module)


@pytest.mark.slow
def test_tiny_rows_are_hf_opt():
    from estimator.profiler.build import build_model

    assert param_table_from_model(build_model(TINY_CONFIG, TrainingSpec(), meta=True)) == TINY


# --- LLMem -----------------------------------------------------------------------------------------------------
def test_gemini_chunk_search_by_hand():
    numels = tuple(p.numel for p in BIG)
    plan = B.gemini_chunk_plan(numels)
    # 50 Mi > mean + 3 sigma -> dedicated chunk. Candidate sizes start at 32 Mi (8 tensors per chunk, 8 Mi left
    # unused); 40 Mi holds 10 tensors with nothing left, the first zero-waste size.
    assert plan == B.ChunkPlan(chunk_size=40 * Mi, outliers=(50 * Mi,), chunked_numel=120 * Mi, waste=0,
                               keep_gathered=False)
    assert B.gemini_chunk_plan(numels, 3).chunk_size == 40 * Mi + 2      # rounded up to the DP degree
    small = B.gemini_chunk_plan(tuple(p.numel for p in TINY))           # < 32 Mi elements: one gathered chunk
    assert small == B.ChunkPlan(TINY_P, (), TINY_P, 0, True)


def test_llmem_single_by_hand():
    est = B.llmem(BIG_ARCH, BIG, run(), m_base_bytes=500 * MIB)
    assert {k: v // MIB for k, v in est.breakdown.items()} == {
        "m_base": 500,
        "chunks": 1020,              # (50 Mi + 3 x 40 Mi) x 6 B
        "gather_fp16": 0,
        "optimizer_states": 1360,    # embedding 2 x 200 + 30 x 2 x 16; the tied lm_head (last tensor) has none
        "lm_p": 100,                 # 2 B x 50 Mi
        "input_ids": 2,
        "m_out": 10,                 # 2 embeddings + 3 layers, 1 MiB each -> 2 MiB each
        "m_lm": 150,                 # fp16 logits 50 MiB + 2 x 49.9 MiB -> 50 MiB each
        "m_back": 0,
    }
    assert est.total_bytes == 3142 * MIB == sum(est.breakdown.values())
    assert est.details["chunk_size_elements"] == 40 * Mi and est.details["fp32_logits"] is False
    # CDP is m_peak^s whatever the world size
    assert B.llmem(BIG_ARCH, BIG, run("ddp", 4), m_base_bytes=500 * MIB) == est


def test_llmem_fp32_logits_for_codegen_and_gpt_neo():
    codegen = arch_from_config({**BIG_ARCH.config, "model_type": "codegen"})
    est = B.llmem(codegen, BIG, run(), m_base_bytes=0)
    assert est.breakdown["m_lm"] == 300 * MIB             # 4 B logits: 100 + 2 x 100 MiB
    assert est.details["fp32_logits"] is True
    neox = arch_from_config({**BIG_ARCH.config, "model_type": "gpt_neox"})   # 'neo' in the name, fp16 logits
    assert B.llmem(neox, BIG, run(), m_base_bytes=0).breakdown["m_lm"] == 150 * MIB


def test_llmem_adp_by_hand():
    for method in ("zero3", "fsdp"):
        est = B.llmem(BIG_ARCH, BIG, run(method, 4), m_base_bytes=0)
        b = {k: v // MIB for k, v in est.breakdown.items()}
        assert b["chunks"] == 256                  # 1020 / 4 = 255 -> 256
        assert b["gather_fp16"] == 76 + 30 * 6    # 3/4 of each fp16 tensor: 75 -> 76, 6 each
        assert b["optimizer_states"] == 100 + 30 * 8
        assert est.total_bytes == (256 + 256 + 340 + 100 + 2 + 10 + 150) * MIB


def test_llmem_small_model_chunks_stay_gathered():
    rows = [Row("embed.weight", (4096, 4096), 16 * Mi, "embedding"), Row("w.weight", (2048, 2048), 4 * Mi, "linear")]
    # 20 Mi elements < Gemini's 32 Mi minimum: one keep-gathered chunk, not sharded over DP (120 MiB, not 30)
    assert B.llmem(BIG_ARCH, rows, run("zero3", 4), m_base_bytes=0).breakdown["chunks"] == 120 * MIB
    assert B.llmem(BIG_ARCH, rows, run("tp", 4, tp=4), m_base_bytes=0).breakdown["chunks"] == 30 * MIB
    assert B.llmem(BIG_ARCH, rows, run("dp_tp", 4, tp=2), m_base_bytes=0).breakdown["chunks"] == 60 * MIB


def test_llmem_tp_and_dp_tp_by_hand():
    tp = B.llmem(BIG_ARCH, BIG, run("tp", 4, tp=4), m_base_bytes=0)
    assert tp.breakdown["gather_fp16"] == 0
    assert tp.breakdown["m_back"] == 2 * 2 * MIB             # L-1 = 2 layers x 0.75 MiB -> 2 MiB
    assert tp.total_bytes == (256 + 340 + 100 + 2 + 10 + 150 + 4) * MIB
    hybrid = B.llmem(BIG_ARCH, BIG, run("dp_tp", 4, tp=2), m_base_bytes=0)
    assert hybrid.breakdown["gather_fp16"] == (26 + 30 * 2) * MIB   # (4 - 2 - 1)/4 of each fp16 tensor
    assert hybrid.breakdown["m_back"] == 4 * MIB
    assert hybrid.total_bytes == (256 + 86 + 340 + 100 + 2 + 10 + 150 + 4) * MIB


def test_llmem_tiny_model_by_hand():
    est = B.llmem(TINY_ARCH, TINY, run(bs=2, sl=128), m_base_bytes=512 * MIB)
    # every tensor is under 2 MiB, so each rounds to one unit: 26 optimizer tensors x 2 states (the tied head,
    # last, gets lm_p only), 2 + 2 activation tensors, 3 logit tensors
    assert {k: v // MIB for k, v in est.breakdown.items()} == {
        "m_base": 512, "chunks": 2, "gather_fp16": 0, "optimizer_states": 104, "lm_p": 2, "input_ids": 2,
        "m_out": 8, "m_lm": 6, "m_back": 0}


def test_llmem_m_base_from_coefficients():
    est = B.llmem(TINY_ARCH, TINY, run(gpu="h100-80gb"))
    from estimator.hardware.residuals import load_coefficients

    assert est.breakdown["m_base"] == load_coefficients("h100-80gb").cuda_context_bytes


def test_llmem_max_batch_search():
    # bs 1..4 at m_base 0: 2642, 2792, 2952, 3102 MiB
    totals = [B.llmem(BIG_ARCH, BIG, run(bs=bs), m_base_bytes=0).total_bytes // MIB for bs in (1, 2, 3, 4)]
    assert totals == [2642, 2792, 2952, 3102]
    bs, est = B.llmem_max_batch(BIG_ARCH, BIG, run(), capacity_bytes=3000 * MIB, m_base_bytes=0)
    assert (bs, est.total_bytes) == (3, 2952 * MIB)
    bs, est = B.llmem_max_batch(BIG_ARCH, BIG, run(), capacity_bytes=2600 * MIB, m_base_bytes=0)
    assert (bs, est.total_bytes) == (0, 2642 * MIB)
    # default m_total: the catalogue capacity (LLMem's V100: 16,384 MiB)
    bs, est = B.llmem_max_batch(BIG_ARCH, BIG, run(gpu="v100-16gb"), m_base_bytes=0)
    assert est.total_bytes <= 16_384 * MIB < B.llmem(BIG_ARCH, BIG, run(bs=bs + 1), m_base_bytes=0).total_bytes


def test_llmem_refuses_methods_it_does_not_model():
    with pytest.raises(ValueError, match="^llmem: method 'zero2' is not one LLMem models"):
        B.llmem(BIG_ARCH, BIG, run("zero2", 4), m_base_bytes=0)


# --- DeepSpeed ---------------------------------------------------------------------------------------------------
def test_deepspeed_zero2_by_hand():
    est = B.deepspeed_model_states(TINY, run("zero2", 4))
    assert est.breakdown == {"params_16bit": 2 * TINY_P, "grads_master_optimizer_sharded": 18 * TINY_P // 4}
    assert est.total_bytes == 1_120_704 and est.host_bytes == TINY_P * 4 * 4 * 3 // 2
    offload = B.deepspeed_model_states(TINY, run("zero_offload", 4, offload_optimizer=True))
    assert offload.total_bytes == 344_832 and offload.host_bytes == TINY_P * 16 * 3 // 2
    zero1 = B.deepspeed_model_states(TINY, run("zero1", 4))
    assert zero1.total_bytes == est.total_bytes and any("ZeRO-1" in n for n in zero1.notes)


def test_deepspeed_zero3_by_hand():
    est = B.deepspeed_model_states(TINY, run("zero3", 4))
    assert est.breakdown == {"largest_layer": 4 * 64_000, "params_grads_master_optimizer_sharded": 775_872}
    assert est.total_bytes == 1_031_872
    opt = B.deepspeed_model_states(TINY, run("zero3", 4, offload_optimizer=True))
    assert opt.total_bytes == 256_000 + 86_208
    both = B.deepspeed_model_states(TINY, run("zero_offload", 4, offload_optimizer=True, offload_param=True))
    assert both.total_bytes == 256_000 and both.name == "deepspeed_zero3"


@pytest.mark.parametrize("method, world, nodes, opt, param", [
    ("zero2", 1, 1, False, False), ("zero2", 8, 2, False, False), ("zero_offload", 4, 1, True, False),
    ("zero3", 4, 1, False, False), ("zero3", 16, 2, True, False), ("zero_offload", 8, 2, True, True),
    ("zero3", 2, 1, False, True), ("zero_offload", 4, 1, False, True), ("zero_offload", 2, 1, False, False),
])
def test_deepspeed_matches_deepspeed(tiny_opt, method, world, nodes, opt, param):
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    est = B.deepspeed_model_states(param_table_from_model(tiny_opt),
                                   run(method, world, offload_optimizer=opt, offload_param=param), num_nodes=nodes)
    cpu_offload = opt or (method == "zero_offload" and not param)
    if est.name == "deepspeed_zero2":
        total = stage_1_and_2.model_to_params(tiny_opt)
        cpu, gpu = stage_1_and_2.estimate_zero2_model_states_mem_needs(
            total, num_gpus_per_node=world // nodes, num_nodes=nodes, cpu_offload=cpu_offload)
    else:
        total, largest = stage3.model_to_params(tiny_opt)
        cpu, gpu, _ = stage3.estimate_zero3_model_states_mem_needs(
            total, largest, num_gpus_per_node=world // nodes, num_nodes=nodes,
            cpu_offload=cpu_offload, cpu_offload_params=param)
    assert (est.total_bytes, est.host_bytes) == (gpu, cpu)


def test_deepspeed_all_cold_printout_agrees(capsys):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold

    estimate_zero3_model_states_mem_needs_all_cold(TINY_P, 64_000, num_gpus_per_node=4)
    row = [line for line in capsys.readouterr().out.splitlines() if "offload_param=none, offload_optimizer=none"
           in line][0]
    gpu_gb = float(row.split("|")[1].strip().split("GB")[0])
    assert gpu_gb == round(B.deepspeed_model_states(TINY, run("zero3", 4)).total_bytes / 2**30, 2)


def test_deepspeed_refuses_non_zero_methods():
    with pytest.raises(ValueError, match="^deepspeed: method 'ddp' has no DeepSpeed estimator"):
        B.deepspeed_model_states(TINY, run("ddp", 2))
    with pytest.raises(ValueError, match="^num_nodes:"):
        B.deepspeed_model_states(TINY, run("zero2", 4), num_nodes=3)


# --- accelerate and the rule of thumb --------------------------------------------------------------------------
def test_accelerate_by_hand():
    assert B.accelerate_estimate(TINY, run(precision="mixed_bf16")).total_bytes == 8 * TINY_P
    assert B.accelerate_estimate(TINY, run(precision="amp_fp16")).total_bytes == 8 * TINY_P
    fp32 = B.accelerate_estimate(TINY, run(precision="fp32"))
    assert fp32.total_bytes == 16 * TINY_P and fp32.details["stages"]["step"] == 16 * TINY_P
    assert B.accelerate_estimate(TINY, run(precision="bf16"), buffer_bytes=100).total_bytes == 8 * TINY_P + 200


@pytest.mark.parametrize("precision", ["fp32", "mixed_bf16", "amp_fp16"])
def test_accelerate_matches_accelerate(tiny_opt, precision):
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils.modeling import calculate_maximum_sizes

    total_size, _ = calculate_maximum_sizes(tiny_opt)   # fp32 model, parameters + buffers
    buffers = sum(b.numel() * b.element_size() for b in tiny_opt.buffers())
    expected = max(estimate_training_usage(total_size, B.accelerate_dtype(precision)).values())
    got = B.accelerate_estimate(param_table_from_model(tiny_opt), run(precision=precision), buffer_bytes=buffers)
    assert got.total_bytes == expected


def test_rule_of_thumb():
    assert B.rule_of_thumb(TINY).total_bytes == 8 * TINY_P
    assert B.rule_of_thumb(BIG, bytes_per_param=16).total_bytes == 16 * (170 * Mi)


def test_works_on_model_params_rows():
    """The lead's ParamInfo (estimator.models.params) carries every field the baselines read."""
    model_params = pytest.importorskip("estimator.models.params")
    rows = [model_params.ParamInfo(name=r.name, shape=r.shape, numel=r.numel, elem_bytes=2, trainable=True,
                                   module_kind=r.module_kind, layer=r.layer, tied_names=r.tied_names) for r in TINY]
    assert B.llmem(TINY_ARCH, rows, run(), m_base_bytes=0) == B.llmem(TINY_ARCH, TINY, run(), m_base_bytes=0)
    assert B.deepspeed_model_states(rows, run("zero3", 4)).total_bytes == 1_031_872
