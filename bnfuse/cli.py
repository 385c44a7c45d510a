"""The `bnfuse` command: a thin shell over the Python API.

User errors (bnfuse.errors.BnfuseError) print one line on stderr and exit 2; `--debug` shows the
traceback instead. Each subcommand's arguments and handler are a module of bnfuse/commands; this module
assembles the parser (allow_abbrev=False on every parser) and runs the chosen handler.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable, Sequence

from bnfuse.commands import doctor, library_path, models, optimize, recalibrate, train, train_graph
from bnfuse.errors import BnfuseError

Handler = Callable[[argparse.Namespace], int]


# The subcommands in the order `bnfuse --help` lists them; each module adds its parser with `add(sub)`.
COMMANDS = (optimize, train_graph, train, recalibrate, models, library_path, doctor)
_ProgressBar = optimize.ProgressBar  # tests/test_cli_optimize.py reads it here


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bnfuse", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add(sub)
    _no_abbreviations(parser)
    return parser


def _no_abbreviations(parser: argparse.ArgumentParser) -> None:
    """allow_abbrev=False on the parser and every subcommand's: `--lr` must never be read as `--lr-mult`."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _no_abbreviations(child)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    if not args.debug:  # NumPy's RuntimeWarnings (a NaN widened, an overflow) are not for users: errors are one line
        warnings.simplefilter("ignore", RuntimeWarning)
    try:
        return handler(args)
    except BnfuseError as exc:
        if args.debug:
            raise
        sys.stderr.write(f"bnfuse {args.command}: error: {exc}\n")  # one write: under mpiexec, lines stay whole
        return 2
    except KeyboardInterrupt as exc:
        print(f"bnfuse: {exc or 'interrupted'}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
