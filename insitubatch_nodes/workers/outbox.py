"""The send side of the engine: what goes to a worker waits in its outbox and is written
when its socket takes it, so no worker can block the engine thread.

A worker reads its socket only between jobs, and a job's frame can be larger than the
socket's buffer (~208 KB; 518 KB with 30 variables). A blocking write would then stop the
engine thread until the worker read: no answers read, no other worker fed, no deadline
checked, and forever if the worker is frozen. So the engine's sockets are non-blocking
and each worker has an outbox (``WorkerProc.outbox``): the engine appends to it and writes
what the socket takes; only while something is left does the engine ask epoll for
EPOLLOUT on that socket (a healthy round is one ``write`` and no extra wake-up, as
before). Everything a worker is sent goes through it, in order: the setup, segments, key
tables (pickles framed as ``Connection.send`` frames them: ``wire.framed``) and jobs.

**Descriptors stay in order with the bytes.** A segment's descriptor is passed with
SCM_RIGHTS on one byte (``wire.send_fd``: the byte is its ancillary data's carrier) right
after the segment's message, and the worker reads that byte alone with ``recvmsg``
(``wire.recv_fd``) right after reading the message. The outbox holds the descriptor as an
``int`` between the byte strings; ``flush`` writes the bytes before it, and passes it only
once they are all in the socket (an ``int`` at the head of the outbox): so its byte lands
exactly where the worker expects it. A ``sendmsg`` of one byte goes whole or not at all
(``BlockingIOError``: it waits for EPOLLOUT like any byte). The descriptor (a segment of
the arena) stays open until the arena closes, after the engine stopped.
"""

from __future__ import annotations

import os
import select
from typing import Any

from . import wire
from .procs import WorkerProc

_IN, _IN_OUT = select.EPOLLIN, select.EPOLLIN | select.EPOLLOUT


class Sender:
    """Writes the workers' outboxes on the engine thread; toggles EPOLLOUT in ``epoll``."""

    def __init__(self, epoll: select.epoll) -> None:
        self._epoll = epoll

    def flush(self, proc: WorkerProc[Any]) -> None:
        """Write what ``proc``'s socket takes of its outbox now, without waiting; ask for
        EPOLLOUT while something is left. ``OSError``: the worker's socket is gone."""
        out = proc.outbox
        if proc.fds_out:
            done = self._flush_slowly(proc)
        else:  # the usual: a round's job frames, one write
            data = b"".join(out)  # type: ignore[arg-type]
            try:
                sent = os.write(proc.fd, data)
            except BlockingIOError:
                sent = 0
            out.clear()
            if sent == len(data):
                if not proc.writing:
                    return
                done = True
            else:
                out.append(data[sent:])
                done = False
        if done == proc.writing:  # (done and waiting) or (left over and not waiting)
            self._epoll.modify(proc.fd, _IN if done else _IN_OUT)
            proc.writing = not done

    @staticmethod
    def _flush_slowly(proc: WorkerProc[Any]) -> bool:
        """``flush`` with descriptors in the outbox: bytes up to each, then it. True when
        all went."""
        out = proc.outbox
        while out:
            head = out[0]
            if isinstance(head, int):
                try:
                    wire.send_fd(proc.sock, head)
                except BlockingIOError:
                    return False
                del out[0]
                proc.fds_out -= 1
                continue
            k = next((i for i, x in enumerate(out) if isinstance(x, int)), len(out))
            data = b"".join(out[:k])  # type: ignore[arg-type]
            try:
                sent = os.write(proc.fd, data)
            except BlockingIOError:
                sent = 0
            if sent < len(data):
                out[:k] = [data[sent:]]
                return False
            del out[:k]
        return True


def queue_pickle(proc: WorkerProc[Any], payload: bytes | memoryview) -> None:
    """A pickled message (``ForkingPickler.dumps``) to ``proc``, after what it was queued."""
    proc.outbox.append(wire.framed(payload))


def queue_fd(proc: WorkerProc[Any], fd: int) -> None:
    """Descriptor ``fd`` to ``proc`` on the stream's next byte (``wire.send_fd``)."""
    proc.outbox.append(fd)
    proc.fds_out += 1
