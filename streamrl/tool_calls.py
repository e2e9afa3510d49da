"""rStar2-Agent tool calls: parse Hermes `<tool_call>` JSON, run the calls, produce the response texts.

Reference: roc_and_grpo.md 3.3-3.6 and the released code it cites (`rstar2_agent/tools/tool_parser.py`,
`rstar2_agent/rollout/rstar2_agent_loop.py::_call_tool`). What the model sees is part of the training
signal (RoC's error penalty searches these texts for "error"), so the texts are the reference's:

* a turn's calls are `re.findall(r"<tool_call>(.*?)</tool_call>", DOTALL)` over the decoded turn, only
  when both tags occur; each match is `json.loads`-ed and must have "name" and "arguments". A match
  that fails keeps its place in the list as the response `Failed to decode tool call: {e}`;
* only the first `max_calls` entries are used, decode failures included;
* an unknown tool name gives `Error when executing tool: '{name}'` (the reference's `KeyError` text);
* a tool's own output longer than `max_chars` is cut in the middle:
  `text[:max_chars // 2] + "...(truncated)..." + text[-(max_chars // 2):]`. As in the reference, only
  tool output is truncated, never the decode-failure or `Error when executing tool` texts.

Deliberate differences (each one only turns an obscure reference exception into a clearer text that
still contains "Error", so RoC counts it the same way):
* arguments that are not a JSON object, or a `code` / `input` that is not a string (`input` may be
  null), give `Error when executing tool: ...` naming the problem; the reference would fail inside
  `parameters.get(...)` or send the wrong type to Code Judge;
* as in the reference's `PythonTool.execute`, a missing `code` or `input` defaults to "".
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sandbox_bridge.tool import TOOL_NAME, python_code_with_standard_io, render_tool_error

__all__ = [
    "DEFAULT_TOOLS",
    "DecodeFailure",
    "ToolCall",
    "ToolFn",
    "is_tool_error",
    "is_tool_success",
    "parse_tool_calls",
    "python_tool",
    "run_tool_calls",
    "truncate_middle",
]

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
TRUNCATION_MARK = "...(truncated)..."

# A tool: (sandbox, arguments) -> the text the model sees. Raising is allowed: the caller turns the
# exception into `Error when executing tool: {e}`, exactly like the reference's `_call_tool`.
ToolFn = Callable[[Any, Any], Awaitable[str]]


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: Any  # whatever the JSON held; a non-string simply matches no tool
    arguments: Any


@dataclass(frozen=True, slots=True)
class DecodeFailure:
    """A `<tool_call>` block that was not valid JSON with name and arguments; `text` is its response."""

    text: str


def parse_tool_calls(text: str) -> list[ToolCall | DecodeFailure]:
    """The calls of one decoded assistant turn, in order; [] when the turn calls no tool."""
    if "<tool_call>" not in text or "</tool_call>" not in text:
        return []
    calls: list[ToolCall | DecodeFailure] = []
    for match in TOOL_CALL_RE.findall(text):
        try:
            obj = json.loads(match)
            calls.append(ToolCall(obj["name"], obj["arguments"]))
        # The reference catches Exception; these are all json.loads and indexing can raise
        # (RecursionError: deeply nested brackets in model text).
        except (ValueError, KeyError, TypeError, IndexError, RecursionError) as e:
            calls.append(DecodeFailure(f"Failed to decode tool call: {e}"))
    return calls


def truncate_middle(text: str, max_chars: int) -> str:
    """Keep the head and tail of an over-long tool output (rStar2's `tool_response_truncate_side=middle`)."""
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    # text[len - half:] rather than text[-half:], which would keep everything when half == 0.
    return text[:half] + TRUNCATION_MARK + text[len(text) - half :]


def is_tool_error(response: str) -> bool:
    """RoC's definition (roc_and_grpo.md 1.5 item 2): the substring "error", any case, after truncation."""
    return "error" in response.lower()


def is_tool_success(response: str) -> bool:
    """The tool ran and the code succeeded; decode failures, tool errors and `Tool call failure` are not."""
    return response.startswith("Tool call success")


class ToolArgumentError(ValueError):
    """The model called a tool with arguments of the wrong shape."""


async def python_tool(sandbox: Any, arguments: Any) -> str:
    """`python_code_with_standard_io(code, input)` on `sandbox` (anything with `async submit`)."""
    if not isinstance(arguments, dict):
        raise ToolArgumentError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    code = arguments.get("code", "")
    stdin = arguments.get("input", "")
    if not isinstance(code, str):
        raise ToolArgumentError(f"argument 'code' must be a string, got {type(code).__name__}")
    if stdin is not None and not isinstance(stdin, str):
        raise ToolArgumentError(f"argument 'input' must be a string, got {type(stdin).__name__}")
    return await python_code_with_standard_io(sandbox, code, stdin)


DEFAULT_TOOLS: Mapping[str, ToolFn] = {TOOL_NAME: python_tool}


async def _call(call: ToolCall, sandbox: Any, tools: Mapping[str, ToolFn], max_chars: int) -> str:
    try:
        tool = tools[call.name]
    # str(KeyError("foo")) is "'foo'": the reference's text. TypeError: an unhashable name (a list).
    except (KeyError, TypeError) as e:
        return render_tool_error(e)
    try:
        text = await tool(sandbox, call.arguments)
    # The tool boundary: whatever a tool raises becomes text for the model, as in the reference.
    except Exception as e:
        return render_tool_error(e)
    return truncate_middle(text, max_chars)


async def run_tool_calls(
    calls: Sequence[ToolCall | DecodeFailure],
    sandbox: Any,
    *,
    max_calls: int,
    max_chars: int,
    tools: Mapping[str, ToolFn] = DEFAULT_TOOLS,
) -> list[str]:
    """The response text of each of the first `max_calls` entries, in order; calls run concurrently."""
    used = list(calls[:max_calls])
    pending = [c for c in used if isinstance(c, ToolCall)]
    results = iter(await asyncio.gather(*(_call(c, sandbox, tools, max_chars) for c in pending)))
    return [c.text if isinstance(c, DecodeFailure) else next(results) for c in used]
