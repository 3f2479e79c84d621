"""Opening the store a command names, or exiting 2 with why it could not be opened.

Every store command (inspect, bench) opens its URL this one way, so a bad one reads the
same whichever command was given it.
"""

from __future__ import annotations

import argparse
from typing import Any


def open_store(parser: argparse.ArgumentParser, url: str, variables: list[str] | None) -> Any:
    """Open the store or exit 2 with the error in words (it names the value and what is
    valid: missing path, unsupported scheme, unknown variable and the ones that exist)."""
    import insitubatch_nodes as ib

    try:
        return ib.open_source(url, variables=variables)
    except (FileNotFoundError, KeyError, ValueError, TypeError, OSError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        parser.error(f"cannot open {url!r}: {msg}")
