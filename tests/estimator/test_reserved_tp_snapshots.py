"""Reserved replay of TP and dp_tp ranks against the H200 allocator snapshots of session 25 (torch 2.11,
transformers 5.17, Llama-3.2-1B mixed_bf16, emulated ranks; docs/allocator.md "TP and dp_tp ranks"). No torch: the
snapshots are read with the restricted unpickler, the profiles are the shipped ones."""

import pathlib

import pandas as pd
import pytest

from benchmarks.reserved_stream_diff import _live, generated, recorded
from calibrate.terms import rank_estimates
from estimator.hardware.residuals import load_coefficients
from estimator.models.params import ParamInfo
from estimator.models.profiles import traced_release
from estimator.profiler.cache import load_plain_and_checkpointed
from estimator.profiler.expand import ALLOC, expand
from estimator.reserved.rank import head_grad_bytes
from estimator.reserved.timeline import to_empty_tied_copies
from estimator.spec import TrainingSpec

ROOT = pathlib.Path(__file__).resolve().parents[2] / "data" / "measurements"
MIB = 1024 * 1024
HEAD_BYTES = 128256 * 2048 * 2  # Llama-3.2-1B's tied embedding / head in bf16
WORKSPACE_BYTES = 32 * MIB  # one cuBLAS workspace on Hopper


def _rows(gpu: str, run_ids: list[str]) -> pd.DataFrame:
    frames = [pd.read_csv(ROOT / gpu / f"{name}.csv", dtype=str, keep_default_na=False, na_values=[""])
              for name in ("gpu_snapshots", "gpu_emulated")]
    rows = pd.concat(frames, ignore_index=True)
    return rows[rows["run_id"].str[:16].isin(run_ids) & (rows["run_status"] == "ok")].reset_index(drop=True)


def _pct(predicted: int, measured: str) -> float:
    return 100.0 * (predicted - int(measured)) / int(measured)


def test_every_k_takes_both_profiles_from_one_model_code():
    """The transformers 5.17 twin ships for the tp 2 plain profile only: the checkpointed one fell back to the default
    (5.23) alone, the two prefixes differed by where one small tensor is freed, and dp_tp every-k:2 kept the prior."""
    training = TrainingSpec(precision="mixed_bf16", micro_batch_size=2, seq_len=1024, grad_ckpt=True,
                            model_code="5.17.0", ckpt_policy="every-k:2")
    _, plain, ckpt = load_plain_and_checkpointed("meta-llama/Llama-3.2-1B", training, 2, allow_build=False)
    assert traced_release(plain) == traced_release(ckpt)
    _, plain1, ckpt1 = load_plain_and_checkpointed("meta-llama/Llama-3.2-1B", training, 1, allow_build=False)
    assert traced_release(plain1) == traced_release(ckpt1) == "5.17"  # both twins ship: they stay


def _param(name: str, tied: tuple[str, ...] = ()) -> ParamInfo:
    return ParamInfo(name=name, shape=(4, 4), numel=16, elem_bytes=2, trainable=True, module_kind="linear",
                     layer=None, tied_names=tied)


def test_to_empty_makes_a_tied_tensor_twice():
    table = [_param("model.embed_tokens.weight", ("lm_head.weight",)), _param("model.norm.weight")]
    plain = [("model.embed_tokens.weight", 32), ("model.norm.weight", 32), ("buffers", 256)]
    replicated = list(plain)
    assert to_empty_tied_copies(replicated, table, swapped=False) == ((3, (3,)),)  # retie drops the head's copy
    swapped = list(plain)
    assert to_empty_tied_copies(swapped, table, swapped=True) == ((3, (0,)),)  # swap_tensors drops the first
    assert replicated[3] == swapped[3] == ("to_empty.lm_head.weight", 32)
    untied = list(plain)
    assert to_empty_tied_copies(untied, [_param("model.embed_tokens.weight")], swapped=True) == ()
    assert untied == plain


def _big_setup_events(requests: list, end: int) -> list[tuple[str, int]]:
    sizes, out = {}, []
    for request in requests[:end]:
        if request[0] == "alloc":
            sizes[request[1]] = request[2]
            if request[2] >= 100 * MIB:
                out.append(("A", request[2]))
        elif sizes.get(request[1], 0) >= 100 * MIB:
            out.append(("F", sizes[request[1]]))
    return out


