"""The learner role: what it reports about each batch, and (slow) a real run of every role with a
hf learner: steps, weight pushes that reach the engine, checkpoints paired with buffer snapshots,
and a resume that continues after the latest checkpoint without training any group twice."""

from __future__ import annotations

from streamrl import messages as m
from workers.learner import batch_stats


def traj(
    i: int, reward: float, versions: list[int], mask: list[int], calls: int = 0, errors: int = 0
) -> m.Trajectory:
    return m.Trajectory(
        sample_index=i,
        tokens=m.pack("tokens", [5] * len(mask)),
        loss_mask=m.pack("loss_mask", mask),
        logprobs=m.pack("logprobs", [-0.1] * len(mask)),
        versions=m.pack("versions", versions),
        reward=reward,
        finish_reason="length" if i == 0 else "stop",
        tool_calls=calls,
        tool_errors=errors,
    )


def test_batch_stats_reports_reward_accuracy_staleness_token_lag_and_tools() -> None:
    g1 = m.Group(
        uid=1,
        prompt_id="a",
        admitted_version=3,
        generator="g",
        prompt_tokens=m.pack("prompt_tokens", [1]),
        trajectories=[
            traj(0, 1.0, [3, 3, -1, 4], [1, 1, 0, 1], calls=2, errors=1),
            traj(1, 0.0, [4, 4], [1, 1]),
        ],
    )
    g2 = m.Group(
        uid=2,
        prompt_id="b",
        admitted_version=4,
        generator="g",
        prompt_tokens=m.pack("prompt_tokens", [1]),
        trajectories=[traj(0, -5.0, [4], [1]), traj(1, 5.0, [4, 4, 4], [1, 1, 1], calls=1)],
    )
    batch = m.Batch(step=5, policy_version=5, groups=[g1, g2], advantages=[m.pack("advantages", [0, 0])] * 2)
    s = batch_stats(batch)
    assert s["reward_mean"] == (1.0 + 0.0 - 5.0 + 5.0) / 4
    assert s["accuracy"] == 0.5  # positive rewards: 1.0 and 5.0
    assert s["response_len_mean"] == (4 + 2 + 1 + 3) / 4
    assert s["staleness"] == {"2": 1, "1": 1} and s["staleness_mean"] == 1.5
    # model tokens only: versions 3,3,4 | 4,4 | 4 | 4,4,4 -> lags 2,2,1,1,1,1,1,1,1
    assert abs(s["token_lag_mean"] - 11 / 9) < 1e-12
    assert s["tool_calls_mean"] == 3 / 4 and s["tool_success_rate"] == 2 / 3
    assert s["truncated_frac"] == 0.5
