"""The package's error base: ``except ib.InsitubatchError`` catches what this library raises.

Each specific error also derives from the builtin a caller caught before the base existed
(``ValueError`` for bad options, stores and states; ``OSError`` for failed reads;
``RuntimeError`` for a dead worker), so no existing ``except`` clause changes meaning.
"""

from __future__ import annotations


class InsitubatchError(Exception):
    """Base of the errors this package raises on purpose (not of a dependency's own)."""


class ConfigError(InsitubatchError, ValueError):
    """An option of the loader, a node or a config group that cannot work as given: the
    message names the option, the value and what would be valid."""


class StoreError(InsitubatchError, ValueError):
    """A store, variable, coordinate or split that cannot be served as asked (its layout,
    its statistics, a manifest that does not match it)."""


class StateError(InsitubatchError, ValueError):
    """A ``state_dict`` that this loader cannot resume from: the message names the field
    that does not match, its value and this loader's."""
