"""Learner throughput on CPU: tokens per second of a full train step (forward, loss, backward, clip,
AdamW, LR schedule) on the tiny model, against a hand-written plain torch loop.

    python -m bench.learner [--quick] [--backend hf|megatron|all] [--sequences 32] [--threads 1]

The model is streamrl.tiny.random_model_dir shaped like the warm-started arith tiny (Qwen2, hidden
128, 4 layers, 4 heads, 2 KV heads, intermediate 512, streamrl's tokenizer): weights do not change
the cost. One batch of `--sequences` trajectories in groups of 8 (prompt `--prompt-tokens`, responses
of random length up to `--response-tokens`, GRPO-like random advantages) is packed once by
streamrl.microbatch into micro-batches of at most `--micro-batch-tokens` padded tokens.

- value: `backend.train_step(micro_batches, loss_fn)` of workers/backends/hf.py with
  streamrl.losses' loss (token-mean, clip-higher, dual clip), tokens = real (unpadded) tokens.
- limit: the same micro-batches through the least a learner must do, written inline: forward,
  float32 log_softmax + gather, a -A * logp token-mean loss, backward, torch AdamW step. No
  clipping, metrics, ratio or entropy: what remains is the backend's overhead.
- also shown: the backend's `logprobs()` (the proximal recompute of decoupled PPO, no grad), and
  with `--backend megatron|all` workers/backends/megatron.py's train step when that module exists.
Paths are warmed up once, then timed runs are interleaved (the load of a shared machine drifts);
medians are reported.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import emit, print_table
from streamrl import messages as m
from streamrl.config import (
    AlgorithmConfig,
    DataConfig,
    JobSpec,
    LearnerConfig,
    ModelConfig,
    SyntheticArithData,
)
from streamrl.log import configure
from streamrl.losses import make_loss_fn
from streamrl.microbatch import build_micro_batches
from workers.backends.base import MicroBatch

GROUP = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, under 30 s")
    p.add_argument("--backend", choices=["hf", "megatron", "all"], default="hf")
    p.add_argument("--sequences", type=int, default=None, help="trajectories per step (default 32; quick 8)")
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument(
        "--response-tokens", type=int, default=None, help="max response length (default 256; quick 96)"
    )
    p.add_argument("--micro-batch-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=None, help="timed steps per path (default 5; quick 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest on a shared machine)")
    args = p.parse_args(argv)
    args.sequences = args.sequences or (8 if args.quick else 32)
    args.response_tokens = args.response_tokens or (96 if args.quick else 256)
    args.repeats = args.repeats or (3 if args.quick else 5)
    return args


def make_batch(args: argparse.Namespace, vocab: int) -> m.Batch:
    rng = np.random.default_rng(0)
    groups, advantages = [], []
    for g in range(0, args.sequences, GROUP):
        trajs = []
        for j in range(min(GROUP, args.sequences - g)):
            n = int(rng.integers(args.response_tokens // 2, args.response_tokens + 1))
            trajs.append(
                m.Trajectory(
                    sample_index=j,
                    tokens=m.pack("tokens", rng.integers(0, vocab, n)),
                    loss_mask=m.pack("loss_mask", np.ones(n)),
                    logprobs=m.pack("logprobs", -rng.random(n) * 5),
                    versions=m.pack("versions", np.zeros(n)),
                    reward=0.0,
                    finish_reason="stop",
                )
            )
        groups.append(
            m.Group(
                uid=g,
                prompt_id=str(g),
                admitted_version=0,
                generator="bench",
                prompt_tokens=m.pack("prompt_tokens", rng.integers(0, vocab, args.prompt_tokens)),
                trajectories=trajs,
            )
        )
        advantages.append(m.pack("advantages", rng.standard_normal(len(trajs))))
    return m.Batch(step=0, policy_version=0, groups=groups, advantages=advantages)


def job_spec(model_dir: Path, backend: str, args: argparse.Namespace) -> JobSpec:
    return JobSpec(
        name="bench-learner",
        model=ModelConfig(path=str(model_dir), dtype="float32"),
        data=DataConfig(train=SyntheticArithData()),
        learner=LearnerConfig(
            backend=backend,  # type: ignore[arg-type]
            lr=1e-6,
            micro_batch_tokens=args.micro_batch_tokens,
            threads=args.threads,
        ),
    )


def plain_torch_step(model_dir: Path) -> Callable[[list[MicroBatch]], None]:
    """The raw limit: forward, log_softmax gather, -A logp token mean, backward, AdamW."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def step(mbs: list[MicroBatch]) -> None:
        for mb in mbs:
            logits = model(input_ids=mb.input_ids, use_cache=False).logits
            lp = logits[:, :-1].float().log_softmax(-1).gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)
            mask = mb.loss_mask[:, 1:]
            loss = -(lp * mb.advantages[:, 1:] * mask).sum() / mask.sum() / len(mbs)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def train_path(backend: Any, mbs: list[MicroBatch], loss_fn: Any) -> Callable[[], Any]:
    return lambda: backend.train_step(mbs, loss_fn)


