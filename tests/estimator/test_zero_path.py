"""DeepSpeed ZeRO-1/2 gradient path per rank (``estimator.methods.state.zero12_ranks``) on hand-made parameter tables.

What is checked is DeepSpeed 0.19's logic as read in ``deepspeed/runtime/zero/stage_1_and_2.py`` and measured on CPU
(docs/LOG.md 2026-11-23): partitions of the flat buffer in ``model.parameters()`` order, a buffer holding every
tensor that overlaps the partition in full, the IPG flush that allocates it, and stage 1's reduction after backward.
"""

from __future__ import annotations

from estimator.api import _undominated
from estimator.methods.state import (
    Zero12Rank,
    _grads_alive,
    _stage2_held,
    _zero_backward_order,
    _zero_flat_order,
    zero12_ranks,
)
from estimator.methods.timeline import replay, segment_sequence
from estimator.models.params import ParamInfo, backward_order, expand_params


def _p(name, numel, layer=None, kind="linear", before=None, index=None, tied=()):
    return ParamInfo(name=name, shape=(numel,), numel=numel, elem_bytes=4, trainable=True, module_kind=kind,
                     layer=layer, tied_names=tied, before_layers=before, backward_index=index)


def _opt_like():
    """OPT's registration order: tied embedding, final norm, then the layers; backward finishes the final norm
    first and the tied embedding last."""
    emb = _p("embed", 1000, kind="embedding", before=True, index=5, tied=("lm_head.weight",))
    norm = _p("final_norm", 10, kind="norm", before=True, index=0)
    layers = [_p(f"l{i}.w", 500, layer=i, index=1 + 2 * (1 - i)) for i in range(2)]
    biases = [_p(f"l{i}.b", 5, layer=i, index=2 + 2 * (1 - i)) for i in range(2)]
    return [emb, norm, layers[0], biases[0], layers[1], biases[1]]


def test_flat_order_follows_registration_and_backward_order_the_hooks():
    table = _opt_like()
    assert [p.name for p in _zero_flat_order(table)] == ["embed", "final_norm", "l0.w", "l0.b", "l1.w", "l1.b"]
    assert [p.name for p in _zero_backward_order(table, _zero_flat_order(table))] == [
        "final_norm", "l1.w", "l1.b", "l0.w", "l0.b", "embed"]
    # Without recorded facts: embeddings / tied tensors first in the flat order, and finished last in backward.
    bare = [ParamInfo(p.name, p.shape, p.numel, 4, True, p.module_kind, p.layer, p.tied_names) for p in table]
    assert [p.name for p in _zero_flat_order(bare)][0] == "embed"
    assert [p.name for p in _zero_backward_order(bare, _zero_flat_order(bare))][-1] == "embed"


def test_partition_buffer_holds_every_overlapping_tensor_in_full():
    # 2020 elements padded to 2 x 2 = 4 -> partitions of 1010: [0, 1010) and [1010, 2020).
    ranks = zero12_ranks(_opt_like(), 2, bucket=10_000)
    assert [r.partition_numel for r in ranks] == [1010, 1010]
    assert ranks[0].buffer_numel == 1000 + 10           # embed, final norm
    assert ranks[1].buffer_numel == 500 + 5 + 500 + 5    # the layers
    assert ranks[0].largest_piece == 1000 and ranks[1].largest_piece == 500
    # With 3 ranks (2022 padded, partitions of 674) the embedding and l0.w are cut: rank 1 holds both in full.
    three = zero12_ranks(_opt_like(), 3, bucket=10_000)
    assert three[1].buffer_numel == 1000 + 10 + 500 and three[1].largest_piece == 1348 - 1010


