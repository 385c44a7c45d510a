"""Errors bnfuse reports to users as one line (the CLI turns them into exit code 2)."""


class BnfuseError(Exception):
    """An error caused by the user's input: a bad file, model, option or tensor."""


class ModelError(BnfuseError):
    """The input is not a usable ONNX model (missing, not ONNX, truncated, invalid, unsupported)."""


class CheckFailedError(BnfuseError):
    """The numerical proof of a rewrite failed: outputs differ beyond tolerance."""


class DestinationError(BnfuseError):
    """An output path bnfuse refuses to write: a file the input reads, a link, a device, a FIFO, named twice."""
