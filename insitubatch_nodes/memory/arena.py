"""The batches being decoded into: buffers keyed by batch number, filled row by row.

Decoding in place, the fetch writes every chunk straight into its final batch rows
(``plan.BatchSlots`` says which); a batch is complete once every row write to it landed
(``landed``). The fetch owns the arena: it yields each batch with a ``BatchFuture``
(``future``), and whoever makes the batch's tensors downstream (``GatherNode``) waits on
that future and takes the batch (``take``), on the training thread.

A batch's memory is taken (``BufferPool``, last in, first out) when it is first written:

- with decode threads and each sample in one slot (one sample per chunk, no split slots):
  by the decode thread whose task writes it first (``arrays_of``, through
  ``fetch/jobs.LazyRows`` as the task starts);
- with decode threads otherwise (several samples per chunk, a sample split across
  channels, a chunk feeding several slots): on the training thread as the window is
  prepared (``rows``, from ``fetch/jobs.prepare_in_place``/``prepare_scattered``);
- with decode workers: on the engine thread, when the first job writing the batch goes out
  to a worker (``arrays_of``, ``workers/engine``).

Batch numbers restart at every reset of the fetch (a new epoch, a restore, an error's
rewind, ``close()``): ``clear`` forgets every batch and moves the arena to a new
``generation``. A read prepared before cannot write into, count into or fail a batch of the
new one (``StaleBatch``), and a future yielded before cannot take one (``StaleFuture``).
"""

from __future__ import annotations

import threading
import time
from _thread import LockType, allocate_lock

import numpy as np

from ..errors import InsitubatchError
from ..sampling.windows import SampleWindow
from .layout import BatchLayout
from .ledger import BufferPool
from .slots import SlotTable, SlotWhere


class StaleBatch(InsitubatchError, RuntimeError):
    """Something of an earlier generation of the arena (before a new epoch, a restore, an
    error's rewind or ``close()``) asked for a batch: a read asking for its memory stops
    there instead of writing into the new batch of that number."""


class StaleFuture(StaleBatch):
    """``BatchFuture.result()`` on a future that cannot hand its batch over: the fetch was
    reset since it was yielded (the batch of that number now is another one), or its batch
    was handed over already. Never another batch's rows."""


class _Filling:
    """One batch being filled: its arrays (``None`` until its first write asks for them),
    its rows, the row writes still to come, and whether it is complete (or failed).

    ``latch`` is a lock held until the batch is complete, made only when a consumer has
    to wait (``take``): it blocks on it. A ``threading.Event`` per batch (a condition, a
    lock and a waiter list, each made and notified per batch) cost both threads several
    microseconds a batch, and most batches are complete when asked for (answers come in
    groups)."""

    __slots__ = ("arrays", "n_rows", "remaining", "complete", "latch", "error")

    def __init__(self, arrays: dict[str, np.ndarray] | None, n_rows: int,
                 remaining: int) -> None:
        self.arrays = arrays
        self.n_rows = n_rows
        self.remaining = remaining
        self.complete = False
        self.latch: LockType | None = None
        self.error: BaseException | None = None

    def finish(self) -> None:
        """Complete (or failed): let the consumer through, once (under the arena's lock)."""
        if not self.complete:
            self.complete = True
            if self.latch is not None:
                self.latch.release()

    def waiter(self) -> LockType:
        """A latch to wait on until complete (under the arena's lock, the batch not
        complete): acquire it, then release it for whoever asks again."""
        if self.latch is None:
            self.latch = allocate_lock()
            self.latch.acquire()
        return self.latch


class BatchFuture:
    """Batch ``batch`` of an arena at generation ``generation`` (the arena's when the
    future was made), as a future: ``result()`` waits until its rows have landed and hands
    its arrays over (``BatchArena.take``), once.

    Valid until the fetch is reset (a new epoch, a restore, an error's rewind,
    ``close()``); futures of one generation may be resolved in any order. A stale one
    raises ``StaleFuture``, never another batch's rows; asking again after a failed read
    raises that error again."""

    __slots__ = ("arena", "batch", "generation")

    def __init__(self, arena: BatchArena, batch: int, generation: int) -> None:
        self.arena, self.batch, self.generation = arena, batch, generation

    def result(self) -> dict[str, np.ndarray]:
        return self.arena.take(self.batch, self.generation)

    def __repr__(self) -> str:
        return f"BatchFuture(batch={self.batch}, generation={self.generation})"


