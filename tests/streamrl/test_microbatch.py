"""streamrl.microbatch on hand-made Batches: token alignment, DP split, packing, step counts."""

from __future__ import annotations

import pytest
import torch

from streamrl import messages as m
from streamrl.microbatch import build_micro_batches, loss_token_count, micro_batch_count, plan_micro_batches


def traj(
    i: int, tokens: list[int], mask: list[int], logprobs: list[float] | None = None, version: int = 3
) -> m.Trajectory:
    return m.Trajectory(
        sample_index=i,
        tokens=m.pack("tokens", tokens),
        loss_mask=m.pack("loss_mask", mask),
        logprobs=m.pack("logprobs", logprobs if logprobs is not None else [-0.5] * len(tokens)),
        versions=m.pack("versions", [version if k else -1 for k in mask]),
        reward=1.0,
        finish_reason="stop",
    )


def group(uid: int, prompt: list[int], trajs: list[m.Trajectory]) -> m.Group:
    return m.Group(
        uid=uid,
        prompt_id=f"p{uid}",
        admitted_version=0,
        generator="g",
        prompt_tokens=m.pack("prompt_tokens", prompt),
        trajectories=trajs,
    )


def batch(groups: list[m.Group], advantages: list[list[float]]) -> m.Batch:
    return m.Batch(
        step=1, policy_version=3, groups=groups, advantages=[m.pack("advantages", a) for a in advantages]
    )


def lengths_batch(lengths: list[int]) -> m.Batch:
    """One group per sequence; sequence k is prompt [k] + (length-1) tokens, all of them loss tokens."""
    groups = [group(k, [k], [traj(0, [100 + k] * (n - 1), [1] * (n - 1))]) for k, n in enumerate(lengths)]
    return batch(groups, [[1.0]] * len(lengths))


def ids_of(mbs: list) -> list[list[int]]:
    """The sequence ids (first token) of each micro-batch's rows."""
    return [mb.input_ids[:, 0].tolist() for mb in mbs]


def test_each_trajectory_becomes_prompt_plus_response_with_per_token_tensors_aligned() -> None:
    # trajectory 0: model 11, 12, tool 13, model 14 | trajectory 1: model 21
    t0 = traj(0, [11, 12, 13, 14], [1, 1, 0, 1], [-0.1, -0.2, 0.7, -0.4], version=5)
    t1 = traj(1, [21], [1], [-0.9], version=6)
    b = batch([group(1, [7, 8], [t0, t1])], [[2.5, -1.5]])
    (mb,) = build_micro_batches(b, max_tokens=64)
    assert mb.input_ids.tolist() == [[7, 8, 11, 12, 13, 14], [7, 8, 21, 0, 0, 0]]
    assert mb.input_ids.dtype == torch.int64
    assert mb.attention_mask.tolist() == [[True] * 6, [True] * 3 + [False] * 3]
    assert mb.loss_mask.tolist() == [[0, 0, 1, 1, 0, 1], [0, 0, 1, 0, 0, 0]]
    torch.testing.assert_close(
        mb.old_logprobs, torch.tensor([[0, 0, -0.1, -0.2, 0, -0.4], [0, 0, -0.9, 0, 0, 0]])
    )  # the tool token's 0.7 is dropped: off-mask entries are 0
    assert mb.advantages.tolist() == [[0, 0, 2.5, 2.5, 0, 2.5], [0, 0, -1.5, 0, 0, 0]]
    assert mb.versions.tolist() == [[-1, -1, 5, 5, -1, 5], [-1, -1, 6, -1, -1, -1]]
    assert mb.versions.dtype == torch.int32 and mb.loss_mask.dtype == torch.float32
    assert mb.prox_logprobs is None and mb.num_tokens == 9 and mb.num_loss_tokens == 4.0
    assert loss_token_count(b) == 4


def test_packing_keeps_rows_times_length_within_max_tokens_and_isolates_long_sequences() -> None:
    b = lengths_batch([10, 8, 25, 6, 3])  # sequence ids 0..4
    mbs = build_micro_batches(b, max_tokens=20)
    assert ids_of(mbs) == [[2], [0, 1], [3, 4]]  # decreasing length; 25 alone; 3*10 > 20 starts a new one
    assert [tuple(mb.input_ids.shape) for mb in mbs] == [(1, 25), (2, 10), (2, 6)]
    assert micro_batch_count(b, 20) == 3
    assert ids_of(build_micro_batches(b, max_tokens=1000)) == [[2, 0, 1, 3, 4]]


def test_sequences_are_split_over_ranks_balanced_by_tokens_each_exactly_once() -> None:
    b = lengths_batch([10, 8, 6, 3, 3])
    # longest first to the lightest rank: 10->r0, 8->r1, 6->r1 (14), 3->r0 (13), 3->r0 (16)
    r0 = build_micro_batches(b, max_tokens=100, dp_rank=0, dp_size=2)
    r1 = build_micro_batches(b, max_tokens=100, dp_rank=1, dp_size=2)
    assert ids_of(r0) == [[0, 3, 4]] and ids_of(r1) == [[1, 2]]
    assert sum(mb.num_tokens for mb in r0) == 16 and sum(mb.num_tokens for mb in r1) == 14
    assert micro_batch_count(b, 100, dp_size=2) == 2
    assert ids_of(build_micro_batches(b, max_tokens=100, dp_rank=0, dp_size=2)) == ids_of(r0)  # deterministic


def test_a_rank_without_sequences_gets_no_micro_batches() -> None:
    b = lengths_batch([4, 4])
    assert [len(build_micro_batches(b, 100, dp_rank=r, dp_size=3)) for r in range(3)] == [1, 1, 0]
    assert micro_batch_count(b, 100, dp_size=3) == 2


def test_plan_covers_every_trajectory_of_every_group() -> None:
    t = [traj(i, [1] * (i + 1), [1] * (i + 1)) for i in range(4)]
    b = batch([group(1, [5], t[:2]), group(2, [6, 6], t[2:])], [[1.0, 2.0], [3.0, 4.0]])
    plan = plan_micro_batches(b, max_tokens=6, dp_size=2)
    seen = sorted((s.group, s.traj) for rank in plan for mb in rank for s in mb)
    assert seen == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert loss_token_count(b) == 1 + 2 + 3 + 4


def test_a_batch_whose_advantages_do_not_match_its_trajectories_is_refused() -> None:
    b = batch([group(9, [1], [traj(0, [2], [1]), traj(1, [3], [1])])], [[1.0]])
    with pytest.raises(ValueError, match="group 9: 1 advantages for 2 trajectories"):
        build_micro_batches(b, 16)
    with pytest.raises(ValueError, match="dp_rank 2"):
        build_micro_batches(lengths_batch([3]), 16, dp_rank=2, dp_size=2)
