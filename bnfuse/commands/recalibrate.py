"""`bnfuse recalibrate`: re-estimate the BatchNormalization statistics on new data (bnfuse.training)."""

from __future__ import annotations

import argparse
import sys

from bnfuse.errors import BnfuseError


def add(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "recalibrate",
        help="re-estimate the BatchNormalization statistics on new data",
        description="New running mean / variance for every BatchNormalization from unlabeled .npz data (arrays "
        "named like the model's inputs, or 'x'), batches in file order; nothing else changes. Under mpiexec every "
        "rank takes its share of each batch. Exit 2: bad input.",
        allow_abbrev=False,
    )
    parser.add_argument("input", help="inference ONNX model with BatchNormalization (before folding)")
    parser.add_argument("--data", required=True, help=".npz with the model's inputs")
    parser.add_argument("-o", "--output", required=True, help="model to write")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per batch (default: 32)")
    parser.add_argument(
        "--mode",
        choices=("update-bn", "exact"),
        default="update-bn",
        help="update-bn: torch.optim.swa_utils.update_bn (BN in training mode, mean of per-batch statistics, "
        "unbiased variance; default); exact: population statistics layer by layer in float64 (biased variance)",
    )
    parser.add_argument("--fold", action="store_true", help="then fold the BN into its producers (bnfuse optimize)")
    parser.add_argument("--cuda", action="store_true", help="run on onnxruntime's CUDA execution provider")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per BatchNormalization")
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from bnfuse.training.recalibrate import mpi_launched
    from bnfuse.training.recalibrate_file import recalibrate_file

    comm = None
    if mpi_launched():
        from bnfuse.training import distributed

        comm = distributed.communicator()
        distributed.abort_on_error(comm)
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if args.cuda else None
    bar = _BatchBar() if sys.stderr.isatty() and (comm is None or comm.rank == 0) else None
    try:
        result = recalibrate_file(
            args.input,
            args.output,
            args.data,
            mode=args.mode,
            batch_size=args.batch_size,
            fold=args.fold,
            providers=providers,
            progress=bar.update if bar else None,
            comm=comm,
        )
    except BnfuseError as exc:
        if comm is None or comm.size == 1:
            raise
        from bnfuse.training import distributed

        distributed.report_and_abort(comm, exc)  # one rank's bad input ends every rank, never a hang
        return 2
    finally:
        if bar is not None:
            bar.close()
    if result.written:
        print(result.report.format_text(verbose=args.verbose))
        if result.fold_text:
            print(result.fold_text)
        print(f"wrote {args.output}" + (f" (tensors in {args.output}.data)" if result.external_data else ""))
    return 0


class _BatchBar:
    """One-line progress over the batches (of every pass) on stderr."""

    WIDTH = 30

    def update(self, done: int, total: int) -> None:
        filled = self.WIDTH * done // total
        sys.stderr.write(f"\rrecalibrating [{'#' * filled}{'.' * (self.WIDTH - filled)}] {done}/{total} batches")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\r" + " " * (self.WIDTH + 40) + "\r")
        sys.stderr.flush()
