"""A decode worker: ``python -m insitubatch_nodes.workers.child FD``.

Started by ``engine`` as a module of its own (not ``multiprocessing``'s spawn, which runs
the training script's top-level code again in the child), it imports only the IO layer,
opens its own readers (its own obstore client and event loop for object stores, its own
decoders and chunk-cache handle), then runs jobs until its socket closes: for each stripe
of a job, read and decode it straight into its batch slot in shared memory (or, for a
stripe of several samples or feeding several slots, into a scratch buffer and copy each
slot's row from there), then report the job done (or its error) to the training process.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import sys
import time
import traceback
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InsitubatchError
from ..io.chunk_cache import ChunkCache
from ..io.partial.ranges import PartSpec
from ..io.retry import RetryPolicy
from ..io.served import open_reader
from ..io.thread_buffer import ThreadBuffer
from ..memory.slots import Slot, SlotTable, SlotWhere, fill_slots, stripe_target
from ..sampling.geometry import VariableGeometry
from . import wire
from .deadlines import StatusPage
from .jobs import OFFSET, STRIPE, VAR, Target, read_starts
from .shared_memory import Segment, array_at, map_segment
from .wire import GROUP, PICKLE, Table, decode_job

if TYPE_CHECKING:  # the worker itself imports neither (the source layer pulls in xarray)
    from ..memory.arena import BatchArena
    from ..store.source import Source


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker needs to read the loader's variables into its batches: the zarr
    arrays (they pickle: store and path), their geometry, the store URL for error
    messages, the retry policy, the loader's chunk cache (it pickles to a handle on the
    same directory) and ``where``: per variable and time step, the batch key, column and
    placement of its slot."""

    arrays: tuple[Any, ...]
    variables: tuple[VariableGeometry, ...]
    origins: tuple[tuple[str, str | None], ...]  # per variable: store URL, snapshot
    retry: RetryPolicy
    cache: ChunkCache | None
    where: tuple[tuple[SlotWhere, ...], ...]  # per variable and step
    max_inflight: int

    @classmethod
    def of(cls, source: Source, arena: BatchArena, retry: RetryPolicy,
           cache: ChunkCache | None, max_inflight: int) -> WorkerSetup:
        """A setup for ``source``'s variables decoded into ``arena``'s batches."""
        n_steps = arena.writes_per_row // len(arena.layout.placements)
        where = arena.where(len(source.variables), n_steps)
        origins = tuple(source.origin(i) for i in range(len(source.variables)))
        return cls(tuple(source.arrays), tuple(source.variables), origins, retry, cache,
                   tuple(where), max_inflight)


# (variable, stripe, its slots): one stripe read once and written into every slot
Read = tuple[int, int, tuple[Target, ...]]
# per batch a job writes: (batch, rows, its keys, [segment, offset] per key)
Places = list[tuple[int, int, Table, list[int]]]

# Messages (``wire``), training process -> worker: the setup, then ("segment", index, nbytes)
# followed by its descriptor (SCM_RIGHTS on one byte: ``wire.recv_fd``), ("table", number,
# keys) and jobs as integers (their places and ``targets``, ``jobs.ReadJob``); the socket
# closing is the stop. Worker -> training process: ("ready",); a job done as integers, or
# ("done", id, read times) when the read counters go along; ("error", id, exception);
# ("fatal", text) when it cannot start. Beside the socket, the worker's status page
# (``deadlines.StatusPage``): the job it runs and since when, written at each job's start
# and end, read by the engine's deadlines.

_SCRATCH = ThreadBuffer()
# How often a worker's read counters (store/decode seconds, retries, cache hits) reach the
# loader's: merging them per job cost the engine thread ~1 us per sample, every 0.05 s
# ~0.5 us (an unpickle and a merge a few jobs, on cold caches).
TIMES_EVERY_S = 0.5
TIMES_IDLE_S = 0.05


