"""Loading and saving ONNX models: clear errors on bad input, atomic writes, ORT-loadable IR version."""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import BinaryIO

import onnx
from onnx import external_data_helper

from bnfuse.errors import DestinationError, ModelError
from bnfuse.protowire import PayloadStore, WireFormatError, map_model, write_external
from bnfuse.tensorcheck import check_strings, check_tensors, printable_name, tensor_nbytes, type_name

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
    model, files = read_model_files(path, check=check)
    return model, len(files) > 1


def read_model_files(path: str | os.PathLike[str], *, check: bool = True) -> tuple[onnx.ModelProto, list[Path]]:
    """``load_model`` plus every file it read: the model, then its external-data files (resolved paths).

    An external-data location must name a regular file inside the model's directory (a relative path
    without ``..``, not leaving the directory through a link), and its offset and length must hold exactly
    the tensor's bytes; anything else is a ModelError.
    """
    path = Path(path)
    require_regular_file(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises DecodeError, RuntimeWarning-like or OSError
        raise ModelError(f"{path}: not a readable ONNX model ({_first_line(exc)})") from exc
    if not _has_graph(model):
        raise ModelError(f"{path}: not an ONNX model (no graph)")
    check_strings(model, what=str(path))
    files = [path.resolve(), *_load_external_data(model, path)]
    check_tensors(model, what=str(path))
    if check:
        check_model(model, what=str(path))
    return model, files


def require_regular_file(path: Path) -> None:
    """ModelError unless ``path`` is a regular file (a FIFO would block, /dev/zero never ends)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ModelError(f"{path}: no such file") from None
    except OSError as exc:
        raise ModelError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if stat.S_ISDIR(mode):
        raise ModelError(f"{path}: is a directory, not an ONNX file")
    if not stat.S_ISREG(mode):
        raise ModelError(f"{path}: not a regular file (a device, FIFO or socket); refusing to read it")


def _load_external_data(model: onnx.ModelProto, path: Path) -> list[Path]:
    """Read every external tensor's bytes into its raw_data; returns the data files read (resolved, once each)."""
    base = path.resolve().parent
    files: dict[Path, tuple[int, BinaryIO]] = {}
    try:
        for tensor in external_data_helper._get_all_tensors(model):
            if not external_data_helper.uses_external_data(tensor):
                continue
            what = f"{path}: tensor '{printable_name(tensor.name)}'"
            entries = {e.key: e.value for e in tensor.external_data}
            data_file = _external_file(entries.get("location", ""), base, what)
            if data_file not in files:
                try:
                    require_regular_file(data_file)
                except ModelError as exc:
                    raise ModelError(f"{path}: cannot read its external data ({exc})") from None
                handle = open(data_file, "rb")  # noqa: SIM115 (closed below, all together)
                files[data_file] = (os.fstat(handle.fileno()).st_size, handle)
            size, handle = files[data_file]
            need = tensor_nbytes(tensor, what)
            if need is None:
                raise ModelError(f"{what}: a {type_name(tensor.data_type)} tensor cannot be stored as external data")
            offset = _external_int(entries, "offset", 0, what)
            length = _external_int(entries, "length", need, what)
            if length != need:
                raise ModelError(f"{what}: external data length {length} but its dims and type need {need} bytes")
            if offset + need > size:
                raise ModelError(
                    f"{what}: external data ends at byte {offset + need}, past the end of its file ({size})"
                )
            handle.seek(offset)
            tensor.raw_data = handle.read(need)
            del tensor.external_data[:]
            tensor.ClearField("data_location")
    except OSError as exc:
        raise ModelError(f"{path}: cannot read its external data ({exc.strerror or exc})") from None
    finally:
        for _, handle in files.values():
            handle.close()
    return list(files)


def _external_file(location: str, base: Path, what: str) -> Path:
    """The data file an external-data location names: only ever a file inside the model's directory."""
    pure = PurePosixPath(location.replace("\\", "/"))
    if not location or "\0" in location or pure.is_absolute() or PureWindowsPath(location).drive or ".." in pure.parts:
        raise ModelError(
            f"{what}: external data location {location[:80]!r} is not a relative path inside the model's directory"
        )
    try:
        target = (base / pure).resolve()
    except (OSError, RuntimeError) as exc:  # a loop of links
        raise ModelError(f"{what}: external data location {location[:80]!r} cannot be resolved ({exc})") from None
    if not target.is_relative_to(base):
        raise ModelError(f"{what}: external data location {location[:80]!r} leads out of the model's directory")
    return target


def _external_int(entries: Mapping[str, str], key: str, default: int, what: str) -> int:
    if key not in entries:
        return default
    try:
        value = int(entries[key])
    except ValueError:
        value = -1
    if value < 0:
        raise ModelError(f"{what}: external data {key} {entries[key][:40]!r} is not a non-negative integer")
    return value


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
    if any(external_data_helper.uses_external_data(t) and store.array(t) is None for t in tensors):
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
            # Written here, not by onnx.save_model: onnx resolves the data file against the working directory.
            model = _detached_copy(model)  # external-data saving rewrites the tensors of the model it gets
            if not write_external(model, None, tmp, tmp_data, location=f"{path.name}.data"):
                staging.drop(tmp_data)  # every tensor was under the threshold
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


def refuse_destination_type(target: Path) -> None:
    """DestinationError when ``target`` exists as a symbolic link or as anything but a regular file.

    A link is refused rather than written through: renaming the new file into place would replace the
    link itself, and writing into its target would put the model (and its data file) somewhere else.
    """
    try:
        mode = os.lstat(target).st_mode
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise DestinationError(f"cannot write {target}: {exc.strerror}") from None
        return  # missing (fine), or a parent that is no directory: creating it names the problem
    if stat.S_ISLNK(mode):
        raise DestinationError(f"cannot write {target}: is a symbolic link; refusing to replace it (name its target)")
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        raise DestinationError(f"cannot write {target}: not a regular file (a device, FIFO or socket)")


def check_destinations(
    destinations: Mapping[str, Path | None],
    inputs: Sequence[Path],
    *,
    possible: Mapping[str, Path] | None = None,
    other_inputs: Mapping[str, Path] | None = None,
) -> None:
    """DestinationError unless the outputs (role -> path) are distinct, writable kinds and none is an input file.

    ``inputs`` are the files the input model reads (model, then external data); ``other_inputs`` more files
    read (label -> path). ``possible`` are outputs that may be written (an external-data file): checked
    against the others and the inputs only.
    Paths are compared after resolving ``..`` and links, so no spelling of an input gets through.
    """
    names = {p.resolve(): "input model's external data" for p in inputs[1:]}
    names.update({p.resolve(): label for label, p in (other_inputs or {}).items()})
    if inputs:
        names[inputs[0].resolve()] = "input model"
    seen: dict[Path, str] = {}
    for role, target in [*destinations.items(), *(possible or {}).items()]:
        if target is None:
            continue
        if role in destinations:
            refuse_destination_type(target)
            if target.is_dir():
                raise DestinationError(f"cannot write {target}: Is a directory")
        try:
            real = target.resolve()
        except OSError as exc:  # a loop of links
            raise DestinationError(f"cannot write {target}: {exc.strerror or exc}") from None
        if real in names:
            raise DestinationError(
                f"{target}: the {role} is a file the input reads; refusing to overwrite the {names[real]}"
            )
        if real in seen:
            raise DestinationError(f"{target}: named as both the {seen[real]} and the {role}; refusing")
        seen[real] = role


class Staging:
    """Temporary files beside their targets, renamed into place together; undone on failure."""

    def __init__(self) -> None:
        self._files: list[tuple[Path, Path]] = []  # (temporary, target), in commit order
        self._created_dirs: list[Path] = []

    def stage(self, target: Path) -> Path:
        directory = target.absolute().parent
        self._make_directory(directory, target)
        if target.is_dir():
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(target))
        refuse_destination_type(target)
        try:  # the name cut short so that the temporary name stays within NAME_MAX when the target's does
            fd, name = tempfile.mkstemp(prefix=f".{target.name[:200]}.", suffix=".tmp", dir=directory)
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


def _first_line(exc: BaseException) -> str:
    """The error text as one line: lines joined (the checker puts the node name on a later line), then cut."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]
