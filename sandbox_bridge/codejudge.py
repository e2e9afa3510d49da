"""Client of a Code Judge server (or `streamrl sandbox serve`) over HTTP: `POST /run/long-batch`.

Behaviour (code_judge.md 7.1, roc_and_grpo.md 4.3), and where it deliberately differs from rStar2's
`call_long_batch`:

* micro-batching: whatever is queued right now, up to `batch_size` (32), goes in one long-batch POST;
  at most `concurrency` POSTs are in flight (client.MicroBatcher);
* an item is retried only when its result says `queue_timeout`, or when the whole request failed
  (connection error, non-200, timeout, malformed or mismatched response); `worker_timeout`, `""`
  and `internal_error` are final;
* results are handed back as soon as they are final: a retry round only carries the items still
  pending, and the other callers are not held up by it;
* backoff doubles from `backoff_s` up to `max_backoff_s`, and is slept only *between failed
  attempts* (rStar2 sleeps after every attempt, adding >= 0.5 s to every tool call);
* after `max_retries` attempts an item gets an error result, `queue_timeout` (the server kept
  timing it out) or `internal_error` (the request kept failing), never an exception and never a
  hang: every request runs under `asyncio.timeout(timeout_s)`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec

from sandbox_bridge.client import BatchItem, MicroBatcher, python_submission, wire_submission
from sandbox_bridge.types import Submission, SubmissionResult, internal_error
from streamrl.config import CodeJudgeSandbox
from streamrl.log import get_logger

log = get_logger(__name__)


class _BatchResult(msgspec.Struct):
    results: list[SubmissionResult]
    sub_id: str | None = None


class BadResponse(Exception):
    """The server answered, but not with a usable long-batch result for this request."""


class CodeJudgeClient:
    """The `Sandbox` backend for `sandbox: {type: code_judge, url: ...}`."""

    def __init__(
        self,
        url: str,
        timeout_s: float = 60.0,
        concurrency: int = 8,
        batch_size: int = 32,
        max_retries: int = 4,
        backoff_s: float = 0.5,
        max_backoff_s: float = 4.0,
    ) -> None:
        if max_retries < 1:
            raise ValueError(f"max_retries={max_retries} must be >= 1")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.isolation = "code_judge"
        self._batcher = MicroBatcher(self._send, concurrency, batch_size, name="code_judge")
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_config(cls, cfg: CodeJudgeSandbox) -> CodeJudgeClient:
        return cls(
            cfg.url,
            timeout_s=cfg.timeout_s,
            concurrency=cfg.concurrency,
            batch_size=cfg.batch_size,
            max_retries=cfg.max_retries,
        )

    async def submit(self, sub: Submission) -> SubmissionResult:
        return await self._batcher.submit(sub)

    async def run(self, code: str, stdin: str | None = None) -> SubmissionResult:
        return await self.submit(python_submission(code, stdin))

    async def status(self) -> dict[str, Any]:
        """`GET /status`: `{"queue": jobs waiting, "num_workers": ...}`, for back-pressure."""
        async with asyncio.timeout(self.timeout_s):
            async with self._http().get(f"{self.url}/status") as resp:
                resp.raise_for_status()
                return msgspec.json.decode(await resp.read(), type=dict[str, Any])

    async def close(self) -> None:
        await self._batcher.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> CodeJudgeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # One connection per concurrent POST, kept alive between batches.
            connector = aiohttp.TCPConnector(limit=self._batcher.concurrency)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def _send(self, items: list[BatchItem]) -> None:
        pending = items
        final: dict[BatchItem, SubmissionResult] = {}
        for attempt in range(1, self.max_retries + 1):
            try:
                results = await self._post([it.sub for it in pending])
            except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError, BadResponse) as exc:
                log.warning(
                    "code_judge_request_failed",
                    url=self.url,
                    attempt=attempt,
                    size=len(pending),
                    error=f"{type(exc).__name__}: {exc}",
                )
                for it in pending:
                    final[it] = internal_error(it.sub.sub_id or "", self.isolation)
            else:
                retry: list[BatchItem] = []
                for it, res in zip(pending, results, strict=True):
                    res.isolation = self.isolation
                    if res.reason == "queue_timeout":
                        final[it] = res
                        retry.append(it)
                    else:
                        it.resolve(res)
                pending = retry
            if not pending:
                return
            if attempt < self.max_retries:
                await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
        log.warning("code_judge_gave_up", url=self.url, attempts=self.max_retries, size=len(pending))
        for it in pending:
            it.resolve(final[it])

    async def _post(self, subs: list[Submission]) -> list[SubmissionResult]:
        body = msgspec.json.encode({"type": "batch", "submissions": [wire_submission(s) for s in subs]})
        async with asyncio.timeout(self.timeout_s):
            async with self._http().post(
                f"{self.url}/run/long-batch", data=body, headers={"Content-Type": "application/json"}
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise BadResponse(f"HTTP {resp.status}: {raw[:200]!r}")
        results = msgspec.json.decode(raw, type=_BatchResult).results
        # Results are matched by position; the sub_id echo guards against a server that reorders.
        if len(results) != len(subs):
            raise BadResponse(f"{len(results)} results for {len(subs)} submissions")
        for sub, res in zip(subs, results, strict=True):
            if res.sub_id != sub.sub_id:
                raise BadResponse(f"result sub_id {res.sub_id!r} for submission {sub.sub_id!r}")
        return results
