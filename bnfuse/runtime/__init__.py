"""bnfuse runtime: BN kernels and their onnxruntime custom-op library (domain ``bnfuse``).

Use the ops in a plain onnxruntime session::

    import onnxruntime
    from bnfuse.runtime import session_options

    session = onnxruntime.InferenceSession("model.onnx", session_options(), providers=["CPUExecutionProvider"])

or register the library yourself with ``options.register_custom_ops_library(library_path())``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from bnfuse.errors import BnfuseError

if TYPE_CHECKING:
    import onnxruntime

__all__ = ["DOMAIN", "library_path", "register_library", "session_options"]

DOMAIN = "bnfuse"
REGISTERED_KEY = "bnfuse.custom_ops_registered"  # session config entry marking options that have the library


def library_path() -> str:
    """Path of the custom-op library to pass to ``SessionOptions.register_custom_ops_library``.

    The file is bnfuse's native custom-op library: any onnxruntime host registers it and gets the CPU ops (no
    Python needed). Calling this also installs, in this process, the hook through which the library adds the ops
    that stay in Python (CUDA kernels, collective ops, the convolution gradients). Options you build yourself keep
    onnxruntime's default spinning pool threads; measured side by side, bnfuse's ops are no slower for them, small
    tensors or large (bench/RESULTS.md; docs/ops.md, "Execution").
    """
    from bnfuse.runtime import ortabi, registry

    try:
        return str(ortabi.install(registry.registration))
    except FileNotFoundError as exc:
        raise BnfuseError(str(exc)) from None


def session_options(
    providers: Iterable[str] | None = None, *, spinning: bool = False, **attributes: Any
) -> onnxruntime.SessionOptions:
    """A new ``onnxruntime.SessionOptions`` with bnfuse's ops registered.

    ``providers``: execution providers to register kernels for, as given to InferenceSession (names or
    (name, options) pairs). CPU kernels are always registered (ORT's fallback provider); CUDA kernels
    when CUDAExecutionProvider is asked for and this onnxruntime build has it (default: whenever it has it).
    ``spinning``: let ORT's idle pool threads busy-wait for work (ORT's default). Off by default: spinning
    threads took the cores bnfuse's multi-threaded CPU kernels ran on, small tensors included (measured 5x
    slower on 2 cores). Small tensors now run on the calling thread only, and bench/RESULTS.md shows no op
    slower with spinning, and a ResNet-50-shaped training step on tiny tensors faster with it.
    ``attributes`` are set on the options, e.g. ``execution_mode=onnxruntime.ExecutionMode.ORT_PARALLEL``
    or ``intra_op_num_threads=1``.
    """
    import onnxruntime

    options = onnxruntime.SessionOptions()
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    for name, value in attributes.items():
        if name.startswith("_") or not hasattr(options, name):
            raise BnfuseError(f"onnxruntime.SessionOptions has no attribute {name!r}")
        setattr(options, name, value)
    return register_library(options, providers)


def register_library(
    options: onnxruntime.SessionOptions, providers: Iterable[Any] | None = None
) -> onnxruntime.SessionOptions:
    """Register bnfuse's ops into existing options (e.g. a caller's, with its own thread settings); returns them.

    Options that went through here (or :func:`session_options`) carry a marker and are left as they are:
    onnxruntime refuses a session whose options register the domain twice ("Domain already set in registry").
    ``providers`` as for :func:`session_options`.
    """
    from bnfuse.runtime import ops, registry

    try:
        if options.get_session_config_entry(REGISTERED_KEY) == "1":
            return options
    except RuntimeError:  # onnxruntime's answer for a key never set
        pass
    available = registry.available_providers()
    wanted = available if providers is None else tuple(p for p in _provider_names(providers) if p in available)
    path = library_path()
    with registry.registering_for((ops.CPU, *wanted)):
        options.register_custom_ops_library(path)
    options.add_session_config_entry(REGISTERED_KEY, "1")
    return options


def _provider_names(providers: Iterable[Any]) -> tuple[str, ...]:
    """Provider names from an InferenceSession-style list: names or (name, options) pairs."""
    return tuple(p[0] if isinstance(p, tuple | list) else str(p) for p in providers)
