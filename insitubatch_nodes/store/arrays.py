"""Reading one named array of an open Zarr group (``group[name]`` may also be a subgroup)."""

from __future__ import annotations

import zarr

from ..errors import StoreError


def array_in(group: zarr.Group, name: str, display: str) -> zarr.Array:
    """``group[name]``, which must be an array: a subgroup of that name is a ``StoreError``
    naming it (a ``KeyError`` where there is nothing of that name, as ``group[name]``)."""
    node = group[name]
    if not isinstance(node, zarr.Array):
        raise StoreError(f"{name!r} in {display!r} is a group, not an array")
    return node
