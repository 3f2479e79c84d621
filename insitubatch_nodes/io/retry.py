"""Which read errors are worth another try, and how long to wait before it.

Object stores fail transiently (5xx, resets, timeouts, truncated bodies that then do not
decode); those are retried with exponential backoff and jitter. Errors that cannot heal by
waiting (403, a bad request, a decode error that repeats) fail at once, so a misconfigured
job stops in seconds instead of minutes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import obstore.exceptions as oe

# Raised by numcodecs / blosc / zstd / our own size check when bytes do not decode.
_DECODE_ERRORS = (RuntimeError, ValueError)
_PERMANENT = (oe.PermissionDeniedError, oe.UnauthenticatedError, oe.InvalidPathError,
              oe.NotSupportedError, oe.UnknownConfigurationKeyError, PermissionError,
              TypeError, AttributeError, KeyError, IndexError, NotImplementedError)


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
            raise ValueError(f"attempts and decode_attempts must be >= 1, got {self}")
        if self.base_delay < 0 or self.max_delay < 0 or not 0 <= self.jitter <= 1:
            raise ValueError(f"delays must be >= 0 and jitter in [0, 1], got {self}")

    def delay(self, failures: int, rng: random.Random) -> float:
        d = min(self.max_delay, self.base_delay * 2 ** (failures - 1))
        return d * (1 + self.jitter * (2 * rng.random() - 1))


NO_RETRY = RetryPolicy(attempts=1, decode_attempts=1)


def classify(exc: BaseException) -> str:
    """``"permanent"``, ``"decode"`` (retry a little) or ``"transient"`` (retry fully)."""
    if isinstance(exc, _PERMANENT):
        return "permanent"
    if isinstance(exc, oe.BaseError):
        text = str(exc)
        # obstore reports some HTTP 4xx as GenericError; those do not heal by waiting.
        if any(f"status: {c}" in text or f" {c} " in text for c in ("400", "401", "403")):
            return "permanent"
        return "transient"
    if isinstance(exc, (OSError, TimeoutError, ConnectionError, EOFError)):
        return "transient"
    if isinstance(exc, _DECODE_ERRORS):
        return "decode"
    return "permanent"
