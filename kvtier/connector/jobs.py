"""Background loads and saves of the connector core, with completion polling.

The client's calls block, so asynchronous variants run them on a small thread pool (one worker
per core connector: jobs of one connector run in submission order, and the client serializes
its calls anyway). An engine submits a job, keeps stepping, and polls for finished jobs
between steps without blocking; it must leave the job's pages alone until the job is reported.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from kvtier_protocol.errors import InvalidRequest

log = logging.getLogger("kvtier.connector")


@dataclass(frozen=True, slots=True)
class JobResult:
    """How one background load or save ended.

    Attributes:
        job: the id :meth:`JobRunner.submit` returned.
        ok: True if the job did all it was asked (every block loaded, or stored or already there).
        num_blocks: blocks loaded into pages (load) or newly stored (save).
        error: why the job fell short (daemon unavailable, a miss, a bad block), else None.
    """

    job: int
    ok: bool
    num_blocks: int
    error: str | None = None


Work = Callable[[int], JobResult]
"""A job body: called with its job id, it returns the job's result."""


class JobRunner:
    """Runs jobs on worker threads and hands their results back once each.

    Args:
        workers: worker threads (1 keeps one connector's jobs in order).
        name: thread name prefix (shows in stack dumps).
    """

    def __init__(self, workers: int = 1, *, name: str = "kvtier-connector") -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._ids = itertools.count(1)
        self._pending: dict[int, Future[JobResult]] = {}
        self._lock = threading.Lock()

    def submit(self, work: Work) -> int:
        """Queue ``work(job_id)``; returns the job id (increasing from 1).

        Raises:
            InvalidRequest: the runner is closed.
        """
        with self._lock:
            job = next(self._ids)
            try:
                future = self._pool.submit(self._run, work, job)
            except RuntimeError:  # the pool was shut down
                raise InvalidRequest("the connector is closed") from None
            self._pending[job] = future
        return job

    @staticmethod
    def _run(work: Work, job: int) -> JobResult:
        try:
            return work(job)
        except Exception as exc:  # a job never takes the worker down: the engine sees it in poll()
            log.exception("connector job %d failed", job)
            return JobResult(job, False, 0, f"{type(exc).__name__}: {exc}")

    def poll(self) -> list[JobResult]:
        """Results of the jobs finished since the last poll, in job order; never blocks."""
        with self._lock:
            done = [job for job, f in self._pending.items() if f.done()]
            futures = [self._pending.pop(job) for job in done]
        return [self._result(f) for f in futures]

    def wait(self, job: int, timeout_s: float | None = None) -> JobResult:
        """Block until ``job`` finishes and return its result (it is not reported by poll again).

        Raises:
            InvalidRequest: an unknown job, or one already reported.
            TimeoutError: the job did not finish within ``timeout_s``.
        """
        with self._lock:
            future = self._pending.get(job)
        if future is None:
            raise InvalidRequest(f"no pending connector job {job} (unknown or already reported)")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            future.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise TimeoutError(f"connector job {job} still running after {timeout_s} s") from None
        with self._lock:
            self._pending.pop(job, None)
        return self._result(future)

    @staticmethod
    def _result(future: Future[JobResult]) -> JobResult:
        if future.cancelled():
            raise AssertionError("jobs are cancelled only by close(), which drops them")
        return future.result()

    def close(self, wait: bool = True) -> None:
        """Stop taking jobs; drop queued ones; wait for the running one if ``wait``."""
        with self._lock:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pending.clear()
        if wait:
            self._pool.shutdown(wait=True)
