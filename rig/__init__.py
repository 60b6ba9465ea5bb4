"""Run a function on 1 or more ranks in long-lived worker processes: the tests' and the benchmarks' rig.

A top-level package of the repository, outside ``tests`` so that the benchmarks import no test code, and outside
``safe_zero`` so that the wheel does not ship it.

CPU ranks join a gloo group (the default); ``backend="nccl"`` puts rank r on GPU r (``tests/gpu``).

Starting a process and importing DeepSpeed costs seconds; a pool per world size pays that once
per session. A body is a module-level function, addressed by ``module:qualname`` and called
with keyword arguments on every rank; what each rank returns (or raises) comes back per rank.
A body that hangs (one rank raised, the other waits in a collective) times out, and the pool
is torn down and rebuilt for the next test.
"""

from __future__ import annotations

import gc
import importlib
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from safe_zero.op_builds import check_op_build
from safe_zero.probes import deepspeed_shm_segments, release_shm


@dataclass
class RankError:
    rank: int
    type: str
    message: str
    traceback: str

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.type}: {self.message}"


class RankFailure(Exception):
    """At least one rank raised; ``errors`` has each failed rank's exception, as text."""

    def __init__(self, errors: list[RankError]):
        self.errors = errors
        super().__init__("\n".join(str(e) for e in errors) + "\n\n" + errors[0].traceback)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, jobs: Any, results: Any, sys_path: list[str],
            backend: str = "gloo") -> None:
    sys.path[:] = sys_path
    os.environ.update(DS_ACCELERATOR="cpu" if backend == "gloo" else "cuda", RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    if backend == "nccl":
        torch.cuda.set_device(rank)
    deepspeed.init_distributed(dist_backend=backend)
    # A ZeRO-3 engine leaves torch.nn.functional.linear replaced by DeepSpeed's zero3_linear_wrap, whose bf16 results
    # differ in the last bits: each job starts with torch's own, as a fresh process would.
    linear = F.linear
    results.put((rank, "ready", None))
    while True:
        job = jobs.get()
        if job is None:
            break
        job_id, target, kwargs = job
        module_name, qualname = target.split(":")
        try:
            fn = importlib.import_module(module_name)
            for part in qualname.split("."):
                fn = getattr(fn, part)
            outcome = ("ok", fn(**kwargs))
        except BaseException as e:  # report everything, including AssertionError from a body
            outcome = ("err", RankError(rank, type(e).__name__, str(e), traceback.format_exc()))
        gc.collect()
        F.linear = linear
        if backend == "nccl":
            torch.cuda.empty_cache()
        results.put((rank, job_id, outcome))
    # Tear gloo down before interpreter exit: its threads abort the process in finalization otherwise.
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _raised(got: dict[int, Any]) -> str:
    """The errors of the ranks that raised, each after "; ", for a message about the ranks that did not finish."""
    return "".join(f"; {outcome[1]}" for outcome in got.values() if outcome and outcome[0] == "err")


class DistPool:
    """``world_size`` worker processes joined in one gloo (or NCCL) group."""

    def __init__(self, world_size: int, start_timeout: float = 300.0, backend: str = "gloo"):
        # Every rank loads DeepSpeed's CPU comm op: refuse a build lock a killed build left, instead of a timeout.
        check_op_build()
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        port = self._port = _free_port()
        self._jobs = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self._jobs[r], self._results, list(sys.path),
                                              backend), daemon=True) for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._next_id = 0
        self._collect("ready", start_timeout)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def _collect(self, job_id: Any, timeout: float, grace: float | None = None) -> dict[int, Any]:
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world_size:
            try:
                rank, jid, outcome = self._results.get(timeout=1.0)
            except queue.Empty:
                if not self.alive():
                    # The exit codes say how (a negative one is the signal, e.g. -11 a segfault, -6 an abort); a
                    # rank that finished may have raised first.
                    codes = {r: p.exitcode for r, p in enumerate(self._procs) if not p.is_alive()}
                    self.close(patience=0)
                    raise RuntimeError(f"a worker of the {self.world_size}-rank pool died during job {job_id} "
                                       f"(exit codes by rank: {codes}){_raised(got)}")
                if time.monotonic() > deadline:
                    self.close(patience=0)
                    # A rank that raised while another waits in a collective: its error is the one to see.
                    raise TimeoutError(f"job {job_id} did not finish on all {self.world_size} ranks within {timeout}s "
                                       f"(finished: {sorted(got)}){_raised(got)}")
                continue
            if jid == job_id:
                got[rank] = outcome
                if grace is not None and outcome[0] == "err":  # as a launcher ends a job a rank left
                    deadline = min(deadline, time.monotonic() + grace)
        return got

    def run(self, fn: Callable[..., Any], /, *, timeout: float = 240.0, grace: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Call ``fn(**kwargs)`` on every rank; return the per-rank results or raise :class:`RankFailure`.

        ``grace``: once a rank has raised, the seconds the others get to finish before the job times out (the
        others may be waiting in a collective the failed rank will never join); by default the whole ``timeout``.
        """
        self._next_id += 1
        job_id = self._next_id
        target = f"{fn.__module__}:{fn.__qualname__}"
        for q in self._jobs:
            q.put((job_id, target, kwargs))
        got = self._collect(job_id, timeout, grace)
        errors = [got[r][1] for r in sorted(got) if got[r][0] == "err"]
        if errors:
            raise RankFailure(errors)
        return [got[r][1] for r in range(self.world_size)]

    def close(self, patience: float = 10.0) -> None:
        """End the workers: each leaves its gloo group when it next reads the queue; a worker still there after
        ``patience`` seconds is killed (0 for a job given up on: its ranks wait in collectives that never end)."""
        for q in self._jobs:
            try:
                q.put(None)
            except Exception:
                pass
        deadline = time.monotonic() + patience
        for p in self._procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()  # else the pool can still look alive and be handed to the next job
        release_shm(deepspeed_shm_segments(self._port))


class Pools:
    """Lazily started pools by world size; a pool that died or timed out is replaced on next use."""

    def __init__(self, backend: str = "gloo") -> None:
        self._pools: dict[int, DistPool] = {}
        self.backend = backend

    def __call__(self, world_size: int) -> DistPool:
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive():
            pool = self._pools[world_size] = DistPool(world_size, backend=self.backend)
        return pool

    def run(self, world_size: int, fn: Callable[..., Any], /, **kwargs: Any) -> list[Any]:
        return self(world_size).run(fn, **kwargs)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
