"""Loading and saving ONNX models: clear errors on bad input, atomic writes, ORT-loadable IR version."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import onnx
from onnx import external_data_helper

from bnfuse.errors import ModelError
from bnfuse.protowire import PayloadStore, WireFormatError, map_model, payload_index

# onnxruntime 1.31 reads IR version 13 at most; onnx 1.23 writes 14 by default.
MAX_IR_VERSION = 13
# Models above 2 GiB cannot be serialized as one protobuf; save their tensors as external data.
_PROTOBUF_LIMIT = 2**31 - 1
_METADATA_MARGIN = 64 * 2**20  # nodes, names, small attributes: generous for any real model


def load_model(path: str | os.PathLike[str], *, check: bool = True) -> onnx.ModelProto:
    """Read an ONNX model (external data included) or raise ModelError with one clear line."""
    return read_model(path, check=check)[0]


def read_model(path: str | os.PathLike[str], *, check: bool = True) -> tuple[onnx.ModelProto, bool]:
    """``load_model`` plus whether the file kept its tensors as external data (so a rewrite can keep that)."""
    path = Path(path)
    if not path.exists():
        raise ModelError(f"{path}: no such file")
    if path.is_dir():
        raise ModelError(f"{path}: is a directory, not an ONNX file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises DecodeError, RuntimeWarning-like or OSError
        raise ModelError(f"{path}: not a readable ONNX model ({_first_line(exc)})") from exc
    if not _has_graph(model):
        raise ModelError(f"{path}: not an ONNX model (no graph)")
    external = any(external_data_helper.uses_external_data(t) for t in external_data_helper._get_all_tensors(model))
    if external:
        try:
            external_data_helper.load_external_data_for_model(model, str(path.parent))
        except Exception as exc:  # a missing or short data file
            raise ModelError(f"{path}: cannot read its external data ({_first_line(exc)})") from exc
    if check:
        check_model(model, what=str(path))
    return model, external


def read_mapped(path: str | os.PathLike[str]) -> tuple[onnx.ModelProto, PayloadStore] | None:
    """The model with its large weights left in a read-only memory map (see bnfuse.protowire).

    None when the file needs ``read_model`` instead: external data, too large for one protobuf, or not
    scannable (``read_model`` then says what is wrong with it).
    """
    path = Path(path)
    try:
        if not path.is_file() or path.stat().st_size + _METADATA_MARGIN >= _PROTOBUF_LIMIT:
            return None
        model, store = map_model(path)
    except (OSError, WireFormatError):
        return None
    if not _has_graph(model):
        return None
    tensors = external_data_helper._get_all_tensors(model)
    if any(external_data_helper.uses_external_data(t) and payload_index(t) is None for t in tensors):
        return None
    return model, store


def _has_graph(model: onnx.ModelProto) -> bool:
    """Whether the parse found a graph at all (protobuf parses many non-ONNX files into empty messages)."""
    return model.HasField("graph") and bool(model.graph.node or model.graph.output)


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


def save_model(
    model: onnx.ModelProto,
    path: str | os.PathLike[str],
    *,
    external_data: bool = False,
    extra_files: Mapping[str | os.PathLike[str], bytes] | None = None,
) -> Path:
    """Write a model atomically: temporary files in the target directories, then renames.

    ``external_data`` (and any model over the 2 GiB protobuf limit) puts tensors of 1 KiB or more in one
    ``<name>.data`` file beside the model. ``extra_files`` (path -> bytes, such as a JSON report) are
    written in the same transaction: every file is complete before the first rename, and when any step
    fails, nothing new is left behind (a file that existed before may have been replaced by then only if
    a later rename fails, which needs the target to vanish or become a directory mid-way).
    """
    path = Path(path)
    ort_compatible(model)
    staging = Staging()
    try:
        external = external_data or exceeds_protobuf_limit(model)
        if external:
            tmp_data = staging.stage(path.with_name(f"{path.name}.data"))
            tmp = staging.stage(path)
            model = _detached_copy(model)  # external-data saving rewrites the tensors of the model it gets
            onnx.save_model(
                model,
                str(tmp),
                save_as_external_data=True,
                all_tensors_to_one_file=True,
                location=tmp_data.name,
                size_threshold=1024,
            )
            if tmp_data.stat().st_size == 0:  # every tensor was under the threshold
                staging.drop(tmp_data)
            else:
                _relocate_external(tmp, tmp_data.name, f"{path.name}.data")
        else:
            tmp = staging.stage(path)
            onnx.save_model(model, str(tmp))
        for extra, data in (extra_files or {}).items():
            staging.stage(Path(extra)).write_bytes(data)
        staging.commit()
    except BaseException:
        staging.abort()
        raise
    return path


def write_files(files: Mapping[str | os.PathLike[str], bytes]) -> None:
    """Write files atomically as one transaction (see save_model)."""
    staging = Staging()
    try:
        for target, data in files.items():
            staging.stage(Path(target)).write_bytes(data)
        staging.commit()
    except BaseException:
        staging.abort()
        raise


class Staging:
    """Temporary files beside their targets, renamed into place together; undone on failure."""

    def __init__(self) -> None:
        self._files: list[tuple[Path, Path]] = []  # (temporary, target), in commit order
        self._created_dirs: list[Path] = []

    def stage(self, target: Path) -> Path:
        directory = target.parent if str(target.parent) else Path(".")
        self._make_directory(directory, target)
        if target.is_dir():
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(target))
        try:
            fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
        except OSError as exc:
            raise type(exc)(exc.errno, exc.strerror, str(target)) from exc
        os.close(fd)
        tmp = Path(name)
        self._files.append((tmp, target))
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; the result should look like any new file
        return tmp

    def drop(self, tmp: Path) -> None:
        self._files = [(t, target) for t, target in self._files if t != tmp]
        tmp.unlink(missing_ok=True)

    def commit(self) -> None:
        done: list[Path] = []
        try:
            for tmp, target in self._files:
                existed = os.path.lexists(target)
                os.replace(tmp, target)
                if not existed:
                    done.append(target)
        except BaseException:
            for target in done:
                target.unlink(missing_ok=True)
            raise
        self._files = []

    def abort(self) -> None:
        for tmp, _ in self._files:
            tmp.unlink(missing_ok=True)
        self._files = []
        for directory in reversed(self._created_dirs):
            try:
                directory.rmdir()
            except OSError:
                break

    def _make_directory(self, directory: Path, target: Path) -> None:
        missing = []
        ancestor = directory
        while not ancestor.exists():
            if ancestor.is_symlink():  # a dangling link: let mkdir report it
                break
            missing.append(ancestor)
            ancestor = ancestor.parent
        if ancestor.exists() and not ancestor.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"{ancestor} is not a directory", str(target))
        for created in reversed(missing):
            try:
                created.mkdir()
            except FileExistsError:
                continue
            except OSError as exc:
                raise type(exc)(exc.errno, exc.strerror, str(target)) from exc
            self._created_dirs.append(created)


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
    for tensor in external_data_helper._get_all_tensors(saved):
        for entry in tensor.external_data:
            if entry.key == "location" and entry.value == old_location:
                entry.value = new_location
    onnx.save_model(saved, str(model_path))


def _first_line(exc: BaseException) -> str:
    """The error text as one line: lines joined (the checker puts the node name on a later line), then cut."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]
