"""ZeRO-3's parameter coordinator on architectures other than Llama: the module trace recorded in the profile
(``estimator.profiler.modules``), stretched to full depth (``estimator.models.modules``) and followed by the
gathers' emulation (``estimator.reserved.zero3_gathers.recorded_modules``).

The fast tests read the shipped profiles of OPT-1.3b, Pythia-1b and BLOOM-1b1 (their traces added with
``python -m estimator.profiler.add_module_trace facebook/opt-1.3b EleutherAI/pythia-1b bigscience/bloom-1b1``); the slow
ones record a tiny Llama's trace against the derived one, and compare the generated allgather stream with real
DeepSpeed runs on CPU (``benchmarks/zero3_arch_replay.py``, ``docs/error_matrix/zero3_arch_cpu.csv``).
"""

from __future__ import annotations

import math

import pytest

from estimator.models.modules import module_trace_at_depth
from estimator.reserved.zero3 import recorded_trace
from estimator.reserved.zero3_gathers import emulate, modules_of

TRAINING = {"precision": "mixed_bf16", "micro_batch_size": 2, "seq_len": 1024}
# per decoder layer, the modules' pre-forward order (each with its direct parameters' count) and the backward's
LAYERS = {
    "facebook/opt-1.3b": (
        [("", 0), ("self_attn_layer_norm", 2), ("self_attn", 0), ("self_attn.q_proj", 2), ("self_attn.k_proj", 2),
         ("self_attn.v_proj", 2), ("self_attn.out_proj", 2), ("final_layer_norm", 2), ("fc1", 2),
         ("activation_fn", 0), ("fc2", 2)],
        ["", "fc2", "activation_fn", "fc1", "final_layer_norm", "self_attn", "self_attn.out_proj",
         "self_attn.v_proj", "self_attn.k_proj", "self_attn.q_proj", "self_attn_layer_norm"]),
    "EleutherAI/pythia-1b": (  # parallel residual: the MLP reads the layer's input through its own norm
        [("", 0), ("input_layernorm", 2), ("attention", 0), ("attention.query_key_value", 2),
         ("attention.dense", 2), ("post_attention_dropout", 0), ("post_attention_layernorm", 2), ("mlp", 0),
         ("mlp.dense_h_to_4h", 2), ("mlp.act", 0), ("mlp.dense_4h_to_h", 2), ("post_mlp_dropout", 0)],
        ["", "post_mlp_dropout", "mlp", "mlp.dense_4h_to_h", "mlp.act", "mlp.dense_h_to_4h",
         "post_attention_layernorm", "post_attention_dropout", "attention", "attention.dense",
         "attention.query_key_value", "input_layernorm"]),
    "bigscience/bloom-1b1": (
        [("", 0), ("input_layernorm", 2), ("self_attention", 0), ("self_attention.query_key_value", 2),
         ("self_attention.attention_dropout", 0), ("self_attention.dense", 2), ("post_attention_layernorm", 2),
         ("mlp", 0), ("mlp.dense_h_to_4h", 2), ("mlp.gelu_impl", 0), ("mlp.dense_4h_to_h", 2)],
        ["", "mlp", "mlp.dense_4h_to_h", "mlp.gelu_impl", "mlp.dense_h_to_4h", "post_attention_layernorm",
         "self_attention", "self_attention.dense", "self_attention.attention_dropout",
         "self_attention.query_key_value", "input_layernorm"]),
}
# the modules before the layers (forward), after them, and the head's parameter (tied: the embedding's)
ENDS = {
    "facebook/opt-1.3b": (["", "model.decoder", "model.decoder.embed_tokens", "model.decoder.embed_positions"],
                          ["model.decoder.final_layer_norm", "lm_head"], "model.decoder.embed_tokens.weight"),
    "EleutherAI/pythia-1b": (["", "gpt_neox", "gpt_neox.embed_in", "gpt_neox.emb_dropout", "gpt_neox.rotary_emb"],
                             ["gpt_neox.final_layer_norm", "lm_head"], "lm_head.weight"),
    "bigscience/bloom-1b1": (["", "transformer", "transformer.word_embeddings",
                              "transformer.word_embeddings_layernorm"],
                             ["transformer.ln_f", "lm_head"], "transformer.word_embeddings.weight"),
}


