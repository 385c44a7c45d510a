"""numba ``cfunc`` s cached on disk, recompiled when the module whose functions they compile in has changed.

numba's cache checks only the source file of the cached function itself; the C entry points of cpu_entry.py and
cpu_pool.py compile cpu.py's kernels into themselves, so after an edit of cpu.py (a ``git pull`` on an editable
install) numba would load the old machine code. :func:`cfunc` keeps a digest of the dependency's source beside
numba's cache files and drops the function's cache entries when the digest differs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any


def source_digest(module: ModuleType) -> str:
    return hashlib.sha256(Path(module.__file__ or "").read_bytes()).hexdigest()


def cfunc(function: Callable[..., Any], signature: Any, depends_on: ModuleType, **options: Any) -> Any:
    """``numba.cfunc(signature, nopython=True, cache=True, **options)(function)``, recompiled when
    ``depends_on`` 's source differs from the one the cached code was compiled against."""
    from numba.core import sigutils
    from numba.core.ccallback import CFunc

    options = {"nopython": True, **options}
    compiled = CFunc(function, sigutils.normalize_signature(signature), locals={}, options=options)
    compiled.enable_caching()
    digest = source_digest(depends_on)
    marker = Path(compiled._cache.cache_path) / f"{function.__module__}.{function.__qualname__}.depends"
    try:
        current = marker.read_text() == digest
    except OSError:
        current = False
    if not current:
        compiled._cache.flush()  # the index of this function: its old entries are never loaded again
    compiled.compile()
    if not current:
        try:
            marker.write_text(digest)
        except OSError:  # a read-only cache directory: numba then does not save either
            pass
    return compiled
