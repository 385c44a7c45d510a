"""onnx-graphsurgeon graphs in and out: the registry's models as gs.Graph, and the fold pass on a gs.Graph."""

from __future__ import annotations

from typing import Any

import onnx_graphsurgeon as gs

from bnfuse.passes.report import Report


def build_graph(name: str, **options: object) -> gs.Graph:
    """A registered model as an onnx-graphsurgeon graph."""
    from bnfuse.models.registry import build

    return gs.import_onnx(build(name, **options))


def optimize_graph(graph: gs.Graph, **kwargs: Any) -> tuple[gs.Graph, Report]:
    """``bnfuse.optimize`` for a gs.Graph (which takes gs.Graph itself; kept for existing callers).

    The graph is exported (not modified), folded, and imported back. Keyword arguments are optimize's.
    """
    from bnfuse.passes.optimize import optimize

    return optimize(graph, **kwargs)
