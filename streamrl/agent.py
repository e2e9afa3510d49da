"""Agent loops: one rollout of one prompt against a rollout engine, as token ids, masks and versions.

    result = await run_math(prompt, engine, tokenizer, cfg.rollout)                 # single turn
    result = await run_rstar2(prompt, engine, tokenizer, sandbox, cfg.rollout)      # tool loop
    traj = result.to_trajectory(sample_index, reward)         # trajectory_fields() feeds write_group

`run_math` is RLinf's single-turn math rollout: `templates.math_prompt`, one assistant turn ending at
`<|im_end|>` or `max_new_tokens`. `run_rstar2` is rStar2-Agent's multi-turn loop (roc_and_grpo.md
3.4, `rstar2_agent/rollout/rstar2_agent_loop.py`), on concatenated token ids, never re-rendering the
history:

    loop:
      generate with max_new_tokens = budget - len(response)     # tool tokens count against the budget
      stop if len(response) >= budget
      stop if assistant_turns >= max_assistant_turns            # that turn's calls are NOT executed
      parse the turn's <tool_call>s; stop if there are none
      run the first max_parallel_calls concurrently (tool_calls.py), outputs middle-truncated
      tool_ids = encode(templates.tool_turn(responses))         # ends with "<|im_start|>assistant\\n<reason>"
      stop, without appending, if len(response) + len(tool_ids) >= budget   # never end on a tool turn
      append tool_ids with loss mask 0, log-prob 0.0, version -1

Interrupted generation (AReaL's interruptible rollout, async_rl_anchors.md 2.1; ARCHITECTURE.md
invariant 3): an engine paused for a weight update in "abort" mode ends in-flight requests with
finish_reason "abort" and the tokens sampled so far. They are kept with the version that sampled
them, and the same turn is resubmitted as prompt + everything so far with the remaining budget; the
engine holds new requests until it continues, so the resumed tokens carry the new version. Resuming
is bounded by `ResumePolicy`; when it gives up the result has finish_reason "abort".

`finish_reason` is how the last generate call ended ("stop" at `<|im_end|>`, "length" at the
budget), except "length" when a tool turn did not fit and "abort" when resuming gave up; "error" is
never produced here. `stop_cause` says why the rollout ended (a turn limit ends on "stop").

Errors: `EngineError` from the engine client (HTTP failure, engine gone) and `ValueError` for a
malformed engine answer propagate to the caller. The generator role catches `EngineError` and reruns
the sample from scratch on another engine. Tool failures never raise: they are texts for the model.

Deliberate differences from the reference:
* a turn the engine ended with "length" before the budget was used up (its context limit) ends the
  rollout: resubmitting would hit the same limit;
* `num_turns` counts assistant turns (the reference reports user + assistant + 1);
* the stop tokens are `<|im_end|>` and, when the vocabulary has it, `<|endoftext|>` (see HFCodec).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from streamrl import templates
from streamrl.log import get_logger
from streamrl.messages import FinishReason, Prompt, Trajectory, pack_trajectory
from streamrl.tool_calls import (
    DEFAULT_TOOLS,
    ToolFn,
    is_tool_error,
    is_tool_success,
    parse_tool_calls,
    run_tool_calls,
)
from workers.engines.client import SamplingParams

if TYPE_CHECKING:
    from streamrl.config import RolloutConfig
    from workers.engines.client import GenerateOutput

__all__ = ["Codec", "Generator", "ResumePolicy", "RolloutResult", "as_codec", "run_math", "run_rstar2"]

log = get_logger(__name__)

# Why a rollout ended; finish_reason alone cannot tell a budget cut from a turn limit.
StopCause = Literal["end_of_turn", "budget", "engine_length", "max_turns", "tool_budget", "interrupted"]


class Generator(Protocol):
    """What the loops need from an engine (workers.engines.client.EngineClient implements it)."""

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: str | None = None
    ) -> GenerateOutput: ...


@runtime_checkable
class Codec(Protocol):
    """Text <-> ids as the loops need it. `encode` adds no special tokens; `eos_id` is `<|im_end|>`."""

    eos_id: int
    stop_ids: list[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class HFCodec:
    """A Hugging Face tokenizer (transformers or `tokenizers.Tokenizer`) as a Codec."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # transformers tokenizers have convert_tokens_to_ids; a bare tokenizers.Tokenizer has token_to_id.
        self._raw = not hasattr(tokenizer, "convert_tokens_to_ids")
        eos = self._token_id(templates.IM_END)
        if eos is None:
            raise ValueError(f"the tokenizer has no {templates.IM_END} token, which ends every ChatML turn")
        self.eos_id: int = eos
        # A base model may end a document with <|endoftext|> instead; without it as a stop token the
        # engine would sample past the end until the budget runs out.
        eot = self._token_id(templates.EOT)
        self.stop_ids: list[int] = [eos] + ([eot] if eot is not None and eot != self.eos_id else [])

    def _token_id(self, token: str) -> int | None:
        if self._raw:
            return self.tokenizer.token_to_id(token)
        tid = self.tokenizer.convert_tokens_to_ids(token)
        return None if tid is None or tid == self.tokenizer.unk_token_id else int(tid)

    def encode(self, text: str) -> list[int]:
        if self._raw:
            return list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))


