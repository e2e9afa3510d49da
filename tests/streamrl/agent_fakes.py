"""Fakes for the agent-loop tests, only at the edges the loop crosses:

* `ScriptedEngine`: the rollout engine (an HTTP server in production). Each `generate` call plays the
  next `Step` (text or ids, finish reason, weight version), honours `max_new_tokens` like a real
  engine, gives every token a distinct log-prob, and records what it was asked.
* `ScriptedSandbox`: the code sandbox (a process pool or a remote service in production); returns
  the next scripted `SubmissionResult` and records the submissions.

The tokenizer is real (`streamrl.tiny.make_tokenizer`), and one test runs the real `LocalSandbox`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from workers.engines.client import GenerateOutput, SamplingParams

from sandbox_bridge.types import Reason, Submission, SubmissionResult
from streamrl.agent import Codec


@dataclass(frozen=True)
class Step:
    """One engine answer. With finish "stop" the engine appends `<|im_end|>` to the tokens."""

    text: str = ""
    finish: str = "stop"
    version: int = 0
    ids: list[int] | None = None


@dataclass
class Request:
    input_ids: list[int]
    sampling: SamplingParams
    rid: str | None


@dataclass
class ScriptedEngine:
    codec: Codec
    steps: list[Step]
    requests: list[Request] = field(default_factory=list)
    outputs: list[GenerateOutput] = field(default_factory=list)
    _next_logprob: float = -0.001

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: str | None = None
    ) -> GenerateOutput:
        self.requests.append(Request(list(input_ids), sampling, rid))
        assert self.steps, f"the loop called the engine more often than scripted ({len(self.requests)} calls)"
        assert sampling.max_new_tokens > 0, "the loop asked for zero new tokens"
        step = self.steps.pop(0)
        ids = list(step.ids) if step.ids is not None else self.codec.encode(step.text)
        finish = step.finish
        if finish == "stop":
            ids.append(self.codec.eos_id)
        if len(ids) > sampling.max_new_tokens:  # what a real engine does at the limit
            ids, finish = ids[: sampling.max_new_tokens], "length"
        logprobs = []
        for _ in ids:  # distinct values, so a misaligned copy cannot pass a test
            logprobs.append(self._next_logprob)
            self._next_logprob -= 0.001
        out = GenerateOutput(
            output_ids=ids,
            logprobs=logprobs,
            finish_reason=finish,
            weight_version=step.version,
            prompt_tokens=len(input_ids),
        )
        self.outputs.append(out)
        await asyncio.sleep(0)
        return out


def ok(stdout: str = "", stderr: str = "", cost: float = 0.01) -> SubmissionResult:
    return SubmissionResult(
        sub_id="s", success=True, run_success=True, cost=cost, stdout=stdout, stderr=stderr
    )


def failed(stderr: str = "", stdout: str = "", reason: Reason = "", cost: float = 0.01) -> SubmissionResult:
    return SubmissionResult(
        sub_id="s", success=False, run_success=False, cost=cost, stdout=stdout, stderr=stderr, reason=reason
    )


@dataclass
class ScriptedSandbox:
    results: list[SubmissionResult]
    submissions: list[Submission] = field(default_factory=list)
    delay_s: float = 0.0
    running: int = 0
    max_running: int = 0

    async def submit(self, sub: Submission) -> SubmissionResult:
        self.submissions.append(sub)
        assert self.results, "the loop ran more tool calls than scripted"
        result = self.results.pop(0)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        await asyncio.sleep(self.delay_s)
        self.running -= 1
        return result
