"""The ``Source``: the variables a loader serves along their shared sample axis, and the
stored arrays (one store's, or several stores' composed) they are read from.

Everything downstream (splits, plans, fetches) works from this frozen value; ``select``,
``drop``, ``rename`` and ``period`` derive new sources from it without reading data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import zarr

from ..errors import ConfigError, StoreError, UnknownNameError
from ..sampling.geometry import SampleGrid, VariableGeometry, common_chunk_size
from ..sampling.grid_parts import grid_axis
from ..sampling.rowmap import RowMap
from .arrays import array_in
from .axis_array import AxisArray
from .composed_array import ComposedArray, composed_chunk
from .cut_array import CutArray, coordinate_index, cut, runs
from .periods import period_rows

# What a served variable is read from: a stored array, several composed, or a part.
Stored = zarr.Array | ComposedArray | CutArray | AxisArray


@dataclass(frozen=True, eq=False)
class Member:
    """One store a composed source reads (a join's or a concat's member): what manifests
    and loader states record, so a resume into another composition is refused naming it."""

    url: str  # without credentials
    snapshot_id: str | None
    n_samples: int
    variables: tuple[VariableGeometry, ...]
    first: str = ""  # first and last sample coordinate values, as text
    last: str = ""
    group: zarr.Group | None = field(default=None, repr=False)
    # its coordinates from the format's metadata (``Source.coords``: an OME-Zarr image's)
    coords: Mapping[str, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    def describe(self) -> str:
        snap = f" snapshot {self.snapshot_id}" if self.snapshot_id else ""
        span = f" {self.first}..{self.last}" if self.first else ""
        shapes = ", ".join(f"{v.name} {v.shape} chunks {v.chunks}" for v in self.variables)
        return f"{self.url}{snap}: {self.n_samples} samples{span}; {shapes}"


@dataclass(frozen=True, eq=False)
class Source:
    """The variables to serve and their shared sample axis, plus the open zarr arrays.

    ``url`` is for display and errors only: it never carries credentials.
    """

    url: str
    variables: tuple[VariableGeometry, ...]
    grid: SampleGrid
    arrays: tuple[Stored, ...] = field(repr=False)
    sample_dim: str | None = None
    snapshot_id: str | None = None  # icechunk snapshot the data was read from
    # Values of the sample dimension's coordinate (datetime64[ns] or numbers), if it has one.
    sample_coord: np.ndarray | None = field(default=None, repr=False)
    group: zarr.Group | None = field(default=None, repr=False)
    # Coordinates that no stored array holds, from the format's metadata (an OME-Zarr image's
    # axes: translation + scale * index at the level served), for ``region`` by value.
    coords: Mapping[str, np.ndarray] = field(default_factory=dict, repr=False)
    # Numeric arrays beside the variables without the sample dimension (a land-sea mask,
    # orography): served whole by ``open_static``, never planned like data chunks.
    static: tuple[str, ...] = ()
    # Sample indices the store marks as missing (anemoi's ``missing_dates``): splits leave
    # out every chunk holding one, so no sample or its time steps ever touch them.
    missing: tuple[int, ...] = ()
    # anemoi datasets: the variables chosen along ``data``'s variable axis, in order; the
    # loader serves them (only them) as ``batch["data"]``.
    selection: tuple[str, ...] | None = None
    format: str = "zarr"  # or "anemoi"
    # Whether ``variables=`` named the variables. Discovered ones (``open_source(url)``)
    # are what the store offers, not what was asked for: ``channels=`` then narrows the
    # source to the channels' variables (``Source.narrowed``), so nothing else is read.
    variables_given: bool = False
    # A composed source (join, concat, period): the stores it reads, and per variable the
    # store and snapshot its chunks come from (empty: all from ``url``/``snapshot_id``).
    members: tuple[Member, ...] = ()
    origins: tuple[tuple[str, str | None], ...] = ()
    # Coordinate arrays read from the stores, by (store, dim): read once however many
    # variables, channels or checks ask (a GET each on an object store). Shared by the
    # sources derived from this one (``replace``): the stored arrays are the same.
    coordinates_read: dict[tuple[str, str], np.ndarray] = field(default_factory=dict,
                                                                repr=False)

    def coordinate(self, dim: str, variable: str | None = None) -> np.ndarray:
        """Values of a 1-D coordinate array (e.g. ``level``) stored beside the variables
        (in a composed source, in the first member storing it), or given by the format's
        metadata (``coords``). With ``variable``: as that variable serves them, from the
        store it is read from (a join's members may store other levels) and cut as a region
        or a part of the grid cut it; a coordinate of another length is refused."""
        if variable is None:
            return self._coordinate_in(dim, None)
        self.variable(variable)  # an unknown name: refused, naming those served
        i = self.names.index(variable)
        url = self.origin(i)[0]
        values = self._coordinate_in(dim, url)
        arr, geom = self.arrays[i], self.variables[i]
        base = arr.base_geom if isinstance(arr, CutArray) else geom
        dims = list(base.dimension_names or ())
        if dim not in dims[1:]:
            return values
        axis = dims.index(dim)
        if values.shape != (base.shape[axis],):
            raise StoreError(f"the coordinate {dim!r} of {url} has shape {values.shape}, but "
                             f"variable {variable!r} has {base.shape[axis]} values along "
                             f"{dim!r}; give index slices ({dim}=slice(a, b)) instead")
        return values[arr.index(axis)] if isinstance(arr, CutArray) else values

    def _coordinate_in(self, dim: str, url: str | None) -> np.ndarray:
        """Coordinate ``dim`` from the format's metadata (an uncomposed source), or the
        first group storing it: of store ``url`` alone where given."""
        if not self.members and dim in self.coords:
            return np.asarray(self.coords[dim])
        for m in self.members:  # a composed source: the member's own, where it has them
            if (url is None or m.url == url) and dim in m.coords:
                return np.asarray(m.coords[dim])
        groups = [(self.group, self.url)] + [(m.group, m.url) for m in self.members]
        if url is not None:
            groups = [g for g in groups if g[1] == url] or groups[:1]
        have: set[str] = set()
        for group, where in groups:
            got = self.coordinates_read.get((where, dim))
            if got is not None:
                return got
            if group is not None and dim in group.array_keys():
                got = np.asarray(array_in(group, dim, where)[:])
                got.setflags(write=False)  # shared: read, never written
                self.coordinates_read[(where, dim)] = got
                return got
            have |= set(group.array_keys()) if group is not None else set()
        raise UnknownNameError(f"no coordinate array {dim!r} in {url or self.url}; arrays: "
                               f"{sorted(have)}")

    def origin(self, i: int) -> tuple[str, str | None]:
        """The store (URL without credentials) and icechunk snapshot variable ``i`` is read
        from: its chunk keys are that store's, cached under it, named in its errors."""
        return self.origins[i] if self.origins else (self.url, self.snapshot_id)

    def batch_coords(self) -> dict[str, np.ndarray]:
        """Per-sample values to put in each batch: datetimes as int64 nanoseconds."""
        if self.sample_coord is None or self.sample_dim is None:
            return {}
        values = self.sample_coord
        if np.issubdtype(values.dtype, np.datetime64):
            values = values.astype("datetime64[ns]").astype(np.int64)
        return {self.sample_dim: np.ascontiguousarray(values)}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(v.name for v in self.variables)

    @property
    def n_samples(self) -> int:
        return self.grid.n_samples

    def variable(self, name: str) -> VariableGeometry:
        for v in self.variables:
            if v.name == name:
                return v
        raise UnknownNameError(f"variable {name!r} is not served by {self.url}; served: "
                               f"{list(self.names)}")

    @property
    def sample_nbytes(self) -> int:
        """Decoded bytes of one sample over all variables."""
        return sum(v.sample_nbytes for v in self.variables)

    def narrowed(self, names: Sequence[str]) -> Source:
        """This source serving only ``names`` (in the store's order), on the same sample
        grid (so a split manifest made for this source fits it): what a loader with
        ``channels=`` reads when the variables were discovered, not named."""
        keep = set(names)
        unknown = sorted(keep - set(self.names))
        if unknown:
            raise UnknownNameError(f"variable(s) {unknown} are not served by {self.url}; "
                                   f"served: {list(self.names)}")
        if keep == set(self.names):
            return self
        return self._keep([i for i, n in enumerate(self.names) if n in keep], regrid=False)

    def _keep(self, at: Sequence[int], regrid: bool = True) -> Source:
        """Variables ``at`` only, in that order; with ``regrid``, on the grid made for
        those (their chunking), else on this one (a manifest made for it fits)."""
        variables = tuple(self.variables[i] for i in at)
        grid = replace(self.grid, chunk_size=common_chunk_size(
            [v.sample_chunk for v in variables])) if regrid else self.grid
        return replace(self, variables=variables, arrays=tuple(self.arrays[i] for i in at),
                       origins=tuple(self.origins[i] for i in at) if self.origins else (),
                       grid=grid, variables_given=True)

    # -- deriving sources -----------------------------------------------------------------
    def _labelled(self) -> bool:
        return self.format == "anemoi"

    def served_names(self) -> tuple[str, ...]:
        """What select/drop/rename name: the variables, or an anemoi dataset's labels."""
        if not self._labelled():
            return self.names
        labels = [lb for v in self.variables for lb in (v.labels or ())]
        return tuple(dict.fromkeys(labels if self.selection is None else self.selection))

    def _check_names(self, names: Sequence[str], what: str) -> list[str]:
        if isinstance(names, str):
            names = [names]
        names = list(names)
        have = self.served_names()
        unknown = [n for n in names if n not in have]
        if unknown:
            raise UnknownNameError(f"{what}: {unknown} not served by {self.url}; served: "
                                   f"{list(have)}")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"{what}: {twice} given twice; name each once")
        return names

    def select(self, names: Sequence[str]) -> Source:
        """Only ``names``, in the order given (of an anemoi dataset: its variables)."""
        names = self._check_names(names, "select")
        if self._labelled():
            return replace(self, selection=tuple(names), variables_given=True).owning()
        return self._keep([self.names.index(n) for n in names])

    def drop(self, names: Sequence[str]) -> Source:
        """All but ``names``, in the stored order."""
        gone = set(self._check_names(names, "drop"))
        keep = [n for n in self.served_names() if n not in gone]
        if not keep:
            raise ConfigError(f"drop {sorted(gone)} leaves no variable of {self.url}")
        if self._labelled():
            return replace(self, selection=tuple(keep), variables_given=True).owning()
        return self._keep([self.names.index(n) for n in keep])

    def owning(self) -> Source:
        """An anemoi join without the members none of whose selected variables it serves
        (a name several members hold is served by the last): nothing of theirs is read."""
        if not self._labelled() or len(self.variables) < 2:
            return self
        owner = {lb: i for i, v in enumerate(self.variables) for lb in (v.labels or ())}
        wanted = self.served_names()
        used = sorted({owner[n] for n in wanted})
        if len(used) == len(self.variables):
            return self
        return self._keep(used)

    def rename(self, mapping: Mapping[str, str]) -> Source:
        """Serve variables (anemoi: its variables) under new names; the stored arrays and
        their chunk keys are unchanged. Two variables may not end up with one name."""
        if not isinstance(mapping, Mapping):
            raise ConfigError(f"rename takes a mapping of old to new names, got {mapping!r}")
        self._check_names(list(mapping), "rename")
        new = [mapping.get(n, n) for n in self.served_names()]
        twice = sorted({n for n in new if new.count(n) > 1})
        if twice:
            raise ConfigError(f"rename {dict(mapping)} would serve {twice} twice; rename "
                              "one of them too")
        if self._labelled():
            variables = tuple(replace(v, labels=tuple(mapping.get(lb, lb) for lb in v.labels))
                              if v.labels else v for v in self.variables)
            selection = (None if self.selection is None
                         else tuple(mapping.get(n, n) for n in self.selection))
            return replace(self, variables=variables, selection=selection)
        return replace(self, variables=tuple(replace(v, name=mapping.get(v.name, v.name))
                                             for v in self.variables))

    def period(self, start: Any = None, end: Any = None, frequency: Any = None) -> Source:
        """The samples whose coordinate lies in ``[start, end]`` (both included), every
        ``frequency`` (a multiple of the stored step): a composed source reading the
        same stores, nothing copied."""
        first, every, n = period_rows(self.sample_coord, self.url, start, end, frequency)
        return self.remapped(lambda rows: rows.take(first, every, n), n,
                             None if self.sample_coord is None
                             else self.sample_coord[first::every][:n])

    def remapped(self, how: Any, n: int, coord: np.ndarray | None) -> Source:
        """Every variable read through ``how(its RowMap)`` (``n`` samples, coordinate
        ``coord``): the one way periods and joins on other dates are made."""
        arrays: list[Stored] = []
        variables, origins = [], []
        for i, (arr, geom) in enumerate(zip(self.arrays, self.variables, strict=True)):
            url, snap = self.origin(i)
            base, base_geom = arr, geom
            if isinstance(arr, CutArray):  # a part of the grid: remap what it cuts, cut again
                base = arr.base
                base_geom = replace(arr.base_geom, name=geom.name, labels=geom.labels)
            composed = as_composed(base, base_geom, url, snap)
            made, made_geom = compose(base_geom, composed, how(composed.rows))
            if isinstance(arr, CutArray):
                made = cut(made, made_geom, arr.cuts)
                made_geom = replace(geom, shape=made.shape, chunks=made.chunks, shards=None)
            arrays.append(made)
            variables.append(made_geom)
            origins.append((url, snap))
        old = np.zeros(self.n_samples + 1, dtype=bool)
        old[list(self.missing)] = True
        probe = how(RowMap.identity(self.n_samples))
        member, local = probe.locate(np.arange(n, dtype=np.int64))
        missing = tuple(int(j) for j in np.flatnonzero((member < 0) | old[local]))
        grid = SampleGrid(n, common_chunk_size([v.sample_chunk for v in variables]))
        members = self.members or (own_member(self),)
        return replace(self, arrays=tuple(arrays), variables=tuple(variables),
                       origins=tuple(origins), grid=grid, sample_coord=coord,
                       missing=missing, members=members)

    # -- parts of the grid ----------------------------------------------------------------
    def grid_part(self, part: slice, axes: Mapping[str, int] | None = None) -> Source:
        """Every variable cut to ``part`` of its grid axis (``axes[name]``, else
        ``sampling.grid_parts.grid_axis``: an anemoi dataset's cells, latitude rows): a read
        group's share, read alone (only the blosc blocks holding it)."""
        cuts: dict[int, list[tuple[int, tuple[tuple[int, int], ...]]]] = {}
        for i, v in enumerate(self.variables):
            axis = (axes or {}).get(v.name) or grid_axis(
                v.dimension_names, len(v.shape), last=self.format == "anemoi")
            if axis is None:
                raise ConfigError(f"variable {v.name!r} (dimensions {v.dimension_names}) has "
                                  "no grid axis after its sample axis to cut; name one in "
                                  "axes={name: axis}")
            lo, hi, step = part.indices(v.shape[axis])
            if step != 1 or lo >= hi:
                raise ConfigError(f"grid part {part} of variable {v.name!r} (axis {axis}, "
                                  f"{v.shape[axis]} long) is empty or strided")
            cuts[i] = [(axis, ((lo, hi),))]
        return self._cut(cuts)

    def region(self, **bounds: Any) -> Source:
        """Only a box of the grid: ``lat=(35, 72), lon=(-25, 45)`` by coordinate values
        (both ends included; descending latitudes and longitudes across the antimeridian
        handled) or index slices (``lat=slice(10, 40)``). Each bound cuts the variables
        with that dimension; one that no variable has is refused."""
        cuts: dict[int, list[tuple[int, tuple[tuple[int, int], ...]]]] = {}
        for dim, bound in bounds.items():
            hit = False
            for i, v in enumerate(self.variables):
                dims = list(v.dimension_names or ())
                if dim not in dims[1:]:
                    continue
                axis = dims.index(dim)
                values = (np.arange(v.shape[axis]) if isinstance(bound, slice)
                          else self.coordinate(dim, v.name))
                cuts.setdefault(i, []).append(
                    (axis, runs(coordinate_index(values, bound, dim))))
                hit = True
            if not hit:
                have = sorted({str(d) for v in self.variables
                               for d in (v.dimension_names or ())[1:]})
                raise UnknownNameError(f"region {dim}=...: no variable of {self.url} has a "
                                       f"dimension {dim!r}; dimensions: {have}")
        return self._cut(cuts)

    def _cut(self, cuts: Mapping[int, Sequence[tuple[int, tuple[tuple[int, int], ...]]]],
             ) -> Source:
        arrays, variables = list(self.arrays), list(self.variables)
        for i, box in cuts.items():
            made = cut(arrays[i], variables[i], box)
            arrays[i] = made
            variables[i] = replace(variables[i], shape=made.shape, chunks=made.chunks,
                                   shards=None)
        return replace(self, arrays=tuple(arrays), variables=tuple(variables))