def as_codec(tokenizer: Any) -> Codec:
    """`tokenizer` itself if it is a Codec, else a Hugging Face tokenizer wrapped in HFCodec."""
    return tokenizer if isinstance(tokenizer, Codec) else HFCodec(tokenizer)


@dataclass(frozen=True, slots=True)
class ResumePolicy:
    """Bounds on resuming aborted generation. An abort that returned tokens made progress and is
    resumed at once (the engine holds the new request until it continues); aborts that return none
    are retried with exponential backoff, at most `max_empty` in a row and for at most `deadline_s`."""

    max_resumes: int = 64
    max_empty: int = 8
    backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    deadline_s: float = 300.0


@dataclass(slots=True, kw_only=True)
class RolloutResult:
    """One rollout. Per-token lists cover the response only (model and tool tokens)."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]  # 1 model token, 0 tool token
    logprobs: list[float]  # engine log-prob of model tokens; 0.0 for tool tokens
    versions: list[int]  # weight version that sampled each model token; -1 for tool tokens
    text: str  # decoded response, special tokens and tool turns kept: what RoC and the reward read
    finish_reason: FinishReason
    stop_cause: StopCause
    num_turns: int  # assistant turns
    tool_calls: int = 0  # tool responses shown to the model (decode failures included)
    tool_errors: int = 0  # responses containing "error", any case, after truncation (RoC's rule)
    tool_failures: int = 0  # responses that are not "Tool call success" (timeouts, decode failures too)
    interrupts: int = 0  # aborted generate calls (weight updates) seen by this rollout
    tool_time_s: float = 0.0

    def trajectory_fields(self, sample_index: int, reward: float) -> dict[str, Any]:
        """The Trajectory's fields, per-token arrays still as lists (group_frame.write_group's input)."""
        return {
            "sample_index": sample_index,
            "tokens": self.response_ids,
            "loss_mask": self.loss_mask,
            "logprobs": self.logprobs,
            "versions": self.versions,
            "reward": reward,
            "finish_reason": self.finish_reason,
            "num_turns": self.num_turns,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "text": self.text,
        }

    def to_trajectory(self, sample_index: int, reward: float) -> Trajectory:
        return pack_trajectory(self.trajectory_fields(sample_index, reward))


@dataclass(slots=True)
class _Rollout:
    """The growing response of one rollout and the engine calls that extend it."""

    engine: Generator
    codec: Codec
    cfg: RolloutConfig
    prompt_ids: list[int]
    resume: ResumePolicy
    rid: str | None
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    calls: int = 0  # generate calls
    interrupts: int = 0
    turns: int = 0  # assistant turns
    tool_calls: int = 0
    tool_errors: int = 0
    tool_failures: int = 0
    tool_time_s: float = 0.0

    def budget(self) -> int:
        return self.cfg.max_new_tokens - len(self.response)

    async def assistant_turn(self) -> tuple[list[int], FinishReason]:
        """Generate one assistant turn, resuming it after aborts; its ids and how it ended."""
        start = len(self.response)
        self.turns += 1
        empty, stalled_since = 0, 0.0
        while (budget := self.budget()) > 0:
            out = await self._generate(budget)
            if out.finish_reason != "abort":
                return self.response[start:], out.finish_reason
            self.interrupts += 1
            if out.output_ids:
                empty = 0
            else:
                empty += 1
                stalled_since = stalled_since if empty > 1 else time.monotonic()
            if (
                self.interrupts > self.resume.max_resumes
                or empty > self.resume.max_empty
                or (empty and time.monotonic() - stalled_since > self.resume.deadline_s)
            ):
                log.warning("rollout_resume_gave_up", rid=self.rid, interrupts=self.interrupts, empty=empty)
                return self.response[start:], "abort"
            if empty:
                await asyncio.sleep(min(self.resume.backoff_s * 2 ** (empty - 1), self.resume.max_backoff_s))
        return self.response[start:], "length"  # an abort used the last of the budget

    async def _generate(self, budget: int) -> GenerateOutput:
        cfg = self.cfg
        sampling = SamplingParams(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            max_new_tokens=budget,
            stop_token_ids=list(self.codec.stop_ids),
        )
        rid = None if self.rid is None else f"{self.rid}.{self.calls}"
        self.calls += 1
        out = await self.engine.generate(self.prompt_ids + self.response, sampling, rid)
        if len(out.logprobs) != len(out.output_ids):
            raise ValueError(
                f"engine answered {len(out.output_ids)} tokens but {len(out.logprobs)} log-probs"
            )
        ids = out.output_ids[:budget]  # an engine must not exceed max_new_tokens; never trust it to
        self.response += ids
        self.mask += [1] * len(ids)
        self.logprobs += [float(x) for x in out.logprobs[: len(ids)]]
        self.versions += [out.weight_version] * len(ids)
        return out

    def stop_cause(self, finish: FinishReason) -> StopCause | None:
        """Why the rollout must end after a turn that ended with `finish`; None: it may go on."""
        if finish == "abort":
            return "interrupted"
        if self.budget() <= 0:
            return "budget"
        if finish == "length":
            return "engine_length"
        return None

    def add_tool_turn(self, ids: list[int], responses: list[str]) -> None:
        self.response += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        # Counted only once shown to the model, so the counts agree with the text RoC reads.
        self.tool_calls += len(responses)
        self.tool_errors += sum(is_tool_error(t) for t in responses)
        self.tool_failures += sum(not is_tool_success(t) for t in responses)

    def result(self, finish: FinishReason, cause: StopCause) -> RolloutResult:
        return RolloutResult(
            prompt_ids=self.prompt_ids,
            response_ids=self.response,
            loss_mask=self.mask,
            logprobs=self.logprobs,
            versions=self.versions,
            text=self.codec.decode(self.response, skip_special_tokens=False),
            finish_reason=finish,
            stop_cause=cause,
            num_turns=self.turns,
            tool_calls=self.tool_calls,
            tool_errors=self.tool_errors,
            tool_failures=self.tool_failures,
            interrupts=self.interrupts,
            tool_time_s=self.tool_time_s,
        )


async def run_math(
    prompt: Prompt,
    engine: Generator,
    tokenizer: Any,
    cfg: RolloutConfig,
    *,
    resume: ResumePolicy = ResumePolicy(),
    rid: str | None = None,
) -> RolloutResult:
    """Single-turn math (RLinf): one assistant turn, up to `<|im_end|>` or `cfg.max_new_tokens`."""
    codec = as_codec(tokenizer)
    prompt_ids = codec.encode(templates.math_prompt(prompt.messages, prompt.text))
    r = _Rollout(engine, codec, cfg, prompt_ids, resume, rid)
    _, finish = await r.assistant_turn()
    return r.result(finish, r.stop_cause(finish) or "end_of_turn")


async def run_rstar2(
    prompt: Prompt,
    engine: Generator,
    tokenizer: Any,
    sandbox: Any,
    cfg: RolloutConfig,
    *,
    tools: Mapping[str, ToolFn] = DEFAULT_TOOLS,
    resume: ResumePolicy = ResumePolicy(),
    rid: str | None = None,
) -> RolloutResult:
    """rStar2-Agent's multi-turn tool loop (module docstring); `sandbox` runs the Python tool."""
    if sandbox is None:
        raise ValueError("run_rstar2 needs a sandbox for its Python tool")
    codec = as_codec(tokenizer)
    prompt_ids = codec.encode(templates.rstar2_prompt(prompt.messages, prompt.text))
    r = _Rollout(engine, codec, cfg, prompt_ids, resume, rid)
    finish, cause = await _tool_loop(r, sandbox, tools)
    return r.result(finish, cause)


