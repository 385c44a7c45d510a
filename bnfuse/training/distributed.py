"""Data-parallel training across processes: start-up checks, state broadcast, failure handling, data shards.

A distributed training graph (``bnfuse train-graph --distributed``) runs one ``session.run`` per step on every
rank; its collective ops use the communicator installed here (:mod:`bnfuse.runtime.collectives`). Use it as
``TrainingSession(train_model, comm=MPI.COMM_WORLD)`` under ``mpiexec -n N``; docs/distributed.md has the rest.

* :func:`attach` wraps the communicator, installs it for the collective ops and refuses to start (one line,
  on every rank) unless every rank has the same graph, onnxruntime version and collective schedule.
* :func:`broadcast_state` makes every rank start from rank 0's parameters.
* :class:`Watchdog` ends the job when a step makes no progress for ``timeout`` seconds (a rank that stopped
  answering); :func:`abort_on_error` ends it when any rank raises, naming the rank and the error.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx

from bnfuse.errors import BnfuseError
from bnfuse.runtime import collectives

DEFAULT_WATCHDOG_S = 300.0


class DistributedError(BnfuseError):
    """Ranks that cannot train together (mismatched graph, runtime or schedule)."""


def communicator(comm: Any = None) -> collectives.Communicator:
    """A bnfuse communicator: one given as is, else an mpi4py communicator (default ``COMM_WORLD``) wrapped."""
    if comm is not None and hasattr(comm, "allreduce_sum") and hasattr(comm, "allgather"):
        return comm
    try:
        return collectives.MpiCommunicator(comm)
    except ImportError:
        raise DistributedError("distributed training needs mpi4py: pip install 'bnfuse[mpi]'") from None


def fingerprint(model: onnx.ModelProto, schedule: list[str]) -> bytes:
    """SHA-256 of what must agree on every rank: the graph (nodes, interface, initializer names, shapes and
    types: values are broadcast from rank 0), the onnxruntime version and the collective schedule."""
    import onnxruntime

    digest = hashlib.sha256()
    graph = model.graph
    for item in [*graph.node, *graph.input, *graph.output]:
        digest.update(item.SerializeToString(deterministic=True))
    for tensor in graph.initializer:
        digest.update(f"{tensor.name}:{tensor.data_type}:{list(tensor.dims)};".encode())
    digest.update(f"onnxruntime {onnxruntime.__version__};".encode())
    digest.update("\n".join(schedule).encode())
    return digest.digest()


def attach(comm: Any, model: onnx.ModelProto) -> collectives.Communicator:
    """Wrap ``comm``, install it for the collective ops, and check that every rank runs the same step."""
    from bnfuse.passes.training.distribute import collective_schedule, is_distributed

    if not is_distributed(model):
        raise DistributedError("comm given but the training graph is not distributed (train-graph --distributed)")
    wrapped = communicator(comm)
    mine = np.frombuffer(fingerprint(model, collective_schedule(model)), np.uint8)
    every = np.asarray(wrapped.allgather(mine))
    differ = [rank for rank in range(wrapped.size) if not np.array_equal(every[rank], every[0])]
    if differ:
        raise DistributedError(
            f"rank(s) {', '.join(map(str, differ))} have a different training graph, onnxruntime version or "
            "collective schedule than rank 0: refusing to start"
        )
    collectives.install(wrapped)
    return wrapped


def broadcast_state(comm: collectives.Communicator, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rank 0's values of every state tensor, on every rank (in name order: the same on every rank)."""
    result = {}
    for name in sorted(state):
        array = np.ascontiguousarray(state[name]).copy()
        comm.broadcast(array)
        result[name] = array
    return result


def shard(count: int, rank: int, size: int) -> slice:
    """Rank ``rank``'s contiguous share of ``count`` samples (sizes differ by at most one)."""
    base, extra = divmod(count, size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


class Watchdog:
    """Ends the job (MPI_Abort) when an armed step runs longer than ``timeout`` seconds.

    One daemon thread for the session; ``with watchdog:`` arms it around a step. A blocked collective holds no
    Python lock that the thread needs (mpi4py releases the GIL while it waits).
    """

    def __init__(self, comm: collectives.Communicator, timeout: float, stream: Any = None) -> None:
        if not timeout > 0:
            raise DistributedError(f"watchdog timeout must be > 0 seconds, got {timeout}")
        self.comm, self.timeout = comm, float(timeout)
        self.stream = stream if stream is not None else sys.stderr
        self._deadline: float | None = None
        self._wake = threading.Event()
        threading.Thread(target=self._watch, name="bnfuse-watchdog", daemon=True).start()

    def __enter__(self) -> Watchdog:
        self._deadline = time.monotonic() + self.timeout
        self._wake.set()
        return self

    def __exit__(self, *exc: object) -> None:
        self._deadline = None

    def _watch(self) -> None:
        while True:
            deadline = self._deadline
            if deadline is None:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            left = deadline - time.monotonic()
            if left > 0:
                time.sleep(min(left, 0.5))
                continue
            print(
                f"bnfuse: rank {self.comm.rank}: a training step made no progress for {self.timeout:g} s "
                "(a rank stopped answering?): aborting the job",
                file=self.stream,
                flush=True,
            )
            self.comm.abort(3)
            return


def abort_on_error(comm: collectives.Communicator) -> Callable[..., None]:
    """Make an uncaught exception on this rank print ``bnfuse: rank R: error`` and end every rank (MPI_Abort);
    returns the previous excepthook."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, trace: types.TracebackType | None) -> None:
        if os.environ.get("BNFUSE_DEBUG"):
            previous(kind, error, trace)
        report_and_abort(comm, error)

    sys.excepthook = hook
    return previous


def report_and_abort(comm: collectives.Communicator, error: BaseException, code: int = 2) -> None:
    """Print one line naming the rank and the error, then end every rank of the job."""
    message = str(error) or type(error).__name__
    print(f"bnfuse: rank {comm.rank}: error: {message}", file=sys.stderr, flush=True)
    comm.abort(code)
