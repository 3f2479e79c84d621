"""The problems of one loader state, gathered so that one ``StateError`` names them all.

``load_state_dict`` checks a state field by field (``state/checkpoint.py``); each check
that finds a problem adds its message here and the checking goes on where it can, so a
state with several problems is refused once, naming each (its field, its value and what
is valid), rather than one problem per attempt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ParamSpec, TypeVar

from ..errors import StateError

P = ParamSpec("P")
T = TypeVar("T")


class StateProblems:
    """The problems found so far in one loader state, in the order found."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def __len__(self) -> int:
        return len(self.messages)

    def add(self, message: str) -> None:
        """One problem: a message naming the field, its value and what is valid."""
        if message not in self.messages:
            self.messages.append(message)

    def check(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T | None:
        """``fn(*args, **kwargs)``; ``None`` when it raises a ``StateError``, whose message
        is then a problem (the caller goes on without that value where it can)."""
        try:
            return fn(*args, **kwargs)
        except StateError as e:
            self.add(str(e))
            return None

    def message(self) -> str:
        """One problem as its own message; several numbered, one a line."""
        if len(self.messages) == 1:
            return self.messages[0]
        lines = "\n".join(f"  {i}. {m}" for i, m in enumerate(self.messages, 1))
        return f"this loader state has {len(self.messages)} problems:\n{lines}"

    def raise_any(self) -> None:
        """Raise every problem found as one ``StateError``; nothing when there is none."""
        if self.messages:
            raise StateError(self.message())
