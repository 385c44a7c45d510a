"""OpenMP's settings belong to whoever else runs in the process (PyTorch reads ``omp_get_max_threads`` for its
intra-op threads): :func:`openmp_settings_kept` puts back every loaded OpenMP runtime's thread count, dynamic
adjustment and nesting after code that may change them (an OpenMP layer may set them when it starts)."""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

# Shared-object names of the OpenMP runtimes in the wild: GNU (PyTorch's and oneDNN's wheels), Intel, LLVM.
_OPENMP_LIBRARIES = ("libgomp", "libiomp5", "libomp")
_openmp_handles: dict[str, ctypes.CDLL] = {}


def _loaded_openmp_runtimes() -> dict[str, ctypes.CDLL]:
    """Every OpenMP runtime this process has loaded, by path (Linux: from /proc/self/maps), opened without
    loading anything. Several copies may be loaded at once (wheels bundle their own); each has its own settings."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {parts[5].strip() for parts in (line.split(None, 5) for line in maps) if len(parts) == 6}
    except OSError:  # not Linux: nothing to read the settings through
        return {}
    found: dict[str, ctypes.CDLL] = {}
    for path in sorted(paths):
        name = os.path.basename(path)
        if not (name.startswith(_OPENMP_LIBRARIES) and ".so" in name):
            continue
        handle = _openmp_handles.get(path)
        if handle is None:
            try:
                handle = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
                getattr(handle, "omp_get_max_threads")  # noqa: B009 - a library named like one, without OpenMP
            except (OSError, AttributeError):
                continue
            _openmp_handles[path] = handle
        found[path] = handle
    return found


def _openmp_settings_of(handle: ctypes.CDLL) -> tuple[int, int, int]:
    """(omp_get_max_threads, omp_get_dynamic, omp_get_max_active_levels) of one runtime, for the calling thread."""
    levels = getattr(handle, "omp_get_max_active_levels", None) or handle.omp_get_nested
    return int(handle.omp_get_max_threads()), int(handle.omp_get_dynamic()), int(levels())


def openmp_settings() -> dict[str, tuple[int, int, int]]:
    """The calling thread's OpenMP settings in every loaded OpenMP runtime, by library path: (max threads,
    dynamic adjustment, max active levels). Empty where none is loaded (or on a system without /proc)."""
    return {path: _openmp_settings_of(handle) for path, handle in _loaded_openmp_runtimes().items()}


@contextlib.contextmanager
def openmp_settings_kept() -> Iterator[None]:
    """Put back, on the calling thread, the settings every OpenMP runtime loaded before the block had then
    (only changed values are written). A runtime first loaded inside the block had no settings anyone could
    have set; it is left as the block leaves it."""
    saved = {path: (handle, _openmp_settings_of(handle)) for path, handle in _loaded_openmp_runtimes().items()}
    try:
        yield
    finally:
        for handle, (threads, dynamic, levels) in saved.values():
            now_threads, now_dynamic, now_levels = _openmp_settings_of(handle)
            if now_threads != threads:
                handle.omp_set_num_threads(threads)
            if now_dynamic != dynamic:
                handle.omp_set_dynamic(dynamic)
            if now_levels != levels:
                setter = getattr(handle, "omp_set_max_active_levels", None)
                if setter is not None:
                    setter(levels)
                else:
                    handle.omp_set_nested(levels > 1)