class Worker:
    """The state of one worker process: its readers, mapped segments, event loop."""

    def __init__(self, setup: WorkerSetup) -> None:
        self.setup = setup
        self.readers = [open_reader(a, g, url) for a, g, (url, _) in
                        zip(setup.arrays, setup.variables, setup.origins, strict=True)]
        times = self.readers[0].times
        for r, (_, snapshot) in zip(self.readers, setup.origins, strict=True):
            r.count_into(times)
            if setup.cache is not None:
                r.use_cache(setup.cache, snapshot)
        self.times = times
        self.local = all(r.groups_reads for r in self.readers)
        # the levels each variable's slots take where not all: only their blocks decoded
        self.parts = [PartSpec.for_slot(w[0], g.sample_shape)
                      for w, g in zip(setup.where, setup.variables, strict=True)]
        self.slots = SlotTable(setup.where)  # split slots' runs joined once
        self.segments: dict[int, Segment] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: ThreadPoolExecutor | None = None

    def run(self, targets: np.ndarray, places: Places) -> None:
        reads = _reads(targets)
        arrays = {b: {k: array_at(self.segments, (where[2 * i], where[2 * i + 1],
                                                  (rows, *tail), dtype))
                      for i, (k, tail, dtype) in enumerate(keys)}
                  for b, rows, keys, where in places}
        if self.local:
            for read in reads:
                self._read_local(read, arrays)
        else:
            self._event_loop().run_until_complete(self._read_all(reads, arrays))

    def _targets(self, read: Read, arrays: dict[int, dict[str, np.ndarray]],
                 ) -> list[Slot]:
        slot, v = self.slots.slot, read[0]
        return [slot(arrays[b], v, k, r) for _, b, r, k in read[2]]

    def _read_local(self, read: Read, arrays: dict[int, dict[str, np.ndarray]]) -> None:
        reader, dsts = self.readers[read[0]], self._targets(read, arrays)
        geom = reader.geom
        buf = stripe_target(dsts, geom.stripe_shape, geom.dtype, _SCRATCH.array)
        reader.read_local_retrying([read[1]], [buf], self.setup.retry,
                                   part=self.parts[read[0]])
        fill_slots(buf, (t[0] for t in read[2]), dsts)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="insitubatch-worker-decode")
        return self._loop

    async def _read_all(self, reads: list[Read],
                        arrays: dict[int, dict[str, np.ndarray]]) -> None:
        """A remote store's reads, up to ``max_inflight`` at once on this worker's loop."""
        loop, pool = self._event_loop(), self._pool
        assert pool is not None
        gate = asyncio.Semaphore(self.setup.max_inflight)

        async def one(read: Read) -> None:
            # a buffer per stripe: reads interleave on this loop (no scratch survives them)
            reader, dsts = self.readers[read[0]], self._targets(read, arrays)
            buf = stripe_target(dsts, reader.geom.stripe_shape, reader.geom.dtype, np.empty)
            async with gate:
                await reader.read(read[1], buf, loop, pool, self.setup.retry,
                                  part=self.parts[read[0]])
            fill_slots(buf, (t[0] for t in read[2]), dsts)

        tasks = [asyncio.ensure_future(one(rd)) for rd in reads]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise


def _reads(targets: np.ndarray) -> list[Read]:
    """A job's ``targets`` rows as reads: (variable, stripe, its slots)."""
    rows = targets.tolist()
    bounds = [*read_starts(targets).tolist(), len(rows)]
    return [(rows[a][VAR], rows[a][STRIPE], tuple(tuple(r[OFFSET:]) for r in rows[a:z]))
            for a, z in zip(bounds[:-1], bounds[1:], strict=True)]


def _sendable(e: BaseException) -> BaseException:
    """``e`` if it survives pickling (ChunkReadError and the like do, notes included), else
    a RuntimeError carrying its type, message and traceback."""
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        text = "".join(traceback.format_exception(e))
        return UnsentError(f"{type(e).__name__}: {e}\n{text}")


