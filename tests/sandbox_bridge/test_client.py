"""The one client API: `make_sandbox` picks the backend from the job spec, and the micro-batcher
behind the remote backends always ends a caller's wait with a result."""

from __future__ import annotations

import asyncio
import time

import pytest

from sandbox_bridge.client import BatchItem, MicroBatcher, Sandbox, make_sandbox
from sandbox_bridge.codejudge import CodeJudgeClient
from sandbox_bridge.redis_queue import RedisQueueSandbox
from sandbox_bridge.types import Submission, SubmissionResult
from streamrl.config import CodeJudgeSandbox, EmbeddedSandbox, RedisSandbox


def sub(i: int, sub_id: str | None = None) -> Submission:
    return Submission(type="python", solution=f"print({i})", sub_id=sub_id)


def echo_result(it: BatchItem) -> SubmissionResult:
    return SubmissionResult(
        sub_id=it.sub.sub_id or "", success=True, run_success=True, cost=0.0, stdout=it.sub.solution
    )


def test_remote_backends_are_chosen_by_the_job_spec_and_connect_lazily() -> None:
    async def go() -> None:
        cj = make_sandbox(CodeJudgeSandbox(url="http://127.0.0.1:9", batch_size=8))
        rq = make_sandbox(RedisSandbox(url="redis://127.0.0.1:9/0"))  # nothing listens: no error yet
        assert isinstance(cj, CodeJudgeClient) and isinstance(rq, RedisQueueSandbox)
        assert isinstance(cj, Sandbox) and isinstance(rq, Sandbox)
        await cj.close()
        await rq.close()

    asyncio.run(go())


def test_the_default_sandbox_is_the_embedded_pool_and_runs_code() -> None:
    pytest.importorskip("sandbox_bridge.local")

    async def go() -> tuple[SubmissionResult, str]:
        sandbox = make_sandbox(EmbeddedSandbox(max_workers=1, timeout_s=5.0))
        assert isinstance(sandbox, Sandbox)
        try:
            return await sandbox.run("print(input())", "hi"), sandbox.isolation  # type: ignore[attr-defined]
        finally:
            await sandbox.close()

    result, isolation = asyncio.run(go())
    assert (result.run_success, result.stdout) == (True, "hi\n")
    assert result.isolation == isolation != ""


def test_every_submission_gets_a_sub_id_and_keeps_a_given_one() -> None:
    async def send(items: list[BatchItem]) -> None:
        for it in items:
            it.resolve(echo_result(it))

    async def go() -> list[SubmissionResult]:
        batcher = MicroBatcher(send, concurrency=1, batch_size=4, name="t")
        try:
            return list(await asyncio.gather(batcher.submit(sub(0)), batcher.submit(sub(1, "mine"))))
        finally:
            await batcher.close()

    a, b = asyncio.run(go())
    assert len(a.sub_id) == 36 and b.sub_id == "mine"


def test_a_send_function_that_raises_or_forgets_items_gives_internal_error_results() -> None:
    async def broken(items: list[BatchItem]) -> None:
        if len(items) > 1:
            raise ConnectionError("backend fell over")
        # forgets to resolve the lone item

    async def go() -> list[SubmissionResult]:
        batcher = MicroBatcher(broken, concurrency=1, batch_size=8, name="t")
        try:
            async with asyncio.timeout(10):
                many = await asyncio.gather(*(batcher.submit(sub(i)) for i in range(3)))
                lone = await batcher.submit(sub(9))
            return [*many, lone]
        finally:
            await batcher.close()

    assert [r.reason for r in asyncio.run(go())] == ["internal_error"] * 4


def test_closing_answers_every_waiting_caller_promptly() -> None:
    async def stuck(items: list[BatchItem]) -> None:
        await asyncio.Event().wait()

    async def go() -> tuple[list[SubmissionResult], float, SubmissionResult]:
        batcher = MicroBatcher(stuck, concurrency=1, batch_size=2, name="t")
        calls = [asyncio.create_task(batcher.submit(sub(i))) for i in range(5)]  # 2 sending, 3 queued
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        await batcher.close()
        results = list(await asyncio.wait_for(asyncio.gather(*calls), 5))
        return results, time.monotonic() - t0, await batcher.submit(sub(7))

    results, close_s, after = asyncio.run(go())
    assert [r.reason for r in results] == ["internal_error"] * 5
    assert close_s < 1.0
    assert after.reason == "internal_error"  # a closed sandbox answers, it does not hang


def test_a_cancelled_caller_does_not_disturb_the_others_in_its_batch() -> None:
    async def go() -> SubmissionResult:
        gate = asyncio.Event()

        async def slow(items: list[BatchItem]) -> None:
            await gate.wait()
            for it in items:
                it.resolve(echo_result(it))

        batcher = MicroBatcher(slow, concurrency=1, batch_size=8, name="t")
        try:
            doomed = asyncio.create_task(batcher.submit(sub(0)))
            kept = asyncio.create_task(batcher.submit(sub(1)))
            await asyncio.sleep(0.01)
            doomed.cancel()
            gate.set()
            return await asyncio.wait_for(kept, 5)
        finally:
            await batcher.close()

    assert asyncio.run(go()).stdout == "print(1)"
