"""The `bnfuse` command: a thin shell over the Python API.

User errors (bnfuse.errors.BnfuseError) print one line on stderr and exit 2; `--debug` shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

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
    parser.add_argument("--momentum", type=float, help="BN running-statistics momentum (default: each node's)")
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
    parser.add_argument("--batch-size", type=int, help="static batch size for a dynamic batch dimension")
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
        help="train a training graph on .npz data and write the trained inference model",
        description="Run SGD / Adam steps of a `bnfuse train-graph` model over an .npz file (arrays named like "
        "the data inputs, or 'x', and 'labels'), then write the inference model with the trained weights and "
        "running statistics (folded by bnfuse optimize with --fold). Exit 2: bad input.",
    )
    train.add_argument("input", help="training graph from `bnfuse train-graph`")
    train.add_argument("--data", required=True, help=".npz with the inputs and 'labels'")
    train.add_argument("-o", "--output", required=True, help="inference model to write")
    train.add_argument("--epochs", type=int, default=1)
    train.add_argument("--lr", type=float, default=0.01, help="learning rate (default: 0.01)")
    train.add_argument("--shuffle-seed", type=int, help="shuffle the samples every epoch with this seed")
    train.add_argument("--fold", action="store_true", help="fold the trained BN into its producers (bnfuse optimize)")
    from bnfuse.training import memory

    train.add_argument(
        "--memory",
        choices=memory.MODES,
        default=memory.DEFAULT,
        help="lean (default): settings that hold less memory per step; speed: onnxruntime's defaults and the weight "
        "gradients on the NCHWc copies (docs/training.md, Memory)",
    )
    train.add_argument(
        "--state-dict",
        metavar="NPZ",
        help="also write the trained parameters and running statistics under the input model's names (.npz; "
        "for a PyTorch export: the module's state_dict names)",
    )
    train.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    train.set_defaults(handler=_run_train)


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
        momentum=args.momentum,
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

    from bnfuse.io import check_destinations, read_model_files
    from bnfuse.passes.training.distribute import is_distributed
    from bnfuse.training.session import TrainingSession

    if args.epochs < 1:
        raise BnfuseError("--epochs must be >= 1")
    if args.state_dict and not args.state_dict.endswith(".npz"):
        raise BnfuseError(f"--state-dict {args.state_dict}: the state dict is written as .npz")
    model, files = read_model_files(args.input, check=False)
    output = Path(args.output)
    state_dict = Path(args.state_dict) if args.state_dict else None
    check_destinations(
        {"output model": output, "state dict": state_dict},
        files,
        possible={"output's data file": _data_file(output)},
        other_inputs={"training data": Path(args.data)},
    )
    classes = _classes(model)
    if not is_distributed(model):
        return _train(args, TrainingSession(model, lr=args.lr, memory=args.memory), None, classes)
    from bnfuse.training import distributed

    comm = distributed.communicator()  # under mpiexec: every rank; alone: a world of one
    distributed.abort_on_error(comm)
    try:
        return _train(args, TrainingSession(model, lr=args.lr, comm=comm, memory=args.memory), comm, classes)
    except BnfuseError as exc:
        if comm.size == 1:
            raise
        distributed.report_and_abort(comm, exc)  # one rank's bad input ends every rank, never a hang
        return 2


def _train(args: argparse.Namespace, session: Any, comm: Any, classes: int | None) -> int:
    """The training loop; with ``comm``, this rank's shard of every epoch, and only rank 0 prints and writes."""
    from pathlib import Path

    import numpy as np

    from bnfuse.io import save_model

    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    lead = rank == 0
    spec = session.spec
    try:
        with np.load(args.data) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as exc:
        raise BnfuseError(f"{args.data}: not a readable .npz file ({exc})") from exc
    inputs = _training_arrays(arrays, spec.data, spec.targets[0])
    _check_labels(inputs[spec.targets[0]], spec.loss_kind, classes)
    count = len(next(iter(inputs.values())))
    batch = session.batch_size
    if count // size < batch:
        per_rank = f" per rank ({size} ranks)" if size > 1 else ""
        raise BnfuseError(f"{args.data}: {count // size} samples{per_rank}, fewer than the graph's batch size {batch}")
    steps = (count // size) // batch  # the same on every rank: each shard holds at least count // size samples
    rng = np.random.default_rng(args.shuffle_seed) if args.shuffle_seed is not None else None
    bar = _TrainBar(steps) if sys.stderr.isatty() and lead else None
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(count) if rng is not None else np.arange(count)  # same seed: same on every rank
        if comm is not None:
            from bnfuse.training.distributed import shard

            order = order[shard(count, rank, size)]
        losses = []
        for step in range(steps):
            index = order[step * batch : (step + 1) * batch]
            feeds = {name: value[index] for name, value in inputs.items() if name in spec.data}
            losses.append(session.step(feeds, inputs[spec.targets[0]][index]))
            if not np.isfinite(losses[-1]):
                if bar is not None:
                    bar.close()
                raise BnfuseError(
                    f"epoch {epoch}, step {step + 1}: the loss is {losses[-1]} (NaN or infinite data, or too large "
                    f"a learning rate); stopped, nothing written"
                )
            if bar is not None:
                bar.update(epoch, step + 1, losses[-1])
        if bar is not None:
            bar.close()
        if lead:
            print(f"epoch {epoch}/{args.epochs}: mean loss {float(np.mean(losses)):.6g} over {steps} steps")
    if not lead:
        return 0
    model = session.export_inference_model()
    if args.state_dict:
        _save_npz(session.state_dict(), args.state_dict)
        print(f"wrote {args.state_dict}")
    if args.fold:
        from bnfuse.passes.optimize import optimize

        model, report = optimize(model)
        print(report.format_text())
    try:
        save_model(model, Path(args.output))
    except OSError as exc:
        raise BnfuseError(f"cannot write {exc.filename or args.output}: {exc.strerror or exc}") from exc
    print(f"wrote {args.output}")
    return 0


def _save_npz(arrays: dict, target: str) -> None:
    """np.savez to a temporary file renamed into place (nothing partial is left)."""
    import os
    import tempfile
    from pathlib import Path

    import numpy as np

    path, temporary = Path(target), None
    try:
        handle, temporary = tempfile.mkstemp(suffix=".npz", dir=path.parent)
        with os.fdopen(handle, "wb") as stream:
            np.savez(stream, **arrays)
        os.replace(temporary, path)
    except OSError as exc:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
        raise BnfuseError(f"cannot write {path}: {exc.strerror or exc}") from exc


def _classes(model: object) -> int | None:
    """The class count of a cross-entropy training graph (its one-hot depth), None for other losses."""
    for tensor in model.graph.initializer:  # type: ignore[attr-defined]
        if tensor.name == "loss/depth":
            from onnx import numpy_helper

            return int(numpy_helper.to_array(tensor))
    return None


def _check_labels(labels: object, loss_kind: str, classes: int | None) -> None:
    """BnfuseError unless the labels suit the loss: class indices in [0, classes), or finite targets."""
    import numpy as np

    values = np.asarray(labels)
    if values.dtype.kind not in "biuf":
        raise BnfuseError(f"labels: expected numbers, got an array of {values.dtype}")
    if loss_kind == "cross-entropy" and classes is not None:
        integral = values.dtype.kind in "biu" or bool(np.all(np.isfinite(values) & (values == np.round(values))))
        bad = ~((values >= 0) & (values < classes)) if integral else ~np.isfinite(values) | (values != values // 1)
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise BnfuseError(
                f"labels: {values[where].item()!r} at {list(where)} is not a class index in [0, {classes}) "
                f"({int(bad.sum())} such labels)"
            )
    elif values.dtype.kind == "f" and not np.isfinite(values).all():
        where = tuple(int(i) for i in np.argwhere(~np.isfinite(values))[0])
        raise BnfuseError(f"labels: {values[where].item()!r} at {list(where)} is not finite")


def _data_file(output: object) -> object:
    from pathlib import Path

    path = Path(str(output))
    return path.with_name(f"{path.name}.data")


def _training_arrays(arrays: dict, data: Sequence[str], target: str) -> dict:
    """The .npz arrays by input name: data inputs by name (a single one may be 'x'), the target as 'labels'."""
    result = {}
    for name in data:
        key = name if name in arrays else ("x" if len(data) == 1 and "x" in arrays else None)
        if key is None:
            raise BnfuseError(f"data file has no array {name!r} (arrays: {', '.join(sorted(arrays))})")
        result[name] = arrays[key]
    key = target if target in arrays else ("labels" if "labels" in arrays else None)
    if key is None:
        raise BnfuseError(f"data file has no array 'labels' (arrays: {', '.join(sorted(arrays))})")
    result[target] = arrays[key]
    counts = {len(v) for v in result.values()}
    if len(counts) != 1:
        raise BnfuseError("data file arrays have different sample counts")
    return result


class _TrainBar:
    """One-line progress of an epoch on stderr."""

    WIDTH = 30

    def __init__(self, total: int) -> None:
        self.total = total

    def update(self, epoch: int, done: int, loss: float) -> None:
        filled = self.WIDTH * done // self.total
        sys.stderr.write(
            f"\repoch {epoch} [{'#' * filled}{'.' * (self.WIDTH - filled)}] {done}/{self.total} loss {loss:.4g}"
        )
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\r" + " " * (self.WIDTH + 50) + "\r")
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
    parser = argparse.ArgumentParser(prog="bnfuse", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_optimize, _add_training, _add_models, _add_runtime, _add_doctor):
        add(sub)
    return parser


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
        print(f"bnfuse {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bnfuse: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
