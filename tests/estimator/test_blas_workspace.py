"""Each thread's cuBLAS workspace enters the replayed stream right after the output of that thread's first cuBLAS
op (CUDA's ``getCurrentCUDABlasHandle`` makes it inside the op, once the op's output exists): the profile's
``blas_first`` (docs/allocator.md, session 25). Pure: a hand-made window, a shipped profile, a shipped row."""

import json
import pathlib

import pandas as pd

from estimator.models.profiles import _shipped_path
from estimator.profiler.expand import ALLOC, expand

ROOT = pathlib.Path(__file__).resolve().parents[2]
LORA_KEY = "9560701ea61efa23_mixed_bf16_sdpa_nockpt_lora16-auto"  # Qwen2.5-0.5B, LoRA r16, the H200 row's


def _events(key: str = LORA_KEY) -> dict:
    return json.loads(_shipped_path(key).read_text())["regimes"][0]["events"]


def test_first_blas_output_per_thread():
    from estimator.profiler.profile import first_blas_outputs

    window = [("m", "window_start"), ("a", 0), ("a", 1), ("f", 0), ("a", 2), ("m", "backward"), ("a", 3),
              ("a", 4), ("a", 5)]
    sids = [10, 11, 12, 13, 14, 15]
    # ordinal 1 is the forward's first matmul output; 2 another; in backward 4 (ordinal 3 is the loss's gradient)
    assert first_blas_outputs(window, sids, [11, 12, 14, 15]) == [1, 4]
    assert first_blas_outputs(window, sids, [14]) == [None, 4]  # no cuBLAS op in the forward
    assert first_blas_outputs(window, sids, []) == [None, None]


def test_workspace_follows_the_first_blas_output_in_each_thread():
    events = _events()
    forward, backward = events["blas_first"]
    expansion = expand(events, 24)
    ops = expansion.first.ops
    for thread, ordinal in ((0, forward), (1, backward)):
        kind, _key, size = ops[expansion.workspace_at[thread] - 1]
        assert kind == ALLOC and size == events["size"][ordinal]
    # the backward's first matmul is the head's input gradient, after the loss's logits-sized gradients: the
    # segment start (before them) put the workspace where the logits' blocks are split, not after them
    old = expand({k: v for k, v in events.items() if k != "blas_first"}, 24)
    assert old.workspace_at[1] < expansion.workspace_at[1]
    assert old.first.ops == ops


def test_lora_row_reserved_level_on_the_h200():
    """Qwen2.5-0.5B LoRA r16 mixed_bf16 b4 s512: the backward workspace in the third logits-sized segment (step 1)
    leaves no cached block for step 2's logits: one more 1188 MiB segment. Was -13.3 % with the segment start."""
    from calibrate.terms import rank_estimates
    from estimator.hardware.residuals import load_coefficients

    rows = pd.read_csv(ROOT / "data" / "measurements" / "h200-141gb" / "gpu_snapshots.csv")
    rows = rows[rows["run_id"] == "0f3d71141564db57-c862afd8"]
    (_, rank), = rank_estimates(rows, load_coefficients("h200-141gb"), allow_build=False)
    measured = int(rows["peak_reserved_bytes"].iloc[0])
    assert rank.reserved_source == "replayed"
    assert abs(rank.peak_reserved_bytes - measured) / measured < 0.002


def _recorder_with(events: list[tuple], pending: list[tuple]):
    from estimator.profiler.trace import StorageRecorder

    rec = StorageRecorder()
    rec.timeline.events = list(events)
    rec.timeline.sizes = {e[1]: e[2] for e in events if e[0] == "a"}
    rec._pending_sums = list(pending)
    rec._settle_sums()
    return rec


def test_an_engine_sum_is_made_in_place_in_the_input_freed_after_it():
    """The recorder's switch ``fold_engine_sums`` (off by default: docs/allocator.md, session 25): autograd's
    ``InputBuffer::accumulate`` on plain GPU tensors sums ``old.add_(new)`` when the buffer holds ``old``'s only
    reference (the trace frees it right after the sum, before anything else is allocated); otherwise out of
    place, whoever holds ``new`` (``var.add_(old_var)`` is for a sparse ``old`` only). The trace's out-of-place
    sum (2 = 0 + 1) is folded accordingly."""
    old, new, out = ("a", 0, 8), ("a", 1, 8), ("a", 2, 8)
    rec = _recorder_with([old, new, out, ("f", 0), ("f", 1)], [(2, 0, 1, 2)])
    assert rec.timeline.events == [old, new, ("f", 1)] and rec._alias == {2: 0}
    rec = _recorder_with([old, new, out, ("f", 1)], [(2, 0, 1, 2)])  # something else holds ``old``
    assert rec.timeline.events == [old, new, out, ("f", 1)] and rec._alias == {}
    rec = _recorder_with([old, new, out, ("a", 3, 8), ("f", 0)], [(2, 0, 1, 2)])  # ``old`` outlives the sum
    assert rec.timeline.events == [old, new, out, ("a", 3, 8), ("f", 0)] and rec._alias == {}
    rec = _recorder_with([old, new, out], [(2, 0, 1, 2)])  # both held elsewhere: a new tensor, as traced
    assert rec.timeline.events == [old, new, out] and rec._alias == {}

