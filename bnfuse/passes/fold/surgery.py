"""The base of a fold's graph surgery: reading constants, computing in float64 for float16 / bfloat16, writing
new constants, retiring nodes, recording outcomes.

One GraphSurgery per graph; the folds (producers, layout, backward, forward, moves, qdq: functions taking it)
read and edit the graph through it, and graph.py decides per BN which of their plans to apply.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from bnfuse.attributes import float_attribute
from bnfuse.passes.constants import release_mapped
from bnfuse.passes.fold import fold_math
from bnfuse.passes.fold.context import (
    BN_PARAMS,
    EXACT_ELEMENTS,
    FLOAT_DTYPES,
    LOW_PRECISION_DTYPES,
    FoldContext,
    NotFoldable,
    Producer,
    describe,
    has_input,
)
from bnfuse.passes.report import BatchNormRecord


class GraphSurgery:
    """Edits of one graph; replaced nodes are swapped out of graph.nodes once, at the end."""

    def __init__(self, graph: gs.Graph, ctx: FoldContext, graph_path: str) -> None:
        self.graph = graph
        self.ctx = ctx
        self.path = graph_path
        self.outputs = {id(t) for t in graph.outputs}
        self.own_nodes = {id(n) for n in graph.nodes}
        self.replaced: dict[int, list[gs.Node]] = {}
        self.renamed: list[tuple[gs.Tensor, str]] = []  # (tensor, suffix): renamed at commit
        self.pending: dict[int, np.ndarray] = {}  # id(rounded array) -> its float64 values, until written
        self.current_reset = False

    def forget_pending(self) -> None:
        """Drop the float64 values of folds planned but not made (the direction not taken)."""
        self.pending.clear()

    # ----- reading constants --------------------------------------------------------------------

    def require_private(self, tensor: gs.Tensor, node: gs.Node) -> None:
        """Folding rewrites ``tensor``'s producer, so nothing else may see the old values."""
        if id(node) not in self.own_nodes:
            raise NotFoldable(f"producer of '{tensor.name}' lives in an enclosing graph")
        if id(tensor) in self.outputs:
            raise NotFoldable(f"producer output '{tensor.name}' is a graph output")
        if len(tensor.outputs) != 1:
            raise NotFoldable(f"producer output '{tensor.name}' has {len(tensor.outputs)} consumers")

    def _budget_note(self, tensor: gs.Tensor | None) -> str:
        """Why a constant-looking tensor is not constant: the expansion budget, when that is the reason."""
        over = self.ctx.resolver.over_budget
        pending, seen = [tensor], 0
        while over and pending and seen < 32:  # the small constant subgraph that feeds it
            current = pending.pop()
            seen += 1
            if current is None:
                continue
            if current.name in over:
                budget = self.ctx.resolver.budget_bytes / 2**20
                return f" (expanding its constant subgraph would pass the {budget:.0f} MiB budget)"
            pending += [t for producer in current.inputs for t in producer.inputs]
        return ""

    def float_constant(self, node: gs.Node, index: int, label: str) -> np.ndarray:
        value = self.ctx.resolver.value(node.inputs[index]) if index < len(node.inputs) else None
        if value is None:
            tensor = node.inputs[index] if index < len(node.inputs) else None
            raise NotFoldable(f"{node.op} {describe(node)} {label} is not constant{self._budget_note(tensor)}")
        if np.dtype(value.dtype) not in FLOAT_DTYPES:
            raise NotFoldable(f"{node.op} {describe(node)} {label} has dtype {value.dtype}")
        return value

    def constant_params(self, bn: gs.Node) -> list[np.ndarray]:
        if len(bn.inputs) != 5:
            raise NotFoldable(f"expected 5 inputs, got {len(bn.inputs)}")
        params = []
        for label, tensor in zip(BN_PARAMS, bn.inputs[1:], strict=True):
            value = self.ctx.resolver.value(tensor)
            if value is None:
                quantized = tensor.inputs[0].op == "DequantizeLinear" if len(tensor.inputs) == 1 else False
                note = " (a quantized parameter: DequantizeLinear is not folded)" if quantized else ""
                raise NotFoldable(f"{label} '{tensor.name}' is not constant{note}{self._budget_note(tensor)}")
            params.append(value)
        return params

    def input_spread(self, bn: gs.Node) -> fold_math.InputSpread:
        _, _, mean, var = self.constant_params(bn)
        return fold_math.input_spread(mean, var, float_attribute(bn.attrs, "epsilon", 1e-5))

    def require_inference_dropout(self, node: gs.Node) -> None:
        if node.op != "Dropout":
            return
        if len(node.inputs) > 2 and node.inputs[2].name:
            training = self.ctx.resolver.value(node.inputs[2])
            if training is None or bool(np.asarray(training).reshape(-1)[0]):
                raise NotFoldable(f"{describe(node)} may run in training mode")
        if any(t.name and (t.outputs or id(t) in self.ctx.graph_outputs) for t in node.outputs[1:]):
            raise NotFoldable(f"{describe(node)} mask is used")

    # ----- float16 / bfloat16: every folded value rounded once ------------------------------------------

    def exact(self, tensor: gs.Tensor | None, values: np.ndarray, dtype: np.dtype) -> np.ndarray:
        """What a fold computes from: ``values`` as they are, or (float16 / bfloat16) in float64, exactly as an
        earlier fold computed them where one did."""
        if dtype not in LOW_PRECISION_DTYPES:
            return values
        entry = self.ctx.exact.get(id(tensor)) if tensor is not None else None
        if entry is not None and entry[0] is tensor and entry[1].shape == np.shape(values):
            exact = entry[1]
            if np.array_equal(exact.astype(dtype), values):  # what the constant holds is its rounding
                return exact
        return np.asarray(values, dtype=np.float64)

    def rounded(self, values: np.ndarray | None, dtype: np.dtype) -> np.ndarray | None:
        """``values`` in the model's ``dtype`` (checked), remembering float64 ones until set_constant writes them."""
        if values is None or np.dtype(values.dtype) == dtype:
            return values
        rounded = fold_math.rounded(values, dtype)
        if values.size <= EXACT_ELEMENTS:
            self.pending[id(rounded)] = values
        return rounded

    # ----- writing ------------------------------------------------------------------------------

    def bias_tensor(self, producer: Producer) -> gs.Tensor | None:
        node = producer.node
        if producer.kind == "MatMul":
            holder = producer.bias_node
            if holder is None:
                return None
            return holder.inputs[0] if self.ctx.resolver.value(holder.inputs[0]) is not None else holder.inputs[1]
        return node.inputs[2] if has_input(node, 2) else None

    def write_in_place(self, producer: Producer, weight: np.ndarray, bias: np.ndarray | None) -> None:
        """New constants for a producer that keeps writing its output tensor (no new node)."""
        node = producer.node
        self.set_constant(node, 1, weight)
        if bias is None:
            return
        if producer.kind == "MatMul":
            holder = producer.bias_node
            self.set_constant(holder, 0 if self.ctx.resolver.value(holder.inputs[0]) is not None else 1, bias)
            return
        if producer.kind == "Gemm":
            node.attrs["beta"] = 1.0
        self.set_constant(node, 2, bias)

    def write(self, producer: Producer, weight: np.ndarray, bias: np.ndarray | None, consumer: gs.Node) -> None:
        """New constants, and the producer (or its bias Add) writes ``consumer``'s output instead of it."""
        node = producer.node
        new_add = producer.kind == "MatMul" and producer.bias_node is None and bias is not None
        if new_add:
            self.set_constant(node, 1, weight)
            output_node = self._new_bias_add(node, bias)
        else:
            self.write_in_place(producer, weight, bias)
            output_node = producer.bias_node if producer.kind == "MatMul" and producer.bias_node else node
        result = consumer.outputs[0]
        self.ctx.superseded[producer.output.name] = result.name
        self.retire(consumer, [output_node] if new_add else [])
        if new_add:
            output_node.outputs.append(result)
        else:
            output_node.outputs[0] = result

    def _new_bias_add(self, matmul: gs.Node, bias: np.ndarray) -> gs.Node:
        base = matmul.name or matmul.outputs[0].name
        constant = gs.Constant(self.ctx.fresh_name(f"{base}_bias"), bias)
        self.ctx.written.add(constant.name)
        self.keep_exact(constant, self.pending.pop(id(bias), None))
        add = gs.Node("Add", self.ctx.fresh_name(f"{base}_bias_add"), inputs=[matmul.outputs[0], constant])
        self.own_nodes.add(id(add))
        return add

    def append_bias_add(self, node: gs.Node, bias: np.ndarray) -> gs.Node:
        """node -> fresh tensor -> Add(bias) -> node's old output, placed right after ``node``."""
        out = node.outputs[0]
        base = node.name or out.name
        product = gs.Variable(self.ctx.fresh_name(f"{base}_product"), dtype=out.dtype, shape=out.shape)
        node.outputs[0] = product
        constant = gs.Constant(self.ctx.fresh_name(f"{base}_bias"), bias)
        self.ctx.written.add(constant.name)
        self.keep_exact(constant, self.pending.pop(id(bias), None))
        add = gs.Node("Add", self.ctx.fresh_name(f"{base}_bias_add"), inputs=[product, constant], outputs=[out])
        self.replaced[id(node)] = [node, add]
        self.own_nodes.add(id(add))  # a BN after it may fold backward into it
        return add

    def set_constant(self, node: gs.Node, index: int, values: np.ndarray) -> None:
        """Give ``node`` new constant values at input ``index``: edit a private initializer, clone a shared one.

        Shared means read by another node (gs counts consumers in subgraphs too) or returned as an output of
        any graph, where the caller would see the folded values.
        """
        current = node.inputs[index] if has_input(node, index) else None
        if current is not None:
            self.ctx.rewritten.add(current.name)
        private = (
            isinstance(current, gs.Constant)
            and len(current.outputs) == 1
            and id(current) not in self.outputs
            and id(current) not in self.ctx.graph_outputs
        )
        exact = self.pending.pop(id(values), None)
        if private:
            release_mapped(current)  # the old weights were read for the last time
            current.values = values
            self.ctx.resolver.forget(current)
            self.ctx.written.add(current.name)
            self.keep_exact(current, exact)
            return
        base = current.name if current is not None else f"{node.name or node.outputs[0].name}_bias"
        fresh = gs.Constant(self.ctx.fresh_name(f"{base}_bnfuse" if current is not None else base), values)
        self.ctx.written.add(fresh.name)
        self.keep_exact(fresh, exact)
        if index < len(node.inputs):
            node.inputs[index] = fresh
        else:
            node.inputs.extend([gs.Variable.empty()] * (index - len(node.inputs)) + [fresh])

    def keep_exact(self, constant: gs.Constant, exact: np.ndarray | None) -> None:
        if exact is None:
            self.ctx.exact.pop(id(constant), None)
        else:
            self.ctx.exact[id(constant)] = (constant, exact)

    def take_output(self, node: gs.Node, consumer: gs.Node, *, changed: list[gs.Tensor], index: int = 0) -> None:
        """``node`` now writes ``consumer``'s output as its output ``index`` (the map moved into its producer);
        ``consumer`` goes.

        ``changed``: the producer outputs written in place, which now hold other values under their old
        names. Each is superseded by the result (the first tensor holding the same values in both models)
        and renamed at commit, so that no name means one thing in the original and another here: a BN folded
        into that producer earlier is then proven on the result, not on a tensor whose meaning changed.
        """
        result = consumer.outputs[0]
        self.ctx.superseded[node.outputs[index].name] = result.name
        for tensor in changed:
            self.ctx.superseded[tensor.name] = result.name
            self.renamed.append((tensor, "_refolded"))
        self.retire(consumer, [])
        node.outputs[index] = result

    def retire(self, node: gs.Node, replacements: list[gs.Node]) -> None:
        """Disconnect ``node``; ``replacements`` take its place in the node order."""
        node.inputs.clear()
        node.outputs.clear()
        self.replaced[id(node)] = replacements

    def commit(self) -> None:
        for tensor, suffix in self.renamed:
            tensor.name = self.ctx.fresh_name(f"{tensor.name}{suffix}")
        if not self.replaced:
            return
        nodes: list[gs.Node] = []
        for node in self.graph.nodes:
            nodes.extend(self.replaced.get(id(node), [node]))
        self.graph.nodes = nodes

    def record(
        self,
        node: str,
        status: str,
        *,
        into: str | None = None,
        reason: str | None = None,
        direction: str | None = None,
        output: str | None = None,
    ) -> None:
        record = BatchNormRecord(node, self.path, status, into=into, reason=reason, direction=direction, output=output)
        record.reset_from_training = self.current_reset
        self.ctx.records.append(record)
