"""OME-Zarr images written by a real NGFF writer (ngff-zarr) for the tests: NGFF 0.4 on
Zarr v2 and 0.5 on Zarr v3, two multiscale levels, label images under ``labels/`` listed
in the ``labels`` group as the spec says (ngff-zarr writes multiscale images, not the
``labels`` group: that group and each label's ``image-label`` are added here)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import zarr

UNITS = {"t": "second", "z": "micrometer", "y": "micrometer", "x": "micrometer"}


def write_image(path: Path, data: np.ndarray, dims: Sequence[str], version: str, *,
                chunks: Mapping[str, int], scale: Mapping[str, float] | None = None,
                translation: Mapping[str, float] | None = None, label: bool = False,
                levels: int = 2) -> None:
    """One multiscale image at ``path`` by ngff-zarr: ``levels`` levels, each halving y and
    x (and z where there is one) and keeping t and c."""
    import ngff_zarr as nz

    spatial = [d for d in dims if d != "c"]
    image = nz.to_ngff_image(data, dims=tuple(dims),
                             scale={d: 1.0 for d in spatial} | dict(scale or {}),
                             translation={d: 0.0 for d in spatial} | dict(translation or {}),
                             axes_units={d: UNITS[d] for d in dims if d in UNITS})
    factors = [{d: 2 ** k for d in dims if d in "zyx"} for k in range(1, levels)]
    method = nz.Methods.ITKWASM_LABEL_IMAGE if label else nz.Methods.ITKWASM_BIN_SHRINK
    multiscales = nz.to_multiscales(image, scale_factors=factors, method=method,
                                    chunks=dict(chunks))
    nz.to_ome_zarr(str(path), multiscales, version=version)


def add_labels(image: Path, version: str, labels: Mapping[str, tuple[np.ndarray, Sequence[str]]],
               *, chunks: Mapping[str, int], listed: Sequence[str] | None = None,
               **kw: object) -> None:
    """Label images ``labels/NAME`` beside the image at ``image``, listed in the ``labels``
    group (``listed``: which, by default all), each with its ``image-label`` metadata."""
    fmt = 2 if version == "0.4" else 3
    for name, (data, dims) in labels.items():
        where = image / "labels" / name
        write_image(where, data, dims, version, label=True,
                    chunks={d: c for d, c in chunks.items() if d in dims}, **kw)  # type: ignore[arg-type]
        group = zarr.open_group(where, mode="a", zarr_format=fmt)
        meta = {"version": version, "source": {"image": "../../"},
                "colors": [{"label-value": 1, "rgba": [0, 255, 0, 128]}]}
        if fmt == 2:
            group.attrs["image-label"] = meta
        else:
            group.attrs["ome"] = {**group.attrs["ome"], "image-label": meta}
    group = zarr.open_group(image / "labels", mode="a", zarr_format=fmt)
    names = list(labels) if listed is None else list(listed)
    if fmt == 2:
        group.attrs["labels"] = names
    else:
        group.attrs["ome"] = {"version": version, "labels": names}


def volume(shape: Sequence[int], seed: int = 0, dtype: str = "uint16") -> np.ndarray:
    """Distinct values everywhere (a plane read from the wrong place shows)."""
    rng = np.random.default_rng(seed)
    return rng.permutation(int(np.prod(shape))).reshape(shape).astype(dtype)


def segmentation(image: np.ndarray) -> np.ndarray:
    """An integer label image of ``image``'s values: 1 above the median, else 0."""
    return (image > np.median(image)).astype("uint8")
