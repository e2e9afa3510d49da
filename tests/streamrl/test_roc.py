"""RoC parity with rStar2's released down-sampling (shared/reference/roc_and_grpo.md section 1)."""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Sequence

import pytest

from streamrl.config import RocSection
from streamrl.errors import ConfigError
from streamrl.roc import (
    RocConfig,
    answer_format_penalty,
    penalty,
    select,
    select_with_stats,
    tool_error_penalty,
)

# ---------------------------------------------------------------- realistic rStar2 response texts
# The prompt ends with "<|im_start|>assistant\n<reason>", so a response text starts inside the
# first assistant turn. Each tool round closes the turn, adds a user turn with the tool response
# and opens a new assistant turn.

CALL = (
    '<tool_call>\n{"name": "python_code_with_standard_io", '
    '"arguments": {"code": "print(2 + 2)", "input": ""}}\n</tool_call>'
)


def tool_round(output: str) -> str:
    return (
        f"{CALL}<|im_end|>\n<|im_start|>user\n<tool_response>\n{output}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<reason>"
    )


def answer(value: str = "4") -> str:
    return f"<answer>\nThe result is \\boxed{{{value}}}.\n</answer>"


NO_TOOL = f"2 + 2 = 4.</reason>\n{answer()}<|im_end|>"
ONE_OK_TOOL = (
    f"Let me check with Python.\n{tool_round('4')}The tool printed 4.</reason>\n{answer()}<|im_end|>"
)
ONE_FAILING_TOOL = (
    "Let me check with Python.\n"
    + tool_round('Traceback (most recent call last):\nNameError at line 1: name "x" is not defined')
    + f"I will do it by hand: 4.</reason>\n{answer()}<|im_end|>"
)
TWO_ANSWERS_ONE_TOOL = (
    f"Probably 3.</reason>\n{answer('3')}\n{tool_round('4')}Corrected.</reason>\n{answer()}<|im_end|>"
)
TIMEOUT = "Tool call failure\nreason: worker_timeout\nstdout: Suicide from timeout."


def test_synthetic_penalties_match_the_reference_values():
    cfg = RocConfig()
    assert penalty(NO_TOOL, cfg) == 1.5
    assert penalty(ONE_OK_TOOL, cfg) == 0.0
    assert penalty(ONE_FAILING_TOOL, cfg) == 1.0
    assert penalty(TWO_ANSWERS_ONE_TOOL, cfg) == 1.0


def test_no_tool_answer_gets_both_half_error_and_full_format_penalty():
    assert tool_error_penalty(NO_TOOL) == 0.5
    assert answer_format_penalty(NO_TOOL) == 1.0


def test_counting_the_first_turn_removes_the_format_penalty_of_a_clean_no_tool_answer():
    cfg = RocConfig(count_first_turn=True)
    assert answer_format_penalty(NO_TOOL, count_first_turn=True) == 0.0
    assert penalty(NO_TOOL, cfg) == 0.5
    assert penalty(ONE_OK_TOOL, cfg) == 0.0
    # Two answers over two counted turns: (2 - 1) / 2.
    assert penalty(TWO_ANSWERS_ONE_TOOL, cfg) == 0.5


def test_penalty_terms_can_be_switched_off():
    assert penalty(NO_TOOL, RocConfig(roc_error_ratio=False)) == 1.0
    assert penalty(NO_TOOL, RocConfig(roc_answer_format=False)) == 0.5
    assert penalty(NO_TOOL, RocConfig(roc_error_ratio=False, roc_answer_format=False)) == 0.0


def test_answer_format_penalty_is_full_for_missing_or_unbalanced_answer_tags():
    assert answer_format_penalty(f"{tool_round('4')}No answer.<|im_end|>") == 1.0
    assert answer_format_penalty(f"{tool_round('4')}<answer>4<|im_end|>") == 1.0
    assert answer_format_penalty(f"{tool_round('4')}<answer>4</answer> <answer>5<|im_end|>") == 1.0
    assert answer_format_penalty(f"{tool_round('4')}<answer>4</answer></answer><|im_end|>") == 1.0


REF_TOOL_RESPONSE = re.compile(r"<tool_response>.*?</tool_response>", re.DOTALL)
REF_ANSWER = re.compile(r"<answer>.*?</answer>", re.DOTALL)
REF_TURN = re.compile(r"<\|im_start\|>assistant.*?<\|im_end\|>", re.DOTALL)


