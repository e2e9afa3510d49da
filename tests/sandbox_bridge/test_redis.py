"""Redis mode against a real redis-server: Code Judge 0.0.5's wire format (code_judge.md 3.2, 7.3),
at-least-once delivery (a job survives `kill -9` of its worker), and harmless duplicates."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import redis

from sandbox_bridge.redis_queue import (
    Keys,
    RedisJobQueue,
    RedisQueueSandbox,
    connect,
    decode_payload,
    decode_result,
    encode_payload,
    encode_result,
)
from sandbox_bridge.types import Submission, SubmissionResult
from tests.conftest import stop_process, wait_until

pytestmark = pytest.mark.redis

WORK_QUEUE = "js:0.0.5:work-queue"
INFLIGHT = "js:0.0.5:inflight"


def result_key(work_id: str) -> str:
    return f"js:0.0.5:result-queue:{work_id}"


def cj_payload(code: str, long_running: bool, stdin: str | None = None) -> tuple[str, bytes]:
    """A WorkPayload exactly as Code Judge's API writes it (pydantic model_dump_json, compact)."""
    work_id = str(uuid.uuid4())
    sub = {"sub_id": str(uuid.uuid4()), "type": "python", "options": None, "solution": code, "input": stdin}
    sub["expected_output"] = None
    body = {"work_id": work_id, "timestamp": time.time(), "long_running": long_running, "submission": sub}
    return work_id, json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def res(stdout: str, sub_id: str = "x") -> SubmissionResult:
    return SubmissionResult(
        sub_id=sub_id, success=True, run_success=True, cost=0.01, stdout=stdout, stderr=""
    )


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, socket_timeout=60)
    yield client
    client.close()


def live_workers(r: redis.Redis) -> int:
    return sum(1 for _ in r.scan_iter(match="js:0.0.5:work-ids:*"))


def start_worker(url: str, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "sandbox_bridge.redis_worker", "--redis", url, "--workers", "1"]
    cmd += ["--timeout-s", "5", "--lease-s", "1", "--block-s", "0.5", "--preload", "", *extra]
    return subprocess.Popen(cmd)


@pytest.fixture
def processes() -> Iterator[list[psutil.Process]]:
    """Processes a test started, directly or not; all are stopped by PID afterwards."""
    started: list[psutil.Process] = []
    yield started
    for p in started:
        try:
            p.kill()
            p.wait(5)
        except psutil.NoSuchProcess:
            pass


def spawn(procs: list[psutil.Process], url: str, *extra: str) -> subprocess.Popen[bytes]:
    proc = start_worker(url, *extra)
    procs.append(psutil.Process(proc.pid))
    return proc


# ---------------------------------------------------------------- wire format


def test_work_payload_has_code_judges_fields_in_code_judges_order_compact_utf8() -> None:
    sub = Submission(type="python", solution="print('é')", input="9", expected_output="9", sub_id="s1")
    raw = encode_payload("w1", 1795254988.0284185, False, sub)
    assert raw == (
        b'{"work_id":"w1","timestamp":1795254988.0284185,"long_running":false,'
        b'"submission":{"sub_id":"s1","type":"python","options":null,"solution":"print(\'\xc3\xa9\')",'
        b'"input":"9","expected_output":"9"}}'
    )
    assert decode_payload(raw).submission == sub


def test_result_json_has_code_judges_fields_and_leaves_out_streamrls_isolation_label() -> None:
    result = SubmissionResult(
        sub_id="x", success=False, run_success=False, cost=4.01, stdout="Suicide from timeout.\n", stderr=""
    )
    result.reason, result.isolation = "worker_timeout", "bwrap"
    raw = encode_result(result)
    assert list(json.loads(raw)) == ["sub_id", "success", "run_success", "cost", "stdout", "stderr", "reason"]
    assert raw == (
        b'{"sub_id":"x","success":false,"run_success":false,"cost":4.01,'
        b'"stdout":"Suicide from timeout.\\n","stderr":"","reason":"worker_timeout"}'
    )
    assert decode_result(raw).reason == "worker_timeout"


