"""Reading a node's own fields out of a saved state, with errors that name the field."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable


def require(state: Mapping[str, Any], key: str, node: object) -> Any:
    """``state[key]``; a ``ValueError`` naming the node, the missing field and the fields
    the state has, instead of a bare ``KeyError`` from deep inside a restore."""
    if not isinstance(state, Mapping):
        raise ValueError(f"{type(node).__name__} state must be a dict, got {state!r}")
    try:
        return state[key]
    except KeyError:
        raise ValueError(
            f"{type(node).__name__} state has no field {key!r} (it has {sorted(state)}): "
            "load a state saved by a loader built the same way"
        ) from None


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