class UnsentError(InsitubatchError, RuntimeError):
    """A worker's error that does not pickle, sent as its type, message and traceback."""


class _Gone(Exception):
    """The training process closed this worker's socket, or exited: stop quietly."""


def _send(conn: Connection, msg: tuple) -> None:
    try:
        conn.send(msg)
    except OSError:  # BrokenPipeError, ConnectionResetError: nobody listens any more
        raise _Gone from None


def _seam(name: str) -> str | None:
    """Tests only: ``INSITUBATCH_TEST_<name>``, a fault on demand (``_before_ready``,
    ``_jobs``); unset in use."""
    return os.environ.get("INSITUBATCH_TEST_" + name) or None


def _first() -> bool:
    """Tests only: with ``INSITUBATCH_TEST_ONCE=path`` a seam acts in one worker alone,
    the first to create ``path``; without it, in every worker."""
    path = _seam("ONCE")
    if path is None:
        return True
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _kill_stripe() -> tuple[int, int] | None:
    """Tests only: ``INSITUBATCH_TEST_KILL_STRIPE="v:s"`` makes a worker kill itself
    (SIGKILL) when a job reads stripe ``s`` of variable ``v``, as a chunk that crashes
    its decoder would."""
    text = _seam("KILL_STRIPE")
    if not text:
        return None
    v, s = text.split(":")
    return int(v), int(s)


def _before_ready() -> None:
    """Tests only: ``INSITUBATCH_TEST_EXIT_BEFORE_READY=path`` makes a worker exit (status
    3) before it says ready while ``path`` exists, as a start that fails;
    ``INSITUBATCH_TEST_STOP_BEFORE_READY=1`` makes it stop itself (SIGSTOP) there, as a
    worker frozen at its start."""
    path = _seam("EXIT_BEFORE_READY")
    if path is not None and os.path.exists(path):
        os._exit(3)
    if _seam("STOP_BEFORE_READY") and _first():
        os.kill(os.getpid(), signal.SIGSTOP)


def _start(conn: Connection) -> Worker | None:
    """The worker, set up from the first message; ``None`` when that failed (the error
    went back as "fatal": the engine starts it once more, then fails the windows)."""
    import pickle

    try:
        data = conn.recv_bytes()
    except (EOFError, OSError):
        raise _Gone from None
    try:
        return Worker(pickle.loads(data))
    except Exception as e:
        _send(conn, ("fatal", "".join(traceback.format_exception(e))))
        return None


def serve(conn: Connection, status: StatusPage) -> None:
    """Run jobs from ``conn`` until it closes, saying on ``status`` which one runs. Losing
    the socket at any point, setup included (the training process closed it, shut down,
    was collected or exited), ends the worker quietly: nobody is left to report to, and a
    traceback would only alarm."""
    try:
        worker = _start(conn)
        if worker is not None:
            _before_ready()
            status.idle()
            _send(conn, ("ready",))
            _jobs(conn, worker, status)
    except _Gone:
        return


class _Inbox:
    """What the socket brought, read in the order sent: jobs (``held``, run in that
    order), segments mapped and key tables kept as they come (each before the jobs that
    use it). Read ahead so that the worker knows how many jobs it holds (``_jobs``)."""

    def __init__(self, conn: Connection, worker: Worker) -> None:
        self.conn, self.worker = conn, worker
        self.tables: dict[int, Table] = {}
        self.held: deque[tuple[int, bool, Places, np.ndarray]] = deque()
        self._waiting = select.poll()  # is a message in the socket? (no selector per ask)
        self._waiting.register(conn.fileno(), select.POLLIN)
        self._sock: socket.socket | None = None  # the socket again, for descriptors

    def read(self) -> None:
        """One message, waiting for it; the socket's end is ``_Gone``."""
        import pickle

        try:
            data = self.conn.recv_bytes()
        except (EOFError, OSError):
            raise _Gone from None
        if data[0] != PICKLE:
            self.held.append(decode_job(data, self.tables))
            return
        msg = pickle.loads(data)
        if msg[0] == "table":
            self.tables[msg[1]] = msg[2]
        elif msg[0] == "segment":
            _, index, nbytes = msg
            if self._sock is None:
                self._sock = socket.socket(fileno=os.dup(self.conn.fileno()))
            try:
                fd = wire.recv_fd(self._sock)
            except (EOFError, OSError):
                raise _Gone from None
            self.worker.segments[index] = map_segment(index, fd, nbytes)
            os.close(fd)  # the mapping stays

    def read_waiting(self) -> None:
        """Every message the socket holds now (a message begun is read whole)."""
        while self._waiting.poll(0):
            self.read()


