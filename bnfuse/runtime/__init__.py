"""bnfuse runtime: BN kernels and their onnxruntime custom-op library (domain ``bnfuse``)."""
