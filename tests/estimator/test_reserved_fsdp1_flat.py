"""FSDP1 without use_orig_params in the reserved replay (estimator.reserved.fsdp1), pure and fast: the layout's
short chunks, setup, the optimizer's flat shards and the adapter finder's helpers. The event-for-event checks
against real CPU runs are ``test_reserved_fsdp1.py``'s (``-m slow``)."""

import pytest

from estimator.methods.fsdp1 import Fsdp1Sizes, flat_unit
from estimator.models.params import ParamInfo
from estimator.profiler.expand import ALLOC, FREE, ExpansionError
from estimator.reserved import fsdp1
from estimator.spec import Fsdp1Spec

ELEM = 2  # bf16


def _param(name: str, numel: int, layer: int | None, trainable: bool = True) -> ParamInfo:
    return ParamInfo(name, (numel,), numel, ELEM, trainable, "other", layer, before_layers=layer is None or None)


def _table() -> list[ParamInfo]:
    """A root of 80 elements (divisible by 2, not 3), two layers of 13 (a 9 and a 4)."""
    root = [_param("embed", 40, None), _param("head", 40, None)]
    layers = [_param(f"layers.{i}.{n}", k, i) for i in range(2) for n, k in (("w", 9), ("b", 4))]
    return root[:1] + layers + root[1:]


def _sizes(table: list[ParamInfo], world: int, rank: int, orig_params: bool) -> Fsdp1Sizes:
    def unit(params):
        return flat_unit(params, world, rank, ELEM, ELEM, ELEM, orig_params)
    return Fsdp1Sizes(root=unit([p for p in table if p.layer is None]), layer=unit([p for p in table if p.layer == 0]),
                      options=Fsdp1Spec(use_orig_params=orig_params), mixed=False)


def test_the_flat_parameter_is_not_padded_and_the_last_chunk_is_short():
    units = fsdp1._units(_table(), 2, _sizes(_table(), 3, 2, False))
    layer = units[0]
    assert (layer.flat.numel, layer.flat.shard_numel, layer.paddings) == (13, 5, ())
    assert [layer.short_chunk_numel(r) for r in range(3)] == [None, None, 3]
    assert layer.stepped_bytes == 5 * ELEM  # the padded shard, what the optimizer steps
    assert units["root"].short_chunk_numel(2) == 26  # torch.chunk(80, 3): 27, 27, 26
    aligned = fsdp1._units(_table(), 2, _sizes(_table(), 3, 2, True))[0]
    assert aligned.flat.numel % 3 == 0 and aligned.short_chunk_numel(2) is None


def test_setup_pads_a_short_chunk_and_frees_the_full_flat_parameter():
    """``_get_shard``: the short chunk's clone, its padded copy (the clone freed with the moved tensors and the
    full flat parameter, which ``shard`` resizes to 0)."""
    table = _table()
    setup = fsdp1.fsdp1_setup(table, (0, 0), 2, _sizes(table, 3, 2, False), rank=2)
    names = [name for name, _ in setup.allocations]
    layer0 = names.index("flat.0")
    assert names[layer0:layer0 + 3] == ["flat.0", "shard_chunk.0", "shard.0"]
    assert [n for _, n in setup.allocations[layer0:layer0 + 3]] == [13 * ELEM, 3 * ELEM, 5 * ELEM]
    freed = dict(setup.frees_after)[layer0 + 2]
    assert {names[i] for i in freed} == {"shard_chunk.0", "moved.layers.0.w", "moved.layers.0.b", "flat.0"}
    rank0 = fsdp1.fsdp1_setup(table, (0, 0), 2, _sizes(table, 3, 0, False), rank=0)
    assert not any(name.startswith("shard_chunk.") for name, _ in rank0.allocations)


def test_the_optimizer_steps_each_trainable_flat_parameter_in_parameters_order():
    """Each FSDP module's flat parameter comes before its children's: the root, then each layer before its
    adapters; frozen ones are not stepped."""
    table = _table()
    units = fsdp1._units(table, 2, _sizes(table, 2, 0, False))
    assert fsdp1._stepped_units(units, 2) == ["root", 0, 1]
    frozen = [p if p.layer is not None else ParamInfo(p.name, p.shape, p.numel, ELEM, False, "other", None,
                                                       before_layers=True) for p in table]
    units = fsdp1._units(frozen, 2, _sizes(frozen, 2, 0, False))
    assert fsdp1._stepped_units(units, 2) == [0, 1]


def test_a_regime_of_one_micro_batch_size_reads_its_s_terms_per_row():
    per_s = [[0.0, 128.0, 0.0, 0.0, 0.0, 0.0], [64.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    assert fsdp1._per_row_polys(per_s) == [[0.0, 0.0, 0.0, 0.0, 128.0, 0.0], [64.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    assert fsdp1._per_token_bytes(fsdp1._per_row_polys(per_s), 0) == 128.0
    varied = [[0.0, 0.0, 0.0, 0.0, 128.0, 0.0], [0.0, 8.0, 0.0, 0.0, 0.0, 0.0]]
    assert fsdp1._per_row_polys(varied) is varied


def test_the_recompute_starts_where_the_layers_forward_allocations_repeat():
    forward = [(ALLOC, 1, 7), (ALLOC, 2, 8), (FREE, 1, 7), (ALLOC, 3, 9)]
    backward = [(ALLOC, 10, 5), (FREE, 10, 5), (ALLOC, 11, 6), (ALLOC, 12, 7), (ALLOC, 13, 8), (ALLOC, 14, 9)]
    ops = forward + backward
    at_mark = {0: [("fw", 1)], len(forward): [("bw", 1)]}
    assert fsdp1._recompute_start(ops, at_mark, len(forward), 1, n=3) == len(forward) + 3
    with pytest.raises(ExpansionError):
        fsdp1._recompute_start(ops, at_mark, len(forward), 0, n=3)