def _table(model: str):
    from estimator import api
    from estimator.spec import TrainingSpec

    arch, profile = api.load_model_profile(model, TrainingSpec(**TRAINING), 1, allow_build=False)
    return arch, api._param_table(profile, arch.num_layers)


@pytest.mark.parametrize("model", list(LAYERS))
def test_the_recorded_trace_has_each_architectures_module_order(model):
    """Every decoder layer's modules in the order their hooks fire, forward and backward, with their direct
    parameters (biases included); the embeddings, whose positional inputs need no gradient, are not released in
    backward;
    the head fetches the embedding where it is tied."""
    arch, table = _table(model)
    forward, backward = modules_of(table, recorded_trace(table))
    layer_forward, layer_backward = LAYERS[model]
    before, after, head = ENDS[model]
    prefix = forward[len(before)].name
    assert prefix.endswith(".0")
    base = prefix[:-2]
    per_layer = [(f"{base}.{i}" + (f".{n}" if n else ""), k) for i in range(arch.num_layers)
                 for n, k in layer_forward]
    assert [m.name for m in forward] == before + [n for n, _ in per_layer] + after
    assert [len(m.params) for m in forward[len(before):-len(after)]] == [k for _, k in per_layer]
    assert forward[-1].params == (head,)
    layers_back = [m.name for m in backward if m.name.startswith(f"{base}.")]
    assert layers_back == [f"{base}.{i}" + (f".{n}" if n else "") for i in reversed(range(arch.num_layers))
                           for n in layer_backward]
    assert [m.name for m in backward[:2]] == ["", "lm_head"]
    assert not backward[-1].released_in_backward and backward[-1].name == before[2]
    # (a module called with keyword inputs only, as OPT's attention, is not released either: it holds none)
    assert all(m.released_in_backward for m in backward if m.name.startswith(f"{base}.") and m.params)


@pytest.mark.parametrize("model", list(LAYERS))
def test_the_trace_recording_step_gathers_each_module_alone(model):
    """The first step (no prefetch) gathers each module's direct parameters in one call: one tensor into its own
    padded storage, a weight and its bias into one flat tensor of both padded partitions; the embeddings are
    released only at backward's end."""
    _, table = _table(model)
    world = 8
    by_name = {p.name: p for p in table}
    forward, _ = modules_of(table, recorded_trace(table))
    ops = emulate(table, world, steps=1, recorded=recorded_trace(table))
    gathers = [c[1] for c in ops.calls[0] if c[0] == "G"]
    assert gathers[:len([m for m in forward if m.params])] == [tuple(sorted(
        m.params, key=[p.name for p in table].index)) for m in forward if m.params]
    made = [nbytes for sign, _, nbytes in ops.steps[0] if sign > 0]
    first = next(m for m in forward if m.params)
    embedding = by_name[first.params[0]]
    assert made[0] == math.ceil(embedding.numel / world) * world * embedding.elem_bytes
    released = [c[1] for c in ops.calls[0] if c[0] == "R"]
    assert released[-1] in (first.params[0], *(n for m in forward[:4] for n in m.params))


def test_a_trace_stretches_to_full_depth_or_not_at_all():
    """The generic traced layer repeated for every layer (forward ascending, backward descending), the modules
    outside the layers kept where they ran; a module outside the layers between two of them, or layers that
    differ, leave no trace (the replay refuses)."""
    def layer(i):
        return [[i, "", [], 1], [i, "fc", ["fc.weight"], 1]]

    trace = {"forward": [[None, "embed", ["embed.weight"], 0]] + layer(0) + layer(1) + layer(2)
             + [[None, "head", ["head.weight"], 1]],
             "backward": [[None, "head"]] + [[i, n] for i in (2, 1, 0) for n in ("", "fc")] + [[None, "embed"]]}
    forward, backward = module_trace_at_depth(trace, "layers", 4)
    assert forward == [("embed", ("embed.weight",), 0)] + [
        (f"layers.{i}" + s, ((f"layers.{i}.fc.weight",) if s else ()), 1) for i in range(4) for s in ("", ".fc")
    ] + [("head", ("head.weight",), 1)]
    assert backward == ["head"] + [f"layers.{i}{s}" for i in (3, 2, 1, 0) for s in ("", ".fc")] + ["embed"]
    between = {**trace, "forward": layer(0) + [[None, "norm", [], 1]] + layer(1) + layer(2)}
    assert module_trace_at_depth(between, "layers", 4) is None
    differing = {**trace, "forward": layer(0) + layer(1) + [[2, "", [], 1]]}
    assert module_trace_at_depth(differing, "layers", 4) is None


