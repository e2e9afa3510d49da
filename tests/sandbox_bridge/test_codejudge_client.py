"""CodeJudgeClient against a real HTTP server playing Code Judge with scripted verdicts, and against
`streamrl sandbox serve`'s app for real."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web

from sandbox_bridge.codejudge import CodeJudgeClient
from sandbox_bridge.types import Submission
from tests.conftest import serve_app

Verdict = Callable[[int, dict[str, Any]], dict[str, Any]]


def ok(sub: dict[str, Any], stdout: str = "ok\n") -> dict[str, Any]:
    fields = {"success": True, "run_success": True, "cost": 0.01, "stdout": stdout, "stderr": ""}
    return {"sub_id": sub["sub_id"], **fields, "reason": ""}


def queue_timeout(sub: dict[str, Any]) -> dict[str, Any]:
    fields = {"success": False, "run_success": False, "cost": 13.0, "stdout": None, "stderr": None}
    return {"sub_id": sub["sub_id"], **fields, "reason": "queue_timeout"}


class FakeCodeJudge:
    """A real aiohttp server on 127.0.0.1 answering `/run/long-batch` with scripted verdicts.

    `verdict(request_no, submission)` gives each item's result; `status` != 200 or `hang` make the
    whole request fail. Records every request body and the peak number of concurrent requests.
    """

    def __init__(
        self,
        verdict: Verdict = lambda n, s: ok(s),
        status: int = 200,
        hang: bool = False,
        delay_s: float = 0.0,
    ):
        self.verdict, self.status, self.hang, self.delay_s = verdict, status, hang, delay_s
        self.requests: list[list[dict[str, Any]]] = []
        self.in_flight = self.peak = 0

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body["submissions"])
        n = len(self.requests)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if self.hang:
                await asyncio.sleep(3600)
            await asyncio.sleep(self.delay_s)
            if self.status != 200:
                return web.Response(status=self.status, text="Internal Server Error")
            results = [self.verdict(n, s) for s in body["submissions"]]
            return web.json_response({"sub_id": body.get("sub_id") or "batch", "results": results})
        finally:
            self.in_flight -= 1

    @asynccontextmanager
    async def serve(self) -> AsyncIterator[str]:
        app = web.Application()
        app.router.add_post("/run/long-batch", self.handle)
        async with serve_app(app) as url:
            yield url


def subs(n: int) -> list[Submission]:
    return [Submission(type="python", solution=f"print({i})", sub_id=f"s{i}") for i in range(n)]


async def run_all(client: CodeJudgeClient, items: list[Submission]) -> list[Any]:
    async with asyncio.timeout(30):  # a hang fails the test instead of stalling the suite
        return await asyncio.gather(*(client.submit(s) for s in items))


def test_queue_timeouts_are_retried_alone_and_results_stay_in_submission_order() -> None:
    def verdict(n: int, s: dict[str, Any]) -> dict[str, Any]:
        return queue_timeout(s) if n == 1 and s["sub_id"] == "s1" else ok(s, stdout=f"{s['sub_id']}@{n}")

    fake = FakeCodeJudge(verdict)

    async def go() -> list[Any]:
        async with fake.serve() as url, CodeJudgeClient(url, batch_size=32, backoff_s=0.01) as client:
            return await run_all(client, subs(3))

    results = asyncio.run(go())
    assert [r.stdout for r in results] == ["s0@1", "s1@2", "s2@1"]
    assert [r.sub_id for r in results] == ["s0", "s1", "s2"]
    assert [[s["sub_id"] for s in req] for req in fake.requests] == [["s0", "s1", "s2"], ["s1"]]


def test_the_request_body_is_what_code_judge_expects() -> None:
    fake = FakeCodeJudge()

    async def go() -> None:
        async with fake.serve() as url, CodeJudgeClient(url) as client:
            await run_all(
                client, [Submission(type="python", solution="print(input())", input="hi", sub_id="a")]
            )

    asyncio.run(go())
    assert fake.requests == [
        [
            {
                "sub_id": "a",
                "type": "python",
                "options": None,
                "solution": "print(input())",
                "input": "hi",
                "expected_output": None,
            }
        ]
    ]


def test_no_sleep_follows_a_successful_attempt() -> None:
    fake = FakeCodeJudge()

    async def go() -> float:
        async with fake.serve() as url, CodeJudgeClient(url, backoff_s=2.0) as client:
            await run_all(client, subs(1))  # warm the connection
            t0 = time.monotonic()
            await run_all(client, subs(2))
            return time.monotonic() - t0

    assert asyncio.run(go()) < 1.0  # rStar2 would sleep 2 s here


def test_after_the_last_retry_a_queue_timeout_is_returned_with_capped_backoff_between_attempts() -> None:
    fake = FakeCodeJudge(lambda n, s: queue_timeout(s))

    async def go() -> tuple[list[Any], float]:
        async with (
            fake.serve() as url,
            CodeJudgeClient(url, max_retries=4, backoff_s=0.1, max_backoff_s=0.15) as c,
        ):
            t0 = time.monotonic()
            res = await run_all(c, subs(2))
            return res, time.monotonic() - t0

    results, elapsed = asyncio.run(go())
    assert [r.reason for r in results] == ["queue_timeout", "queue_timeout"]
    assert len(fake.requests) == 4
    assert 0.1 + 0.15 + 0.15 <= elapsed < 2.0  # 3 sleeps between 4 attempts: 0.1, then capped at 0.15


def test_http_errors_are_retried_and_then_become_internal_error_results() -> None:
    fake = FakeCodeJudge(status=500)

    async def go() -> list[Any]:
        async with fake.serve() as url, CodeJudgeClient(url, max_retries=3, backoff_s=0.01) as client:
            return await run_all(client, subs(2))

    results = asyncio.run(go())
    assert [(r.reason, r.run_success, r.stdout) for r in results] == [("internal_error", False, None)] * 2
    assert len(fake.requests) == 3


def test_a_server_that_never_answers_gives_an_error_result_not_a_hang() -> None:
    fake = FakeCodeJudge(hang=True)

    async def go() -> tuple[list[Any], float]:
        async with (
            fake.serve() as url,
            CodeJudgeClient(url, timeout_s=0.3, max_retries=2, backoff_s=0.01) as c,
        ):
            t0 = time.monotonic()
            res = await run_all(c, subs(1))
            return res, time.monotonic() - t0

    results, elapsed = asyncio.run(go())
    assert results[0].reason == "internal_error"
    assert elapsed < 3.0


def test_an_unreachable_server_gives_error_results() -> None:
    async def go() -> list[Any]:
        async with CodeJudgeClient(
            "http://127.0.0.1:9", max_retries=2, backoff_s=0.01, timeout_s=2
        ) as client:
            return await run_all(client, subs(2))

    assert [r.reason for r in asyncio.run(go())] == ["internal_error"] * 2


def test_a_response_with_the_wrong_number_of_results_is_not_trusted() -> None:
    fake = FakeCodeJudge()
    fake.verdict = lambda n, s: ok(s)
    original = fake.handle

    async def drop_last(request: web.Request) -> web.Response:
        resp = await original(request)
        body = json.loads(resp.body)
        body["results"] = body["results"][:-1]
        return web.json_response(body)

    fake.handle = drop_last  # type: ignore[method-assign]

    async def go() -> list[Any]:
        async with fake.serve() as url, CodeJudgeClient(url, max_retries=2, backoff_s=0.01) as client:
            return await run_all(client, subs(2))

    assert [r.reason for r in asyncio.run(go())] == ["internal_error"] * 2


def test_queued_calls_are_micro_batched_up_to_batch_size_without_waiting_to_fill() -> None:
    fake = FakeCodeJudge()

    async def go() -> tuple[list[int], float]:
        async with fake.serve() as url, CodeJudgeClient(url, concurrency=1, batch_size=32) as client:
            await run_all(client, subs(70))
            sizes = [len(r) for r in fake.requests]
            t0 = time.monotonic()
            await run_all(client, subs(1))  # alone: sent at once, not held for company
            return sizes, time.monotonic() - t0

    sizes, lone_s = asyncio.run(go())
    assert sizes == [32, 32, 6]
    assert lone_s < 1.0


def test_no_more_than_concurrency_requests_are_in_flight() -> None:
    fake = FakeCodeJudge(delay_s=0.05)

    async def go() -> None:
        async with fake.serve() as url, CodeJudgeClient(url, concurrency=2, batch_size=1) as client:
            await run_all(client, subs(8))

    asyncio.run(go())
    assert len(fake.requests) == 8
    assert fake.peak == 2


def test_client_gets_real_results_from_streamrl_sandbox_serve() -> None:
    pytest.importorskip("sandbox_bridge.local")
    from sandbox_bridge.server import LocalBackend, make_app

    async def go() -> list[Any]:
        app = make_app(LocalBackend(max_workers=2, timeout_s=2.0, memory_mb=256), timeout_s=2.0)
        async with serve_app(app) as url, CodeJudgeClient(url) as client:
            echo = client.run("print(input())", "hi")
            crash = client.run("x = 1\n1/0")
            sleepy = client.run("import time\ntime.sleep(10)")
            async with asyncio.timeout(30):
                return list(await asyncio.gather(echo, crash, sleepy))

    echo, crash, sleepy = asyncio.run(go())
    assert (echo.success, echo.run_success, echo.stdout, echo.reason) == (True, True, "hi\n", "")
    assert (crash.run_success, crash.reason) == (False, "")
    assert "ZeroDivisionError" in (crash.stderr or "")
    assert (sleepy.run_success, sleepy.reason) == (False, "worker_timeout")
