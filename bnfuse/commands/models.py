"""`bnfuse models`: list or write the built-in test networks (bnfuse.models)."""

from __future__ import annotations

import argparse

from bnfuse.errors import BnfuseError


def add(sub: argparse._SubParsersAction) -> None:
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
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
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