class BatchArena:
    """Batch buffers by batch number, filled by the decode threads or workers.

    ``expect(b, n)`` announces batch ``b`` (``n`` rows, every key of the layout), whose
    memory its first write takes (``arrays_of``; ``rows`` takes it now); ``landed(b, k,
    generation)`` counts ``k`` row writes, ``fail`` a read that will not land;
    ``take(b)`` (through ``future(b)``) waits until all have landed (so a batch is handed
    out as soon as it is complete, not when the window around it is) and hands batch ``b``
    over, whatever the order: the other batches stay. A batch announced and never taken
    (none in the standard graph: a restore's skipped draws and a dropped short batch are
    never announced) is forgotten at the next ``clear``.
    """

    def __init__(self, layout: BatchLayout, pool: BufferPool,
                 steps: SampleWindow | None = None) -> None:
        self.layout = layout
        self.pool = pool
        # With time steps a key holds (rows, history, ...) inputs and "target/key"
        # (rows, n_leads, ...) targets, as GatherNode makes them.
        self.steps = steps
        self._lock = threading.Lock()
        self._batches: dict[int, _Filling] = {}
        # Batch numbers restart every epoch and restore: reads from before a clear() carry
        # the old generation, so they can never count into (or fail) a new batch.
        self.generation = 0
        self._tables: dict[tuple[int, int], SlotTable] = {}  # ``slot_table``'s, by shape
        self.wait_s = 0.0  # consumer time blocked in take() (the fetch's, in LoaderStats)

    @property
    def writes_per_row(self) -> int:
        """Row writes that complete one batch row: every variable at every step."""
        n_steps = 1 if self.steps is None else self.steps.history + len(self.steps.lead)
        return len(self.layout.placements) * n_steps

    def slot(self, key: str, step: int) -> tuple[str, int | None]:
        """Batch key and column for step ``step`` of a sample (``None``: no step axis)."""
        if self.steps is None:
            return key, None
        h = self.steps.history
        return (key, step) if step < h else (f"target/{key}", step - h)

    def where(self, n_vars: int, n_steps: int) -> list[tuple[SlotWhere, ...]]:
        """Per variable and time step, every part of a slot it fills: (batch key, time-step
        column, placement) per placement (one, whole, for a variable decoded straight into
        the batch; several for levels or anemoi variables split across channels)."""
        table = []
        for v in range(n_vars):
            pls = self.layout.placements[v]
            table.append(tuple(tuple((*self.slot(pl.key, k), pl) for pl in pls)
                               for k in range(n_steps)))
        return table

    def slot_table(self, n_vars: int, n_steps: int) -> SlotTable:
        """``where`` as a ``SlotTable`` (split slots' runs joined), made once per shape:
        the decode threads ask for it every window."""
        got = self._tables.get((n_vars, n_steps))
        if got is None:
            got = self._tables[(n_vars, n_steps)] = SlotTable(self.where(n_vars, n_steps))
        return got

    def _allocate(self, n: int) -> dict[str, np.ndarray]:
        out = {}
        for k in self.layout.keys:
            if self.steps is None:
                out[k.name] = self.pool.take((n, *k.row_shape), k.dtype)
                continue
            out[k.name] = self.pool.take((n, self.steps.history, *k.row_shape), k.dtype)
            if self.steps.lead:
                out[f"target/{k.name}"] = self.pool.take(
                    (n, len(self.steps.lead), *k.row_shape), k.dtype)
        return out

    def _arrays(self, got: _Filling) -> dict[str, np.ndarray]:
        """A batch's arrays, allocated at the first ask (under ``_lock``)."""
        if got.arrays is None:
            got.arrays = self._allocate(got.n_rows)
        return got.arrays

    def rows(self, b: int, n: int) -> dict[str, np.ndarray]:
        """Batch ``b``'s arrays (``n`` rows), allocated on first use."""
        with self._lock:
            got = self._batches.get(b)
            if got is None:
                got = self._batches[b] = _Filling(None, n, n * self.writes_per_row)
            return self._arrays(got)

    def expect(self, b: int, n: int) -> None:
        """Batch ``b`` will have ``n`` rows; its memory is taken by its first write
        (``arrays_of``), not now. Batch buffers are pooled last in, first out, so a batch
        taken as the decode threads reach it reuses one the consumer let go of moments
        before, still in cache, and the ledger holds the batches being decoded, not a few
        windows of them (t2m one step: peak 209 -> 42-50 MB, docs/benchmarks.md)."""
        with self._lock:
            if b not in self._batches:
                self._batches[b] = _Filling(None, n, n * self.writes_per_row)

    def expect_many(self, first: int, rows: list[int]) -> None:
        """``expect`` for batches ``first``, ``first + 1``, ... of ``rows`` rows each (a
        window's batches: one lock)."""
        per_row = self.writes_per_row
        with self._lock:
            batches = self._batches
            for b, n in enumerate(rows, first):
                if b not in batches:
                    batches[b] = _Filling(None, n, n * per_row)

    def arrays_of(self, b: int, generation: int) -> dict[str, np.ndarray]:
        """Batch ``b``'s arrays for a read of ``generation``, allocated now if this is its
        first write; ``StaleBatch`` for a read from before a new epoch or a restore."""
        with self._lock:
            got = self._batches.get(b) if generation == self.generation else None
            if got is None:
                raise StaleBatch(f"batch {b} of generation {generation} is gone (now "
                                 f"{self.generation}): a read from before a new epoch or a "
                                 "restore")
            return self._arrays(got)

    def hold(self, b: int, reads: int) -> None:
        """``reads`` copies will read rows of batch ``b`` (a chunk decoded there feeds other
        slots too): ``b`` is not handed out, and then changed in place by a transform or the
        user, before they are done (each counted by ``landed``)."""
        with self._lock:
            self._batches[b].remaining += reads

    def landed(self, b: int, writes: int, generation: int) -> None:
        """``writes`` row writes of batch ``b`` landed (for reads of ``generation``)."""
        self.landed_many({b: writes}, generation)

    def landed_many(self, writes: dict[int, int], generation: int) -> None:
        """``landed`` for every batch of ``writes`` (batch -> row writes), under one lock; a
        batch cleared meanwhile (a new epoch or a restore) is not counted."""
        with self._lock:
            if generation != self.generation:
                return
            batches = self._batches
            for b, n in writes.items():
                got = batches.get(b)
                if got is not None:
                    got.remaining -= n
                    if got.remaining <= 0:
                        got.finish()


    def fail(self, batches: list[int], error: BaseException, generation: int) -> None:
        """The reads for ``batches`` failed: ``take`` raises ``error`` for each."""
        with self._lock:
            if generation != self.generation:
                return
            for b in batches:
                got = self._batches.get(b)
                if got is not None and got.error is None:
                    got.error = error
                    got.finish()

    def future(self, b: int) -> BatchFuture:
        """Batch ``b`` (announced by ``expect``) as a future the fetch yields downstream,
        of this generation (called on the training thread, as ``clear`` is)."""
        return BatchFuture(self, b, self.generation)

    def _stale(self, b: int, generation: int) -> StaleFuture:
        """The error for a future of batch ``b`` of ``generation`` that cannot take it
        (under ``_lock``)."""
        if generation != self.generation:
            return StaleFuture(
                f"batch {b} of generation {generation} is gone: the fetch was reset since its "
                f"future was yielded (the arena is at generation {self.generation}, where "
                f"batch {b} names another batch). A future cannot be held across a reset (a new "
                "epoch, a restore, an error's rewind, close()): resolve it before, or use "
                "the batches the fetch yields after")
        return StaleFuture(f"batch {b} of generation {generation} was handed over already: "
                           "a future's result() hands its batch over once")

    def take(self, b: int, generation: int | None = None) -> dict[str, np.ndarray]:
        """Wait for batch ``b``'s rows, then hand its arrays over (see the class); of
        ``generation`` (a future's; ``None``: the current one), else ``StaleFuture``."""
        gen = self.generation if generation is None else generation
        with self._lock:
            got = self._batches.get(b) if gen == self.generation else None
            if got is None:
                raise self._stale(b, gen)
            latch = None if got.complete else got.waiter()
        if latch is not None:
            t0 = time.perf_counter()
            latch.acquire()  # let through by its last write, a failure, or a clear()
            latch.release()
            self.wait_s += time.perf_counter() - t0
        with self._lock:
            if self._batches.get(b) is not got:  # cleared while waiting, or taken
                raise self._stale(b, gen)
            if got.error is not None:
                raise got.error  # kept: asking again raises again
            del self._batches[b]
            return self._arrays(got)  # allocated by its writes (every row has one)

    def clear(self) -> None:
        """Forget every batch (new epoch, restore, error, close) and start a new generation.
        Reads still running on pool threads may write into them, so their memory is never
        recycled, only freed; a consumer waiting on one of them is let through (its
        ``take`` raises ``StaleFuture``)."""
        with self._lock:
            stale, self._batches = self._batches, {}
            self.generation += 1
            for filling in stale.values():
                filling.finish()
        for filling in stale.values():
            for a in (filling.arrays or {}).values():
                self.pool.disown(a)

    def __len__(self) -> int:
        return len(self._batches)
