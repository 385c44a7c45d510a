"""The backward of the network: onnx-ad's reverse mode with bnfuse's rules plugged into its rule table.

onnx-ad (PyPI ``onnx-ad``) keeps one reverse rule per op type in ``onnx_ad.rules.REVERSE``. While it
differentiates a training graph, bnfuse installs (fast_rules.installed) a rule for the training-mode BN
node that emits bnfuse.BatchNormalizationGrad, and faster single-seed rules for Conv and GlobalAveragePool;
every other operator keeps onnx-ad's own, tested rule. The table is restored afterwards.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence

import onnx

from bnfuse.errors import BnfuseError
from bnfuse.passes.training import fast_rules

ADJOINT_PREFIX = "adj."


def reverse(
    model: onnx.ModelProto, parameters: Sequence[str], output: str, *, fast: bool = True, weight_grad_op: bool = False
) -> onnx.ModelProto:
    """The model plus its adjoint graph: new input ``adj.<output>`` (output's shape + [1]) and one output
    ``adj.<p>`` (p's shape + [1]) per parameter. ``fast=False`` keeps onnx-ad's Conv / pooling rules.
    ``weight_grad_op``: convolution weight gradients as bnfuse.ConvWeightGrad where oneDNN is available."""
    try:
        import onnx_ad
    except ImportError as exc:  # pragma: no cover - onnx-ad is a dependency
        raise BnfuseError("the training pass needs onnx-ad (pip install onnx-ad)") from exc
    try:
        with fast_rules.installed(fast=fast, weight_grad_op=weight_grad_op), _no_if_no_inlining():
            return onnx_ad.reverse(
                model, inputs=list(parameters), outputs=[output], prefix=ADJOINT_PREFIX, dim="nseed", layout="onnx"
            )
    except (onnx_ad.UnsupportedOperator, ValueError) as exc:
        raise BnfuseError(f"cannot differentiate the model: {exc}") from exc


@contextlib.contextmanager
def _no_if_no_inlining() -> Iterator[None]:
    """onnx-ad's ``inline_constant_ifs`` (run twice per reverse) infers every shape of the model before it looks for
    an ``If``; for a model without any subgraph it returns the model as it is, so here it is not called at all."""
    modules = [sys.modules[name] for name in ("onnx_ad.reverse", "onnx_ad.expand")]
    saved = [module.inline_constant_ifs for module in modules]

    def inline_constant_ifs(model: onnx.ModelProto) -> onnx.ModelProto:
        return saved[0](model) if _has_subgraphs(model.graph) else model

    for module in modules:
        module.inline_constant_ifs = inline_constant_ifs
    try:
        yield
    finally:
        for module, original in zip(modules, saved, strict=True):
            module.inline_constant_ifs = original


def _has_subgraphs(graph: onnx.GraphProto) -> bool:
    graphs = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
    return any(attribute.type in graphs for node in graph.node for attribute in node.attribute)