def own_member(source: Source) -> Member:
    """A one-store source as a member of a composition."""
    coord = source.sample_coord
    if coord is not None and coord.dtype.kind == "M":
        coord = coord.astype("datetime64[s]")  # 2020-01-01T06:00:00, not nanoseconds
    first = str(coord[0]) if coord is not None and coord.size else ""
    last = str(coord[-1]) if coord is not None and coord.size else ""
    return Member(source.url, source.snapshot_id, source.n_samples, source.variables,
                  first, last, source.group, source.coords)


def as_composed(arr: Stored, geom: VariableGeometry, url: str,
                snapshot: str | None) -> ComposedArray:
    """Any served array as a composition (a stored one: of itself, as stored)."""
    if isinstance(arr, ComposedArray):
        return arr
    if isinstance(arr, CutArray):
        raise ConfigError(f"variable {geom.name!r} of {url} is cut to a part of its grid "
                          "(grid_part, region): concat the sources first, then cut the "
                          "composition")
    return ComposedArray((arr,), (geom,), (url,), (snapshot,), RowMap.identity(geom.shape[0]),
                         geom.sample_chunk)


def compose(geom: VariableGeometry, parts: ComposedArray,
            rows: RowMap) -> tuple[Stored, VariableGeometry]:
    """``parts``' arrays read through ``rows``: the stored array itself where that is all
    of one array as stored, else a ``ComposedArray``; with its served geometry."""
    if len(parts.arrays) == 1 and rows.is_identity:
        arr = parts.arrays[0]
        if rows.n_rows == parts.geoms[0].shape[0]:
            return arr, replace(parts.geoms[0], name=geom.name, labels=geom.labels)
    made = ComposedArray(parts.arrays, parts.geoms, parts.urls, parts.snapshots, rows,
                         composed_chunk(rows, parts.geoms))
    return made, replace(geom, shape=made.shape, chunks=made.chunks, shards=None)
