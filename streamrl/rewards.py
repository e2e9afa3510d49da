"""Reward graders: pure functions of (response text, ground-truth answer), run inside reward workers.

Picked by `RewardConfig.type` (roc_and_grpo.md section 5): `math_verify` (Math-Verify as rStar calls
it: gold wrapped as `\\boxed{gt}`, response parsed with expression then LaTeX targets; 1.0 / 0.0),
`rstar2_fused` (a rule-based grader in prime_math's role, then Math-Verify; an exception counts as
"not correct by that grader"), `rlinf_pm5` (RLinf's math reward, +5 / -5, with RLinf's extraction:
minerva phrase, last box, "the answer is", "final answer is", "答案是"; nothing found is incorrect).
`final_answer_only` grades `final_answer_text(response)` instead, so a number printed by the tool
(Math-Verify takes the rightmost number when nothing is anchored) is never credited.

The rule-based grader is written here in the spirit of prime_math and RLinf's `math_equal`; no code
is copied. Deliberate deviations:
1. Extraction takes whichever comes last: the last anchor ("answer:", "answer is", "answers are",
   "答案是") or the last box (prime_math applies anchors, then looks for a box in the remainder); no
   "is the answer" form. With neither, like prime_math, the last line (after its last "=" or " is ")
   if it has a digit. An anchor's answer is its first line up to the end of the sentence.
2. Numbers: relative tolerance 1e-4 with RLinf's percentage variants (gold x100 and /100), so gold 5
   also accepts 500 and 0.05, a reference quirk kept on purpose; no pi = 3.14 variant.
3. Symbolic: our own LaTeX-to-infix conversion (fractions, roots, products, powers, pi) into sympy,
   restricted to digits, operators and one-letter symbols (sympy's parser evaluates Python), numeric
   exponents over 1000 refused, then `simplify(a - b) == 0` (or a 1e-4 comparison for constants)
   under a 2 s SIGALRM limit; off the main thread this step is skipped, never unbounded. Matrices,
   equations and latex2sympy are left to Math-Verify.
4. An unclosed last `\\boxed{` (a truncated answer) gives no answer; an earlier box is not used.
5. One reference answer is graded (RLinf's math reward accepts any of several).
"""

from __future__ import annotations

import math
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

SYMPY_TIME_LIMIT_S = 2.0
REL_TOL = 1e-4
_MAX_EXPONENT = 1000.0  # larger numeric powers are refused: big-int pow runs in C, deaf to signals

ASSISTANT_START, IM_END, USER_START = "<|im_start|>assistant", "<|im_end|>", "<|im_start|>user"


class Grader(Protocol):
    """What a reward worker calls; `score` below is the production implementation."""

    def __call__(self, kind: str, response: str, answer: str, final_answer_only: bool) -> float: ...


# ---------------------------------------------------------------- extraction


