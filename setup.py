"""Builds the compiled parts of bnfuse: the onnxruntime custom-op library entry point, and the oneDNN glue.

The entry point only exports ``RegisterCustomOps`` and forwards it to a Python callback
(see the ``bnfuse/runtime/ortabi`` package); it does not link against onnxruntime or Python.
``_onednn`` (bnfuse/runtime/onednn.c) is the Python face of the oneDNN convolution-gradient core
(bnfuse/runtime/native/onednn_*.c), which dlopen()s oneDNN from the installed ``onednn-cpu-gomp`` wheel at run time:
the build needs neither oneDNN nor its headers.
"""

import sys

from setuptools import Extension, setup

extensions = [
    Extension(
        "bnfuse.runtime._ortentry",
        sources=["bnfuse/runtime/ortentry.c"],
        # no FMA contraction: the fused optimizer steps give the bits of the separate ONNX nodes
        extra_compile_args=[
            "-O2",
            "-fvisibility=hidden",
            "-ffp-contract=off",
            "-fno-math-errno",
            "-fvect-cost-model=dynamic",
        ],  # fmt: skip
        libraries=["m"],
    ),
    # the CPU BN kernels (cpu.py, cpu_pool.py, cpu_entry.py): omp simd reductions (-fopenmp-simd needs no OpenMP
    # runtime), strict IEEE elementwise (no FMA contraction), NaN / Inf kept (no -ffast-math)
    Extension(
        "bnfuse.runtime._cpukernels",
        sources=[f"bnfuse/runtime/{name}.c" for name in ("cpukernels", "cpureduce", "cpuloops", "cpuserial")],
        depends=["bnfuse/runtime/cpukernels.h"],
        extra_compile_args=[
            "-O3",
            "-fvisibility=hidden",
            "-fopenmp-simd",
            "-ffp-contract=off",
            "-fno-math-errno",
            "-fno-trapping-math",
            "-Wno-psabi",
        ],  # fmt: skip
        libraries=["m", "pthread"],
    ),
]
if sys.platform.startswith("linux"):  # the onednn-cpu-gomp wheel is Linux x86-64 only
    extensions.append(
        Extension(
            "bnfuse.runtime._onednn",
            # the Python face over the Python-free core in runtime/native/ (the native library compiles the same core)
            sources=["bnfuse/runtime/onednn.c"]
            + [f"bnfuse/runtime/native/onednn_{name}.c" for name in ("load", "plan", "split", "conv")],
            depends=[f"bnfuse/runtime/native/onednn_{name}.h" for name in ("conv", "dnnl", "split")],
            extra_compile_args=["-O2", "-fvisibility=hidden", "-ffp-contract=off"],
            libraries=["dl", "pthread"],
        )
    )

setup(ext_modules=extensions)
