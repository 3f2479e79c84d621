"""Which read errors are worth another try, how long to wait, and the error that ends a read.

Object stores fail transiently (5xx, resets, timeouts, truncated bodies that then do not
decode); those are retried with exponential backoff and jitter. Only errors *known* to be
transient are retried: obstore's ``GenericError`` (its requests, bodies and timeouts) unless
it carries a 4xx status, network ``OSError``s, and ``ChunkDecodeError`` (a received frame
that does not decode). Everything else, a programming error included, fails at once.
"""

from __future__ import annotations

import errno
import lzma
import random
import re
import zlib
from dataclasses import dataclass

import obstore.exceptions as oe

from ..errors import ConfigError, InsitubatchError

# What codecs raise for stored bytes that do not decode: numcodecs' RuntimeError/ValueError,
# gzip's EOFError, zlib.error, LZMAError, our frame checks' ValueError. (Not OSError: on a
# read path it may be the store's own error.)
DECODE_ERRORS = (ValueError, RuntimeError, EOFError, zlib.error, lzma.LZMAError)


class ChunkDecodeError(InsitubatchError, ValueError):
    """Stored bytes that did not decode, raised where received frames are decoded or
    checked. Its own type so that retries tell a damaged transfer (worth another try) from
    a ``ValueError`` of our code (not); ``key`` is the chunk's store key where known."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.inner: tuple[int, ...] | None = None  # inner-chunk coords, set by the reader


class ChunkReadError(InsitubatchError, OSError):
    """A chunk read failed for good. The message names the store (no credentials), the
    variable, the chunk key (``key``: ``None`` where a stripe of several chunks failed as a
    whole) and the attempts; the last failure is ``__cause__``. An ``OSError`` because a
    failed read is an IO failure: ``except OSError`` catches it, as it caught most transport
    errors before (obstore's own types subclass only ``Exception``)."""

    def __init__(self, message: str, url: str = "", variable: str = "",
                 key: str | None = None, attempts: int = 0) -> None:
        super().__init__(message)
        self.url, self.variable, self.key, self.attempts = url, variable, key, attempts


class CorruptChunkError(ChunkReadError, ValueError):
    """A chunk that did not decode in any attempt. Also a ``ValueError``, as the codec's
    own error was (like ``io.UnsupportedOperation``), so ``except ValueError`` still
    catches a damaged chunk."""


@dataclass(frozen=True)
class RetryPolicy:
    """Up to ``attempts`` tries per stripe; waits ``base_delay * 2**k`` (capped at
    ``max_delay``) with +-``jitter`` relative noise. A decode error gets ``decode_attempts``
    tries: once may be a truncated transfer, three times in a row is a corrupt chunk."""

    attempts: int = 5
    base_delay: float = 0.1
    max_delay: float = 5.0
    jitter: float = 0.5
    decode_attempts: int = 3

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.decode_attempts < 1:
            raise ConfigError(f"attempts and decode_attempts must be >= 1, got {self}")
        if self.base_delay < 0 or self.max_delay < 0 or not 0 <= self.jitter <= 1:
            raise ConfigError(f"delays must be >= 0 and jitter in [0, 1], got {self}")

    def delay(self, failures: int, rng: random.Random) -> float:
        d = min(self.max_delay, self.base_delay * 2 ** (failures - 1))
        return d * (1 + self.jitter * (2 * rng.random() - 1))


NO_RETRY = RetryPolicy(attempts=1, decode_attempts=1)

# Network and IO errnos that can heal by waiting (a local disk's EIO, NFS's ESTALE, ...).
_TRANSIENT_ERRNOS = frozenset(getattr(errno, n) for n in (
    "EIO", "EAGAIN", "EINTR", "EBUSY", "ESTALE", "ETIMEDOUT", "ECONNRESET", "ECONNABORTED",
    "ECONNREFUSED", "EPIPE", "ENETDOWN", "ENETUNREACH", "ENETRESET", "EHOSTUNREACH",
    "EHOSTDOWN") if hasattr(errno, n))
# obstore raises these without an errno: they say what happened by type.
_NEVER_HEAL = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
               ChunkReadError)
# object_store's words for an HTTP status ("Server returned non-2xx status code: 503 ...",
# older releases "Client error with status 400 ..."); see ``http_status``.
_STATUS = re.compile(r"\b(?:status code:|with status) (\d{3})\b")


def http_status(exc: BaseException) -> int | None:
    """The HTTP status of an obstore error, where it has one.

    The typed errors say it by type (``PermissionDeniedError`` 403, ``UnauthenticatedError``
    401, ``FileNotFoundError`` 404). obstore (0.12) gives ``GenericError`` no status
    attribute, so for that type only the status is read from object_store's own phrase in
    the message (the first match, which precedes any response body); ``None`` if absent.
    """
    if isinstance(exc, oe.PermissionDeniedError):
        return 403
    if isinstance(exc, oe.UnauthenticatedError):
        return 401
    if isinstance(exc, (FileNotFoundError, oe.NotFoundError)):
        return 404
    if isinstance(exc, oe.GenericError):
        m = _STATUS.search(str(exc))
        return int(m.group(1)) if m else None
    return None


def classify(exc: BaseException) -> str:
    """``"transient"`` (retry fully), ``"decode"`` (a received frame that did not decode:
    retry a little) or ``"permanent"`` (fail now: not known to heal by waiting)."""
    if isinstance(exc, ChunkDecodeError):
        return "decode"
    if isinstance(exc, oe.GenericError):
        status = http_status(exc)
        # 4xx do not heal by waiting, except a request timeout and "slow down".
        if status is not None and 400 <= status < 500 and status not in (408, 429):
            return "permanent"
        return "transient"
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return "transient"
    if isinstance(exc, _NEVER_HEAL):
        return "permanent"
    if isinstance(exc, OSError):
        # obstore's IO errors carry no errno; a local file's say what happened.
        return "transient" if exc.errno is None or exc.errno in _TRANSIENT_ERRNOS else (
            "permanent")
    return "permanent"


def is_store_error(exc: BaseException) -> bool:
    """A failure of the store or of its bytes (wrapped in ``ChunkReadError`` when final),
    as opposed to a programming error, which keeps its own type."""
    return isinstance(exc, (oe.BaseError, OSError, ChunkDecodeError))


def final_error(kind: str, where: str, last: str, attempts: int, url: str,
                variable: str, key: str | None) -> ChunkReadError:
    """The error that ends a stripe's reads (``kind`` as ``classify`` said): its message
    alone says ``where`` (store, variable, chunk key), how often it was tried, and what
    failed ``last``."""
    plural = "s" if attempts != 1 else ""
    if kind == "decode":
        return CorruptChunkError(
            f"{where} did not decode in {attempts} attempt{plural} (the stored bytes are "
            f"damaged, or every transfer was cut short): {last}", url, variable, key, attempts)
    if kind == "permanent":
        return ChunkReadError(
            f"cannot read {where}: failed after {attempts} attempt{plural}, not retried "
            f"further since this error does not heal by waiting: {last}",
            url, variable, key, attempts)
    return ChunkReadError(f"cannot read {where}: gave up after {attempts} "
                          f"attempt{plural}: {last}", url, variable, key, attempts)

