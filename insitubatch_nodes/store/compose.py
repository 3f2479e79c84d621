"""Several stores as one source: ``join`` (their variables on a common sample axis) and
``concat`` (their periods one after another).

Nothing is copied or rewritten: each served variable keeps reading its own store's chunks
(``Source.origin``), a variable spanning several stores through a ``ComposedArray``. The
composed source lists its members, which manifests and loader states record.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from ..errors import ConfigError, ConfigTypeError, StoreError, UnknownNameError
from ..sampling.geometry import SampleGrid, VariableGeometry, common_chunk_size
from ..sampling.rowmap import RowMap, RowRun
from .anemoi import DATA
from .composed_array import ComposedArray
from .cut_array import same_point
from .periods import regular_step
from .served import Member, Source, Stored, as_composed, compose, own_member
from .statistics import GRID_DIMS

ALIGNS = ("exact", "inner")


def _members(sources: Sequence[Source]) -> tuple[Member, ...]:
    return tuple(m for s in sources for m in (s.members or (own_member(s),)))


def _checked(sources: Any, what: str) -> list[Source]:
    if isinstance(sources, Source) or not isinstance(sources, Sequence):
        raise ConfigTypeError(f"{what} takes a list of sources (ib.open_source(...), "
                              f"ib.open_icechunk(...), ...), got {type(sources).__name__}")
    out = list(sources)
    bad = [i for i, s in enumerate(out) if not isinstance(s, Source)]
    if bad:
        raise ConfigTypeError(f"{what}: member(s) {bad} are not sources (got "
                              f"{[type(out[i]).__name__ for i in bad]}); open each with "
                              "ib.open_source(url)")
    if not out:
        raise ConfigError(f"{what} of no sources: give at least one")
    kinds = {s.format for s in out}
    if len(kinds) > 1:
        raise ConfigError(f"{what} of an anemoi dataset and a Zarr group: the anemoi "
                          "dataset serves one 'data' tensor, the others their variables; "
                          f"{what} sources of one kind ({[s.url for s in out]})")
    return out


def _coord(s: Source, k: int, what: str) -> np.ndarray:
    coord = s.sample_coord
    if coord is None:
        raise StoreError(f"{what}: member {k} ({s.url}) has no coordinate along its sample "
                         f"dimension {s.sample_dim!r}, so its samples cannot be matched to "
                         "the others'")
    steps = np.diff(coord)
    rising = steps > np.zeros(1, dtype=steps.dtype)
    if not rising.all():
        at = int(np.flatnonzero(~rising)[0])
        raise StoreError(f"{what}: member {k} ({s.url})'s {s.sample_dim!r} does not increase "
                         f"({coord[at]} then {coord[at + 1]})")
    return coord


def join(sources: Sequence[Source], align: str = "exact") -> Source:
    """The variables of ``sources`` on their common sample coordinate, served as one source.

    ``align="exact"`` requires every member's coordinate equal to the first's (refused
    naming the member and the first value that differs); ``"inner"`` serves the values all
    members have, each member read at its own indices. A variable name two members serve
    is refused: ``rename`` or ``drop`` it in one of them first."""
    sources = _checked(sources, "join")
    if align not in ALIGNS:
        raise ConfigError(f"join(align={align!r}): align is one of {ALIGNS}")
    if len(sources) == 1:
        return sources[0]
    if align == "inner":
        sources = _on_common(sources)
    else:
        _check_equal(sources)
    _check_grids(sources)
    anemoi = sources[0].format == "anemoi"
    variables: list[VariableGeometry] = []
    arrays: list[Stored] = []
    origins: list[tuple[str, str | None]] = []
    seen: dict[str, int] = {}
    for k, s in enumerate(sources):
        for i, (geom, arr) in enumerate(zip(s.variables, s.arrays, strict=True)):
            name = geom.name
            if name in seen and not anemoi:
                raise ConfigError(
                    f"join: variable {name!r} is served by member {seen[name]} "
                    f"({sources[seen[name]].url}) and member {k} ({s.url}); rename it in "
                    f"one (source.rename({{{name!r}: '{name}_{k}'}})) or drop it there")
            seen.setdefault(name, k)
            if anemoi and variables:  # a "data" per member (the labels say what each
                geom = replace(geom, name=f"{DATA}.{len(variables)}")  # holds): data, data.1..
            variables.append(geom)
            arrays.append(arr)
            origins.append(s.origin(i))
    first = sources[0]
    missing = sorted(set().union(*(s.missing for s in sources)))
    selection = None
    if anemoi:  # anemoi: the first occurrence's place, the last occurrence's values
        selection = tuple(dict.fromkeys(n for s in sources for n in s.served_names()))
    grid = SampleGrid(first.n_samples, common_chunk_size([v.sample_chunk for v in variables]))
    joined = replace(first, url=f"join({', '.join(s.url for s in sources)})",
                     variables=tuple(variables), arrays=tuple(arrays), origins=tuple(origins),
                     grid=grid, missing=tuple(missing), members=_members(sources),
                     selection=selection, snapshot_id=None,
                     variables_given=all(s.variables_given for s in sources))
    return joined.owning()


def _check_equal(sources: list[Source]) -> None:
    """``align="exact"``: every member on the first's samples."""
    first = sources[0]
    ref = first.sample_coord
    for k, s in enumerate(sources[1:], 1):
        if s.n_samples != first.n_samples:
            raise StoreError(f"join(align='exact'): member {k} ({s.url}) has {s.n_samples} "
                             f"samples, member 0 ({first.url}) {first.n_samples}; use "
                             "align='inner' to serve the dates both have")
        coord = s.sample_coord
        if ref is None or coord is None:
            continue
        differs = np.flatnonzero(coord != ref) if coord.dtype.kind == ref.dtype.kind else [0]
        if len(differs):
            i = int(differs[0])
            raise StoreError(f"join(align='exact'): member {k} ({s.url}) differs from member 0 "
                             f"({first.url}) at sample {i}: {coord[i]} vs {ref[i]}; use "
                             "align='inner' to serve the values both have")


