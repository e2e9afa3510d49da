"""Replay-buffer throughput: trajectories per second through admission, RoC and batch formation.

What is timed, on one core: the buffer dispatching prompts under the staleness rule, taking
complete groups (consistency checks, ordering by sample index, RoC 2G -> G with the penalty regexes
over rStar2-style texts, GRPO advantages), forming batches of B groups and retiring them with a
weight-version bump. Decoding is the transport's job and is excluded (bench/transport.py times it).
The limit is the same trajectory objects merely appended to and popped from a deque: the cost of
moving them at all in Python.

    python -m bench.buffer [--quick]
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import time

from bench.common import emit, print_table
from streamrl import messages as m
from streamrl.buffer import ReplayBuffer
from streamrl.config import (
    BufferConfig,
    DataConfig,
    JobSpec,
    ModelConfig,
    RocSection,
    RolloutConfig,
    SyntheticArithData,
)
from streamrl.data import train_source

TOOL_TURN = (
    "<|im_end|>\n<|im_start|>user\n<tool_response>\nTool call success\nstdout: {out}\n\nexecution time: 0.01s"
    "\n</tool_response><|im_end|>\n<|im_start|>assistant\n<reason>"
)


def rstar_text(rng: random.Random) -> str:
    body = "Let me compute this with Python. " * 6
    turns = "".join(
        TOOL_TURN.format(out=rng.choice(["42", "NameError at line 2: x"])) for _ in range(rng.randint(0, 3))
    )
    return f"{body}</reason>{turns}<answer>\\boxed{{42}}</answer><|im_end|>"


def template_groups(n_groups: int, n: int, tokens: int, seed: int) -> list[list[m.Trajectory]]:
    rng = random.Random(seed)
    zeros = m.pack("tokens", [0] * tokens)
    groups = []
    for _ in range(n_groups):
        p_correct = rng.choice([0.02, 0.2, 0.5, 0.8, 0.98])
        trajs = [
            m.Trajectory(
                sample_index=i,
                tokens=zeros,
                loss_mask=m.pack("loss_mask", [1] * tokens),
                logprobs=m.pack("logprobs", [-0.5] * tokens),
                versions=zeros,
                reward=float(rng.random() < p_correct),
                finish_reason="stop",
                text=rstar_text(rng),
            )
            for i in range(n)
        ]
        rng.shuffle(trajs)  # arrival order
        groups.append(trajs)
    return groups


def run_buffer(args: argparse.Namespace, templates: list[list[m.Trajectory]]) -> tuple[float, ReplayBuffer]:
    spec = JobSpec(
        name="bench",
        model=ModelConfig(tiny="arith"),
        data=DataConfig(train=SyntheticArithData(size=100_000)),
        rollout=RolloutConfig(n_samples=args.n),
        roc=RocSection(enabled=True, down_sample_to_n=args.n // 2),
        buffer=BufferConfig(groups_per_step=args.batch_groups, max_staleness=2),
    )
    buf = ReplayBuffer(spec, *train_source(spec.data))
    prompt_tokens = m.pack("prompt_tokens", list(range(64)))
    step = trajectories = 0
    t0 = time.perf_counter()
    while trajectories < args.trajectories:
        for p in buf.admit("gen-0", 64):
            trajs = templates[p.uid % len(templates)]
            group = m.Group(
                uid=p.uid,
                prompt_id=p.prompt_id,
                admitted_version=p.admitted_version,
                generator="gen-0",
                prompt_tokens=prompt_tokens,
                trajectories=list(trajs),
            )
            buf.add_group(group)
            trajectories += len(trajs)
        while buf.next_batch(step) is not None:
            buf.on_weights_published(step + 1, step)
            step += 1
    return trajectories / (time.perf_counter() - t0), buf


def run_deque(args: argparse.Namespace, templates: list[list[m.Trajectory]]) -> float:
    q: collections.deque[m.Trajectory] = collections.deque()
    done = 0
    t0 = time.perf_counter()
    while done < args.trajectories:
        for trajs in templates:
            for t in trajs:
                q.append(t)
            while q:
                q.popleft()
                done += 1
    return done / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--n", type=int, default=32, help="trajectories per group (2G)")
    ap.add_argument("--batch-groups", type=int, default=8, help="B")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--trajectories", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=0)
    args = ap.parse_args()
    args.trajectories = args.trajectories or (100_000 if args.quick else 400_000)
    args.repeats = args.repeats or (3 if args.quick else 5)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core, as specified
    templates = template_groups(64, args.n, args.tokens, seed=0)
    run_buffer(argparse.Namespace(**{**vars(args), "trajectories": 10_000}), templates)  # warm-up
    results, deque_rates, buf = [], [], None
    for _ in range(args.repeats):
        rate, buf = run_buffer(args, templates)
        results.append(rate)
        deque_rates.append(run_deque(args, templates))
    value = sorted(results)[len(results) // 2]
    limit = sorted(deque_rates)[len(deque_rates) // 2]
    c = buf.counters
    keep = c["trajectories_kept"] / max(c["trajectories_in"], 1)
    print_table(
        ["path", "trajectories/s", "groups/s", "x of target 50k"],
        [
            ["streamrl buffer (admit, RoC, GRPO, batch)", value, value / args.n, value / 50_000],
            ["deque append + popleft", limit, limit / args.n, limit / 50_000],
        ],
        title=f"replay buffer, one core, 2G={args.n}, B={args.batch_groups}, median of {args.repeats}",
    )
    print(f"RoC keep rate {keep:.2f}; groups filtered (equal reward) {c['dropped_roc_equal_reward']}")
    emit(
        "buffer",
        "trajectories_per_s",
        value,
        "deque_trajectories_per_s",
        limit,
        config=vars(args),
        target=50_000,
    )


if __name__ == "__main__":
    main()