def logprobs_path(backend: Any, mbs: list[MicroBatch]) -> Callable[[], Any]:
    return lambda: [backend.logprobs(mb) for mb in mbs]


def ensure_process_group() -> None:
    """Megatron's backend is built after torch.distributed is initialised (world size 1 here)."""
    import socket

    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure(role="bench-learner", level="warning", stream=sys.stderr)  # stdout: the table and the JSON
    torch.set_num_threads(args.threads)
    from streamrl.tiny import random_model_dir

    backends = ["hf", "megatron"] if args.backend == "all" else [args.backend]
    megatron_found = importlib.util.find_spec("workers.backends.megatron") is not None
    if "megatron" in backends and not megatron_found:
        if args.backend == "megatron":
            raise SystemExit("--backend megatron: workers/backends/megatron.py does not exist yet")
        backends.remove("megatron")

    with tempfile.TemporaryDirectory(prefix="bench-learner-") as tmp:
        model_dir = random_model_dir(Path(tmp) / "model", seed=0, hidden=128, layers=4, heads=4, kv_heads=2)
        from transformers import AutoConfig

        vocab = int(AutoConfig.from_pretrained(model_dir).vocab_size)
        batch = make_batch(args, vocab)
        mbs = build_micro_batches(batch, args.micro_batch_tokens)
        tokens = sum(mb.num_tokens for mb in mbs)
        padded = sum(mb.input_ids.numel() for mb in mbs)
        loss_fn = make_loss_fn(AlgorithmConfig(), None, micro_batches=len(mbs))

        plain = plain_torch_step(model_dir)
        paths: dict[str, Callable[[], Any]] = {"plain": lambda: plain(mbs)}
        for name in backends:
            if name == "megatron":
                ensure_process_group()
            module = importlib.import_module(f"workers.backends.{name}")
            paths[name] = train_path(
                module.make_backend(job_spec(model_dir, name, args), model_dir), mbs, loss_fn
            )
            if name == "hf":
                paths["hf_logprobs"] = logprobs_path(
                    module.make_backend(job_spec(model_dir, name, args), model_dir), mbs
                )

        for run in paths.values():  # warm-up
            run()
        times: dict[str, list[float]] = {k: [] for k in paths}
        names = list(paths)
        for r in range(args.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                t0 = time.perf_counter()
                paths[name]()
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: tokens / v for k, v in med.items()}

    labels = {
        "plain": "plain torch loop (limit)",
        "hf": "hf backend train_step",
        "megatron": "megatron backend train_step",
        "hf_logprobs": "hf backend logprobs (no grad)",
    }
    rows = [[labels[k], len(mbs), tokens, med[k] * 1e3, tps[k], tps[k] / tps["plain"]] for k in paths]
    print_table(
        ["path", "micro-batches", "tokens", "ms/step", "tokens/s", "vs limit"],
        rows,
        f"Learner step, tiny Qwen2 on CPU ({args.threads} thread(s)), padding efficiency {tokens / padded:.2f}",
    )
    main_path = "hf" if "hf" in tps else backends[0]
    emit(
        "learner",
        f"{main_path}_learner_tokens_per_s",
        tps[main_path],
        "plain_torch_train_tokens_per_s",
        tps["plain"],
        vars(args),
        tokens_per_step=tokens,
        micro_batches=len(mbs),
        padding_efficiency=tokens / padded,
        megatron_learner_tokens_per_s=tps.get("megatron"),
        megatron_found=megatron_found,
        hf_logprobs_tokens_per_s=tps.get("hf_logprobs"),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
