"""ONNX attributes as ONNX defines them.

A FLOAT attribute is a float32 (AttributeProto.f): onnxruntime reads ``epsilon=1e-5`` as float32(1e-5) =
9.99999974738e-06, whether the model writes it or leaves it to its default. A default must therefore be
rounded the same way, or a float64 model folds (or trains) with an epsilon onnxruntime never uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


def onnx_float(value: float) -> float:
    """``value`` as a FLOAT attribute holds it: rounded to float32 (returned as a Python float)."""
    return float(np.float32(value))


def float_attribute(attributes: Mapping[str, Any], name: str, default: float) -> float:
    """A FLOAT attribute from a name -> value mapping, its default rounded to float32 like a written value."""
    return onnx_float(attributes.get(name, default))
