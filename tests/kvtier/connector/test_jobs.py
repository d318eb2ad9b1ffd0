"""Background loads and saves: the job runner on its own, and the core's submit/poll/wait against a
real daemon (also a stopped one)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvtier.connector import JobResult, KVConnectorCore
from kvtier.connector.jobs import JobRunner
from kvtier.connector.pages import gather_block
from kvtier_protocol.errors import InvalidRequest
from tests.kvtier.conftest import KvtierDaemon
from tests.kvtier.connector.connkit import make_caches, make_ns, tokens
from tests.kvtier.waitkit import PATIENCE_S


@pytest.fixture
def runner() -> Iterator[JobRunner]:
    r = JobRunner(1)
    yield r
    r.close()


def poll_until(poll, count: int, timeout_s: float = PATIENCE_S) -> list[JobResult]:
    """Poll without blocking until ``count`` results came back."""
    results: list[JobResult] = []
    deadline = time.monotonic() + timeout_s
    while len(results) < count:
        assert time.monotonic() < deadline, f"only {len(results)} of {count} jobs reported"
        results.extend(poll())
        time.sleep(0.01)
    return results


def test_jobs_run_in_order_and_are_reported_once(runner: JobRunner) -> None:
    order: list[int] = []

    def work(job: int) -> JobResult:
        order.append(job)
        return JobResult(job, True, job * 10)

    jobs = [runner.submit(work) for _ in range(5)]
    assert jobs == [1, 2, 3, 4, 5]
    assert runner.wait(3) == JobResult(3, True, 30)
    results = poll_until(runner.poll, 4)
    assert [r.job for r in results] == [1, 2, 4, 5] and order == jobs
    assert runner.poll() == []
    with pytest.raises(InvalidRequest, match="already reported"):
        runner.wait(3)


def test_poll_never_blocks_and_wait_times_out(runner: JobRunner) -> None:
    gate = threading.Event()
    job = runner.submit(lambda j: JobResult(j, gate.wait(PATIENCE_S), 1))
    assert runner.poll() == []  # the job is held by the gate: a poll that waited would return it
    with pytest.raises(TimeoutError):
        runner.wait(job, timeout_s=0.05)  # held by the gate: no wait can end otherwise
    gate.set()
    assert runner.wait(job, timeout_s=PATIENCE_S) == JobResult(job, True, 1)


def test_a_failing_job_is_reported_not_raised(runner: JobRunner) -> None:
    def boom(job: int) -> JobResult:
        raise ValueError("broken pages")

    job = runner.submit(boom)
    result = runner.wait(job)
    assert (result.ok, result.num_blocks, result.error) == (False, 0, "ValueError: broken pages")
    assert runner.wait(runner.submit(lambda j: JobResult(j, True, 2))).ok, "the worker survives"


def test_a_closed_runner_takes_no_jobs() -> None:
    r = JobRunner(1)
    r.close()
    with pytest.raises(InvalidRequest, match="closed"):
        r.submit(lambda j: JobResult(j, True, 0))


def test_async_save_and_load_complete_and_poll_reports_them(kvtier_daemon_module: KvtierDaemon) -> None:
    ns = make_ns("mha", kv_dtype="bfloat16")
    src, dst = make_caches(ns, "vllm-nhc", seed=1), make_caches(ns, "vllm-nhc", seed=None)
    with KVConnectorCore(ns, address=kvtier_daemon_module.address, page_layout="vllm-nhc", timeout_s=60.0) as core:
        core.bind_kv_caches(src)
        prompt = tokens(4 * ns.block_tokens, seed=3)
        hashes = core.block_hashes(prompt)
        original = [gather_block(src, p, core.page_layout).clone() for p in (0, 1, 2, 3)]
        save = core.submit_save(hashes, [0, 1, 2, 3], token_ids=prompt)
        for c in src:  # the pages were copied at submit: the engine may reuse them at once
            c.zero_()
        assert core.wait(save, timeout_s=PATIENCE_S) == JobResult(save, True, 4)
        assert core.wait(core.submit_save(hashes, [0, 1, 2, 3]), timeout_s=PATIENCE_S) == JobResult(save + 1, True, 0)
        core.bind_kv_caches(dst)
        jobs = [core.submit_load(hashes[:2], [7, 6]), core.submit_load(hashes, [0, 1, 2, 3])]
        results = poll_until(core.poll, 2)
        assert results == [JobResult(jobs[0], True, 2), JobResult(jobs[1], True, 4)]
        for p, want in zip((0, 1, 2, 3), original):
            assert torch.equal(gather_block(dst, p, core.page_layout), want)
        miss = core.wait(core.submit_load([*hashes[:1], bytes(32)], [4, 5]), timeout_s=PATIENCE_S)
        assert (miss.ok, miss.num_blocks, miss.error) == (False, 1, "miss at block 1 of 2")
        with pytest.raises(InvalidRequest, match="page ids"):
            core.submit_load(hashes, [0])


def test_async_jobs_against_a_stopped_daemon_report_the_outage(kvtier_daemon: KvtierDaemon) -> None:
    ns = make_ns("mla")
    with KVConnectorCore(ns, address=kvtier_daemon.address, page_layout="mla-latent", timeout_s=60.0) as core:
        core.bind_kv_caches(make_caches(ns, "mla-latent", seed=2))
        hashes = core.block_hashes(tokens(2 * ns.block_tokens, seed=4))
        kvtier_daemon.stop()
        jobs = [core.submit_save(hashes, [0, 1]), core.submit_load(hashes, [2, 3])]
        results = poll_until(core.poll, 2)
        assert [(r.job, r.ok, r.num_blocks) for r in results] == [(jobs[0], False, 0), (jobs[1], False, 0)]
        assert all(r.error is not None and r.error.startswith("daemon unavailable") for r in results)
