"""GRPO advantages and optional token-weighted whitening, as pure numpy functions.

Implemented (reference: `shared/reference/roc_and_grpo.md` sections 2.1, 2.2 and 2.4):

- `grpo_advantages`: verl / RLinf GRPO with `norm_adv_by_std_in_grpo=True`,
  A_i = (r_i - mean) / (std + eps) over one group (after RoC), `std` unbiased (ddof=1) like
  `torch.std`, eps 1e-6. A group of size 1 uses verl's mean 0, std 1, so A = r / (1 + eps).
  The scalar is broadcast to the trajectory's loss tokens by the caller (tool tokens get 0).
- `whiten`: RLinf's `normalize_advantages` (`safe_normalize` over the loss mask) across a batch:
  every trajectory's advantage counts once per loss token; population std; (A - mean) /
  (std + 1e-8), or all zeros when std < 1e-8.

Reward scale: (r - mean) / std is invariant to scaling r, so RLinf's +5/-5 rewards give the same
advantages as 1/0 rewards except through eps, which is negligible next to either std (a mixed group
of 16 has std >= 0.25 with 1/0 rewards, 10x that with +5/-5).

Deliberate deviations: statistics are computed in float64 (verl and RLinf use float32), the result
is float32; a group whose rewards are all exactly equal returns exact zeros, where float32 torch
can return values of order 1e-7 / eps from rounding in the mean.
"""

from __future__ import annotations

import numpy as np

__all__ = ["grpo_advantages", "whiten"]

WHITEN_EPS = 1e-8


def grpo_advantages(rewards: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """GRPO advantages of one group. rewards: [G] -> [G] float32."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"grpo_advantages needs a non-empty 1-D group of rewards, got shape {r.shape}")
    if r.size == 1:
        return (r / (1.0 + eps)).astype(np.float32)
    if np.all(r == r[0]):
        return np.zeros(r.shape, dtype=np.float32)
    return ((r - r.mean()) / (r.std(ddof=1) + eps)).astype(np.float32)


def whiten(advantages: list[np.ndarray], token_counts: list[np.ndarray]) -> list[np.ndarray]:
    """Token-weighted whitening across a batch, returning new float32 arrays of the same shapes.

    advantages: per group, [G_k] advantage per trajectory; token_counts: per group, [G_k] loss
    tokens per trajectory (>= 0). Mean and std are those of the batch's loss tokens, where each
    token carries its trajectory's advantage. Trajectories with 0 loss tokens are transformed too
    but do not weigh in. A batch with no loss tokens, or std < 1e-8, gives zeros.
    """
    if len(advantages) != len(token_counts):
        raise ValueError(f"whiten: {len(advantages)} advantage arrays but {len(token_counts)} token counts")
    shapes = [np.shape(a) for a in advantages]
    for k, (a, c) in enumerate(zip(advantages, token_counts, strict=True)):
        if np.shape(a) != np.shape(c):
            raise ValueError(f"whiten: group {k} has advantages {np.shape(a)} but token counts {np.shape(c)}")
    if not advantages:
        return []
    a = np.concatenate([np.asarray(x, dtype=np.float64).ravel() for x in advantages])
    w = np.concatenate([np.asarray(x, dtype=np.float64).ravel() for x in token_counts])
    if np.any(w < 0):
        raise ValueError("whiten: token counts must be >= 0")
    out = np.zeros(a.shape, dtype=np.float32)
    total = w.sum()
    if total > 0:
        mean = (a * w).sum() / total
        std = np.sqrt((w * (a - mean) ** 2).sum() / total)
        if np.isfinite(std) and std >= WHITEN_EPS:
            out = ((a - mean) / (std + WHITEN_EPS)).astype(np.float32)
    pieces = np.split(out, np.cumsum([int(np.prod(s)) for s in shapes])[:-1])
    return [p.reshape(s) for p, s in zip(pieces, shapes, strict=True)]
