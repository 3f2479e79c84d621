"""Channel names one way: ``"temperature@500"`` (the form ``loader.channel_names`` gives)
and ``("temperature", 500)`` are one channel, a level matched by value (500, 500.0, "500")
and named as stored. ``nodes/channels`` and ``store/statistics`` read names through here.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np

from ..errors import ConfigTypeError


def split_channel(item: Any, names: Collection[str] = ()) -> tuple[str, Any]:
    """``(name, level or None)`` of a channel as written: ``"t2m"``, ``"temperature@500"``
    (the form ``loader.channel_names`` gives) or ``("temperature", 500)``. A string that is
    one of ``names`` (a variable or label, which may hold an ``@``) is a name alone."""
    if isinstance(item, str):
        if item in names or "@" not in item:
            return item, None
        name, _, level = item.rpartition("@")
        return name, level
    if isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str):
        return item[0], item[1]
    raise ConfigTypeError(f"channel {item!r}: a channel is a name ('2m_temperature'), a "
                          "level of a variable written 'temperature@500', or a pair "
                          "('temperature', 500)")


def level_index(values: np.ndarray, level: Any) -> int | None:
    """Where ``level`` is in the coordinate ``values``, matched by value: 500, 500.0, "500"
    and ``np.int64(500)`` all match a stored 500 (or 500.0); ``None`` if not exactly once."""
    values = np.asarray(values)
    if values.dtype.kind in "biuf":
        if isinstance(level, bool):
            return None
        try:
            x = float(level)
        except (TypeError, ValueError):
            return None
        hits = np.flatnonzero(values.astype(np.float64) == x)
    else:
        hits = np.flatnonzero(values.astype(str) == str(level))
    return int(hits[0]) if hits.size == 1 else None


def level_label(name: str, value: Any) -> str:
    """A level's channel name as stored: ``temperature@500`` for a stored 500, however the
    level was typed (``loader.channel_names``, statistics rows)."""
    v = value.item() if isinstance(value, np.generic) else value
    return f"{name}@{v}"