def test_stage2_buffer_appears_at_the_first_flush_holding_the_partition():
    # Bucket of 600 elements: final_norm (10) then l1.w (500) fit; l1.b fits (515); l0.w overflows -> flush of
    # {final_norm, l1.w, l1.b} in l0.w's hook. Rank 0 holds final_norm (registered before the layers), so its
    # buffer appears there, after 10 + 500 + 5 + 500 elements of gradients (4 bytes each) -- not after half of them.
    ranks = zero12_ranks(_opt_like(), 2, bucket=600)
    assert ranks[0].appears_at == 4 * (10 + 500 + 5 + 500)
    assert ranks[1].appears_at == 4 * (10 + 500 + 5 + 500)
    # Llama-like order (final norm after the layers): rank 0 waits for the flush holding its layer, rank 1 not.
    table = [_p("embed", 1000, kind="embedding", before=True, index=5), _p("l0.w", 500, layer=0, index=3),
             _p("l0.b", 5, layer=0, index=4), _p("l1.w", 500, layer=1, index=1), _p("l1.b", 5, layer=1, index=2),
             _p("norm", 10, kind="norm", before=False, index=0)]
    ranks = zero12_ranks(table, 2, bucket=600)
    assert ranks[1].appears_at == 4 * (10 + 500 + 5 + 500)
    assert ranks[0].appears_at == 4 * 2020  # l0's flush, in the embedding's hook: every gradient produced


def test_stage1_reduction_frees_bucketed_gradients_and_keeps_oversized_ones():
    # Flat order embed (1000, oversized for a 600 bucket), final_norm, l0.w, l0.b, l1.w, l1.b; all 2020 gradient
    # elements held when the reduction starts. Rank 1's buffer (1010) appears at the flush holding l0.w, in l1.w's
    # arrival: by then final_norm, l0.w, l0.b went into the bucket (515 freed) while the oversized embedding keeps
    # its storage (rank 0's, reduced but not freed for rank 1).
    ranks = zero12_ranks(_opt_like(), 2, bucket=600)
    assert ranks[1].reduction_held == 4 * (2020 - 515 + 1010)
    # Rank 0's buffer appears at the first flush (the embedding alone), with everything still held.
    assert ranks[0].reduction_held == 4 * (2020 + 1010)


def test_backward_order_expands_the_generic_layer():
    params = {"layer_prefix": "model.layers", "layers_at": 1,
              "non_layer": [{"name": "emb", "shape": [8], "numel": 8, "elem_bytes": 2, "trainable": True,
                             "kind": "embedding", "tied": []},
                            {"name": "norm", "shape": [2], "numel": 2, "elem_bytes": 2, "trainable": True,
                             "kind": "norm", "tied": []}],
              "per_layer": [{"name": name, "shape": [4], "numel": 4, "elem_bytes": 2, "trainable": True,
                             "kind": "linear", "tied": []} for name in ("a", "b")],
              "grad_order": [[None, "norm"], [2, "b"], [2, "a"], [1, "b"], [1, "a"], [0, "b"], [0, "a"],
                             [None, "emb"]]}
    order = backward_order(params, 4)
    assert [key for key, _ in sorted(order.items(), key=lambda kv: kv[1])] == [
        (None, "norm"), (3, "b"), (3, "a"), (2, "b"), (2, "a"), (1, "b"), (1, "a"), (0, "b"), (0, "a"), (None, "emb")]
    table = expand_params(params, 4)
    assert [p.before_layers for p in table if p.layer is None] == [True, False]
    assert all(p.backward_index is not None for p in table)
    assert backward_order({**params, "grad_order": [[None, "norm"], [1, "a"]]}, 4) == {}  # layer does not match


def test_undominated_ranks():
    def path(buffer, appears, largest=1, reduction=0.0):
        return Zero12Rank(partition_numel=10, buffer_numel=buffer, largest_piece=largest, appears_at=appears,
                          reduction_held=reduction)
    paths = [path(10, 90.0), path(12, 10.0), path(12, 10.0), path(11, 50.0), path(10, 5.0)]
    assert _undominated(paths) == [1, 4]