def test_payloads_and_results_are_byte_identical_to_pydantic_model_dump_json() -> None:
    from tests.sandbox_bridge.cj_models import CJSubmission, CJSubmissionResult, CJWorkPayload

    sub = Submission(type="cpp", solution="int main(){}\n", input=None, sub_id="s", options={"k": "v"})
    ours = encode_payload("{t}:0-1", 1795254988.0284185, True, sub)
    cj_sub = CJSubmission(sub_id="s", type="cpp", options={"k": "v"}, solution="int main(){}\n")
    theirs = CJWorkPayload(
        work_id="{t}:0-1", timestamp=1795254988.0284185, long_running=True, submission=cj_sub
    )
    assert ours == theirs.model_dump_json().encode()
    result = SubmissionResult(
        sub_id="s", success=True, run_success=True, cost=9.8e-05, stdout="hi\n", stderr=""
    )
    cj_result = CJSubmissionResult(
        sub_id="s", success=True, run_success=True, cost=9.8e-05, stdout="hi\n", stderr=""
    )
    assert encode_result(result) == cj_result.model_dump_json().encode()


def test_batch_work_ids_carry_a_hash_tag_so_a_batch_lands_in_one_cluster_slot(redis_url: str) -> None:
    async def go() -> list[tuple[str, bytes]]:
        q = RedisJobQueue(connect(redis_url, 2.0))
        try:
            return await q.push([Submission(type="python", solution="1")] * 3, long_running=False)
        finally:
            await q.r.aclose()

    jobs = asyncio.run(go())
    tags = {w.split("}")[0] for w, _ in jobs}
    assert len(tags) == 1 and [w.split(":")[-1] for w, _ in jobs] == ["0-0", "0-1", "1-0"]  # chunks of 2


# ---------------------------------------------------------------- API side vs a Code Judge worker


async def code_judge_worker(url: str, answer: dict[str, Any]) -> None:
    """One iteration of Code Judge's Worker loop, reading and writing raw Redis as it does."""
    r = redis.asyncio.Redis.from_url(url)
    try:
        await r.set(f"js:0.0.5:work-ids:{uuid.uuid4()}", "1", ex=165)
        _, member, _ = await r.bzpopmin(WORK_QUEUE, timeout=10)
        payload = json.loads(member)
        body = {"sub_id": payload["submission"]["sub_id"], **answer}
        await r.rpush(result_key(payload["work_id"]), json.dumps(body))
        await r.expire(result_key(payload["work_id"]), 3615 if payload["long_running"] else 60)
    finally:
        await r.aclose()


def test_our_api_side_is_served_by_a_code_judge_worker_and_labels_timeouts_like_code_judges_api(
    redis_url: str,
) -> None:
    answer = {"success": False, "run_success": False, "cost": 4.2, "stdout": "", "stderr": "", "reason": ""}

    async def go() -> SubmissionResult:
        sandbox = RedisQueueSandbox(redis_url, timeout_s=4.0)
        try:
            worker = asyncio.create_task(code_judge_worker(redis_url, answer))
            [got] = await sandbox.run_batch(
                [Submission(type="python", solution="x", sub_id="q")], max_wait_s=10
            )
            await worker
            return got
        finally:
            await sandbox.close()

    got = asyncio.run(go())
    assert (got.sub_id, got.run_success, got.reason) == ("q", False, "worker_timeout")


def test_with_no_worker_the_api_side_gives_queue_timeout_and_withdraws_the_job(
    redis_url: str, r: redis.Redis
) -> None:
    async def go() -> SubmissionResult:
        sandbox = RedisQueueSandbox(redis_url)
        try:
            [got] = await sandbox.run_batch(
                [Submission(type="python", solution="1", sub_id="z")], max_wait_s=0.3
            )
            return got
        finally:
            await sandbox.close()

    got = asyncio.run(go())
    assert (got.sub_id, got.reason, got.stdout) == ("z", "queue_timeout", None)
    assert got.cost >= 0.3
    assert r.zcard(WORK_QUEUE) == 0


# ---------------------------------------------------------------- leases, reaper, duplicates


