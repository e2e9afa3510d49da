"""rStar2-Agent's `python_code_with_standard_io` tool: the code wrapper and the tool-response text.

The model's code is not run verbatim. Like rStar2's `code_judge_utils.py`, it is embedded (base64, so
no quoting can break out) in a small driver script that runs it notebook-style:

* a trailing bare expression is evaluated and its `repr` printed unless it is None (`x = 2\\nx` -> `2`);
* an exception is reported on stderr as `{Type} at line {n}: {msg}\\n  {source line}` with `n` counted
  in the model's own code, and the script exits 1 (`os._exit`, so atexit hooks and stray non-daemon
  threads cannot turn a failure into a hang or a success);
* `SystemExit` is left alone: `sys.exit(0)` is a success, `sys.exit(3)` a plain failure.

Deliberate differences from rStar2's driver (same text format, better content):
* the last expression is split off on the AST, not on line boundaries, so `x = 1; x` works;
* the error line is the deepest frame of the model's code, not of whatever library raised;
* stdout is flushed before `os._exit(1)`, so output printed before the error is not lost;
* a failing last expression is not re-executed as a statement (rStar2 runs its side effects twice).

The driver script is an ordinary Code Judge `python` solution, so it runs the same on the embedded
pool, on a Code Judge server and on Redis workers. `render_tool_result` produces the exact
`Tool call success|failure` text that rStar2's agent loop shows the model and that RoC's error
penalty searches for the substring "error" (roc_and_grpo.md 3.5), so it must stay byte-compatible.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Protocol

from sandbox_bridge.types import Submission, SubmissionResult

TOOL_NAME = "python_code_with_standard_io"

# Runs inside the sandboxed interpreter. Kept free of f-string tricks newer than Python 3.8 because
# a Code Judge worker may run an older python3.
_DRIVER = """\
import ast as _ast
import base64 as _b64
import os as _os
import sys as _sys

_FILE = "<string>"
_GLOBALS = {"__name__": "__main__", "__file__": _FILE, "__builtins__": __builtins__}


def _fail(exc, lineno, src):
    lines = src.splitlines()
    if lineno is not None and 1 <= lineno <= len(lines):
        text = "%s at line %d: %s\\n  %s" % (type(exc).__name__, lineno, exc, lines[lineno - 1])
    else:
        text = "%s: %s" % (type(exc).__name__, exc)
    try:
        _sys.stdout.flush()
        print(text, file=_sys.stderr)
        _sys.stderr.flush()
    finally:
        _os._exit(1)


def _user_lineno(exc):
    lineno = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == _FILE:
            lineno = tb.tb_lineno
        tb = tb.tb_next
    return lineno


def _run(src, replay):
    try:
        tree = _ast.parse(src)
    except SyntaxError as exc:
        if not replay:
            _fail(exc, exc.lineno, src)
        return
    last = None
    if tree.body and isinstance(tree.body[-1], _ast.Expr):
        last = _ast.Expression(body=tree.body.pop().value)
    try:
        exec(compile(tree, _FILE, "exec"), _GLOBALS)
        if last is not None:
            value = eval(compile(last, _FILE, "eval"), _GLOBALS)
            if value is not None and not replay:
                print(repr(value))
    except Exception as exc:
        if not replay:
            _fail(exc, _user_lineno(exc), src)


def _quiet(src):
    import io
    import contextlib

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        _run(src, True)

"""


def wrap_code(code: str, history: Sequence[str] = ()) -> str:
    """The driver script that runs `code` notebook-style.

    `history` is rStar2's `jupyter_code` emulation: earlier cells are replayed first in the same
    globals with their output suppressed and their errors ignored.
    """
    parts = [_DRIVER]
    for cell in history:
        parts.append(f'_quiet(_b64.b64decode("{_b64(cell)}").decode())\n')
    parts.append(f'_run(_b64.b64decode("{_b64(code)}").decode(), False)\n')
    return "".join(parts)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def tool_submission(code: str, input: str | None = None, history: Sequence[str] = ()) -> Submission:
    """The Code Judge submission for one `python_code_with_standard_io(code, input)` call."""
    return Submission(type="python", solution=wrap_code(code, history), input=input)


def render_tool_result(result: SubmissionResult) -> str:
    """rStar2's tool-response text (code_judge_utils.run_tool_calls_on_server_async), byte for byte."""
    ok = result.run_success and result.success
    parts = ["Tool call success"] if ok else ["Tool call failure", f"reason: {result.reason}"]
    if result.stdout:
        parts.append(f"stdout: {result.stdout}")
    if result.stderr:
        parts.append(f"stderr: {result.stderr}")
    parts.append(f"execution time: {result.cost:.2f}s")
    return "\n".join(parts)


def render_tool_error(exc: BaseException | str) -> str:
    """The text rStar2's agent loop shows when the tool call itself raised."""
    return f"Error when executing tool: {exc}"


class _Submitter(Protocol):
    async def submit(self, sub: Submission) -> SubmissionResult: ...


async def python_code_with_standard_io(
    sandbox: _Submitter, code: str, input: str | None = None, history: Sequence[str] = ()
) -> str:
    """Run one tool call and return the text the model sees. Never raises for sandbox faults."""
    try:
        result = await sandbox.submit(tool_submission(code, input, history))
    except Exception as exc:  # the agent loop must get text back whatever the backend did
        return render_tool_error(exc)
    return render_tool_result(result)
