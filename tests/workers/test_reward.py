"""RewardPool with real worker processes: timeouts, crashes, replacement, asyncio concurrency, close.

Misbehaviour is injected through the pool's `grader` argument: `misbehaving_grader` below is
imported by name inside each worker, so production code carries no test hooks. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import psutil
import pytest

from streamrl import rewards
from streamrl.config import RewardConfig
from streamrl.errors import WorkerFailed
from streamrl.templates import tool_turn
from workers.reward import RewardPool, RewardResult, RewardStats

TIMEOUT_S = 1.0  # per call: real calls here take milliseconds, so this is generous even under load
DEFAULT = -1.0  # distinct from every real score, so a default is visible


def misbehaving_grader(kind: str, response: str, answer: str, final_answer_only: bool) -> float:
    """rewards.score, except for marker responses that hang, crash, exit or raise inside the worker."""
    if response == "hang":
        time.sleep(600)
    if response == "exit":
        os._exit(3)
    if response == "raise":
        raise ZeroDivisionError("grader bug")
    if response.startswith("slow:"):  # announce the pid, then wait to be killed from outside
        Path(response[5:]).write_text(str(os.getpid()))
        time.sleep(600)
    return rewards.score(kind, response, answer, final_answer_only)


def dies_at_start(kind: str, response: str, answer: str, final_answer_only: bool) -> float:
    os._exit(4)  # the warm-up call already kills the worker


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def reward_children() -> list[psutil.Process]:
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "workers.reward" in p.cmdline():
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def misbehaving_pool(workers: int) -> RewardPool:
    p = RewardPool(workers, TIMEOUT_S, DEFAULT, "rstar2_fused", grader=misbehaving_grader)
    p.wait_ready(60.0)
    return p


@pytest.fixture(scope="module")
def shared_pool() -> Iterator[RewardPool]:
    """One pool for the tests that leave it healthy (worker start-up is the slow part on 2 cores)."""
    p = misbehaving_pool(2)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def pool(shared_pool: RewardPool) -> RewardPool:
    assert len(shared_pool.worker_pids()) == 2, "an earlier test left the shared pool short of workers"
    return shared_pool


def changes(pool: RewardPool, before: RewardStats) -> dict[str, int]:
    """Counters that moved since `before`."""
    after = msgspec.structs.asdict(pool.stats())
    return {k: v - b for k, v in after.items() if k != "mean_latency_s" and (b := getattr(before, k)) != v}


def test_a_normal_call_returns_the_graders_score_with_status_ok(pool: RewardPool) -> None:
    before = pool.stats()
    right = pool.score_sync("so \\boxed{\\frac{1}{2}}", "0.5")
    assert right.status == "ok" and right.score == 1.0 and 0 < right.wall_s < TIMEOUT_S
    wrong = pool.score_sync("\\boxed{3}", "4")
    assert (wrong.status, wrong.score) == ("ok", 0.0)
    assert pool.score_sync("\\boxed{5} \ud800", "5").score == 1.0  # a lone surrogate cannot break a call
    assert changes(pool, before) == {"calls": 3, "ok": 3}


def test_a_hung_grading_call_times_out_with_the_default_score_and_the_pool_keeps_working(
    pool: RewardPool,
) -> None:
    before, stats = set(pool.worker_pids()), pool.stats()
    started = time.monotonic()
    result = pool.score_sync("hang", "1")
    assert (result.status, result.score) == ("timeout", DEFAULT)
    assert TIMEOUT_S <= time.monotonic() - started < TIMEOUT_S + 3.0
    killed = before - set(pool.worker_pids())
    assert len(killed) == 1 and all(gone(pid) for pid in killed)
    assert pool.score_sync("\\boxed{7}", "7").score == 1.0
    assert pool.score_sync("\\boxed{7}", "7").score == 1.0  # the replacement answers too
    assert changes(pool, stats) == {"calls": 3, "ok": 2, "timeouts": 1, "replaced": 1}


def test_a_worker_killed_with_sigkill_mid_call_is_replaced_and_the_call_reports_crashed(
    pool: RewardPool, tmp_path: Path
) -> None:
    marker, stats = tmp_path / "pid", pool.stats()
    results: list[RewardResult] = []
    caller = threading.Thread(target=lambda: results.append(pool.score_sync(f"slow:{marker}", "1")))
    caller.start()
    wait_for(lambda: marker.exists() and marker.read_text() != "", 10.0, "the grading worker's pid")
    victim = int(marker.read_text())
    os.kill(victim, signal.SIGKILL)
    caller.join(10.0)
    assert not caller.is_alive()
    assert [(r.status, r.score) for r in results] == [("crashed", DEFAULT)]
    assert victim not in pool.worker_pids() and len(pool.worker_pids()) == 2
    assert pool.score_sync("\\boxed{7}", "7").status == "ok"
    assert changes(pool, stats) == {"calls": 2, "ok": 1, "crashes": 1, "replaced": 1}


def test_a_worker_that_exits_inside_grading_is_replaced(pool: RewardPool) -> None:
    before = set(pool.worker_pids())
    result = pool.score_sync("exit", "1")
    assert (result.status, result.score) == ("crashed", DEFAULT)
    assert len(before - set(pool.worker_pids())) == 1
    assert pool.score_sync("\\boxed{7}", "7").score == 1.0


def test_a_grader_exception_returns_the_default_score_with_status_error_and_keeps_the_worker(
    pool: RewardPool,
) -> None:
    before, stats = pool.worker_pids(), pool.stats()
    result = pool.score_sync("raise", "1")
    assert (result.status, result.score) == ("error", DEFAULT)
    assert pool.worker_pids() == before and changes(pool, stats) == {"calls": 1, "errors": 1}


def test_concurrent_asyncio_calls_are_all_answered_while_one_hangs(pool: RewardPool) -> None:
    pairs = [(f"\\boxed{{{i}}}", str(i % 3)) for i in range(12)]

    async def run() -> list[RewardResult]:
        return await asyncio.wait_for(pool.score_many([("hang", "1"), *pairs]), 30.0)

    started = time.monotonic()
    results = asyncio.run(run())
    assert time.monotonic() - started < TIMEOUT_S + 10.0
    assert results[0].status == "timeout"
    assert [r.score for r in results[1:]] == [1.0 if i == i % 3 else 0.0 for i in range(12)]
    assert all(r.status == "ok" for r in results[1:])


def test_close_kills_every_worker_and_leaves_no_process() -> None:
    p = RewardPool(2, TIMEOUT_S, DEFAULT, "math_verify")
    pids = p.worker_pids()
    assert len(pids) == 2 and all(not gone(pid) for pid in pids)
    p.close()
    assert all(gone(pid) for pid in pids)
    assert not any(c.pid in pids for c in reward_children())
    with pytest.raises(RuntimeError, match="closed"):
        p.score_sync("\\boxed{1}", "1")
    p.close()  # idempotent


def test_close_makes_calls_in_flight_and_queued_behind_them_raise_promptly(tmp_path: Path) -> None:
    pool = misbehaving_pool(1)
    marker = tmp_path / "pid"
    outcomes: list[object] = []

    async def calls() -> None:  # the first occupies the only worker, the second waits in the queue
        pending = [pool.score(f"slow:{marker}", "1"), pool.score("\\boxed{1}", "1")]
        outcomes.extend(await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 20.0))

    caller = threading.Thread(target=asyncio.run, args=(calls(),))
    caller.start()
    wait_for(lambda: marker.exists() and marker.read_text() != "", 10.0, "the call to reach a worker")
    pids = pool.worker_pids()
    pool.close()
    caller.join(5.0)
    assert not caller.is_alive()
    assert [type(o) for o in outcomes] == [RuntimeError, RuntimeError]
    assert all(gone(pid) for pid in pids)


def test_final_answer_only_from_the_reward_config_reaches_the_workers() -> None:
    response = "Compute it." + tool_turn(["42"]) + "The tool printed the value I needed.<|im_end|>"
    with RewardPool.from_config(RewardConfig(type="math_verify", workers=1, final_answer_only=True)) as p:
        assert p.score_sync(response, "42").score == 0.0  # plain Math-Verify would credit the tool's 42
        assert p.score_sync(response.replace("needed.", "needed: \\boxed{42}"), "42").score == 1.0


def test_a_grader_that_cannot_be_imported_by_name_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="importable"):
        RewardPool(1, TIMEOUT_S, DEFAULT, "math_verify", grader=lambda k, r, a, f: 1.0)
    with pytest.raises(ValueError, match="unknown reward type"):
        RewardPool(1, TIMEOUT_S, DEFAULT, "llm_judge")


def test_workers_that_keep_dying_at_start_make_the_pool_fail_fast() -> None:
    with RewardPool(1, TIMEOUT_S, DEFAULT, "math_verify", grader=dies_at_start, startup_timeout_s=30.0) as p:
        first, second = p.score_sync("\\boxed{1}", "1"), p.score_sync("\\boxed{1}", "1")
        assert [(r.status, r.score) for r in (first, second)] == [("crashed", DEFAULT)] * 2
        with pytest.raises(WorkerFailed, match="failed to start"):
            p.score_sync("\\boxed{1}", "1")
        assert p.stats().start_failures == 3


def test_the_standalone_main_scores_a_jsonl_file(tmp_path: Path) -> None:
    data = tmp_path / "dump.jsonl"
    data.write_text('{"response": "\\\\boxed{4}", "answer": "4"}\n{"response": "no", "answer": "4"}\n')
    cmd = [sys.executable, "-m", "workers.reward", "--kind", "rlinf_pm5", "--workers", "1", str(data)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout.splitlines()
    assert out[0].startswith('{"score":5.0') or '"score": 5.0' in out[0]
    assert '"score": -5.0' in out[1] and '"stats"' in out[2]
