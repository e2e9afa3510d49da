"""streamrl.losses against hand-computed values on tiny tensors.

Ratios are set through log-probs: logprobs = log(r), old_logprobs = 0, so r is exact up to one
exp/log rounding (hence approx with 1e-6).
"""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.config import AlgorithmConfig
from streamrl.losses import entropy_from_logits, make_loss_fn, policy_loss
from workers.backends.base import MicroBatch


def rows(*values: list[float]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.float32)


def logr(*ratios: list[float]) -> torch.Tensor:
    """Log-probs giving these ratios against old log-probs of 0, with grad."""
    return rows(*ratios).log().requires_grad_(True)


def test_clip_low_and_clip_high_bind_only_on_their_side() -> None:
    # A=+1 r=1.5: clipped at 1.28 -> -1.28 | A=+1 r=0.5: -0.5 (no lower clip for A>0)
    # A=-1 r=0.5: clipped at 0.8 -> 0.8    | A=-1 r=1.1: 1.1
    lp = logr([1.5, 0.5, 0.5, 1.1])
    adv = rows([1.0, 1.0, -1.0, -1.0])
    loss, m = policy_loss(lp, torch.zeros(1, 4), adv, torch.ones(1, 4))
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 1.1) / 4, abs=1e-6)
    assert m["clip_frac_low"] == 0.25 and m["clip_frac_high"] == 0.25 and m["clip_frac_dual"] == 0.0
    assert m["ratio_mean"] == pytest.approx(0.9, abs=1e-6)
    assert m["ratio_max"] == pytest.approx(1.5, abs=1e-6)
    loss.backward()
    # d/dlogp of -A*r/4 is -A*r/4 where unclipped, 0 where the clip binds
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, rows([0.0, -0.125, 0.0, 0.275]))


def test_clip_high_of_0_2_is_the_symmetric_ppo_clip() -> None:
    loss, m = policy_loss(logr([1.5]), torch.zeros(1, 1), rows([1.0]), torch.ones(1, 1), clip_high=0.2)
    assert loss.item() == pytest.approx(-1.2, abs=1e-6)
    assert m["clip_frac_high"] == 1.0


def test_dual_clip_caps_only_negative_advantages() -> None:
    # A=-2 r=4: max(8, 2.56)=8, capped at 2*3=6 | A=-2 r=2.5: 5 < 6 | A=+2 r=5: max(-10, -2.56)=-2.56
    lp = logr([4.0, 2.5, 5.0])
    adv = rows([-2.0, -2.0, 2.0])
    loss, m = policy_loss(lp, torch.zeros(1, 3), adv, torch.ones(1, 3))
    assert loss.item() == pytest.approx((6.0 + 5.0 - 2.56) / 3, abs=1e-5)
    assert m["clip_frac_dual"] == pytest.approx(1 / 3)
    assert m["clip_frac_high"] == pytest.approx(1 / 3) and m["clip_frac_low"] == 0.0
    loss.backward()
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, rows([0.0, 2.0 * 2.5 / 3, 0.0]))  # the dual cap has no gradient
    off, m_off = policy_loss(lp.detach(), torch.zeros(1, 3), adv, torch.ones(1, 3), dual_clip_c=None)
    assert off.item() == pytest.approx((8.0 + 5.0 - 2.56) / 3, abs=1e-5)
    assert m_off["clip_frac_dual"] == 0.0


def test_log_ratio_clamp_bounds_the_ratio() -> None:
    lp = torch.tensor([[30.0]], requires_grad=True)
    old, adv, mask = torch.zeros(1, 1), rows([-1.0]), torch.ones(1, 1)
    loss, m = policy_loss(lp, old, adv, mask, dual_clip_c=None)
    assert loss.item() == pytest.approx(math.exp(20.0), rel=1e-6)
    assert m["ratio_max"] == pytest.approx(math.exp(20.0), rel=1e-6)
    loss.backward()
    assert lp.grad is not None and lp.grad.item() == 0.0  # clamped: no gradient
    loose, _ = policy_loss(lp.detach(), old, adv, mask, dual_clip_c=None, log_ratio_clamp=None)
    assert loose.item() == pytest.approx(math.exp(30.0), rel=1e-6)
    low, m_low = policy_loss(torch.tensor([[-30.0]]), old, rows([1.0]), mask, log_ratio_clamp=5.0)
    assert m_low["ratio_mean"] == pytest.approx(math.exp(-5.0), rel=1e-6)
    assert low.item() == pytest.approx(-math.exp(-5.0), rel=1e-6)