def test_duplicate_results_are_harmless_the_first_wins_and_late_ones_expire(
    redis_url: str, r: redis.Redis
) -> None:
    async def go() -> tuple[SubmissionResult, str]:
        q = RedisJobQueue(connect(redis_url, 2.0))
        try:
            sub = Submission(type="python", solution="1", sub_id="x")
            jobs = await q.push([sub], long_running=True)
            work_id, member = jobs[0]
            payload = decode_payload(member)
            await q.ack(member, payload, res("first"))
            await q.ack(member, payload, res("second"))  # a re-run after a lease expired
            [got] = await q.collect(jobs, [sub], max_wait_s=5)
            await q.ack(member, payload, res("late"))  # after the API side has moved on
            return got, work_id
        finally:
            await q.r.aclose()

    got, work_id = asyncio.run(go())
    assert got.stdout == "first"
    assert r.llen(result_key(work_id)) == 1
    assert 0 < r.ttl(result_key(work_id)) <= 3615


def test_concurrent_reapers_requeue_an_expired_lease_exactly_once(redis_url: str, r: redis.Redis) -> None:
    async def go() -> list[tuple[int, int]]:
        queues = [RedisJobQueue(connect(redis_url, 2.0)) for _ in range(8)]
        try:
            await queues[0].push([Submission(type="python", solution="1")], long_running=True)
            assert await queues[0].take(block_s=1, lease_s=0.05) is not None
            await asyncio.sleep(0.15)
            return list(await asyncio.gather(*(q.reap() for q in queues)))
        finally:
            for q in queues:
                await q.r.aclose()

    counts = asyncio.run(go())
    assert sum(n for n, _ in counts) == 1
    assert (r.zcard(WORK_QUEUE), r.zcard(INFLIGHT)) == (1, 0)


def test_a_renewed_lease_is_not_reaped_while_its_job_runs(redis_url: str, r: redis.Redis) -> None:
    async def go() -> tuple[int, int]:
        q = RedisJobQueue(connect(redis_url, 2.0))
        try:
            await q.push([Submission(type="python", solution="1")], long_running=True)
            member = await q.take(block_s=1, lease_s=1.0)
            assert member is not None
            for _ in range(6):  # 1.5 s in all: the first lease alone would have expired
                await asyncio.sleep(0.25)
                await q.renew(member, 1.0)
            return await q.reap()
        finally:
            await q.r.aclose()

    assert asyncio.run(go()) == (0, 0)
    assert (r.zcard(WORK_QUEUE), r.zcard(INFLIGHT)) == (0, 1)


def test_a_job_that_keeps_losing_its_worker_ends_as_internal_error_after_max_redeliveries(
    redis_url: str, r: redis.Redis
) -> None:
    async def go() -> list[tuple[int, int]]:
        q = RedisJobQueue(connect(redis_url, 2.0), Keys(), max_redeliveries=1)
        try:
            await q.push([Submission(type="python", solution="1", sub_id="poison")], long_running=True)
            counts = []
            for _ in range(2):
                assert await q.take(block_s=1, lease_s=0.05) is not None
                await asyncio.sleep(0.1)
                counts.append(await q.reap())
            return counts
        finally:
            await q.r.aclose()

    assert asyncio.run(go()) == [(1, 0), (0, 1)]
    [key] = list(r.scan_iter(match="js:0.0.5:result-queue:*"))
    got = json.loads(r.lpop(key))
    assert got == {
        "sub_id": "poison",
        "success": False,
        "run_success": False,
        "cost": 0.0,
        "stdout": None,
        "stderr": None,
        "reason": "internal_error",
    }
    assert (r.zcard(WORK_QUEUE), r.zcard(INFLIGHT)) == (0, 0)


def test_a_stale_short_job_is_dropped_unanswered_like_code_judge(redis_url: str, r: redis.Redis) -> None:
    from sandbox_bridge.redis_worker import _handle

    work_id, member = cj_payload("print(1)", long_running=False)
    old = json.loads(member)
    old["timestamp"] -= 10
    member = json.dumps(old, separators=(",", ":")).encode()
    args = argparse.Namespace(max_queue_work_life_s=4.0, lease_s=5.0)

    async def go() -> None:
        q = RedisJobQueue(connect(redis_url, 2.0))
        try:
            await q.r.zadd(WORK_QUEUE, {member: old["timestamp"]})
            taken = await q.take(block_s=1, lease_s=5.0)
            await _handle(q, None, taken, args)  # type: ignore[arg-type]  # never reaches the sandbox
        finally:
            await q.r.aclose()

    asyncio.run(go())
    assert (r.zcard(INFLIGHT), r.exists(result_key(work_id))) == (0, 0)


# ---------------------------------------------------------------- real worker processes


