"""Reading a node's own fields out of a saved state, with errors that name the field."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from ..errors import StateError

_ATOMS = (int, float, str, bool, type(None))


def owner_name(node: object) -> str:
    """How errors name the owner of a state: a node by its class, else the string given
    (the loader names its own fields ``"loader"``)."""
    return node if isinstance(node, str) else type(node).__name__


def copy_state(state: Any) -> Any:
    """A deep copy of a state: nested dicts and lists of numbers and strings are copied by
    hand (several times faster than ``copy.deepcopy``, and nodes snapshot their upstream's
    state once per window); anything else goes to ``copy.deepcopy``."""
    t = type(state)
    if t is dict:
        return {k: copy_state(v) for k, v in state.items()}
    if t is list:
        return [copy_state(v) for v in state]
    if t in _ATOMS:
        return state
    return copy.deepcopy(state)


def require(state: Mapping[str, Any], key: str, node: object) -> Any:
    """``state[key]``; a ``ValueError`` naming the node (or owner, a string), the missing
    field and the fields the state has, instead of a bare ``KeyError`` from deep inside a
    restore."""
    if not isinstance(state, Mapping):
        raise StateError(f"{owner_name(node)} state must be a dict (reading its field "
                         f"{key!r}), got {state!r}")
    try:
        return state[key]
    except KeyError:
        raise StateError(
            f"{owner_name(node)} state has no field {key!r} (it has {sorted(state)}): "
            "load a state saved by a loader built the same way"
        ) from None


def require_count(state: Mapping[str, Any], key: str, node: object,
                  upper: int | None = None, what: str = "") -> int:
    """``state[key]`` as a count: an integer (not a bool) in ``[0, upper]``; else a
    ``ValueError`` naming the node, the field, the value and the valid range (``what``
    says what ``upper`` is, e.g. "the epoch's windows")."""
    value = require(state, key, node)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise StateError(f"{owner_name(node)} state field {key!r} must be an integer "
                         f">= 0, got {value!r}: load a state saved by state_dict()")
    if upper is not None and value > upper:
        raise StateError(f"{owner_name(node)} state field {key!r} is {value}, past "
                         f"{what or 'its range'} ({upper}): the state was edited or saved "
                         "by a loader built differently")
    return value


def require_dict(state: Mapping[str, Any], key: str, node: object) -> dict[str, Any]:
    """``state[key]`` where it must itself be a state (an upstream node's), else a
    ``ValueError`` naming the node and the field."""
    value = require(state, key, node)
    if not isinstance(value, dict):
        raise StateError(f"{owner_name(node)} state field {key!r} must be a dict (the "
                         f"upstream node's state), got {value!r}")
    return value


def shutdown_source(node: object) -> None:
    """Pass ``shutdown()`` upstream where the upstream node has one.

    torchdata 0.11's ``BaseNode`` has no ``shutdown()`` (its main branch adds it, and its
    ``Prefetcher.shutdown()`` calls ``source.shutdown()``), so a foreign upstream node may
    lack it; ours all have it. This is the one place that asks.
    """
    stop = getattr(node, "shutdown", None)
    if callable(stop):
        stop()


@runtime_checkable
class Resumable(Protocol):
    """A stage that can say its state before its first item, given its upstream's: what
    an elastic resume builds the graph's state from."""

    def start_state(self, upstream: dict[str, Any]) -> dict[str, Any]: ...
