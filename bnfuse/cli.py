"""The `bnfuse` command: a thin shell over the Python API.

User errors (bnfuse.errors.BnfuseError) print one line on stderr and exit 2; `--debug` shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import sys
import warnings
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
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON (every BN listed)")
    parser.add_argument("-v", "--verbose", action="store_true", help="list every BatchNormalization and its proof")
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
    from bnfuse.passes.optimize import default_model_path
    from bnfuse.passes.optimize_file import optimize_file

    source = Path(args.input) if args.input else default_model_path()
    output = Path(args.output) if args.output else Path.cwd() / f"{source.stem}.bnfuse.onnx"
    if args.seed < 0:
        raise BnfuseError(f"--seed {args.seed}: must be a non-negative integer")
    shapes = _parse_input_shapes(args.input_shape)
    bar = _ProgressBar() if sys.stderr.isatty() else None
    try:
        # Model (with its external data) and JSON report are written as one transaction: a failed write of
        # either, or a failed check, leaves neither behind.
        report = optimize_file(
            source,
            output,
            json_path=args.json,
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
    parser = sub.add_parser(
        "train-graph",
        help="turn an inference model into a training graph",
        description="Build a training graph onnxruntime runs: BatchNormalization in training mode (bnfuse custom "
        "ops, or standard ops with --portable), the loss, the backward and an optimizer step, with parameters, "
        "running statistics and optimizer state as inputs and outputs. Exit 2: bad input.",
    )
    parser.add_argument("input", help="inference ONNX model")
    parser.add_argument("-o", "--output", required=True, help="training graph to write")
    parser.add_argument("--loss", choices=("cross-entropy", "mse", "seed"), default="cross-entropy")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--sgd-momentum", type=float, default=0.0, help="SGD momentum (PyTorch semantics)")
    parser.add_argument("--nesterov", action="store_true", help="Nesterov momentum (SGD)")
    parser.add_argument(
        "--weight-decay",
        action=_GroupRule,
        metavar="[GLOB=]WD",
        help="L2 weight decay added to the gradient: WD for every parameter, or GLOB=WD for the parameters "
        "matching GLOB (repeatable; a name glob, @bn for BN scales and biases, @1d for every 1-D parameter)",
    )
    parser.add_argument(
        "--no-decay", action=_GroupRule, metavar="GLOB", help="no weight decay on these parameters (repeatable)"
    )
    parser.add_argument(
        "--lr-mult", action=_GroupRule, metavar="GLOB=X", help="learning rate times X for these parameters (repeatable)"
    )
    parser.add_argument(
        "--trainable", action="append", metavar="PATTERN", help="initializer name or glob to train (repeatable)"
    )
    parser.add_argument("--frozen-bn", action="store_true", help="normalize every BN with its running statistics")
    parser.add_argument(
        "--frozen-bn-node", action="append", default=[], metavar="NAME", help="freeze this BN only (repeatable)"
    )
    parser.add_argument("--fix-gamma", action="store_true", help="BN scale fixed to 1 (MXNet fix_gamma)")
    parser.add_argument("--bn-momentum", type=float, help="BN running-statistics momentum (default: each node's)")
    parser.add_argument("--momentum", type=float, action=_DeprecatedMomentum, help="deprecated: --bn-momentum")
    parser.add_argument("--static-batch", action="store_true", help="fix the batch dimension at --batch-size")
    parser.add_argument(
        "--momentum-convention",
        default=None,
        help="onnx|mxnet: running*m + batch*(1-m); pytorch|mindspore|cudnn: running*(1-m) + batch*m; cumulative: "
        "cumulative moving average (PyTorch momentum=None). Default: node attributes (in a PyTorch export, "
        "momentum 1.0 means momentum=None: cumulative)",
    )
    parser.add_argument(
        "--unbiased-running-var",
        action="store_const",
        const=True,
        default=None,
        help="running variance from the unbiased batch variance (default under pytorch / cudnn / cumulative "
        "and for PyTorch exports)",
    )
    parser.add_argument(
        "--biased-running-var",
        dest="unbiased_running_var",
        action="store_const",
        const=False,
        help="running variance from the biased batch variance (default otherwise)",
    )
    parser.add_argument(
        "--dropout",
        choices=("train", "off"),
        default="train",
        help="the model's Dropout nodes: drop while training (default; seeded) or stay the identity",
    )
    parser.add_argument("--dropout-seed", type=int, default=0, help="seed of the first Dropout node (then +1 each)")
    parser.add_argument(
        "--batch-size",
        type=int,
        help="the graph's batch size: the default of `bnfuse train` (the batch dimension stays dynamic), or the "
        "only one with --static-batch",
    )
    parser.add_argument("--input-shape", action="append", default=[], metavar="NAME:DIMS")
    parser.add_argument("--loss-output", metavar="NAME", help="model output the loss is computed on (default: first)")
    parser.add_argument("--portable", action="store_true", help="standard ONNX ops only (no bnfuse library needed)")
    parser.add_argument(
        "--fuse-relu",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="BN -> Relu as the BN ops' fused activation (default on; --no-fuse-relu keeps the Relu nodes)",
    )
    parser.add_argument(
        "--standard-optimizer",
        action="store_true",
        help="the optimizer update as standard ONNX nodes per parameter instead of one bnfuse.SGDStep / AdamStep",
    )
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="data-parallel step for `mpiexec -n N bnfuse train`: synchronized BN, gradients all-reduced in the "
        "graph, loss over the global batch (--batch-size is then the per-rank batch)",
    )
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    parser.set_defaults(handler=_run_train_graph)

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
    train.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    train.set_defaults(handler=_run_train)


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


class _DeprecatedMomentum(argparse.Action):
    """--momentum: the BN statistics' momentum, now --bn-momentum (it was too easily taken for SGD's)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        print(
            f"{parser.prog}: warning: --momentum is deprecated: it sets the BN running-statistics momentum, now "
            "spelled --bn-momentum (SGD's momentum is --sgd-momentum)",
            file=sys.stderr,
        )
        namespace.bn_momentum = values


