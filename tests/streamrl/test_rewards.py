"""Grader behaviour (streamrl/rewards.py): extraction, equivalence, the three graders, final-answer mode.

These run in pytest's main thread, where Math-Verify's signal-based timeouts work.
"""

from __future__ import annotations

import threading
import time

import math_verify
import pytest

from streamrl import rewards
from streamrl.rewards import (
    answers_match,
    extract_answer,
    extract_boxed,
    final_answer_text,
    math_verify_score,
    rlinf_pm5_score,
    rstar2_fused_score,
    rule_based_correct,
    score,
    symbolic_equal,
)
from streamrl.templates import tool_turn

CALL = (
    '<tool_call>\n{"name": "python_code_with_standard_io", '
    '"arguments": {"code": "print(6 * 7)", "input": ""}}\n</tool_call><|im_end|>\n'
)


def rstar2_response(first: str, tool_output: str, last: str) -> str:
    """A response text as the rStar2 loop builds it: one tool round, then the final assistant turn."""
    return first + CALL + tool_turn([tool_output]) + last + "<|im_end|>"


# ---------------------------------------------------------------- extraction


def test_extract_boxed_matches_nested_braces_and_takes_the_last_box() -> None:
    text = "first \\boxed{1} then \\boxed{\\frac{1}{\\sqrt{2}}} and \\{not a box\\}"
    assert extract_boxed(text) == "\\frac{1}{\\sqrt{2}}"
    assert extract_boxed("\\boxed{\\{1, 2\\}}") == "\\{1, 2\\}"


def test_extract_boxed_reads_fbox_and_the_space_form() -> None:
    assert extract_boxed("\\boxed{3} and later \\fbox{7}") == "7"
    assert extract_boxed("so $\\boxed 5$.") == "5"
    assert extract_boxed("no box here") is None


def test_an_unclosed_last_box_yields_no_answer_even_after_a_closed_one() -> None:
    assert extract_boxed("\\boxed{1} ... \\boxed{\\frac{2}{3") is None


def test_rule_based_extraction_takes_the_later_of_anchor_and_box() -> None:
    assert extract_answer("The answer is \\boxed{5}.") == "5"
    assert extract_answer("I first wrote \\boxed{3}.\nFinal answer: 7") == "7"
    assert extract_answer("Answer: $42$</answer><|im_end|>") == "42"
    assert extract_answer("so x = 12. Done") == "12"  # no anchor or box: the last line, after "="
    assert extract_answer("x = 12\nI could not finish.") is None  # the last line has no digit


# ---------------------------------------------------------------- final answer only


def test_final_answer_text_is_the_last_box_of_the_last_assistant_turn() -> None:
    response = rstar2_response("<answer>\\boxed{41}</answer>", "42", "so \\boxed{6} then \\boxed{42}.")
    assert final_answer_text(response + "<|endoftext|>\\boxed{99}") == "\\boxed{42}"


def test_final_answer_text_is_empty_without_a_box_in_the_last_turn() -> None:
    response = rstar2_response("We guess \\boxed{42}.", "42", "The tool printed it. Answer: 42")
    assert final_answer_text(response) == ""


def test_final_answer_text_is_empty_when_the_trajectory_ends_inside_a_tool_turn() -> None:
    response = "\\boxed{42}" + CALL + "<|im_start|>user\n<tool_response>\n42"
    assert final_answer_text(response) == ""


def test_final_answer_text_of_a_single_turn_response_is_its_last_box() -> None:
    assert final_answer_text("so 2 + 2 = \\boxed{4}<|im_end|>") == "\\boxed{4}"


def test_a_number_printed_by_the_tool_is_credited_by_plain_math_verify_but_not_in_final_answer_mode() -> None:
    response = rstar2_response("Let me compute 6 * 7.", "42", "The tool printed the value I needed.</reason>")
    assert math_verify_score(response, "42") == 1.0  # Math-Verify's rightmost-number fallback
    assert score("math_verify", response, "42") == 1.0
    for kind in ("math_verify", "rstar2_fused"):
        assert score(kind, response, "42", final_answer_only=True) == 0.0
    assert score("rlinf_pm5", response, "42", final_answer_only=True) == -5.0
    boxed = response.replace("needed.</reason>", "needed.</reason><answer>\\boxed{42}</answer>")
    for kind, right in (("math_verify", 1.0), ("rstar2_fused", 1.0), ("rlinf_pm5", 5.0)):
        assert score(kind, boxed, "42", final_answer_only=True) == right


# ---------------------------------------------------------------- equivalence


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ("\\frac{1}{2}", "0.5"),
        ("\\dfrac12", "\\frac{1}{2}"),
        ("-\\frac{3}{4}", "-0.75"),
        ("1,000", "1000"),
        (".5", "1/2"),
        ("x = 5", "5"),
        ("90^\\circ", "90"),
        ("5 \\text{ cm}", "5"),
        ("\\text{(B)}", "B"),
        ("(1, 2)", "(1,2)"),
        ("\\frac{\\sqrt{8}}{2}", "\\sqrt{2}"),
        ("2\\sqrt{3}", "\\sqrt{12}"),
        ("2 \\pi", "\\pi \\cdot 2"),
        ("0.3333", "\\frac{1}{3}"),
    ],
)
def test_equivalent_answers_match(pred: str, gold: str) -> None:
    assert answers_match(pred, gold)
    assert rule_based_correct(f"so \\boxed{{{pred}}}", gold)


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ("41", "42"),
        ("0.333", "\\frac{1}{3}"),
        ("(1, 2)", "[1, 2]"),
        ("(1, 2)", "(2, 1)"),
        ("2x", "3x"),
        ("B", "C"),
    ],
)
def test_different_answers_do_not_match(pred: str, gold: str) -> None:
    assert not answers_match(pred, gold)