def test_replay_evaluates_the_repetition_where_the_policy_steps():
    # Activations fall by 10 per backward layer, each layer produces 1 byte of gradient; a buffer of 100 appears
    # once 5.5 bytes are produced: the peak is in the 6th backward layer (a middle repetition of "bw").
    def seg(net_act, net_grad):
        return {"net_act": [net_act, 0, 0, 0, 0, 0], "net_grad": net_grad,
                "candidates": [([0.0] * 6, net_grad)]}
    segments = {name: seg(0.0, 0.0) for name, _ in segment_sequence(20)}
    for name in ("fw_first", "fw", "fw_last"):
        segments[name] = seg(10.0, 0.0)
    for name in ("bw_first", "bw", "bw_last"):
        segments[name] = seg(-10.0, 1.0)

    def held(prev, within):
        return 100.0 if prev + within >= 5.5 else 0.0
    held.breakpoints = (5.5,)
    result = replay(segments, 20, 1, 1, grad_policy=held)
    assert result.peak_bytes == 200 - 50 + 100  # after 5 layers' backward (act 150), the 6th layer's gradient


def test_replay_with_a_stepping_policy_equals_explicit_iteration():
    import random

    from estimator.methods.timeline import poly

    rng = random.Random(1)
    for _ in range(1000):
        def seg():
            return {"net_act": [rng.uniform(-10, 10) for _ in range(6)], "net_grad": rng.uniform(0, 10),
                    "candidates": [([rng.uniform(-5, 50) for _ in range(6)], rng.uniform(0, 20)) for _ in range(3)]}
        segments = {name: seg() for name, _ in segment_sequence(5)}
        layers, b, s = rng.randint(2, 40), rng.randint(1, 4), rng.randint(1, 100)
        point, step = rng.uniform(0, 300), rng.uniform(0, 5000)

        def held(prev, within, point=point, step=step):
            return prev + within + (step if prev + within >= point else 0.0)
        held.breakpoints = (point,)
        act = grad = 0.0
        best = float("-inf")
        for name, reps in segment_sequence(layers):
            for _ in range(reps):
                for cand_act, cand_grad in segments[name]["candidates"]:
                    best = max(best, act + poly(cand_act, b, s) + held(grad, cand_grad))
                act += poly(segments[name]["net_act"], b, s)
                grad += segments[name]["net_grad"]
        assert abs(replay(segments, layers, b, s, grad_policy=held).peak_bytes - best) < 1e-6


def test_a_tensor_backward_never_finishes_holds_no_gradient_but_sits_in_the_buffer():
    # An unused trainable tensor after the layers: 2120 elements -> partitions of 1060; rank 1's buffer counts it
    # (and l0.w, cut by the boundary, in full), but no gradient of it is ever held or reduced.
    table = [*_opt_like(), _p("unused", 100, layer=None, kind="other", before=False, index=None)]
    ranks = zero12_ranks(table, 2, bucket=600)
    assert ranks[0].buffer_numel == 1000 + 10 + 500 and ranks[1].buffer_numel == 500 + 5 + 500 + 5 + 100
    assert ranks[0].reduction_held == 4 * (2020 + 1510)
    assert ranks[1].reduction_held == 4 * (2020 - 515 + 1110)


def test_an_extra_large_gradient_stays_until_the_next_hook():
    # Bucket of 10 elements, 4 bytes each: a (5) fits and is copied into the bucket by its own hook; b (30) is
    # extra-large and kept as it is until c's hook flushes it, so c arrives with b still alive; d arrives alone.
    order = [_p("a", 5), _p("b", 30), _p("c", 4), _p("d", 2)]
    arrival, after = _stage2_held(order, bucket=10)
    assert arrival == [0.0, 20.0, 120.0, 16.0 + 120.0, 8.0]
    assert after == [0.0, 0.0, 120.0, 0.0, 0.0]


def test_gradients_alive_at_a_candidate_are_the_worst_arrival_since_the_previous_candidate():
    order = [_p("a", 5), _p("b", 30), _p("c", 4), _p("d", 2)]
    arrival, after = _stage2_held(order, bucket=10)
    produced = (0.0, 20.0, 140.0, 156.0, 164.0)
    alive = _grads_alive(produced, tuple(arrival), tuple(after))
    assert alive(0.0, 156.0, 0.0) == 136.0      # c's arrival (b pending) may be a dropped candidate: counted
    assert alive(0.0, 164.0, 156.0) == 8.0      # only d arrived since the previous candidate
    assert alive(140.0, 0.0, 0.0) == 120.0      # a segment's start after b's hook: b still pending
    assert alive(0.0, 156.0, 156.0) == 0.0      # a later moment at c's level: c's hook ran and flushed b