def test_masked_tokens_change_nothing() -> None:
    lp = logr([1.5, 0.5], [9.0, 1.1])
    adv = rows([1.0, -3.0], [7.0, -1.0])
    mask = rows([1.0, 0.0], [0.0, 1.0])
    loss, m = policy_loss(lp, torch.zeros(2, 2), adv, mask)
    # only A=+1 r=1.5 (-1.28) and A=-1 r=1.1 (1.1) count, over 2 tokens
    assert loss.item() == pytest.approx((-1.28 + 1.1) / 2, abs=1e-6)
    assert m["ratio_max"] == pytest.approx(1.5, abs=1e-6)  # not 9 from the masked token
    assert m["ratio_mean"] == pytest.approx(1.3, abs=1e-6)
    loss.backward()
    assert lp.grad is not None
    assert lp.grad[0, 1] == 0.0 and lp.grad[1, 0] == 0.0
    assert lp.grad[1, 1].item() == pytest.approx(1.1 / 2, abs=1e-6)


def test_an_empty_mask_gives_zero_loss_that_still_backprops() -> None:
    lp = logr([2.0, 3.0])
    loss, m = policy_loss(lp, torch.zeros(1, 2), rows([1.0, 1.0]), torch.zeros(1, 2))
    loss.backward()
    assert loss.item() == 0.0 and m["ratio_max"] == 0.0 and m["clip_frac_low"] == 0.0
    assert lp.grad is not None and not lp.grad.any()


def test_behaviour_weight_multiplies_each_token_and_is_truncated_at_the_cap() -> None:
    # prox = 0; behaviour = -log w so w = pi_prox / pi_beh is 2, 0.5, 8 and 2
    # A=+1 everywhere; ratios (against prox) 1, 1, 1, 1.5 (clipped at 1.28)
    beh = rows([-math.log(2.0), -math.log(0.5), -math.log(8.0), -math.log(2.0)])
    lp = logr([1.0, 1.0, 1.0, 1.5])
    prox, adv, mask = torch.zeros(1, 4), torch.ones(1, 4), torch.ones(1, 4)
    loss, m = policy_loss(lp, prox, adv, mask, behaviour_logprobs=beh)
    assert loss.item() == pytest.approx((-2.0 - 0.5 - 8.0 - 1.28 * 2.0) / 4, abs=1e-5)
    assert m["bw_mean"] == pytest.approx((2 + 0.5 + 8 + 2) / 4, abs=1e-5)
    assert m["bw_max"] == pytest.approx(8.0, abs=1e-5) and m["bw_capped_frac"] == 0.0
    capped, mc = policy_loss(lp, prox, adv, mask, behaviour_logprobs=beh, behaviour_weight_cap=5.0)
    assert capped.item() == pytest.approx((-2.0 - 0.5 - 5.0 - 1.28 * 2.0) / 4, abs=1e-5)
    assert mc["bw_capped_frac"] == 0.25
    assert mc["bw_max"] == pytest.approx(8.0, abs=1e-5)  # stats are of the weight before the cap
    capped.backward()
    assert lp.grad is not None  # d/dlogp of -w*r/4 at r=1: -w/4 (capped w=5); the clipped token: 0
    torch.testing.assert_close(lp.grad, rows([-0.5, -0.125, -1.25, 0.0]))


def test_plain_ppo_reports_no_behaviour_weight_stats() -> None:
    _, m = policy_loss(logr([1.0]), torch.zeros(1, 1), rows([1.0]), torch.ones(1, 1))
    assert not any(k.startswith("bw_") for k in m)


def test_global_token_mean_divides_by_the_given_count_so_micro_batches_sum_to_the_step_mean() -> None:
    lp = logr([1.5, 0.5, 0.5, 1.1])
    adv = rows([1.0, 1.0, -1.0, -1.0])
    full, _ = policy_loss(lp, torch.zeros(1, 4), adv, torch.ones(1, 4))
    first, _ = policy_loss(
        lp[:, :3], torch.zeros(1, 3), adv[:, :3], torch.ones(1, 3), agg="global-token-mean", global_tokens=4
    )
    second, _ = policy_loss(
        lp[:, 3:], torch.zeros(1, 1), adv[:, 3:], torch.ones(1, 1), agg="global-token-mean", global_tokens=4
    )
    assert (first + second).item() == pytest.approx(full.item(), abs=1e-6)
    assert first.item() == pytest.approx((-1.28 - 0.5 + 0.8) / 4, abs=1e-6)
    with pytest.raises(ValueError, match="global_tokens"):
        policy_loss(lp, torch.zeros(1, 4), adv, torch.ones(1, 4), agg="global-token-mean")


def test_entropy_from_logits() -> None:
    logits = torch.tensor([[0.0, 0.0], [math.log(0.25), math.log(0.75)]])
    expected = [math.log(2.0), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor(expected))


# ---------------------------------------------------------------- the learner's LossFn


def micro_batch(ratios: list[float], adv: list[float], mask: list[float]) -> tuple[MicroBatch, torch.Tensor]:
    """One-row micro-batch with behaviour log-probs 0 and current log-probs giving `ratios`."""
    n = len(ratios)
    mb = MicroBatch(
        input_ids=torch.zeros(1, n, dtype=torch.int64),
        attention_mask=torch.ones(1, n, dtype=torch.bool),
        loss_mask=rows(mask),
        old_logprobs=torch.zeros(1, n),
        advantages=rows(adv),
        versions=torch.zeros(1, n, dtype=torch.int32),
    )
    return mb, logr(ratios)