def test_numbers_match_with_relative_tolerance_and_percentage_variants() -> None:
    assert answers_match("1000.05", "1000")  # within 1e-4 relative
    assert not answers_match("1001", "1000")
    assert answers_match("50\\%", "0.5") and answers_match("0.5", "50")  # RLinf's percentage variants
    assert answers_match("500", "5")  # the same rule's quirk, kept on purpose


def test_symbolic_equality_refuses_code_and_huge_powers_quickly() -> None:
    started = time.monotonic()
    assert not symbolic_equal("__import__('os').getcwd()", "1")
    assert not symbolic_equal("x.conjugate()", "x")
    assert not symbolic_equal("9^{9^{9}}", "1")
    assert time.monotonic() - started < 1.0


def test_symbolic_equality_is_skipped_off_the_main_thread() -> None:
    results: list[bool] = []
    worker = threading.Thread(
        target=lambda: results.append(symbolic_equal("\\frac{\\sqrt{8}}{2}", "\\sqrt{2}"))
    )
    worker.start()
    worker.join(10.0)
    assert results == [False]
    assert symbolic_equal("\\frac{\\sqrt{8}}{2}", "\\sqrt{2}")


def test_math_verify_refuses_to_run_off_the_main_thread() -> None:
    errors: list[BaseException] = []

    def grade() -> None:
        try:
            math_verify_score("\\boxed{1}", "1")
        except RuntimeError as e:
            errors.append(e)

    worker = threading.Thread(target=grade)
    worker.start()
    worker.join(10.0)
    assert len(errors) == 1 and "main thread" in str(errors[0])


# ---------------------------------------------------------------- the graders


def test_math_verify_wraps_the_gold_in_a_box_and_grades_latex() -> None:
    assert math_verify_score("The result is $\\boxed{\\frac{2}{4}}$", "\\frac{1}{2}") == 1.0
    assert math_verify_score("The result is $\\boxed{\\{1, 2\\}}$", "\\{2, 1\\}") == 1.0
    assert math_verify_score("\\boxed{3}", "4") == 0.0


def test_fused_grader_credits_what_either_grader_credits() -> None:
    assert math_verify_score("\\boxed{0.3333}", "\\frac{1}{3}") == 0.0  # rounds to 6 digits
    assert rstar2_fused_score("\\boxed{0.3333}", "\\frac{1}{3}") == 1.0  # the rules' 1e-4 tolerance
    assert not rule_based_correct("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}")
    assert rstar2_fused_score("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}") == 1.0  # Math-Verify's sets
    assert rstar2_fused_score("\\boxed{3}", "4") == 0.0


def test_fused_grader_tries_the_rules_first_and_math_verify_only_when_they_fail(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(rewards, "math_verify_score", lambda r, a: calls.append(r) or 0.0)
    assert rstar2_fused_score("\\boxed{7}", "7") == 1.0
    assert calls == []
    assert rstar2_fused_score("\\boxed{8}", "7") == 0.0
    assert calls == ["\\boxed{8}"]


def test_an_exception_in_the_rule_based_grader_falls_through_to_math_verify(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(response: str, answer: str) -> bool:
        raise RecursionError("rules broke")

    monkeypatch.setattr(rewards, "rule_based_correct", broken)
    assert rstar2_fused_score("\\boxed{7}", "7") == 1.0


def test_an_exception_or_timeout_inside_math_verify_scores_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    from math_verify.errors import TimeoutException

    for error in (ValueError("parse failed"), TimeoutException("Operation timed out!")):

        def broken(*args: object, error: BaseException = error, **kwargs: object) -> object:
            raise error

        monkeypatch.setattr(math_verify, "parse", broken)
        assert math_verify_score("\\boxed{7}", "7") == 0.0
        assert rstar2_fused_score("so the result is nothing", "7") == 0.0


def test_rlinf_pm5_gives_plus_five_for_boxed_or_anchored_answers() -> None:
    assert rlinf_pm5_score("so \\boxed{\\frac{1}{2}}", "0.5") == 5.0
    assert rlinf_pm5_score("So the answer is 12.\nDone.", "\\boxed{12}") == 5.0
    assert rlinf_pm5_score("The final answer is $7$. I hope it is correct.", "7") == 5.0
    assert rlinf_pm5_score("\\boxed{13}", "12") == -5.0


def test_rlinf_pm5_gives_minus_five_without_a_box_or_anchor() -> None:
    text = "6 * 7 makes 42"
    assert math_verify_score(text, "42") == 1.0  # rightmost number
    assert rlinf_pm5_score(text, "42") == -5.0
    assert rlinf_pm5_score("Answer: 42", "42") == -5.0  # "Answer:" is not one of RLinf's anchors
    assert rlinf_pm5_score("", "42") == -5.0


def test_score_dispatches_by_reward_type_and_rejects_unknown_ones() -> None:
    assert score("math_verify", "\\boxed{2}", "2") == 1.0
    assert score("rstar2_fused", "\\boxed{2}", "2") == 1.0
    assert score("rlinf_pm5", "\\boxed{2}", "2") == 5.0
    with pytest.raises(ValueError, match="unknown reward type"):
        score("llm_judge", "\\boxed{2}", "2")