def _jobs(conn: Connection, worker: Worker, status: StatusPage) -> None:
    """The job loop: segments to map, key tables, jobs to run and answer, in the order
    sent, until the socket ends. Each job's start and end go on the status page (the
    engine's deadlines and blame: ``deadlines``). Answers go back in groups (``wire``: one
    wake-up of the training process for a group): a job's answer waits while the worker
    holds two jobs or more not started, up to ``GROUP`` answers, unless it is urgent or an
    error; so it answers as it starts its last job in hand (the engine refills it meanwhile)."""
    kill, pause = _kill_stripe(), float(_seam("JOB_SLEEP_S") or 0)
    inbox = _Inbox(conn, worker)
    held = inbox.held
    pending: list[bytes] = []  # answers not sent yet
    sent = time.perf_counter()  # when the read counters last went back (``_done``)
    while True:
        while not held:
            inbox.read()
        inbox.read_waiting()
        ident, urgent, places, targets = held.popleft()
        status.took(ident)
        if kill is not None and any((v, s) == kill for v, s in targets[
                :, [VAR, STRIPE]].tolist()) and _first():
            os.kill(os.getpid(), signal.SIGKILL)
        if pause:
            time.sleep(pause)
        error = _run(worker, ident, targets, places)
        status.idle()
        inbox.read_waiting()
        if error is None:
            answer, sent = _done(worker, ident, sent, idle=not held)
        pending.append(answer if error is None else error)
        if urgent or error is not None or len(pending) >= GROUP or len(held) <= 1:
            _write(conn, b"".join(pending))
            pending.clear()


def _write(conn: Connection, data: bytes) -> None:
    """``data`` (whole frames) into the socket."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(conn.fileno(), view):]
    except OSError:  # BrokenPipeError, ConnectionResetError: nobody listens any more
        raise _Gone from None


def _run(worker: Worker, ident: int, targets: np.ndarray, places: Places) -> bytes | None:
    """Run one job: ``None`` when done, else its error's frame."""
    import pickle

    try:
        worker.run(targets, places)
    except BaseException as e:  # noqa: BLE001 - every failure goes to the loader
        return wire.framed(pickle.dumps(("error", ident, _sendable(e))))
    return None


def _done(worker: Worker, ident: int, sent: float, idle: bool) -> tuple[bytes, float]:
    """Job ``ident``'s answer, as integers or with the read counters (every
    ``TIMES_EVERY_S``, or ``TIMES_IDLE_S`` when the worker has no job left: an epoch's
    counters are then the loader's soon after its end), and when they last went back."""
    import pickle

    now = time.perf_counter()
    if now - sent < (TIMES_IDLE_S if idle else TIMES_EVERY_S):
        return wire.done(ident), sent
    return wire.framed(pickle.dumps(("done", ident, worker.times.take()))), now


def main(argv: list[str]) -> int:
    """``child FD STATUS_FD``: the socket to the training process, and the status page."""
    # Ctrl-C in a terminal reaches the whole process group: the training process decides
    # (it closes our socket); a worker killed by it would only print a second traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(argv[1]))
    status = StatusPage(int(argv[2]))
    os.close(int(argv[2]))  # the mapping stays
    try:
        serve(conn, status)
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
