"""The bytes between the engine and its decode workers.

Both ends frame messages as ``multiprocessing.connection`` does (a 4-byte big-endian
length, then the payload), so a worker reads them with ``Connection.recv_bytes``. The
messages that come and go once per job are plain integers, not pickles: pickling a job's
index array and its places cost the engine thread more than everything else it does per
job. A payload whose first byte is 0x80 is a pickle (every pickle of protocol 2 or more
starts so): the setup, a segment, a table of batch keys, a read error, read counters.

Engine -> worker, in one ordered byte stream: the setup (a pickle), then as needed a
segment (a pickle naming it, then ``FD_BYTE`` carrying its descriptor: ``send_fd``), a key
table (a pickle), and per job: ``JOB`` (tag, id, urgent, batches, target rows), then per batch
the integers (batch, rows, table, then a segment and an offset per key of that table), then
the job's ``targets`` (``jobs.ReadJob``) as int64 rows. Worker -> engine, per job done:
``DONE`` (tag, id); a job's error, read counters and the start-up messages are pickles.

**Answers in groups.** Every wake-up of the training process costs it tens of microseconds
on a machine whose cores the workers keep busy (its caches are cold when it runs): one per
job was most of its CPU per sample. So a worker holds several jobs (its credit, ``credit``)
and answers them together, in one write: it reads every job its socket holds as it goes, and
sends what it has done when it starts its last job in hand (the engine then refills it while
it runs that one), at most ``GROUP`` answers, or at once for an ``urgent`` job (the first
batch of a start: an epoch, a restore) or an error. Batches then also complete in groups, so
the training thread waits for one in a group only. The credit is ``CREDIT`` (5) jobs, more
for small jobs (``credit``: up to ``MAX_CREDIT`` while a worker holds less than
``CREDIT_BYTES``): groups of 4 took the engine thread from 4.4-5.5 to 3.4-3.8 us of CPU per
sample against pairs; groups of 8 (a batch of t2m one step per chunk is 8 MB), with a
window's first batch answered at once only at a start (``jobs.prepare_window``), the
training process from 9.0 to 6.5 us (medians of 5 pairs, the engine thread 4.05 -> 2.17;
``benchmarks.profile_workers``, 2 workers, 2-core VM under load, alternating). A job of 16
MB or more keeps the credit of 5, so the memory in flight grows only for small jobs, to
~``CREDIT_BYTES`` a worker (t2m: peak 0.25 -> 0.31-0.36 GB, bound 0.56 GB). A healthy worker
is so silent for up to ``GROUP`` jobs: its deadlines time each job from when it took it,
read from its status page, not its silence (``deadlines``).
"""

from __future__ import annotations

import os
import socket
import struct

import numpy as np

from ..errors import InsitubatchError

FRAME = struct.Struct("!i")  # multiprocessing.connection's length prefix
JOB = struct.Struct("<qqqqq")  # TAG_JOB, job id, urgent, batches placed, target rows
DONE = struct.Struct("<qq")  # TAG_DONE, job id
TAG_JOB = 1
TAG_DONE = 2
PICKLE = 0x80  # the first byte of a pickle (protocol >= 2)
CREDIT = 5  # jobs a worker holds at a time, at least (``credit``)
MAX_CREDIT = 9  # ... at most, for jobs of less than CREDIT_BYTES / CREDIT bytes
CREDIT_BYTES = 80 << 20  # what a worker's credit holds, about, where jobs are small
GROUP = MAX_CREDIT - 1  # answers a worker sends together, at most (see above)
COLUMNS = 6  # of a job's targets (``jobs.VAR`` .. ``jobs.STEP``)
# The one byte a segment's descriptor rides on (SCM_RIGHTS), right after the segment's
# message: its value is the count of descriptors, as ``multiprocessing.reduction`` sends them.
FD_BYTE = b"\x01"

# A table of batch keys: (key, shape after the rows, dtype string) per array of a batch,
# in the order of the (segment, offset) pairs of a batch's place.
Table = tuple[tuple[str, tuple[int, ...], str], ...]


def credit(job_nbytes: int) -> int:
    """Jobs a worker may hold at a time for jobs of up to ``job_nbytes`` bytes written:
    ``CREDIT``, more (up to ``MAX_CREDIT``) while they hold less than ``CREDIT_BYTES``."""
    return min(MAX_CREDIT, max(CREDIT, CREDIT_BYTES // max(1, job_nbytes)))


def encode_job(ident: int, places: list[tuple[int, ...]], targets: np.ndarray,
               urgent: bool = False) -> bytes:
    """A job's frame: its places (one tuple of integers per batch it writes) and targets;
    ``urgent``: answered as soon as it is done, not with the next."""
    flat = places[0] if len(places) == 1 else [x for p in places for x in p]
    return b"".join((FRAME.pack(JOB.size + 8 * len(flat) + targets.nbytes),
                     JOB.pack(TAG_JOB, ident, urgent, len(places), len(targets)),
                     struct.pack(f"<{len(flat)}q", *flat), targets.tobytes()))


def decode_job(payload: bytes, tables: dict[int, Table],
               ) -> tuple[int, bool, list[tuple[int, int, Table, list[int]]], np.ndarray]:
    """A job's id, urgency, places (batch, rows, key table, [segment, offset, ...]) and
    targets."""
    _, ident, urgent, n_places, n_rows = JOB.unpack_from(payload)
    at = JOB.size
    places = []
    for _ in range(n_places):
        b, rows, table = struct.unpack_from("<3q", payload, at)
        keys = tables[table]
        at += 24
        where = list(struct.unpack_from(f"<{2 * len(keys)}q", payload, at))
        at += 16 * len(keys)
        places.append((b, rows, keys, where))
    targets = np.frombuffer(payload, dtype=np.int64, count=n_rows * COLUMNS, offset=at)
    return ident, bool(urgent), places, targets.reshape(n_rows, COLUMNS)


def done(ident: int) -> bytes:
    """The frame a worker answers for a job done without read counters to report."""
    return FRAME.pack(DONE.size) + DONE.pack(TAG_DONE, ident)


def framed(payload: bytes | memoryview) -> bytes:
    """``payload`` with its length before it, as ``Connection.send_bytes`` writes it."""
    return FRAME.pack(len(payload)) + payload


def send_fd(sock: socket.socket, fd: int) -> None:
    """Pass descriptor ``fd`` on ``FD_BYTE``, the next byte of the stream (one
    ``sendmsg``: on a non-blocking socket it goes whole or raises ``BlockingIOError``)."""
    socket.send_fds(sock, [FD_BYTE], [fd])


class WireError(InsitubatchError, OSError):
    """The socket ended where a descriptor was due, or carried something else: the other
    end is gone or out of step (a worker then stops, as on any lost socket)."""


def recv_fd(sock: socket.socket) -> int:
    """The descriptor riding on the next byte of ``sock`` (``send_fd``). The byte must be
    read alone, with room for the descriptor: a plain read over it would close it."""
    msg, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if not msg:
        raise WireError("the socket ended before a descriptor")
    if len(fds) != 1 or msg != FD_BYTE:
        for fd in fds:
            os.close(fd)
        raise WireError(f"expected one descriptor on {FD_BYTE!r}, got {len(fds)} on {msg!r}")
    return fds[0]