def test_replay_hands_a_since_aware_policy_the_previous_candidates_gradients():
    seen = []

    def held(prev, within, since=0.0):
        seen.append((prev, within, since))
        return 0.0
    held.since_previous = True
    empty = {"net_act": [0.0] * 6, "net_grad": 0.0, "candidates": [([0.0] * 6, 0.0)]}
    segments = {name: empty for name, _ in segment_sequence(3)}
    segments["bw_first"] = {"net_act": [0.0] * 6, "net_grad": 3.0,
                            "candidates": [([0.0] * 6, 1.0), ([0.0] * 6, 3.0)]}
    replay(segments, 3, 1, 1, grad_policy=held)
    assert (0.0, 1.0, 0.0) in seen and (0.0, 3.0, 1.0) in seen


def test_a_hook_moment_holds_the_hooked_gradient_and_the_pending_one():
    # c's hook runs after its node's frees, at the same gradient bytes as c's allocation: b (extra-large) is still
    # pending then, and only flushed by that hook; a later moment at c's level holds neither
    order = [_p("a", 5), _p("b", 30), _p("c", 4), _p("d", 2)]
    arrival, after = _stage2_held(order, bucket=10)
    alive = _grads_alive((0.0, 20.0, 140.0, 156.0, 164.0), tuple(arrival), tuple(after))
    assert alive(0.0, 156.0, 156.0, True) == 136.0
    assert alive(0.0, 156.0, 156.0, False) == alive(0.0, 156.0, 156.0) == 0.0


def test_the_partition_buffer_appears_in_the_hook_not_at_the_gradients_allocation():
    # DeepSeek-V2 tiny's last ZeRO-2 rank: lm_head's gradient is extra-large and pending until the final norm's
    # hook flushes it into the partition buffer that hook allocates. The profile records three moments at the
    # norm gradient's level: its allocation (the buffer not there yet), its hook (lm_head's gradient and the new
    # buffer alive together: the real run's peak) and the fp32 rest of the norm's backward (lm_head's gone).
    table = [_p("lm_head", 1000, index=0), _p("norm", 10, index=1), _p("w", 50, layer=0, index=2)]
    path = zero12_ranks(table[1:] + table[:1], 2, bucket=100)[1]
    assert path.appears_at == 4 * 1010
    segments = {name: {"net_act": [0.0] * 6, "net_grad": 0.0, "candidates": [([0.0] * 6, 0.0)]}
                for name, _ in segment_sequence(3)}
    allocated, hooked, later = 40.0, 30.0, 60.0
    segments["mid_bw"] = {"net_act": [0.0] * 6, "net_grad": 4040.0, "hooks": [1, 3],
                          "candidates": [([0.0] * 6, 4000.0), ([0.0] * 6, 4000.0),
                                         ([allocated] + [0.0] * 5, 4040.0), ([hooked] + [0.0] * 5, 4040.0),
                                         ([later] + [0.0] * 5, 4040.0)]}
    from estimator.spec import ParallelSpec, RunSpec, TrainingSpec, ZeroSpec
    spec = RunSpec(model="x", gpu="h100-80gb", training=TrainingSpec(precision="fp32"),
                   parallel=ParallelSpec(method="zero2", world_size=2, zero=ZeroSpec(reduce_bucket_size=100)))
    from estimator.methods.state import zero
    policy = zero(spec, table, rank=1, path=path).grad_policy
    buffer = 4.0 * path.buffer_numel
    assert policy(0.0, 4040.0, 4000.0, False) == 4040.0 + 400.0              # allocated: no buffer yet
    assert policy(0.0, 4040.0, 4040.0, True) == 4040.0 + 400.0 + buffer      # the hook: both, and the buffer
    assert policy(0.0, 4040.0, 4040.0, False) == 400.0 + buffer  # after it: both copied into the bucket, freed
    peak = replay(segments, 3, 1, 1, grad_policy=policy)
    assert peak.peak_bytes == hooked + 4040.0 + 400.0 + buffer


