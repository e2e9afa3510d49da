"""Prompt text: Qwen ChatML, the single-turn math prompt and rStar2-Agent's tool-calling template.

The rStar2 format (roc_and_grpo.md section 3.1) is part of the training signal: RoC's format
penalty counts `<|im_start|>assistant ... <|im_end|>` turns and `<answer>` tags, and the tool loop
masks exactly the tool-turn text rendered here. The tiny CPU models are warm-started on text made by
these same functions, so the demo model speaks the format the agent loop parses.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from streamrl.messages import ChatMessage

IM_START, IM_END, EOT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = (EOT, IM_START, IM_END)

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

TOOL_NAME = "python_code_with_standard_io"
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Run Python code with the given standard input and return its standard output "
        "(or the error it raised).",
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "The Python program to run."},
                "input": {"type": "string", "description": "Text given to the program on standard input."},
            },
            "required": ["code", "input"],
        },
    },
}

RSTAR2_SYSTEM = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The Assistant first reasons about the problem and then gives the answer. The reasoning is enclosed "
    "within <reason> </reason> and the answer within <answer> </answer> tags, i.e., "
    "<reason> reasoning here </reason> <answer> answer here </answer>."
)

RSTAR2_USER_PREFIX = (
    "You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here </answer>. "
    "And your final answer will be extracted automatically by the \\boxed{} tag.\nThis is the problem:\n"
)

RSTAR2_GENERATION_PREFIX = "<reason>"


def tools_block(tools: Sequence[dict[str, object]]) -> str:
    """The Hermes-style tool description appended to the system prompt."""
    lines = "\n".join(json.dumps(t) for t in tools)
    return (
        "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>"
        "\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def turn(role: str, content: str) -> str:
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def chatml(messages: Iterable[ChatMessage], generation_prefix: str | None = "") -> str:
    """Render messages; with a generation prefix (None = no generation prompt) open the assistant turn."""
    text = "".join(turn(m.role, m.content) for m in messages)
    if generation_prefix is not None:
        text += f"{IM_START}assistant\n{generation_prefix}"
    return text


def math_prompt(messages: list[ChatMessage] | None, text: str | None) -> str:
    """Single-turn math: a plain question gets the boxed-answer instruction in a ChatML user turn.

    Text that already carries a chat format (RLinf's boba data is stored pre-templated) is used as is.
    """
    if messages:
        return chatml(messages)
    if text is None:
        raise ValueError("a prompt needs messages or text")
    if IM_START in text or "<｜User｜>" in text or "<|User|>" in text:
        return text
    return chatml([ChatMessage("user", f"{text} {MATH_INSTRUCTION}")])


def rstar2_prompt(messages: list[ChatMessage] | None, text: str | None) -> str:
    """System prompt with the tool schema, wrapped user question, then `<|im_start|>assistant\\n<reason>`."""
    if messages:
        question = "\n".join(m.content for m in messages if m.role == "user")
    elif text is not None:
        question = text
    else:
        raise ValueError("a prompt needs messages or text")
    system = RSTAR2_SYSTEM + tools_block([TOOL_SCHEMA])
    return (
        turn("system", system)
        + turn("user", RSTAR2_USER_PREFIX + question)
        + (f"{IM_START}assistant\n{RSTAR2_GENERATION_PREFIX}")
    )


def tool_turn(responses: Sequence[str]) -> str:
    """Tool results as one user turn, then the next assistant turn opened inside `<reason>`.

    It follows the model's own `<|im_end|>` directly (the reference strips the system prefix from a
    re-rendered template, which leaves no newline between the two turns).
    """
    body = "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in responses)
    return f"{IM_START}user\n{body}{IM_END}\n{IM_START}assistant\n{RSTAR2_GENERATION_PREFIX}"


def tool_call_text(code: str, stdin: str = "") -> str:
    """What a model writes to call the tool (used to build warm-start data)."""
    payload = json.dumps({"name": TOOL_NAME, "arguments": {"code": code, "input": stdin}})
    return f"<tool_call>\n{payload}\n</tool_call>"
