"""The communicator bnfuse's collective ops (:mod:`bnfuse.runtime.sync_ops`) run on: an existing engine, never a
home-made transport.

* :class:`MpiCommunicator` wraps an mpi4py communicator (host buffers: the CPU execution provider).
* :class:`NcclCommunicator` runs NCCL through CuPy (``cupy.cuda.nccl``) on device buffers, on the CUDA stream
  onnxruntime hands the kernel; its unique id is broadcast over MPI. Written against CuPy's documented API and
  never run here (no GPU): unverified.
* :class:`SingleProcess` is a world of one: every collective is the identity, so a graph with collective ops
  runs unchanged (and gives the non-distributed result) without MPI.

The process has one communicator for its collective ops at a time (:func:`use` / :func:`current`): one training
session per process, as MPI jobs run.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

ABORT_GRACE_S = 0.5  # seconds between a rank's last stderr line and MPI_Abort (see MpiCommunicator.abort)


class Communicator(Protocol):
    """What the collective ops need: rank and size, an all-gather and a summing all-reduce."""

    rank: int
    size: int

    def allgather(self, array: Any, stream: int = 0) -> Any:
        """Every rank's ``array`` stacked in rank order: shape (size, *array.shape)."""
        ...

    def allreduce_sum(self, array: Any, stream: int = 0) -> None:
        """Replace ``array`` (contiguous, writable) by its sum over the ranks, in place."""
        ...

    def broadcast(self, array: np.ndarray) -> None:
        """Overwrite host ``array`` with rank 0's, in place."""
        ...

    def abort(self, code: int = 1) -> None:
        """End every rank of the job now (MPI_Abort)."""
        ...


class SingleProcess:
    """A world of one rank: collectives copy or do nothing."""

    rank = 0
    size = 1

    def allgather(self, array: Any, stream: int = 0) -> Any:
        return array.reshape((1, *array.shape)).copy()

    def allreduce_sum(self, array: Any, stream: int = 0) -> None:
        return None

    def broadcast(self, array: np.ndarray) -> None:
        return None

    def abort(self, code: int = 1) -> None:
        import os

        os._exit(code)


class MpiCommunicator:
    """Collectives over an mpi4py communicator (``mpi4py.MPI.COMM_WORLD`` by default) on host arrays."""

    def __init__(self, comm: Any = None) -> None:
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = int(self.comm.Get_rank())
        self.size = int(self.comm.Get_size())
        self._mpi = MPI

    def allgather(self, array: Any, stream: int = 0) -> Any:
        send = np.ascontiguousarray(array)
        out = np.empty((self.size, *send.shape), send.dtype)
        self.comm.Allgather(send, out)
        return out

    def allreduce_sum(self, array: Any, stream: int = 0) -> None:
        if array.size:
            self.comm.Allreduce(self._mpi.IN_PLACE, array, op=self._mpi.SUM)
        else:  # every rank still takes part: a skipped call would pair with another rank's next collective
            self.comm.Barrier()

    def broadcast(self, array: np.ndarray) -> None:
        self.comm.Bcast(array, root=0)

    def abort(self, code: int = 1) -> None:
        # MPI_Abort tears the job down at once; mpiexec forwards a rank's stderr through its proxies, and a
        # line printed just before (the rank and its error) was lost in CI about once in ~10 runs. A short grace
        # lets that line reach the user first.
        sys.stderr.flush()
        time.sleep(ABORT_GRACE_S)
        self.comm.Abort(code)


_NCCL_TYPES = {"float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64", "int64": "NCCL_INT64", "float16": "NCCL_FLOAT16"}


class NcclCommunicator:
    """NCCL (through CuPy) for device arrays, one GPU per rank; the unique id goes over ``mpi`` (an
    :class:`MpiCommunicator`), which also serves host arrays and aborts. Unverified: no GPU where it was written.
    """

    def __init__(self, mpi: MpiCommunicator, device: int | None = None) -> None:
        import cupy
        from cupy.cuda import nccl

        self.mpi = mpi
        self.rank, self.size = mpi.rank, mpi.size
        self.device = device if device is not None else mpi.rank % cupy.cuda.runtime.getDeviceCount()
        uid = nccl.get_unique_id() if mpi.rank == 0 else None
        uid = mpi.comm.bcast(uid, root=0)
        with cupy.cuda.Device(self.device):
            self.comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        self._nccl = nccl
        self._cupy = cupy

    def _type(self, array: Any) -> int:
        return getattr(self._nccl, _NCCL_TYPES[str(array.dtype)])

    def allgather(self, array: Any, stream: int = 0) -> Any:
        if isinstance(array, np.ndarray):
            return self.mpi.allgather(array)
        send = self._cupy.ascontiguousarray(array)
        out = self._cupy.empty((self.size, *send.shape), send.dtype)
        self.comm.allGather(send.data.ptr, out.data.ptr, send.size, self._type(send), stream)
        return out

    def allreduce_sum(self, array: Any, stream: int = 0) -> None:
        if isinstance(array, np.ndarray):
            self.mpi.allreduce_sum(array)
            return
        ptr = array.data.ptr
        self.comm.allReduce(ptr, ptr, array.size, self._type(array), self._nccl.NCCL_SUM, stream)

    def broadcast(self, array: np.ndarray) -> None:
        self.mpi.broadcast(array)

    def abort(self, code: int = 1) -> None:
        self.mpi.abort(code)


_current: Communicator = SingleProcess()
_lock = threading.Lock()


def current() -> Communicator:
    """The communicator the collective ops use now (a world of one unless one was installed)."""
    return _current


def install(comm: Communicator) -> None:
    """Make ``comm`` the process's communicator for the collective ops."""
    global _current
    with _lock:
        _current = comm


@contextlib.contextmanager
def use(comm: Communicator) -> Iterator[Communicator]:
    """Install ``comm`` for the block, then put the previous one back."""
    previous = current()
    install(comm)
    try:
        yield comm
    finally:
        install(previous)
