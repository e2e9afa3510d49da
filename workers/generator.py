"""The generator role: prompts from the buffer, n_samples rollouts each across engines, scored groups back.

    python -m workers.generator --job JOB.yaml --buffer ADDR --engines URL[,URL...] --model DIR [--name gen-0]
        [--metrics-dir RUN_DIR]     # a metrics record every 5 s to RUN_DIR/metrics-generator-<name>.jsonl

        buffer ──Prompts──▶ group task per prompt ──n_samples──▶ agent loop ──HTTP──▶ engines
           ▲                      │                                   └──────────▶ sandbox (tool calls)
           └──Group / GroupAcks───┴── reward pool (processes, timeouts) ◀── RolloutResult

Flow control: at most `rollout.concurrency` trajectories run at once; the generator asks for
`free // n_samples` prompts and the buffer's admission rule may answer with fewer (or none, with a
retry hint). Every group is acknowledged; a group whose ack does not come is sent again (the buffer
deduplicates by uid). Failure handling: a sample whose engine fails is rerun from scratch on another
healthy engine; an engine that failed is probed until it answers /health again; a prompt that cannot
be finished (no engine for `engine_wait_s`) is released to the buffer for re-dispatch. A hung or
crashed reward worker costs one default score (workers/reward.py), never a stuck group.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from pathlib import Path
from typing import Any

from streamrl import log
from streamrl.agent import RolloutResult, run_math, run_rstar2
from streamrl.config import JobSpec
from streamrl.config_load import load_job_or_exit
from streamrl.errors import TransportError
from streamrl.group_frame import GroupFrame, write_group
from streamrl.messages import (
    GroupAck,
    GroupAcks,
    Heartbeat,
    Message,
    Prompt,
    PromptRelease,
    PromptRequest,
    Prompts,
)
from streamrl.metrics import MetricsWriter, RolloutMeter, TimedSandbox
from streamrl.transport import tune_allocator
from streamrl.transport_client import AsyncClient
from workers.engines.client import EngineClient, EngineError
from workers.reward import RewardPool

logger = log.get_logger("workers.generator")
HEARTBEAT_S = 5.0
ACK_TIMEOUT_S = 30.0
SEND_ATTEMPTS = 3


class EnginePool:
    """Round-robin over healthy engines; a failed engine is probed until /health answers again."""

    def __init__(self, engines: list[EngineClient], probe_every_s: float = 2.0) -> None:
        self.engines = engines
        self.healthy: set[int] = set(range(len(engines)))
        self._rr = itertools.cycle(range(len(engines)))
        self.probe_every_s = probe_every_s
        self.failures = 0

    def pick(self) -> tuple[int, EngineClient] | None:
        for _ in range(len(self.engines)):
            i = next(self._rr)
            if i in self.healthy:
                return i, self.engines[i]
        return None

    def failed(self, i: int, error: Exception) -> None:
        if i in self.healthy:
            self.healthy.discard(i)
            self.failures += 1
            logger.warning("engine_failed", engine=self.engines[i].url, error=str(error))

    async def wait_started(self, timeout_s: float) -> None:
        """At start, wait (bounded) for every engine; one that never answers starts out unhealthy."""
        ok = await asyncio.gather(*(e.wait_healthy(timeout_s) for e in self.engines), return_exceptions=True)
        self.healthy = {i for i, err in enumerate(ok) if err is None}
        if not self.healthy:
            raise EngineError("engines", "/health", f"no engine answered within {timeout_s:.0f}s")

    async def probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.probe_every_s)
            for i in set(range(len(self.engines))) - self.healthy:
                if await self.engines[i].health():
                    self.healthy.add(i)
                    logger.info("engine_back", engine=self.engines[i].url)


class GeneratorRole:
    def __init__(
        self,
        spec: JobSpec,
        client: AsyncClient,
        engines: EnginePool,
        tokenizer: Any,
        rewards: RewardPool,
        sandbox: Any = None,
        engine_wait_s: float = 60.0,
        metrics: MetricsWriter | None = None,
        metrics_every_s: float = 5.0,
    ) -> None:
        self.spec, self.client, self.engines = spec, client, engines
        self.meter = RolloutMeter()
        self.tokenizer, self.rewards = tokenizer, rewards
        self.sandbox = None if sandbox is None else TimedSandbox(sandbox, self.meter)
        self.engine_wait_s = engine_wait_s
        self.metrics, self.metrics_every_s = metrics, metrics_every_s
        self.n = spec.rollout.n_samples
        self.free = spec.rollout.concurrency  # trajectories not yet promised to a prompt
        self._acks: dict[int, asyncio.Future[GroupAck]] = {}
        self._prompts: asyncio.Future[Prompts] | None = None
        self.stats: dict[str, int] = {"groups_sent": 0, "released": 0, "resends": 0, "engine_retries": 0}
        self.stopping = asyncio.Event()

    # ------------------------------------------------------------------ buffer conversation

    async def _receive(self) -> None:
        """The only reader of the socket: routes replies to whoever waits for them."""
        while not self.stopping.is_set():
            msg: Message | None = await self.client.recv(0.5)
            match msg:
                case None:
                    continue
                case Prompts() if self._prompts is not None and not self._prompts.done():
                    self._prompts.set_result(msg)
                case GroupAcks(acks=acks):
                    for ack in acks:
                        if (fut := self._acks.pop(ack.uid, None)) is not None and not fut.done():
                            fut.set_result(ack)
                case _:
                    logger.warning("unexpected_reply", message=msg)

    async def _ask_prompts(self, k: int) -> Prompts | None:
        self._prompts = asyncio.get_running_loop().create_future()
        await self.client.send(PromptRequest(max_prompts=k))
        try:
            return await asyncio.wait_for(self._prompts, ACK_TIMEOUT_S)
        except TimeoutError:
            logger.warning("prompt_request_unanswered", waited_s=ACK_TIMEOUT_S)
            return None

    async def _send_group(self, group: GroupFrame) -> GroupAck | None:
        for attempt in range(SEND_ATTEMPTS):
            fut = asyncio.get_running_loop().create_future()
            self._acks[group.uid] = fut
            await self.client.send(group)
            try:
                return await asyncio.wait_for(fut, ACK_TIMEOUT_S)
            except TimeoutError:
                self._acks.pop(group.uid, None)
                self.stats["resends"] += 1
                logger.warning("group_ack_missing", uid=group.uid, attempt=attempt + 1)
        return None

    # ------------------------------------------------------------------ rollouts

    async def _sample(self, prompt: Prompt, index: int) -> RolloutResult:
        deadline = time.monotonic() + self.engine_wait_s
        while True:
            picked = self.engines.pick()
            if picked is None:
                if time.monotonic() > deadline:
                    raise EngineError(
                        "engines", "/generate", f"no healthy engine for {self.engine_wait_s:.0f}s"
                    )
                await asyncio.sleep(0.5)
                continue
            i, engine = picked
            try:
                if self.spec.rollout.agent == "rstar2_tool":
                    return await run_rstar2(prompt, engine, self.tokenizer, self.sandbox, self.spec.rollout)
                return await run_math(prompt, engine, self.tokenizer, self.spec.rollout)
            except EngineError as e:
                self.engines.failed(i, e)
                self.stats["engine_retries"] += 1  # rerun this sample from scratch elsewhere

    async def _rollout(self, prompt: Prompt, index: int) -> tuple[RolloutResult, float]:
        with self.meter.tracking():
            result = await self._sample(prompt, index)
            reward = await self.rewards.score(result.text, prompt.answer)
        self.meter.record(result, reward.score)
        return result, reward.score

    async def _group(self, prompt: Prompt) -> None:
        t0 = time.monotonic()
        try:
            done = await asyncio.gather(*(self._rollout(prompt, i) for i in range(self.n)))
        except EngineError as e:
            await self.client.send(PromptRelease(uids=[prompt.uid], reason="no_engine"))
            self.stats["released"] += 1
            logger.warning("prompt_released", uid=prompt.uid, error=str(e))
            return
        finally:
            self.free += self.n
        group = write_group(  # the group's wire frame, written once straight from the token lists
            [r.trajectory_fields(i, reward) for i, (r, reward) in enumerate(done)],
            uid=prompt.uid,
            prompt_id=prompt.prompt_id,
            admitted_version=prompt.admitted_version,
            generator=self.client.name,
            prompt_tokens=done[0][0].prompt_ids,
            gen_time_s=time.monotonic() - t0,
        )
        ack = await self._send_group(group)
        if ack is None:
            logger.error("group_unacknowledged", uid=prompt.uid)  # the buffer re-dispatches it on expiry
            return
        if ack.status == "rejected":
            logger.error("group_rejected", uid=prompt.uid, detail=ack.detail)
        self.stats["groups_sent"] += 1

    # ------------------------------------------------------------------ main loop

    def _write_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.write({**self.meter.snapshot(), "groups_sent": self.stats["groups_sent"]})

    async def _metrics_forever(self) -> None:
        while True:
            await asyncio.sleep(self.metrics_every_s)
            self._write_metrics()

    async def run(self) -> None:
        tasks: set[asyncio.Task[None]] = set()
        background = [asyncio.create_task(self._receive()), asyncio.create_task(self.engines.probe_forever())]
        if self.metrics is not None:
            background.append(asyncio.create_task(self._metrics_forever()))
        last_beat = 0.0
        try:
            while not self.stopping.is_set():
                if time.monotonic() - last_beat > HEARTBEAT_S:
                    await self.client.send(Heartbeat(sent_at=time.time()))
                    last_beat = time.monotonic()
                k = self.free // self.n
                if k == 0:
                    await asyncio.sleep(0.05)
                    continue
                reply = await self._ask_prompts(k)
                if reply is None or not reply.prompts:
                    await asyncio.sleep(reply.retry_after_s if reply else 1.0)
                    continue
                for prompt in reply.prompts:
                    self.free -= self.n
                    task = asyncio.create_task(self._group(prompt))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
        finally:
            for t in [*tasks, *background]:
                t.cancel()
            await asyncio.gather(*tasks, *background, return_exceptions=True)
            self._write_metrics()  # the last partial interval


async def _amain(args: argparse.Namespace, spec: JobSpec) -> int:
    from transformers import AutoTokenizer

    from sandbox_bridge.client import make_sandbox

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    engines = EnginePool([EngineClient(url) for url in args.engines.split(",")])
    sandbox = make_sandbox(spec.sandbox) if spec.rollout.agent == "rstar2_tool" else None
    rewards = RewardPool.from_config(spec.reward)
    client = AsyncClient(args.buffer, role="generator", name=args.name)
    metrics = None if args.metrics_dir is None else MetricsWriter(args.metrics_dir, "generator", args.name)
    try:
        await client.connect(timeout_s=60.0)
        await engines.wait_started(timeout_s=120.0)
        role = GeneratorRole(
            spec,
            client,
            engines,
            tokenizer,
            rewards,
            sandbox,
            metrics=metrics,
            metrics_every_s=args.metrics_every_s,
        )
        loop = asyncio.get_running_loop()
        for sig in ("SIGTERM", "SIGINT"):
            import signal

            loop.add_signal_handler(getattr(signal, sig), role.stopping.set)
        logger.info("generator_started", engines=args.engines, buffer=args.buffer)
        await role.run()
    except TransportError as e:
        logger.error("buffer_unreachable", error=str(e))
        return 1
    finally:
        client.close()
        rewards.close()
        for e in engines.engines:
            await e.close()
        if sandbox is not None:
            await sandbox.close()
        if metrics is not None:
            metrics.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="workers.generator", description="the generator role")
    ap.add_argument("--job", required=True)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--buffer", required=True, help="the buffer's address")
    ap.add_argument("--engines", required=True, help="comma-separated engine URLs")
    ap.add_argument("--model", required=True, type=Path, help="model folder (for the tokenizer)")
    ap.add_argument("--name", default="gen-0")
    ap.add_argument("--log-file")
    ap.add_argument("--metrics-dir", type=Path, help="run folder for metrics records (none if not given)")
    ap.add_argument("--metrics-every-s", type=float, default=5.0, help="seconds between metrics records")
    args = ap.parse_args(argv)
    spec = load_job_or_exit(args.job, args.overrides)
    log.configure("generator", level=spec.logging.level, json_file=args.log_file)
    tune_allocator()
    return asyncio.run(_amain(args, spec))


if __name__ == "__main__":
    sys.exit(main())