@pytest.mark.parametrize("run_id", ["c18d98b58a82376d", "85f44c981a598d21", "a4b78a6f54206ff7"])
def test_the_setups_large_requests_are_the_snapshots(run_id):
    """TP x8 (the head's copy made and dropped after the buffers), dp_tp and FSDP2 (the embedding's fp32 shard
    made again after the buffers, the first freed)."""
    row = _rows("h200-141gb", [run_id]).iloc[0].to_dict()
    gen, gen_starts, _ = generated(row, steps=1)
    path = ROOT / "h200-141gb" / "snapshots" / f"{row['run_id']}.rank{row['rank']}.snapshot.pickle.gz"
    b, s = int(row["micro_batch_size"]), int(row["seq_len"])
    rec, rec_starts, _ = recorded(path, b * s * 8, _live(gen[:gen_starts[1]]))
    assert _big_setup_events(gen, gen_starts[1]) == _big_setup_events(rec, rec_starts[1])


def test_the_backward_workspace_follows_the_heads_weight_gradient():
    """In the TP x8 snapshot (b1: the reduce kernels' staging buffers are 16 MiB, so the only 32 MiB requests are
    the two cuBLAS workspaces) the backward thread's workspace comes right after the 501 MiB head gradient; the
    expansion puts it there, where it used to open the loss's backward."""
    row = _rows("h200-141gb", ["c18d98b58a82376d"]).iloc[0].to_dict()
    path = ROOT / "h200-141gb" / "snapshots" / f"{row['run_id']}.rank0.snapshot.pickle.gz"
    rec, _, _ = recorded(path, 1024 * 8)
    allocs = [r[2] for r in rec if r[0] == "alloc"]
    workspaces = [i for i, nbytes in enumerate(allocs) if nbytes == WORKSPACE_BYTES]
    assert len(workspaces) == 2 and allocs[workspaces[1] - 1] == HEAD_BYTES

    training = TrainingSpec(precision="mixed_bf16", micro_batch_size=1, seq_len=1024, model_code="5.17.0")
    _, plain, _ = load_plain_and_checkpointed("meta-llama/Llama-3.2-1B", training, 8, allow_build=False)
    events = plain["regimes"][0]["events"]
    expansion = expand(events, 16, head_grad_bytes=HEAD_BYTES)
    at = expansion.workspace_at[1]
    kind, _key, poly = expansion.first.ops[at - 1]
    assert kind == ALLOC and events["polys"][poly] == [HEAD_BYTES, 0, 0, 0, 0, 0]
    # the profile's traced first cuBLAS output (blas_first) gives the same place without the head's bytes
    assert expand(events, 16).workspace_at[1] == at
    untraced = {key: value for key, value in events.items() if key != "blas_first"}
    assert expand(untraced, 16).workspace_at[1] < at  # neither: the old place, the start of the loss's backward


def test_a_frozen_head_keeps_the_workspace_at_the_loss():
    table = [ParamInfo(name="model.embed_tokens.weight", shape=(8, 2), numel=16, elem_bytes=2, trainable=False,
                       module_kind="embedding", layer=None, tied_names=("lm_head.weight",))]
    assert head_grad_bytes(table) is None
    assert head_grad_bytes([_param("lm_head.weight")]) == 32


def test_under_autocast_the_heads_matmul_makes_a_16_bit_gradient():
    """amp: fp32 weights, the matmul in bf16 (the H200 amp snapshot's workspace follows a 501 MiB request, not the
    1002 MiB fp32 copy of the head's gradient)."""
    fp32_head = ParamInfo(name="lm_head.weight", shape=(4, 4), numel=16, elem_bytes=4, trainable=True,
                          module_kind="linear", layer=None)
    assert head_grad_bytes([fp32_head]) == 64
    assert head_grad_bytes([fp32_head], autocast_elem_bytes=2) == 32


def test_tp_and_dp_tp_rows_are_replayed_within_a_tenth_of_a_percent():
    """Before: dp_tp every-k:2 -16.7 % (prior), TP x8 b1 -5.5 %, dp_tp b1 -1.9 % on both GPUs."""
    for gpu, run_ids in (("h200-141gb", ["7addc9fe3f22cb20", "c18d98b58a82376d", "85f44c981a598d21"]),
                         ("h100-80gb", ["f57fb3ccdaaf7d14", "54c837f27b9de8ac"])):
        rows = _rows(gpu, run_ids)
        assert len(rows) >= 2 * len(run_ids)
        for (_, row), result in zip(rows.iterrows(), rank_estimates(rows, load_coefficients(gpu), allow_build=False)):
            _, rank = result
            assert rank.reserved_source == "replayed", row["run_id"]
            assert abs(_pct(rank.peak_reserved_bytes, row["peak_reserved_bytes"])) < 0.1, row["run_id"]
