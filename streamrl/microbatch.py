"""Turn a train step's `Batch` into padded micro-batches for one data-parallel rank.

Every trajectory of every group becomes one sequence `prompt_tokens + trajectory.tokens`; its
per-token tensors follow the alignment of `workers/backends/base.py` (entry t belongs to token t):
the response's loss mask, behaviour log-probs and versions start at column `len(prompt)`, the
prompt and the padding get mask 0, log-prob 0 and version -1, and the trajectory's advantage is
placed on its loss-mask tokens only (tool tokens get 0).

Split and packing (both deterministic, a function of the batch and the arguments only, so every rank
computes the same plan without talking to the others):

1. Data-parallel split, balanced by tokens: sequences in order of decreasing length (ties by
   position in the batch) each go to the rank with the fewest tokens so far (ties: lowest rank), the
   longest-processing-time rule, within 4/3 of the best split.
2. Packing on each rank: its sequences in decreasing length fill micro-batches greedily while the
   padded size `rows * longest` stays within `max_tokens`, so lengths in a micro-batch are similar
   and padding is small. A sequence longer than `max_tokens` gets a micro-batch of its own.

The loss needs two step-wide counts that every rank must agree on: `loss_token_count` (for
global-token-mean) and `micro_batch_count` over all ranks (for token-mean, see streamrl/losses.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from streamrl.messages import Batch, unpack
from workers.backends.base import MicroBatch

__all__ = [
    "build_micro_batches",
    "loss_token_count",
    "micro_batch_count",
    "plan_micro_batches",
]


@dataclass(frozen=True, slots=True)
class SeqRef:
    """One trajectory of the batch: `batch.groups[group].trajectories[traj]`, `length` tokens long."""

    group: int
    traj: int
    length: int


def _sequences(batch: Batch) -> list[SeqRef]:
    if len(batch.advantages) != len(batch.groups):
        raise ValueError(
            f"batch step {batch.step}: {len(batch.advantages)} advantage arrays for {len(batch.groups)} groups"
        )
    out = []
    for g, group in enumerate(batch.groups):
        prompt = len(group.prompt_tokens) // 4
        n_adv = len(batch.advantages[g]) // 4
        if n_adv != len(group.trajectories):
            raise ValueError(
                f"batch step {batch.step}, group {group.uid}: {n_adv} advantages "
                f"for {len(group.trajectories)} trajectories"
            )
        for j, traj in enumerate(group.trajectories):
            out.append(SeqRef(g, j, prompt + traj.num_tokens))
    return out


def plan_micro_batches(batch: Batch, max_tokens: int, dp_size: int = 1) -> list[list[list[SeqRef]]]:
    """The whole step's plan: `plan[rank][k]` lists the sequences of micro-batch k of that rank."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    order = sorted(enumerate(_sequences(batch)), key=lambda p: (-p[1].length, p[0]))
    loads = [0] * dp_size
    per_rank: list[list[SeqRef]] = [[] for _ in range(dp_size)]
    for _, seq in order:  # decreasing length, so each rank's list is too
        rank = min(range(dp_size), key=lambda r: (loads[r], r))
        loads[rank] += seq.length
        per_rank[rank].append(seq)
    plan: list[list[list[SeqRef]]] = []
    for seqs in per_rank:
        mbs: list[list[SeqRef]] = []
        for seq in seqs:
            current = mbs[-1] if mbs else None
            # the first sequence of a micro-batch is its longest, so padded size = rows * that length
            if current is not None and (len(current) + 1) * current[0].length <= max_tokens:
                current.append(seq)
            else:
                mbs.append([seq])
        plan.append(mbs)
    return plan


def build_micro_batches(
    batch: Batch, max_tokens: int, *, dp_rank: int = 0, dp_size: int = 1
) -> list[MicroBatch]:
    """Micro-batches of rank `dp_rank` (of `dp_size`), each with `rows * T <= max_tokens` unless it
    holds a single longer sequence. A rank may get none (more ranks than sequences)."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
    plan = plan_micro_batches(batch, max_tokens, dp_size)[dp_rank]
    return [_materialise(batch, seqs) for seqs in plan]


def _materialise(batch: Batch, seqs: list[SeqRef]) -> MicroBatch:
    b, T = len(seqs), max(s.length for s in seqs)
    input_ids = np.zeros((b, T), dtype=np.int64)
    attention = np.zeros((b, T), dtype=bool)
    loss_mask = np.zeros((b, T), dtype=np.float32)
    old_logprobs = np.zeros((b, T), dtype=np.float32)
    advantages = np.zeros((b, T), dtype=np.float32)
    versions = np.full((b, T), -1, dtype=np.int32)
    for i, s in enumerate(seqs):
        group = batch.groups[s.group]
        traj = group.trajectories[s.traj]
        prompt = unpack("prompt_tokens", group.prompt_tokens)
        p, n = len(prompt), traj.num_tokens
        mask = unpack("loss_mask", traj.loss_mask).astype(bool)
        input_ids[i, :p] = prompt
        input_ids[i, p : p + n] = unpack("tokens", traj.tokens)
        attention[i, : p + n] = True
        loss_mask[i, p : p + n] = mask
        old_logprobs[i, p : p + n] = np.where(mask, unpack("logprobs", traj.logprobs), 0.0)
        advantages[i, p : p + n] = np.where(
            mask, unpack("advantages", batch.advantages[s.group])[s.traj], 0.0
        )
        versions[i, p : p + n] = np.where(mask, unpack("versions", traj.versions), -1)
    return MicroBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention),
        loss_mask=torch.from_numpy(loss_mask),
        old_logprobs=torch.from_numpy(old_logprobs),
        advantages=torch.from_numpy(advantages),
        versions=torch.from_numpy(versions),
    )


def loss_token_count(batch: Batch) -> int:
    """Model-generated (loss-mask) tokens of the whole batch: the global-token-mean denominator."""
    return sum(
        int(np.count_nonzero(unpack("loss_mask", t.loss_mask))) for g in batch.groups for t in g.trajectories
    )


def micro_batch_count(batch: Batch, max_tokens: int, dp_size: int = 1) -> int:
    """Micro-batches of the step over all ranks: the token-mean scale (streamrl/losses.py)."""
    return sum(len(mbs) for mbs in plan_micro_batches(batch, max_tokens, dp_size))