def test_a_first_layer_that_runs_apart_keeps_its_own_modules():
    """Under LoRA the first layer's input needs no gradient (a frozen embedding): its modules' inputs count none
    and backward reaches fewer of them; that layer is kept as recorded, the generic one repeated after it."""
    def layer(i, grad=1, modules=("", "fc")):
        return [[i, n, [f"{n}.weight"] if n else [], grad] for n in modules]

    trace = {"forward": [[None, "embed", ["embed.weight"], 0]] + layer(0, 0) + layer(1) + layer(2),
             "backward": [[i, n] for i in (2, 1) for n in ("", "fc")] + [[0, "fc"]]}
    forward, backward = module_trace_at_depth(trace, "layers", 4)
    assert forward[1:3] == [("layers.0", (), 0), ("layers.0.fc", ("layers.0.fc.weight",), 0)]
    assert forward[3:] == [(f"layers.{i}" + s, ((f"layers.{i}.fc.weight",) if s else ()), 1)
                           for i in range(1, 4) for s in ("", ".fc")]
    assert backward == [f"layers.{i}{s}" for i in (3, 2, 1) for s in ("", ".fc")] + ["layers.0.fc"]
    second_apart = {**trace, "forward": layer(0) + layer(1, 0) + layer(2)}
    assert module_trace_at_depth(second_apart, "layers", 4) is None
    other_kind = {**trace, "forward": layer(0, 0, ("", "dense")) + layer(1) + layer(2)}  # a dense first layer
    assert module_trace_at_depth(other_kind, "layers", 4) is None


def test_zero3_refuses_a_non_llama_table_without_a_trace_and_lora_with_checkpointing():
    from estimator.models.params import ParamTable
    from estimator.reserved.zero3 import why_not_zero3
    from estimator.spec import ParallelSpec, RunSpec, TrainingSpec

    def spec(**training) -> RunSpec:
        return RunSpec(model="facebook/opt-1.3b", training=TrainingSpec(**{**TRAINING, **training}),
                       parallel=ParallelSpec(method="zero3", world_size=2))

    _, table = _table("facebook/opt-1.3b")
    assert why_not_zero3(spec(), table) is None
    assert why_not_zero3(spec(), list(table)).startswith("zero3: the coordinator's module trace")
    assert why_not_zero3(spec(grad_ckpt=True), table) is None
    assert why_not_zero3(spec(lora_rank=8), table) is None
    assert why_not_zero3(spec(lora_rank=8, grad_ckpt=True), table).startswith(
        "zero3 with LoRA and checkpointing outside Llama-style decoders")
    assert why_not_zero3(spec(grad_ckpt=True, ckpt_policy="every-k:2"), table).startswith(
        "zero3 with every-k checkpointing outside Llama")
    assert why_not_zero3(spec(grad_ckpt=True, ckpt_reentrant=True), table).startswith(
        "zero3 with reentrant checkpointing outside Llama")
    untraced = ParamTable(table)
    assert why_not_zero3(spec(), untraced).startswith("zero3: the coordinator's module trace")


@pytest.mark.slow
def test_a_tiny_llamas_recorded_trace_is_the_derived_one():
    """The trace recorded from a tiny Llama's step (fake tensors) is the one ``modules_of`` derives from its
    parameter table, forward and backward."""
    from estimator.models.params import expand_params
    from estimator.profiler.add_module_trace import trace_for
    from estimator.profiler.profile import PROFILE_LAYERS, _Model, param_table
    from estimator.reserved.zero3_gathers import recorded_modules
    from estimator.spec import TrainingSpec
    from tests.estimator.test_zero3_recompute import LLAMA

    training = TrainingSpec(precision="mixed_bf16", attn="sdpa")
    model = _Model(LLAMA, training, PROFILE_LAYERS)
    params = param_table(model.base, model.layers, PROFILE_LAYERS)
    params["module_trace"] = trace_for(LLAMA, training)
    table = expand_params(params, LLAMA["num_hidden_layers"])
    derived_forward, derived_backward = modules_of(list(table))
    recorded_forward, recorded_backward = recorded_modules(table.module_trace)
    assert [(m.name, m.params) for m in recorded_forward] == [(m.name, m.params) for m in derived_forward]
    assert [(m.name, m.params) for m in recorded_backward] == [(m.name, m.params) for m in derived_backward]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["opt", "gpt_neox", "bloom", "gpt2"])
