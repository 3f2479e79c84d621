"""anemoi-datasets' ``open_dataset`` specs (a path, list, dict or its YAML) as one ``Source``:
``join`` / ``concat`` become ``compose.join`` / ``concat``, checked as anemoi checks them; the
options apply in anemoi's order (``usage/dataset.py`` ``__subset``) with its date rules
(``usage/misc.py``). Any other key is refused by name. anemoi-datasets is not imported."""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError, ConfigTypeError, InternalError, MissingDependencyError
from .source import Source, open_source

__all__ = ["Options", "Spec", "open_anemoi", "parse_frequency", "parse_spec", "resolve_date"]

COMBINERS = ("dataset", "datasets", "join", "concat")
SUPPORTED = COMBINERS + ("start", "end", "frequency", "select", "drop", "rename",
                         "fill_missing_gaps")
SECOND = np.timedelta64(1, "s")
DATES = ("a date is a year (2020, '2020'), a month (202003, '2020-03'), a day (20200301, "
         "'2020-03-01', a date), an instant ('2020-03-01T06:00:00', a datetime or "
         "datetime64), or a share of the dates ('25%')")
FREQUENCIES = ("a frequency is a positive whole number of seconds: hours (6, '6'), '6h', '1d', "
               "'30m', '10s', '1:30', '1:30:00' or a timedelta")


@dataclass(frozen=True)
class Options:
    """The keys applied to a dataset or a combination (``None``/empty: not given)."""

    start: Any = None
    end: Any = None
    frequency: np.timedelta64 | None = None
    select: tuple[str, ...] | None = None
    select_in_store_order: bool = False  # select given as a set: the store's order
    drop: tuple[str, ...] = ()
    rename: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Spec:
    """One node of a spec: a store, or a combination of members; then its options."""

    where: str  # its place in the spec, for messages: "spec", "spec.join[1]"
    kind: str  # "path", "join", "concat", "dataset" (several: joined or concatenated)
    path: str | None = None
    members: tuple[Spec, ...] = ()
    options: Options = Options()
    fill_missing_gaps: bool = False


def open_anemoi(spec: Any) -> Source:
    """What anemoi-datasets' ``open_dataset(spec)`` serves: values, variable order, dates,
    missing dates. ``spec``: a path, list, dict or YAML text (a config's ``dataset:``)."""
    return _evaluate(parse_spec(spec)).source


def _bad(where: str, value: Any, valid: str) -> ConfigError:
    return ConfigError(f"open_anemoi: {where} is {value!r}; {valid}")


def parse_spec(spec: Any) -> Spec:
    """``spec`` checked and parsed; nothing is opened."""
    if isinstance(spec, str) and ("\n" in spec or re.search(r":\s|^\s*[\[{]", spec)):
        try:
            import yaml
        except ImportError:
            raise MissingDependencyError("open_anemoi reads YAML text with PyYAML: pip "
                                         "install pyyaml, or pass the spec as a dict") from None
        try:
            spec = yaml.safe_load(spec)
        except yaml.YAMLError as e:
            raise _bad("spec", spec, f"not valid YAML ({e}); give a path, a dict or the "
                       "YAML of a dataset: entry") from None
    return _node(spec, "spec")


def _node(value: Any, where: str) -> Spec:
    if isinstance(value, (str, os.PathLike)):
        if "${" in os.fspath(value):
            raise _bad(where, value, "an unresolved interpolation: resolve the config first "
                       "(OmegaConf.to_container(cfg, resolve=True))")
        return Spec(where, "path", path=os.fspath(value))
    if isinstance(value, (list, tuple)):
        return Spec(where, "dataset", members=_members(value, where))
    if isinstance(value, Mapping):
        return _mapping(value, where)
    raise ConfigTypeError(f"open_anemoi: {where} is {value!r} ({type(value).__name__}); a "
                          "dataset is a path, a list of datasets or a dict with one of "
                          f"{list(COMBINERS)}")


