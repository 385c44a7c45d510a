"""onnx-graphsurgeon graphs in and out: the registry's models as gs.Graph, and the fold pass on a gs.Graph."""

from __future__ import annotations

from typing import Any

import onnx_graphsurgeon as gs

from bnfuse.io import ort_compatible
from bnfuse.passes.report import Report


def build_graph(name: str, **options: object) -> gs.Graph:
    """A registered model as an onnx-graphsurgeon graph."""
    from bnfuse.models.registry import build

    return gs.import_onnx(build(name, **options))


def optimize_graph(graph: gs.Graph, **kwargs: Any) -> tuple[gs.Graph, Report]:
    """``bnfuse.optimize`` for a gs.Graph: the graph is exported (not modified), folded, and imported back.

    Keyword arguments are optimize's (standalone, check, input_shapes, ...).
    """
    from bnfuse.passes.optimize import optimize

    model = ort_compatible(gs.export_onnx(graph, do_type_check=False))
    optimized, report = optimize(model, **kwargs)
    return gs.import_onnx(optimized), report