@pytest.mark.parametrize("world", [2, 4])
def test_the_allgather_stream_is_a_real_runs(tmp_path, arch, world):
    """A real DeepSpeed ZeRO-3 run on CPU of a tiny model built from config (rank 0, three steps, each storage on
    the stream a GPU run makes it on): the generated allgather stream is the run's, request by request, in every
    step. (The default stream differs at the head's backward and the dropout masks; the reduction stream
    agrees since the bias hooks follow the memory-efficient linear: ``test_zero3_bias_order.py``,
    ``docs/error_matrix/zero3_arch_cpu.csv``.)"""
    pytest.importorskip("deepspeed")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import zero3_arch_replay

    row = zero3_arch_replay.point(tmp_path, arch, world)
    assert row["source"] == "replayed"
    assert [d for d in __import__("json").loads(row["first_differences"]) if d[0] == 2] == []


def test_a_dropped_out_layer_recomputes_before_its_output_projections_fetch():
    """A layer whose hidden states are dropped out after the MLP (OPT-1.3b: ``dropout`` 0.1, the profile's bool
    mask of ``b * s * hidden``) unpacks the mask first: each checkpointed layer's forward modules come right
    before the backward fetch of ``fc2``, after the layer's own (parameter-less) entry, each owned by that fetch,
    and no release moves. So the trace-recording step gathers ``fc2`` three times (forward, recomputation,
    backward), the recomputation's copy held while the backward's is gathered (a detached alias the checkpoint
    saved). GPT-NeoX and BLOOM (hidden dropout 0) have no such mask."""
    from estimator import api
    from estimator.reserved.zero3 import _drops_out_hidden_states
    from estimator.reserved.zero3_gathers import recomputed_before_fetch
    from estimator.spec import TrainingSpec

    for model, drops in (("facebook/opt-1.3b", True), ("EleutherAI/pythia-1b", False),
                         ("bigscience/bloom-1b1", False)):
        arch, profile = api.load_model_profile(model, TrainingSpec(**TRAINING), 1, allow_build=False)
        table = api._param_table(profile, arch.num_layers)
        polys = api._regime(profile, 2, 1024)["events"]["polys"]
        assert _drops_out_hidden_states(table, polys) is drops, model
    _, table = _table("facebook/opt-1.3b")
    forward, backward = modules_of(table, recorded_trace(table), inputs_need_grad=True)
    out, owners = recomputed_before_fetch(forward, backward, frozenset({1}))
    names = [m.name for m in out]
    layer = "model.decoder.layers.1"
    recompute = [m.name for m in forward if m.name.startswith(layer + ".")]
    at = len(names) - 1 - names[::-1].index(f"{layer}.fc2")  # its backward's (the recomputation runs one too)
    assert names[at - len(recompute) - 1:at] == [layer] + recompute
    assert len(out) == len(backward) + len(recompute)
    assert owners == {len(forward) + k: len(forward) + at for k in range(at - len(recompute), at)}
    assert recomputed_before_fetch(forward, backward, frozenset()) == (backward, {})

    fc2 = next(p for p in table if p.name == f"{layer}.fc2.weight")

    def step(dropped_out: bool) -> tuple[int, int]:
        """(fc2's gathers, the most weight-sized copies out of a flat gather live at once: fc1's and fc2's
        weights are both ``ffn x hidden``)."""
        ops = emulate(table, 2, steps=1, recorded=recorded_trace(table), checkpointed=frozenset({1}),
                      dropped_out=dropped_out)
        live, most = 0, 0
        for sign, _, nbytes in ops.steps[0]:
            if nbytes == fc2.numel * fc2.elem_bytes:
                live += sign
                most = max(most, live)
        return sum(fc2.name in c[1] for c in ops.calls[0] if c[0] == "G"), most

    # the recomputation's fc1 and fc2 kept to their backward, fc2 gathered again beside them; the stopped order
    # (Llama's, GPT-NeoX's) holds fc2 from its backward fetch through the recomputation
    assert step(True) == (3, 3)
    assert step(False) == (2, 2)


