"""GRPO advantages (verl / RLinf semantics) and token-weighted whitening."""

from __future__ import annotations

import math

import numpy as np
import pytest

from streamrl.advantages import grpo_advantages, whiten


def test_grpo_uses_unbiased_std_and_eps():
    adv = grpo_advantages(np.array([1.0, 0.0, 0.0, 1.0]))
    # mean 0.5, unbiased std sqrt(1/3) = 0.57735; population std (0.5) would give +-1.
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert adv.dtype == np.float32
    assert adv.shape == (4,)
    np.testing.assert_allclose(adv, [expected, -expected, -expected, expected], rtol=1e-6)
    assert abs(adv[0] - 0.866) < 1e-3


def test_grpo_one_correct_out_of_four():
    adv = grpo_advantages(np.array([0.0, 0.0, 1.0, 0.0]))
    std = math.sqrt((3 * 0.25**2 + 0.75**2) / 3)  # 0.5
    np.testing.assert_allclose(adv, np.array([-0.25, -0.25, 0.75, -0.25]) / (std + 1e-6), rtol=1e-6)


def test_grpo_of_an_all_equal_group_is_zero():
    for rewards in ([1.0] * 4, [0.0] * 16, [0.1] * 3, [-5.0] * 8):
        adv = grpo_advantages(np.array(rewards))
        assert adv.dtype == np.float32
        assert np.array_equal(adv, np.zeros(len(rewards), dtype=np.float32))


def test_grpo_of_a_single_trajectory_uses_mean_zero_and_std_one():
    np.testing.assert_allclose(grpo_advantages(np.array([1.0])), [1.0 / (1.0 + 1e-6)], rtol=1e-7)
    np.testing.assert_allclose(grpo_advantages(np.array([-5.0])), [-5.0 / (1.0 + 1e-6)], rtol=1e-7)


def test_plus_minus_five_rewards_give_the_same_advantages_as_one_and_zero():
    binary = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(grpo_advantages(binary * 10 - 5), grpo_advantages(binary), rtol=1e-5)


def test_eps_is_added_to_the_std():
    rewards = np.array([1.0, 0.0])  # unbiased std sqrt(0.5)
    adv = grpo_advantages(rewards, eps=0.5)
    np.testing.assert_allclose(adv, [0.5 / (math.sqrt(0.5) + 0.5), -0.5 / (math.sqrt(0.5) + 0.5)], rtol=1e-6)


def test_grpo_rejects_empty_and_batched_input():
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(np.array([]))
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(np.zeros((2, 4)))


def token_stats(values: list[np.ndarray], counts: list[np.ndarray]) -> tuple[float, float]:
    per_token = np.repeat(np.concatenate(values).astype(np.float64), np.concatenate(counts))
    return float(per_token.mean()), float(per_token.std())


def test_whitening_gives_token_weighted_mean_zero_and_std_one():
    adv = [grpo_advantages(np.array([1.0, 0.0, 0.0, 1.0])), grpo_advantages(np.array([0.0, 0.0, 0.0, 1.0]))]
    counts = [np.array([10, 300, 40, 7]), np.array([1000, 5, 60, 200])]
    out = whiten(adv, counts)
    assert [a.shape for a in out] == [(4,), (4,)]
    assert all(a.dtype == np.float32 for a in out)
    mean, std = token_stats(out, counts)
    assert abs(mean) < 1e-6
    assert abs(std - 1.0) < 1e-5
    # Weighting by tokens differs from weighting by trajectory.
    assert abs(float(np.concatenate(out).mean())) > 0.1


def test_whitening_matches_a_hand_computed_example():
    # Tokens: 3 x 1.0, 1 x -1.0, 2 x 0.5 -> mean 0.5, population variance 0.5.
    out = whiten([np.array([1.0, -1.0]), np.array([0.5])], [np.array([3, 1]), np.array([2])])
    s = math.sqrt(0.5) + 1e-8
    np.testing.assert_allclose(out[0], [0.5 / s, -1.5 / s], rtol=1e-6)
    np.testing.assert_allclose(out[1], [0.0], atol=1e-7)


def test_whitening_returns_new_arrays_and_ignores_trajectories_without_loss_tokens():
    adv = [np.array([1.0, -1.0, 100.0], dtype=np.float32)]
    before = adv[0].copy()
    out = whiten(adv, [np.array([2, 2, 0])])
    assert np.array_equal(adv[0], before)
    assert out[0] is not adv[0]
    np.testing.assert_allclose(out[0][:2], [1.0, -1.0], rtol=1e-6)


def test_whitening_a_constant_or_empty_batch_gives_zeros():
    out = whiten([np.array([0.3, 0.3]), np.array([0.3])], [np.array([5, 6]), np.array([7])])
    assert all(np.array_equal(a, np.zeros_like(a)) for a in out)
    out = whiten([np.array([1.0, -1.0])], [np.array([0, 0])])
    assert np.array_equal(out[0], np.zeros(2, dtype=np.float32))
    assert whiten([], []) == []


def test_whitening_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="group 0"):
        whiten([np.array([1.0, 0.0])], [np.array([3])])
    with pytest.raises(ValueError, match="token counts"):
        whiten([np.array([1.0])], [])