def _check_grids(sources: list[Source]) -> None:
    """A join serves its variables on one grid: where two members store a coordinate of a
    grid dimension (latitude, longitude, y, x, cells...), their values must be equal. Members
    on grids of one shape but other values (latitudes north to south and south to north)
    would otherwise be served side by side as if aligned. Levels may differ: each variable
    keeps its own (``Source.coordinate(dim, variable)``)."""
    seen: dict[str, tuple[int, np.ndarray]] = {}
    for k, s in enumerate(sources):
        for v in s.variables:
            for dim in (v.dimension_names or ())[1:]:
                if dim is None or dim not in GRID_DIMS:
                    continue
                try:
                    values = s.coordinate(dim, v.name)
                except (UnknownNameError, StoreError):
                    continue  # not stored: nothing to compare
                if dim not in seen:
                    seen[dim] = (k, values)
                    continue
                j, ref = seen[dim]
                at = _differ(values, ref) if j != k else None
                if at is not None:
                    raise StoreError(
                        f"join: the {dim!r} of member {k} ({s.url}) differs from member {j}'s "
                        f"({sources[j].url}){at}: a join serves its variables on one grid; "
                        "join stores of the same grid")


def _differ(values: np.ndarray, ref: np.ndarray) -> str | None:
    """Where two coordinates differ, in words (``None``: equal; numbers to 0.1 % of their
    spacing, so a grid stored in float32 matches its float64 twin)."""
    if values.shape != ref.shape:
        return f": {values.size} values against {ref.size}"
    if values.dtype.kind in "fiu" and ref.dtype.kind in "fiu":
        same = np.isclose(values.astype(np.float64), ref.astype(np.float64), rtol=0,
                          atol=same_point(ref))
    else:
        same = values == ref
    bad = np.flatnonzero(~np.asarray(same))
    if bad.size == 0:
        return None
    i = int(bad[0])
    return f" at index {i}: {values[i]} against {ref[i]}"


def _on_common(sources: list[Source]) -> list[Source]:
    """``align="inner"``: each member read at the coordinate values all members have."""
    coords = [_coord(s, k, "join(align='inner')") for k, s in enumerate(sources)]
    common = coords[0]
    for c in coords[1:]:
        common = np.intersect1d(common, c)
    if common.size == 0:
        spans = "; ".join(f"member {k} ({s.url}): {c[0]} .. {c[-1]}" if c.size else
                          f"member {k} ({s.url}): empty"
                          for k, (s, c) in enumerate(zip(sources, coords, strict=True)))
        raise StoreError(f"join(align='inner'): the members share no "
                         f"{sources[0].sample_dim!r} value; {spans}")
    out = []
    for s, c in zip(sources, coords, strict=True):
        at = np.searchsorted(c, common)
        if at.size == c.size:
            out.append(s)
            continue
        out.append(s.remapped(lambda rows, at=at: rows.at(at), int(common.size), common))
    return out


