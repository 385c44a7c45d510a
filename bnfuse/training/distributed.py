"""Data-parallel training across processes: start-up checks, state broadcast, failure handling, data and threads.

A distributed training graph (``bnfuse train-graph --distributed``) runs one ``session.run`` per step on every
rank; its collective ops use the communicator installed here (:mod:`bnfuse.runtime.collectives`). Use it as
``TrainingSession(train_model, comm=MPI.COMM_WORLD)`` under ``mpiexec -n N``; docs/distributed.md has the rest.

* :func:`communicator` is the one place a communicator is taken: an mpi4py one is wrapped, a bnfuse one kept;
  every function here that takes ``comm`` goes through it.
* :func:`attach` installs it for the collective ops and refuses to start (one line, on every rank) unless every
  rank has the same graph, onnxruntime version and collective schedule.
* :func:`broadcast_state` makes every rank start from rank 0's parameters and optimizer state.
* :class:`Watchdog` ends the job when a step makes no progress for ``timeout`` seconds (a rank that stopped
  answering); :func:`abort_on_error` ends it when any rank raises, in one line naming the rank and the error.
* :func:`thread_share` gives each rank its share of its machine's cores; :class:`EpochSplit` each rank its
  share of every global batch of an epoch.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from bnfuse.errors import BnfuseError
from bnfuse.runtime import collectives

DEFAULT_WATCHDOG_S = 300.0


class DistributedError(BnfuseError):
    """Ranks that cannot train together (mismatched graph, runtime or schedule).

    ``every_rank``: raised by every rank at the same point (decided from one collective's result), so that
    :func:`report_and_abort` can let every rank print its line before the job ends."""

    def __init__(self, message: str, *, every_rank: bool = False) -> None:
        super().__init__(message)
        self.every_rank = every_rank


def communicator(comm: Any = None) -> collectives.Communicator:
    """What every function here does with the communicator it is given: a bnfuse communicator
    (``bnfuse.runtime.collectives``) is used as is; an mpi4py communicator (default ``MPI.COMM_WORLD``) is wrapped
    in an ``MpiCommunicator``. Anything else is a DistributedError."""
    if isinstance(comm, collectives.SingleProcess | collectives.MpiCommunicator | collectives.NcclCommunicator):
        return comm
    if comm is None or all(hasattr(comm, name) for name in ("Get_rank", "Get_size", "Allgather", "Abort")):
        try:
            return collectives.MpiCommunicator(comm)
        except ImportError:
            raise DistributedError("distributed training needs mpi4py: pip install 'bnfuse[mpi]'") from None
    if all(hasattr(comm, name) for name in ("rank", "size", "allgather", "allreduce_sum", "broadcast", "abort")):
        return comm  # another implementation of collectives.Communicator
    raise DistributedError(
        f"not a communicator: {type(comm).__name__} (expected an mpi4py communicator such as MPI.COMM_WORLD, or "
        "one from bnfuse.runtime.collectives)"
    )


# what MPI launchers tell each process about the job's size, read without starting MPI
LAUNCHER_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE")


def launched_ranks() -> int:
    """How many processes an MPI launcher (MPICH / Hydra, Open MPI, PMIx, MVAPICH) started in this job; 1 when none
    says so. Read from the environment, so that a job that is not distributed can tell without importing MPI."""
    for name in LAUNCHER_SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 1


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
    """Wrap ``comm`` (:func:`communicator`), install it for the collective ops, and check that every rank runs the
    same step."""
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
            "collective schedule than rank 0: refusing to start",
            every_rank=True,  # every rank saw the same all-gather
        )
    collectives.install(wrapped)
    return wrapped


def broadcast_state(comm: Any, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rank 0's values of every state tensor, on every rank (in name order: the same on every rank); shapes kept
    (a scalar such as Adam's step counter stays a scalar)."""
    wrapped = communicator(comm)
    result = {}
    for name in sorted(state):
        array = np.array(state[name], copy=True, order="C")  # np.ascontiguousarray would make a scalar shape [1]
        wrapped.broadcast(array)
        result[name] = array
    return result


def shard(count: int, rank: int, size: int) -> slice:
    """Rank ``rank``'s contiguous share of ``count`` samples (sizes differ by at most one)."""
    base, extra = divmod(count, size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


@dataclass(frozen=True)
class EpochSplit:
    """How ``size`` ranks share an epoch of ``count`` samples, ``batch`` per rank and step.

    Every sample (drop_last False), as PyTorch's DistributedSampler + DataLoader do: the epoch's order is cut into
    global batches of ``batch * size`` samples, the last one partial, and each global batch into the ranks'
    contiguous shares (sizes differing by at most one, in rank order). Step s of every rank together is exactly
    global batch s, so N ranks take the steps one process takes with a ``batch * size`` batch, every rank runs the
    same number of steps, and the synchronized ops merge the uneven shares. A last sliver smaller than the rank
    count joins the step before (then up to ``batch + 1`` per rank), so that no rank runs a step on no samples.
    drop_last True (the static-batch behaviour): rank r takes the r-th contiguous share of the epoch and runs
    ``(count // size) // batch`` full batches of its own; the rest of its share is not trained that epoch.
    """

    count: int
    size: int
    batch: int
    drop_last: bool
    why: str = "--drop-last"  # what asked for full batches only, for describe()

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise DistributedError(f"batch size must be >= 1, got {self.batch}")
        if self.drop_last and self.count // self.size < self.batch:
            per_rank = f" per rank ({self.size} ranks)" if self.size > 1 else ""
            raise DistributedError(
                f"{self.count // self.size} samples{per_rank}, fewer than the batch size {self.batch} ({self.why})"
            )
        if not self.drop_last and self.count < self.size:
            raise DistributedError(f"{self.count} samples for {self.size} ranks: every rank needs one in a step")

    @property
    def steps(self) -> int:
        if self.drop_last:
            return (self.count // self.size) // self.batch
        width = self.batch * self.size
        steps = -(-self.count // width)
        if steps > 1 and self.count - (steps - 1) * width < self.size:
            steps -= 1  # the sliver joins the step before
        return steps

    def positions(self, rank: int) -> list[slice]:
        """Rank ``rank``'s steps: slices of the epoch's order (the same order on every rank)."""
        if self.drop_last:
            start = shard(self.count, rank, self.size).start
            return [slice(start + i * self.batch, start + (i + 1) * self.batch) for i in range(self.steps)]
        width, steps = self.batch * self.size, self.steps
        result = []
        for step in range(steps):
            first = step * width
            stop = self.count if step == steps - 1 else first + width
            part = shard(stop - first, rank, self.size)
            result.append(slice(first + part.start, first + part.stop))
        return result

    def global_sizes(self) -> list[int]:
        """Samples in each step over every rank (the count the step's loss is averaged over)."""
        every = [self.positions(rank) for rank in range(self.size)]
        return [sum(steps[step].stop - steps[step].start for steps in every) for step in range(self.steps)]

    def describe(self) -> str:
        if self.drop_last:
            used = self.steps * self.batch * self.size
            ranks = f"{self.size} ranks x " if self.size > 1 else ""
            return (
                f"{ranks}{self.batch} samples per step, {self.steps} steps per epoch: {used} of {self.count} "
                f"samples each epoch ({self.why})"
            )
        width = self.batch * self.size
        last = self.count - (self.steps - 1) * width
        tail = "" if last == width else f"; the last step's {last} split {_split_text(last, self.size)} over the ranks"
        return (
            f"{self.size} ranks: every one of {self.count} samples once per epoch, {self.steps} steps of {width} "
            f"({self.batch} per rank){tail}"
        )


def _split_text(count: int, size: int) -> str:
    sizes = [shard(count, rank, size) for rank in range(size)]
    return "/".join(str(part.stop - part.start) for part in sizes)


@dataclass(frozen=True)
class ThreadShare:
    """This rank's share of the machine's cores for onnxruntime's intra-op pool, as torchrun gives each rank."""

    threads: int  # intra-op threads for this rank
    cores: int  # cores this rank may run on (its CPU affinity)
    sharing: int  # ranks on this machine that may run on the same cores (this one included)
    local_ranks: int  # ranks on this machine (MPI's shared-memory split)

    def describe(self) -> str:
        ranks = f"{self.local_ranks} rank{'s' if self.local_ranks > 1 else ''} on this machine"
        if self.sharing == self.local_ranks:
            where = f"{ranks} share {self.cores} cores"
        else:
            where = f"{ranks}, {self.sharing} of them bound to the same {self.cores} cores"
        return f"{where}: {self.threads} onnxruntime thread{'s' if self.threads > 1 else ''} per rank"


def thread_share(comm: Any = None) -> ThreadShare:
    """Collective: the ranks on this machine (MPI_Comm_split_type SHARED) that may run on the same cores split
    them evenly (at least one thread each). A launcher that binds each rank to its own cores leaves it all of them.
    A communicator without MPI underneath counts as alone on its machine."""
    wrapped = communicator(comm)
    mine = tuple(sorted(os.sched_getaffinity(0)))
    mpi_comm = getattr(getattr(wrapped, "mpi", wrapped), "comm", None)
    if mpi_comm is None or not hasattr(mpi_comm, "Split_type"):
        return ThreadShare(threads=len(mine), cores=len(mine), sharing=1, local_ranks=1)
    from mpi4py import MPI

    local = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        every = local.allgather(mine)
    finally:
        local.Free()
    sharing = sum(cores == mine for cores in every)
    return ThreadShare(threads=max(1, len(mine) // sharing), cores=len(mine), sharing=sharing, local_ranks=len(every))


class Watchdog:
    """Ends the job (MPI_Abort) when an armed step runs longer than ``timeout`` seconds.

    One daemon thread for the session; ``with watchdog:`` arms it around a step. A blocked collective holds no
    Python lock that the thread needs (mpi4py releases the GIL while it waits).
    """

    def __init__(self, comm: Any, timeout: float, stream: Any = None) -> None:
        if not timeout > 0:
            raise DistributedError(f"watchdog timeout must be > 0 seconds, got {timeout}")
        self.comm, self.timeout = communicator(comm), float(timeout)
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
            say(
                f"bnfuse: rank {self.comm.rank}: a training step made no progress for {self.timeout:g} s "
                "(a rank stopped answering?): aborting the job",
                self.stream,
            )
            self.comm.abort(3)
            return


def abort_on_error(comm: Any = None, *, debug: bool | None = None) -> Callable[..., None]:
    """Make an uncaught exception on this rank print one line, ``bnfuse: rank R: error: ...``, and end every rank
    of the job (MPI_Abort: under any launcher, not only one that kills the others when a rank exits).

    ``comm``: an mpi4py communicator (default ``MPI.COMM_WORLD``) or a bnfuse one. ``debug``: also print the
    traceback (default: when the environment sets ``BNFUSE_DEBUG``). Returns the previous ``sys.excepthook``.
    """
    wrapped = communicator(comm)
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, trace: types.TracebackType | None) -> None:
        report_and_abort(wrapped, error, debug=debug)

    sys.excepthook = hook
    return previous


def debugging(debug: bool | None = None) -> bool:
    """``debug`` when given, else whether the environment sets ``BNFUSE_DEBUG`` (to anything but empty or 0)."""
    if debug is not None:
        return debug
    return os.environ.get("BNFUSE_DEBUG", "") not in ("", "0")


def say(line: str, stream: Any = None) -> None:
    """Write ``line`` and its newline in one write: print() writes them apart, and mpiexec, merging every rank's
    stderr, then put another rank's line between a line and its newline."""
    stream = stream if stream is not None else sys.stderr
    stream.write(line + "\n")
    stream.flush()


def report_and_abort(comm: Any, error: BaseException, code: int = 2, *, debug: bool | None = None) -> None:
    """Print one line naming the rank and the error (after its traceback with ``debug``), then end every rank of
    the job (MPI_Abort)."""
    wrapped = communicator(comm)
    if debugging(debug):
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if not isinstance(error, BnfuseError) and type(error).__name__ not in message:
        message = f"{type(error).__name__}: {message}"
    say(f"bnfuse: rank {wrapped.rank}: error: {message}")
    if getattr(error, "every_rank", False):  # every rank is here: none aborts before the others have printed
        wrapped.allreduce_sum(np.zeros(1))
    wrapped.abort(code)
