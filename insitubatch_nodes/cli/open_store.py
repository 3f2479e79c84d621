"""Opening the store a command names, or exiting 2 with why it could not be opened.

Every store command (inspect, bench) opens its URL this one way, so a bad one reads the
same whichever command was given it. A mistake in what the store is asked for (a store
that cannot be opened, a channel it lacks) is ``fail``: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from ..errors import ConfigError, ConfigTypeError, StoreError, UnknownNameError

# what the package raises for a mistake in its input (not a bug: that keeps its traceback)
INPUT_ERRORS = (ConfigError, ConfigTypeError, UnknownNameError, StoreError)


def message(e: BaseException) -> str:
    """``e``'s message (a ``KeyError``'s without the quotes ``str`` adds)."""
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


def fail(parser: argparse.ArgumentParser, msg: str) -> NoReturn:
    """Exit 2 with ``insitubatch CMD: error: msg`` as the one line on stderr: a mistake in
    the data asked for, where argparse's usage lines would only hide it."""
    parser.exit(2, f"{parser.prog}: error: {' '.join(msg.split())}\n")


def open_store(parser: argparse.ArgumentParser, url: str, variables: list[str] | None) -> Any:
    """Open the store or exit 2 with the error in one line (it names the value and what is
    valid: missing path, unsupported scheme, unknown variable and the ones that exist)."""
    import insitubatch_nodes as ib

    try:
        if ome_description(url) is not None:  # an OME-Zarr image: along z, else t
            try:
                return ib.open_ome_zarr(url, sample_dim="z")
            except UnknownNameError:
                return ib.open_ome_zarr(url, sample_dim="t")
        return ib.open_source(url, variables=variables)
    except (FileNotFoundError, KeyError, ValueError, TypeError, OSError) as e:
        fail(parser, f"cannot open {url!r}: {message(e)}")


def ome_description(url: str) -> str | None:
    """An OME-Zarr image's axes and levels in words (``describe_ome_zarr``); ``None`` for a
    store that is not one."""
    import insitubatch_nodes as ib

    try:
        return ib.describe_ome_zarr(url)
    except (FileNotFoundError, KeyError, ValueError, TypeError, OSError):
        return None
