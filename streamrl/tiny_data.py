"""Synthetic warm-start text and per-task settings for the tiny CPU models, and answer checks.

Every text is rendered with `streamrl.templates` and `sandbox_bridge.tool.render_tool_result`, so the
warm-started model speaks exactly the format the math agent and the rStar2 tool loop parse. The
prompts come from `SyntheticArithSource`, the same source the RL demos read:

* `arith`: 2-digit addition (`"37+58="`), single-turn math prompt, completion `\\boxed{95}<|im_end|>`.
* `tool`: 4-digit products (`"4821*7305="`), too long for a 1M-parameter model to do in its head.
  The first assistant turn calls `python_code_with_standard_io` with formulaic code
  (`print(4821*7305)`), the tool response carries the true stdout, the second turn copies it into
  `<answer> \\boxed{N} </answer>`. A `direct_fraction` of examples answer in the head instead: the
  model can learn that mode but not its arithmetic, so sampling sometimes skips the tool and gets no
  reward, which leaves RL a tool-call rate to raise (the rStar2 story).

`PLANS` holds each task's model depth, batch, learning rate and stopping band (tuned on 2 cores).
An `Example` is a list of (text, trained) segments: the prompt and the tool turn are context only
(the agent loop masks tool tokens, roc_and_grpo.md 3.4), the assistant turns are trained on.
Segments are tokenized one by one, like the agent loop concatenates token ids.
"""

from __future__ import annotations

import ast
import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from sandbox_bridge.tool import render_tool_result
from sandbox_bridge.types import SubmissionResult
from streamrl import templates
from streamrl.config import SyntheticArithData
from streamrl.data import PromptItem, SyntheticArithSource

Task = Literal["arith", "tool"]
TASKS: tuple[Task, ...] = ("arith", "tool")

# The RL demos read the same distributions (configs use these values).
ARITH_DATA = SyntheticArithData(digits=2, ops="+")
TOOL_DATA = SyntheticArithData(digits=4, ops="*")
HELDOUT_SEED_OFFSET = 7919  # held-out items come from seed + this offset, and are excluded from training
_STREAM = 10**9  # the training stream: item i of SyntheticArithSource(seed), i < this

DIRECT_FRACTION = 0.2  # tool task: share of examples that answer in the head (and so, usually wrongly)
FIRST_TURN = " Use Python.\n"
DIRECT_TURN = " No tool needed. </reason> <answer> \\boxed{{{n}}} </answer>"
SECOND_TURN = " Done. </reason> <answer> \\boxed{{{n}}} </answer>"


@dataclass(frozen=True)
class Plan:
    """Per-task warm-start settings, tuned on 2 CPU cores."""

    layers: int
    batch: int
    lr: float
    check_every: int  # steps between held-out checks
    snap_every: int  # steps between weight snapshots a check can roll back to
    heldout: int  # held-out prompts per check
    band: tuple[float, float]  # target greedy held-out accuracy: low enough that RL has room
    copy_prior: float  # scale of the copy-friendly value/output init (0: Hugging Face's init)
    criterion: Literal["greedy", "sampled"] = "greedy"  # which held-out accuracy the band applies to


PLANS: dict[Task, Plan] = {
    "arith": Plan(
        layers=4,
        batch=64,
        lr=3e-3,
        check_every=20,
        snap_every=5,
        heldout=100,
        band=(0.2, 0.4),
        copy_prior=0.2,
    ),
    "tool": Plan(
        layers=2,
        batch=16,
        lr=3e-3,
        check_every=25,
        snap_every=5,
        heldout=64,
        band=(0.2, 0.5),
        copy_prior=0.2,
        # Greedy decoding is right long before sampling is: at the first check inside the greedy band,
        # sampling at temperature 1 (as RL does) calls the tool 20% of the time and answers 0%.
        criterion="sampled",
    ),
}
WARMUP_STEPS = 20


@dataclass(frozen=True)
class Example:
    segments: tuple[tuple[str, bool], ...]  # (text, trained); the first segment is the prompt
    answer: str
    question: str

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.segments)


def source(task: Task, seed: int, size: int = _STREAM) -> SyntheticArithSource:
    base = ARITH_DATA if task == "arith" else TOOL_DATA
    return SyntheticArithSource(SyntheticArithData(size=size, digits=base.digits, ops=base.ops, seed=seed))


def prompt_text(task: Task, item: PromptItem) -> str:
    render = templates.math_prompt if task == "arith" else templates.rstar2_prompt
    return render(item.messages, item.text)