def test_early_stop_zeroes_a_micro_batch_whose_mean_ratio_exceeds_the_threshold() -> None:
    fn = make_loss_fn(AlgorithmConfig(early_stop_imp_ratio=5.0, dual_clip_c=None), None)
    mb, lp = micro_batch([8.0, 4.0], [1.0, -1.0], [1.0, 1.0])  # mean ratio 6 > 5
    loss, m = fn(mb, lp, torch.zeros(1, 2))
    loss.backward()
    assert m["early_stopped"] == 1.0 and m["ratio_mean"] == pytest.approx(6.0, abs=1e-5)
    assert loss.item() == 0.0 and m["loss"] == 0.0
    assert lp.grad is not None and not lp.grad.any()
    mb, lp = micro_batch([5.0, 4.0], [1.0, -1.0], [1.0, 1.0])  # mean 4.5: trained
    loss, m = fn(mb, lp, torch.zeros(1, 2))
    assert m["early_stopped"] == 0.0
    assert loss.item() == pytest.approx((-1.28 + 4.0) / 2, abs=1e-5)


def test_early_stop_reads_the_mean_over_loss_tokens_only() -> None:
    fn = make_loss_fn(AlgorithmConfig(early_stop_imp_ratio=5.0), None)
    mb, lp = micro_batch([100.0, 1.0], [1.0, 1.0], [0.0, 1.0])
    _, m = fn(mb, lp, torch.zeros(1, 2))
    assert m["early_stopped"] == 0.0


def test_loss_fn_uses_prox_logprobs_as_old_and_engine_logprobs_as_behaviour() -> None:
    fn = make_loss_fn(AlgorithmConfig(behaviour_weight_cap=5.0), None)
    mb, lp = micro_batch([1.0, 1.5], [1.0, 1.0], [1.0, 1.0])
    mb.old_logprobs = rows([-math.log(8.0), -math.log(2.0)])  # engine (behaviour)
    mb.prox_logprobs = torch.zeros(1, 2)  # learner's recompute
    loss, m = fn(mb, lp, torch.zeros(1, 2))
    assert loss.item() == pytest.approx((-5.0 - 1.28 * 2.0) / 2, abs=1e-5)
    assert m["bw_capped_frac"] == 0.5
    mb.prox_logprobs = None  # plain PPO against the engine's log-probs: ratios 8 and 3 (both clip)
    loss, m = fn(mb, lp.detach(), torch.zeros(1, 2))
    assert loss.item() == pytest.approx(-1.28, abs=1e-5) and "bw_mean" not in m


def test_entropy_bonus_subtracts_coef_times_the_masked_mean_entropy() -> None:
    fn = make_loss_fn(AlgorithmConfig(entropy_coef=0.1), None)
    assert fn.needs_entropy_grad
    mb, lp = micro_batch([1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0])
    entropy = rows([2.0, 4.0, 100.0]).requires_grad_(True)
    loss, m = fn(mb, lp, entropy)
    assert loss.item() == pytest.approx(-0.1 * 3.0, abs=1e-6)
    assert m["entropy"] == pytest.approx(3.0)
    loss.backward()
    assert entropy.grad is not None
    torch.testing.assert_close(entropy.grad, rows([-0.05, -0.05, 0.0]))
    assert not make_loss_fn(AlgorithmConfig(), None).needs_entropy_grad


def test_token_mean_losses_are_scaled_by_the_step_micro_batch_count_and_global_ones_are_not() -> None:
    mb, lp = micro_batch([1.5, 0.5], [1.0, 1.0], [1.0, 1.0])
    single, m1 = make_loss_fn(AlgorithmConfig(), None)(mb, lp, torch.zeros(1, 2))
    quarter, m4 = make_loss_fn(AlgorithmConfig(), None, micro_batches=4)(mb, lp, torch.zeros(1, 2))
    assert quarter.item() == pytest.approx(single.item() / 4, abs=1e-7)
    assert m4["loss"] == pytest.approx(m1["loss"])  # the metric is the micro-batch's own token mean
    cfg = AlgorithmConfig(loss_agg="global-token-mean")
    glob, mg = make_loss_fn(cfg, 8.0, micro_batches=4)(mb, lp, torch.zeros(1, 2))
    assert glob.item() == pytest.approx((-1.28 - 0.5) / 8, abs=1e-6)
    assert mg["loss"] == pytest.approx(m1["loss"], abs=1e-6) and mg["loss_tokens"] == 2.0


def test_loss_fn_refuses_what_it_cannot_compute() -> None:
    with pytest.raises(ValueError, match="kl_coef"):
        make_loss_fn(AlgorithmConfig(kl_coef=0.1), None)
    with pytest.raises(ValueError, match="global-token-mean"):
        make_loss_fn(AlgorithmConfig(loss_agg="global-token-mean"), None)
