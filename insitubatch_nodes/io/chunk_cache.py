"""A local, size-bounded cache of stored (compressed) chunks, shared by processes on a node.

Later epochs over an object store or icechunk repository read the chunk bytes from local
disk instead of paying a round trip (and egress) each time. One file per chunk, named by a
hash of (store URL without credentials, icechunk snapshot id, chunk key): a moved branch has
a new snapshot id, so it never meets the old bytes. Each file carries its identity, length
and crc32c, checked on every read: a damaged or foreign entry is deleted and reads as a miss.

Why not diskcache (process-safe, sqlite-backed, LRU eviction): with its LRU policy every
``get`` is a sqlite write, measured at ~215 us per 128 kB hit against ~25 us for a plain file
read (DESIGN.md "Local chunk cache"), which at 10k chunks/s is two cores of bookkeeping; its
values carry no checksum either. Publication here is a rename of a complete temp file (no
torn reads, a crash leaves no entry), recency is the file's mtime (touched on every hit),
and the byte total lives in one small file updated under ``flock``, rescanned from disk
whenever an eviction runs (so drift between processes heals).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import google_crc32c

try:
    import fcntl
except ImportError:  # Windows: no flock; one process per cache directory there
    fcntl = None  # type: ignore[assignment]  # the module's name, None where it is missing

from ..errors import ConfigError, LocalFileError
from ..memory.budget import parse_bytes
from ..store.storage import redact_urls

__all__ = ["CacheScope", "ChunkCache"]

_VERSION = 1
# magic, version, identity length, payload length, payload crc32c
_HEADER = struct.Struct("<4sBxxxIQI")
_MAGIC = b"IBCC"
_LOW_WATER = 0.9  # an eviction frees down to this share of max_bytes (evictions stay rare)
_STALE_TMP_S = 3600.0  # temp files this old belong to a writer that died: removed on evict
_BACKLOG = 64 << 20  # bytes waiting for the writer thread; past it, chunks are not cached
_WRITER_NICE = 10  # the writer thread's nice value (Linux): it writes in the CPU's idle time
_names = itertools.count()
log = logging.getLogger("insitubatch_nodes")


@dataclass(frozen=True)
class CacheScope:
    """Where a store's chunks live in a cache: the store URL without credentials and the
    icechunk snapshot id (``None`` for stores without snapshots). ``ident(key)`` is what a
    cache entry is checked against."""

    url: str
    snapshot_id: str | None

    @classmethod
    def of(cls, url: str, snapshot_id: str | None) -> CacheScope:
        """A scope for ``url`` (any URLs inside it lose user info and query strings). With a
        snapshot id, the ref an icechunk URL names (``... @ branch 'main'``) is dropped: the
        snapshot says which bytes, so a branch, a tag and the id itself share entries."""
        if snapshot_id is not None:
            url = url.rsplit(" @ ", 1)[0]
        return cls(redact_urls(url), snapshot_id)

    def ident(self, key: str) -> str:
        return f"{self.url}\n{self.snapshot_id or '-'}\n{key}"


class ChunkCache:
    """Stored chunk bytes on local disk, at most ``max_bytes`` (``"200GB"``, ``"512MiB"`` or
    an int), least recently used evicted first. Several processes may share ``directory``.

    ``get``/``put`` are blocking file IO: the read paths call them on pool threads. Local
    stores are never cached (their chunks are on local disk already).
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int | str = "200GB") -> None:
        self.directory = Path(directory)
        self.max_bytes = parse_bytes(max_bytes)
        if self.max_bytes < 1:
            raise ConfigError(f"ChunkCache max_bytes must be positive, got {max_bytes!r}")
        self.root = self.directory / f"v{_VERSION}"
        try:
            (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise LocalFileError(f"ChunkCache cannot create its directory {str(self.root)!r}: "
                                 f"{e}") from e
        self._root = str(self.root)  # string joins: pathlib costs microseconds per chunk
        self.corrupt = 0  # entries found damaged (deleted, read as misses) by this process
        self.skipped = 0  # chunks not cached by put_later: the writer was too far behind
        # Two locks: the writer, its backlog and the counters take ``_lock`` (held for a few
        # statements, also from the event loop); the byte total takes ``_total_lock`` and
        # then the directory's flock, held through an eviction's scan.
        self._lock = threading.Lock()
        self._total_lock = threading.Lock()
        self._fd: int | None = None
        self._pid = -1
        self._writer: ThreadPoolExecutor | None = None
        self._writer_pid = -1
        self._backlog = 0  # bytes handed to the writer thread, not yet written
        self._warned = False

    def __repr__(self) -> str:
        return f"ChunkCache({str(self.directory)!r}, max_bytes={self.max_bytes})"

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory, "max_bytes": self.max_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        type(self).__init__(self, state["directory"], state["max_bytes"])  # unpickled as built

    # -- entries ---------------------------------------------------------------------
    def path(self, ident: str) -> str:
        """The file of entry ``ident`` (a hash: no URL or key text in the path)."""
        h = hashlib.blake2b(ident.encode(), digest_size=16).hexdigest()
        return f"{self._root}/{h[:2]}/{h}"

    def get(self, ident: str) -> bytes | None:
        """The bytes stored for ``ident``, or ``None`` (never stored, evicted, or damaged:
        a damaged entry is deleted, so the caller's refetch replaces it)."""
        path = self.path(ident)
        try:
            with open(path, "rb") as f:
                entry = _read_entry(f)
        except FileNotFoundError:
            return None
        if entry is not None and entry[0] == ident.encode():
            _touch(path)
            return entry[1]
        self._drop_damaged(path)
        return None

    def has(self, ident: str) -> bool:
        """Whether an entry for ``ident`` exists (one ``stat``, no read, no check): cheap
        enough for the event loop, so a miss goes to the store without a pool hand-off, and
        for the pool threads that skip re-writing a partly cached stripe's chunks."""
        return os.path.exists(self.path(ident))

    def put(self, ident: str, data: bytes | memoryview) -> None:
        """Store ``data`` for ``ident``: written to a temp file, then renamed into place, so
        readers see the whole entry or none. Evicts the least recently used entries when the
        total would pass ``max_bytes``."""
        payload = data if isinstance(data, bytes) else bytes(data)
        who = ident.encode()
        head = _HEADER.pack(_MAGIC, _VERSION, len(who), len(payload),
                            google_crc32c.value(payload))
        size = len(head) + len(who) + len(payload)
        if size > self.max_bytes:
            return
        path = self.path(ident)
        tmp = f"{self._root}/tmp/{os.getpid()}.{threading.get_ident()}.{next(_names)}"
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(who)
                f.write(payload)
            _touch(tmp)
            try:
                old = os.stat(path).st_size
            except FileNotFoundError:
                old = 0
                os.makedirs(os.path.dirname(path), exist_ok=True)
            os.replace(tmp, path)
        except BaseException:
            with _quiet():
                os.unlink(tmp)
            raise
        self._account(size - old)

    def put_later(self, ident: str, data: bytes | memoryview) -> None:
        """``put`` on this cache's writer thread, at a lower CPU priority, so neither the
        fetch nor the decode waits for the disk (epoch 1 stays as fast as without a cache).
        With more than 64 MB already waiting, the chunk is not cached this time (``skipped``)
        and is fetched again, and cached, in a later epoch. A failed write (a full disk) is
        logged once, never raised. ``flush`` waits for the writes."""
        with self._lock:
            if self._writer is None or self._writer_pid != os.getpid():
                self._writer = ThreadPoolExecutor(1, thread_name_prefix="insitubatch-cache",
                                                  initializer=_lower_priority)
                self._writer_pid, self._backlog = os.getpid(), 0
            if self._backlog + len(data) > _BACKLOG:
                self.skipped += 1
                return
            self._backlog += len(data)
            writer = self._writer
        writer.submit(self._put_quietly, ident, data, len(data))

    def flush(self) -> None:
        """Wait until every ``put_later`` so far is on disk."""
        with self._lock:
            writer = self._writer if self._writer_pid == os.getpid() else None
        if writer is not None:
            done: Future = writer.submit(lambda: None)
            done.result()

    def _put_quietly(self, ident: str, data: bytes | memoryview, queued: int) -> None:
        try:
            self.put(ident, data)
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning("insitubatch: ChunkCache %s could not write an entry (%s); chunks "
                            "not written are read from the store again", self.directory, e)
        finally:
            if queued:
                with self._lock:
                    self._backlog -= queued

    def usage(self) -> int:
        """Bytes of the entries on disk now (a directory scan)."""
        return sum(size for _, size, _ in self._entries())

    def entries(self) -> int:
        """Entries on disk now (a directory scan)."""
        return sum(1 for _ in self._entries())

    def verify(self) -> int:
        """Check every entry's header, length, checksum and name: the number damaged
        (left in place: a read of one deletes it and refetches)."""
        bad = 0
        for _, _, path in self._entries():
            with _quiet(), open(path, "rb") as f:
                entry = _read_entry(f)
                bad += entry is None or self.path(entry[0].decode(errors="replace")) != path
        return bad

    def clear(self) -> None:
        """Delete every entry."""
        with self._locked() as fd:
            for _, _, path in self._entries():
                with _quiet():
                    os.unlink(path)
            _write_total(fd, 0)

    # -- the byte total and eviction --------------------------------------------------
    def _drop_damaged(self, path: str) -> None:
        with self._lock:  # decode threads find damaged entries concurrently
            self.corrupt += 1
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            return
        self._account(-size)

    def _account(self, delta: int) -> None:
        with self._locked() as fd:
            total = _read_total(fd)
            total = self.usage() if total is None else max(0, total + delta)
            if total > self.max_bytes:
                total = self._evict(int(self.max_bytes * _LOW_WATER))
            _write_total(fd, total)

    def _evict(self, target: int) -> int:
        """Delete the least recently used entries until at most ``target`` bytes remain
        (under the lock; the scan is the truth, whatever the total said). Returns the
        bytes left."""
        entries = sorted(self._entries())
        total = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if total <= target:
                break
            with _quiet():
                os.unlink(path)
                total -= size
        now = time.time()
        with os.scandir(f"{self._root}/tmp") as it:
            for e in it:
                with _quiet():
                    if now - e.stat().st_mtime > _STALE_TMP_S:
                        os.unlink(e.path)
        return total

    def _entries(self) -> list[tuple[int, int, str]]:
        """(mtime ns, size, path) of every entry."""
        out = []
        with os.scandir(self._root) as top:
            subdirs = [e.path for e in top if e.is_dir() and len(e.name) == 2]
        for sub in subdirs:
            with _quiet(), os.scandir(sub) as it:
                for e in it:
                    with _quiet():
                        st = e.stat()
                        out.append((st.st_mtime_ns, st.st_size, e.path))
        return out

    def _locked(self) -> _Flock:
        with self._total_lock:
            if self._fd is None or self._pid != os.getpid():  # a forked child opens its own
                self._fd = os.open(f"{self._root}/total", os.O_RDWR | os.O_CREAT, 0o644)
                self._pid = os.getpid()
            return _Flock(self._fd, self._total_lock)


class _Flock:
    """This process's thread lock, then the directory's ``flock``: one writer of the total
    at a time across threads and processes."""

    def __init__(self, fd: int, lock: threading.Lock) -> None:
        self.fd, self.lock = fd, lock

    def __enter__(self) -> int:
        self.lock.acquire()
        if fcntl is not None:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self.fd

    def __exit__(self, *exc: object) -> None:
        if fcntl is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.lock.release()


def _read_entry(f: Any) -> tuple[bytes, bytes] | None:
    """(identity, payload) of an open entry file, or ``None`` if it is damaged: a bad
    header, a length that does not match the file, or a payload that fails its crc32c."""
    head = f.read(_HEADER.size)
    if len(head) != _HEADER.size:
        return None
    magic, version, n_ident, n, crc = _HEADER.unpack(head)
    if magic != _MAGIC or version != _VERSION:
        return None
    who = f.read(n_ident)
    data = f.read(n + 1)  # one more: a longer file is damaged too
    if len(who) != n_ident or len(data) != n or google_crc32c.value(data) != crc:
        return None
    return who, data


def _read_total(fd: int) -> int | None:
    raw = os.pread(fd, 8, 0)
    return struct.unpack("<q", raw)[0] if len(raw) == 8 else None


def _write_total(fd: int, total: int) -> None:
    os.pwrite(fd, struct.pack("<q", total), 0)


def _lower_priority() -> None:
    """The writer thread yields the CPU to the loader's own threads (and to the training
    loop): on Linux a thread has its own nice value. Elsewhere it keeps the default."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _WRITER_NICE)


def _touch(path: str) -> None:
    """Mark an entry used now (its mtime is its recency for eviction). An explicit time:
    the kernel's own file times tick every few ms, too coarse to order recent uses."""
    now = time.time_ns()
    with _quiet():
        os.utime(path, ns=(now, now))


class _quiet:
    """Ignore a file that another process removed first."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, *rest: object) -> bool:
        return kind is not None and issubclass(kind, FileNotFoundError)
