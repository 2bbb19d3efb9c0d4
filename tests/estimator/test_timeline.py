import random

from estimator.methods.timeline import poly, replay, segment_sequence


def _segments(rng):
    def seg():
        cands = [([rng.uniform(-5, 50) for _ in range(6)], rng.uniform(0, 20)) for _ in range(3)]
        return {"net_act": [rng.uniform(-10, 10) for _ in range(6)], "net_grad": rng.uniform(0, 10),
                "candidates": cands}
    return {name: seg() for name, _ in segment_sequence(5)}


def _explicit(segments, layers, b, s):
    act = grad = 0.0
    best = float("-inf")
    for name, reps in segment_sequence(layers):
        for _ in range(reps):
            seg = segments[name]
            for cand_act, cand_grad in seg["candidates"]:
                best = max(best, act + poly(cand_act, b, s) + grad + cand_grad)
            act += poly(seg["net_act"], b, s)
            grad += seg["net_grad"]
    return best


def test_replay_of_repeated_layers_equals_explicit_iteration():
    rng = random.Random(0)
    for _ in range(200):
        segments = _segments(rng)
        layers, b, s = rng.randint(2, 40), rng.randint(1, 8), rng.randint(1, 300)
        assert abs(replay(segments, layers, b, s).peak_bytes - _explicit(segments, layers, b, s)) < 1e-6


def test_poly_monomials():
    assert poly([1, 2, 3, 4, 5, 6], b=2, s=10) == 1 + 20 + 300 + 8 + 100 + 1200
