"""The package's error base: ``except ib.InsitubatchError`` catches what this library raises.

Each specific error also derives from the builtin a caller caught before the base existed
(``ValueError`` for bad options, stores and states; ``KeyError`` for a name that is not
there; ``TypeError`` for an argument of the wrong type; ``OSError`` and its kin for stores
that cannot be opened and failed reads; ``RuntimeError`` for a loader used where or when it
cannot run and a dead worker), so no existing ``except`` clause changes meaning.
"""

from __future__ import annotations


class InsitubatchError(Exception):
    """Base of the errors this package raises on purpose (not of a dependency's own)."""


class ConfigError(InsitubatchError, ValueError):
    """An option of the loader, a node or a config group that cannot work as given: the
    message names the option, the value and what would be valid."""


class ConfigTypeError(InsitubatchError, TypeError):
    """An option or argument of the wrong type (an unknown keyword included): the message
    names it, the value given and the type or names that are valid."""


class UnknownNameError(InsitubatchError, KeyError):
    """A name that is not there: a split of a manifest, a variable, channel, level or
    statistic of a store, a batch key, an icechunk branch. The message names it and lists
    the names that are."""

    def __str__(self) -> str:  # the message as written (KeyError's own quotes it)
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class StoreError(InsitubatchError, ValueError):
    """A store, variable, coordinate or split that cannot be served as asked (its layout,
    its statistics, a manifest that does not match it)."""


class StoreNotFoundError(InsitubatchError, FileNotFoundError):
    """No Zarr store or group (or icechunk repository) where one was asked for."""


class StoreAccessError(InsitubatchError, PermissionError):
    """A store (or a virtual chunk's container) refused the credentials given."""


class StoreConnectionError(InsitubatchError, ConnectionError):
    """A store's endpoint could not be reached or talked to as configured."""


class StoreExistsError(InsitubatchError, FileExistsError):
    """A path a writer would replace holds something that is not a Zarr store."""


class LocalFileError(InsitubatchError, OSError):
    """A local file or directory the package needs that cannot be made or used (the chunk
    cache's directory, a c-blosc2 library of another major version)."""


class StateError(InsitubatchError, ValueError):
    """A ``state_dict`` that this loader cannot resume from: the message names the field
    that does not match, its value and this loader's."""


class SampleIndexError(InsitubatchError, IndexError):
    """A position past the samples of a ``SampleDataset``."""


class LoaderUsageError(InsitubatchError, RuntimeError):
    """A loader, dataset or node used where or when it cannot run: after ``shutdown()``,
    from a second thread, in a forked process, on a CUDA device this torch lacks."""


class InternalError(InsitubatchError, RuntimeError):
    """A broken invariant of this package (a bug: please report it with the message)."""


class UsageTypeError(InsitubatchError, TypeError):
    """An object used in a way its type does not allow: a loader pickled or sent to
    ``DataLoader`` worker processes, a stripe reader asked for a read path it lacks."""


class TestServerError(InsitubatchError, RuntimeError):
    """A loopback server of ``insitubatch_nodes.testing`` (moto S3, the fault proxy) did not
    start: the message says where its log is."""


class MissingDependencyError(InsitubatchError, ImportError):
    """An optional dependency a feature needs is not installed: the message names the
    extra that installs it."""
