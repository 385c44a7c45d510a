"""`bnfuse library-path`: print the onnxruntime custom-op library path (bnfuse.runtime)."""

from __future__ import annotations

import argparse


def add(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("library-path", help="print the onnxruntime custom-op library path")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from bnfuse.runtime import library_path

    print(library_path())
    return 0
