"""LocalSandbox's API: sync and async calls, bounded concurrency, lifecycle, and what it leaves behind."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import structlog

from sandbox_bridge import LocalSandbox, isolation
from sandbox_bridge.local import leftovers
from sandbox_bridge.types import SubmissionResult
from streamrl.config import EmbeddedSandbox

_spawned: list[int] = []
FIELDS = ("success", "run_success", "cost", "stdout", "stderr", "reason")


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """At the end of the session: no worker of these tests, no job process, cgroup or temp dir."""
    yield
    assert leftovers(_spawned) == []


@pytest.fixture
def make() -> Iterator[type[LocalSandbox]]:
    """LocalSandbox, with preload=() by default (fast start) and every instance closed and checked."""
    made: list[LocalSandbox] = []

    def factory(**kw: object) -> LocalSandbox:
        kw.setdefault("preload", ())
        box = LocalSandbox(**kw)  # type: ignore[arg-type]
        made.append(box)
        return box

    yield factory  # type: ignore[misc]
    for box in made:
        box.close()
        _spawned.extend(box.spawned_pids())
        assert leftovers(box.spawned_pids()) == []


def test_importing_the_package_does_not_start_or_import_the_executor() -> None:
    code = (
        "import sandbox_bridge, sys; print(sorted(m for m in sys.modules if m.startswith('sandbox_bridge')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['sandbox_bridge']"


def test_run_sync_returns_the_six_fields(make: type[LocalSandbox]) -> None:
    with make(max_workers=1, timeout_s=2.0) as sb:
        r = sb.run_sync("print(input()[::-1])", stdin="abc")
        assert isinstance(r, SubmissionResult)
        assert {f: getattr(r, f) for f in FIELDS if f != "cost"} == {
            "success": True, "run_success": True, "stdout": "cba\n", "stderr": "", "reason": ""
        }  # fmt: skip
        assert r.cost > 0 and r.isolation == sb.isolation


def test_async_run_inside_an_async_context_manager(make: type[LocalSandbox]) -> None:
    async def go() -> SubmissionResult:
        async with make(max_workers=1, timeout_s=2.0) as sb:
            return await sb.run("print(6 * 7)")

    assert asyncio.run(go()).stdout == "42\n"


def test_many_asyncio_tasks_share_a_bounded_pool(make: type[LocalSandbox]) -> None:
    sb = make(max_workers=2, timeout_s=3.0)
    code = "import os, time\nt = time.time()\ntime.sleep(0.3)\nprint(t, time.time())"

    async def go() -> list[SubmissionResult]:
        return await asyncio.gather(*(sb.run(code) for _ in range(6)))

    results = asyncio.run(go())
    assert all(r.run_success for r in results)
    spans = [tuple(map(float, (r.stdout or "").split())) for r in results]
    overlap = max(sum(1 for a, b in spans if a <= t < b) for t, _ in spans)
    assert overlap <= 2  # never more jobs at once than workers; the rest waited their turn


def test_calls_from_several_threads(make: type[LocalSandbox]) -> None:
    sb = make(max_workers=2, timeout_s=2.0)
    out: dict[int, str | None] = {}

    def call(i: int) -> None:
        out[i] = sb.run_sync(f"print({i} * 2)").stdout

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert out == {i: f"{i * 2}\n" for i in range(8)}


def test_from_config_takes_the_embedded_section(make: type[LocalSandbox]) -> None:
    cfg = EmbeddedSandbox(max_workers=1, timeout_s=1.5, memory_mb=64, max_output_chars=10)
    with LocalSandbox.from_config(cfg) as sb:
        _spawned.extend(sb.spawned_pids())
        assert (sb.limits.timeout_s, sb.limits.memory_mb, sb.limits.max_output_chars) == (1.5, 64, 10)
        assert sb.run_sync("print('x' * 50)").stdout == "x" * 10


def test_close_during_a_running_job_returns_internal_error_promptly(make: type[LocalSandbox]) -> None:
    sb = make(max_workers=1, timeout_s=20.0)
    result: list[SubmissionResult] = []
    t = threading.Thread(target=lambda: result.append(sb.run_sync("import time\ntime.sleep(15)")))
    t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    sb.close()
    t.join(timeout=10)
    assert time.monotonic() - t0 < 8 and result[0].reason == "internal_error"
    assert leftovers(sb.spawned_pids()) == []


def test_calls_still_queued_when_the_sandbox_closes_get_internal_error(make: type[LocalSandbox]) -> None:
    sb = make(max_workers=1, timeout_s=20.0)

    async def go() -> list[SubmissionResult]:
        tasks = [asyncio.create_task(sb.run("import time\ntime.sleep(15)")) for _ in range(3)]
        await asyncio.sleep(0.5)
        await asyncio.to_thread(sb.close)
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)

    assert [r.reason for r in asyncio.run(go())] == ["internal_error"] * 3


def test_close_is_idempotent_and_later_calls_raise(make: type[LocalSandbox]) -> None:
    sb = make(max_workers=1)
    sb.close()
    sb.close()
    with pytest.raises(RuntimeError, match="closed"):
        sb.run_sync("pass")


def test_a_worker_that_died_while_idle_is_replaced_without_losing_the_job(make: type[LocalSandbox]) -> None:
    import os

    sb = make(max_workers=1)
    [worker] = sb.worker_pids()
    os.kill(worker, 9)
    time.sleep(0.2)
    assert sb.run_sync("print('ok')").stdout == "ok\n"
    assert sb.worker_pids() != [worker]


def test_the_isolation_label_names_the_active_features(make: type[LocalSandbox]) -> None:
    sb = make(max_workers=1)
    assert sb.isolation == "rlimits-only" or sb.isolation.endswith("rlimits")
    assert sb.run_sync("pass").isolation == sb.isolation
    assert isolation.probe() == sb.isolation


def test_the_isolation_level_is_logged_once_per_label() -> None:
    with structlog.testing.capture_logs() as logs:
        isolation.log_once("test-label-xyz", {"pidns": "refused"})
        isolation.log_once("test-label-xyz", {"pidns": "refused"})
    assert [e["level"] for e in logs if e["event"] == "sandbox_isolation"] == ["test-label-xyz"]


@pytest.mark.parametrize("kw", [{"max_workers": 0}, {"timeout_s": 0}, {"memory_mb": 0}])
def test_invalid_limits_are_rejected(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="LocalSandbox"):
        LocalSandbox(**kw)  # type: ignore[arg-type]
