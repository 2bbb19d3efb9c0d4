"""Hydra callback for sweeps (``conf/hydra/default.yaml``): validate every point before any runs, show a
progress bar, print one summary line at the end.

* ``on_multirun_start``: expands the sweep exactly as Hydra's BasicSweeper does (``hydra.sweeper.params`` plus
  the command line), composes each point and converts it to (RunSpec, HarnessOptions): a bad value anywhere in
  the grid stops the sweep before the first GPU minute, with one line naming the key and the point (exit 2).
* ``on_job_end``: advances the bar (in-process launchers; with submitit the jobs end elsewhere).
* ``on_multirun_end``: counts the statuses from every job's ``point.json`` (works for submitit too, the sweep
  dir being on a shared file system) and prints ``sweep: N points: a ok, b oom, ... in T s``.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

EXIT_USAGE = 2


def expand_sweep(config: DictConfig) -> list[list[str]]:
    """Every job's override list, in the order BasicSweeper launches them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = config.hydra.sweeper.get("params") or {}
    arguments = [f"{key}={value}" for key, value in params.items()] + list(config.hydra.overrides.task)
    overrides = OverridesParser.create().parse_overrides(arguments)
    return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


class JobComposer:
    """Each job's composed config. Jobs that differ only in plain ``key=value`` overrides share one
    composition (Hydra takes ~0.1-0.5 s per composition; a 500-point grid has few distinct group choices):
    the plain values are then applied with ``OmegaConf.update``, type-checked against the schema like Hydra."""

    def __init__(self, config_name: str) -> None:
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.override_parser.overrides_parser import OverridesParser

        self.loader = GlobalHydra.instance().config_loader()
        self.groups = set(self.loader.list_groups(""))
        self.parser = OverridesParser.create()
        self.config_name = config_name
        self._cache: dict[tuple[str, ...], DictConfig] = {}

    def compose(self, job: list[str]) -> DictConfig:
        from hydra.types import RunMode

        overrides = self.parser.parse_overrides(job)
        plain = [o for o in overrides if self._is_plain(o)]
        structural = tuple(o.input_line for o in overrides if not self._is_plain(o))
        if structural not in self._cache:
            self._cache[structural] = self.loader.load_configuration(
                config_name=self.config_name, overrides=list(structural), run_mode=RunMode.MULTIRUN)
        cfg = self._cache[structural].copy()
        for override in plain:
            try:
                OmegaConf.update(cfg, override.key_or_group, override.value(), merge=True)
            except Exception as err:  # noqa: BLE001 - worded as Hydra would: the key first
                raise ValueError(f"{override.key_or_group}: {str(err).splitlines()[0]}") from None
        return cfg

    def _is_plain(self, override) -> bool:
        """A value override (``training.seq_len=1024``), not a group choice (``training=paper``,
        ``hydra/launcher=...``), an addition/deletion or a hydra setting."""
        key = override.key_or_group
        return (override.package is None and not override.is_add() and not override.is_delete()
                and not override.is_force_add() and key not in self.groups and "/" not in key
                and not key.startswith("hydra."))


def validate_jobs(config: DictConfig, jobs: list[list[str]]) -> str | None:
    """The first invalid point as one line, or None: each point composed, converted and planned (no run)."""
    from harness.config import to_run
    from harness.environment import detect_device
    from harness.launch import plan_point

    device = detect_device()
    composer = JobComposer(config.hydra.job.config_name)
    for job in jobs:
        try:
            spec, opts = to_run(composer.compose(job))
            plan_point(spec, opts, device, check_data=False, check_device=not opts.dry_run)
        except ValueError as err:
            return f"{err}  [point: {' '.join(job)}]"
    return None


class SweepCallback(Callback):
    def __init__(self) -> None:
        self.bar: Any = None
        self.started = 0.0
        self.total = 0

    def __getstate__(self) -> dict[str, Any]:
        # submitit pickles Hydra's context, callbacks included, into every job: the bar stays here.
        return {**self.__dict__, "bar": None}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = time.perf_counter()
        jobs = expand_sweep(config)
        self.total = len(jobs)
        problem = validate_jobs(config, jobs)
        if problem is not None:
            print(f"error: {problem}", file=sys.stderr)
            sys.exit(EXIT_USAGE)
        if not str(OmegaConf.select(config, "hydra.launcher._target_") or "").endswith("BasicLauncher"):
            return  # jobs end in other processes (submitit): only the summary line is meaningful here
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc="sweep", unit="point", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            self.bar = None

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.close()
        counts = count_statuses(Path(config.hydra.sweep.dir))
        elapsed = time.perf_counter() - self.started
        print(summary(counts, self.total, elapsed, OmegaConf.select(config, "campaign")), flush=True)


def count_statuses(sweep_dir: Path) -> Counter:
    from harness.files import read_json

    counts: Counter = Counter()
    for path in sweep_dir.glob("*/point.json"):
        counts[(read_json(path) or {}).get("status", "unknown")] += 1
    return counts


def summary(counts: Counter, total: int, elapsed_s: float, campaign: str | None) -> str:
    done = sum(counts.values())
    parts = ", ".join(f"{n} {status}" for status, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    missing = f", {total - done} without a result" if total > done else ""
    return f"sweep {campaign or ''}: {total} points: {parts or 'none finished'}{missing} in {elapsed_s:.0f} s"
