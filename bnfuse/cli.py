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
    parser = sub.add_parser(
        "optimize",
        help="fold inference BatchNormalization into its producer",
        description="Fold inference BatchNormalization (and trailing per-channel Mul/Add/Sub/Div) into the "
        "preceding Conv / ConvTranspose / Gemm / MatMul. Exit 1: --check failed; exit 2: bad input.",
    )
    parser.add_argument("input", nargs="?", help="ONNX model (default: onnx's shipped light_resnet50.onnx)")
    parser.add_argument("-o", "--output", help="output path (default: <input stem>.bnfuse.onnx here)")
    parser.add_argument("--check", action="store_true", help="prove the rewrite in onnxruntime on random inputs")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    parser.add_argument(
        "--standalone",
        choices=("keep", "scale-shift"),
        default="keep",
        help="what to do with a BatchNormalization that cannot fold (default: keep)",
    )
    parser.add_argument(
        "--input-shape",
        action="append",
        default=[],
        metavar="NAME:DIMS",
        help="concrete shape of an input for --check, e.g. data:1x3x224x224 (repeatable)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the --check inputs (default: 0)")
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    parser.set_defaults(handler=_run_optimize)


def _run_optimize(args: argparse.Namespace) -> int:
    from pathlib import Path

    from bnfuse.errors import CheckFailedError
    from bnfuse.io import save_model
    from bnfuse.passes.optimize import default_model_path, optimize

    source = Path(args.input) if args.input else default_model_path()
    output = Path(args.output) if args.output else Path.cwd() / f"{source.stem}.bnfuse.onnx"
    if output.exists() and source.exists() and output.resolve() == source.resolve():
        raise BnfuseError(f"{output}: refusing to overwrite the input model")
    shapes = _parse_input_shapes(args.input_shape)
    bar = _ProgressBar() if sys.stderr.isatty() else None
    try:
        model, report = optimize(
            source,
            standalone=args.standalone,
            check=args.check,
            input_shapes=shapes,
            seed=args.seed,
            full_check=True,
            progress=bar.update if bar else None,
        )
    except CheckFailedError as exc:
        report = getattr(exc, "report", None)
        if report is not None:
            print(report.format_text())
        print(f"bnfuse optimize: check failed: {exc} (nothing written)", file=sys.stderr)
        return 1
    finally:
        if bar is not None:
            bar.close()
    try:
        save_model(model, output)
        if args.json:
            report.write_json(args.json)
    except OSError as exc:
        raise BnfuseError(f"cannot write {exc.filename or output}: {exc.strerror or exc}") from exc
    print(report.format_text())
    print(f"wrote {output}")
    return 0


def _parse_input_shapes(specs: Sequence[str]) -> dict[str, list[int]]:
    """``name:1x3x224x224`` (the name may itself contain ':') -> {name: [1, 3, 224, 224]}."""
    shapes: dict[str, list[int]] = {}
    for spec in specs:
        name, sep, dims = spec.rpartition(":")
        try:
            values = [int(d) for d in dims.replace(",", "x").split("x")] if dims else []
        except ValueError:
            values = []
        if not sep or not name or not values or any(v < 0 for v in values):
            raise BnfuseError(f"--input-shape {spec!r}: expected NAME:DIMS such as data:1x3x224x224")
        shapes[name] = values
    return shapes


class _ProgressBar:
    """A one-line progress bar on stderr, drawn only for models with many BatchNormalization nodes."""

    MIN_TOTAL = 50
    WIDTH = 30

    def __init__(self) -> None:
        self._drawn = False

    def update(self, done: int, total: int) -> None:
        if total < self.MIN_TOTAL:
            return
        filled = self.WIDTH * done // total
        sys.stderr.write(f"\rfolding [{'#' * filled}{'.' * (self.WIDTH - filled)}] {done}/{total}")
        sys.stderr.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            sys.stderr.write("\r" + " " * (self.WIDTH + 30) + "\r")
            sys.stderr.flush()


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
