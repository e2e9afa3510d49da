"""One async client API over the three sandbox backends, chosen by the job spec's `sandbox` section.

    sandbox = make_sandbox(job.sandbox)          # None -> the embedded pool with default limits
    result = await sandbox.run("print(1)")       # -> SubmissionResult (Code Judge's shape)
    await sandbox.close()

| `sandbox.type` | backend                                    | module              |
|----------------|--------------------------------------------|---------------------|
| `embedded`     | LocalSandbox, a warm pool in this process  | local.py            |
| `code_judge`   | a Code Judge server, `POST /run/long-batch` | codejudge.py        |
| `redis`        | Code Judge 0.0.5 Redis queue + workers     | redis_queue.py      |

Failures of the user's code come back as results; faults of the backend come back as results too
(`internal_error` / `queue_timeout`), so an agent loop never has to catch anything but cancellation.

`MicroBatcher` is the shared front half of the two remote backends: callers submit one job at a
time, and each of `concurrency` senders takes whatever is queued *right now* (up to `batch_size`)
without waiting for a batch to fill, which is how rStar2's RequestProcessor keeps latency low.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import msgspec

from sandbox_bridge.types import Submission, SubmissionResult, internal_error, new_id
from streamrl.config import CodeJudgeSandbox, EmbeddedSandbox, RedisSandbox, SandboxConfig
from streamrl.log import get_logger

log = get_logger(__name__)


@runtime_checkable
class Sandbox(Protocol):
    """What the agent loop and the reward role use; every backend implements it."""

    async def submit(self, sub: Submission) -> SubmissionResult: ...

    async def run(self, code: str, stdin: str | None = None) -> SubmissionResult: ...

    async def close(self) -> None: ...


def make_sandbox(cfg: SandboxConfig | None = None) -> Sandbox:
    """The backend the job spec asks for. Remote backends connect lazily, on first use."""
    if cfg is None or isinstance(cfg, EmbeddedSandbox):
        return _EmbeddedSandbox(cfg or EmbeddedSandbox())
    if isinstance(cfg, CodeJudgeSandbox):
        from sandbox_bridge.codejudge import CodeJudgeClient

        return CodeJudgeClient.from_config(cfg)
    if isinstance(cfg, RedisSandbox):
        from sandbox_bridge.redis_queue import RedisQueueSandbox

        return RedisQueueSandbox.from_config(cfg)
    raise TypeError(f"unknown sandbox config {type(cfg).__name__}")


class _EmbeddedSandbox:
    """LocalSandbox behind the async `close()` of the Sandbox protocol (its own close is sync)."""

    def __init__(self, cfg: EmbeddedSandbox) -> None:
        from sandbox_bridge.local import LocalSandbox

        self.local = LocalSandbox.from_config(cfg)
        self.isolation: str = self.local.isolation

    async def submit(self, sub: Submission) -> SubmissionResult:
        return await self.local.submit(sub)

    async def run(self, code: str, stdin: str | None = None) -> SubmissionResult:
        return await self.local.run(code, stdin)

    async def close(self) -> None:
        # LocalSandbox.close joins pool processes; keep that off the event loop.
        await asyncio.to_thread(self.local.close)


def wire_submission(sub: Submission) -> dict[str, Any]:
    """A submission exactly as Code Judge's pydantic model dumps it: its field order, nulls included.

    Byte-compatible with `model_dump_json()`, which matters in Redis, where the JSON is the ZSET member.
    """
    return {
        "sub_id": sub.sub_id,
        "type": sub.type,
        "options": sub.options,
        "solution": sub.solution,
        "input": sub.input,
        "expected_output": sub.expected_output,
    }


def python_submission(code: str, stdin: str | None = None) -> Submission:
    """`run(code, stdin)` as a Code Judge submission, with our own sub_id so results can be checked."""
    return Submission(type="python", solution=code, input=stdin, sub_id=new_id())


@dataclass(eq=False)
class BatchItem:
    """One queued submission and the future its caller awaits."""

    sub: Submission
    future: asyncio.Future[SubmissionResult] = field(repr=False)

    def resolve(self, result: SubmissionResult) -> None:
        # The caller may have been cancelled meanwhile; its result is then simply dropped.
        if not self.future.done():
            self.future.set_result(result)


SendBatch = Callable[[list[BatchItem]], Awaitable[None]]


class MicroBatcher:
    """Bounded-concurrency micro-batching: `concurrency` senders, each sending <= `batch_size` items.

    `send(items)` must resolve each item (it may do so one by one, as results arrive); any item it
    leaves unresolved, or every item when it raises, gets an `internal_error` result, so a caller's
    await always ends. Senders start lazily inside the running loop.
    """

    def __init__(self, send: SendBatch, concurrency: int, batch_size: int, name: str) -> None:
        if concurrency < 1 or batch_size < 1:
            raise ValueError(f"concurrency={concurrency} and batch_size={batch_size} must be >= 1")
        self._send = send
        self.concurrency = concurrency
        self.batch_size = batch_size
        self.name = name
        self._queue: asyncio.Queue[BatchItem] | None = None
        self._senders: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    async def submit(self, sub: Submission) -> SubmissionResult:
        sub_id = sub.sub_id or new_id()
        if self._closed:
            return internal_error(sub_id)
        loop = asyncio.get_running_loop()
        if self._queue is None:
            self._loop = loop
            self._start()
        elif loop is not self._loop:
            raise RuntimeError(f"the {self.name} sandbox is bound to the event loop it was first used from")
        assert self._queue is not None
        if sub.sub_id is None:
            sub = msgspec.structs.replace(sub, sub_id=sub_id)
        item = BatchItem(sub, loop.create_future())
        self._queue.put_nowait(item)
        return await item.future

    def _start(self) -> None:
        self._queue = asyncio.Queue()
        self._senders = [
            asyncio.create_task(self._sender(), name=f"{self.name}-sender-{i}")
            for i in range(self.concurrency)
        ]

    async def _sender(self) -> None:
        assert self._queue is not None
        while not self._closed:
            batch = [await self._queue.get()]
            # Take only what is already waiting: a partial batch now beats a full one later.
            while len(batch) < self.batch_size and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            batch = [it for it in batch if not it.future.done()]
            if not batch:
                continue
            try:
                await self._send(batch)
            except asyncio.CancelledError:
                _fail_all(batch)
                raise
            except Exception:
                log.exception("sandbox_batch_failed", backend=self.name, size=len(batch))
            _fail_all(batch)

    async def close(self) -> None:
        """Stop the senders; every caller still waiting gets an `internal_error` result."""
        self._closed = True
        pending = self._senders
        # redis-py 8.1's asyncio client can swallow a cancellation that lands mid-command (the
        # command then returns normally), so cancel again, in bounded rounds, until they are gone.
        for _ in range(5):
            if not pending:
                break
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=1.0)
            pending = list(pending)
        if pending:
            log.error("sandbox_senders_did_not_stop", backend=self.name, count=len(pending))
        for task in self._senders:
            if task.done() and not task.cancelled() and task.exception() is not None:
                log.error("sandbox_sender_failed", backend=self.name, error=repr(task.exception()))
        self._senders = []
        while self._queue is not None and not self._queue.empty():
            _fail_all([self._queue.get_nowait()])


def _fail_all(items: list[BatchItem]) -> None:
    for it in items:
        it.resolve(internal_error(it.sub.sub_id or ""))
