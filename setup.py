"""Builds the one compiled part of bnfuse: the onnxruntime custom-op library entry point.

The shared object only exports ``RegisterCustomOps`` and forwards it to a Python callback
(see ``bnfuse/runtime/ortabi.py``); it does not link against onnxruntime or Python.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "bnfuse.runtime._ortentry",
            sources=["bnfuse/runtime/ortentry.c"],
            extra_compile_args=["-O2", "-fvisibility=hidden"],
        )
    ]
)
