"""Redis worker process: serves Code Judge 0.0.5's work queue with streamrl's embedded executor.

    python -m sandbox_bridge.redis_worker --redis redis://HOST:6379 --workers 64 --timeout-s 4

Start it on any number of hosts against one Redis. It is a drop-in for Code Judge's
`run_workers.py`: a Code Judge API node can use it, and our API side (`RedisQueueSandbox`,
`streamrl sandbox serve --backend redis`) can use Code Judge's workers. Each of the `--workers`
slots loops like a Code Judge Worker: refresh its `work-ids:<uuid>` key, `BZPOPMIN` a job, run it
(here on a shared LocalSandbox pool), `RPUSH` the result. On top of that each job is leased while
it runs and every process runs the reaper, so a job whose worker died is run again elsewhere
(redis_queue.py). SIGTERM/SIGINT: stop taking jobs, finish the running ones, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
from redis.exceptions import RedisError

from sandbox_bridge.redis_queue import (
    MAX_QUEUE_WORK_LIFE_S,
    Keys,
    RedisJobQueue,
    WorkPayload,
    connect,
    decode_payload,
)
from sandbox_bridge.types import Submission, SubmissionResult, internal_error
from streamrl import log as slog

if TYPE_CHECKING:
    from sandbox_bridge.local import LocalSandbox

log = slog.get_logger(__name__)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m sandbox_bridge.redis_worker", description=__doc__.split("\n")[0]
    )
    p.add_argument("--redis", required=True, help="redis://host:port/db of the shared queue")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="concurrent job slots")
    p.add_argument("--timeout-s", type=float, default=4.0, help="wall/CPU limit per job")
    p.add_argument("--memory-mb", type=int, default=256)
    p.add_argument("--max-output-chars", type=int, default=1000)
    p.add_argument("--preload", default="math,numpy,sympy", help="modules the warm pool imports once")
    p.add_argument("--lease-s", type=float, default=10.0, help="a dead worker's job is re-run after this")
    p.add_argument("--block-s", type=float, default=2.0, help="BZPOPMIN timeout; bounds shutdown time")
    p.add_argument("--max-redeliveries", type=int, default=3)
    p.add_argument(
        "--max-queue-work-life-s",
        type=float,
        default=MAX_QUEUE_WORK_LIFE_S,
        help="drop short (non long-batch) jobs older than this, as Code Judge does; 0 keeps all",
    )
    p.add_argument("--max-redis-down-s", type=float, default=300.0, help="exit 1 if Redis is gone this long")
    p.add_argument("--key-prefix", default="js")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = p.parse_args(argv)
    if args.workers < 1 or args.lease_s <= 0 or args.block_s <= 0:
        p.error("--workers, --lease-s and --block-s must be positive")
    return args


class RedisDown(Exception):
    pass


async def _slot(
    queue: RedisJobQueue, sandbox: LocalSandbox, stop: asyncio.Event, args: argparse.Namespace
) -> None:
    worker_id = str(uuid.uuid4())
    down_since: float | None = None
    backoff = 0.5
    try:
        while not stop.is_set():
            try:
                await queue.heartbeat(worker_id)
                # Not cancelled mid-pop on shutdown: a pop cancelled after Redis answered loses the job.
                member = await queue.take(args.block_s, args.lease_s)
                if member is not None:
                    await _handle(queue, sandbox, member, args)
                down_since, backoff = None, 0.5
            except (RedisError, OSError) as exc:
                down_since = down_since or time.monotonic()
                if time.monotonic() - down_since > args.max_redis_down_s:
                    raise RedisDown(f"Redis unreachable for {args.max_redis_down_s:.0f} s: {exc}") from exc
                log.warning(
                    "redis_worker_redis_error", error=f"{type(exc).__name__}: {exc}", retry_in_s=backoff
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), backoff)
                backoff = min(backoff * 2, 30.0)
    finally:
        with contextlib.suppress(RedisError, OSError):
            await queue.unregister(worker_id)


async def _handle(
    queue: RedisJobQueue, sandbox: LocalSandbox, member: bytes, args: argparse.Namespace
) -> None:
    try:
        payload = decode_payload(member)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        await _reject(queue, member, exc)
        return
    age = time.time() - payload.timestamp
    if not payload.long_running and args.max_queue_work_life_s > 0 and age >= args.max_queue_work_life_s:
        # Code Judge's API has given up on short jobs this old; answering would only waste a slot.
        log.info("redis_worker_stale_job_dropped", work_id=payload.work_id, age_s=round(age, 3))
        await queue.release(member)
        return
    done = asyncio.Event()
    renewer = asyncio.create_task(_renew(queue, member, args.lease_s, done))
    try:
        result = await sandbox.submit(payload.submission)
    except Exception:  # the executor's own fault: answer it, as Code Judge does, rather than die
        log.exception("redis_worker_executor_failed", work_id=payload.work_id)
        result = internal_error(payload.submission.sub_id or "")
    finally:
        # Stopped by an event, not cancel(): redis-py 8.1 can swallow a cancellation mid-command.
        done.set()
        await renewer
    result.sub_id = payload.submission.sub_id or result.sub_id
    await queue.ack(member, payload, result)


async def _reject(queue: RedisJobQueue, member: bytes, exc: Exception) -> None:
    """Answer an invalid payload with `invalid_input` when it names a work_id (Code Judge's intent)."""
    log.warning("redis_worker_invalid_payload", error=str(exc), payload=member[:200])
    try:
        raw = msgspec.json.decode(member)
    except msgspec.DecodeError:
        raw = None
    work_id = raw.get("work_id") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or not isinstance(work_id, str):
        await queue.release(member)
        return
    sub = raw.get("submission")
    sub_id = sub.get("sub_id") if isinstance(sub, dict) else None
    placeholder = Submission(type="python", solution="")
    payload = WorkPayload(
        work_id=work_id, timestamp=0.0, long_running=raw.get("long_running") is True, submission=placeholder
    )
    sub_id = sub_id if isinstance(sub_id, str) else ""
    result = SubmissionResult(
        sub_id=sub_id, success=False, run_success=False, cost=0.0, reason="invalid_input"
    )
    await queue.ack(member, payload, result)


async def _renew(queue: RedisJobQueue, member: bytes, lease_s: float, done: asyncio.Event) -> None:
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), lease_s / 3)
        if done.is_set():
            return
        try:
            await queue.renew(member, lease_s)
        except (RedisError, OSError) as exc:  # the slot loop notices a dead Redis; just keep trying
            log.warning("redis_worker_lease_renew_failed", error=str(exc))


