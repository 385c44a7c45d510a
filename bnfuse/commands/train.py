"""`bnfuse train`: train a model on .npz data and write the trained inference model (bnfuse.training.job).

The options of `train` are all in :func:`add`; those that build the training graph (a group of their own) are
listed again in :data:`GRAPH_OPTIONS`.
"""

from __future__ import annotations

import argparse
import sys

from bnfuse.errors import BnfuseError

NPZ_LAYOUT = (
    "Data files (.npz): each data input as an array of its name (with one input also 'x' or 'X'), the labels as "
    "'labels' or 'y' (class indices for cross-entropy), samples along the first axis."
)
# train's options that build the training graph: refused when the input already is one
GRAPH_OPTIONS = (
    "loss",
    "optimizer",
    "sgd_momentum",
    "nesterov",
    "weight_decay",
    "bn_momentum",
    "static_batch",
    "portable",
)


def add(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser(
        "train",
        help="train a model on .npz data and write the trained inference model",
        description="Train an inference model (the training graph is built with the options below) or a "
        "`bnfuse train-graph` output on an .npz file, then write the inference model with the trained weights and "
        "running statistics. Every epoch runs every sample once, shuffled (seed 0 unless --shuffle-seed / "
        "--no-shuffle), in batches of --batch-size with the partial last batch (unless --drop-last). "
        + NPZ_LAYOUT
        + " Exit 2: bad input; 130: interrupted (a checkpoint is saved first).",
    )
    train.add_argument("input", help="inference model (.onnx), or a training graph from `bnfuse train-graph`")
    train.add_argument("--data", required=True, help="training samples (.npz; layout above)")
    train.add_argument("-o", "--output", required=True, help="inference model to write")
    train.add_argument("--epochs", type=int, default=1, help="(default: 1)")
    train.add_argument("--batch-size", type=int, help="samples per step (default: the training graph's, else 32)")
    train.add_argument("--lr", type=float, default=0.01, help="learning rate (default: 0.01)")
    train.add_argument(
        "--lr-schedule",
        choices=("constant", "step", "cosine"),
        default="constant",
        help="per-epoch schedule as torch.optim.lr_scheduler: StepLR(--lr-step-size, --lr-gamma), "
        "CosineAnnealingLR(T_max = epochs - warm-up, eta_min = --min-lr) (default: constant)",
    )
    train.add_argument("--lr-step-size", type=int, default=1, help="step: epochs between decays (default: 1)")
    train.add_argument("--lr-gamma", type=float, default=0.1, help="step: decay factor (default: 0.1)")
    train.add_argument("--min-lr", type=float, default=0.0, help="cosine: final learning rate (default: 0)")
    train.add_argument("--warmup-epochs", type=int, default=0, help="linear warm-up epochs (LinearLR) first")
    train.add_argument(
        "--warmup-start-factor", type=float, default=1 / 3, help="warm-up's first lr as a fraction of --lr (1/3)"
    )
    train.add_argument("--shuffle-seed", type=int, default=0, help="seed of every epoch's sample order (default: 0)")
    train.add_argument("--no-shuffle", action="store_true", help="samples in file order every epoch")
    train.add_argument(
        "--drop-last",
        action="store_true",
        help="skip each epoch's partial last batch (on a distributed graph: each rank trains only full batches of "
        "its contiguous share; default there: every sample once per epoch, in global batches split over the ranks)",
    )
    train.add_argument(
        "--memory",
        choices=("lean", "speed"),
        default="lean",
        help="lean (default): settings that hold less memory per step; speed: onnxruntime's defaults and the weight "
        "gradients on the NCHWc copies (docs/training.md, Memory)",
    )
    train.add_argument(
        "--threads",
        type=int,
        help="onnxruntime intra-op threads (per rank; default: every core, under mpiexec each rank's share of its "
        "machine's cores)",
    )
    train.add_argument("--val-data", metavar="NPZ", help="validation samples (same layout): loss / accuracy per epoch")
    train.add_argument(
        "--val-split", type=float, metavar="FRACTION", help="hold out this fraction of --data for validation"
    )
    train.add_argument(
        "--keep",
        choices=("best", "last"),
        help="write the epoch with the lowest validation loss, or the last (default: best with validation)",
    )
    train.add_argument("--checkpoint-dir", metavar="DIR", help="write a checkpoint after every epoch into DIR")
    train.add_argument("--resume", action="store_true", help="continue the run whose checkpoints are in DIR")
    train.add_argument("--fold", action="store_true", help="fold the trained BN into its producers (bnfuse optimize)")
    train.add_argument(
        "--state-dict",
        metavar="NPZ",
        help="also write the trained parameters and running statistics under the input model's names (.npz; "
        "for a PyTorch export: the module's state_dict names)",
    )
    graph = train.add_argument_group(
        "training graph (with an inference model as input; for more, use `bnfuse train-graph`)"
    )
    graph.add_argument("--loss", choices=("cross-entropy", "mse"), help="(default: cross-entropy)")
    graph.add_argument("--optimizer", choices=("sgd", "adam"), help="(default: sgd)")
    graph.add_argument("--sgd-momentum", type=float, help="SGD momentum (PyTorch semantics; default: 0)")
    graph.add_argument("--nesterov", action="store_true", default=None, help="Nesterov momentum (SGD)")
    graph.add_argument("--weight-decay", type=float, help="L2 weight decay on every parameter (default: 0)")
    graph.add_argument("--bn-momentum", type=float, help="BN running-statistics momentum (default: each node's)")
    graph.add_argument(
        "--static-batch", action="store_true", default=None, help="fix the graph's batch at --batch-size"
    )
    graph.add_argument("--portable", action="store_true", default=None, help="standard ONNX ops only")
    train.add_argument("--momentum", type=float, dest="ambiguous_momentum", help=argparse.SUPPRESS)
    train.add_argument(
        "--no-graph-cache",
        action="store_true",
        help="build the training graph anew and keep no copy (default: kept in the user's cache, BNFUSE_CACHE_DIR or "
        "~/.cache/bnfuse, and reused by the next run with the same model and options; BNFUSE_GRAPH_CACHE=0 turns it "
        "off too)",
    )
    train.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    train.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from bnfuse.training.job import TrainJob
    from bnfuse.training.job import run as run_job

    if args.ambiguous_momentum is not None:
        raise BnfuseError(
            "--momentum: say which: --sgd-momentum M (SGD's momentum) or --bn-momentum M (the BN running statistics')"
        )
    job = TrainJob(
        model=Path(args.input),
        data=Path(args.data),
        output=Path(args.output),
        epochs=args.epochs,
        batch_size=args.batch_size,
        schedule={
            "kind": args.lr_schedule,
            "base": args.lr,
            "step_size": args.lr_step_size,
            "gamma": args.lr_gamma,
            "min_lr": args.min_lr,
            "warmup": args.warmup_epochs,
            "warmup_start_factor": args.warmup_start_factor,
        },
        shuffle_seed=None if args.no_shuffle else args.shuffle_seed,
        drop_last=args.drop_last,
        val_data=Path(args.val_data) if args.val_data else None,
        val_split=args.val_split,
        keep=args.keep,
        checkpoint_dir=Path(args.checkpoint_dir) if args.checkpoint_dir else None,
        resume=args.resume,
        fold=args.fold,
        state_dict=Path(args.state_dict) if args.state_dict else None,
        graph_options={k: getattr(args, k) for k in GRAPH_OPTIONS if getattr(args, k) is not None},
        threads=args.threads,
        memory=args.memory,
        graph_cache=not args.no_graph_cache,
        debug=args.debug or None,  # None: BNFUSE_DEBUG decides
    )
    bar = _TrainBar() if sys.stderr.isatty() else None
    try:
        run_job(job, on_step=bar.update if bar else None)
    finally:
        if bar is not None:
            bar.close()
    return 0


class _TrainBar:
    """One-line progress of an epoch on stderr (cleared before the epoch's summary line)."""

    WIDTH = 30

    def __init__(self) -> None:
        self._drawn = False

    def update(self, epoch: int, done: int, total: int, loss: float) -> None:
        filled = self.WIDTH * done // total
        sys.stderr.write(
            f"\repoch {epoch} [{'#' * filled}{'.' * (self.WIDTH - filled)}] {done}/{total} loss {loss:.4g}"
        )
        if done == total:
            self.close()
        else:
            sys.stderr.flush()
            self._drawn = True

    def close(self) -> None:
        sys.stderr.write("\r" + " " * (self.WIDTH + 50) + "\r")
        sys.stderr.flush()
        self._drawn = False
