"""The fields of a split manifest's JSON, each checked: a field missing or of the wrong
type is a ``StoreError`` naming it (``SplitManifest.from_dict``)."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from ..errors import StoreError


def is_int(x: object) -> bool:
    """An integer that is not a bool (JSON's ``true`` is not a count)."""
    return isinstance(x, int) and not isinstance(x, bool)


class _Missing(enum.Enum):
    MISSING = enum.auto()


_MISSING = _Missing.MISSING
_T = TypeVar("_T")


def checked_field(d: Mapping[str, Any], key: str, kind: type[_T],
                  default: _T | _Missing = _MISSING) -> _T:
    """``d[key]``, checked to be a ``kind`` (ints: not bools), else a ValueError naming it."""
    if key not in d:
        if isinstance(default, _Missing):
            raise StoreError(f"split manifest has no field {key!r} (it has {sorted(d)})")
        return default
    value = d[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise StoreError(f"split manifest field {key!r} must be {kind.__name__}, got {value!r}")
    return value


def fractions_field(raw: list) -> tuple[float, ...]:
    if not all(isinstance(f, (int, float)) and not isinstance(f, bool) for f in raw):
        raise StoreError(f"split manifest field 'fractions' must be a list of numbers, "
                         f"got {raw!r}")
    return tuple(float(f) for f in raw)


def snapshot_field(raw: object) -> str | None:
    if raw is not None and not isinstance(raw, str):
        raise StoreError(f"split manifest field 'snapshot_id' must be a string or null, "
                         f"got {raw!r}")
    return raw


def periods_field(raw: list) -> tuple[tuple[str, str | None, str | None], ...]:
    ok = all(isinstance(p, list) and len(p) == 3 and isinstance(p[0], str)
             and all(x is None or isinstance(x, str) for x in p[1:]) for p in raw)
    if not ok:
        raise StoreError(f"split manifest field 'periods' must be a list of [split, start, "
                         f"end] (start/end strings or null), got {raw!r}")
    return tuple((n, a, b) for n, a, b in raw)


def check_members(saved: Sequence[str], now: Sequence[str], what: str) -> None:
    """Refuse a composition whose stores differ from the saved one, naming the first
    member that changed (or the count, when members were added or removed)."""
    if tuple(saved) == tuple(now) or not saved:
        return
    for i, (a, b) in enumerate(zip(saved, now, strict=False)):
        if a != b:
            raise StoreError(f"{what} was made for a composed source whose member {i} was "
                             f"{a!r}; this source's member {i} is {b!r}. Open the stores it "
                             "was made on, or make a new manifest (split_by_chunk)")
    raise StoreError(f"{what} was made for a composition of {len(saved)} stores, this one "
                     f"has {len(now)} (members now: {list(now)})")