def _members(value: Any, where: str) -> tuple[Spec, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise _bad(where, value, "it takes a non-empty list of datasets (paths or dicts)")
    return tuple(_node(v, f"{where}[{i}]") for i, v in enumerate(value))


def _mapping(m: Mapping[Any, Any], where: str) -> Spec:
    unknown = [k for k in m if k not in SUPPORTED]
    if unknown:
        raise ConfigError(f"open_anemoi: {where} has key(s) {unknown}, which open_anemoi does "
                          f"not support; supported keys: {list(SUPPORTED)}")
    combine = [k for k in COMBINERS if k in m]
    if len(combine) != 1:
        raise ConfigError(f"open_anemoi: {where} has {combine or 'none'} of {list(COMBINERS)}; "
                          f"a dict takes exactly one (its keys: {list(m)})")
    key = combine[0]
    gaps = m.get("fill_missing_gaps", False)
    if "fill_missing_gaps" in m and (key != "concat" or not isinstance(gaps, bool)):
        raise _bad(f"{where}.fill_missing_gaps", gaps, "it is true or false, beside concat only")
    inner = f"{where}.{key}"
    if key in ("join", "concat") or isinstance(m[key], (list, tuple)):
        members = _members(m[key], inner)
    else:
        members = (_node(m[key], inner),)
    return Spec(where, "dataset" if key == "datasets" else key, members=members,
                options=_options(m, where), fill_missing_gaps=gaps)


def _options(m: Mapping[str, Any], where: str) -> Options:
    kw: dict[str, Any] = {}
    for key in ("start", "end"):
        if m.get(key) is not None:  # checked on a date here, resolved on the dataset's own
            resolve_date(m[key], np.array(["2000-01-01"], "M8[s]"), last=key == "end",
                         where=f"{where}.{key}")
            kw[key] = m[key]
    if "frequency" in m:
        kw["frequency"] = parse_frequency(m["frequency"], f"{where}.frequency")
    if "select" in m:
        kw["select"] = _names(m["select"], f"{where}.select", allow_empty=False)
        kw["select_in_store_order"] = isinstance(m["select"], (set, frozenset))
    if "drop" in m:
        kw["drop"] = _names(m["drop"], f"{where}.drop", allow_empty=True)
    if "rename" in m:
        ren = m["rename"]
        if not isinstance(ren, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in ren.items()):
            raise _bad(f"{where}.rename", ren, "it maps old names to new ones ({'2t': 't2m'})")
        kw["rename"] = tuple(ren.items())
    return Options(**kw)


def _names(value: Any, where: str, allow_empty: bool) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (set, frozenset)):
        value = sorted(value, key=str)
    if (not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value)
            or (not value and not allow_empty)):
        raise _bad(where, value, "it takes a variable name, a list of names (kept in that "
                   "order) or a set (the store's order)" + ("" if allow_empty else ", not empty"))
    return tuple(value)


def parse_frequency(value: Any, where: str = "frequency") -> np.timedelta64:
    """A frequency as anemoi-utils' ``frequency_to_timedelta`` reads it (an int or digits
    are hours, ``m`` is minutes), as a positive ``timedelta64[s]``."""
    seconds: float | None = None
    if isinstance(value, np.timedelta64):
        seconds = value / SECOND
    elif isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int) and not isinstance(value, bool):
        seconds = value * 3600
    elif isinstance(value, str):
        seconds = _frequency_seconds(value.strip().removeprefix("+"))
    if seconds is None or seconds <= 0 or seconds != int(seconds):
        raise _bad(where, value, FREQUENCIES)
    return np.timedelta64(int(seconds), "s")


def _frequency_seconds(text: str) -> int | None:
    if re.fullmatch(r"\d+", text):
        return int(text) * 3600
    if m := re.fullmatch(r"(\d+)([hdms])", text, re.IGNORECASE):
        return int(m[1]) * {"d": 86400, "h": 3600, "m": 60, "s": 1}[m[2].lower()]
    if m := re.fullmatch(r"(\d+):(\d+)(?::(\d+))?", text):
        return int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3] or 0)
    return None


def resolve_date(value: Any, dates: np.ndarray, *, last: bool, where: str = "start") -> Any:
    """anemoi's ``as_first_date`` / ``as_last_date`` (``usage/misc.py``): a year, month or
    day from its first second to its last, rounded into ``dates`` (``round_datetime``)."""
    bad = _bad(where, value, DATES)
    if isinstance(value, datetime.datetime):  # before date: a datetime is a date
        if value.tzinfo is not None:
            value = value.astimezone(datetime.UTC).replace(tzinfo=None)
        value = np.datetime64(value, "s")
    elif isinstance(value, datetime.date):
        value = value.year * 10_000 + value.month * 100 + value.day
    if isinstance(value, np.datetime64):
        return _round(value.astype("M8[s]"), dates, up=not last)
    if isinstance(value, str):
        text = value.strip()
        value = int(text) if re.fullmatch(r"\d+", text) else _date_text(text, dates, last, bad)
        if isinstance(value, np.datetime64):
            return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad
    digits = str(value)  # anemoi: by length, YYYY, YYYYMM or YYYYMMDD
    text = {4: digits, 6: f"{digits[:4]}-{digits[4:]}",
            8: f"{digits[:4]}-{digits[4:6]}-{digits[6:]}"}.get(len(digits), "no date")
    try:
        first = np.datetime64(text)
    except ValueError:
        raise bad from None
    bound = (first + 1).astype("M8[s]") - SECOND if last else first.astype("M8[s]")
    return _round(bound, dates, up=not last)


