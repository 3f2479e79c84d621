"""Pool tasks that let go of their arguments as soon as they have run.

``ThreadPoolExecutor`` keeps a task's arguments in its work item until the worker thread
gets the GIL back after completing the future; under load that is long enough for the
consumer to finish with a decode buffer the work item still references, so the memory
ledger (rightly) saw it resident past its last use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ..errors import InternalError

T = TypeVar("T")


class OneShot(Generic[T]):
    """``fn(*args)`` once; the references are dropped before the result is handed back."""

    __slots__ = ("_args", "_fn")

    def __init__(self, fn: Callable[..., T], *args: Any) -> None:
        self._fn: Callable[..., T] | None = fn
        self._args: tuple[Any, ...] = args

    def drop(self) -> None:
        """Never to run (its future was cancelled before it started): let go of the
        arguments now. The work item stays in the executor's queue until a worker takes
        it, and the buffers with it, past a restore that allocates new ones."""
        self._fn, self._args = None, ()

    def __call__(self) -> T:
        fn, args = self._fn, self._args
        if fn is None:
            raise InternalError("a OneShot pool task ran twice")
        self._fn, self._args = None, ()
        return fn(*args)