class _GroupRule(argparse.Action):
    """--no-decay GLOB, --weight-decay [GLOB=]WD, --lr-mult GLOB=X: kept in command-line order (last match wins),
    checked by the handler so that a bad one is a one-line error."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        namespace.group_rules = [*getattr(namespace, "group_rules", []), (option_string, values)]


def _group_rules(args: argparse.Namespace) -> tuple[float, list]:
    """(global weight decay, parameter-group rules) from the command line's group options."""
    from bnfuse.passes.training.groups import GroupRule, parse_rule

    decay, rules = 0.0, []
    for option, text in getattr(args, "group_rules", []):
        if option == "--no-decay":
            rules.append(GroupRule(text, weight_decay=0.0))
        elif option == "--lr-mult":
            rules.append(parse_rule(text, "lr_scale"))
        elif "=" in text:
            rules.append(parse_rule(text, "weight_decay"))
        else:
            try:
                decay = float(text)
            except ValueError:
                raise BnfuseError(f"--weight-decay: expected WD or GLOB=WD, got {text!r}") from None
    return decay, rules


def _run_train_graph(args: argparse.Namespace) -> int:
    from pathlib import Path

    from bnfuse.io import check_destinations, read_model_files, save_model
    from bnfuse.passes.training import SGD, Adam, build_training_graph

    source, output = Path(args.input), Path(args.output)
    _, files = read_model_files(source, check=False)
    check_destinations({"output model": output}, files, possible={"output's data file": _data_file(output)})
    weight_decay, rules = _group_rules(args)
    if args.optimizer == "sgd":
        optimizer = SGD(momentum=args.sgd_momentum, weight_decay=weight_decay, nesterov=args.nesterov)
    else:
        optimizer = Adam(weight_decay=weight_decay)
    model, report = build_training_graph(
        source,
        loss=args.loss,
        optimizer=optimizer,
        trainable=args.trainable,
        frozen_bn=args.frozen_bn_node or args.frozen_bn,
        fix_gamma=args.fix_gamma,
        momentum=args.bn_momentum,
        momentum_convention=args.momentum_convention,
        unbiased_running_var=args.unbiased_running_var,
        param_groups=rules,
        dropout=args.dropout,
        dropout_seed=args.dropout_seed,
        batch_size=args.batch_size,
        input_shapes=_parse_input_shapes(args.input_shape),
        output=args.loss_output,
        portable=args.portable,
        fuse_relu=args.fuse_relu,
        fused_optimizer=not args.standard_optimizer,
        static_batch=args.static_batch,
    )
    if args.distributed:
        from bnfuse.passes.training.distribute import distribute_training_graph

        model, distributed = distribute_training_graph(model)
    try:
        save_model(model, output)
    except OSError as exc:
        raise BnfuseError(f"cannot write {exc.filename or output}: {exc.strerror or exc}") from exc
    print(report.format_text())
    if args.distributed:
        print(distributed.format_text())
    print(f"wrote {output}")
    return 0


