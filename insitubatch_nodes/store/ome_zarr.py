"""OME-Zarr images as they are stored: NGFF 0.4 on Zarr v2 (``.zattrs`` ``multiscales``) and
NGFF 0.5 on Zarr v3 (``zarr.json`` attributes ``ome.multiscales``).

``open_ome_zarr`` serves one multiscale level of the image as ``image`` and the label images
of ``labels/`` (their own multiscales, read at the same level) by name, all sampled along
one of the image's named axes (z-planes of a ``czyx`` volume, time points of a ``tczyx``
one) wherever it stands; the sample coordinate is the axis' physical position, ``translation
+ scale * index`` from the level's ``coordinateTransformations`` (then the multiscale's own).
``describe_ome_zarr`` says what an image holds: its axes and levels.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import zarr

from ..errors import ConfigError, ConfigTypeError, StoreError, UnknownNameError
from .served import Source
from .source import source_of_arrays
from .storage import OpenedStore, explain, open_url

IMAGE = "image"  # the variable the image is served as
DEFAULT_AXES = ("t", "c", "z", "y", "x")  # NGFF 0.1 and 0.2: no axes metadata, always 5-D
__all__ = ["describe_ome_zarr", "open_ome_zarr"]


@dataclass(frozen=True)
class Axis:
    name: str
    type: str | None = None
    unit: str | None = None

    def describe(self) -> str:
        what = ", ".join(x for x in (self.type, self.unit) if x)
        return f"{self.name} ({what})" if what else self.name


@dataclass(frozen=True)
class Level:
    path: str
    scale: tuple[float, ...] | None  # None: a transform stored as binary data (``path``)
    translation: tuple[float, ...] | None


@dataclass(frozen=True, eq=False)
class Multiscale:
    """One multiscale image group: where it is, its version, axes and levels."""

    group: zarr.Group
    display: str
    zarr_format: Literal[2, 3]
    version: str
    name: str | None
    axes: tuple[Axis, ...]
    levels: tuple[Level, ...]

    @property
    def store(self) -> Any:
        return self.group.store

    @property
    def path(self) -> str:  # of the group in the store
        return self.group.path

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)

    def array(self, level: int) -> zarr.Array:
        """The level's array, its dimensions checked against the axes."""
        where = _join(self.path, self.levels[level].path)
        try:
            arr = zarr.open_array(self.store, path=where, mode="r", zarr_format=self.zarr_format)
        except Exception as e:
            raise StoreError(f"level {level} of the OME-Zarr image {self.display!r} (datasets"
                             f"[{level}].path {self.levels[level].path!r}) is not a Zarr array "
                             f"that opens: {type(e).__name__}: {e}") from None
        names = getattr(arr.metadata, "dimension_names", None)
        if arr.ndim != len(self.axes) or (names is not None and tuple(names) != self.axis_names):
            raise StoreError(f"level {level} of {self.display!r} ({self.levels[level].path!r}) "
                             f"has {arr.ndim} dimensions named {names} but its multiscales "
                             f"axes are {self.axis_names}")
        return arr


def _join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


