"""Synchronous vs asynchronous RL, side by side: the same tiny job with `buffer.max_staleness` 0 and 2.

    python -m bench.e2e [--job configs/tiny-arith.yaml] [--target 0.45] [--quick] [--out DIR]

Each mode is one real `streamrl launch` run (every role a process, as a user runs it). Reported per
mode: wall time until the held-out greedy accuracy first reaches the target (from the periodic
evaluations), trained tokens/s, the learner's and generators' idle ratios, and the staleness
histogram of trained groups. The last line is JSON; its `ratio` is async/sync wall time to target
(the goal is <= 0.7: generation and training overlap instead of taking turns).

In sync mode (eta = 0) the buffer admits only prompts for the current policy, so the engine idles
while the learner trains and the learner idles while the engine samples. With eta = 2 both stay busy,
at the price of off-policy tokens (the histogram shows how far behind they were).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import emit, print_table
from streamrl.metrics import read_metrics
from streamrl.report import time_to_accuracy

ROOT = Path(__file__).resolve().parents[1]
MODES = {"sync": 0, "async": 2}


def run_mode(job: Path, eta: int, run_dir: Path, extra: list[str]) -> float:
    """Launch the job as a user would; returns the launcher's wall seconds."""
    sets = ["--set", f"buffer.max_staleness={eta}", *(a for s in extra for a in ("--set", s))]
    cmd = [sys.executable, "-m", "streamrl", "launch", str(job), "--run-dir", str(run_dir), *sets]
    t0 = time.monotonic()
    with (run_dir.parent / f"{run_dir.name}.out").open("wb") as out:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{run_dir.name}: streamrl launch exited {proc.returncode}; see {run_dir}/logs")
    return time.monotonic() - t0


def time_to_target_without_eval(evals: list[dict[str, Any]], target: float) -> float | None:
    """Wall seconds to the first evaluation at `target`, minus the time spent evaluating until then.

    Evaluation blocks the learner for the same work in both modes (the generator keeps sampling
    meanwhile in both), and at this frequency it would otherwise be a third of the run.
    """
    spent = 0.0
    for e in evals:
        spent += e.get("eval_s", 0.0)
        if (e.get("greedy_acc") or 0.0) >= target:
            return e["wall_s"] - spent
    return None


def mode_stats(run_dir: Path, target: float) -> dict[str, Any]:
    records = read_metrics(run_dir)
    learner = [r for r in records if r.get("role") == "learner"]
    evals = [r for r in records if r.get("role") == "eval"]
    gens = [r for r in records if r.get("role") == "generator" and r.get("idle_ratio") is not None]
    wall = max((r["wall_s"] for r in learner), default=0.0)
    busy = sum(r.get("train_s", 0.0) for r in learner)
    idle = sum(r.get("idle_s", 0.0) for r in learner)
    staleness: Counter[str] = Counter()
    for r in learner:
        staleness.update({k: int(v) for k, v in (r.get("staleness") or {}).items()})
    return {
        "steps": len(learner),
        "wall_s": wall,
        "time_to_target_s": time_to_accuracy(evals, target),
        "train_time_to_target_s": time_to_target_without_eval(evals, target),
        "eval_s": sum(e.get("eval_s", 0.0) for e in evals),
        "eval_start": evals[0].get("greedy_acc") if evals else None,
        "eval_best": max((e.get("greedy_acc", 0.0) for e in evals), default=None),
        "trained_tokens_per_s": sum(r.get("tokens", 0) for r in learner) / wall if wall else 0.0,
        "learner_busy_s": busy,
        "learner_idle_ratio": idle / wall if wall else None,
        "generator_idle_ratio": sum(g["idle_ratio"] for g in gens) / len(gens) if gens else None,
        "staleness": dict(sorted(staleness.items(), key=lambda kv: int(kv[0]))),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", type=Path, default=ROOT / "configs/tiny-arith.yaml")
    ap.add_argument("--target", type=float, default=0.45, help="held-out greedy accuracy to reach")
    ap.add_argument("--steps", type=int, default=None, help="override train.steps")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a short run (fewer steps, smaller eval)")
    ap.add_argument("--reuse", action="store_true", help="re-read finished runs in --out, launch no new ones")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / f"bench-e2e-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    extra = [f"eval.every_steps={args.eval_every}", "eval.sampled_n=0", "learner.checkpoint_every=0"]
    if args.quick:
        extra += ["train.steps=20", "eval.max_prompts=64"]
    elif args.steps:
        extra.append(f"train.steps={args.steps}")
    args.out.mkdir(parents=True, exist_ok=True)
    stats = {}
    for name, eta in MODES.items():
        print(f"running {name} (max_staleness={eta}) -> {args.out / name}", flush=True)
        done = args.reuse and (args.out / name / "summary.json").is_file()
        launcher_s = 0.0 if done else run_mode(args.job, eta, args.out / name, extra)
        stats[name] = {**mode_stats(args.out / name, args.target), "launcher_s": launcher_s}

    rows = [
        [
            name,
            s["steps"],
            s["train_time_to_target_s"] if s["train_time_to_target_s"] is not None else "not reached",
            s["time_to_target_s"] if s["time_to_target_s"] is not None else "not reached",
            s["wall_s"],
            s["eval_start"],
            s["eval_best"],
            s["trained_tokens_per_s"],
            s["learner_idle_ratio"],
            s["generator_idle_ratio"],
            " ".join(f"{k}:{v}" for k, v in s["staleness"].items()),
        ]
        for name, s in stats.items()
    ]
    print_table(
        [
            "mode",
            "steps",
            f"s to {args.target} w/o eval",
            "incl. eval",
            "train wall s",
            "acc start",
            "acc best",
            "trained tok/s",
            "learner idle",
            "gen idle",
            "staleness hist",
        ],
        rows,
        title=f"sync vs async on {args.job.name} (target greedy accuracy {args.target})",
    )
    sync_t, async_t = stats["sync"]["train_time_to_target_s"], stats["async"]["train_time_to_target_s"]
    if sync_t is None or async_t is None:
        # Fall back to whole-run wall time so the record still compares the two modes.
        value, limit, metric = stats["async"]["wall_s"], stats["sync"]["wall_s"], "wall_s_full_run"
    else:
        value, limit, metric = async_t, sync_t, "wall_s_to_target_without_eval"
    emit(
        "e2e",
        metric,
        value,
        "sync_" + metric,
        limit,
        {"job": str(args.job), "target": args.target, "extra": extra, "out": str(args.out)},
        goal_ratio_max=0.7,
        modes=stats,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