def reference_error_ratio(text: str) -> float:
    matches = REF_TOOL_RESPONSE.findall(text)
    if not matches:
        return 0.5
    return len([m for m in matches if "error" in m.lower()]) / len(matches)


def reference_answer_format(text: str) -> float:
    tags = ["<answer>", "</answer>"]
    if any(tag not in text for tag in tags):
        return 1.0
    closed = len(REF_ANSWER.findall(text))
    if any(text.count(tag) != closed for tag in tags):
        return 1.0
    num_turns = len(REF_TURN.findall(text))
    if num_turns == 0:
        return 1.0
    return min((closed - 1) / num_turns, 1.0)


def test_penalties_equal_the_reference_regex_code_on_random_texts():
    pieces = [
        "<tool_response>",
        "</tool_response>",
        "Error",
        "err",
        "or",
        "<answer>",
        "</answer>",
        "<|im_start|>assistant",
        "<|im_start|>user",
        "<|im_end|>",
        "\n",
        "x",
    ]
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        assert tool_error_penalty(text) == reference_error_ratio(text), text
        assert answer_format_penalty(text) == reference_answer_format(text), text


def test_timeout_is_not_a_tool_error():
    assert tool_error_penalty(f"x{tool_round(TIMEOUT)}{answer()}<|im_end|>") == 0.0


def test_error_substring_anywhere_in_a_tool_response_counts_in_any_case():
    assert tool_error_penalty(tool_round("max relative error: 1e-9")) == 1.0
    assert tool_error_penalty(tool_round("Error when executing tool: unknown tool 'foo'")) == 1.0
    assert tool_error_penalty(tool_round("ERROR")) == 1.0
    assert tool_error_penalty(tool_round("Failed to decode tool call: Expecting ',' delimiter")) == 0.0


def test_tool_error_penalty_is_the_share_of_failing_tool_responses():
    text = tool_round("ValueError: bad") + tool_round("4") + tool_round(TIMEOUT) + tool_round("5")
    assert tool_error_penalty(text) == 0.25


# ---------------------------------------------------------------- selection

# (zn, pn) for z = 1..31 negatives, N=32, n=16, minimums 2 (section 1.3).
QUOTA_TABLE = {
    1: (1, 15), 2: (2, 14), 3: (2, 14), 4: (2, 14), 5: (2, 14), 6: (3, 13), 7: (4, 12), 8: (4, 12),
    9: (4, 12), 10: (5, 11), 11: (6, 10), 12: (6, 10), 13: (6, 10), 14: (7, 9), 15: (8, 8), 16: (8, 8),
    17: (8, 8), 18: (9, 7), 19: (10, 6), 20: (10, 6), 21: (10, 6), 22: (11, 5), 23: (12, 4), 24: (12, 4),
    25: (12, 4), 26: (13, 3), 27: (14, 2), 28: (14, 2), 29: (14, 2), 30: (14, 2), 31: (15, 1),
}  # fmt: skip


def spread_rewards(num_neg: int, total: int = 32, pos: float = 1.0, neg: float = 0.0) -> list[float]:
    """num_neg negatives scattered over the group (i * 7 mod 32 is a permutation)."""
    return [neg if (i * 7) % total < num_neg else pos for i in range(total)]


def kept_counts(rewards: Sequence[float], kept: list[int]) -> tuple[int, int]:
    return sum(rewards[i] <= 0 for i in kept), sum(rewards[i] > 0 for i in kept)


@pytest.mark.parametrize("num_neg", sorted(QUOTA_TABLE))
def test_quota_table_for_32_to_16_with_minimums_of_two(num_neg):
    rewards = spread_rewards(num_neg)
    kept = select(rewards, [ONE_OK_TOOL] * 32, RocConfig())
    assert len(kept) == 16
    assert kept == sorted(set(kept))
    assert kept_counts(rewards, kept) == QUOTA_TABLE[num_neg]


def test_plus_minus_five_rewards_select_like_one_and_zero():
    cfg = RocConfig()
    texts = [NO_TOOL, ONE_OK_TOOL, ONE_FAILING_TOOL, TWO_ANSWERS_ONE_TOOL] * 8
    for num_neg in (1, 7, 16, 27):
        binary = select(spread_rewards(num_neg), texts, cfg)
        assert select(spread_rewards(num_neg, pos=5.0, neg=-5.0), texts, cfg) == binary