def _brace_group(text: str, i: int) -> tuple[str, int] | None:
    """Content of the `{...}` group opening at text[i] and the index after it; escaped braces skipped."""
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j], j + 1
        j += 1
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` or `\\fbox{...}` (nested braces matched).

    `\\boxed 5` (space form) gives the token up to the next whitespace or `$`. An unclosed last box
    (a truncated answer) gives None.
    """
    b, f = text.rfind("\\boxed"), text.rfind("\\fbox")
    if b < 0 and f < 0:
        return None
    i = b + len("\\boxed") if b > f else f + len("\\fbox")
    j = i
    while j < len(text) and text[j] in " \t":
        j += 1
    if j < len(text) and text[j] == "{":
        group = _brace_group(text, j)
        return group[0] if group else None
    if j > i:  # "\boxed 5": the token after the space
        m = re.match(r"[^\s$]+", text[j:])
        return m.group(0) if m else None
    return None


def final_answer_text(response: str) -> str:
    """The text graded when `final_answer_only` is set: `\\boxed{X}` for the final answer X, or "".

    The last assistant turn is the text after the last `<|im_start|>assistant` (the whole response
    when there is none: a single-turn answer, or an rStar2 answer without tool calls, whose turn the
    prompt opened), cut at its `<|im_end|>`. If a user (tool-response) turn starts after it, the
    trajectory ended inside a tool turn and has no final answer. X is that turn's last `\\boxed{}`
    (`\\fbox{}`); a turn without one gives "" (graded incorrect), so numbers in tool output and
    anchors such as "Answer: 42" without a box are never credited.
    """
    start = response.rfind(ASSISTANT_START)
    turn = response if start < 0 else response[start + len(ASSISTANT_START) :]
    if USER_START in turn:
        return ""
    turn = turn.split(IM_END, 1)[0]
    boxed = extract_boxed(turn)
    return "" if boxed is None else "\\boxed{" + boxed + "}"


_TAGS = re.compile(r"<\|[^|<>]*\|>|</?(?:answer|reason|think)>")
_ANCHORS = re.compile(r"final answer is|answer is|answers are|answer:|答案是", re.IGNORECASE)


def _first_sentence(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    first = lines[0].strip() if lines else ""
    return first.split(". ", 1)[0].strip(" $").rstrip(".").strip(" $")


def extract_answer(text: str) -> str | None:
    """The rule-based grader's answer: the later of the last anchor and the last box, else a fallback."""
    text = _TAGS.sub(" ", text)
    anchors = list(_ANCHORS.finditer(text))
    anchor = anchors[-1] if anchors else None
    box_at = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if box_at >= 0 and (anchor is None or box_at > anchor.start()):
        return extract_boxed(text)
    if anchor is not None:
        return _first_sentence(text[anchor.end() :].lstrip(" :$\n")) or None
    last = next((line for line in reversed(text.splitlines()) if line.strip()), "")
    for marker in ("=", " is "):
        if marker in last:
            last = last.rsplit(marker, 1)[1]
            break
    last = _first_sentence(last)
    return last if any(c.isdigit() for c in last) else None


def rlinf_extract_answer(text: str) -> str:
    """RLinf's extraction order: minerva phrase, last box, "he answer is", "final answer is", "答案是"."""
    if "final answer is $" in text and "$. I hope" in text:
        found: str | None = text.split("final answer is $", 1)[1].split("$. I hope", 1)[0]
    elif "boxed" in text or "\\fbox" in text:
        found = extract_boxed(text)
    else:
        found = None
        for marker in ("he answer is", "final answer is", "答案是"):
            if marker in text:
                found = _first_sentence(_TAGS.sub(" ", text.rsplit(marker, 1)[1]))
                break
    return (found or "").strip().lstrip(":").rstrip("./").strip()


# ---------------------------------------------------------------- normalisation and comparison

_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mbox|operatorname)\s*\{([^{}]*)\}")
_DROP = ("\\displaystyle", "\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\quad", "\\$", "$")
_NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)(?:e-?\d+)?")


def normalize_answer(text: str) -> str:
    """A canonical string for an answer: LaTeX noise, units, degrees, %, `x=` and spaces removed."""
    s = _TAGS.sub(" ", text).strip()
    s = _WRAPPERS.sub(r"\1", s)
    for token in _DROP:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\{", "{").replace("\\}", "}")
    s = re.sub(r"\^\s*\{?\\circ\}?|°|\\%|%|\bdegrees?\b", "", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", s)
    s = re.sub(r"^\s*[A-Za-z](?:_\{?\w+\}?)?\s*=\s*([^=]+)$", r"\1", s)  # "x = 5" -> "5"
    s = re.sub(r"^\s*(-?[\d.,]+)\s+[A-Za-z]{2,}(?:\s+[A-Za-z]+)*\s*$", r"\1", s)  # "5 cm" -> "5"
    s = re.sub(r"\s+", "", s).rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):  # thousands separators
        s = s.replace(",", "")
    s = re.sub(r"(?<![\d}])\.(\d)", r"0.\1", s)  # ".5" -> "0.5"
    return re.sub(r"^\(([A-Za-z])\)$", r"\1", s)  # "(B)" -> "B"


def _to_number(s: str) -> float | None:
    """A plain number, `a/b` or `\\frac{a}{b}` (already normalised) as a float."""
    if _NUMBER.fullmatch(s):
        return float(s)
    m = re.fullmatch(r"(-?)(?:\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}|(-?[\d.]+)/(-?[\d.]+))", s)
    if m is None:
        return None
    num, den = (m.group(2), m.group(3)) if m.group(2) else (m.group(4), m.group(5))
    try:
        value = float(num) / float(den)
    except (ValueError, ZeroDivisionError):
        return None
    return -value if m.group(1) else value


def _split_list(s: str) -> tuple[str, list[str]] | None:
    """`(a,b)` / `[a,b]` / `{a,b}` / `a,b` -> (brackets, top-level elements), for two or more elements."""
    brackets = s[0] + s[-1] if len(s) >= 2 and s[0] in "([{" and s[-1] in ")]}" else ""
    inner = s[1:-1] if brackets else s
    parts, depth, start = [], 0, 0
    for i, c in enumerate(inner):
        depth += c in "([{"
        depth -= c in ")]}"
        if c == "," and depth == 0:
            parts.append(inner[start:i])
            start = i + 1
    parts.append(inner[start:])
    return (brackets, parts) if len(parts) >= 2 else None


def answers_match(pred: str, gold: str) -> bool:
    """RLinf/prime-style equality: strings, choice letters, numbers (1e-4, %), tuples, then sympy."""
    p, g = normalize_answer(pred), normalize_answer(gold)
    if not p or not g:
        return False
    if p == g or (p.isalpha() and p.lower() == g.lower()):
        return True
    pn, gn = _to_number(p), _to_number(g)
    if pn is not None and gn is not None:
        return any(math.isclose(pn, v, rel_tol=REL_TOL) for v in (gn, gn / 100, gn * 100))
    pl, gl = _split_list(p), _split_list(g)
    if pl and gl:
        return pl[0] == gl[0] and len(pl[1]) == len(gl[1]) and all(map(answers_match, pl[1], gl[1]))
    return symbolic_equal(p, g)


# ---------------------------------------------------------------- symbolic equality under a time limit


class _OutOfTime(BaseException):
    """Raised by SIGALRM; a BaseException so sympy's own `except Exception` blocks cannot swallow it."""


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """SIGALRM-bounded block (main thread only); an outer timer (e.g. pytest-timeout) is restored."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("a signal-based time limit needs the main thread")

    def on_alarm(signum: int, frame: Any) -> None:
        raise _OutOfTime

    outer_remaining, _ = signal.getitimer(signal.ITIMER_REAL)
    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_remaining > 0:
            signal.setitimer(signal.ITIMER_REAL, max(outer_remaining - (time.monotonic() - started), 1e-3))


def _latex_to_infix(s: str) -> str:
    """Fractions, roots, products, powers and pi to sympy infix; ValueError on anything else."""
    out, i = [], 0
    while i < len(s):
        c = s[i]
        if c == "\\":
            m = re.match(r"\\([A-Za-z]+)", s[i:])
            if m is None:
                raise ValueError(s)
            name, i = m.group(1), i + len(m.group(0))
            if name == "frac":
                num, i = _group_or_char(s, i)
                den, i = _group_or_char(s, i)
                out.append(f" (({_latex_to_infix(num)})/({_latex_to_infix(den)})) ")
            elif name == "sqrt" and s.startswith("[", i):
                close = s.index("]", i)
                arg, end = _group_or_char(s, close + 1)
                out.append(f" (({_latex_to_infix(arg)})**(1/({_latex_to_infix(s[i + 1 : close])}))) ")
                i = end
            elif name == "sqrt":
                arg, i = _group_or_char(s, i)
                out.append(f" sqrt({_latex_to_infix(arg)}) ")
            elif name in ("cdot", "times", "div", "pi"):
                out.append({"cdot": "*", "times": "*", "div": "/", "pi": " pi "}[name])
            else:
                raise ValueError(name)
        elif c == "{":
            arg, i = _group_or_char(s, i)
            out.append(f"({_latex_to_infix(arg)})")
        else:
            out.append("**" if c == "^" else c)
            i += 1
    return "".join(out)


def _group_or_char(s: str, i: int) -> tuple[str, int]:
    group = None if i >= len(s) else _brace_group(s, i) if s[i] == "{" else (s[i], i + 1)
    if group is None:
        raise ValueError(s)
    return group


def _to_sympy(s: str) -> Any:
    import sympy
    from sympy.parsing.sympy_parser import implicit_multiplication, parse_expr, standard_transformations

    infix = _latex_to_infix(s)
    names = set(re.findall(r"[A-Za-z]+", infix))
    # parse_expr evaluates Python: only digits, operators and one-letter symbols get that far.
    if not re.fullmatch(r"[0-9A-Za-z+\-*/().\s]*", infix) or re.search(r"\.\s*[A-Za-z]", infix):
        raise ValueError(s)
    if any(len(n) > 1 and n not in ("sqrt", "pi") for n in names):
        raise ValueError(s)
    local = {n: sympy.Symbol(n) for n in names if len(n) == 1}
    transformations = (*standard_transformations, implicit_multiplication)
    expr = parse_expr(infix, local_dict=local, transformations=transformations, evaluate=False)
    for node in sympy.preorder_traversal(expr):
        if node.is_Pow and node.exp.is_number and abs(complex(node.exp.evalf(15))) > _MAX_EXPONENT:
            raise ValueError(f"exponent too large in {s}")
    return expr


def symbolic_equal(a: str, b: str, limit_s: float = SYMPY_TIME_LIMIT_S) -> bool:
    """sympy equality of two normalised answers; False when unparsable, out of time or off main thread."""
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        with _time_limit(limit_s):
            import sympy

            x, y = _to_sympy(a), _to_sympy(b)
            if not x.free_symbols and not y.free_symbols:
                vx, vy = complex(sympy.N(x)), complex(sympy.N(y))
                return abs(vx - vy) <= REL_TOL * max(abs(vx), abs(vy)) or vx == vy
            return bool(sympy.simplify(x - y) == 0)
    except (_OutOfTime, Exception):
        return False


# ---------------------------------------------------------------- the graders


def _require_main_thread() -> None:
    # Math-Verify's signal.alarm raises ValueError off the main thread and its callers turn that into
    # a silent 0.0; refusing loudly is better than grading everything wrong.
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("math-verify grading must run in a process's main thread (use workers.reward)")


def math_verify_score(response: str, answer: str) -> float:
    """Math-Verify as rStar's reward calls it; any exception or timeout gives 0.0."""
    _require_main_thread()
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    from math_verify.errors import TimeoutException

    try:
        gold = parse("\\boxed{" + answer + "}", (LatexExtractionConfig(),))
        pred = parse(response, (ExprExtractionConfig(), LatexExtractionConfig()))
        return 1.0 if gold and pred and verify(gold, pred) else 0.0
    except (Exception, TimeoutException):  # TimeoutException is a BaseException
        return 0.0


def rule_based_correct(response: str, answer: str) -> bool:
    """prime_math's role in the fused grader: extract an answer, compare with `answers_match`."""
    pred = extract_answer(response)
    gold = extract_boxed(answer) or answer
    return pred is not None and answers_match(pred, gold)


def rstar2_fused_score(response: str, answer: str) -> float:
    """Rule-based first, then Math-Verify; an exception in a grader counts as not correct."""
    _require_main_thread()
    try:
        if rule_based_correct(response, answer):
            return 1.0
    except Exception:
        pass
    return math_verify_score(response, answer)


def rlinf_pm5_score(response: str, answer: str) -> float:
    """RLinf's math reward: +5 correct, -5 incorrect (no extracted answer or an exception included)."""
    try:
        pred = rlinf_extract_answer(response)
        return 5.0 if pred and answers_match(pred, extract_boxed(answer) or answer) else -5.0
    except Exception:
        return -5.0


GRADERS: dict[str, Callable[[str, str], float]] = {
    "math_verify": math_verify_score,
    "rstar2_fused": rstar2_fused_score,
    "rlinf_pm5": rlinf_pm5_score,
}


def score(kind: str, response: str, answer: str, final_answer_only: bool = False) -> float:
    """Grade `response` against `answer` with the grader named by `RewardConfig.type`."""
    grader = GRADERS.get(kind)
    if grader is None:
        raise ValueError(f"unknown reward type {kind!r}; expected one of {sorted(GRADERS)}")
    return grader(final_answer_text(response) if final_answer_only else response, answer)


def warm_up() -> None:
    """Pay the imports (Math-Verify, sympy: about 0.5 s) and first-call caches before real work."""
    math_verify_score("\\boxed{\\frac{1}{2}}", "0.5")
    symbolic_equal("\\sqrt{4}", "2")