def _run_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from bnfuse.training.job import TrainJob, run

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
        debug=args.debug or None,  # None: BNFUSE_DEBUG decides
    )
    bar = _TrainBar() if sys.stderr.isatty() else None
    try:
        run(job, on_step=bar.update if bar else None)
    finally:
        if bar is not None:
            bar.close()
    return 0


def _data_file(output: object) -> object:
    from pathlib import Path

    path = Path(str(output))
    return path.with_name(f"{path.name}.data")


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


# --- recalibrate ---------------------------------------------------------------------------------


def _add_recalibrate(sub: argparse._SubParsersAction) -> None:
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
    parser.set_defaults(handler=_run_recalibrate)


def _run_recalibrate(args: argparse.Namespace) -> int:
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


# --- models -------------------------------------------------------------------------------------


def _add_models(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "models",
        help="list or write the built-in test networks",
        description="Realistic test networks (random weights, calibrated BN statistics) written as ONNX.",
    )
    actions = parser.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="list the networks")
    listing.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    write = actions.add_parser(
        "write", help="write one network as an ONNX file", description="Build a network and save it (atomically)."
    )
    write.add_argument("name", help="network name (see `bnfuse models list`)")
    write.add_argument("output", help="output .onnx path")
    write.add_argument("--opset", type=int, default=17, help="ONNX opset (default: 17)")
    write.add_argument("--dtype", choices=("float32", "float16"), default="float32", help="(default: float32)")
    write.add_argument("--batch", type=int, help="fixed batch size (default: a dynamic batch dimension)")
    write.add_argument("--size", type=int, help="input size: pixels, samples or features (default: per network)")
    write.add_argument("--width", type=float, default=1.0, help="channel multiplier (default: 1.0)")
    write.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    write.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    parser.set_defaults(handler=_run_models)


def _run_models(args: argparse.Namespace) -> int:
    from bnfuse.models import REGISTRY, parameter_bytes, parameter_count, write

    if args.models_command == "list":
        for spec in REGISTRY.values():
            print(f"{spec.name:<12} {spec.description} (default size {spec.size} {spec.unit})")
        return 0
    options = {"opset": args.opset, "dtype": args.dtype, "batch": args.batch, "width": args.width, "seed": args.seed}
    if args.size is not None:
        options["size"] = args.size
    try:
        model, path = write(args.name, args.output, **options)
    except OSError as exc:
        raise BnfuseError(f"cannot write {args.output}: {exc.strerror or exc}") from exc
    print(
        f"wrote {path}: {args.name}, {parameter_count(model):,} parameters, "
        f"{parameter_bytes(model) / 1e6:.1f} MB {args.dtype}, opset {args.opset}"
    )
    return 0


# --- runtime ------------------------------------------------------------------------------------


def _add_runtime(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("library-path", help="print the onnxruntime custom-op library path")
    parser.set_defaults(handler=_run_library_path)


def _run_library_path(args: argparse.Namespace) -> int:
    from bnfuse.runtime import library_path

    print(library_path())
    return 0


# --- doctor ------------------------------------------------------------------------------------


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "doctor",
        help="check this machine: versions, providers, the custom-op library, every op against the reference",
        description="Versions, onnxruntime providers, the custom-op library, every op on every provider against "
        "the float64 reference, CUDA zero-copy / stream (with a GPU) and a bandwidth figure. Exit 0 only if every "
        "check passes.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per bandwidth figure (median)")
    parser.set_defaults(handler=_run_doctor)


def _run_doctor(args: argparse.Namespace) -> int:
    import json

    from bnfuse.doctor import run_doctor

    report = run_doctor(repeats=max(1, args.repeats))
    print(json.dumps(report.to_json(), indent=2) if args.json else report.format_text())
    return 0 if report.ok else 1


# --- entry point --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bnfuse", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_optimize, _add_training, _add_recalibrate, _add_models, _add_runtime, _add_doctor):
        add(sub)
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
