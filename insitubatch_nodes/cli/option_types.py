"""The types of the command's options: each parses one value or says what is valid.

argparse turns an ``ArgumentTypeError`` into "argument --x: ..." and exit code 2, so a bad
value is one line that names it and what would do instead.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ..bench import BELUGA_ZARR_READ, PEER_NAMES


def bounded(kind: type, low: float, low_ok: bool, high: float | None,
            what: str) -> Callable[[str], Any]:
    """An argparse type: ``kind(text)`` within bounds, else a message naming the value."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if (value != value or value < low or (value == low and not low_ok)
                or (high is not None and value > high)):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


positive_int = bounded(int, 1, True, None, "a whole number >= 1")
nonneg_int = bounded(int, 0, True, None, "a whole number >= 0")
positive_float = bounded(float, 0, False, None, "a number > 0")
fraction = bounded(float, 0, False, 1, "a number in (0, 1], e.g. 0.9")


def byte_size(text: str) -> int:
    """A byte size as the loader reads one (4GB, 512MiB, 1000000), > 0."""
    from ..memory.budget import parse_bytes

    try:
        value = parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"cannot read a byte size from {text!r}; write e.g. 4GB, 512MiB or 1000000"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a byte size > 0, got {text!r}")
    return value


def int_list_of(minimum: int, example: str) -> Callable[[str], tuple[int, ...]]:
    """An argparse type: comma-separated whole numbers >= ``minimum``."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(p) for p in text.replace(" ", "").split(",") if p)
        except ValueError:
            values = ()
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated whole numbers >= {minimum}, e.g. {example}, "
                f"got {text!r}")
        return values

    return parse


int_list = int_list_of(1, "1,8,24,96")
int_list0 = int_list_of(0, "0,2")  # DataLoader worker counts


def positive_int_or_auto(text: str) -> int | None:
    """A whole number >= 1, or ``auto`` (``None``: the loader decides)."""
    if text.strip().lower() == "auto":
        return None
    return positive_int(text)


def choices_list(known: tuple[str, ...], what: str,
                 allow_none: bool) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: comma-separated names out of ``known`` (``none``: no name)."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n for n in text.replace(" ", "").split(",") if n)
        if allow_none and names == ("none",):
            return ()
        bad = [n for n in names if n not in known]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {what} out of {', '.join(known)}"
                + (" (or none)" if allow_none else "") + f", got {text!r}")
        return names

    return parse


peer_list = choices_list(PEER_NAMES, "peers", True)
beluga_modes = choices_list(BELUGA_ZARR_READ, "zarr_read modes", False)


def shape2(text: str) -> tuple[int, int]:
    """A sample shape of two whole numbers >= 1, written 64x64 or 64,64."""
    try:
        values = tuple(int(p) for p in text.lower().replace("x", ",").split(",") if p)
    except ValueError:
        values = ()
    if len(values) != 2 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a sample shape like 64x64, got {text!r}")
    return values
