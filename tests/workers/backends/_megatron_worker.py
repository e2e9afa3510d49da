"""Shared by test_megatron.py and the processes it starts: a tiny job spec, fixed micro-batches, a
PPO-style loss with an optional entropy bonus, and `run_steps`, the sequence every layout runs: TP=1
in the test process; TP=2, then TP=1 x DP=2, then PP=2 (plus export and resume), then a Qwen3 at TP=2,
in two processes started by `python -m tests.workers.backends._megatron_worker`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from streamrl.config import DataConfig, JobSpec, LearnerConfig, ModelConfig, SyntheticArithData, TrainConfig
from workers.backends.base import MicroBatch

STEPS = 3


def tiny_spec(
    model_dir: Path, tp: int = 1, dp: int = 1, warmup: int = 2, grad_clip: float = 1.0, pp: int = 1
) -> JobSpec:
    return JobSpec(
        name="megatron-test",
        model=ModelConfig(path=str(model_dir), dtype="float32"),
        data=DataConfig(train=SyntheticArithData()),
        learner=LearnerConfig(
            backend="megatron", tp=tp, pp=pp, dp=dp, lr=1e-3, warmup_steps=warmup, grad_clip=grad_clip
        ),
        train=TrainConfig(steps=STEPS, seed=0),
    )


def micro_batch(vocab: int, lengths: list[int], prompt: int, seed: int) -> MicroBatch:
    """Right-padded sequences of the given lengths; the first `prompt` tokens are not trained on."""
    g = torch.Generator().manual_seed(seed)
    b, t = len(lengths), max(lengths)
    ids = torch.randint(1, vocab, (b, t), generator=g)
    real = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    ids = ids * real
    loss_mask = (real & (torch.arange(t)[None, :] >= prompt)).float()
    old = (-torch.log(torch.tensor(float(vocab))) + 0.3 * torch.randn(b, t, generator=g)) * loss_mask
    adv = torch.randn(b, 1, generator=g).expand(b, t) * loss_mask
    versions = torch.where(loss_mask > 0, 0, -1).to(torch.int32)
    return MicroBatch(ids, real, loss_mask, old, adv.contiguous(), versions)


def step_batches(vocab: int) -> list[list[MicroBatch]]:
    """STEPS steps of two micro-batches each (different lengths, so padding is exercised)."""
    return [
        [micro_batch(vocab, [12, 9, 5], 3, 10 * s), micro_batch(vocab, [16, 11], 4, 10 * s + 1)]
        for s in range(STEPS)
    ]


class PPOLoss:
    """Clipped PPO, token-mean per micro-batch, halved (two micro-batches per step), minus an entropy
    bonus; `needs_entropy_grad` asks the backend for an entropy with gradients (streamrl.losses' flag)."""

    def __init__(self, entropy_coef: float = 0.0) -> None:
        self.entropy_coef = entropy_coef
        self.needs_entropy_grad = entropy_coef > 0

    def __call__(
        self, mb: MicroBatch, logprobs: torch.Tensor, entropy: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = mb.loss_mask
        ratio = torch.exp(logprobs - mb.old_logprobs)
        obj = torch.minimum(ratio * mb.advantages, ratio.clamp(0.8, 1.28) * mb.advantages)
        mean_entropy = (entropy * mask).sum() / mask.sum()
        loss = (-(obj * mask).sum() / mask.sum() - self.entropy_coef * mean_entropy) / 2
        return loss, {"loss": float(loss.detach()), "entropy": float(mean_entropy.detach())}


loss_fn = PPOLoss()
bonus_loss_fn = PPOLoss(entropy_coef=0.1)
STEP_LOSSES = [loss_fn, bonus_loss_fn, loss_fn]


def run_steps(backend: Any, vocab: int, dp_part: int | None = None) -> dict[str, Any]:
    """Log-probs before training, per-step metrics, log-probs and weights after: what layouts must
    agree on. With `dp_part`, this rank trains only micro-batch `dp_part` of each step (DP=2)."""
    batches = step_batches(vocab)
    probe = batches[0][1]
    out: dict[str, Any] = {"before": backend.logprobs(probe), "steps": []}
    t0 = time.perf_counter()
    for mbs, fn in zip(batches, STEP_LOSSES, strict=True):
        metrics = backend.train_step(mbs if dp_part is None else [mbs[dp_part]], fn)
        metrics.pop("train_step_s")
        out["steps"].append(metrics)
    out["train_s"] = time.perf_counter() - t0
    out["after"] = backend.logprobs(probe)
    out["weights"] = {k: v.clone() for k, v in backend.hf_weights()}
    return out


def run_pp2(model_dir: Path, vocab: int, tmp: Path) -> dict[str, Any]:
    """`run_steps` as two pipeline stages, then export, save, and a resumed backend's next step."""
    from workers.backends.megatron import make_backend

    backend = make_backend(tiny_spec(model_dir, pp=2), model_dir)
    out = run_steps(backend, vocab)
    backend.export_hf(tmp / "pp2_export")
    backend.save(tmp / "pp2_ckpt")
    extra = step_batches(vocab)[0]
    out["next_step"] = backend.train_step(extra, loss_fn)
    resumed = make_backend(tiny_spec(model_dir, pp=2), model_dir)
    resumed.load(tmp / "pp2_ckpt")
    out["resumed_step"] = resumed.train_step(extra, loss_fn)
    for m in (out["next_step"], out["resumed_step"]):
        m.pop("train_step_s")
    out["resumed_weights"] = {k: v.clone() for k, v in resumed.hf_weights()}
    out["next_weights"] = {k: v.clone() for k, v in backend.hf_weights()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--qwen3", type=Path, required=True, help="a Qwen3 model folder (q/k norms)")
    args = ap.parse_args(argv)
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from megatron.core import parallel_state

        from workers.backends.megatron import make_backend

        vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
        results = {"tp2": run_steps(make_backend(tiny_spec(args.model, tp=2), args.model), vocab)}
        parallel_state.destroy_model_parallel()  # same two processes, now as two data-parallel ranks
        backend = make_backend(tiny_spec(args.model, dp=2), args.model)
        results["dp2"] = run_steps(backend, vocab, dp_part=backend.dp_rank)
        parallel_state.destroy_model_parallel()  # and now as two pipeline stages
        results["pp2"] = run_pp2(args.model, vocab, args.out.parent)
        parallel_state.destroy_model_parallel()  # Qwen3's q/k norms: replicated weights, TP-split heads
        qwen3_vocab = json.loads((args.qwen3 / "config.json").read_text())["vocab_size"]
        results["qwen3_tp2"] = run_steps(make_backend(tiny_spec(args.qwen3, tp=2), args.qwen3), qwen3_vocab)
        torch.save(results, args.out if rank == 0 else args.out.with_suffix(f".rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