def test_held_inputs_are_the_traced_frozen_linears_inputs():
    """A GPT-NeoX-like layer's plain-autograd forward (size indices: 0 hidden, 1 a LayerNorm's statistics, 2 the
    fused qkv, 3 the MLP's width, 4 attention's internals): each frozen Linear's input is the latest tensor of its
    size before its output, freed in the segment; the residual sums and attention's hidden-size internals are not
    taken; a Linear whose input autograd keeps (never freed) holds nothing; nor one whose input needs no
    gradient."""
    from estimator.profiler.expand import ALLOC, FREE
    from estimator.reserved.zero3 import _held_by_trace

    a, f = (lambda key, size: (ALLOC, key, size)), (lambda key: (FREE, key, 0))
    body = [a(1, 0), a(2, 1), a(3, 2),                      # input norm (+ stats), qkv
            a(4, 0), a(5, 0), a(6, 0), f(5), a(7, 0),      # attention: q, a temporary, the merged output, dense
            f(3), f(6), f(1), a(8, 0), a(9, 1), a(10, 3),  # its input freed; post norm (+ stats), h_to_4h
            a(11, 3), a(12, 0), f(11), f(8),               # act, 4h_to_h: act's output and the norm's freed
            a(13, 0), f(7), f(12)]                          # the residual sum
    qkv, dense, up, down = (True, 0, 2), (True, 0, 0), (True, 0, 3), (True, 3, 0)
    assert sorted(body[at][1] for at in _held_by_trace(body, 0, len(body), [qkv, dense, up, down])) == [1, 6, 8, 11]
    # the first layer's parallel MLP reads the frozen embedding's activations: its inputs need no gradient
    first = [(False, 0, 2), dense, (False, 0, 3), (False, 3, 0)]
    assert [body[at][1] for at in _held_by_trace(body, 0, len(body), first)] == [6]
    kept = [op for op in body if op != f(11)]  # act's output saved by autograd (a ReLU's): nothing to hold
    assert sorted(kept[at][1] for at in _held_by_trace(kept, 0, len(kept), [qkv, dense, up, down])) == [1, 6, 8]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt_neox", "bloom", "opt", "gpt2"])
def test_lora_against_a_real_run(tmp_path, arch):
    """peft LoRA on the default targets, no checkpointing, a real DeepSpeed ZeRO-3 run on CPU (rank 0 of 2;
    ``benchmarks/zero3_arch_replay.py --lora``): replayed, the allgather and reduction streams are the run's and
    the three-stream peaks equal (GPT-NeoX's differed while the held inputs were found as Llama's layers make
    them: 8.0 vs 10.0 MiB)."""
    pytest.importorskip("deepspeed")
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import zero3_arch_replay

    row = zero3_arch_replay.point(tmp_path, arch, 2, lora=True)
    assert row["source"] == "replayed"
    assert [d for d in json.loads(row["first_differences"]) if d[0] in (1, 2)] == []
    assert row["recorded_three_streams_mib"] == row["generated_three_streams_mib"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt_neox", "bloom", "opt", "gpt2"])
def test_checkpointing_against_a_real_run(tmp_path, arch):
    """Full non-reentrant checkpointing, a real DeepSpeed ZeRO-3 run on CPU (rank 0 of 2, three steps;
    ``benchmarks/zero3_arch_replay.py --ckpt``): the allgather and reduction streams are the run's request by
    request and the three-stream peaks equal, OPT's and GPT-2's (their hidden states dropped out after the MLP:
    the recomputation before the output projection's fetch) as GPT-NeoX's and BLOOM's."""
    pytest.importorskip("deepspeed")
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import zero3_arch_replay

    row = zero3_arch_replay.point(tmp_path, arch, 2, ckpt=True)
    assert row["source"] == "replayed"
    assert [d for d in json.loads(row["first_differences"]) if d[0] in (1, 2)] == []
    assert row["recorded_three_streams_mib"] == row["generated_three_streams_mib"]
