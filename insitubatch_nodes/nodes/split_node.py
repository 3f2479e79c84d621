"""SplitNode: the chunk ids of one split, in canonical order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from ..store.splits import SplitManifest
from .state import require_count


class SplitNode(BaseNode[int]):
    """Yields a split's chunk ids in ascending order, less ``exclude``; the head of the graph.

    Its only state is a position, so the split itself always comes from the manifest and a
    checkpoint never carries chunk lists.
    """

    POSITION_KEY = "position"

    def __init__(self, manifest: SplitManifest, split: str,
                 exclude: Sequence[int] | np.ndarray = ()) -> None:
        super().__init__()
        ids = manifest.chunk_ids(split)  # raises a KeyError listing the splits that exist
        self.manifest = manifest
        self.split = split
        # chunks never served (they hold samples touching the store's missing dates)
        self.exclude = tuple(int(i) for i in exclude)
        if self.exclude:
            ids = np.setdiff1d(ids, np.asarray(self.exclude, dtype=np.int64))
        self._array = np.array(ids, dtype=np.int64)  # own copy: made read-only below
        self._array.flags.writeable = False  # drain() hands out views of it
        self._ids = self._array.tolist()
        self._pos = 0

    def __len__(self) -> int:
        return len(self._ids)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._pos = (require_count(initial_state, self.POSITION_KEY, self, len(self._ids),
                                   f"the {len(self._ids)} chunks of split {self.split!r}")
                     if initial_state else 0)

    def next(self) -> int:
        if self._pos >= len(self._ids):
            raise StopIteration
        self._pos += 1
        return self._ids[self._pos - 1]

    def drain(self) -> np.ndarray:
        """Every chunk id ``next()`` has left to yield, at once (read-only), the position
        moved to the end as if each had been yielded. ``ChunkPermuteNode`` pulls an epoch's
        ids so: a ``next()`` per chunk cost ~0.3 us each on the training thread at every
        epoch start, 0.1 s at the 350k one-step chunks of an hourly ERA5 archive."""
        ids = self._array[self._pos :]
        self._pos = len(self._ids)
        return ids

    def get_state(self) -> dict[str, Any]:
        return {self.POSITION_KEY: self._pos}

    def shutdown(self) -> None:
        """The head of the graph: nothing to stop."""
