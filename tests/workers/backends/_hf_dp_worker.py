"""Shared pieces of the hf backend tests, and one data-parallel rank run as a subprocess.

    python -m tests.workers.backends._hf_dp_worker MODEL_DIR OUT_DIR   (env: RANK, WORLD_SIZE, MASTER_*)

The rank joins a gloo group, trains `STEPS` steps on `make_batch(DP_SEQUENCES)` with its share of
the micro-batches, and writes its final weights to OUT_DIR/rank-<r>.pt.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from streamrl import messages as m
from streamrl.config import (
    AlgorithmConfig,
    DataConfig,
    JobSpec,
    LearnerConfig,
    ModelConfig,
    SyntheticArithData,
)
from streamrl.losses import make_loss_fn
from streamrl.microbatch import build_micro_batches, loss_token_count, micro_batch_count

STEPS = 2
MAX_TOKENS = 64
# (prompt length, response length, advantage) per sequence: 5 sequences, so DP ranks differ in size
DP_SEQUENCES = [(5, 20, 1.0), (3, 9, -1.0), (8, 14, 0.5), (4, 30, -0.5), (6, 6, 2.0)]


def job_spec(model_dir: str | Path, *, dp: int = 1, **algorithm: Any) -> JobSpec:
    return JobSpec(
        name="hf-test",
        model=ModelConfig(path=str(model_dir)),
        data=DataConfig(train=SyntheticArithData()),
        algorithm=AlgorithmConfig(**algorithm),
        learner=LearnerConfig(
            backend="hf", lr=1e-3, warmup_steps=3, dp=dp, micro_batch_tokens=MAX_TOKENS, threads=1
        ),  # one thread: two would fight over a shared 2-core machine
    )


def make_batch(
    sequences: list[tuple[int, int, float]], seed: int = 0, vocab: int = 200, logprob: float = -3.0
) -> m.Batch:
    """One single-trajectory group per (prompt length, response length, advantage), random tokens;
    every response token is a loss token with behaviour log-prob `logprob` and version 0."""
    rng = np.random.default_rng(seed)
    groups = []
    for k, (p, n, _) in enumerate(sequences):
        traj = m.Trajectory(
            sample_index=0,
            tokens=m.pack("tokens", rng.integers(0, vocab, n)),
            loss_mask=m.pack("loss_mask", np.ones(n)),
            logprobs=m.pack("logprobs", np.full(n, logprob)),
            versions=m.pack("versions", np.zeros(n)),
            reward=0.0,
            finish_reason="length",
        )
        groups.append(
            m.Group(
                uid=k,
                prompt_id=f"p{k}",
                admitted_version=0,
                generator="test",
                prompt_tokens=m.pack("prompt_tokens", rng.integers(0, vocab, p)),
                trajectories=[traj],
            )
        )
    advantages = [m.pack("advantages", [a]) for _, _, a in sequences]
    return m.Batch(step=0, policy_version=0, groups=groups, advantages=advantages)


def dp_train(backend: Any, steps: int) -> list[dict[str, float]]:
    """`steps` train steps on the DP batch with global-token-mean, this rank's micro-batches only."""
    batch = make_batch(DP_SEQUENCES)
    cfg = AlgorithmConfig(loss_agg="global-token-mean")
    fn = make_loss_fn(
        cfg, loss_token_count(batch), micro_batches=micro_batch_count(batch, MAX_TOKENS, backend.dp_size)
    )
    mbs = build_micro_batches(batch, MAX_TOKENS, dp_rank=backend.dp_rank, dp_size=backend.dp_size)
    return [backend.train_step(mbs, fn) for _ in range(steps)]


def main(model_dir: str, out_dir: str) -> int:
    from workers.backends.hf import make_backend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        backend = make_backend(job_spec(model_dir, dp=world), model_dir)
        dp_train(backend, STEPS)
        torch.save(
            {n: t.clone() for n, t in backend.model.state_dict().items()}, Path(out_dir) / f"rank-{rank}.pt"
        )
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
