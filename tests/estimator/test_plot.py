"""Breakdown chart (estimator.io.plot): bar extraction without matplotlib, a PNG with it."""

from __future__ import annotations

import builtins
from types import SimpleNamespace

import pytest

from estimator.baselines.equations import Baseline
from estimator.io.plot import breakdown_bars, plot_breakdown

GIB = 1 << 30

ESTIMATE = {  # the shape of Estimate.to_dict()
    "label": "zero3 x4", "capacity_bytes": 80 * GIB,
    "ranks": [{"rank": 0, "breakdown": {"params": 10 * GIB, "activations": 20 * GIB, "correction": -GIB}},
              {"rank": 1, "breakdown": {"params": 10 * GIB, "activations": 25 * GIB}}],
}


def test_breakdown_bars_from_dicts_objects_and_baselines():
    spec = SimpleNamespace(parallel=SimpleNamespace(method="ddp", world_size=2))
    as_object = SimpleNamespace(spec=spec, capacity_bytes=40 * GIB,
                                ranks=[SimpleNamespace(rank=0, breakdown={"params": GIB})])
    bars = breakdown_bars([ESTIMATE, as_object, Baseline("llmem", 3 * GIB, {"m_base": GIB, "chunks": 2 * GIB})])
    assert [label for label, _, _ in bars] == ["zero3 x4 r0", "zero3 x4 r1", "ddp x2", "llmem"]
    assert [cap for _, _, cap in bars] == [80 * GIB, 80 * GIB, 40 * GIB, None]
    assert bars[3][1] == {"m_base": GIB, "chunks": 2 * GIB}
    with pytest.raises(ValueError, match="^plot: estimate '#0' has neither ranks nor a breakdown"):
        breakdown_bars([{}])


def test_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = plot_breakdown([ESTIMATE, Baseline("llmem", 3 * GIB, {"m_base": GIB, "chunks": 2 * GIB})],
                         tmp_path / "sub" / "breakdown.png", title="test")
    assert out == tmp_path / "sub" / "breakdown.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_empty_list_is_refused(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="^plot: nothing to plot"):
        plot_breakdown([], tmp_path / "x.png")


def test_missing_matplotlib_is_one_line(monkeypatch, tmp_path):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match=r"^plot: matplotlib is not installed; pip install "
                                          r"'llm-memory-estimator\[plot\]'$"):
        plot_breakdown([ESTIMATE], tmp_path / "x.png")
