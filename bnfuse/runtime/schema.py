"""The one description of bnfuse's CPU custom ops (domain ``bnfuse``): names, inputs, outputs, element types,
attributes with their types and defaults. The native library reads it as ``bnfuse/runtime/native/schema.h``,
generated from here (``python -m bnfuse.runtime.schema``; tests/runtime/test_native.py checks it is up to date);
ops.py and optimizer_ops.py take their names and defaults from it.

Types: a BN op's ``T`` inputs and outputs (X, dY, Y, dX) have the data type, its ``U`` ones (scale, bias, statistics,
gradients of the parameters) the parameter type; the registered (T, U) pairs are :data:`BN_TYPE_PAIRS`. The
optimizer steps take one variadic float32 list and give one.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from bnfuse.attributes import onnx_float

DOMAIN = "bnfuse"
FLOAT, FLOAT16 = 1, 10  # ONNX TensorProto element types
BN_TYPE_PAIRS = ((FLOAT, FLOAT), (FLOAT16, FLOAT16), (FLOAT16, FLOAT))
HEADER = Path(__file__).resolve().parent / "native" / "schema.h"


@dataclass(frozen=True)
class Attribute:
    name: str
    default: float | int | str | tuple[float, ...]  # a float default is the float32 an ONNX attribute holds
    ints: bool = False  # a list of ints (a tuple default is a list of floats otherwise)

    @property
    def kind(self) -> str:
        if isinstance(self.default, tuple):
            return "INTS" if self.ints else "FLOATS"
        return {float: "FLOAT", int: "INT", str: "STRING"}[type(self.default)]


@dataclass(frozen=True)
class Value:
    name: str
    data: bool = False  # of type T (else U)
    optional: bool = False


@dataclass(frozen=True)
class OpSchema:
    name: str
    inputs: tuple[Value, ...]
    outputs: tuple[Value, ...]
    attributes: tuple[Attribute, ...]
    variadic: bool = False  # one homogeneous float32 input list and one output list

    def attribute(self, name: str) -> Attribute:
        return next(a for a in self.attributes if a.name == name)

    @property
    def defaults(self) -> dict[str, float | int | str | tuple[float, ...]]:
        return {a.name: a.default for a in self.attributes}


def _values(spec: str) -> tuple[Value, ...]:
    """'X* scale B Y*?': a trailing * marks a T value, ? an optional one."""
    return tuple(Value(word.rstrip("*?"), "*" in word, word.endswith("?")) for word in spec.split())


_EPSILON = Attribute("epsilon", onnx_float(1e-5))
_MODE, _AXIS = Attribute("mode", "spatial"), Attribute("axis", 1)
_ACTIVATION = Attribute("activation", "none")

BN_INFERENCE = OpSchema(
    "BatchNormalizationInference", _values("X* scale B mean var"), _values("Y*"), (_EPSILON, _MODE, _AXIS)
)
BN_TRAINING = OpSchema(
    "BatchNormalizationTraining",
    _values("X* scale B input_mean input_var"),
    _values("Y* running_mean running_var saved_mean saved_inv_std batch_var?"),
    (
        _EPSILON,
        Attribute("momentum", onnx_float(0.9)),
        Attribute("momentum_convention", "onnx"),
        _MODE,
        _AXIS,
        Attribute("unbiased_running_var", 0),
        Attribute("fix_gamma", 0),
        Attribute("use_global_stats", 0),
        _ACTIVATION,
    ),
)
# Grad accepts epsilon (nodes may copy the training node's attributes) but never uses it: saved_inv_std has it.
BN_GRAD = OpSchema(
    "BatchNormalizationGrad",
    _values("dY* X* scale saved_mean saved_inv_std Y*?"),
    _values("dX* dScale dBias"),
    (_EPSILON, _MODE, _AXIS, Attribute("use_global_stats", 0), Attribute("fix_gamma", 0), _ACTIVATION),
)
_PER_PARAMETER = (Attribute("weight_decays", ()), Attribute("lr_scales", ()))
SGD_STEP = OpSchema(
    "SGDStep",
    _values("inputs"),
    _values("outputs"),
    (Attribute("momentum", 0.0), Attribute("nesterov", 0), *_PER_PARAMETER),
    variadic=True,
)
ADAM_STEP = OpSchema(
    "AdamStep",
    _values("inputs"),
    _values("outputs"),
    (
        Attribute("beta1", onnx_float(0.9)),
        Attribute("beta2", onnx_float(0.999)),
        Attribute("epsilon", onnx_float(1e-8)),
        *_PER_PARAMETER,
    ),
    variadic=True,
)
# The convolution gradients (float32, oneDNN): conv_grad.py and conv_input_grad.py describe them.
_CONV = tuple(Attribute(name, (), ints=True) for name in ("kernel_shape", "strides", "dilations", "pads"))
CONV_WEIGHT_GRAD = OpSchema(
    "ConvWeightGrad", _values("X* dY*"), _values("dW*"), (*_CONV, Attribute("group", 1), Attribute("x_block", 0))
)
CONV_INPUT_GRAD = OpSchema(
    "ConvInputGrad",
    _values("dY* W*"),
    _values("dX*"),
    (*_CONV, Attribute("group", 1), Attribute("output_shape", (), ints=True)),
)
BN_OPS = (BN_INFERENCE, BN_TRAINING, BN_GRAD)
OPTIMIZER_OPS = (SGD_STEP, ADAM_STEP)
CONV_OPS = (CONV_WEIGHT_GRAD, CONV_INPUT_GRAD)
# Defined, created and computed by the native library. The convolution gradients only where bnfuse's Python side is
# not in the process: there it registers its own kernels of them (the same oneDNN core, with TrainingSession's
# thread count).
NATIVE_CPU_OPS = (*BN_OPS, *OPTIMIZER_OPS, *CONV_OPS)
NATIVE_BESIDE_PYTHON = frozenset(op.name for op in (*BN_OPS, *OPTIMIZER_OPS))
BY_NAME = {op.name: op for op in NATIVE_CPU_OPS}


Shape = tuple[int, ...]


def bn_output_shapes(op: OpSchema, attributes: dict[str, object], inputs: list[Shape | None]) -> list[Shape | None]:
    """A BN op's output shapes from its inputs' (None: unknown): the data outputs take X's shape, the others the
    parameters' (X's channel axis in spatial mode, X's shape without the batch axis per activation)."""
    at = [v.name for v in op.inputs].index("X")
    x = inputs[at] if at < len(inputs) else None
    if not x:
        return [None] * len(op.outputs)
    mode = attributes.get("mode", "spatial")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    if mode.lower() == "per_activation":
        params: Shape = tuple(x[1:])
    else:
        params = (x[int(attributes.get("axis", 1)) % len(x)],)  # type: ignore[call-overload]
    return [x if v.data else params for v in op.outputs]