def _ome_attrs(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """The OME metadata of a group: 0.5's ``ome`` namespace, or the attributes (0.4)."""
    ome = attrs.get("ome")
    return dict(ome) if isinstance(ome, Mapping) else dict(attrs)


def _transforms(items: Any, ndim: int) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """Fold a list of scale / translation / identity transforms into one (scale, translation)
    applied as ``scale * index + translation``; None where one is stored at a ``path``."""
    scale, shift = np.ones(ndim), np.zeros(ndim)
    for t in items or ():
        if t.get("type") == "scale":
            if "scale" not in t:
                return None
            v = np.asarray(t["scale"], dtype=float)
            scale, shift = scale * v, shift * v
        elif t.get("type") == "translation":
            if "translation" not in t:
                return None
            shift = shift + np.asarray(t["translation"], dtype=float)
    return tuple(scale.tolist()), tuple(shift.tolist())


def _open_group(store: Any, path: str, display: str, opened: OpenedStore | None) -> zarr.Group:
    try:
        return zarr.open_group(store, path=path, mode="r")
    except Exception as e:
        if opened is not None and not path:
            raise explain(opened, e) from None
        raise StoreError(f"no Zarr group at {display!r}: {type(e).__name__}: {e}") from None


def _multiscale(store: Any, path: str, display: str,
                opened: OpenedStore | None = None) -> Multiscale:
    """The first multiscale image described by the group at ``path`` (as the spec says to
    read a group listing several)."""
    group = _open_group(store, path, display, opened)
    ome = _ome_attrs(group.attrs.asdict())
    found = ome.get("multiscales")
    if not isinstance(found, list) or not found:
        hint = (" It is a bioformats2raw collection: open its images, "
                f"{display.rstrip('/')}/0, /1, ..." if "bioformats2raw.layout" in ome else
                " It is an HCS plate: open one field, e.g. .../A/1/0." if "plate" in ome else "")
        raise StoreError(f"{display!r} is not an OME-Zarr image: its attributes hold no "
                         f"'multiscales' (keys: {sorted(ome)}).{hint}")
    ms = found[0]
    try:  # NGFF 0.3 names axes by strings; 0.1 and 0.2 name none: 5-D, t c z y x
        axes = tuple(Axis(a) if isinstance(a, str) else Axis(a["name"], a.get("type"),
                                                              a.get("unit"))
                     for a in ms.get("axes", DEFAULT_AXES))
        levels = [Level(str(d["path"]), *(_transforms(
            [*d.get("coordinateTransformations", ()), *ms.get("coordinateTransformations", ())],
            len(axes)) or (None, None))) for d in ms["datasets"]]
    except (KeyError, TypeError, ValueError) as e:
        raise StoreError(f"the multiscales metadata of {display!r} is malformed ({e!r}): "
                         "each of its 'axes' needs a 'name', each of its 'datasets' a "
                         "'path', and scale and translation one number per axis") from None
    if not levels:
        raise StoreError(f"the multiscales metadata of {display!r} lists no 'datasets' (its "
                         "levels): an image needs at least one")
    version = str(ome.get("version") or ms.get("version") or "?")
    return Multiscale(group, display, group.metadata.zarr_format, version, ms.get("name"),
                      axes, tuple(levels))


def _label_names(image: Multiscale) -> list[str]:
    """The label images the ``labels`` group lists (none without one)."""
    where = _join(image.path, "labels")
    try:
        group = zarr.open_group(image.store, path=where, mode="r",
                                zarr_format=image.zarr_format)
    except (FileNotFoundError, KeyError, zarr.errors.ContainsArrayError):
        return []  # no labels group (a failing store is not "no labels": it raises)
    names = _ome_attrs(group.attrs.asdict()).get("labels") or []
    return [str(n) for n in names]


def _chosen_labels(image: Multiscale, labels: Sequence[str] | None) -> list[str]:
    there = _label_names(image)
    if labels is None:
        return there
    if isinstance(labels, str):
        raise ConfigTypeError(f"labels={labels!r} must be a list of label names, e.g. "
                              f"[{labels!r}]; the image has {there}")
    unknown = [n for n in labels if n not in there]
    if unknown:
        raise UnknownNameError(f"labels {unknown} are not label images of {image.display!r}; "
                               f"its labels group lists {there or 'none'}")
    if IMAGE in labels:
        raise ConfigError(f"a label image named {IMAGE!r} would take the image's name; leave "
                          "it out of labels=")
    return list(labels)


def _check_level(image: Multiscale, level: Any) -> int:
    if isinstance(level, bool) or not isinstance(level, (int, np.integer)):
        raise ConfigTypeError(f"level={level!r} must be the index of a multiscale level, "
                              f"0 to {len(image.levels) - 1}")
    if not 0 <= level < len(image.levels):
        shapes = ", ".join(f"{k}: {lv.path!r} {tuple(image.array(k).shape)}"
                           for k, lv in enumerate(image.levels))
        raise ConfigError(f"level={level} is not a level of the OME-Zarr image "
                          f"{image.display!r}; its levels are {shapes}")
    return int(level)


def _label_array(image: Multiscale, arr: zarr.Array, name: str, level: int,
                 sample_dim: str) -> tuple[zarr.Array, tuple[str, ...]]:
    """Label image ``name`` at ``level``, on the image's grid (an axis of size 1 where it
    does not apply, as the spec allows) and having the sample axis."""
    where = _join(image.path, "labels", name)
    label = _multiscale(image.store, where, f"{image.display.rstrip('/')}/labels/{name}")
    if sample_dim not in label.axis_names:
        raise StoreError(f"label image {name!r} has axes {label.axis_names}, not the sample "
                         f"axis {sample_dim!r}: leave it out of labels= or sample along one "
                         "of those")
    if level >= len(label.levels):
        raise StoreError(f"label image {name!r} has {len(label.levels)} levels, not level "
                         f"{level} of the image")
    larr = label.array(level)
    sizes = dict(zip(image.axis_names, arr.shape, strict=True))
    for axis, n in zip(label.axis_names, larr.shape, strict=True):
        want = sizes.get(axis)
        if want is None or not (n == want or (n == 1 and axis != sample_dim)):
            raise StoreError(f"label image {name!r} at level {level} is on another grid than "
                             f"the image: axis {axis!r} has {n} points, the image "
                             f"{'none' if want is None else want} (label axes "
                             f"{dict(zip(label.axis_names, larr.shape, strict=True))}, image "
                             f"{sizes})")
    return larr, label.axis_names


def _sample_coord(image: Multiscale, level: int, sample_dim: str, n: int) -> np.ndarray | None:
    lv = image.levels[level]
    if lv.scale is None or lv.translation is None:
        return None
    k = image.axis_names.index(sample_dim)
    return lv.translation[k] + lv.scale[k] * np.arange(n, dtype=np.float64)


def _physical(image: Multiscale, level: int, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """Each axis' physical positions at ``level`` (``translation + scale * i``) but a
    channel axis': what ``Source.region`` takes values of (``y=(10.0, 60.0)`` in the axis'
    unit)."""
    lv = image.levels[level]
    if lv.scale is None or lv.translation is None:
        return {}
    return {a.name: lv.translation[k] + lv.scale[k] * np.arange(shape[k], dtype=np.float64)
            for k, a in enumerate(image.axes) if a.type != "channel"}


def _open_image(url: str | os.PathLike[str] | zarr.Group,
                storage_options: Mapping[str, Any] | None) -> Multiscale:
    if isinstance(url, zarr.Group):
        return _multiscale(url.store, url.path, str(url.store_path))
    opened = open_url(url, storage_options)
    return _multiscale(opened.store, "", opened.display, opened)


def open_ome_zarr(url: str | os.PathLike[str] | zarr.Group, level: int = 0,
                  sample_dim: str = "z", labels: Sequence[str] | None = None,
                  storage_options: Mapping[str, Any] | None = None) -> Source:
    """An OME-Zarr image (NGFF 0.4 or 0.5) served along its axis ``sample_dim``.

    ``level`` indexes the multiscale levels (``datasets``, 0 the full resolution). The image
    is served as ``image`` and each label image by its name (``labels=None``: all the
    ``labels`` group lists, ``[]``: none, a list picks and orders them), at that level; a
    sample is the plane at one index of ``sample_dim``, the other axes in stored order.
    ``Source.sample_coord`` is the axis' physical position (``translation + scale * i``).
    """
    image = _open_image(url, storage_options)
    if not isinstance(sample_dim, str) or sample_dim not in image.axis_names:
        raise UnknownNameError(f"sample_dim={sample_dim!r} is not an axis of the OME-Zarr "
                               f"image {image.display!r}; its axes are {image.axis_names}")
    level = _check_level(image, level)
    names = _chosen_labels(image, labels)
    arr = image.array(level)
    arrays: dict[str, zarr.Array] = {IMAGE: arr}
    dims: dict[str, tuple[str, ...]] = {IMAGE: image.axis_names}
    for name in names:
        arrays[name], dims[name] = _label_array(image, arr, name, level, sample_dim)
    n = int(arr.shape[image.axis_names.index(sample_dim)])
    return source_of_arrays(arrays, dims, image.display, sample_dim, group=image.group,
                            sample_coord=_sample_coord(image, level, sample_dim, n),
                            coords=_physical(image, level, arr.shape))


def describe_ome_zarr(url: str | os.PathLike[str] | zarr.Group,
                      storage_options: Mapping[str, Any] | None = None) -> str:
    """What an OME-Zarr image holds, in words: version, axes (type, unit), each level's
    path, shape, chunks, dtype, scale and translation, and its label images."""
    image = _open_image(url, storage_options)
    name = f" {image.name!r}" if image.name else ""
    lines = [f"OME-Zarr {image.version} image{name} at {image.display} (Zarr v"
             f"{image.zarr_format})",
             "axes: " + ", ".join(a.describe() for a in image.axes), "levels:"]
    for k, lv in enumerate(image.levels):
        arr = image.array(k)
        where = ("scale and translation stored as binary data" if lv.scale is None else
                 f"scale {_numbers(lv.scale)} translation {_numbers(lv.translation or ())}")
        lines.append(f"  {k}: {lv.path} shape {tuple(arr.shape)} chunks {tuple(arr.chunks)} "
                     f"{arr.dtype}, {where}")
    labels = _label_names(image)
    lines.append("labels: " + (", ".join(labels) if labels else "none"))
    return "\n".join(lines)


def _numbers(values: Sequence[float]) -> str:
    return "(" + ", ".join(f"{v:g}" for v in values) + ")"
