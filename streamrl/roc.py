"""Resample-on-Correct (RoC): rStar2-Agent's down-sampling of one rollout group, as pure functions.

Implemented: the released rStar2 code (`rstar2_agent/down_sample/reject_sampling.py` and `roc.py`,
after PR #50), one group at a time. Reference: `shared/reference/roc_and_grpo.md` section 1.

    select(rewards[N], texts[N], cfg) -> kept indices (ascending), [] when the group is dropped

1. Reject-equal (`reject_equal_reward`): a group whose rewards are all equal (all wrong or all
   right) is dropped. "Equal" is `torch.allclose(r[0], r)`: |r0 - ri| <= 1e-8 + 1e-5 * |ri|.
2. N < n drops the group; N == n keeps it whole (n = `down_sample_to_n`).
3. Negatives are rewards <= 0, positives > 0 (so 0/1 and -5/+5 rewards behave the same).
   Quotas zn = round(#neg * n / N), pn = round(#pos * n / N) with Python's banker's rounding.
4. If zn < min_zero and pn < min_non_zero the whole group (N indices) is kept. This is the
   reference behaviour and streamrl keeps it, but it is unreachable: the two rounded quotas sum to
   n - 1, n or n + 1, and `RocConfig` rejects min_zero + min_non_zero > n exactly as rStar2's config
   assert does, so the branch exists only for parity.
5. Otherwise the minimums override, in this order: if zn <= min(min_zero, #neg) then
   zn = min(min_zero, #neg), pn = n - zn; then if pn <= min(min_non_zero, #pos) then
   pn = min(min_non_zero, #pos), zn = n - pn. A negative minimum (rStar2's default -1) disables it.
6. Keep pn positives and zn negatives; a selection whose size is not n raises `ValueError` (the
   reference asserts). It can happen for odd n, e.g. N=30, n=15, 7 negatives: 4 + 12 = 16.

Penalties of a trajectory (range [0, 2]; `tool_error_penalty` + `answer_format_penalty`, each
enabled by `roc_error_ratio` / `roc_answer_format`) are computed from its decoded *response* text
with special tokens kept (`<|im_start|>`, `<|im_end|>`) and tool-response turns included.

Quirks of the reference and the options that choose them (defaults reproduce the reference):

- `count_first_turn=False`: the prompt ends with `<|im_start|>assistant\\n<reason>`, so the first
  assistant turn has no `<|im_start|>assistant` in the response text and is not counted; a correct
  answer without tool calls therefore gets 0.5 + 1.0 = 1.5 (the `num_turns == 0` branch), more
  than a clean answer whose only tool call failed (1.0 + 0.0). True adds 1 to the turn count (the first turn is counted whether
  or not it was closed by `<|im_end|>`), so that answer gets 0.5 + 0.0.
- `positive_selection="lowest_penalty"`: the pn positives with the lowest penalty, stable sort, so
  ties (very common: many traces have penalty 0) go to the lower index. "inverse_penalty" is the
  paper's description as reported by secondary sources: pn positives drawn without replacement
  with probability proportional to 1 / (penalty + `inverse_penalty_eps`), seeded. The default eps
  0.1 keeps the preference soft: a clean trace is (2 + 0.1) / 0.1 = 21x as likely to be drawn as a
  maximally penalised one; a tiny eps approaches "lowest penalty with random tie-breaking".
- `negative_selection="submission_order"`: the first zn negatives by index. The reference's batch
  order is submission order, and streamrl's caller sorts a group by sample index (never by
  completion order, which would favour short, fast failures), so this equals the reference.
  "shuffle" draws zn negatives uniformly without replacement, seeded.
- Seeded draws use `random.Random` seeded from (`seed`, `group_key`), so a group's selection does
  not depend on arrival order or on other groups; the caller passes a per-group key (its id).

Intentionally omitted or changed:

- rStar2's `filter_by_mask` truncates the kept batch to a multiple of the trainer world size,
  which can cut a group partially. streamrl batches whole groups, so this does not apply.
- The `do_down_sampling` master switch is `RocSection.enabled`, checked by the caller; the
  reference's `down_sample_to_n <= 0` ("metrics only") is rejected rather than supported.
- Penalties are computed only for positives, only when RoC has to choose among them, and with
  "lowest_penalty" only until pn positives of penalty 0 (the minimum) are found in index order; the
  reference computes them for every trajectory, but the skipped values cannot change the
  selection, so the result is identical. The patterns are matched with str.find rather than `re`,
  with identical matches.
- A NaN reward raises `ValueError` (the reference would put the trajectory in neither list).
- Metrics (`RocResult`) are per group; the reference's batch-level metric names are the buffer's.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from streamrl.errors import ConfigError

if TYPE_CHECKING:
    from streamrl.config import RocSection

__all__ = [
    "RocConfig",
    "RocResult",
    "answer_format_penalty",
    "penalty",
    "select",
    "select_with_stats",
    "tool_error_penalty",
]

PositiveSelection = Literal["lowest_penalty", "inverse_penalty"]
NegativeSelection = Literal["submission_order", "shuffle"]
DropReason = Literal["equal_reward", "too_small"]

# The reference's patterns, all with re.DOTALL:
#     r"<tool_response>.*?</tool_response>"   r"<answer>.*?</answer>"
#     r"<\|im_start\|>assistant.*?<\|im_end\|>"
# `_count_spans` and `tool_error_penalty` find exactly their `re.findall` matches with str.find
# (tests compare them with `re` on random texts), 2-4x faster than `re`'s lazy `.*?`.

# torch.allclose defaults, used by rStar2's reject-equal stage.
_RTOL = 1e-5
_ATOL = 1e-8


@dataclass(frozen=True, slots=True, kw_only=True)
class RocConfig:
    """RoC settings; the first six fields are rStar2's `down_sampling_config` names and values."""

    down_sample_to_n: int = 16
    reject_equal_reward: bool = True
    roc_error_ratio: bool = True
    roc_answer_format: bool = True
    min_zero_reward_trace_num: int = 2
    min_non_zero_reward_trace_num: int = 2
    count_first_turn: bool = False
    positive_selection: PositiveSelection = "lowest_penalty"
    negative_selection: NegativeSelection = "submission_order"
    seed: int = 0
    inverse_penalty_eps: float = 0.1

    def __post_init__(self) -> None:
        if self.down_sample_to_n < 1:
            raise ConfigError(f"roc.down_sample_to_n must be >= 1, got {self.down_sample_to_n}")
        mins = self.min_zero_reward_trace_num + self.min_non_zero_reward_trace_num
        if mins > self.down_sample_to_n:
            raise ConfigError(
                "roc.min_zero_reward_trace_num + roc.min_non_zero_reward_trace_num must be <= "
                f"roc.down_sample_to_n, got {self.min_zero_reward_trace_num} + "
                f"{self.min_non_zero_reward_trace_num} > {self.down_sample_to_n}"
            )
        if self.positive_selection not in ("lowest_penalty", "inverse_penalty"):
            raise ConfigError(f"roc.positive_selection: unknown value {self.positive_selection!r}")
        if self.negative_selection not in ("submission_order", "shuffle"):
            raise ConfigError(f"roc.negative_selection: unknown value {self.negative_selection!r}")
        if not self.inverse_penalty_eps > 0:
            raise ConfigError(f"roc.inverse_penalty_eps must be > 0, got {self.inverse_penalty_eps}")

    @classmethod
    def from_section(cls, section: RocSection) -> RocConfig:
        """Build from the job spec's `roc:` section (its `enabled` switch is the caller's)."""
        return cls(
            down_sample_to_n=section.down_sample_to_n,
            reject_equal_reward=section.reject_equal_reward,
            roc_error_ratio=section.roc_error_ratio,
            roc_answer_format=section.roc_answer_format,
            min_zero_reward_trace_num=section.min_zero_reward_trace_num,
            min_non_zero_reward_trace_num=section.min_non_zero_reward_trace_num,
            count_first_turn=section.count_first_turn,
            positive_selection=section.positive_selection,
            negative_selection=section.negative_selection,
            seed=section.seed,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RocResult:
    """What RoC did to one group, for the buffer's metrics (keep-rate, penalties)."""

    kept: list[int]
    """Kept indices, ascending; empty when the group is dropped."""
    dropped: DropReason | None
    """Why the whole group was dropped, or None."""
    group_size: int
    """N, the group size before RoC."""
    num_pos: int
    """Positives (reward > 0) in the group."""
    num_neg: int
    """Negatives (reward <= 0) in the group."""
    kept_pos: int
    kept_neg: int
    whole_group: bool
    """Kept without selection (N == n, or the both-quotas-under-minimum branch)."""
    penalties: dict[int, float] = field(default_factory=dict)
    """Penalties computed, by index: only positives, only when RoC chose among them (otherwise
    empty), and with "lowest_penalty" only up to the pn-th positive of penalty 0 in index order.
    Every kept positive is included."""


# ---------------------------------------------------------------- penalties


def _count_spans(text: str, open_tag: str, close_tag: str) -> int:
    """Number of matches of `open_tag.*?close_tag` (DOTALL), like `len(re.findall(...))`.

    The leftmost open tag followed by a close tag starts the next match, which ends at the first
    close tag after it; if the leftmost open tag has no close tag after it, no later one has.
    """
    count = pos = 0
    while (start := text.find(open_tag, pos)) >= 0:
        close = text.find(close_tag, start + len(open_tag))
        if close < 0:
            break
        count += 1
        pos = close + len(close_tag)
    return count


def tool_error_penalty(text: str) -> float:
    """Share of `<tool_response>` blocks containing "error" (any case); 0.5 when there is none.

    Only the literal substring counts: a timeout (`Tool call failure\\nreason: worker_timeout...`)
    is not an error, while stdout printing "relative error" is.
    """
    matches = errors = pos = 0
    while (start := text.find("<tool_response>", pos)) >= 0:
        close = text.find("</tool_response>", start + 15)
        if close < 0:
            break
        matches += 1
        pos = close + 16
        errors += "error" in text[start:pos].lower()
    if not matches:
        return 0.5
    return errors / matches


def answer_format_penalty(text: str, count_first_turn: bool = False) -> float:
    """rStar2's `answer_tag_repetition`: min((#closed <answer> blocks - 1) / #turns, 1).

    1.0 when `<answer>` or `</answer>` is missing, when the open/close counts differ from the number
    of closed blocks, or when no assistant turn is counted. Turns are
    `<|im_start|>assistant ... <|im_end|>` spans of the response text; with `count_first_turn`
    the count is that plus 1 (the first turn starts inside the prompt).
    """
    # Same outcome as the reference's order of checks (tags absent; counts != closed blocks).
    opened = text.count("<answer>")
    if opened == 0 or text.count("</answer>") != opened:
        return 1.0
    closed = _count_spans(text, "<answer>", "</answer>")
    if closed != opened:
        return 1.0
    num_turns = _count_spans(text, "<|im_start|>assistant", "<|im_end|>") + int(count_first_turn)
    if num_turns == 0:
        return 1.0
    return min((closed - 1) / num_turns, 1.0)


def penalty(text: str, cfg: RocConfig) -> float:
    """The RoC penalty of one trajectory under `cfg`, in [0, 2] (0 when both terms are off)."""
    p = 0.0
    if cfg.roc_error_ratio:
        p += tool_error_penalty(text)
    if cfg.roc_answer_format:
        p += answer_format_penalty(text, cfg.count_first_turn)
    return p


# ---------------------------------------------------------------- selection


def _all_close(rewards: Sequence[float]) -> bool:
    r0 = rewards[0]
    return all(abs(r0 - r) <= _ATOL + _RTOL * abs(r) for r in rewards)


def _rng(cfg: RocConfig, group_key: int) -> random.Random:
    mask = (1 << 64) - 1
    return random.Random(((cfg.seed & mask) << 64) | (group_key & mask))


def select_with_stats(
    rewards: Sequence[float],
    texts: Sequence[str],
    cfg: RocConfig,
    *,
    group_key: int = 0,
) -> RocResult:
    """RoC on one group, with counts for metrics. See the module docstring for the rules.

    rewards: [N] summed reward per trajectory; texts: [N] decoded response texts, both ordered by
    sample (submission) index. group_key: mixed into `cfg.seed` for the seeded options.
    """
    n_total = len(rewards)
    if len(texts) != n_total:
        raise ValueError(f"RoC needs one text per reward, got {n_total} rewards and {len(texts)} texts")
    if any(r != r for r in rewards):
        raise ValueError(f"RoC got a NaN reward: {list(rewards)}")
    neg = [i for i, r in enumerate(rewards) if r <= 0]
    pos = [i for i, r in enumerate(rewards) if r > 0]
    n = cfg.down_sample_to_n

    def whole(kept: list[int], dropped: DropReason | None = None) -> RocResult:
        k = bool(kept)
        return RocResult(
            kept=kept,
            dropped=dropped,
            group_size=n_total,
            num_pos=len(pos),
            num_neg=len(neg),
            kept_pos=len(pos) if k else 0,
            kept_neg=len(neg) if k else 0,
            whole_group=k,
        )

    if n_total and cfg.reject_equal_reward and _all_close(rewards):
        return whole([], "equal_reward")
    if n_total < n:
        return whole([], "too_small")
    if n_total == n:
        return whole(list(range(n)))

    min_zero = cfg.min_zero_reward_trace_num
    min_pos = cfg.min_non_zero_reward_trace_num
    zn = round(len(neg) * n / n_total)
    pn = round(len(pos) * n / n_total)
    if zn < min_zero and pn < min_pos:
        return whole(list(range(n_total)))
    if zn <= min(min_zero, len(neg)):
        zn = min(min_zero, len(neg))
        pn = n - zn
    if pn <= min(min_pos, len(pos)):
        pn = min(min_pos, len(pos))
        zn = n - pn

    # Slices below are the reference's `pairs[:quota]`, negative quotas included (only reachable
    # with negative minimums, and then the size check fails as the reference's assert does).
    rng: random.Random | None = None
    penalties: dict[int, float] = {}
    if pn >= len(pos):
        kept_pos = pos
    elif cfg.positive_selection == "lowest_penalty":
        # Stable ascending sort, ties keep index order. 0 is the lowest penalty, so once pn
        # positives with penalty 0 are found (in index order) they are the answer.
        clean: list[int] = []
        for i in pos:
            p = penalties[i] = penalty(texts[i], cfg)
            if p == 0.0 and len(clean) < pn:
                clean.append(i)
                if len(clean) == pn:
                    break
        kept_pos = clean if len(clean) == pn else sorted(pos, key=penalties.__getitem__)[:pn]
    else:
        penalties = {i: penalty(texts[i], cfg) for i in pos}
        rng = _rng(cfg, group_key)
        eps = cfg.inverse_penalty_eps
        # Efraimidis-Spirakis: the pn smallest Exp(1) / weight keys are a draw without
        # replacement with probability proportional to weight = 1 / (penalty + eps).
        keys = {i: rng.expovariate(1.0) * (penalties[i] + eps) for i in pos}
        kept_pos = sorted(pos, key=keys.__getitem__)[:pn]
    if zn >= len(neg):
        kept_neg = neg
    elif cfg.negative_selection == "submission_order":
        kept_neg = neg[:zn]
    else:
        rng = rng or _rng(cfg, group_key)
        kept_neg = rng.sample(neg, len(neg[:zn]))

    if len(kept_pos) + len(kept_neg) != n:
        raise ValueError(
            f"RoC selected {len(kept_pos)} positives + {len(kept_neg)} negatives = "
            f"{len(kept_pos) + len(kept_neg)} trajectories, expected down_sample_to_n={n} "
            f"(group of N={n_total} with {len(pos)} positives and {len(neg)} negatives, "
            f"quotas pn={pn} zn={zn}; rounding can do this when n is odd)"
        )
    return RocResult(
        kept=sorted(kept_pos + kept_neg),
        dropped=None,
        group_size=n_total,
        num_pos=len(pos),
        num_neg=len(neg),
        kept_pos=len(kept_pos),
        kept_neg=len(kept_neg),
        whole_group=False,
        penalties=penalties,
    )


def select(
    rewards: Sequence[float],
    texts: Sequence[str],
    cfg: RocConfig,
    *,
    group_key: int = 0,
) -> list[int]:
    """Kept indices of one group, ascending; [] when the group is dropped.

    rewards: [N] summed reward per trajectory; texts: [N] decoded response texts (special tokens
    kept), both ordered by sample index. Raises ValueError when the selection size is not n.
    """
    return select_with_stats(rewards, texts, cfg, group_key=group_key).kept
