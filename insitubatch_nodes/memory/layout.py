"""Where every variable of a sample lands in a batch, known before anything is read.

A variable served as itself fills its own key; a variable (or some of its levels) stacked
into ``channels`` fills a channel range of that key. Pure index math: the gather and the
in-place decode both write through these placements, so channel stacking never costs a
pass of its own over the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import UnknownNameError
from ..sampling.geometry import VariableGeometry

CHANNELS_KEY = "channels"


@dataclass(frozen=True)
class Channel:
    """One channel: a variable, and (for a variable with a level axis) which level."""

    variable: str
    index: int | None = None  # the level, on the sample's first axis
    label: str = ""


@dataclass(frozen=True)
class KeySpec:
    """One array of the batch: its key, the shape of one row (after any time-step axis)
    and its dtype."""

    name: str
    row_shape: tuple[int, ...]
    dtype: np.dtype


@dataclass(frozen=True)
class Placement:
    """Part of one variable's sample written into batch key ``key``.

    ``channel`` is where on the key's channel axis (the row's first axis): ``None`` fills
    the whole row, an ``int`` one channel (a sample without a level axis), a ``slice`` a
    range. ``levels`` is what of the sample goes there: ``None`` all of it, or a slice of
    its level axis. ``cast``: the key's dtype is wider than the variable's (channels of
    mixed dtypes stack in their promoted dtype, as ``torch.stack`` would).
    """

    key: str
    channel: int | slice | None = None
    levels: slice | None = None
    cast: bool = False

    @property
    def whole(self) -> bool:
        """The whole sample, contiguous in the row and in the variable's own dtype: a
        stripe decodes straight into it."""
        return self.levels is None and not self.cast


@dataclass(frozen=True)
class BatchLayout:
    """The batch's arrays and, per variable (in source order), its placements."""

    keys: tuple[KeySpec, ...]
    placements: tuple[tuple[Placement, ...], ...]

    def key(self, name: str) -> KeySpec:
        for k in self.keys:
            if k.name == name:
                return k
        raise UnknownNameError(f"no batch key {name!r}; keys: {[k.name for k in self.keys]}")

    @property
    def stacks_channels(self) -> bool:
        return any(p.key == CHANNELS_KEY for ps in self.placements for p in ps)

    def row_nbytes(self, v: int) -> int:
        """Bytes one sample of variable ``v`` fills in a batch row (every placement)."""
        total = 0
        for pl in self.placements[v]:
            spec = self.key(pl.key)
            n = int(np.prod(spec.row_shape, dtype=np.int64)) * np.dtype(spec.dtype).itemsize
            if pl.channel is not None:
                c = spec.row_shape[0]
                part = (1 if isinstance(pl.channel, int)
                        else len(range(*pl.channel.indices(c))))
                n = n // c * part
            total += n
        return total

    @property
    def all_direct(self) -> bool:
        """Every variable decodes straight into its batch slot (none split up or cast)."""
        return all(self.direct(v) is not None for v in range(len(self.placements)))

    def direct(self, v: int) -> Placement | None:
        """Variable ``v``'s one placement when it takes the whole sample (so its stripes can
        be decoded straight into the batch); ``None`` when it is split up or unused."""
        ps = self.placements[v]
        return ps[0] if len(ps) == 1 and ps[0].whole else None


def promoted(dtypes: list[np.dtype]) -> np.dtype:
    """The dtype ``torch.stack`` gives tensors of ``dtypes`` (torch's promotion: int32 with
    float32 is float32, where numpy says float64), as a numpy dtype. torch is imported only
    for mixed dtypes: the decode workers import this module and never need it."""
    if len(set(dtypes)) == 1:
        return np.dtype(dtypes[0])
    import torch

    from .dtypes import torch_dtype

    native = [np.dtype(d).newbyteorder("=") for d in dtypes]
    out = torch_dtype(native[0])
    for d in native[1:]:
        out = torch.promote_types(out, torch_dtype(d))
    return torch.empty(0, dtype=out).numpy().dtype


def _sample_shape(var: VariableGeometry) -> tuple[int, ...]:
    return tuple(var.sample_shape)


def build_layout(variables: Sequence[VariableGeometry],
                 channels: Sequence[Channel] | None = None,
                 key: str = CHANNELS_KEY) -> BatchLayout:
    """The layout for ``variables`` with ``channels`` stacked into ``key`` (the channel
    variables are then not served on their own, as ``StackChannelsNode`` does; an anemoi
    selection stacks into ``"data"``). Channels of different dtypes stack in the dtype
    torch promotes them to (float32 + float64: float64), each converted as it is written."""
    by_name = {v.name: i for i, v in enumerate(variables)}
    placements: list[list[Placement]] = [[] for _ in variables]
    keys: list[KeySpec] = []
    stacked = {ch.variable for ch in channels or ()}
    for i, var in enumerate(variables):
        if var.name not in stacked:
            keys.append(KeySpec(var.name, _sample_shape(var), var.dtype))
            placements[i].append(Placement(var.name))
    if channels:
        key_dtype = promoted([variables[by_name[ch.variable]].dtype for ch in channels])
        spatial = None
        c = 0
        for ch in channels:
            v = by_name[ch.variable]
            cast = variables[v].dtype != key_dtype
            shape = _sample_shape(variables[v])
            spatial = shape[-2:] if ch.index is None else shape[1:][-2:]
            prev = placements[v][-1] if placements[v] else None
            if ch.index is None:
                placements[v].append(Placement(key, c, cast=cast))
            elif (prev is not None and isinstance(prev.channel, slice) and prev.levels
                  is not None and prev.channel.stop == c and prev.levels.stop == ch.index):
                # the next level of the same variable in the next channel: one range
                placements[v][-1] = Placement(key, slice(prev.channel.start, c + 1),
                                              slice(prev.levels.start, ch.index + 1), cast)
            else:
                placements[v].append(Placement(key, slice(c, c + 1),
                                               slice(ch.index, ch.index + 1), cast))
            c += 1
        assert spatial is not None
        keys.append(KeySpec(key, (c, *spatial), key_dtype))
        # A range holding every level of its variable, in order, is the whole sample.
        for v, ps in enumerate(placements):
            n_levels = _sample_shape(variables[v])[0] if variables[v].sample_shape else 0
            placements[v] = [Placement(p.key, p.channel, None, p.cast)
                             if p.levels is not None and p.levels == slice(0, n_levels)
                             and len(_sample_shape(variables[v])) == 3 else p for p in ps]
    return BatchLayout(tuple(keys), tuple(tuple(ps) for ps in placements))


def row_view(row: np.ndarray, placement: Placement) -> np.ndarray:
    """The part of one batch row (``row``: that row of ``placement.key``'s array, time-step
    axis already selected) that ``placement`` fills."""
    if placement.channel is None:
        return row
    return row[..., placement.channel, :, :]


def sample_part(sample: np.ndarray, placement: Placement) -> np.ndarray:
    """The part of one variable's sample(s) (leading batch axis) that ``placement`` takes."""
    if placement.levels is None:
        return sample
    return sample[:, placement.levels]
