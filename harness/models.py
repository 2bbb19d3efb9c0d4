"""Model config resolution for the harness: ``estimator.models.arch.load_config`` (catalogue name, config.json path,
hub id when online), plus config paths relative to the repository root (the tiny test models in
``harness/assets/models``), so a spec keeps a short, machine-independent ``model`` string."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from estimator.models.arch import load_config

REPO_ROOT = Path(__file__).resolve().parent.parent


def resolve_model_path(model: str) -> str:
    """``model`` itself, or its absolute path when it names a file relative to the repo root (not the cwd)."""
    path = Path(model).expanduser()
    if not path.is_absolute() and not path.exists() and (REPO_ROOT / path).exists():
        return str(REPO_ROOT / path)
    return model


def load_model_config(model: str, *, allow_hub: bool = True) -> dict[str, Any]:
    """The HF config dict; raises ValueError("model: ...") with the estimator's wording when unknown. Hub ids
    outside the catalogue are fetched when the hub is reachable (the harness may download; the estimator not)."""
    return load_config(resolve_model_path(model), allow_hub=allow_hub)


def max_positions(config: dict[str, Any]) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