def test_the_profile_keeps_a_gradients_hook_moment_that_a_later_moment_outweighs():
    # The final RMSNorm's backward: its weight's gradient (ordinal 1) made while the incoming gradient (0) is alive,
    # then freed, then fp32 temporaries (2, 3) at the same gradient bytes. The hook moment (the level the node's
    # outputs reach) shows what a ZeRO rank holds there; the later, larger moment outweighed it before.
    from fractions import Fraction

    from estimator.profiler.profile import _segment_summary

    def c(n):
        return [Fraction(n)] + [Fraction(0)] * 5
    coeffs = [c(16), c(1), c(64), c(64)]
    grads = [None, "norm.weight", None, None]
    events = [("a", 0), ("a", 1), ("f", 0), ("a", 2), ("a", 3), ("f", 2), ("f", 3)]
    summary = _segment_summary(events, coeffs, grads)
    assert [(act[0], grad) for act, grad in summary["candidates"]] == [(16.0, 1.0), (128.0, 1.0)]
    assert summary["hooks"] == [0]
    forward = _segment_summary([("a", 0), ("f", 0)], coeffs, grads)
    assert "hooks" not in forward  # no gradient: nothing a ZeRO policy reads


def _summary_of(sizes: list[int], grads: list[str | None], events: list[tuple]) -> dict:
    from fractions import Fraction

    from estimator.profiler.profile import _segment_summary

    coeffs = [[Fraction(n)] + [Fraction(0)] * 5 for n in sizes]
    return _segment_summary(events, coeffs, grads)


def test_a_gradients_hook_comes_after_its_node_released_its_inputs():
    # An untied head's backward (Pythia's embed_out): the bf16 logits gradient (0) is made and the fp32 one (5)
    # freed; the head's node makes the weight's gradient (1) and the hidden state's (2), then releases its input
    # (0) and its saved hidden state (3, from forward). The engine runs the weight's AccumulateGrad, and
    # DeepSpeed's hook (the IPG bucket), only then: the hook moment holds neither the logits gradient nor the
    # saved state. The final norm's backward (4) follows.
    sizes = [100, 50, 8, 4, 8, 200]
    grads = [None, "head.weight", None, None, None, None]
    events = [("a", 0), ("f", 5), ("a", 1), ("a", 2), ("f", 0), ("f", 3), ("a", 4), ("f", 4)]
    summary = _summary_of(sizes, grads, events)
    assert [(act[0], grad) for act, grad in summary["candidates"]] == [
        (100.0, 0.0), (-92.0, 50.0), (-196.0, 50.0), (-188.0, 50.0)]
    assert summary["hooks"] == [2]  # after the node's frees, not at its allocations (-92)


def test_a_gradients_hook_before_the_next_nodes_allocations_stays_at_the_allocation_run():
    # small-opt's fc2 (AddmmBackward) releases nothing: its allocations (the input's gradient 0, the weight's and
    # the bias's 1, 2) run on into the ReLU's backward (3), which frees the input's gradient it consumed (0) and
    # the saved output (4). A free of a tensor made in the run shows that a later node ran: the hook is counted
    # at the end of the allocation run (an upper bound by the later node's allocation), not after those frees.
    sizes = [16, 40, 1, 16, 16]
    grads = [None, "fc2.weight", "fc2.bias", None, None]
    events = [("a", 0), ("a", 1), ("a", 2), ("a", 3), ("f", 0), ("f", 4)]
    summary = _summary_of(sizes, grads, events)
    assert [(act[0], grad) for act, grad in summary["candidates"]] == [(32.0, 41.0), (0.0, 41.0)]
    assert summary["hooks"] == [0]


