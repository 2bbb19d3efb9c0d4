"""Memo tables keyed by an owner's identity (a loaded profile, a parameter table, an expansion): the value is
computed once per owner object and dropped with the table when it grows past its limit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def memo_by_owner(cache: dict[tuple, tuple[Any, Any]], key: tuple, owner: Any, build: Callable[[], T],
                  limit: int = 256) -> T:
    """``build()``, memoized in ``cache`` under ``key`` (which holds ``id(owner)``): a hit counts only while the
    entry's owner is ``owner`` itself (an id can be reused once its object is gone)."""
    hit = cache.get(key)
    if hit is None or hit[0] is not owner:
        if len(cache) > limit:
            cache.clear()
        hit = cache[key] = (owner, build())
    return hit[1]
