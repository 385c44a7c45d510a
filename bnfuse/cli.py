"""The `bnfuse` command: a thin shell over the Python API.

User errors (bnfuse.errors.BnfuseError) print one line on stderr and exit 2; `--debug` shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from bnfuse.errors import BnfuseError

Handler = Callable[[argparse.Namespace], int]


# --- optimize -----------------------------------------------------------------------------------


def _add_optimize(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("optimize", help="fold inference BatchNormalization into its producer")
    parser.set_defaults(handler=_run_optimize)


def _run_optimize(args: argparse.Namespace) -> int:
    raise BnfuseError("optimize: not built yet")


# --- train-graph / train ------------------------------------------------------------------------


def _add_training(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("train-graph", help="turn an inference model into a training graph")
    parser.set_defaults(handler=_run_train_graph)


def _run_train_graph(args: argparse.Namespace) -> int:
    raise BnfuseError("train-graph: not built yet")


# --- models -------------------------------------------------------------------------------------


def _add_models(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("models", help="list or write the built-in test networks")
    parser.set_defaults(handler=_run_models)


def _run_models(args: argparse.Namespace) -> int:
    raise BnfuseError("models: not built yet")


# --- runtime ------------------------------------------------------------------------------------


def _add_runtime(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("library-path", help="print the onnxruntime custom-op library path")
    parser.set_defaults(handler=_run_library_path)


def _run_library_path(args: argparse.Namespace) -> int:
    from bnfuse.runtime import library_path

    print(library_path())
    return 0


# --- entry point --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bnfuse", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_optimize, _add_training, _add_models, _add_runtime):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except BnfuseError as exc:
        if args.debug:
            raise
        print(f"bnfuse {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bnfuse: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
