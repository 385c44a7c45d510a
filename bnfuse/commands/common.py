"""What more than one subcommand parses."""

from __future__ import annotations

from collections.abc import Sequence

from bnfuse.errors import BnfuseError


def parse_input_shapes(specs: Sequence[str]) -> dict[str, list[int]]:
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
