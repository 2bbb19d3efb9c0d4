"""Stacked-bar chart of memory breakdowns: one bar per (estimate, rank), with the GPU capacity as a line.

matplotlib is imported inside ``plot_breakdown`` only (the ``plot`` extra), never on the predict path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

GIB = float(1 << 30)


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _label(item: Any, index: int) -> str:
    for name in ("label", "name", "method"):
        value = _get(item, name)
        if value:
            return str(value)
    spec = _get(item, "spec")
    parallel = _get(spec, "parallel") if spec is not None else None
    method = _get(parallel, "method") if parallel is not None else None
    if method:
        world = _get(parallel, "world_size", 1)
        return f"{method} x{world}" if world and world > 1 else str(method)
    return f"#{index}"


def breakdown_bars(estimates: list[Any]) -> list[tuple[str, dict[str, float], float | None]]:
    """(label, breakdown in bytes, capacity in bytes or None) per bar.

    Each item is an ``Estimate`` (or its ``to_dict()``) with ``ranks``, each rank carrying a ``breakdown``
    and a ``rank``. An item with a single ``breakdown`` (a ``baselines.Baseline``, a ``RankEstimate``)
    gives one bar. Labels come from ``label`` / ``name`` / ``method`` / ``spec.parallel.method``.
    """
    bars = []
    for index, item in enumerate(estimates):
        label = _label(item, index)
        capacity = _get(item, "capacity_bytes")
        ranks = _get(item, "ranks")
        if ranks:
            for rank in ranks:
                number = _get(rank, "rank")
                name = label if len(ranks) == 1 else f"{label} r{number if number is not None else '?'}"
                bars.append((name, dict(_get(rank, "breakdown") or {}), capacity))
        elif _get(item, "breakdown") is not None:
            bars.append((label, dict(_get(item, "breakdown")), capacity))
        else:
            raise ValueError(f"plot: estimate {label!r} has neither ranks nor a breakdown")
    return bars


def plot_breakdown(estimates: list[Any], path: str | Path, *, title: str | None = None) -> Path:
    """Write a stacked bar chart (GiB) of each estimate's per-rank breakdown to ``path`` (format from suffix).

    Components are stacked in first-seen order; negative components (corrections) are left out of the stack.
    Capacities are drawn as a dashed line, one per distinct value. Returns the path written.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plot: matplotlib is not installed; pip install 'llm-memory-estimator[plot]'") from None
    bars = breakdown_bars(list(estimates))
    if not bars:
        raise ValueError("plot: nothing to plot (empty list of estimates)")
    components: list[str] = []
    for _, breakdown, _ in bars:
        components.extend(k for k in breakdown if k not in components)

    figure = Figure(figsize=(max(6.0, 0.9 * len(bars) + 3.0), 5.0), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    positions = list(range(len(bars)))
    bottoms = [0.0] * len(bars)
    palette = _palette(len(components))
    for component, color in zip(components, palette, strict=True):
        heights = [max(0.0, float(b.get(component, 0))) / GIB for _, b, _ in bars]
        if any(heights):
            axes.bar(positions, heights, bottom=bottoms, label=component, color=color, width=0.7)
            bottoms = [bottom + height for bottom, height in zip(bottoms, heights, strict=True)]
    for capacity in sorted({c for _, _, c in bars if c}):
        axes.axhline(capacity / GIB, color="black", linestyle="--", linewidth=1.0)
        axes.annotate(f"capacity {capacity / GIB:.1f} GiB", xy=(0, capacity / GIB), xycoords=("axes fraction", "data"),
                      xytext=(2, 2), textcoords="offset points", fontsize=8)
    axes.set_xticks(positions, [label for label, _, _ in bars], rotation=30, ha="right")
    axes.set_ylabel("GiB")
    axes.set_title(title or "Per-rank memory breakdown")
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path


def _palette(n: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    return [cmap(i % 20) for i in range(n)]