def _date_text(text: str, dates: np.ndarray, last: bool, bad: ConfigError) -> Any:
    """A date string as anemoi's ``_as_date`` reads it: an int, or one of ``dates``."""
    if (m := re.fullmatch(r"(\d+(?:\.\d*)?)%", text)) and float(m[1]) <= 100:
        share, eps = float(m[1]) * len(dates) / 100, 2 ** -30
        index = int(share + eps) - 1 if last else int(share - eps)
        return dates[max(0, min(len(dates) - 1, index))]
    if m := re.fullmatch(r"(\d+)-(\d+)-(\d+)[T ](\d+):(\d+):(\d+)", text):
        try:
            when = np.datetime64("{:04}-{:02}-{:02}T{:02}:{:02}:{:02}".format(
                *(int(g) for g in m.groups())))
        except ValueError:
            raise bad from None
        return _round(when.astype("M8[s]"), dates, up=not last)
    if m := re.fullmatch(r"(\d+)-(\d+)(?:-(\d+))?", text):
        y, mo = int(m[1]), int(m[2])
        return y * 100 + mo if m[3] is None else y * 10_000 + mo * 100 + int(m[3])
    raise bad


def _round(when: np.datetime64, dates: np.ndarray, *, up: bool) -> np.datetime64:
    """``when``, else the next date (``up``) or the one before, else the nearest end."""
    i = int(np.searchsorted(dates, when, side="left"))
    if i == len(dates):
        return dates[-1]
    return dates[i] if dates[i] == when or up or i == 0 else dates[i - 1]


@dataclass(frozen=True)
class _Opened:
    source: Source
    frequency: np.timedelta64 | None  # anemoi's frequency of it (None: under two dates)


def _evaluate(spec: Spec) -> _Opened:
    if spec.kind == "path":
        return _apply(_open_path(spec), spec.options, spec.where)
    members = [_evaluate(m) for m in spec.members]
    kind = spec.kind
    if kind == "dataset":  # anemoi's _concat_or_join: the same first and last dates join
        kind = "join" if len({(_dates(m)[0], _dates(m)[-1]) for m in members}) == 1 else "concat"
    if len(members) == 1:
        opened = members[0]
    else:
        opened = _join(members, spec) if kind == "join" else _concat(members, spec)
    return _apply(opened, spec.options, spec.where)


def _open_path(spec: Spec) -> _Opened:
    src = open_source(str(spec.path))
    if src.format != "anemoi" or src.group is None:
        raise _bad(spec.where, spec.path, "not an anemoi dataset (a Zarr group with data, "
                   "dates and a variables attribute); open it with open_source")
    attr = src.group.attrs.get("frequency")
    if attr is not None:
        return _Opened(src, parse_frequency(attr, f"the frequency attribute of {spec.path!r}"))
    dates = _dates(src)
    return _Opened(src, dates[1] - dates[0] if len(dates) > 1 else None)


def _dates(src: Source | _Opened) -> np.ndarray:
    src = src.source if isinstance(src, _Opened) else src
    if src.sample_coord is None:
        raise InternalError(f"the anemoi source {src.url} has no dates")
    return np.asarray(src.sample_coord).astype("M8[s]")


def _join(members: list[_Opened], spec: Spec) -> _Opened:
    """anemoi's ``Join(...)._overlay()`` (``usage/gridded/join.py``): the members' dates and
    frequency match; a variable in several members takes the last one's values at the
    first one's place. As in anemoi, the earlier ones are named ``(v)`` and left out."""
    _check_same(spec, "frequency", [m.frequency for m in members])
    from .compose import join  # its align="exact" refuses other dates

    seen: set[str] = set()
    renames: list[dict[str, str]] = [{} for _ in members]
    for i in reversed(range(len(members))):
        for v in reversed(members[i].source.served_names()):
            name = v
            while name in seen:
                name = f"({name})"
            seen.add(name)
            if name != v:
                renames[i][v] = name
    joined = join([m.source.rename(r) if r else m.source
                   for m, r in zip(members, renames, strict=True)], align="exact")
    order = tuple(dict.fromkeys(v for m in members for v in m.source.served_names()))
    if any(renames):
        joined = joined.select(list(order))
    return _Opened(joined, members[0].frequency)