def concat(sources: Sequence[Source]) -> Source:
    """The periods of ``sources`` one after another along the sample axis: coordinates
    increasing and not overlapping (refused naming the dates), every member on one step
    and with the same variables; a gap between members is served as missing samples (no
    sample or time window crosses it). Members may differ in chunking and format."""
    sources = _checked(sources, "concat")
    if len(sources) == 1:
        return sources[0]
    coords = [_coord(s, k, "concat") for k, s in enumerate(sources)]
    step = _common_step(sources, coords)
    _check_alike(sources)
    offsets, gaps, at = [], [], 0
    for k, c in enumerate(coords):
        if k:
            prev = coords[k - 1][-1]
            if c[0] <= prev:
                raise StoreError(
                    f"concat: member {k} ({sources[k].url}) starts at {c[0]}, not after "
                    f"member {k - 1} ({sources[k - 1].url}) ends ({prev}): the periods "
                    "overlap (or are out of order); cut one with .period(start=, end=)")
            gap = (c[0] - prev) / step - 1
            if gap != int(gap):
                raise StoreError(f"concat: member {k} ({sources[k].url}) starts at {c[0]}, "
                                 f"off the step {step} of the members before ({prev})")
            gaps += [at + j for j in range(int(gap))]
            at += int(gap)
        offsets.append(at)
        at += c.size
    first = sources[0]
    variables, arrays, origins = [], [], []
    for v, geom in enumerate(first.variables):
        parts = [as_composed(s.arrays[v], s.variables[v], *s.origin(v)) for s in sources]
        runs: list[RowRun] = []
        base = 0
        for part, off in zip(parts, offsets, strict=True):
            runs += part.rows.placed(off, base)
            base += len(part.arrays)
        joined = ComposedArray(
            arrays=tuple(a for p in parts for a in p.arrays),
            geoms=tuple(g for p in parts for g in p.geoms),
            urls=tuple(u for p in parts for u in p.urls),
            snapshots=tuple(x for p in parts for x in p.snapshots),
            rows=RowMap(tuple(runs), at), chunk=1)
        made, made_geom = compose(geom, joined, joined.rows)
        variables.append(made_geom)
        arrays.append(made)
        origins.append(first.origin(v))
    coord = np.concatenate([np.concatenate([c, c[-1] + step * np.arange(1, n + 1)])
                            for c, n in zip(coords, _gap_sizes(offsets, coords, at),
                                            strict=True)])
    missing = sorted(set(gaps) | {off + i for s, off in zip(sources, offsets, strict=True)
                                  for i in s.missing})
    grid = SampleGrid(at, common_chunk_size([v.sample_chunk for v in variables]))
    return replace(first, url=f"concat({', '.join(s.url for s in sources)})",
                   variables=tuple(variables), arrays=tuple(arrays), origins=tuple(origins),
                   grid=grid, sample_coord=coord, missing=tuple(missing),
                   members=_members(sources), snapshot_id=None)


def _gap_sizes(offsets: list[int], coords: list[np.ndarray], n: int) -> list[int]:
    """Samples of gap after each member."""
    ends = [off + c.size for off, c in zip(offsets, coords, strict=True)]
    return [nxt - end for end, nxt in zip(ends, [*offsets[1:], n], strict=True)]


def _common_step(sources: list[Source], coords: list[np.ndarray]) -> Any:
    steps = [(k, regular_step(c, f"concat member {k} ({s.url})"))
             for k, (s, c) in enumerate(zip(sources, coords, strict=True)) if c.size > 1]
    if not steps:
        raise StoreError("concat: every member has one sample, so the step between samples "
                         "is unknown")
    k0, step = steps[0]
    for k, other in steps[1:]:
        if other != step:
            raise StoreError(f"concat: member {k} ({sources[k].url}) steps {other}, member "
                             f"{k0} ({sources[k0].url}) {step}: concat members of one "
                             "frequency (cut one with .period(frequency=...))")
    return step


def _check_alike(sources: list[Source]) -> None:
    """Every member serves the first's variables, in its order, shaped and typed alike."""
    first = sources[0]
    for k, s in enumerate(sources[1:], 1):
        if s.names != first.names or s.served_names() != first.served_names():
            raise StoreError(f"concat: member {k} ({s.url}) serves {list(s.served_names())}, "
                             f"member 0 ({first.url}) {list(first.served_names())}: select "
                             "the same variables in the same order in each")
        for a, b in zip(first.variables, s.variables, strict=True):
            if a.sample_shape != b.sample_shape or a.dtype != b.dtype:
                raise StoreError(f"concat: variable {a.name!r} of member {k} ({s.url}) is "
                                 f"{b.dtype} samples of {b.sample_shape}{_dims(b)}, of member "
                                 f"0 ({first.url}) {a.dtype} of {a.sample_shape}{_dims(a)}")
            for dim in (b.dimension_names or ())[1:]:
                at = _coordinates_differ(first, s, a.name, dim)
                if at is not None:
                    raise StoreError(f"concat: the {dim!r} of variable {a.name!r} in member {k} "
                                     f"({s.url}) differs from member 0's ({first.url}){at}: "
                                     "its samples would mean other things in each period")


def _coordinates_differ(first: Source, other: Source, name: str, dim: str | None,
                        ) -> str | None:
    """Where ``other``'s coordinate ``dim`` of variable ``name`` differs from ``first``'s,
    in words; ``None`` where they are equal or either store has none."""
    if dim is None:
        return None
    try:
        return _differ(other.coordinate(dim, name), first.coordinate(dim, name))
    except (UnknownNameError, StoreError):
        return None


def _dims(v: VariableGeometry) -> str:
    """`` (y, x)``: a sample's dimensions, where the store names them (a sample keeps the
    stored order of the axes other than the sample axis, which members may not share)."""
    names = v.dimension_names
    return f" ({', '.join(str(d) for d in names[1:])})" if names else ""
