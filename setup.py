"""Builds the compiled parts of bnfuse: the onnxruntime custom-op library, the CPU kernels' Python extension, and
the oneDNN glue.

``_ortentry`` is the custom-op library (bnfuse/runtime/native/): it exports ``RegisterCustomOps`` and defines,
creates and computes every CPU op of the domain ``bnfuse`` in C, linking neither onnxruntime nor Python (a process
that never imports bnfuse registers it too). ``bnfuse/runtime/native/Makefile`` builds the same file without Python.
``_cpukernels`` is the same C kernels as a Python extension for cpu.py's direct calls. ``_onednn``
(bnfuse/runtime/onednn.c) is the Python face of the oneDNN convolution-gradient core
(bnfuse/runtime/native/onednn_*.c), which dlopen()s oneDNN from the installed ``onednn-cpu-gomp`` wheel at run time:
the build needs neither oneDNN nor its headers.
"""

import sys

from setuptools import Extension, setup

NATIVE = "bnfuse/runtime/native"
KERNELS = [f"{NATIVE}/{name}.c" for name in ("cpureduce", "cpuloops", "cpuserial")]
LIBRARY = [
    f"{NATIVE}/{name}.c"
    for name in ("register", "python_hook", "common", "bn_ops", "bn_pooled", "optimizer_ops", "conv_ops")
]
ONEDNN_CORE = [f"{NATIVE}/onednn_{name}.c" for name in ("load", "plan", "split", "conv", "direct", "gemm")]
ONEDNN_HEADERS = [f"{NATIVE}/onednn_{name}.h" for name in ("conv", "dnnl", "split", "direct", "gemm")]
# The flags of native/Makefile: omp simd reductions (-fopenmp-simd needs no OpenMP runtime), strict IEEE elementwise
# (no FMA contraction: the fused optimizer steps give the bits of the separate ONNX nodes), NaN / Inf kept.
FLAGS = [
    "-O3",
    "-fvisibility=hidden",
    "-fopenmp-simd",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-Wno-psabi",
]
HEADERS = [f"{NATIVE}/{name}.h" for name in ("cpukernels", "ort_api", "common", "schema", "native_ops", "bn_pooled")]

extensions = [
    Extension(
        "bnfuse.runtime._ortentry",
        sources=LIBRARY + KERNELS + ONEDNN_CORE,
        depends=[
            *HEADERS,
            *ONEDNN_HEADERS,
            f"{NATIVE}/exports.map",
        ],
        extra_compile_args=FLAGS,
        extra_link_args=[f"-Wl,--version-script={NATIVE}/exports.map"],
        libraries=["m", "pthread", "dl"],
    ),
    Extension(
        "bnfuse.runtime._cpukernels",
        sources=[f"{NATIVE}/cpukernels.c", *KERNELS],
        depends=HEADERS,
        extra_compile_args=FLAGS,
        libraries=["m", "pthread"],
    ),
]
if sys.platform.startswith("linux"):  # the onednn-cpu-gomp wheel is Linux x86-64 only
    extensions.append(
        Extension(
            "bnfuse.runtime._onednn",
            # the Python face over the Python-free core in runtime/native/ (the native library compiles the same core)
            sources=["bnfuse/runtime/onednn.c", *ONEDNN_CORE],
            depends=ONEDNN_HEADERS,
            extra_compile_args=["-O2", "-fvisibility=hidden", "-ffp-contract=off"],
            libraries=["dl", "pthread"],
        )
    )

setup(ext_modules=extensions)
