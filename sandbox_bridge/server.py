"""`streamrl sandbox serve`: Code Judge 0.0.5's HTTP API (code_judge.md section 2) over our backends.

    streamrl sandbox serve --port 8088                       # embedded pool in this process
    streamrl sandbox serve --port 8088 --backend redis --redis-url redis://HOST:6379 [--workers N]

Existing Code Judge clients (rStar2's `call_long_batch`, RLinf's HttpCodeJudgeTool, `judge_client.py`)
work unchanged: same paths, same request validation (422 with a pydantic-style `detail` list), same
response shapes, 200 for every valid request with faults reported in `reason`. Wait budgets follow
Code Judge's defaults for the given `--timeout-s` T: `/run`, `/judge` and `/batch` wait T + 9 s,
the long-batch endpoints T + 3605 s; whatever is not done by then is `queue_timeout`.
With `--backend redis`, `/run` and `/batch` jobs are short (workers drop them after 4 s in the
queue) and long-batch jobs are long-running, exactly as Code Judge's API marks them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec
from aiohttp import web

from sandbox_bridge.redis_queue import RedisQueueSandbox
from sandbox_bridge.types import Submission, SubmissionResult, internal_error, queue_timeout
from sandbox_bridge.validation import ValidationFailed, parse_batch, parse_submission
from streamrl import log as slog

log = slog.get_logger(__name__)


class Backend(Protocol):
    async def run_many(
        self, subs: list[Submission], long_running: bool, max_wait_s: float
    ) -> list[SubmissionResult]: ...

    async def status(self) -> dict[str, int]: ...

    async def close(self) -> None: ...


class LocalBackend:
    """The embedded pool. `queue` counts accepted jobs beyond the pool's slots, as Code Judge's ZCARD."""

    def __init__(self, max_workers: int, timeout_s: float, memory_mb: int, **local_kwargs: Any) -> None:
        from sandbox_bridge.local import LocalSandbox

        self.max_workers = max_workers
        self.sandbox = LocalSandbox(
            max_workers=max_workers, timeout_s=timeout_s, memory_mb=memory_mb, **local_kwargs
        )
        self._accepted = 0

    async def run_many(
        self, subs: list[Submission], long_running: bool, max_wait_s: float
    ) -> list[SubmissionResult]:
        start = time.monotonic()
        tasks = [asyncio.create_task(self.sandbox.submit(s)) for s in subs]
        self._accepted += len(tasks)
        try:
            await asyncio.wait(tasks, timeout=max_wait_s)
        finally:
            self._accepted -= len(tasks)
            for t in tasks:
                # Drops jobs still queued past their budget; a running one ends at its own timeout.
                t.cancel()
        waited = time.monotonic() - start
        return [_task_result(t, s, waited) for t, s in zip(tasks, subs, strict=True)]

    async def status(self) -> dict[str, int]:
        return {"queue": max(0, self._accepted - self.max_workers), "num_workers": self.max_workers}

    async def close(self) -> None:
        await asyncio.to_thread(self.sandbox.close)


def _task_result(task: asyncio.Task[SubmissionResult], sub: Submission, waited: float) -> SubmissionResult:
    if not task.done() or task.cancelled():  # cancelled just now, or earlier
        return queue_timeout(sub.sub_id or "", waited)
    if task.exception() is not None:
        log.error("sandbox_server_executor_failed", sub_id=sub.sub_id, error=repr(task.exception()))
        return internal_error(sub.sub_id or "")
    return task.result()


class RedisBackend:
    """Code Judge's own architecture: we are the API node; workers anywhere serve the queue."""

    def __init__(self, sandbox: RedisQueueSandbox) -> None:
        self.sandbox = sandbox

    async def run_many(
        self, subs: list[Submission], long_running: bool, max_wait_s: float
    ) -> list[SubmissionResult]:
        return await self.sandbox.run_batch(subs, long_running=long_running, max_wait_s=max_wait_s)

    async def status(self) -> dict[str, int]:
        return await self.sandbox.status()

    async def close(self) -> None:
        await self.sandbox.close()


BACKEND = web.AppKey("backend", Backend)


