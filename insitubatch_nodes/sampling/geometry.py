"""Pure geometry of the arrays a loader reads: no IO here.

A *sample* is one index along the sample axis (axis 0 of every variable). A *chunk* in the
sense of splits and windows is a stripe of ``chunk_size`` consecutive samples: the least
common multiple of the variables' chunk lengths along the sample axis, so that no
variable's chunk straddles two of our chunks (and so never serves two splits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError

# Beyond this many times the largest variable chunk, an LCM grid would make windows
# needlessly coarse; we then fall back to the largest chunk and accept that a few chunks of
# the other variables straddle two stripes (they are read once per stripe that needs them).
_MAX_LCM_FACTOR = 4


@dataclass(frozen=True)
class VariableGeometry:
    """Shape, chunking and dtype of one variable, as stored.

    ``chunks`` is the read unit (the inner chunk of a sharded array); ``shards`` is the
    shard shape or ``None``.
    """

    name: str
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: np.dtype
    dimension_names: tuple[str | None, ...] | None = None
    shards: tuple[int, ...] | None = None
    # Names along the axis after the sample axis, when the store gives them (an anemoi
    # dataset's variables: ``2t``, ``t_500``): channels can then be picked by name.
    labels: tuple[str, ...] | None = None

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    @property
    def sample_chunk(self) -> int:
        """Samples per chunk along the sample axis."""
        return self.chunks[0]

    @property
    def n_sample_chunks(self) -> int:
        return -(-self.shape[0] // self.chunks[0])

    @property
    def inner_grid(self) -> tuple[int, ...]:
        """Number of chunks along each non-sample axis (chunks per sample-axis stripe)."""
        return tuple(-(-s // c) for s, c in zip(self.shape[1:], self.chunks[1:], strict=True))

    @property
    def stripe_shape(self) -> tuple[int, ...]:
        """Shape of the buffer that holds one sample-axis chunk of this variable, decoded."""
        return (self.chunks[0], *self.shape[1:])

    @property
    def stripe_nbytes(self) -> int:
        # math.prod, not np.prod: asked per stripe on the consumer's hot path
        return int(math.prod(self.stripe_shape)) * self.dtype.itemsize

    @property
    def sample_nbytes(self) -> int:
        return int(math.prod(self.sample_shape)) * self.dtype.itemsize


@dataclass(frozen=True)
class SampleGrid:
    """The common sample axis of all variables and its split into chunks (stripes).

    ``first``/``last`` bound the indices that are samples: with time steps, a sample is an
    anchor step whose whole window (history before, leads after) lies on the axis. With
    ``every`` > 1 only every ``every``-th index is one (those ``≡ phase`` modulo ``every``:
    6-hourly anchors of an hourly archive).
    """

    n_samples: int
    chunk_size: int
    first: int = 0
    last: int | None = None  # exclusive; None = n_samples
    every: int = 1
    phase: int = 0  # in [0, every)

    @property
    def end(self) -> int:
        return self.n_samples if self.last is None else self.last

    def with_valid(self, first: int, last: int) -> SampleGrid:
        return SampleGrid(self.n_samples, self.chunk_size, max(0, first),
                          min(self.n_samples, last), self.every, self.phase)

    def with_every(self, every: int, phase: int) -> SampleGrid:
        """This grid with only indices ``≡ phase`` (mod ``every``) as samples."""
        if every < 1 or not 0 <= phase < every:
            raise ConfigError(f"every must be >= 1 and phase in [0, every), got every={every}, "
                             f"phase={phase}")
        return SampleGrid(self.n_samples, self.chunk_size, self.first, self.last, every, phase)

    def _count_below(self, x: np.ndarray) -> np.ndarray:
        """Indices ``i < x`` (``x >= 0``) with ``i ≡ phase`` (mod ``every``)."""
        return np.maximum(0, (x - self.phase + self.every - 1) // self.every)

    @property
    def n_chunks(self) -> int:
        return -(-self.n_samples // self.chunk_size)

    def chunk_range(self, chunk_id: int) -> tuple[int, int]:
        """Half-open sample range ``[start, stop)`` of a chunk; the last one may be short."""
        start = chunk_id * self.chunk_size
        return start, min(start + self.chunk_size, self.n_samples)


    def _bounds(self, chunk_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        starts = np.maximum(chunk_ids * self.chunk_size, self.first)
        stops = np.minimum(chunk_ids * self.chunk_size + self.chunk_size, self.end)
        return starts, np.maximum(stops, starts)

    def samples_of(self, chunk_ids: np.ndarray) -> np.ndarray:
        """Global sample indices of the given chunks, chunk by chunk, in the order given."""
        chunk_ids = np.asarray(chunk_ids, dtype=np.int64)
        if chunk_ids.size == 0:
            return np.empty(0, dtype=np.int64)
        if self.every > 1:
            every = self._all_samples_of(chunk_ids)
            return every[(every - self.phase) % self.every == 0]
        return self._all_samples_of(chunk_ids)

    def _all_samples_of(self, chunk_ids: np.ndarray) -> np.ndarray:
        """``samples_of`` as if ``every`` were 1."""
        cs = self.chunk_size
        if cs == 1:  # the valid ids themselves (asked once per window, on the hot path)
            return chunk_ids[(chunk_ids >= self.first) & (chunk_ids < self.end)]
        if chunk_ids.min() * cs >= self.first and (chunk_ids.max() + 1) * cs <= self.end:
            # every chunk whole and valid: one broadcast instead of the run math below
            return (chunk_ids[:, None] * cs + np.arange(cs, dtype=np.int64)).ravel()
        starts, stops = self._bounds(chunk_ids)
        lens = stops - starts
        offsets = np.repeat(starts - np.concatenate(([0], np.cumsum(lens)[:-1])), lens)
        return np.arange(int(lens.sum()), dtype=np.int64) + offsets

    def n_samples_each(self, chunk_ids: np.ndarray) -> np.ndarray:
        """Valid samples (anchors, with time steps) in each of the given chunks."""
        starts, stops = self._bounds(np.asarray(chunk_ids, dtype=np.int64))
        if self.every > 1:
            return self._count_below(stops) - self._count_below(starts)
        return stops - starts

    def n_samples_of(self, chunk_ids: np.ndarray) -> int:
        return int(self.n_samples_each(chunk_ids).sum())


def common_chunk_size(sample_chunks: list[int]) -> int:
    """Split/window chunk length for variables chunked ``sample_chunks`` along the sample axis."""
    if not sample_chunks:
        raise ConfigError("no variables: cannot define a chunk grid")
    lcm = math.lcm(*sample_chunks)
    if lcm <= _MAX_LCM_FACTOR * max(sample_chunks):
        return lcm
    return max(sample_chunks)
