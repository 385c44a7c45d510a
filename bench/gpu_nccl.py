"""bnfuse's NCCL communicator (bnfuse.runtime.collectives.NcclCommunicator) on real GPUs: one rank per GPU.

One step of bench/gpu_acceptance.py; alone (one rank, or under mpiexec with one rank per GPU):

    python bench/gpu_nccl.py --json result.json
    mpiexec -n 2 python bench/gpu_nccl.py --json result.json    # rank 0 writes the file

Checks, on device arrays: all-reduce (sum) of float32 / float64 / float16 / int64 values that differ per rank,
all-gather of float64, and the synchronized BN forward (bnfuse.runtime.sync_ops.sync_forward: statistics
gathered over NCCL) against the float64 reference over every rank's batch together, and the all-reduce's time
for 16 MiB. Every rank can rebuild every rank's batch (seeded by rank), so no host copy of others' data is needed.

Under mpiexec the unique id goes over MPI (an MpiCommunicator). Alone, a one-rank host side stands in for it
(no MPI needed): rank 0 of a world of one makes the id and keeps it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bnfuse.runtime import collectives  # noqa: E402

SHAPE = (8, 16, 12, 12)  # one rank's batch for the synchronized BN check


class OneRankHost(collectives.SingleProcess):
    """The host side of a one-rank NCCL world when MPI is not there: ``comm.bcast`` hands the id back."""

    class _Comm:
        @staticmethod
        def bcast(value: Any, root: int = 0) -> Any:
            return value

    comm = _Comm()


def host_communicator() -> tuple[Any, str]:
    """(host communicator, how): MPI under mpiexec; alone, the one-rank stand-in (a world of one needs no MPI,
    and an MPI library missing or broken on the machine must not end the check)."""
    if any(k in os.environ for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")):
        comm = collectives.MpiCommunicator()
        return comm, f"MPI ({comm.size} ranks)"
    return OneRankHost(), "one rank, no MPI"


def _batch(rank: int) -> np.ndarray:
    return (np.random.default_rng(100 + rank).standard_normal(SHAPE) * 2 + 50 + rank).astype(np.float32)


def run_checks() -> dict[str, Any]:
    import cupy

    from bnfuse.runtime import reference, sync_ops
    from bnfuse.runtime.semantics import BatchNormConfig

    host, how = host_communicator()
    comm = collectives.NcclCommunicator(host)
    rank, size = comm.rank, comm.size
    checks: dict[str, str] = {}
    with cupy.cuda.Device(comm.device):
        stream = cupy.cuda.get_current_stream()
        for dtype in ("float32", "float64", "float16", "int64"):
            values = cupy.arange(1000).astype(dtype) % 7 + rank
            comm.allreduce_sum(values, stream.ptr)
            stream.synchronize()
            want = (np.arange(1000) % 7) * size + size * (size - 1) // 2
            ok = np.array_equal(cupy.asnumpy(values).astype(np.float64), want)
            checks[f"allreduce_sum {dtype}"] = "pass" if ok else "fail: wrong sums"
        gathered = comm.allgather(cupy.full(5, rank, np.float64), stream.ptr)
        stream.synchronize()
        want = np.repeat(np.arange(size, dtype=np.float64)[:, None], 5, axis=1)
        checks["allgather float64"] = "pass" if np.array_equal(cupy.asnumpy(gathered), want) else "fail: wrong rows"
        config = BatchNormConfig()
        channels = SHAPE[1]
        params = [np.ones(channels, np.float32), np.zeros(channels, np.float32), np.zeros(channels, np.float32),
                  np.ones(channels, np.float32)]  # fmt: skip
        x = _batch(rank)
        y, _, _, mean, inv_std = sync_ops.sync_forward(
            cupy.asarray(x), *(cupy.asarray(p) for p in params), config, comm, stream.ptr
        )
        stream.synchronize()
        whole = np.concatenate([_batch(r) for r in range(size)])
        want = reference.forward_training(whole, *params, config)
        errors = [float(np.max(np.abs(cupy.asnumpy(mean) - want.saved_mean))),
                  float(np.max(np.abs(cupy.asnumpy(inv_std) / want.saved_inv_std - 1))),
                  float(np.max(np.abs(cupy.asnumpy(y) - want.y[rank * SHAPE[0]:(rank + 1) * SHAPE[0]])))]  # fmt: skip
        ok = max(errors) <= 1e-5
        checks["sync_forward vs float64 reference"] = ("pass" if ok else "fail") + f": max error {max(errors):.1e}"
        big = cupy.ones(4 * 2**20, np.float32)
        times = []
        for i in range(12):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            comm.allreduce_sum(big, stream.ptr)
            end.record()
            end.synchronize()
            if i >= 2:  # warm-up
                times.append(cupy.cuda.get_elapsed_time(start, end))
    return {"rank": rank, "ranks": size, "host": how, "device": comm.device, "checks": checks,
            "allreduce_16MiB_ms_median": statistics.median(times)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--json", type=Path, required=True, help="where rank 0 writes the result")
    args = parser.parse_args(argv)
    result = run_checks()
    if result["rank"] == 0:
        args.json.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0 if all(v.startswith("pass") for v in result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
