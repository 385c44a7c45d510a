"""`bnfuse optimize`: fold inference BatchNormalization into its producer (bnfuse.passes.optimize_file)."""

from __future__ import annotations

import argparse
import sys

from bnfuse.commands.common import parse_input_shapes
from bnfuse.errors import BnfuseError


def add(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "optimize",
        help="fold inference BatchNormalization into its producer",
        description="Fold inference BatchNormalization (and trailing per-channel Mul/Add/Sub/Div) into the "
        "preceding Conv / ConvTranspose / Gemm / MatMul, after merging sums of parallel Conv / BN / identity branches "
        "of one tensor (RepVGG, MobileOne ...) into one Conv. Exit 1: --check failed; exit 2: bad input.",
    )
    parser.add_argument("input", nargs="?", help="ONNX model (default: onnx's shipped light_resnet50.onnx)")
    parser.add_argument("-o", "--output", help="output path (default: <input stem>.bnfuse.onnx here)")
    parser.add_argument("--check", action="store_true", help="prove the rewrite in onnxruntime on random inputs")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON (every BN listed)")
    parser.add_argument("-v", "--verbose", action="store_true", help="list every BN and branch merge, with its proof")
    parser.add_argument(
        "--standalone",
        choices=("keep", "scale-shift"),
        default="keep",
        help="what to do with a BatchNormalization that cannot fold (default: keep)",
    )
    parser.add_argument(
        "--no-activation-moves",
        dest="activation_moves",
        action="store_false",
        help="keep pre-activation BN (BN -> Relu -> Conv) instead of moving their scale into the Conv: fewer BN, but "
        "at onnxruntime's default level the Add left can be slower than the BN + Relu it fuses (docs/exporting.md)",
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
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from bnfuse.errors import CheckFailedError
    from bnfuse.passes.optimize import default_model_path
    from bnfuse.passes.optimize_file import optimize_file

    source = Path(args.input) if args.input else default_model_path()
    output = Path(args.output) if args.output else Path.cwd() / f"{source.stem}.bnfuse.onnx"
    if args.seed < 0:
        raise BnfuseError(f"--seed {args.seed}: must be a non-negative integer")
    shapes = parse_input_shapes(args.input_shape)
    bar = ProgressBar() if sys.stderr.isatty() else None
    try:
        # Model (with its external data) and JSON report are written as one transaction: a failed write of
        # either, or a failed check, leaves neither behind.
        report = optimize_file(
            source,
            output,
            json_path=args.json,
            standalone=args.standalone,
            activation_moves=args.activation_moves,
            check=args.check,
            input_shapes=shapes,
            seed=args.seed,
            full_check=True,
            progress=bar.update if bar else None,
        )
    except CheckFailedError as exc:
        report = getattr(exc, "report", None)
        if report is not None:
            print(report.format_text(verbose=args.verbose))
        print(f"bnfuse optimize: check failed: {exc} (nothing written)", file=sys.stderr)
        return 1
    except OSError as exc:
        raise BnfuseError(f"cannot write {exc.filename or output}: {exc.strerror or exc}") from exc
    finally:
        if bar is not None:
            bar.close()
    print(report.format_text(verbose=args.verbose))
    if not report.external_data:
        print(f"wrote {output}")
    elif report.external_data_reason == "2 GiB":
        print(f"wrote {output} (tensors in {output.name}.data: the model outgrew protobuf's 2 GiB limit)")
    else:
        print(f"wrote {output} (tensors in {output.name}.data)")
    return 0


class ProgressBar:
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