def code_for(question: str) -> str:
    """The formulaic program for `"a*b="`: simple enough for a tiny model to copy digit by digit."""
    return f"print({question.rstrip('=')})"


def tool_response(stdout: str, cost: float) -> str:
    result = SubmissionResult(
        sub_id="sft", success=True, run_success=True, cost=cost, stdout=stdout, stderr=""
    )
    return render_tool_result(result)


def example(
    task: Task, item: PromptItem, rng: random.Random, direct_fraction: float = DIRECT_FRACTION
) -> Example:
    prompt, n, question = prompt_text(task, item), item.answer, str(item.text)
    if task == "arith":
        return Example(((prompt, False), (f"\\boxed{{{n}}}{templates.IM_END}", True)), n, question)
    if rng.random() < direct_fraction:
        return Example(((prompt, False), (DIRECT_TURN.format(n=n) + templates.IM_END, True)), n, question)
    call = FIRST_TURN + templates.tool_call_text(code_for(question)) + templates.IM_END
    # Execution time varies a little, as it does in the sandbox; the model must learn to ignore it.
    response = tool_response(f"{n}\n", cost=rng.randint(1, 6) / 100)
    second = SECOND_TURN.format(n=n) + templates.IM_END
    segments = ((prompt, False), (call, True), (templates.tool_turn([response]), False), (second, True))
    return Example(segments, n, question)


def heldout(task: Task, seed: int, n: int) -> list[PromptItem]:
    src = source(task, seed + HELDOUT_SEED_OFFSET)
    return [src[i] for i in range(n)]


def train_stream(
    task: Task, seed: int, exclude: set[str], direct_fraction: float = DIRECT_FRACTION
) -> Iterator[Example]:
    """The SFT examples in training order: a pure function of (task, seed, exclude)."""
    src = source(task, seed)
    rng = random.Random(f"tiny-sft-{task}-{seed}")  # str seeds hash deterministically (not PYTHONHASHSEED)
    for i in range(len(src)):
        item = src[i]
        if item.text in exclude:
            continue
        yield example(task, item, rng, direct_fraction)


def tokenizer_corpus(seed: int = 0, per_task: int = 200) -> list[str]:
    """Text like the model sees, so BPE merges cover the prompts, tool JSON and tool responses."""
    texts: list[str] = []
    for task in TASKS:
        stream = train_stream(task, seed, set(), direct_fraction=0.5)
        texts.extend(next(stream).text for _ in range(per_task))
    texts.append(templates.tool_turn([render_tool_result(_failure("NameError: name 'x' is not defined"))]))
    return texts


# ---------------------------------------------------------------- scoring held-out generations

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def last_boxed(text: str) -> str | None:
    found = _BOXED.findall(text)
    return found[-1].strip() if found else None


def parse_tool_call(text: str) -> str | None:
    """The code of the first well-formed `python_code_with_standard_io` call (the rStar2 parser's rule)."""
    match = _TOOL_CALL.search(text)
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    args = call.get("arguments") if isinstance(call, dict) else None
    if call.get("name") != templates.TOOL_NAME or not isinstance(args, dict):
        return None
    code = args.get("code")
    return code if isinstance(code, str) else None


def _failure(stderr: str) -> SubmissionResult:
    return SubmissionResult(sub_id="eval", success=False, run_success=False, cost=0.01, stderr=stderr + "\n")


def _arith(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) < 10**30:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_arith(node.operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult):
        left, right = _arith(node.left), _arith(node.right)
        return (
            left + right
            if isinstance(node.op, ast.Add)
            else left - right
            if isinstance(node.op, ast.Sub)
            else left * right
        )
    raise ValueError("only integer + - * is evaluated here")


def run_formulaic(code: str) -> SubmissionResult:
    """Run `print(<integer + - * expression>)` exactly as the sandbox would, without a sandbox.

    The warm start's held-out check needs tool results for the code its own model writes, many times
    a minute; spawning sandboxed interpreters for that would cost more than the check. Anything that
    is not that one formula gets a failure, as a broken program would.
    """
    try:
        tree = ast.parse(code)
        (stmt,) = tree.body
        call = stmt.value if isinstance(stmt, ast.Expr) else None
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "print"):
            raise ValueError("only print(<expression>) is evaluated here")
        if len(call.args) != 1 or call.keywords:
            raise ValueError("print takes one expression here")
        value = _arith(call.args[0])
    except (SyntaxError, ValueError) as e:
        return _failure(f"{type(e).__name__}: {e}")
    return SubmissionResult(
        sub_id="eval", success=True, run_success=True, cost=0.01, stdout=f"{value}\n", stderr=""
    )
