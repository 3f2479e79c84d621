"""Which samples a period and a frequency keep, by coordinate value (``Source.period``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError


def as_step(value: Any, what: str) -> np.timedelta64:
    """``"6h"``, ``"1d"``, ``"30min"``, a ``timedelta``/``numpy.timedelta64``: a duration."""
    import pandas as pd

    try:
        step = pd.Timedelta(value)
    except (ValueError, TypeError):
        raise ConfigError(f"{what}={value!r} is not a duration; give e.g. '6h', '1d', "
                          "'30min' or a datetime.timedelta") from None
    if step <= pd.Timedelta(0):
        raise ConfigError(f"{what}={value!r} must be a positive duration")
    return np.timedelta64(step.value, "ns")


def regular_step(coord: np.ndarray, where: str) -> Any:
    """The one step between consecutive coordinate values, refused (naming the first
    place it changes) when there is none."""
    if coord.size < 2:
        raise ConfigError(f"{where} has {coord.size} sample(s): no step to take a "
                          "frequency of")
    steps = np.diff(coord)
    if not (steps == steps[0]).all():
        at = int(np.flatnonzero(steps != steps[0])[0])
        raise ConfigError(f"{where}'s coordinate is not regular: the step is {steps[0]} "
                          f"until {coord[at]}, then {steps[at]}; a frequency needs one step")
    return steps[0]


def _bound(value: Any, coord: np.ndarray, what: str) -> Any:
    if coord.dtype.kind == "M":
        try:
            return np.datetime64(value, "ns")
        except (ValueError, TypeError):
            raise ConfigError(f"{what}={value!r} is not a date; give e.g. '2020-01-01' or "
                              "'2020-01-01T06'") from None
    try:
        return coord.dtype.type(value)
    except (ValueError, TypeError):
        raise ConfigError(f"{what}={value!r} is not a value of a {coord.dtype} "
                          "coordinate") from None


def period_rows(coord: np.ndarray | None, url: str, start: Any, end: Any,
                frequency: Any) -> tuple[int, int, int]:
    """(first index, step in indices, count) of the samples in ``[start, end]`` every
    ``frequency``, checked against the sample coordinate ``coord`` of the source ``url``."""
    if coord is None:
        raise ConfigError(f"{url} has no coordinate along its sample dimension, so it has "
                          "no period to take")
    lo = 0 if start is None else int(np.searchsorted(coord, _bound(start, coord, "start"),
                                                       "left"))
    hi = coord.size if end is None else int(np.searchsorted(coord, _bound(end, coord, "end"),
                                                             "right"))
    every = 1
    if frequency is not None:
        stored = regular_step(coord, url)
        want = as_step(frequency, "frequency") if coord.dtype.kind == "M" else frequency
        ratio = want / stored
        if ratio < 1 or ratio != int(ratio):
            raise ConfigError(f"frequency={frequency!r} is not a multiple of the stored step "
                              f"{stored} of {url}")
        every = int(ratio)
    n = max(0, -(-(hi - lo) // every))
    if n == 0:
        span = f"{coord[0]} .. {coord[-1]}" if coord.size else "nothing"
        raise ConfigError(f"period start={start!r} end={end!r} holds no sample of "
                          f"{url}, which spans {span}")
    return lo, every, n
