"""The training graph's interface, stored in the model itself (metadata_props) so a session needs nothing else.

Inputs: the data inputs, the labels (or gradient seeds), ``lr``, then every state tensor (trainable
parameters, BatchNormalization running statistics, optimizer state, step counters). Every state input has one output
holding its value after the step; the session feeds that output back as the next step's input.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field, fields

import onnx

from bnfuse.errors import ModelError

METADATA_KEY = "bnfuse.training"
INFERENCE_KEY = "bnfuse.training.inference_graph"
VERSION = 1


@dataclass
class TrainingSpec:
    """Names of the training graph's inputs and outputs, by role."""

    data: list[str]
    targets: list[str]  # labels (cross-entropy, mse) or gradient seeds (seed)
    lr: str
    loss: str
    loss_kind: str
    parameters: list[str]
    running_stats: list[str]
    optimizer_state: list[str]
    state: dict[str, str]  # state input name -> output name holding its updated value
    outputs: list[str] = field(default_factory=list)  # the inference model's outputs, also computed
    counters: list[str] = field(default_factory=list)  # step counters in the state (bn.num_batches_tracked)
    # state name -> the input model's name for that tensor, where they differ (a BN's untied copy of a shared
    # initializer); every other state tensor keeps the input model's name
    original_names: dict[str, str] = field(default_factory=dict)
    # the batch size the graph was built for: its static batch, or a dynamic graph's default (None: not given)
    batch_size: int | None = None
    version: int = VERSION

    def to_json(self) -> str:
        # the fields hold strings, numbers and flat lists / dicts of them: asdict's deep copy would add nothing
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TrainingSpec:
        data = json.loads(text)
        if data.get("version") != VERSION:
            raise ModelError(f"training graph format version {data.get('version')} is not supported")
        return cls(**data)


def write_spec(model: onnx.ModelProto, spec: TrainingSpec, inference_graph: onnx.GraphProto) -> None:
    """Record the spec and the inference graph (nodes and interface, no weights) in the model."""
    _set(model, METADATA_KEY, spec.to_json())
    _set(model, INFERENCE_KEY, base64.b64encode(inference_graph.SerializeToString()).decode("ascii"))


def set_spec(model: onnx.ModelProto, spec: TrainingSpec) -> None:
    """Replace the model's recorded spec."""
    _set(model, METADATA_KEY, spec.to_json())


def read_spec(model: onnx.ModelProto) -> TrainingSpec:
    for prop in model.metadata_props:
        if prop.key == METADATA_KEY:
            return TrainingSpec.from_json(prop.value)
    raise ModelError("not a bnfuse training graph (no bnfuse.training metadata); build one with `bnfuse train-graph`")


def read_inference_graph(model: onnx.ModelProto) -> onnx.GraphProto:
    for prop in model.metadata_props:
        if prop.key == INFERENCE_KEY:
            graph = onnx.GraphProto()
            graph.ParseFromString(base64.b64decode(prop.value))
            return graph
    raise ModelError("training graph carries no inference graph (bnfuse.training.inference_graph metadata)")


def _set(model: onnx.ModelProto, key: str, value: str) -> None:
    for prop in model.metadata_props:
        if prop.key == key:
            prop.value = value
            return
    entry = model.metadata_props.add()
    entry.key, entry.value = key, value
