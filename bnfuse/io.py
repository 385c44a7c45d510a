"""Loading and saving ONNX models: clear errors on bad input, atomic writes, ORT-loadable IR version."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import onnx

from bnfuse.errors import ModelError

# onnxruntime 1.31 reads IR version 13 at most; onnx 1.23 writes 14 by default.
MAX_IR_VERSION = 13
# Models above 2 GiB cannot be serialized as one protobuf; save their tensors as external data.
_PROTOBUF_LIMIT = 2**31 - 1
_METADATA_MARGIN = 64 * 2**20  # nodes, names, small attributes: generous for any real model


def load_model(path: str | os.PathLike[str], *, check: bool = True) -> onnx.ModelProto:
    """Read an ONNX model (external data included) or raise ModelError with one clear line."""
    path = Path(path)
    if not path.exists():
        raise ModelError(f"{path}: no such file")
    if path.is_dir():
        raise ModelError(f"{path}: is a directory, not an ONNX file")
    try:
        model = onnx.load(str(path), load_external_data=True)
    except Exception as exc:  # protobuf raises DecodeError, RuntimeWarning-like or OSError
        raise ModelError(f"{path}: not a readable ONNX model ({_first_line(exc)})") from exc
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise ModelError(f"{path}: not an ONNX model (no graph)")
    if check:
        check_model(model, what=str(path))
    return model


def check_model(model: onnx.ModelProto, *, what: str = "model", full: bool = False) -> None:
    """Run onnx.checker; raise ModelError on failure."""
    try:
        if not exceeds_protobuf_limit(model):
            onnx.checker.check_model(model, full_check=full)
    except Exception as exc:
        raise ModelError(f"{what}: invalid ONNX model ({_first_line(exc)})") from exc


def ort_compatible(model: onnx.ModelProto) -> onnx.ModelProto:
    """Cap the IR version at what onnxruntime 1.31 loads (in place; returns the model)."""
    if model.ir_version > MAX_IR_VERSION or model.ir_version == 0:
        model.ir_version = MAX_IR_VERSION
    return model


def save_model(model: onnx.ModelProto, path: str | os.PathLike[str]) -> Path:
    """Write a model atomically: a temporary file in the target directory, then a rename.

    Large models (over the 2 GiB protobuf limit) get their tensors in one external-data file
    beside the model. Nothing partial is left behind on failure.
    """
    path = Path(path)
    ort_compatible(model)
    directory = path.parent if str(path.parent) else Path(".")
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    os.close(fd)
    tmp = Path(tmp_name)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; the result should look like any new file
    external = exceeds_protobuf_limit(model)
    data_name = f"{path.name}.data"
    tmp_data = directory / f".{data_name}.tmp"
    try:
        if external:
            model = _detached_copy(model)  # external-data saving rewrites the tensors of the model it gets
            onnx.save_model(
                model,
                str(tmp),
                save_as_external_data=True,
                all_tensors_to_one_file=True,
                location=tmp_data.name,
                size_threshold=1024,
            )
            if tmp_data.exists():  # every tensor may have been under the threshold
                _relocate_external(tmp, tmp_data.name, data_name)
                os.replace(tmp_data, directory / data_name)
        else:
            onnx.save_model(model, str(tmp))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        tmp_data.unlink(missing_ok=True)
        raise
    return path


def exceeds_protobuf_limit(model: onnx.ModelProto) -> bool:
    """Whether the model is too large to serialize as one protobuf (tensor payloads + a margin for the rest).

    ``ModelProto.ByteSize()`` walks every byte (0.7 s for a 100 MB ResNet-50); payload lengths are free.
    """
    payload = 0
    graphs = [model.graph, *(a.g for n in model.graph.node for a in n.attribute if a.type == a.GRAPH)]
    for graph in graphs:
        tensors = [*graph.initializer, *(a.t for n in graph.node for a in n.attribute if a.type == a.TENSOR)]
        for tensor in tensors:
            payload += len(tensor.raw_data) + 8 * (
                len(tensor.float_data) + len(tensor.int32_data) + len(tensor.int64_data) + len(tensor.double_data)
            )
    return payload + _METADATA_MARGIN >= _PROTOBUF_LIMIT


def _detached_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def _relocate_external(model_path: Path, old_location: str, new_location: str) -> None:
    """Point the saved model's external-data references at the final data file name."""
    saved = onnx.load(str(model_path), load_external_data=False)
    for tensor in onnx.external_data_helper._get_all_tensors(saved):
        for entry in tensor.external_data:
            if entry.key == "location" and entry.value == old_location:
                entry.value = new_location
    onnx.save_model(saved, str(model_path))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
