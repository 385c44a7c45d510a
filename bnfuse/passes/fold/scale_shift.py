"""A BatchNormalization that cannot fold, rewritten as Mul + Add by precomputed per-channel constants.

``y = x * a + b`` with a = scale / sqrt(var + eps) and b = bias - mean * a, both shaped (C, 1, ..., 1) so
they broadcast along channel axis 1 of a rank-r input (r - 2 trailing ones).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_graphsurgeon as gs

from bnfuse.passes.fold.fold_math import ChannelAffine, scale_shift_constants


def scale_shift_nodes(
    x: gs.Tensor,
    y: gs.Tensor,
    affine: ChannelAffine,
    *,
    rank: int,
    dtype: np.dtype,
    base: str,
    fresh_name: Callable[[str], str],
) -> tuple[gs.Node, gs.Node]:
    """Mul(x, a) -> Add(., b): the Add is returned without outputs; the caller attaches ``y`` to it.

    Raises fold_math.NotRepresentableError when a or b overflow ``dtype``.
    """
    mul_values, add_values = scale_shift_constants(affine, rank, dtype)
    scale = gs.Constant(fresh_name(f"{base}_scale"), mul_values)
    shift = gs.Constant(fresh_name(f"{base}_shift"), add_values)
    scaled = gs.Variable(fresh_name(f"{base}_scaled"), dtype=y.dtype or x.dtype, shape=y.shape or x.shape)
    mul = gs.Node("Mul", fresh_name(f"{base}_mul"), inputs=[x, scale], outputs=[scaled])
    add = gs.Node("Add", fresh_name(f"{base}_add"), inputs=[scaled, shift], outputs=[])
    return mul, add
