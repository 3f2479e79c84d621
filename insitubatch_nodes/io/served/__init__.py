"""The reader of one served variable, whatever it reads: a stored array, several composed
(a join at other dates, a concat, a period), or a part of the grid (a read group, a region)."""

from __future__ import annotations

import zarr

from ...sampling.geometry import VariableGeometry
from ...store.axis_array import AxisArray
from ...store.composed_array import ComposedArray
from ...store.cut_array import CutArray
from ..reader import StripeReader
from .axis import AxisStripeReader
from .composed import ComposedReader
from .cut import CutReader

Reader = StripeReader | ComposedReader | CutReader


def open_reader(arr: zarr.Array | ComposedArray | CutArray | AxisArray,
                geom: VariableGeometry, source_url: str) -> Reader:
    """The reader of ``Source.arrays[i]`` served as ``Source.variables[i]``, its chunks
    named as ``Source.origin(i)``'s."""
    if isinstance(arr, CutArray):
        return CutReader(arr, geom, source_url, open_reader(arr.base, arr.base_geom, source_url))
    if isinstance(arr, ComposedArray):
        return ComposedReader(arr, geom, source_url)
    if isinstance(arr, AxisArray):
        return AxisStripeReader(arr, geom, source_url)
    return StripeReader(arr, geom, source_url)