def test_all_wrong_and_all_right_groups_are_dropped():
    for value in (0.0, 1.0, -5.0, 5.0):
        res = select_with_stats([value] * 32, [ONE_OK_TOOL] * 32, RocConfig())
        assert res.kept == []
        assert res.dropped == "equal_reward"


def test_rewards_equal_within_float_tolerance_count_as_equal():
    assert select([1.0] * 31 + [1.0 + 1e-9], [ONE_OK_TOOL] * 32, RocConfig()) == []
    assert select([1.0] * 31 + [1.001], [ONE_OK_TOOL] * 32, RocConfig()) != []


def test_without_reject_equal_an_all_correct_group_is_down_sampled_by_penalty():
    texts = [NO_TOOL, ONE_OK_TOOL] * 16
    kept = select([1.0] * 32, texts, RocConfig(reject_equal_reward=False))
    assert kept == list(range(1, 32, 2))


def test_group_smaller_than_target_is_dropped():
    rewards = spread_rewards(5, total=15)
    res = select_with_stats(rewards, [ONE_OK_TOOL] * 15, RocConfig())
    assert res.kept == []
    assert res.dropped == "too_small"


def test_group_of_exactly_the_target_size_is_kept_whole():
    rewards = spread_rewards(3, total=16)
    res = select_with_stats(rewards, [NO_TOOL] * 16, RocConfig())
    assert res.kept == list(range(16))
    assert res.whole_group
    assert (res.kept_neg, res.kept_pos) == (3, 13)


def test_positives_with_lowest_penalty_win_and_ties_go_to_the_earlier_index():
    # 6 positives (even indices) and 6 negatives (odd); n=6 keeps 3 + 3.
    rewards = [1.0, 0.0] * 6
    pos_texts = [ONE_OK_TOOL, NO_TOOL, ONE_OK_TOOL, ONE_FAILING_TOOL, ONE_OK_TOOL, ONE_OK_TOOL]
    neg_texts = [NO_TOOL, NO_TOOL, NO_TOOL, ONE_OK_TOOL, ONE_OK_TOOL, ONE_OK_TOOL]
    texts = [t for pair in zip(pos_texts, neg_texts, strict=True) for t in pair]
    res = select_with_stats(rewards, texts, RocConfig(down_sample_to_n=6))
    # Clean positives at 0, 4, 8, 10: the first three win. Negatives: first three by index,
    # whatever their penalty.
    assert res.kept == [0, 1, 3, 4, 5, 8]
    # The third penalty-0 positive settles it: index 10 is never scored.
    assert res.penalties == {0: 0.0, 2: 1.5, 4: 0.0, 6: 1.0, 8: 0.0}


def test_lowest_penalty_sorts_all_positives_when_too_few_are_clean():
    rewards = [1.0, 0.0] * 6
    pos_texts = [NO_TOOL, ONE_FAILING_TOOL, TWO_ANSWERS_ONE_TOOL, ONE_OK_TOOL, NO_TOOL, ONE_FAILING_TOOL]
    texts = [t for p in pos_texts for t in (p, NO_TOOL)]
    res = select_with_stats(rewards, texts, RocConfig(down_sample_to_n=6))
    # Penalties 1.5, 1.0, 1.0, 0.0, 1.5, 1.0 at 0, 2, 4, 6, 8, 10: keep 6, then 2 and 4.
    assert [i for i in res.kept if rewards[i] > 0] == [2, 4, 6]
    assert len(res.penalties) == 6


def test_negative_texts_are_never_read():
    class PositivesOnly(list):
        def __init__(self, items: list[str], rewards: list[float]) -> None:
            super().__init__(items)
            self.rewards = rewards

        def __getitem__(self, i):  # type: ignore[override]
            assert self.rewards[i] > 0, f"read the text of negative {i}"
            return super().__getitem__(i)

    rewards = spread_rewards(10)
    texts = PositivesOnly([NO_TOOL, ONE_OK_TOOL] * 16, rewards)
    assert len(select(rewards, texts, RocConfig())) == 16


def test_odd_target_where_quotas_overshoot_raises_with_the_numbers():
    rewards = spread_rewards(7, total=30)
    with pytest.raises(ValueError, match=r"16 trajectories, expected down_sample_to_n=15"):
        select(rewards, [ONE_OK_TOOL] * 30, RocConfig(down_sample_to_n=15))


