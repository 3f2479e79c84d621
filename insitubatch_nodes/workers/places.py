"""Where a job's batches live, as the engine tells a worker: each batch's place (segment,
offset per array, through a numbered table of its keys, shapes and dtypes), taken from the
arena when the first job writing the batch goes out; and what a worker must be sent before
its first job on a place (the segments' descriptors, the key tables it lacks).
"""

from __future__ import annotations

from multiprocessing.reduction import ForkingPickler
from typing import Any

from ..memory.arena import BatchArena
from . import wire
from .jobs import ReadJob
from .outbox import queue_fd, queue_pickle
from .procs import WorkerProc
from .shared_memory import SharedMemoryArena


class Places:
    """Batch places of the arena's current generation, and the key tables numbered as
    workers get them (a batch's shapes past the rows and its dtypes follow from its keys:
    a table is made once per set of keys, then looked up)."""

    def __init__(self, arena: BatchArena, shared: SharedMemoryArena) -> None:
        self.arena, self.shared = arena, shared
        # batch -> its place: (batch, rows, key table, segment, offset, ...) (``wire``)
        self._places: dict[int, tuple[int, ...]] = {}
        self._generation = -1
        self._tables: dict[wire.Table, int] = {}
        self._table_of: dict[tuple[str, ...], int] = {}  # a batch's keys -> its table

    def of(self, job: ReadJob, generation: int) -> list[tuple[int, ...]]:
        """Where the arrays of the batches ``job`` writes live, allocating each batch at
        the first job that writes it (``StaleBatch`` for a cleared generation)."""
        if generation != self._generation:
            self._places, self._generation = {}, generation
        places = self._places
        out = []
        for b in job.writes:
            got = places.get(b)
            if got is None:
                got = places[b] = self._place(b, self.arena.arrays_of(b, generation))
            out.append(got)
        return out

    def _place(self, b: int, arrays: dict[str, Any]) -> tuple[int, ...]:
        """Batch ``b``'s place: (b, rows, key table, then segment and offset per key)."""
        number = self._table_of.get(tuple(arrays))
        if number is None:
            number = self._table(arrays)
        where = self.shared.where
        place = [b, 0, number]
        for a in arrays.values():
            place[1] = len(a)  # (every array of a batch has its rows)
            place += where(a)
        return tuple(place)

    def _table(self, arrays: dict[str, Any]) -> int:
        """The number of the key table of ``arrays`` (a new one the first time)."""
        table = tuple((k, tuple(a.shape[1:]), a.dtype.str) for k, a in arrays.items())
        number = self._table_of[tuple(arrays)] = self._tables.setdefault(table, len(self._tables))
        return number

    def send_setup(self, proc: WorkerProc[Any]) -> None:
        """Queue what ``proc`` needs before a job on the places handed out so far: the
        segments' descriptors and the key tables it was not sent (before the job: the
        outbox keeps the order)."""
        segments = self.shared.segments
        while proc.segments < len(segments):
            seg = segments[proc.segments]
            queue_pickle(proc, ForkingPickler.dumps(("segment", seg.index, seg.nbytes)))
            queue_fd(proc, seg.fd)
            proc.segments += 1
        if len(proc.tables) < len(self._tables):
            for table, number in self._tables.items():
                if number not in proc.tables:
                    queue_pickle(proc, ForkingPickler.dumps(("table", number, table)))
                    proc.tables.add(number)