async def _tool_loop(
    r: _Rollout, sandbox: Any, tools: Mapping[str, ToolFn]
) -> tuple[FinishReason, StopCause]:
    """Run the rStar2 turns on `r`; how the last generation ended and why the rollout stopped."""
    cfg = r.cfg
    while True:
        turn_ids, finish = await r.assistant_turn()
        cause = r.stop_cause(finish)
        if cause is None and r.turns >= cfg.max_assistant_turns:
            cause = "max_turns"  # checked before parsing: this turn's calls are not executed
        if cause is not None:
            return finish, cause
        parsed = parse_tool_calls(r.codec.decode(turn_ids, skip_special_tokens=False))
        if not parsed:
            return finish, "end_of_turn"
        t0 = time.monotonic()
        responses = await run_tool_calls(
            parsed,
            sandbox,
            max_calls=cfg.max_parallel_calls,
            max_chars=cfg.max_tool_response_chars,
            tools=tools,
        )
        r.tool_time_s += time.monotonic() - t0
        tool_ids = r.codec.encode(templates.tool_turn(responses))
        if len(r.response) + len(tool_ids) >= cfg.max_new_tokens:
            # The reward sits on the last token, which must be the model's: never end on a tool turn.
            return "length", "tool_budget"
        r.add_tool_turn(tool_ids, responses)
