"""Agent loops against a scripted engine, a real tokenizer and scripted or real sandboxes.

Expected texts are the rStar2 strings of roc_and_grpo.md 3.3-3.6 (`Failed to decode tool call: ...`,
`Error when executing tool: ...`, `...(truncated)...`, the `<tool_response>` user turn) and the RoC
penalties of 1.5 computed on the decoded text.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import numpy as np
import pytest

from sandbox_bridge.tool import render_tool_result
from streamrl import roc, templates
from streamrl.agent import Codec, HFCodec, ResumePolicy, RolloutResult, as_codec, run_math, run_rstar2
from streamrl.config import RolloutConfig
from streamrl.messages import Prompt, check_trajectory, unpack
from streamrl.tiny import VOCAB_SIZE, make_tokenizer
from streamrl.tiny_data import tokenizer_corpus
from streamrl.tool_calls import TRUNCATION_MARK, parse_tool_calls, truncate_middle
from tests.streamrl.agent_fakes import ScriptedEngine, ScriptedSandbox, Step, failed, ok

PROMPT = Prompt(uid=1, prompt_id="p1", answer="42", text="What is 6*7?", admitted_version=0, n_samples=1)
CALL = templates.tool_call_text("print(6*7)")
ANSWER = " The tool says 42. </reason> <answer> \\boxed{42} </answer>"
OK42 = render_tool_result(ok("42\n"))


@pytest.fixture(scope="module")
def codec() -> Codec:
    return as_codec(make_tokenizer(tokenizer_corpus(per_task=50), VOCAB_SIZE))


def cfg(**kw: Any) -> RolloutConfig:
    return RolloutConfig(agent="rstar2_tool", max_new_tokens=kw.pop("max_new_tokens", 400), **kw)


def rstar2(
    codec: Codec, steps: list[Step], sandbox: Any, resume: ResumePolicy | None = None, **kw: Any
) -> tuple[RolloutResult, ScriptedEngine]:
    engine = ScriptedEngine(codec, list(steps))  # the engine pops its steps
    res = asyncio.run(run_rstar2(PROMPT, engine, codec, sandbox, cfg(**kw), resume=resume or ResumePolicy()))
    return res, engine


def tool_ids(codec: Codec, *responses: str) -> list[int]:
    return codec.encode(templates.tool_turn(list(responses)))


def responses_in(text: str) -> list[str]:
    """The bodies of the <tool_response> blocks of a decoded response."""
    parts = text.split("<tool_response>\n")[1:]
    return [p.split("\n</tool_response>")[0] for p in parts]


# ---------------------------------------------------------------- masking, text, RoC


def test_tool_tokens_are_masked_with_logprob_zero_and_version_minus_one(codec: Codec) -> None:
    sandbox = ScriptedSandbox([ok("42\n")])
    res, engine = rstar2(codec, [Step("Compute it.\n" + CALL, version=1), Step(ANSWER, version=2)], sandbox)
    first, second = engine.outputs
    tool = tool_ids(codec, OK42)
    n1, nt, n2 = len(first.output_ids), len(tool), len(second.output_ids)
    assert res.response_ids == first.output_ids + tool + second.output_ids
    assert res.loss_mask == [1] * n1 + [0] * nt + [1] * n2
    assert res.logprobs == first.logprobs + [0.0] * nt + second.logprobs
    assert res.versions == [1] * n1 + [-1] * nt + [2] * n2
    # The second turn is generated from the prompt plus everything so far, tool turn included.
    assert engine.requests[1].input_ids == res.prompt_ids + first.output_ids + tool
    assert res.prompt_ids == codec.encode(templates.rstar2_prompt(None, PROMPT.text))
    assert (
        res.text
        == "Compute it.\n" + CALL + "<|im_end|>" + templates.tool_turn([OK42]) + ANSWER + "<|im_end|>"
    )
    assert (res.num_turns, res.tool_calls, res.tool_errors, res.tool_failures) == (2, 1, 0, 0)
    assert (res.finish_reason, res.stop_cause) == ("stop", "end_of_turn")
    assert sandbox.submissions[0].input == ""


def test_trajectory_packs_the_per_token_arrays(codec: Codec) -> None:
    res, _ = rstar2(codec, [Step(CALL), Step(ANSWER)], ScriptedSandbox([ok("42\n")]))
    traj = res.to_trajectory(3, 1.0)
    check_trajectory(traj)
    assert unpack("tokens", traj.tokens).tolist() == res.response_ids
    assert unpack("loss_mask", traj.loss_mask).tolist() == res.loss_mask
    assert np.allclose(unpack("logprobs", traj.logprobs), res.logprobs)
    assert unpack("versions", traj.versions).tolist() == res.versions
    assert (traj.sample_index, traj.reward, traj.num_turns, traj.tool_calls, traj.text) == (
        3,
        1.0,
        2,
        1,
        res.text,
    )


def test_decoded_text_gives_rstar2_roc_penalties(codec: Codec) -> None:
    clean, _ = rstar2(codec, [Step(CALL), Step(ANSWER)], ScriptedSandbox([ok("42\n")]))
    assert roc.tool_error_penalty(clean.text) == 0.0
    assert roc.answer_format_penalty(clean.text) == 0.0  # one successful call + one answer -> 0.0
    stderr = "NameError at line 1: name 'x' is not defined\n  print(x)\n"
    failing, _ = rstar2(codec, [Step(CALL), Step(ANSWER)], ScriptedSandbox([failed(stderr)]))
    assert roc.tool_error_penalty(failing.text) == 1.0
    assert (failing.tool_errors, failing.tool_failures) == (1, 1)
    no_tool, _ = rstar2(codec, [Step(ANSWER)], ScriptedSandbox([]))
    assert roc.tool_error_penalty(no_tool.text) + roc.answer_format_penalty(no_tool.text) == 1.5
    assert (no_tool.num_turns, no_tool.tool_calls) == (1, 0)


# ---------------------------------------------------------------- truncation


def test_truncate_middle_keeps_128_chars_each_side() -> None:
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    cut = truncate_middle(text, 256)
    assert cut == text[:128] + "...(truncated)..." + text[-128:]
    assert truncate_middle(text[:256], 256) == text[:256]
    assert truncate_middle("abc", 1) == "...(truncated)..."  # half == 0 keeps neither side


def test_long_tool_output_is_truncated_in_the_middle_before_counting_errors(codec: Codec) -> None:
    stdout = "".join(str(i % 10) for i in range(1000))
    res, _ = rstar2(codec, [Step(CALL), Step(ANSWER)], ScriptedSandbox([ok(stdout)]))
    full = render_tool_result(ok(stdout))
    (shown,) = responses_in(res.text)
    assert shown == full[:128] + TRUNCATION_MARK + full[-128:]
    assert len(shown) == 256 + len(TRUNCATION_MARK)
    # An error message cut out by the truncation is not an error for RoC, but still a failure.
    cut_error = failed("ZeroDivisionError at line 1: division by zero\n" + "." * 300, stdout="a" * 300)
    res, _ = rstar2(codec, [Step(CALL), Step(ANSWER)], ScriptedSandbox([cut_error]))
    assert "ZeroDivisionError" not in res.text
    assert (res.tool_calls, res.tool_errors, res.tool_failures) == (1, 0, 1)
    assert roc.tool_error_penalty(res.text) == 0.0


def test_truncation_length_is_configurable(codec: Codec) -> None:
    res, _ = rstar2(
        codec, [Step(CALL), Step(ANSWER)], ScriptedSandbox([ok("x" * 100)]), max_tool_response_chars=40
    )
    full = render_tool_result(ok("x" * 100))
    assert responses_in(res.text) == [full[:20] + TRUNCATION_MARK + full[-20:]]


# ---------------------------------------------------------------- budget and turn limits


def test_budget_counts_tool_tokens(codec: Codec) -> None:
    res, engine = rstar2(codec, [Step(CALL), Step(ANSWER)], ScriptedSandbox([ok("42\n")]), max_new_tokens=300)
    n1, nt = len(engine.outputs[0].output_ids), len(tool_ids(codec, OK42))
    assert [r.sampling.max_new_tokens for r in engine.requests] == [300, 300 - n1 - nt]
    assert engine.requests[0].sampling.stop_token_ids[0] == codec.eos_id


def test_loop_stops_without_appending_a_tool_turn_that_does_not_fit(codec: Codec) -> None:
    n1 = len(codec.encode(CALL)) + 1
    nt = len(tool_ids(codec, OK42))
    sandbox = ScriptedSandbox([ok("42\n")])
    res, engine = rstar2(codec, [Step(CALL), Step(ANSWER)], sandbox, max_new_tokens=n1 + nt)
    assert res.response_ids == engine.outputs[0].output_ids and res.loss_mask == [1] * n1
    assert (res.finish_reason, res.stop_cause, res.tool_calls) == ("length", "tool_budget", 0)
    assert len(sandbox.submissions) == 1  # the call ran; its response did not fit
    assert len(engine.requests) == 1


@pytest.mark.parametrize("extra", [1, 3])
def test_after_a_tool_turn_the_rest_of_the_budget_goes_to_the_model(codec: Codec, extra: int) -> None:
    n1, nt = len(codec.encode(CALL)) + 1, len(tool_ids(codec, OK42))
    res, engine = rstar2(
        codec, [Step(CALL), Step(ANSWER)], ScriptedSandbox([ok("42\n")]), max_new_tokens=n1 + nt + extra
    )
    assert engine.requests[1].sampling.max_new_tokens == extra
    assert len(res.response_ids) == n1 + nt + extra and res.loss_mask[-extra:] == [1] * extra
    assert (res.finish_reason, res.stop_cause) == ("length", "budget")


def test_no_budget_ends_on_a_tool_turn_or_overruns(codec: Codec) -> None:
    steps = [Step("a\n" + CALL), Step("b\n" + CALL), Step(ANSWER)]
    full = len(rstar2(codec, steps, ScriptedSandbox([ok("1"), ok("2")]))[0].response_ids)
    for budget in range(1, full + 3):
        res, _ = rstar2(codec, steps, ScriptedSandbox([ok("1"), ok("2")]), max_new_tokens=budget)
        assert 0 < len(res.response_ids) <= budget
        assert res.loss_mask[-1] == 1, f"budget {budget} ended on a tool token"
        assert len(res.loss_mask) == len(res.logprobs) == len(res.versions) == len(res.response_ids)


def test_max_assistant_turns_stops_without_executing_the_last_turns_call(codec: Codec) -> None:
    sandbox = ScriptedSandbox([ok("1\n")])
    res, engine = rstar2(codec, [Step("a\n" + CALL), Step("b\n" + CALL)], sandbox, max_assistant_turns=2)
    assert len(sandbox.submissions) == 1
    assert (res.num_turns, res.tool_calls, res.stop_cause, res.finish_reason) == (2, 1, "max_turns", "stop")
    assert res.text.endswith("b\n" + CALL + "<|im_end|>")


# ---------------------------------------------------------------- parsing and tool errors


def test_parse_needs_both_tags_and_keeps_every_block_in_order() -> None:
    assert parse_tool_calls("<tool_call>\n{}") == []
    calls = parse_tool_calls(CALL + "text" + templates.tool_call_text("print(2)", "x"))
    assert [c.arguments for c in calls] == [
        {"code": "print(6*7)", "input": ""},
        {"code": "print(2)", "input": "x"},
    ]  # type: ignore[union-attr]


def test_decode_errors_are_returned_as_tool_responses_and_are_not_roc_errors(codec: Codec) -> None:
    bad = '{"name": "python_code_with_standard_io", "arguments": {"code": "print(1)" "input": ""}}'
    try:
        json.loads("\n" + bad + "\n")
    except json.JSONDecodeError as e:
        expected = f"Failed to decode tool call: {e}"
    assert expected.startswith("Failed to decode tool call: Expecting ',' delimiter")
    sandbox = ScriptedSandbox([])
    res, _ = rstar2(codec, [Step(f"<tool_call>\n{bad}\n</tool_call>"), Step(ANSWER)], sandbox)
    assert responses_in(res.text) == [expected]
    assert (res.tool_calls, res.tool_errors, res.tool_failures, len(sandbox.submissions)) == (1, 0, 1, 0)
    assert roc.tool_error_penalty(res.text) == 0.0
    missing = '<tool_call>\n{"name": "python_code_with_standard_io"}\n</tool_call>'
    res, _ = rstar2(codec, [Step(missing), Step(ANSWER)], ScriptedSandbox([]))
    assert responses_in(res.text) == ["Failed to decode tool call: 'arguments'"]


def test_max_parallel_calls_1_uses_only_the_first_call_and_parse_errors_count(codec: Codec) -> None:
    sandbox = ScriptedSandbox([ok("42\n")])
    res, _ = rstar2(codec, [Step(CALL + templates.tool_call_text("print(0)")), Step(ANSWER)], sandbox)
    assert len(sandbox.submissions) == 1 and responses_in(res.text) == [OK42]
    sandbox = ScriptedSandbox([ok("42\n")])
    res, _ = rstar2(codec, [Step("<tool_call>\n{oops}\n</tool_call>" + CALL), Step(ANSWER)], sandbox)
    assert len(sandbox.submissions) == 0
    assert [r.split(":")[0] for r in responses_in(res.text)] == ["Failed to decode tool call"]


def test_parallel_calls_run_concurrently_and_keep_their_order(codec: Codec) -> None:
    bad = "<tool_call>\n[1]\n</tool_call>"
    turn = CALL + bad + templates.tool_call_text("print(1)")
    sandbox = ScriptedSandbox([ok("a"), ok("b")], delay_s=0.05)
    res, _ = rstar2(codec, [Step(turn), Step(ANSWER)], sandbox, max_parallel_calls=3)
    shown = responses_in(res.text)
    assert shown[0] == render_tool_result(ok("a")) and shown[2] == render_tool_result(ok("b"))
    assert shown[1].startswith("Failed to decode tool call: list indices must be integers")
    assert sandbox.max_running == 2
    assert (res.tool_calls, res.tool_errors, res.tool_failures) == (3, 0, 1)


def test_unknown_tool_and_bad_arguments_are_tool_errors(codec: Codec) -> None:
    unknown = '<tool_call>\n{"name": "run_bash", "arguments": {"cmd": "ls"}}\n</tool_call>'
    res, _ = rstar2(codec, [Step(unknown), Step(ANSWER)], ScriptedSandbox([]))
    assert responses_in(res.text) == ["Error when executing tool: 'run_bash'"]
    assert (res.tool_errors, res.tool_failures) == (1, 1)
    assert roc.tool_error_penalty(res.text) == 1.0
    bad_args = '<tool_call>\n{"name": "python_code_with_standard_io", "arguments": "print(1)"}\n</tool_call>'
    res, _ = rstar2(codec, [Step(bad_args), Step(ANSWER)], ScriptedSandbox([]))
    assert responses_in(res.text) == ["Error when executing tool: arguments must be a JSON object, got str"]


def test_a_timeout_is_a_failure_but_not_a_roc_error(codec: Codec) -> None:
    timeout = failed(stdout="Suicide from timeout.", reason="worker_timeout", cost=4.0)
    res, _ = rstar2(codec, [Step(CALL), Step(ANSWER)], ScriptedSandbox([timeout]))
    assert responses_in(res.text) == [
        "Tool call failure\nreason: worker_timeout\nstdout: Suicide from timeout.\nexecution time: 4.00s"
    ]
    assert (res.tool_errors, res.tool_failures) == (0, 1)


# ---------------------------------------------------------------- interrupted generation


def test_interrupted_generation_resumes_from_the_prefix_and_versions_switch_at_the_right_token(
    codec: Codec,
) -> None:
    steps = [
        Step("Let me think", finish="abort", version=3),
        Step(" about it.\n" + CALL, version=4),
        Step(" The tool", finish="abort", version=4),
        Step(" says 42. </reason> <answer> \\boxed{42} </answer>", version=5),
    ]
    res, engine = rstar2(codec, steps, ScriptedSandbox([ok("42\n")]), max_new_tokens=300)
    a, b, c, d = (o.output_ids for o in engine.outputs)
    tool = tool_ids(codec, OK42)
    assert engine.requests[1].input_ids == res.prompt_ids + a
    assert engine.requests[1].sampling.max_new_tokens == 300 - len(a)
    assert engine.requests[3].input_ids == res.prompt_ids + a + b + tool + c
    assert engine.requests[3].sampling.max_new_tokens == 300 - len(a + b + tool + c)
    assert res.response_ids == a + b + tool + c + d
    assert res.versions == [3] * len(a) + [4] * len(b) + [-1] * len(tool) + [4] * len(c) + [5] * len(d)
    assert res.loss_mask == [1] * len(a + b) + [0] * len(tool) + [1] * len(c + d)
    assert res.text.startswith("Let me think about it.\n" + CALL + "<|im_end|>")
    assert (res.num_turns, res.interrupts, res.finish_reason, res.tool_calls) == (2, 2, "stop", 1)


def test_aborts_without_tokens_are_retried_with_a_bound(codec: Codec) -> None:
    policy = ResumePolicy(max_empty=2, backoff_s=0.001)
    empty = Step(ids=[], finish="abort", version=1)
    res, engine = rstar2(codec, [empty, empty, Step(ANSWER, version=2)], ScriptedSandbox([]), resume=policy)
    assert (res.finish_reason, res.interrupts, len(engine.requests)) == ("stop", 2, 3)
    assert set(res.versions) == {2}
    res, engine = rstar2(
        codec, [Step("partial", finish="abort")] + [empty] * 3, ScriptedSandbox([]), resume=policy
    )
    assert (res.finish_reason, res.stop_cause, len(engine.requests)) == ("abort", "interrupted", 4)
    assert res.response_ids == codec.encode("partial")
    assert engine.steps == []


def test_total_resumes_are_bounded(codec: Codec) -> None:
    steps = [Step("x", finish="abort")] * 4
    res, engine = rstar2(codec, steps, ScriptedSandbox([]), resume=ResumePolicy(max_resumes=3))
    assert (res.finish_reason, res.interrupts, len(engine.requests)) == ("abort", 4, 4)


# ---------------------------------------------------------------- single-turn math and a real sandbox


def test_math_loop_is_one_turn_up_to_im_end_or_the_budget(codec: Codec) -> None:
    engine = ScriptedEngine(codec, [Step("3+4 = 7, so \\boxed{7}", version=7)])
    rollout = RolloutConfig(agent="math", max_new_tokens=64, temperature=0.7, top_p=0.9, top_k=20)
    res = asyncio.run(run_math(PROMPT, engine, codec, rollout))
    assert res.prompt_ids == codec.encode(templates.math_prompt(None, PROMPT.text))
    assert engine.requests[0].input_ids == res.prompt_ids
    s = engine.requests[0].sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_new_tokens) == (0.7, 0.9, 20, 64)
    assert res.text == "3+4 = 7, so \\boxed{7}<|im_end|>"
    assert res.loss_mask == [1] * len(res.response_ids) and set(res.versions) == {7}
    assert (res.finish_reason, res.stop_cause, res.num_turns, res.tool_calls) == ("stop", "end_of_turn", 1, 0)
    engine = ScriptedEngine(codec, [Step("a long answer that does not fit")])
    res = asyncio.run(run_math(PROMPT, engine, codec, msgspec.structs.replace(rollout, max_new_tokens=4)))
    assert (len(res.response_ids), res.finish_reason, res.stop_cause) == (4, "length", "budget")


def test_math_loop_resumes_an_interrupted_turn(codec: Codec) -> None:
    engine = ScriptedEngine(
        codec, [Step("so the", finish="abort", version=1), Step(" answer is 7", version=2)]
    )
    res = asyncio.run(run_math(PROMPT, engine, codec, RolloutConfig(max_new_tokens=64)))
    assert res.text == "so the answer is 7<|im_end|>"
    n = len(engine.outputs[0].output_ids)
    assert res.versions == [1] * n + [2] * (len(res.response_ids) - n)


def test_real_sandbox_runs_the_models_code(codec: Codec) -> None:
    from sandbox_bridge import LocalSandbox

    error_call = templates.tool_call_text("y = 1\nprint(x)")

    async def go() -> tuple[RolloutResult, RolloutResult]:
        async with LocalSandbox(max_workers=1, preload=()) as sb:
            good = await run_rstar2(
                PROMPT, ScriptedEngine(codec, [Step(CALL), Step(ANSWER)]), codec, sb, cfg()
            )
            bad = await run_rstar2(
                PROMPT, ScriptedEngine(codec, [Step(error_call), Step(ANSWER)]), codec, sb, cfg()
            )
            return good, bad

    good, bad = asyncio.run(go())
    (shown,) = responses_in(good.text)
    assert shown.startswith("Tool call success\nstdout: 42\n")
    assert (good.tool_errors, roc.tool_error_penalty(good.text)) == (0, 0.0)
    (shown,) = responses_in(bad.text)
    assert shown.startswith(
        "Tool call failure\nreason: \nstderr: NameError at line 2: name 'x' is not defined"
    )
    assert (bad.tool_errors, bad.tool_failures, roc.tool_error_penalty(bad.text)) == (1, 1, 1.0)


def test_codec_wraps_transformers_and_raw_tokenizers(codec: Codec) -> None:
    assert isinstance(codec, HFCodec)
    raw = as_codec(codec.tokenizer.backend_tokenizer)  # a bare tokenizers.Tokenizer
    text = templates.rstar2_prompt(None, "x") + CALL + "<|im_end|>" + templates.tool_turn([OK42])
    assert raw.encode(text) == codec.encode(text) and raw.decode(codec.encode(text)) == text
    assert codec.encode("<|im_end|>") == [codec.eos_id] == [raw.eos_id]
    assert codec.stop_ids == [codec.eos_id, codec.tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    assert as_codec(codec) is codec


def test_rstar2_needs_a_sandbox_and_consistent_engine_answers(codec: Codec) -> None:
    with pytest.raises(ValueError, match="sandbox"):
        asyncio.run(run_rstar2(PROMPT, ScriptedEngine(codec, []), codec, None, cfg()))

    class Broken(ScriptedEngine):
        async def generate(self, input_ids: list[int], sampling: Any, rid: str | None = None) -> Any:
            out = await super().generate(input_ids, sampling, rid)
            out.logprobs.pop()
            return out

    with pytest.raises(ValueError, match="log-probs"):
        asyncio.run(run_math(PROMPT, Broken(codec, [Step("hi")]), codec, cfg()))
