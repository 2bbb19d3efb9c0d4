"""Harness test fixtures: Hydra composition against conf/, offline data, every output under tmp_path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
TINY = "harness/assets/models/tiny-llama.json"
# Small and fast: fp32 on CPU (bf16 matmuls are slow there), 2 steps, seq 64.
TINY_OVERRIDES = ["model=tiny-llama", "data=synthetic", "training.seq_len=64", "training.micro_batch_size=2",
                  "training.precision=fp32"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    # No hub probing from tests: the fallback paths are what CI exercises.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.delenv("PROJECT_ROOT", raising=False)


def path_overrides(tmp_path: Path) -> list[str]:
    return [f"paths.root_dir={tmp_path}", f"paths.cache_dir={tmp_path}/cache"]


@pytest.fixture(scope="session", autouse=True)
def _hydra():
    """Initialise Hydra on conf/ once per session (compose() then costs only the composition)."""
    from hydra import initialize_config_dir

    import harness.config  # noqa: F401 - registers the schema and the resolver

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


def compose(*overrides: str, hydra_config: bool = False):
    from hydra import compose as hydra_compose

    return hydra_compose("measure", overrides=list(overrides), return_hydra_config=hydra_config)


def run_point(tmp_path: Path, *overrides: str, **kwargs):
    """Compose, convert and measure one point in this process's Hydra-free path (what the task function does)."""
    from harness.config import to_run
    from harness.launch import run_point as launch_point

    spec, opts = to_run(compose(*overrides, *path_overrides(tmp_path)))
    return launch_point(spec, opts, **kwargs)


def cli(*args: str, cwd: Path = ROOT, timeout: int = 300):
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)
