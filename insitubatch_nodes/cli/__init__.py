"""The ``insitubatch`` command: ``make-demo``, ``inspect`` and ``bench``.

Bad input (a store that cannot be opened, an unknown variable, an option out of range) is
reported in one line that names the value and what is valid, with exit code 2.
The parser is ``parser``; each subcommand's implementation is a module of its own
(``make_demo``, ``inspect_store`` with ``plot_sample``, ``bench_command``).
"""

from __future__ import annotations

import sys

from .bench_command import cmd_bench
from .inspect_store import cmd_inspect
from .make_demo import cmd_make_demo
from .parser import build_parser

__all__ = ["COMMANDS", "EXIT_USAGE", "main"]

EXIT_USAGE = 2

COMMANDS = {"make-demo": cmd_make_demo, "inspect": cmd_inspect, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` (default: the process's arguments) names; its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args.parser, args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
