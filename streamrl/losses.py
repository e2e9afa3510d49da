"""Policy-gradient losses as pure functions over `[batch, tokens]` tensors, and the learner's LossFn.

Implemented (reference: `shared/reference/roc_and_grpo.md` 2.1-2.3, `async_rl_anchors.md` 2.1):

- `policy_loss`: verl / RLinf PPO-clip. Per token, with r = exp(clamp(logp - logp_old, -c, c)):
  L = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))       (clip-higher, DAPO's 0.2 / 0.28)
  and for A < 0 only the dual clip L = min(L, -A dual_clip_c)  (verl's clip_ratio_c = 3).
- Decoupled PPO (AReaL) when `behaviour_logprobs` is given: `old_logprobs` is then the proximal
  policy (recomputed by the learner) and each token's L is multiplied by the behaviour weight
  w = pi_prox / pi_behaviour = exp(old_logprobs - behaviour_logprobs). With `behaviour_weight_cap`,
  weights above the cap are *truncated* to the cap (AReaL's `clamp` action, truncated importance
  sampling); AReaL can also *mask* such tokens, which streamrl does not offer. The log of w goes
  through the same clamp as the ratio, so a wild behaviour log-prob cannot make w infinite.
- Aggregation: `token-mean` is the masked mean over this micro-batch (verl / RLinf default);
  `global-token-mean` is the masked sum divided by `global_tokens`, the loss-token count of the
  whole step over every data-parallel rank (so every token weighs the same, whatever micro-batch
  it landed in).
- `make_loss_fn`: the `LossFn` the learner hands a backend: the above on a `MicroBatch`, an entropy
  bonus, and RLinf's micro-batch early stop (the whole micro-batch's loss times 0 when its masked
  mean ratio exceeds `early_stop_imp_ratio`, RLinf's "abandon this microbatch").

Step-loss convention (what `Backend.train_step` relies on): every rank's gradients are *summed*
over its micro-batches and then over data-parallel ranks. So `global-token-mean` losses need no
further scaling, and `token-mean` losses are divided by the step's micro-batch count over all ranks
(`micro_batches`), making the step loss the mean of the micro-batch means, as Megatron and RLinf
average over micro-batches.

Deliberate deviations: RLinf all-reduces the early-stop ratio over the data-parallel group; here
each rank decides on its own micro-batch (ranks may hold different numbers of micro-batches, so a
collective inside the loss could deadlock). No KL term (`kl_coef` must be 0: the recipes use none).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from streamrl.config import AlgorithmConfig
    from workers.backends.base import MicroBatch

__all__ = ["LossFunction", "entropy_from_logits", "make_loss_fn", "masked_mean", "policy_loss"]

Agg = Literal["token-mean", "global-token-mean"]


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` [b, T] over `mask` [b, T] (0 when the mask is empty), differentiable."""
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy [..., ] of the softmax of `logits` [..., V], computed in float32."""
    logp = logits.float().log_softmax(dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip_c: float | None = 3.0,
    log_ratio_clamp: float | None = 20.0,
    behaviour_logprobs: torch.Tensor | None = None,
    behaviour_weight_cap: float | None = None,
    agg: Agg = "token-mean",
    global_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip loss (scalar, differentiable in `logprobs`) and its metrics.

    logprobs [b, T] (current policy, with grad), old_logprobs [b, T] (the policy the ratio is taken
    against: the behaviour policy, or the proximal one when `behaviour_logprobs` [b, T] is given),
    advantages [b, T], mask [b, T] (1 on model-generated tokens). Off-mask entries may hold anything
    finite. Metrics are over masked tokens: clip_frac_low (A < 0 and r < 1 - clip_low),
    clip_frac_high (A > 0 and r > 1 + clip_high), clip_frac_dual (A < 0 and the dual clip binds),
    ratio_mean, ratio_max, and with behaviour log-probs bw_mean and bw_max (of w before the cap)
    and bw_capped_frac (tokens whose w was truncated).
    """
    if agg not in ("token-mean", "global-token-mean"):
        raise ValueError(f"unknown loss aggregation {agg!r}; expected 'token-mean' or 'global-token-mean'")
    if agg == "global-token-mean" and (global_tokens is None or global_tokens <= 0):
        raise ValueError(
            f"global-token-mean needs global_tokens > 0 (the step's loss tokens), got {global_tokens}"
        )
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    mask = mask.to(logprobs.dtype)
    on = mask > 0
    old = old_logprobs.detach()
    adv = advantages.detach()

    log_ratio = logprobs - old
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = log_ratio.exp()
    pg_plain = -adv * ratio
    pg_clip = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg_plain, pg_clip)
    negative = adv < 0
    if dual_clip_c is not None:
        cap = -adv * dual_clip_c
        dual_binds = negative & (pg > cap)
        pg = torch.where(negative, torch.minimum(pg, cap), pg)
    else:
        dual_binds = torch.zeros_like(on)

    stats: dict[str, torch.Tensor] = {}
    if behaviour_logprobs is not None:
        log_w = old - behaviour_logprobs.detach()
        if log_ratio_clamp is not None:
            log_w = log_w.clamp(-log_ratio_clamp, log_ratio_clamp)
        w = log_w.exp()
        stats["bw_mean"] = masked_mean(w, mask)
        stats["bw_max"] = _masked_max(w, on)
        if behaviour_weight_cap is not None:
            stats["bw_capped_frac"] = masked_mean((w > behaviour_weight_cap).to(mask.dtype), mask)
            w = w.clamp(max=behaviour_weight_cap)
        else:
            stats["bw_capped_frac"] = torch.zeros((), dtype=mask.dtype, device=mask.device)
        pg = pg * w

    total = torch.where(on, pg, torch.zeros_like(pg)).sum()
    loss = total / (mask.sum().clamp(min=1.0) if agg == "token-mean" else float(global_tokens))  # type: ignore[arg-type]

    with torch.no_grad():
        r = ratio.detach()
        stats |= {
            "clip_frac_low": masked_mean((negative & (r < 1.0 - clip_low)).to(mask.dtype), mask),
            "clip_frac_high": masked_mean(((adv > 0) & (r > 1.0 + clip_high)).to(mask.dtype), mask),
            "clip_frac_dual": masked_mean(dual_binds.to(mask.dtype), mask),
            "ratio_mean": masked_mean(r, mask),
            "ratio_max": _masked_max(r, on),
        }
        names = list(stats)
        values = torch.stack([stats[k].detach().float() for k in names]).tolist()  # one device sync
    return loss, dict(zip(names, values, strict=True))


