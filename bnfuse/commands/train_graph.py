"""`bnfuse train-graph`: turn an inference model into a training graph (bnfuse.passes.training)."""

from __future__ import annotations

import argparse
import sys

from bnfuse.commands.common import parse_input_shapes
from bnfuse.errors import BnfuseError


def add(sub: argparse._SubParsersAction) -> None:
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
    parser.add_argument(
        "--nchwc",
        action="store_true",
        help="write the convolutions in onnxruntime's blocked layout for this CPU (what TrainingSession does at run "
        "time): any onnxruntime host with bnfuse's library runs the file at full speed, on CPUs of the same block",
    )
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    parser.set_defaults(handler=run)


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


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from bnfuse.io import check_destinations, read_model_files, save_model
    from bnfuse.passes.training import SGD, Adam, build_training_graph

    source, output = Path(args.input), Path(args.output)
    if args.nchwc and (args.distributed or args.portable):
        raise BnfuseError(
            f"--nchwc and --{'distributed' if args.distributed else 'portable'}: not together (the "
            "layout is onnxruntime's CPU one; a distributed session rewrites it at run time)"
        )
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
        input_shapes=parse_input_shapes(args.input_shape),
        output=args.loss_output,
        portable=args.portable,
        fuse_relu=args.fuse_relu,
        fused_optimizer=not args.standard_optimizer,
        static_batch=args.static_batch,
        nchwc=args.nchwc,
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


def _data_file(output: object) -> object:
    from pathlib import Path

    path = Path(str(output))
    return path.with_name(f"{path.name}.data")