def test_a_job_pushed_the_code_judge_way_is_answered_the_code_judge_way(
    redis_url: str, r: redis.Redis, processes: list[psutil.Process]
) -> None:
    pytest.importorskip("sandbox_bridge.local")
    worker = spawn(processes, redis_url)
    wait_until(lambda: live_workers(r) == 1, 30, "the worker's work-ids key")
    assert 0 < r.ttl(next(r.scan_iter(match="js:0.0.5:work-ids:*"))) <= 165
    work_id, member = cj_payload("print(input())", long_running=False, stdin="hi")
    r.zadd(WORK_QUEUE, {member: json.loads(member)["timestamp"]})
    wait_until(lambda: r.exists(result_key(work_id)) == 1, 20, "the result list")
    assert 0 < r.ttl(result_key(work_id)) <= 60  # short job: Code Judge's 60 s expiry
    got = json.loads(r.lpop(result_key(work_id)))
    assert list(got) == ["sub_id", "success", "run_success", "cost", "stdout", "stderr", "reason"]
    assert got["sub_id"] == json.loads(member)["submission"]["sub_id"]
    assert (got["success"], got["run_success"], got["stdout"], got["reason"]) == (True, True, "hi\n", "")
    assert (r.zcard(WORK_QUEUE), r.zcard(INFLIGHT)) == (0, 0)
    stop_process(worker)
    assert worker.returncode == 0


def test_a_job_whose_worker_is_killed_mid_job_still_completes_on_another_worker(
    redis_url: str, r: redis.Redis, processes: list[psutil.Process]
) -> None:
    pytest.importorskip("sandbox_bridge.local")
    a = spawn(processes, redis_url)
    wait_until(lambda: live_workers(r) == 1, 30, "worker A")
    work_id, member = cj_payload("import time\ntime.sleep(1.5)\nprint('done')", long_running=True)
    r.zadd(WORK_QUEUE, {member: json.loads(member)["timestamp"]})
    wait_until(lambda: r.zcard(INFLIGHT) == 1, 10, "worker A to lease the job")
    time.sleep(0.3)  # the job is now running inside A's pool
    processes.extend(psutil.Process(a.pid).children(recursive=True))  # orphans-to-be, cleaned up by PID
    os.kill(a.pid, signal.SIGKILL)
    a.wait(5)
    b = spawn(processes, redis_url)
    got = r.blpop([result_key(work_id)], timeout=30)
    assert got is not None, "the job was lost with its worker"
    result = json.loads(got[1])
    assert (result["run_success"], result["stdout"]) == (True, "done\n")
    assert (r.zcard(WORK_QUEUE), r.zcard(INFLIGHT)) == (0, 0)
    assert not list(r.scan_iter(match="js:0.0.5:redeliveries:*"))
    stop_process(b)


def test_sigterm_lets_the_running_job_finish_then_the_worker_exits_cleanly(
    redis_url: str, r: redis.Redis, processes: list[psutil.Process]
) -> None:
    pytest.importorskip("sandbox_bridge.local")
    worker = spawn(processes, redis_url)
    wait_until(lambda: live_workers(r) == 1, 30, "the worker")
    work_id, member = cj_payload("import time\ntime.sleep(1)\nprint('finished')", long_running=True)
    r.zadd(WORK_QUEUE, {member: json.loads(member)["timestamp"]})
    wait_until(lambda: r.zcard(INFLIGHT) == 1, 10, "the job to start")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(20) == 0
    assert json.loads(r.lpop(result_key(work_id)))["stdout"] == "finished\n"
    assert live_workers(r) == 0  # its registration is withdrawn, so /status stops counting it


def test_redis_sandbox_started_from_the_job_spec_runs_code_on_its_own_workers(redis_url: str) -> None:
    pytest.importorskip("sandbox_bridge.local")

    async def go() -> list[SubmissionResult]:
        sandbox = RedisQueueSandbox(redis_url, workers=2, timeout_s=5.0, worker_args=["--preload", ""])
        try:
            async with asyncio.timeout(60):
                return list(
                    await asyncio.gather(sandbox.run("print(6*7)"), sandbox.run("print(input())", "x"))
                )
        finally:
            await sandbox.close()

    a, b = asyncio.run(go())
    assert (a.stdout, b.stdout, a.isolation) == ("42\n", "x\n", "redis")