def _concat(members: list[_Opened], spec: Spec) -> _Opened:
    """anemoi's ``Concat`` (``usage/gridded/concat.py``): the same variables in the same
    order and the same frequency; in date order, not overlapping, each member starting one
    step after the previous one ends (a gap is missing dates with ``fill_missing_gaps``).
    ``compose.concat`` refuses overlaps and fills the gaps."""
    _check_same(spec, "variables", [m.source.served_names() for m in members])
    _check_same(spec, "frequency", [m.frequency for m in members])
    step, where = members[0].frequency, [s.where for s in spec.members]
    if step is None:
        raise _bad(where[0], spec.members[0].path, "a single date: no frequency to "
                   "concatenate the others at")
    ranges = [(_dates(m)[0], _dates(m)[-1]) for m in members]
    for i in range(len(ranges) - 1):
        end, start = ranges[i][1], ranges[i + 1][0]
        gap = start - end
        if gap == step or (spec.fill_missing_gaps and gap > step and not gap % step):
            continue
        raise ConfigError(
            f"open_anemoi: {where[i]} ends at {end} and {where[i + 1]} starts at {start}; "
            f"concat takes members in date order, each starting one step ({step}) after the "
            "previous one ends" + ("" if spec.fill_missing_gaps else
                                   " (fill_missing_gaps: true makes a gap missing dates)"))
    from .compose import concat

    return _Opened(concat([m.source for m in members]), step)


def _check_same(spec: Spec, what: str, values: list[Any]) -> None:
    for s, v in zip(spec.members[1:], values[1:], strict=True):
        if v != values[0]:
            raise ConfigError(f"open_anemoi: the members of {spec.where}.{spec.kind} differ in "
                              f"{what}: {spec.members[0].where} has {values[0]}, {s.where} has "
                              f"{v}; they must be the same")


def _apply(opened: _Opened, opts: Options, where: str) -> _Opened:
    """``opts`` in anemoi's order: start/end, frequency, select, drop, rename."""
    src, step = opened.source, opened.frequency
    if opts.start is not None or opts.end is not None:
        src, step = _period(src, opts, where)
    if opts.frequency is not None:
        src, step = _every(src, step, opts.frequency, where)
    if opts.select is not None:
        chosen = _known(opts.select, src, f"{where}.select")
        if opts.select_in_store_order:
            chosen = tuple(v for v in src.served_names() if v in chosen)
        src = src.select(list(chosen))
    if opts.drop:
        src = src.drop(list(_known(opts.drop, src, f"{where}.drop")))
    if opts.rename:
        _known(tuple(k for k, _ in opts.rename), src, f"{where}.rename")
        src = src.rename(dict(opts.rename))  # it refuses two variables of one name
    return _Opened(src, step)


def _known(chosen: tuple[str, ...], src: Source, where: str) -> tuple[str, ...]:
    unknown = [v for v in chosen if v not in src.served_names()]
    if unknown:
        raise _bad(where, list(chosen), f"the dataset has no {unknown}; its variables: "
                   f"{list(src.served_names())}")
    return chosen


def _period(src: Source, opts: Options, where: str) -> tuple[Source, np.timedelta64 | None]:
    """anemoi's ``_dates_to_indices``: the dates from the rounded start to the rounded end."""
    dates = _dates(src)
    lo = (dates[0] if opts.start is None else
          resolve_date(opts.start, dates, last=False, where=f"{where}.start"))
    hi = (dates[-1] if opts.end is None else
          resolve_date(opts.end, dates, last=True, where=f"{where}.end"))
    kept = dates[(dates >= lo) & (dates <= hi)]
    if not kept.size:
        raise ConfigError(f"open_anemoi: {where} start {opts.start!r}, end {opts.end!r} ({lo}"
                          f" .. {hi}) leave none of its dates {dates[0]} .. {dates[-1]}")
    src = src.period(start=kept[0], end=kept[-1])
    return src, (kept[1] - kept[0] if len(kept) > 1 else None)


def _every(src: Source, step: np.timedelta64 | None, frequency: np.timedelta64,
           where: str) -> tuple[Source, np.timedelta64 | None]:
    """anemoi's ``_frequency_to_indices``: every k-th date from the first."""
    if step is None or frequency % step:
        raise _bad(f"{where}.frequency", frequency, "not a multiple of the dataset's "
                   f"frequency ({step or 'none: a single date'}); anemoi's "
                   "interpolate_frequency, which makes new dates, is not supported")
    every = int(frequency // step)
    if every == 1:
        return src, step
    many = src.n_samples > every  # two dates or more kept: every k-th from the first
    return src.period(frequency=frequency), (frequency if many else None)
