"""Held-out evaluation through the rollout engines: greedy and sampled accuracy of the current policy.

The learner calls `evaluate` right after a weight push (so the engines hold exactly the policy of
that step), with the same agent loop and grader as training, on the first `eval.max_prompts` items
of `data.eval`. Accuracy counts a sample as correct when its reward is positive (all graders give
0 or less for wrong answers: math-verify 0, RLinf -5). Engines are shared with the generators; the
evaluation requests simply queue with theirs. `Evaluator` holds rank 0's evaluation resources
(tokenizer, grader pool, sandbox, one event loop) for the whole run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from streamrl.agent import RolloutResult, run_math, run_rstar2
from streamrl.config import JobSpec
from streamrl.data import PromptSource, make_source
from streamrl.messages import Prompt
from workers.engines.client import EngineClient

CONCURRENCY = 64  # requests in flight per evaluation; the engine batches them


@dataclass(frozen=True, slots=True)
class EvalResult:
    greedy_acc: float | None
    sampled_acc: float | None
    prompts: int
    response_len_mean: float
    tool_calls_mean: float
    seconds: float

    def metrics(self) -> dict[str, float]:
        values = {
            "greedy_acc": self.greedy_acc,
            "sampled_acc": self.sampled_acc,
            "eval_prompts": self.prompts,
            "eval_response_len_mean": self.response_len_mean,
            "eval_tool_calls_mean": self.tool_calls_mean,
            "eval_s": self.seconds,
        }
        return {k: float(v) for k, v in values.items() if v is not None}


def eval_prompts(spec: JobSpec) -> list[Prompt]:
    """The first `eval.max_prompts` items of `data.eval` as dispatchable prompts (empty if unset)."""
    if spec.data.eval is None:
        return []
    source: PromptSource = make_source(spec.data.eval)
    prompts = []
    for i in range(min(len(source), spec.eval.max_prompts)):
        item = source[i]
        prompts.append(
            Prompt(
                uid=-1 - i,
                prompt_id=item.prompt_id,
                answer=item.answer,
                messages=item.messages,
                text=item.text,
                meta=item.meta,
                admitted_version=0,
                n_samples=1,
            )
        )
    return prompts


async def evaluate(
    spec: JobSpec,
    prompts: Sequence[Prompt],
    engine_urls: Sequence[str],
    tokenizer: Any,
    rewards: Any,
    sandbox: Any = None,
) -> EvalResult:
    """Greedy accuracy (if `eval.greedy`) and sampled accuracy over `eval.sampled_n` samples per prompt.

    `rewards` is a `workers.reward.RewardPool` (anything with `async score(response, answer)`).
    """
    t0 = time.monotonic()
    engines = [EngineClient(url) for url in engine_urls]
    limit = asyncio.Semaphore(CONCURRENCY)
    lengths: list[int] = []
    tool_calls: list[int] = []

    async def one(i: int, prompt: Prompt, temperature: float) -> bool:
        rollout = msgspec.structs.replace(spec.rollout, temperature=temperature)
        engine = engines[i % len(engines)]
        async with limit:
            result: RolloutResult
            if spec.rollout.agent == "rstar2_tool":
                result = await run_rstar2(prompt, engine, tokenizer, sandbox, rollout)
            else:
                result = await run_math(prompt, engine, tokenizer, rollout)
        lengths.append(len(result.response_ids))
        tool_calls.append(result.tool_calls)
        reward = await rewards.score(result.text, prompt.answer)
        return reward.score > 0

    async def accuracy(temperature: float, n: int) -> float:
        jobs = [one(i * n + j, p, temperature) for i, p in enumerate(prompts) for j in range(n)]
        correct = await asyncio.gather(*jobs)
        return sum(correct) / max(1, len(correct))

    try:
        greedy = await accuracy(0.0, 1) if spec.eval.greedy and prompts else None
        sampled = (
            await accuracy(spec.eval.temperature, spec.eval.sampled_n)
            if spec.eval.sampled_n and prompts
            else None
        )
    finally:
        for e in engines:
            await e.close()
    return EvalResult(
        greedy_acc=greedy,
        sampled_acc=sampled,
        prompts=len(prompts),
        response_len_mean=sum(lengths) / max(1, len(lengths)),
        tool_calls_mean=sum(tool_calls) / max(1, len(tool_calls)),
        seconds=time.monotonic() - t0,
    )


class Evaluator:
    """Rank 0's evaluation resources, kept for the whole run on one event loop."""

    def __init__(self, spec: JobSpec, engine_urls: list[str], model_dir: Path) -> None:
        from transformers import AutoTokenizer  # heavy: only the process that evaluates pays for it

        from workers.reward import RewardPool

        self.spec, self.urls = spec, engine_urls
        self.prompts = eval_prompts(spec)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.runner = asyncio.Runner()
        self.rewards = RewardPool.from_config(spec.reward)
        self.sandbox = None
        if spec.rollout.agent == "rstar2_tool":
            from sandbox_bridge.client import make_sandbox

            self.sandbox = make_sandbox(spec.sandbox)

    def __call__(self) -> dict[str, float]:
        coro = evaluate(self.spec, self.prompts, self.urls, self.tokenizer, self.rewards, self.sandbox)
        try:
            return self.runner.run(coro).metrics()
        except Exception:
            self.runner.run(_cancel_pending())
            raise

    def close(self) -> None:
        if self.sandbox is not None:
            self.runner.run(self.sandbox.close())
        self.runner.close()
        self.rewards.close()


async def _cancel_pending() -> None:
    """End the rollouts a failed evaluation left running (gather does not cancel the others when
    one fails), now rather than whenever the next evaluation runs the loop again."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
