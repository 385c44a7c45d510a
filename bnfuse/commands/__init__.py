"""The subcommands of `bnfuse` (bnfuse/cli.py assembles them): one module each, with its arguments (`add`) and
its handler, a thin shell over the Python API. Imports run one way: bnfuse.cli -> these -> the API modules."""
