"""The custom-op library (``_ortentry``, built from bnfuse/runtime/native/): loading it, the hook installed into it
for the ops that stay in Python (native/python_hook.c), and the counters it keeps. Loaded once; it and its callbacks
live as long as the process."""

from __future__ import annotations

import ctypes
import importlib.machinery
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bnfuse.runtime.ortabi import tensors
from bnfuse.runtime.ortabi.api import API_VERSION, ORT_FAIL, OrtApi, OrtError
from bnfuse.runtime.ortabi.custom_ops import (
    _CREATE_KERNEL_V2,
    _DESTROY,
    _ENTRY_FUNCTIONS,
    OP_INFO_OFFSET,
    OpSpec,
    _describe,
    _keep_for_process,
    _registry,
)


def _finalizing_function() -> int:
    """The address of the interpreter's ``Py_IsFinalizing`` (``_Py_IsFinalizing`` before Python 3.13)."""
    for name in ("Py_IsFinalizing", "_Py_IsFinalizing"):
        function = getattr(ctypes.pythonapi, name, None)
        if function is not None:
            return ctypes.cast(function, ctypes.c_void_p).value or 0
    raise OrtError("this Python exports neither Py_IsFinalizing nor _Py_IsFinalizing")


# (session options, api base, the domain RegisterCustomOps fills, int *with_native): the Python ops join the native
# ones' domain; with_native set to 0 leaves the native BN ops out (the Python side registers its CPU BN kernels)
_REGISTER = ctypes.CFUNCTYPE(
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)
)
_SET_PYTHON = (ctypes.c_void_p, _CREATE_KERNEL_V2, _DESTROY, ctypes.c_size_t)

# The op specs to register for a given session options, and whether the native BN ops join them: ops.py supplies it.
OpsProvider = Callable[[], tuple[str, Sequence[OpSpec], bool]]


class _Entry:
    """The loaded entry library and the RegisterCustomOps callback installed into it."""

    def __init__(self, path: Path, provider: OpsProvider) -> None:
        self.path = path
        self.provider = provider
        self.library = ctypes.CDLL(str(path))
        functions = {field: getattr(self.library, name, None) for field, name in _ENTRY_FUNCTIONS.items()}
        set_python = getattr(self.library, "bnfuse_set_python", None)
        if set_python is None or None in functions.values():
            raise OrtError("bnfuse's entry library does not match bnfuse.runtime.ortabi: rebuild it (pip install -e .)")
        _keep_for_process(self)  # the library's callbacks into Python live as long as the process
        set_python.argtypes, set_python.restype = _SET_PYTHON, None
        callbacks = _registry.callbacks
        set_python(_finalizing_function(), callbacks["CreateKernelV2"], callbacks["KernelDestroy"], OP_INFO_OFFSET)
        self.callback = _REGISTER(self._register)
        self.library.bnfuse_set_register_callback.argtypes = (_REGISTER,)
        self.library.bnfuse_set_register_callback.restype = None
        self.library.bnfuse_set_register_callback(self.callback)
        _registry.entry_functions = {
            field: ctypes.cast(function, ctypes.c_void_p).value or 0 for field, function in functions.items()
        }

    def _register(self, session_options: int, api_base: int, domain: int, with_native: Any) -> int | None:
        try:
            api = _registry.api
            if api is None:
                api = OrtApi.from_api_base(api_base)
                tensors.bind_hot_path(self.library, api)
                _registry.api = api
        except BaseException:  # noqa: B036 - without the API no status can be made; the C side has one
            return _fallback_status(api_base)
        try:
            with _registry.lock:
                _, specs, native = self.provider()
                _registry.add_ops(api, domain, specs)
            with_native[0] = int(native)
            return None
        except BaseException as exc:  # noqa: B036 - nothing may unwind into onnxruntime
            return api.make_status(f"bnfuse custom ops: {_describe(exc)}")


def _fallback_status(api_base: int) -> int | None:
    """An OrtStatus made through the oldest API table, for runtimes too old for :data:`API_VERSION`."""
    get_api = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32)(ctypes.c_void_p.from_address(api_base).value)
    table = get_api(1)
    if not table:
        return None
    create_status = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p)(
        ctypes.c_void_p.from_address(table).value
    )
    return create_status(ORT_FAIL, f"bnfuse custom ops need onnxruntime C API version {API_VERSION}".encode())


_entry: _Entry | None = None
_entry_lock = threading.Lock()


def entry_library_path() -> Path:
    """The built entry library in bnfuse/runtime, next to this package (``_ortentry`` + the interpreter's extension
    suffix)."""
    here = Path(__file__).resolve().parent.parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"_ortentry{suffix}"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"bnfuse's onnxruntime entry library is not built in {here} (run `pip install -e .` or reinstall bnfuse)"
    )


def install(provider: OpsProvider) -> Path:
    """Load the entry library and install the RegisterCustomOps callback; returns the library's path.

    Idempotent: later calls keep the first callback (and its op set provider).
    """
    global _entry
    with _entry_lock:
        if _entry is None:
            _entry = _Entry(entry_library_path(), provider)
        return _entry.path


def native_call_count() -> int:
    """How many kernel calls of the native ops (native/register.c) onnxruntime has made in this process."""
    if _entry is None:
        return 0
    function = _entry.library.bnfuse_native_calls
    function.restype, function.argtypes = ctypes.c_int64, ()
    return int(function())


def ort_api() -> OrtApi:
    """The OrtApi table once onnxruntime has registered the library in some session options."""
    return _registry.ortapi()


def live_kernel_count() -> int:
    """How many kernels onnxruntime currently holds (created and not yet destroyed)."""
    return len(_registry.kernels)


def refused_call_count() -> int:
    """How many calls the entry library answered without Python because the interpreter was finalizing."""
    if _entry is None:
        return 0
    function = _entry.library.bnfuse_refused_calls
    function.restype, function.argtypes = ctypes.c_int64, ()
    return int(function())