def make_app(
    backend: Backend, timeout_s: float, short_wait_s: float | None = None, long_wait_s: float | None = None
) -> web.Application:
    """The Code Judge API over `backend`. Wait budgets default to Code Judge's for exec limit T."""
    process_s = timeout_s + 5.0  # MAX_PROCESS_TIME
    short = short_wait_s if short_wait_s is not None else process_s + 4.0  # MAX_QUEUE_WAIT_TIME
    long = long_wait_s if long_wait_s is not None else 3600.0 + process_s  # LONG_BATCH_MAX_QUEUE_WAIT_TIME
    app = web.Application(client_max_size=64 * 1024**2)
    app[BACKEND] = backend

    async def ping(_: web.Request) -> web.Response:
        return _json("pong")

    async def status(request: web.Request) -> web.Response:
        return _json(await request.app[BACKEND].status())

    app.router.add_get("/ping", ping)
    app.router.add_get("/status", status)
    for path, with_output in (("/run", True), ("/judge", False)):
        app.router.add_post(path, _single(with_output, short))
        app.router.add_post(f"{path}/batch", _batch(with_output, False, short))
        app.router.add_post(f"{path}/long-batch", _batch(with_output, True, long))

    async def close_backend(app: web.Application) -> None:
        await app[BACKEND].close()

    app.on_cleanup.append(close_backend)
    return app


def _single(with_output: bool, wait_s: float) -> Any:
    async def handler(request: web.Request) -> web.Response:
        try:
            sub = parse_submission(await request.read())
        except ValidationFailed as exc:
            return _json({"detail": exc.errors}, status=422)
        [result] = await _run(request.app[BACKEND], [sub], False, wait_s)
        return _json(result.to_codejudge(with_output))

    return handler


def _batch(with_output: bool, long_running: bool, wait_s: float) -> Any:
    async def handler(request: web.Request) -> web.Response:
        try:
            batch = parse_batch(await request.read())
        except ValidationFailed as exc:
            return _json({"detail": exc.errors}, status=422)
        results = await _run(request.app[BACKEND], batch.submissions, long_running, wait_s)
        return _json({"sub_id": batch.sub_id, "results": [r.to_codejudge(with_output) for r in results]})

    return handler


async def _run(
    backend: Backend, subs: list[Submission], long_running: bool, wait_s: float
) -> list[SubmissionResult]:
    """Run and answer 200 whatever happens, as Code Judge tries to: faults become internal_error."""
    try:
        results = await backend.run_many(subs, long_running, wait_s)
    except Exception:
        log.exception("sandbox_server_backend_failed", size=len(subs))
        return [internal_error(s.sub_id or "") for s in subs]
    for sub, res in zip(subs, results, strict=True):
        res.sub_id = sub.sub_id or res.sub_id  # the id the client sent (or the one we assigned)
    return results


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status, content_type="application/json")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="streamrl sandbox serve", description="Code Judge-compatible HTTP API")
    p.add_argument("--host", default="127.0.0.1", help="never expose it beyond a trusted network")
    p.add_argument("--port", type=int, default=8088)
    p.add_argument("--backend", choices=["local", "redis"], default="local")
    p.add_argument("--redis-url", default=None, help="required with --backend redis")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="local: pool size (default: CPU count); redis: worker slots to start here (default 0: attach)",
    )
    p.add_argument(
        "--timeout-s", type=float, default=4.0, help="per-job limit (Code Judge MAX_EXECUTION_TIME)"
    )
    p.add_argument("--memory-mb", type=int, default=256)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = p.parse_args(argv)
    if args.backend == "redis" and not args.redis_url:
        p.error("--backend redis needs --redis-url")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    slog.configure(role="sandbox_server", level=args.log_level)

    async def build() -> web.Application:
        backend: Backend
        if args.backend == "local":
            backend = LocalBackend(args.workers or os.cpu_count() or 1, args.timeout_s, args.memory_mb)
        else:
            rs = RedisQueueSandbox(
                args.redis_url, workers=args.workers or 0, timeout_s=args.timeout_s, memory_mb=args.memory_mb
            )
            backend = RedisBackend(rs)
        log.info("sandbox_server_starting", host=args.host, port=args.port, backend=args.backend)
        return make_app(backend, args.timeout_s)

    web.run_app(build(), host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
