"""Structural re-parameterization: an Add / Sum of linear branches of one tensor becomes one Conv.

RepVGG, MobileOne, ACNet, DBB, RepGhost, RepViT, FastViT ... train with parallel branches (a k x k Conv [+ BN], a 1 x 1
Conv [+ BN], a BN or the input itself, an AveragePool, 1 x 1 -> k x k pairs, per-channel scales) summed, and
deploy the sum as one Conv. A model exported without its author's ``reparameterize()`` keeps every branch; this
pass merges them (the math is reparam_math's, in float64, rounded once to the model's dtype).

Per Add / Sum tree (Adds, Sums, Subs, Identity nodes and Muls by a constant over a sum, FastViT's layer scale,
whose outputs nothing else reads; a term keeps the factor the tree multiplies it by), each term is traced back
through the branch ops (Conv with constant weights, inference BN, Mul / Add / Sub / Div by a per-channel
constant, AveragePool, constant-mode Pad, Identity, inference Dropout) while the tensor it reads is private to the
branch (one reader, not a graph output). Terms that start from the same tensor and include a Conv are merged: the
new Conv reads that tensor and writes the tree's output (or, where other terms remain, a new tensor the remaining
Adds read). A merge that would not be exact, or would cost more multiply-adds than its branches, is refused with
the reason.

It runs before the BN folds of the same graph, so a BN after the sum (RepViT) then folds into the merged Conv.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from bnfuse.attributes import float_attribute
from bnfuse.passes.fold import fold_math, reparam_math
from bnfuse.passes.fold.context import (
    EXACT_ELEMENTS,
    FLOAT_DTYPES,
    LOW_PRECISION_DTYPES,
    FoldContext,
    describe,
    is_default_domain,
    per_channel_vector,
)
from bnfuse.passes.fold.fold_math import InvalidStatisticsError
from bnfuse.passes.fold.reparam_math import Kernel, NotMergeable
from bnfuse.passes.report import BatchNormRecord, MergeRecord

SUM_OPS = ("Add", "Sum", "Sub")
AFFINE_STEPS = ("Mul", "Add", "Sub", "Div")
TRANSPARENT = ("Identity", "Dropout")


@dataclass
class _Branch:
    """One term of the sum: the nodes from ``root`` (the tensor it reads) to ``leaf`` (what the sum reads)."""

    leaf: gs.Tensor
    root: gs.Tensor
    nodes: list[gs.Node]  # root -> leaf order
    shared: str | None = None  # why the walk stopped at a tensor another node (or the caller) reads too
    coefficient: np.ndarray | None = None  # what the sum multiplies the term by (a Sub's -1, a layer scale)

    @property
    def has_conv(self) -> bool:
        return any(n.op == "Conv" for n in self.nodes)


def _attr_text(node: gs.Node, name: str, default: str) -> str:
    value = node.attrs.get(name, default)
    return value.decode() if isinstance(value, bytes) else str(value)


def merge_branches(graph: gs.Graph, ctx: FoldContext, records: list[MergeRecord], *, graph_path: str = "main") -> None:
    """Merge every exact branch sum of one (sub)graph into a Conv, in place; append a record per candidate."""
    _Merger(graph, ctx, records, graph_path).run()


class _Merger:
    def __init__(self, graph: gs.Graph, ctx: FoldContext, records: list[MergeRecord], path: str) -> None:
        self.graph, self.ctx, self.records, self.path = graph, ctx, records, path
        self.own = {id(n) for n in graph.nodes}
        self.outputs = {id(t) for t in graph.outputs} | ctx.graph_outputs
        self.removed: set[int] = set()
        self.inserted: dict[int, list[gs.Node]] = {}  # id(top node) -> nodes that replace it

    def run(self) -> None:
        first_merge, first_bn = len(self.records), len(self.ctx.records)
        visited: set[int] = set()
        for node in reversed(list(self.graph.nodes)):  # a tree's top before its inner Adds
            if id(node) in visited or not self._is_sum(node):
                continue
            leaves, tree = self._terms(node)
            visited.update(id(n) for n in tree)
            if len(leaves) >= 2:
                self._merge_tree(node, leaves, tree)
        # found from the last sum back: recorded in graph order (the proof blames the most upstream failure)
        self.records[first_merge:] = self.records[first_merge:][::-1]
        self.ctx.records[first_bn:] = self.ctx.records[first_bn:][::-1]
        if self.removed or self.inserted:
            nodes = []
            for node in self.graph.nodes:
                if id(node) in self.inserted:
                    nodes.extend(self.inserted[id(node)])
                elif id(node) not in self.removed:
                    nodes.append(node)
            self.graph.nodes = nodes

    # ----- finding the branches -----------------------------------------------------------------

    def _is_sum(self, node: gs.Node) -> bool:
        if not is_default_domain(node) or node.op not in SUM_OPS or len(node.outputs) != 1:
            return False
        if node.op == "Sub" and len(node.inputs) != 2:
            return False
        return len(node.inputs) >= 2 and all(self.ctx.resolver.value(t) is None for t in node.inputs)

    def _private(self, tensor: gs.Tensor) -> bool:
        return len(tensor.outputs) == 1 and id(tensor) not in self.outputs and not isinstance(tensor, gs.Constant)

    def _producer(self, tensor: gs.Tensor) -> gs.Node | None:
        if not tensor.inputs:
            return None
        node = tensor.inputs[0]
        return node if id(node) in self.own and is_default_domain(node) and id(node) not in self.removed else None

    def _terms(self, top: gs.Node) -> tuple[list[tuple[gs.Tensor, np.ndarray | None]], list[gs.Node]]:
        """The tensors the tree of Adds / Subs / Sums / Identity under ``top`` sums, each with the constant it is
        multiplied by (a Sub's -1, a Mul by a constant over a sum: FastViT's layer scale; None for 1), and the
        tree's nodes."""
        tree, leaves = [top], []
        pending = self._children(top, None)
        while pending:
            tensor, coefficient = pending.pop(0)
            producer = self._producer(tensor)
            inner = producer is not None and self._private(tensor)
            if inner and producer.op in ("Identity", "Mul"):
                source, factor = self._scaled_sum(producer)
                if source is not None:
                    tree.append(producer)
                    scaled = factor if coefficient is None else np.asarray(coefficient * factor)
                    pending.insert(0, (source, None if factor is None and coefficient is None else scaled))
                    continue
            if inner and self._is_sum(producer):
                tree.append(producer)
                pending[:0] = self._children(producer, coefficient)
                continue
            leaves.append((tensor, coefficient))
        return leaves, tree

    @staticmethod
    def _children(node: gs.Node, coefficient: np.ndarray | None) -> list[tuple[gs.Tensor, np.ndarray | None]]:
        if node.op != "Sub":
            return [(t, coefficient) for t in node.inputs]
        negated = np.asarray(-1.0 if coefficient is None else -coefficient)
        return [(node.inputs[0], coefficient), (node.inputs[1], negated)]

    def _scaled_sum(self, node: gs.Node) -> tuple[gs.Tensor | None, np.ndarray | None]:
        """An Identity (factor None), or a Mul by a constant of a sum that is the Mul's own: its input and factor."""
        if node.op == "Identity":
            return (node.inputs[0], None) if len(node.inputs) == 1 else (None, None)
        if len(node.inputs) != 2:
            return None, None
        values = [self.ctx.resolver.value(t) for t in node.inputs]
        if (values[0] is None) == (values[1] is None):
            return None, None
        constant, data = (values[0], node.inputs[1]) if values[0] is not None else (values[1], node.inputs[0])
        if np.dtype(constant.dtype) not in FLOAT_DTYPES or constant.ndim > 4:
            return None, None
        producer = self._producer(data)
        if producer is None or not self._private(data) or not self._is_sum(producer):
            return None, None  # a Mul of one branch is that branch's own step (see _walk)
        return data, np.asarray(constant, dtype=np.float64)

    def _walk(self, leaf: gs.Tensor, coefficient: np.ndarray | None = None, *, strict: bool = True) -> _Branch:
        """Back from ``leaf`` through branch ops while each tensor is the branch's own (``strict``)."""
        nodes: list[gs.Node] = []
        current, spatial, shared = leaf, 0, None
        while True:
            producer = self._producer(current)
            step = self._branch_step(producer) if producer is not None else None
            if step is None:
                break
            kind, data = step
            if kind == "spatial" and spatial:
                break  # at most one window per branch: two in a row are not one Conv
            if strict and not self._private(current):
                readers = len(current.outputs)
                shared = f"'{current.name}' is a graph output" if id(current) in self.outputs else (
                    f"'{current.name}' has {readers} readers")  # fmt: skip
                break
            spatial += kind == "spatial"
            nodes.insert(0, producer)
            current = data
            if len(nodes) > 64:
                break
        return _Branch(leaf, current, nodes, shared, coefficient)

    def _branch_step(self, node: gs.Node) -> tuple[str, gs.Tensor] | None:
        """("spatial" | "pointwise", the node's data input) where ``node`` is a branch op, else None."""
        if not node.inputs or len(node.outputs) < 1:
            return None
        if node.op in TRANSPARENT and len(node.inputs) >= 1:
            if node.op == "Dropout" and (len(node.inputs) > 2 and node.inputs[2].name):
                training = self.ctx.resolver.value(node.inputs[2])
                if training is None or bool(np.asarray(training).reshape(-1)[0]):
                    return None
            if any(t.name and t.outputs for t in node.outputs[1:]):
                return None
            return "pointwise", node.inputs[0]
        if node.op == "BatchNormalization":
            if int(node.attrs.get("training_mode", 0)) or any(t.name for t in node.outputs[1:]):
                return None
            if len(node.inputs) != 5 or any(self.ctx.resolver.value(t) is None for t in node.inputs[1:]):
                return None
            return "pointwise", node.inputs[0]
        if node.op in AFFINE_STEPS and len(node.inputs) == 2:
            values = [self.ctx.resolver.value(t) for t in node.inputs]
            if (values[0] is None) == (values[1] is None):
                return None
            if node.op == "Div" and values[1] is None:
                return None  # c / x is not affine in x
            return "pointwise", node.inputs[1 if values[0] is not None else 0]
        if node.op == "Conv":
            if len(node.inputs) < 2 or self.ctx.resolver.value(node.inputs[1]) is None:
                return None
            if len(node.inputs) > 2 and node.inputs[2].name and self.ctx.resolver.value(node.inputs[2]) is None:
                return None
            weight = self.ctx.resolver.value(node.inputs[1])
            pointwise = all(int(k) == 1 for k in weight.shape[2:]) and not any(
                int(s) != 1 for s in node.attrs.get("strides", [])
            )
            return ("pointwise" if pointwise and not any(int(p) for p in node.attrs.get("pads", [])) else "spatial",
                    node.inputs[0])  # fmt: skip
        if node.op == "AveragePool":
            return "spatial", node.inputs[0]
        if node.op == "Pad" and _attr_text(node, "mode", "constant") == "constant":
            return "pointwise", node.inputs[0]  # moves onto the input where exact (_pad_kernel says why not)
        return None

    # ----- merging ------------------------------------------------------------------------------

    def _merge_tree(self, top: gs.Node, leaves: list[tuple[gs.Tensor, np.ndarray | None]], tree: list[gs.Node]) -> None:
        if len({id(leaf) for leaf, _ in leaves}) != len(leaves):
            return  # a tensor summed twice (Add(a, a)): its branch cannot be removed once per term
        branches = [self._walk(leaf, coefficient) for leaf, coefficient in leaves]
        groups: dict[int, list[_Branch]] = {}
        for branch in branches:
            groups.setdefault(id(branch.root), []).append(branch)
        candidates = [
            g
            for g in groups.values()
            if len(g) >= 2 and any(b.has_conv for b in g) and not isinstance(g[0].root, gs.Constant)
        ]
        if not candidates:
            self._near_miss(top, leaves, branches)
            return
        merged: list[tuple[list[_Branch], gs.Node, MergeRecord]] = []
        for group in candidates:
            record = MergeRecord(describe(top), self.path, "skipped", output=top.outputs[0].name,
                                 input=group[0].root.name, branches=[self._describe(b) for b in group])  # fmt: skip
            kept = [b.shared for b in branches if b.shared and b not in group]
            kept += [self._not_linear(b, group[0].root) for b in branches if b not in group and not b.shared]
            kept = [k for k in kept if k]
            try:
                kernel, dtype, group, refused = self._kernel(group)
                conv = self._conv(top, group[0].root, kernel, dtype)
            except NotMergeable as why:
                record.reason = str(why)
                self.records.append(record)
                continue
            record.status, record.into = "merged", conv.name
            record.branches = [self._describe(b) for b in group]
            record.kernel, record.groups = [int(k) for k in kernel.weight.shape[2:]], kernel.groups
            kept += [f"[{self._describe(b)}]: {why}" for b, why in refused]
            if kept:
                record.reason = "kept apart: " + "; ".join(kept)
            merged.append((group, conv, record))
        if not merged:
            return
        self._rewire(top, tree, branches, merged)

    def _near_miss(
        self, top: gs.Node, leaves: list[tuple[gs.Tensor, np.ndarray | None]], branches: list[_Branch]
    ) -> None:
        """Report a sum whose branches would share an input but for a branch tensor read elsewhere."""
        if not any(b.shared for b in branches):
            return
        relaxed: dict[int, list[_Branch]] = {}
        for leaf, coefficient in leaves:
            branch = self._walk(leaf, coefficient, strict=False)
            relaxed.setdefault(id(branch.root), []).append(branch)
        for group in relaxed.values():
            if len(group) >= 2 and any(b.has_conv for b in group):
                reasons = [b.shared for b in branches if b.shared]
                self.records.append(
                    MergeRecord(
                        describe(top),
                        self.path,
                        "skipped",
                        output=top.outputs[0].name,
                        input=group[0].root.name,
                        branches=[self._describe(b) for b in group],
                        reason="a branch is read elsewhere: " + "; ".join(reasons),
                    )  # fmt: skip
                )
                return

    def _not_linear(self, branch: _Branch, root: gs.Tensor) -> str | None:
        """Why a term that reads ``root`` a few nodes back is no branch of it (a node that is not linear), or None."""
        current = branch.root
        for _ in range(4):
            producer = self._producer(current)
            if producer is None or not producer.inputs:
                return None
            if any(t is root for t in producer.inputs):
                return (
                    f"'{branch.leaf.name}' goes through {producer.op} '{describe(producer)}' (not a linear branch op)"
                )
            current = producer.inputs[0]
        return None

    def _kernel(self, group: list[_Branch]) -> tuple[Kernel, np.dtype, list[_Branch], list[tuple[_Branch, str]]]:
        """The branches of ``group`` summed as one Conv, the dtype its weights take, the branches it sums and
        those left out (a branch that is not exactly a Conv of the input, with the reason)."""
        convs = [n for b in group for n in b.nodes if n.op == "Conv"]
        weights = [self.ctx.resolver.value(n.inputs[1]) for n in convs]
        dtypes = {np.dtype(w.dtype) for w in weights}
        root = group[0].root
        root_dtype = self.ctx.types.dtype(root)
        if len(dtypes) != 1 or (root_dtype is not None and root_dtype not in dtypes):
            raise NotMergeable(f"branch weights of types {sorted(d.name for d in dtypes)} for a {root_dtype} input")
        dtype = dtypes.pop()
        if dtype not in FLOAT_DTYPES:
            raise NotMergeable(f"Conv weights of type {dtype}")
        rank = weights[0].ndim - 2
        channels = self._input_channels(group, root)
        kernels, kept, refused = [], [], []
        for branch in group:
            try:
                kernels.append(self._branch_kernel(branch, channels, rank, dtype))
                kept.append(branch)
            except NotMergeable as why:
                refused.append((branch, str(why)))
        if len(kept) < 2 or not any(b.has_conv for b in kept):
            raise NotMergeable("; ".join(why for _, why in refused))
        merged = reparam_math.merge(kernels)
        cost = sum(self._cost(b, channels) for b in kept)
        if reparam_math.weight_elements(merged) > cost:
            raise NotMergeable(
                f"the merged {'x'.join(map(str, merged.weight.shape[2:]))} Conv in {merged.groups} group(s) would "
                f"cost {reparam_math.weight_elements(merged)} multiply-adds per position, its branches {cost}"
            )
        return merged, dtype, kept, refused

    def _input_channels(self, group: list[_Branch], root: gs.Tensor) -> int:
        for branch in group:
            for node in branch.nodes:
                if node.op == "Conv":
                    weight = self.ctx.resolver.value(node.inputs[1])
                    return int(weight.shape[1]) * int(node.attrs.get("group", 1))
                if node.op not in TRANSPARENT:
                    break
        shape = self.ctx.types.shape(root)
        if shape is not None and len(shape) > 1 and isinstance(shape[1], int):
            return shape[1]
        raise NotMergeable(f"the channel count of '{root.name}' is unknown")

    def _branch_kernel(self, branch: _Branch, channels: int, rank: int, dtype: np.dtype) -> Kernel:
        kernel = reparam_math.identity_kernel(channels, rank)
        for node in branch.nodes:
            if node.op in TRANSPARENT:
                continue
            if node.op == "Conv":
                kernel = self._compose(kernel, self._conv_kernel(node, rank))
            elif node.op == "AveragePool":
                kernel = self._compose(kernel, self._pool_kernel(node, kernel.out_channels, rank))
            elif node.op == "Pad":
                pads, value = self._pad(node, rank)
                try:
                    kernel = reparam_math.padded(kernel, pads, value, dtype)
                except NotMergeable as why:
                    raise NotMergeable(f"Pad {describe(node)}: {why}") from None
            else:
                scale, shift = self._affine(node, kernel.out_channels, rank)
                kernel = reparam_math.then_affine(kernel, scale, shift)
        if branch.coefficient is not None:
            factor = per_channel_vector(branch.coefficient, rank + 2, kernel.out_channels)
            if factor is None:
                raise NotMergeable(
                    f"a factor of shape {list(branch.coefficient.shape)} over the sum is not per channel"
                )
            kernel = reparam_math.then_affine(kernel, factor, np.zeros(1))
        return kernel

    @staticmethod
    def _compose(before: Kernel, step: Kernel) -> Kernel:
        identity = before.pointwise and before.groups == before.out_channels and not np.any(before.bias)
        if identity and np.all(before.weight == 1):
            return step  # nothing yet but the input itself
        return reparam_math.compose(before, step)

    def _conv_kernel(self, node: gs.Node, rank: int) -> Kernel:
        weight = self.ctx.resolver.value(node.inputs[1])
        bias = self.ctx.resolver.value(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2].name else None
        if weight.ndim - 2 != rank:
            raise NotMergeable(f"Conv {describe(node)} has {weight.ndim - 2} spatial axes, not {rank}")
        strides = tuple(int(s) for s in node.attrs.get("strides", [1] * rank))
        dilations = tuple(int(d) for d in node.attrs.get("dilations", [1] * rank))
        pads = self._pads(node, weight.shape[2:], strides, dilations, rank)
        return reparam_math.conv_kernel(weight, bias, groups=int(node.attrs.get("group", 1)), strides=strides,
                                        dilations=dilations, pads=pads)  # fmt: skip

    def _pool_kernel(self, node: gs.Node, channels: int, rank: int) -> Kernel:
        shape = tuple(int(k) for k in node.attrs.get("kernel_shape", []))
        if len(shape) != rank:
            raise NotMergeable(f"AveragePool {describe(node)} has a {len(shape)}-D window, not {rank}")
        strides = tuple(int(s) for s in node.attrs.get("strides", [1] * rank))
        dilations = tuple(int(d) for d in node.attrs.get("dilations", [1] * rank))
        return reparam_math.average_pool_kernel(
            channels, shape, strides=strides, dilations=dilations,
            pads=self._pads(node, shape, strides, dilations, rank),
            count_include_pad=bool(node.attrs.get("count_include_pad", 0)),
            ceil_mode=bool(node.attrs.get("ceil_mode", 0)),
        )  # fmt: skip

    def _pad(self, node: gs.Node, rank: int) -> tuple[tuple[int, ...], float]:
        """A constant-mode Pad's spatial pads (begins, then ends) and value; NotMergeable where they are not constant
        or it pads the batch or channel axis."""
        if len(node.inputs) > 1 and node.inputs[1].name:  # opset 11+: pads, constant_value, axes as inputs
            values = [self.ctx.resolver.value(t) if t.name else None for t in node.inputs[1:4]]
            given = [bool(t.name) for t in node.inputs[1:4]]
            if any(g and v is None for g, v in zip(given, values, strict=False)):
                raise NotMergeable(f"Pad {describe(node)}: its pads, value or axes are not constant")
            pads, value = values[0], values[1] if len(values) > 1 and values[1] is not None else 0.0
            axes = values[2] if len(values) > 2 and values[2] is not None else None
        else:
            pads, value, axes = node.attrs.get("pads", []), float_attribute(node.attrs, "value", 0.0), None
        pads = [int(p) for p in np.asarray(pads).reshape(-1)]
        dims = rank + 2
        axes = list(range(dims)) if axes is None else [int(a) % dims for a in np.asarray(axes).reshape(-1)]
        if len(pads) != 2 * len(axes):
            raise NotMergeable(f"Pad {describe(node)}: {len(pads)} pads for {len(axes)} axes")
        full = [0] * (2 * dims)
        for position, axis in enumerate(axes):
            full[axis], full[dims + axis] = pads[position], pads[len(axes) + position]
        if any(full[a] or full[dims + a] for a in (0, 1)):
            raise NotMergeable(f"Pad {describe(node)} pads the batch or channel axis")
        value = float(np.asarray(value, dtype=np.float64).reshape(-1)[0]) if np.size(value) else 0.0
        return tuple(full[2:dims]) + tuple(full[dims + 2 :]), value

    @staticmethod
    def _pads(node: gs.Node, window: tuple[int, ...], strides, dilations, rank: int) -> tuple[int, ...]:  # noqa: ANN001
        auto_pad = node.attrs.get("auto_pad", "NOTSET")
        auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad)
        if auto_pad in ("NOTSET", ""):
            return tuple(int(p) for p in node.attrs.get("pads", [0] * (2 * rank)))
        if auto_pad == "VALID":
            return (0,) * (2 * rank)
        if any(s != 1 for s in strides):
            raise NotMergeable(f"{node.op} {describe(node)}: auto_pad={auto_pad} with a stride depends on the size")
        total = [d * (int(k) - 1) for k, d in zip(window, dilations, strict=True)]
        small = [t // 2 for t in total]
        begins = small if auto_pad == "SAME_UPPER" else [t - s for t, s in zip(total, small, strict=True)]
        return tuple(begins) + tuple(t - b for t, b in zip(total, begins, strict=True))

    def _affine(self, node: gs.Node, channels: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
        if node.op == "BatchNormalization":
            params = [self.ctx.resolver.value(t) for t in node.inputs[1:]]
            if any(np.ndim(p) != 1 or np.size(p) != channels for p in params):
                raise NotMergeable(f"BatchNormalization {describe(node)}: parameters are not {channels} per channel")
            try:
                affine = fold_math.batchnorm_affine(*params, float_attribute(node.attrs, "epsilon", 1e-5))
            except InvalidStatisticsError as exc:
                raise NotMergeable(f"BatchNormalization {describe(node)}: {exc}") from exc
            return affine.scale, affine.shift
        values = [self.ctx.resolver.value(t) for t in node.inputs]
        first = values[0] is not None
        constant = values[0] if first else values[1]
        vector = per_channel_vector(constant, rank + 2, channels)
        if vector is None:
            raise NotMergeable(f"{node.op} {describe(node)}: its constant of shape {list(constant.shape)} is not "
                               f"per channel")  # fmt: skip
        try:
            affine = fold_math.constant_affine(node.op, vector, channels, constant_first=first)
        except ValueError as exc:
            raise NotMergeable(f"{node.op} {describe(node)}: {exc}") from exc
        return affine.scale, affine.shift

    def _cost(self, branch: _Branch, channels: int) -> int:
        """Multiply-adds per output position of the branch as it runs now (at least an add per channel)."""
        cost = channels
        for node in branch.nodes:
            if node.op == "Conv":
                cost += int(self.ctx.resolver.value(node.inputs[1]).size)
            elif node.op == "AveragePool":
                cost += channels * math.prod(int(k) for k in node.attrs.get("kernel_shape", [1]))
            elif node.op not in TRANSPARENT:
                cost += channels
        return cost

    # ----- surgery ------------------------------------------------------------------------------

    def _conv(self, top: gs.Node, root: gs.Tensor, kernel: Kernel, dtype: np.dtype) -> gs.Node:
        """The merged Conv (not yet connected to an output)."""
        weight = reparam_math.rounded(kernel.weight, dtype)
        has_bias = bool(np.any(kernel.bias))
        bias = reparam_math.rounded(kernel.bias, dtype) if has_bias else None
        base = top.name or top.outputs[0].name
        name = self.ctx.fresh_name(f"{base}_reparam")
        inputs: list[gs.Tensor] = [root, self._constant(f"{name}_weight", weight, kernel.weight, dtype)]
        if bias is not None:
            inputs.append(self._constant(f"{name}_bias", bias, kernel.bias, dtype))
        attrs = {
            "kernel_shape": [int(k) for k in kernel.weight.shape[2:]],
            "strides": list(kernel.strides),
            "dilations": list(kernel.dilations),
            "pads": list(kernel.pads),
            "group": kernel.groups,
        }
        return gs.Node("Conv", name, attrs=attrs, inputs=inputs, outputs=[])

    def _constant(self, base: str, values: np.ndarray, exact: np.ndarray, dtype: np.dtype) -> gs.Constant:
        constant = gs.Constant(self.ctx.fresh_name(base), values)
        self.ctx.written.add(constant.name)
        if dtype in LOW_PRECISION_DTYPES and exact.size <= EXACT_ELEMENTS:  # a later fold starts from these
            self.ctx.exact[id(constant)] = (constant, np.array(exact, dtype=np.float64))
        return constant

    def _rewire(self, top: gs.Node, tree: list[gs.Node], branches: list[_Branch], merged: list) -> None:  # noqa: ANN001
        output = top.outputs[0]
        taken = {id(b) for group, _, _ in merged for b in group}
        dtype = merged[0][1].inputs[1].values.dtype
        remaining = [self._scaled_leaf(b, dtype) for b in branches if id(b) not in taken]
        sums: list[gs.Tensor] = []
        new_nodes: list[gs.Node] = []
        for index, (group, conv, record) in enumerate(merged):
            last = index == len(merged) - 1 and not remaining
            result = output if last else gs.Variable(self.ctx.fresh_name(f"{conv.name}_output"), dtype=output.dtype)
            conv.outputs.append(result)
            new_nodes.append(conv)
            sums.append(result)
            for branch in group:
                for node in branch.nodes:
                    self._bn_record(node, conv, output)
                    self._remove(node)
            self.records.append(record)
        for _, nodes in remaining:
            new_nodes.extend(nodes)
        terms = sums + [term for term, _ in remaining]
        accumulated = terms[0]
        for position, term in enumerate(terms[1:], start=1):
            last = position == len(terms) - 1
            result = output if last else gs.Variable(self.ctx.fresh_name(f"{describe(top)}_partial"),
                                                     dtype=output.dtype)  # fmt: skip
            add = gs.Node("Add", self.ctx.fresh_name(f"{describe(top)}_rest"), inputs=[accumulated, term],
                          outputs=[result])  # fmt: skip
            new_nodes.append(add)
            accumulated = result
        for node in tree:
            if node is not top:
                self._remove(node)
        top.inputs.clear()
        top.outputs.clear()
        self.inserted[id(top)] = new_nodes

    def _scaled_leaf(self, branch: _Branch, dtype: np.dtype) -> tuple[gs.Tensor, list[gs.Node]]:
        """A term left out of the merges, times its coefficient (a Mul, where it has one)."""
        if branch.coefficient is None:
            return branch.leaf, []
        factor = gs.Constant(
            self.ctx.fresh_name(f"{branch.leaf.name}_factor"), np.array(branch.coefficient, dtype=dtype)
        )
        scaled = gs.Variable(self.ctx.fresh_name(f"{branch.leaf.name}_scaled"), dtype=dtype)
        mul = gs.Node("Mul", self.ctx.fresh_name(f"{branch.leaf.name}_mul"), inputs=[branch.leaf, factor],
                      outputs=[scaled])  # fmt: skip
        return scaled, [mul]

    def _remove(self, node: gs.Node) -> None:
        node.inputs.clear()
        node.outputs.clear()
        self.removed.add(id(node))

    def _bn_record(self, node: gs.Node, conv: gs.Node, output: gs.Tensor) -> None:
        if node.op != "BatchNormalization":
            return
        name = node.outputs[0].name
        self.ctx.superseded[name] = output.name
        record = BatchNormRecord(describe(node), self.path, "folded", into=conv.name, direction="merged", output=name)
        record.reset_from_training = name in self.ctx.reset_from_training
        self.ctx.records.append(record)
        if self.ctx.progress is not None:
            self.ctx.progress()

    def _describe(self, branch: _Branch) -> str:
        parts = []
        for node in branch.nodes:
            if node.op in TRANSPARENT:
                continue
            if node.op in ("Conv", "AveragePool"):
                weight = self.ctx.resolver.value(node.inputs[1]) if node.op == "Conv" else None
                window = weight.shape[2:] if weight is not None else node.attrs.get("kernel_shape", [])
                group = int(node.attrs.get("group", 1))
                extra = f", {group} groups" if group > 1 else ""
                parts.append(f"{node.op} '{describe(node)}' ({'x'.join(str(int(k)) for k in window)}{extra})")
            else:
                parts.append(f"{node.op} '{describe(node)}'")
        return " -> ".join(parts) if parts else f"'{branch.root.name}' itself"