def _masked_max(values: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """Max of `values` where `on`, 0 when nothing is on."""
    if not bool(on.any()):
        return torch.zeros((), dtype=values.dtype, device=values.device)
    return values.detach()[on].max()


class LossFunction:
    """The learner's `LossFn` (workers/backends/base.py): `policy_loss` on a MicroBatch plus the entropy
    bonus and the micro-batch early stop.

    `needs_entropy_grad` tells a backend whether the entropy it passes must carry gradients (only
    for an entropy bonus); otherwise it may pass a detached tensor and skip that backward work.
    """

    def __init__(self, cfg: AlgorithmConfig, global_tokens: float | None, micro_batches: int = 1) -> None:
        if cfg.kl_coef:
            raise ValueError(f"algorithm.kl_coef={cfg.kl_coef}: the KL term is not implemented; set it to 0")
        if cfg.loss_agg == "global-token-mean" and (global_tokens is None or global_tokens <= 0):
            raise ValueError("algorithm.loss_agg=global-token-mean needs the step's loss-token count (> 0)")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.cfg, self.global_tokens = cfg, global_tokens
        # token-mean: the step loss is the mean over the step's micro-batches (sum over ranks)
        self.scale = 1.0 / micro_batches if cfg.loss_agg == "token-mean" else 1.0
        self.needs_entropy_grad = cfg.entropy_coef > 0

    def __call__(
        self, mb: MicroBatch, logprobs: torch.Tensor, entropy: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.cfg
        decoupled = mb.prox_logprobs is not None
        loss, metrics = policy_loss(
            logprobs,
            mb.prox_logprobs if decoupled else mb.old_logprobs,  # type: ignore[arg-type]
            mb.advantages,
            mb.loss_mask,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            dual_clip_c=cfg.dual_clip_c,
            log_ratio_clamp=cfg.log_ratio_clamp,
            behaviour_logprobs=mb.old_logprobs if decoupled else None,
            behaviour_weight_cap=cfg.behaviour_weight_cap if decoupled else None,
            agg=cfg.loss_agg,
            global_tokens=self.global_tokens,
        )
        mask = mb.loss_mask.to(logprobs.dtype)
        if cfg.entropy_coef > 0:
            if cfg.loss_agg == "token-mean":
                ent_term = masked_mean(entropy, mask)
            else:
                ent_term = (entropy * mask).sum() / float(self.global_tokens)  # type: ignore[arg-type]
            loss = loss - cfg.entropy_coef * ent_term
        stop = cfg.early_stop_imp_ratio is not None and metrics["ratio_mean"] > cfg.early_stop_imp_ratio
        if stop:
            loss = loss * 0.0  # keeps the graph: backward runs and adds zero gradients
        tokens = float(mask.sum())
        # reported as this micro-batch's token mean whatever the aggregation, so averages read alike
        per_mb = 1.0 if cfg.loss_agg == "token-mean" else float(self.global_tokens) / max(tokens, 1.0)  # type: ignore[arg-type]
        metrics["loss"] = float(loss.detach()) * per_mb
        metrics["early_stopped"] = 1.0 if stop else 0.0
        metrics["entropy"] = float(masked_mean(entropy.detach(), mask))
        metrics["loss_tokens"] = tokens
        return loss * self.scale, metrics


def make_loss_fn(
    cfg: AlgorithmConfig, global_tokens: float | None, *, micro_batches: int = 1
) -> LossFunction:
    """The LossFn for one train step.

    global_tokens: loss tokens of the whole step over all data-parallel ranks (needed for
    `global-token-mean`; `streamrl.microbatch.loss_token_count`). micro_batches: the step's
    micro-batch count over all ranks (`streamrl.microbatch.micro_batch_count`), which scales
    `token-mean` losses so that the summed gradients are those of the mean micro-batch loss.
    """
    return LossFunction(cfg, global_tokens, micro_batches)