def test_minimum_override_repairs_quotas_that_round_down_together():
    # N=30, n=15, 5 negatives: round(2.5) + round(12.5) = 2 + 12 = 14; the negative minimum
    # (zn <= 2) resets pn to 15 - 2 = 13.
    rewards = spread_rewards(5, total=30)
    kept = select(rewards, [ONE_OK_TOOL] * 30, RocConfig(down_sample_to_n=15))
    assert kept_counts(rewards, kept) == (2, 13)


@pytest.mark.parametrize(
    ("option", "value"), [("negative_selection", "shuffle"), ("positive_selection", "inverse_penalty")]
)
def test_seeded_options_are_reproducible_vary_with_the_seed_and_keep_quotas(option, value):
    rewards = spread_rewards(12)
    texts = [ONE_OK_TOOL] * 32  # equal penalties: only the random draw decides
    outcomes = set()
    for seed in range(8):
        cfg = RocConfig(seed=seed, **{option: value})
        kept = select(rewards, texts, cfg, group_key=3)
        assert select(rewards, texts, cfg, group_key=3) == kept
        assert kept_counts(rewards, kept) == QUOTA_TABLE[12]
        outcomes.add(tuple(kept))
    assert len(outcomes) > 1
    baseline = select(rewards, texts, RocConfig())
    assert outcomes != {tuple(baseline)}


def test_group_key_decorrelates_groups_with_the_same_seed():
    rewards = spread_rewards(12)
    cfg = RocConfig(negative_selection="shuffle", seed=1)
    draws = {tuple(select(rewards, [ONE_OK_TOOL] * 32, cfg, group_key=k)) for k in range(8)}
    assert len(draws) > 1


def test_inverse_penalty_sampling_prefers_clean_positives():
    # 16 positives: 8 clean (penalty 0), 8 penalised (1.5); 16 negatives; 8 positives kept.
    rewards = [1.0] * 16 + [0.0] * 16
    texts = [ONE_OK_TOOL, NO_TOOL] * 8 + [NO_TOOL] * 16
    cfg = RocConfig(positive_selection="inverse_penalty")
    picks: Counter[str] = Counter()
    for key in range(100):
        for i in select(rewards, texts, cfg, group_key=key):
            if i < 16:
                picks["clean" if i % 2 == 0 else "penalised"] += 1
    assert picks["clean"] + picks["penalised"] == 800
    # Weights 1/0.1 vs 1/1.6: clean traces fill most, but not all, of the 8 slots.
    assert 600 < picks["clean"] < 800


def test_stats_report_group_composition_and_kept_counts():
    rewards = spread_rewards(7)
    res = select_with_stats(rewards, [ONE_OK_TOOL] * 32, RocConfig())
    assert (res.group_size, res.num_neg, res.num_pos) == (32, 7, 25)
    assert (res.kept_neg, res.kept_pos) == (4, 12)
    assert res.dropped is None
    assert not res.whole_group
    kept_pos = [i for i in res.kept if rewards[i] > 0]
    assert set(kept_pos) <= res.penalties.keys() <= {i for i, r in enumerate(rewards) if r > 0}


def test_minimums_above_the_target_size_are_rejected_like_the_reference_assert():
    with pytest.raises(ConfigError, match="min_zero_reward_trace_num"):
        RocConfig(down_sample_to_n=3, min_zero_reward_trace_num=2, min_non_zero_reward_trace_num=2)


def test_config_is_built_from_the_job_spec_section():
    section = RocSection(
        enabled=True,
        down_sample_to_n=8,
        min_zero_reward_trace_num=1,
        count_first_turn=True,
        positive_selection="inverse_penalty",
        negative_selection="shuffle",
        seed=7,
    )
    cfg = RocConfig.from_section(section)
    assert cfg == RocConfig(
        down_sample_to_n=8,
        min_zero_reward_trace_num=1,
        count_first_turn=True,
        positive_selection="inverse_penalty",
        negative_selection="shuffle",
        seed=7,
    )
    assert RocConfig.from_section(RocSection()) == RocConfig()


def test_mismatched_texts_and_nan_rewards_are_rejected():
    with pytest.raises(ValueError, match="one text per reward"):
        select([1.0, 0.0], [NO_TOOL], RocConfig())
    with pytest.raises(ValueError, match="NaN"):
        select([1.0, float("nan")] * 16, [NO_TOOL] * 32, RocConfig())