def _without_hook_moments(profile: dict) -> dict:
    """``profile`` as a trace before hook moments were kept summarised it (no ``hooks``, no ``summary_rule``)."""
    def strip(segments: dict) -> dict:
        return {name: {k: v for k, v in seg.items() if k != "hooks"} for name, seg in segments.items()}

    regimes = [{**r, **{name: strip(r[name]) for name in ("segments", "segments_manual") if name in r}}
               for r in profile["regimes"]]
    return {**{k: v for k, v in profile.items() if k != "summary_rule"}, "regimes": regimes}


def test_a_profile_summarised_before_hook_moments_is_summarised_again_at_load():
    # A profile without today's summary rule (a user's cached one) has its backward segments re-derived from its
    # events at load (the stored summaries otherwise kept), so ZeRO's hooks fall after the node's releases; the
    # shipped ones carry the rule (``ship --resummarise``) and load as stored.
    from estimator.models.profiles import find_profile, profile_key, summaries_current
    from estimator.profiler.cache import _with_hook_moments, cached_arch, load_model_profile
    from estimator.profiler.vocab import resummarised, with_hook_moments
    from estimator.spec import TrainingSpec

    training = TrainingSpec(precision="mixed_bf16", attn="sdpa", micro_batch_size=2, seq_len=1024)
    shipped = find_profile(profile_key(cached_arch("EleutherAI/pythia-1b").config_sha, training, 1, False))
    assert summaries_current(shipped)
    _, loaded = load_model_profile("EleutherAI/pythia-1b", training, allow_build=False)
    assert loaded["regimes"] == shipped["regimes"]  # taken as stored: no re-summary
    stored = _without_hook_moments(shipped)
    assert not summaries_current(stored)
    profile = _with_hook_moments(stored)
    regime, before = profile["regimes"][-1], stored["regimes"][-1]
    assert "hooks" in regime["segments"]["mid_bw"] and "hooks" in regime["segments_manual"]["bw"]
    for name in ("prefix", "fw", "mid_fw"):  # no gradient: as stored
        assert regime["segments"][name] == before["segments"][name]
    assert regime["segments"]["mid_bw"]["net_act"] == before["segments"]["mid_bw"]["net_act"]
    assert profile["regimes"] == shipped["regimes"]  # the shipped summaries are the re-summary's
    again = with_hook_moments(profile)
    assert again["regimes"][-1]["segments"] == regime["segments"]  # today's summaries: a fixed point
    marked = resummarised(stored)
    assert summaries_current(marked) and list(marked)[:2] == ["schema_version", "summary_rule"]
    assert resummarised(marked) == marked and {k: v for k, v in marked.items() if k != "summary_rule"} == profile


def test_every_shipped_profile_carries_today_s_summary_rule():
    """The loader re-summarises a profile without it at every load (seconds of a cold plan): after re-tracing or
    merging shipped profiles, ``python -m estimator.profiler.ship --resummarise``."""
    from pathlib import Path

    from estimator.models.profiles import SUMMARY_RULE

    profiles = Path(__file__).resolve().parents[2] / "estimator" / "profiles"
    marker = f'"summary_rule":{SUMMARY_RULE},'  # beside the schema, at the start of the file
    stale = []
    for path in sorted(profiles.glob("*.json")):
        with path.open() as fh:
            if marker not in fh.read(100):
                stale.append(path.name)
    assert not stale, f"{len(stale)} shipped profiles to re-summarise, e.g. {stale[0]}"


def test_resummarise_marks_stored_profiles_in_place_once(tmp_path, capsys):
    import json

    from estimator.models.profiles import find_profile, profile_key, summaries_current
    from estimator.profiler.cache import cached_arch
    from estimator.profiler.ship import main as ship
    from estimator.spec import TrainingSpec

    training = TrainingSpec(precision="mixed_bf16", attn="sdpa")
    source = find_profile(profile_key(cached_arch("EleutherAI/pythia-1b").config_sha, training, 1, False))
    (tmp_path / "p.json").write_text(json.dumps(_without_hook_moments(source)))
    assert ship(["--resummarise", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "p.json").read_text()) == source
    assert summaries_current(source)
    assert ship(["--resummarise", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("0 of 1 profiles")
