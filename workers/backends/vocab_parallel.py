"""Log-probabilities and entropy from vocab-sharded logits (tensor parallelism), without gathering them.

Each TP rank holds the logits of a contiguous slice of the vocabulary. A full log-softmax needs
only three numbers per token from every rank (the max, the sum of exponentials, and the target's
logit, plus sum exp*logit for the entropy), so two all-reduces of [N]-sized tensors replace an
all-gather of [N, V]. Megatron's own `vocab_parallel_cross_entropy` computes the same log-prob but
overwrites its input in place and has no entropy; this one returns both, and differentiates the
entropy when an entropy bonus needs it. With `group=None` it is a plain (tp=1) log-softmax.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _VocabParallelLogprobs(torch.autograd.Function):
    """log p(target) and entropy from vocab-sharded logits: each TP rank holds columns
    [start, start + v) of the softmax. Two all-reduces (the max; then sum-exp, target logit and
    sum exp*logit stacked into one), never the gathered logits. Entropy carries a gradient only
    when asked (an entropy bonus): d H / d z_j = -p_j (log p_j + H)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, start: int, group: Any, entropy_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # logits [N, v] float32 (this rank's vocab columns), target [N] int64 (global ids)
        logits_max = logits.max(dim=-1).values
        if group is not None:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max[:, None]  # [N, v]
        exp = shifted.exp()
        v = logits.shape[1]
        local = target - start
        mine = (local >= 0) & (local < v)
        local = local.clamp(0, v - 1)
        sums = torch.stack(
            [exp.sum(-1), shifted.gather(1, local[:, None]).squeeze(1) * mine, (exp * shifted).sum(-1)]
        )  # [3, N]
        if group is not None:
            dist.all_reduce(sums, group=group)
        sum_exp, target_shifted, sum_exp_shifted = sums
        log_z = sum_exp.log()
        logprob = target_shifted - log_z
        entropy = log_z - sum_exp_shifted / sum_exp
        ctx.save_for_backward(shifted, log_z, entropy, local, mine)
        ctx.entropy_grad = entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logprob, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprob: torch.Tensor, grad_entropy: torch.Tensor | None) -> tuple[Any, ...]:
        shifted, log_z, entropy, local, mine = ctx.saved_tensors
        log_p = shifted - log_z[:, None]  # [N, v], this rank's columns
        p = log_p.exp()
        # d logprob / d z = onehot(target) - p (the one-hot only on the rank that owns the target)
        grad = p * -grad_logprob[:, None]
        grad.scatter_add_(1, local[:, None], (grad_logprob * mine)[:, None])
        if ctx.entropy_grad and grad_entropy is not None:
            grad -= grad_entropy[:, None] * p * (log_p + entropy[:, None])
        return grad, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor, target: torch.Tensor, start: int, group: Any, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, v] (vocab columns [start, start + v) of the full softmax), target [N] ->
    (logprob [N] with grad, entropy [N], with grad only if `entropy_grad`); `group` is the TP
    group, None for tp=1."""
    return _VocabParallelLogprobs.apply(logits, target, start, group, entropy_grad)  # type: ignore[no-any-return]