async def _reaper(queue: RedisJobQueue, stop: asyncio.Event, every_s: float) -> None:
    while not stop.is_set():
        try:
            requeued, failed = await queue.reap()
            if requeued or failed:
                log.info("redis_worker_reaped", requeued=requeued, given_up=failed)
        except (RedisError, OSError) as exc:
            log.warning("redis_worker_reap_failed", error=str(exc))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


async def _watch_parent(parent_pid: int, stop: asyncio.Event) -> None:
    # A worker started by a streamrl process must not outlive it, even if that process is SIGKILLed.
    while not stop.is_set():
        if os.getppid() != parent_pid:
            log.info("redis_worker_parent_gone", parent_pid=parent_pid)
            stop.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


async def serve(args: argparse.Namespace) -> int:
    from sandbox_bridge.local import LocalSandbox

    queue = RedisJobQueue(
        connect(args.redis, args.block_s), Keys(prefix=args.key_prefix), args.max_redeliveries
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        secs, usecs = await queue.r.time()
        skew = abs(time.time() - (secs + usecs / 1e6))
        if skew > 1.0:  # stale-drop compares the API's clock with ours
            log.warning("redis_worker_clock_skew", skew_s=round(skew, 3))
        preload = tuple(m for m in args.preload.split(",") if m)
        sandbox = LocalSandbox(
            max_workers=args.workers,
            timeout_s=args.timeout_s,
            memory_mb=args.memory_mb,
            max_output_chars=args.max_output_chars,
            preload=preload,
        )
        try:
            slots = [asyncio.create_task(_slot(queue, sandbox, stop, args)) for _ in range(args.workers)]
            helpers = [asyncio.create_task(_reaper(queue, stop, max(0.2, args.lease_s / 2)))]
            if args.parent_pid is not None:
                helpers.append(asyncio.create_task(_watch_parent(args.parent_pid, stop)))
            log.info("redis_worker_started", slots=args.workers, isolation=sandbox.isolation, pid=os.getpid())
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait([*slots, stopping], return_when=asyncio.FIRST_COMPLETED)
            stop.set()  # a slot only ends early on RedisDown; then the whole process goes
            # Running jobs finish (bounded by their own timeout); their leases cover a forced exit.
            _, late = await asyncio.wait(slots, timeout=args.block_s + args.timeout_s + 10.0)
            for task in [*late, *helpers, stopping]:
                task.cancel()
            await asyncio.gather(*late, *helpers, stopping, return_exceptions=True)
            errors = [t.exception() for t in slots if t.done() and not t.cancelled() and t.exception()]
            if errors:
                log.error("redis_worker_failed", error=str(errors[0]))
                return 1
            return 0
        finally:
            await asyncio.to_thread(sandbox.close)
    finally:
        await queue.r.aclose()
        log.info("redis_worker_stopped", pid=os.getpid())


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    slog.configure(role="sandbox_worker", level=args.log_level)
    return asyncio.run(serve(args))


def spawn_worker(url: str, slots: int, extra_args: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """Start a worker process tied to this one (it exits when we are gone)."""
    cmd = [sys.executable, "-m", "sandbox_bridge.redis_worker", "--redis", url, "--workers", str(slots)]
    return subprocess.Popen([*cmd, "--parent-pid", str(os.getpid()), *extra_args])


def stop_worker(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """SIGTERM, wait for running jobs to finish, then SIGKILL; their leases make that safe."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5.0)


if __name__ == "__main__":
    sys.exit(main())
