"""`bnfuse doctor`: check this machine (bnfuse.doctor)."""

from __future__ import annotations

import argparse


def add(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "doctor",
        help="check this machine: versions, providers, the custom-op library, every op against the reference",
        description="Versions, onnxruntime providers, the custom-op library, every op on every provider against "
        "the float64 reference, CUDA zero-copy / stream (with a GPU) and a bandwidth figure. Exit 0 only if every "
        "check passes.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per bandwidth figure (median)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import json

    from bnfuse.doctor import run_doctor

    report = run_doctor(repeats=max(1, args.repeats))
    print(json.dumps(report.to_json(), indent=2) if args.json else report.format_text())
    return 0 if report.ok else 1
