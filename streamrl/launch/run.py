"""`streamrl launch`: a job spec in, a finished run folder out.

    streamrl launch JOB.yaml [--set k=v] [--run-dir DIR] [--dry-run] [--resume RUN_DIR]

The run folder (default runs/<job name>-<timestamp>):

    job.yaml          the resolved spec every role reads (overrides applied, defaults filled in)
    plan.json         the processes, addresses and resources (streamrl/launch/plan.py)
    started_at        the run's time origin for every metrics record
    logs/             <process>.log (stdout and stderr), <role>.jsonl (structured), launcher.jsonl
    metrics.jsonl     learner and eval records; metrics-generator-*.jsonl; tb/
    checkpoints/      step_NNNNNN/{learner/, buffer.snapshot}, latest
    summary.json      written at the end: steps, wall time, eval at start and end, group counts

`--resume RUN_DIR` continues that folder from its latest checkpoint (JOB defaults to its job.yaml).
Exit status: 0 the learner finished, 130 stopped by a signal (after a checkpoint), 1 failed,
2 bad spec or arguments.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from rich.console import Console

from streamrl import checkpoint, log
from streamrl.config import JobSpec
from streamrl.config_load import dump_job, load_job_or_exit
from streamrl.errors import ConfigError
from streamrl.launch.plan import Plan, plan, ports_needed, to_json
from streamrl.launch.supervisor import Outcome
from streamrl.launch.view import MetricsTail, ProgressView, print_plan

EXIT_CODES = {"completed": 0, "interrupted": 130, "failed": 1}


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports free right now (all held open until all are found, so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def default_run_dir(spec: JobSpec) -> Path:
    return Path("runs") / f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def resolve_model(spec: JobSpec, console: Console) -> str:
    """The model folder: `model.path`, or the tiny model (built once and cached, with progress)."""
    if spec.model.path is not None:
        if spec.launcher.kind == "local" and not Path(spec.model.path).is_dir():
            raise ConfigError(f"model.path: {spec.model.path} is not a folder on this host")
        return spec.model.path
    from streamrl import tiny

    assert spec.model.tiny is not None
    console.print(f"model: tiny {spec.model.tiny} (built on first use, then cached)", highlight=False)
    return str(tiny.ensure(spec.model.tiny, progress=True))


def latest_checkpoint_dir(run_dir: Path) -> str | None:
    step = checkpoint.latest(run_dir)
    return None if step is None else str(checkpoint.step_dir(run_dir, step))


def launch(
    spec: JobSpec,
    run_dir: Path,
    *,
    resume_step: int | None = None,
    console: Console | None = None,
    max_wall_s: float | None = None,
) -> tuple[Outcome, dict[str, Any]]:
    """Run the job to its end in `run_dir`; returns the outcome and the summary written there."""
    console = console or Console()
    t0 = time.monotonic()
    run_dir = Path(run_dir).resolve()
    model_dir = resolve_model(spec, console)  # before anything is written: a bad path leaves no run folder
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    log.configure("launcher", level=spec.logging.level, json_file=run_dir / "logs" / "launcher.jsonl")
    (run_dir / "job.yaml").write_text(dump_job(spec))
    from streamrl.metrics import run_started_at

    run_started_at(run_dir)  # metrics of every role share this time origin (kept on --resume)
    initial = None if resume_step is None else str(checkpoint.step_dir(run_dir, resume_step))
    with ExitStack() as stack:
        view = stack.enter_context(ProgressView(run_dir, spec.name, spec.train.steps, console))
        common: dict[str, Any] = dict(
            latest_checkpoint=lambda: latest_checkpoint_dir(run_dir),
            initial_checkpoint=initial,
            on_tick=view.refresh,
            max_wall_s=max_wall_s,
        )
        if spec.launcher.kind == "ray":
            from streamrl.launch.ray import launch_ray

            outcome = launch_ray(spec, run_dir, model_dir=model_dir, resume_step=resume_step, **common)
        else:
            from streamrl.launch.local import run_local

            p = plan(
                spec,
                run_dir,
                model_dir=model_dir,
                ports=free_ports(ports_needed(spec)),
                resume_step=resume_step,
            )
            write_plan(p)
            outcome = run_local(p, **common)
    summary = summarize(run_dir, spec, outcome, time.monotonic() - t0)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return outcome, summary


def write_plan(p: Plan) -> None:
    (Path(p.run_dir) / "plan.json").write_bytes(to_json(p) + b"\n")


def _eval_point(r: dict[str, Any] | None) -> dict[str, Any] | None:
    if r is None:
        return None
    keep = {"step", "wall_s"} | {k for k in r if k.endswith("_acc")}
    return {k: r[k] for k in r if k in keep}


def summarize(run_dir: Path, spec: JobSpec, outcome: Outcome, wall_s: float) -> dict[str, Any]:
    """summary.json: what the run did, from metrics.jsonl and the final buffer snapshot."""
    records = MetricsTail(run_dir / "metrics.jsonl").read()
    learner = [r for r in records if r.get("role") == "learner"]
    evals = [r for r in records if r.get("role") == "eval"]
    groups: dict[str, Any] = {"dispatched": None, "trained": None, "dropped": None}
    ckpt: int | None = None
    try:
        ckpt = checkpoint.latest(run_dir)
    except ConfigError as e:
        groups["error"] = str(e)
    if ckpt is not None:
        from streamrl.buffer import read_snapshot

        snap = read_snapshot(checkpoint.step_dir(run_dir, ckpt) / checkpoint.BUFFER_SNAPSHOT)
        c = snap.counters
        dropped = {k.removeprefix("dropped_"): v for k, v in c.items() if k.startswith("dropped_")}
        groups = {
            "dispatched": c.get("dispatched", 0) - c.get("redispatched", 0),  # distinct prompts
            "trained": snap.trained_groups,
            "dropped": sum(dropped.values()),
            "dropped_by_reason": dropped,
            "redispatched": c.get("redispatched", 0),
            "snapshot_step": snap.step,
        }
    steps = max((int(r["step"]) + 1 for r in learner if "step" in r), default=0)
    if not learner and ckpt is not None:
        steps = ckpt + 1
    return {
        "job": spec.name,
        "status": outcome.status,
        "reason": outcome.reason,
        "steps": steps,
        "steps_planned": spec.train.steps,
        "wall_s": round(wall_s, 2),
        "train_wall_s": learner[-1].get("wall_s") if learner else None,
        "eval": {
            "start": _eval_point(evals[0] if evals else None),
            "end": _eval_point(evals[-1] if evals else None),
        },
        "groups": groups,
        "restarts": outcome.restarts,
        "exit_codes": outcome.exit_codes,
        "checkpoint": ckpt,
        "run_dir": str(run_dir),
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="streamrl launch", description="run a job: plan, start, supervise, summarise"
    )
    ap.add_argument("job", nargs="?", help="job spec YAML (default with --resume: RUN_DIR/job.yaml)")
    ap.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
        help="override a field of the spec (repeatable), e.g. --set buffer.max_staleness=2",
    )  # fmt: skip
    ap.add_argument("--run-dir", type=Path, help="run folder (default runs/<job name>-<timestamp>)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan; start and write nothing")
    ap.add_argument(
        "--resume", type=Path, metavar="RUN_DIR", help="continue RUN_DIR from its latest checkpoint"
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.job is None and args.resume is None:
        ap.error("give a job spec, or --resume RUN_DIR")
    if args.resume is not None and args.run_dir is not None and args.run_dir != args.resume:
        ap.error("--resume continues RUN_DIR in place: leave out --run-dir")
    spec = load_job_or_exit(args.job or args.resume / "job.yaml", args.overrides)
    run_dir: Path = (args.resume or args.run_dir or default_run_dir(spec)).resolve()
    console = Console()
    try:
        resume_step = checkpoint.require_latest(run_dir) if args.resume is not None else None
        if args.dry_run:
            model = spec.model.path or f"<tiny {spec.model.tiny} model, built on first launch>"
            print_plan(plan(spec, run_dir, model_dir=model, resume_step=resume_step), console)
            return 0
        if args.resume is None and (run_dir / "job.yaml").exists():
            raise ConfigError(
                f"{run_dir} already holds a run: --resume {run_dir}, or choose another --run-dir"
            )
        outcome, summary = launch(spec, run_dir, resume_step=resume_step, console=console)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    console.print(
        f"{outcome.status}: {outcome.reason} · {summary['steps']}/{spec.train.steps} steps in "
        f"{summary['wall_s']:.0f} s · {run_dir / 'summary.json'}",
        highlight=False,
    )
    return EXIT_CODES[outcome.status]