def conv_output_shapes(op: OpSchema, attributes: dict[str, object], inputs: list[Shape | None]) -> list[Shape | None]:
    """dW of ConvWeightGrad (X, dY): [O, C / group, kernel...]; dX of ConvInputGrad (dY, W): [N, C, output_shape...]."""
    first, second = (inputs + [None, None])[:2]
    if first is None or second is None:
        return [None]
    group = int(attributes.get("group", 1))  # type: ignore[call-overload]
    if op is CONV_WEIGHT_GRAD:
        return [(second[1], first[1] // group, *attributes["kernel_shape"])]  # type: ignore[misc]
    return [(first[0], second[1] * group, *attributes["output_shape"])]  # type: ignore[misc]


def output_shapes(op_name: str, attributes: dict[str, object], inputs: list[Shape | None]) -> list[Shape | None]:
    """The shape rule of any op in :data:`NATIVE_CPU_OPS` but the variadic optimizer steps."""
    op = BY_NAME[op_name]
    rule = conv_output_shapes if op in CONV_OPS else bn_output_shapes
    return rule(op, attributes, inputs)


def output_element_types(op_name: str, inputs: list[int | None]) -> list[int | None]:
    """The type rule of any op in :data:`NATIVE_CPU_OPS`: a data output (T) takes its first data input's element
    type, any other output (U) its first parameter input's (None: unknown)."""
    op = BY_NAME[op_name]
    given = list(zip(op.inputs, inputs, strict=False))
    data = next((t for v, t in given if v.data and t), None)
    params = next((t for v, t in given if not v.data and t), None)
    return [data if v.data else params for v in op.outputs]


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _c_attribute(attribute: Attribute) -> str:
    default = attribute.default
    real = repr(float(default)) if isinstance(default, float) else "0.0"
    integer = str(default) if isinstance(default, int) else "0"
    text = _c_string(default) if isinstance(default, str) else '""'
    return f"{{{_c_string(attribute.name)}, BN_ATTR_{attribute.kind}, {real}, {integer}, {text}}}"


def _c_values(values: tuple[Value, ...]) -> str:
    return ", ".join(f"{{{_c_string(v.name)}, {int(v.data)}, {int(v.optional)}}}" for v in values)


def c_header() -> str:
    """native/schema.h: the ops as C tables."""
    lines = [
        "/* Generated by `python -m bnfuse.runtime.schema` from bnfuse/runtime/schema.py: do not edit. */",
        "#ifndef BNFUSE_SCHEMA_H",
        "#define BNFUSE_SCHEMA_H",
        "",
        "#include <stdint.h>",
        "",
        f"#define BN_DOMAIN {_c_string(DOMAIN)}",
        "enum { BN_ATTR_FLOAT, BN_ATTR_INT, BN_ATTR_STRING, BN_ATTR_FLOATS, BN_ATTR_INTS };",
        "enum { BN_SCHEMA_MAX_VALUES = 6, BN_SCHEMA_MAX_ATTRIBUTES = 9 };",
        "",
        "typedef struct {",
        "    const char *name;",
        "    int kind;",
        "    double real;",
        "    int64_t integer;",
        "    const char *text;",
        "} bn_attribute_schema;",
        "",
        "typedef struct {",
        "    const char *name;",
        "    int data; /* of the data type T (else the parameter type U) */",
        "    int optional;",
        "} bn_value_schema;",
        "",
        "typedef struct {",
        "    const char *name;",
        "    int inputs, outputs, variadic, attributes;",
        "    bn_value_schema input[BN_SCHEMA_MAX_VALUES], output[BN_SCHEMA_MAX_VALUES];",
        "    bn_attribute_schema attribute[BN_SCHEMA_MAX_ATTRIBUTES];",
        "} bn_op_schema;",
        "",
    ]
    codes = {op.name: index for index, op in enumerate(NATIVE_CPU_OPS)}
    lines.append("enum { " + ", ".join(f"BN_OP_{_macro(name)} = {code}" for name, code in codes.items()) + " };")
    lines.append(f"enum {{ BN_OP_COUNT = {len(NATIVE_CPU_OPS)}, BN_TYPE_PAIR_COUNT = {len(BN_TYPE_PAIRS)} }};")
    lines.append(
        f"enum {{ BN_BN_OPS = {len(BN_OPS)}, BN_OPTIMIZER_OPS = {len(OPTIMIZER_OPS)}, BN_CONV_OPS = {len(CONV_OPS)} }};"
    )
    pairs = ", ".join(f"{{{t}, {u}}}" for t, u in BN_TYPE_PAIRS)
    lines += ["", f"static const int bn_type_pairs[BN_TYPE_PAIR_COUNT][2] = {{{pairs}}};", ""]
    lines.append("static const bn_op_schema bn_schema[BN_OP_COUNT] = {")
    for op in NATIVE_CPU_OPS:
        attributes = ", ".join(_c_attribute(a) for a in op.attributes)
        lines += [
            f"    {{{_c_string(op.name)}, {len(op.inputs)}, {len(op.outputs)}, {int(op.variadic)}, "
            f"{len(op.attributes)},",
            f"     {{{_c_values(op.inputs)}}},",
            f"     {{{_c_values(op.outputs)}}},",
            f"     {{{attributes}}}}},",
        ]
    lines += ["};", "", "#endif", ""]
    return "\n".join(lines)


def _macro(name: str) -> str:
    """SGDStep -> SGD_STEP, BatchNormalizationGrad -> BATCH_NORMALIZATION_GRAD"""
    return re.sub(r"(?<=[a-z])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).upper()


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        sys.exit(0 if HEADER.read_text() == c_header() else 1)
    HEADER.write_text(c_header())
