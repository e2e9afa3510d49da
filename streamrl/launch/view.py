"""What the launcher shows: the plan as a table (`--dry-run`), and live progress while a job runs.

Progress is read by tailing `RUN_DIR/metrics.jsonl` (the learner's "learner" and "eval" records, see
streamrl/metrics.py), never by talking to a role. On a terminal it is a rich Live panel; otherwise
(CI, a pipe) one plain line per learner step and per evaluation.
"""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from streamrl.launch.processes import Plan
from streamrl.launch.supervisor import Supervisor


class MetricsTail:
    """New complete JSON lines of a growing file since the last call (a partial last line waits)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                if f.seek(0, 2) < self.offset:  # truncated or replaced: start over
                    self.offset, self.partial = 0, b""
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        out = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash: metrics.py skips it too
            if isinstance(record, dict):
                out.append(record)
        return out


def _fmt(value: Any, spec: str = ".3f") -> str:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return format(value, spec)
    return "-"


def step_line(r: dict[str, Any], steps: int) -> str:
    return (
        f"step {int(r.get('step', 0)) + 1}/{steps}  reward {_fmt(r.get('reward_mean'))}  "
        f"acc {_fmt(r.get('accuracy'))}  tok/s {_fmt(r.get('tokens_per_s'), '.0f')}  "
        f"staleness {_fmt(r.get('staleness_mean'), '.2f')}  sync {_fmt(r.get('sync_total_s'), '.2f')}s"
    )


def eval_line(r: dict[str, Any]) -> str:
    done = int(r.get("step", -1)) + 1  # an eval record's step is the last step trained (-1: none yet)
    when = "at start" if done == 0 else f"after {done} steps"
    return f"eval {when}: greedy {_fmt(r.get('greedy_acc'))}  sampled {_fmt(r.get('sampled_acc'))}"


class ProgressView:
    """Call `refresh(supervisor)` often (the supervisor's on_tick); it re-reads metrics at most 4x/s."""

    def __init__(self, run_dir: Path, job: str, steps: int, console: Console | None = None) -> None:
        self.console = console or Console()
        self.tail = MetricsTail(Path(run_dir) / "metrics.jsonl")
        self.run_dir, self.job, self.steps = run_dir, job, steps
        self.last: dict[str, Any] | None = None
        self.first_eval: dict[str, Any] | None = None
        self.last_eval: dict[str, Any] | None = None
        self.live: Any = None
        self._next = 0.0
        self._phase = ""
        self._sup: Supervisor | None = None

    def __enter__(self) -> ProgressView:
        if self.console.is_terminal:
            from rich.live import Live

            self.live = Live(console=self.console, refresh_per_second=4, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._sup is not None:
            self.refresh(self._sup, force=True)  # what arrived after the last tick
        if self.live is not None:
            self.live.__exit__(None, None, None)
            self.live = None

    def refresh(self, sup: Supervisor, force: bool = False) -> None:
        now = time.monotonic()
        self._sup = sup
        if now < self._next and not force:
            return
        self._next = now + 0.25
        for r in self.tail.read():
            if r.get("role") == "learner":
                self.last = r
                if self.live is None:
                    self.console.print(step_line(r, self.steps), highlight=False, markup=False)
            elif r.get("role") == "eval":
                self.first_eval = self.first_eval or r
                self.last_eval = r
                if self.live is None:
                    self.console.print(eval_line(r), highlight=False, markup=False)
        if self.live is not None:
            self.live.update(self.render(sup))
        elif sup.phase != self._phase:
            self._phase = sup.phase
            self.console.print(f"{self.job}: {sup.phase}", highlight=False, markup=False)

    def render(self, sup: Supervisor) -> RenderableType:
        done = int(self.last["step"]) + 1 if self.last else 0
        r = self.last or {}
        metrics = Table.grid(padding=(0, 2))
        for _ in range(4):
            metrics.add_column()
        metrics.add_row("reward", _fmt(r.get("reward_mean")), "accuracy", _fmt(r.get("accuracy")))
        metrics.add_row(
            "tokens/s", _fmt(r.get("tokens_per_s"), ".0f"), "staleness", _fmt(r.get("staleness_mean"), ".2f")
        )
        metrics.add_row(
            "sync s", _fmt(r.get("sync_total_s"), ".2f"), "elapsed s", f"{time.monotonic() - sup.started:.0f}"
        )
        if self.last_eval is not None:
            first = self.first_eval or {}
            metrics.add_row(
                "eval greedy",
                f"{_fmt(first.get('greedy_acc'))} -> {_fmt(self.last_eval.get('greedy_acc'))}",
                "eval sampled",
                f"{_fmt(first.get('sampled_acc'))} -> {_fmt(self.last_eval.get('sampled_acc'))}",
            )
        procs = Table(box=None, padding=(0, 1), show_header=True, header_style="dim")
        for col in ("process", "state", "pid", "restarts"):
            procs.add_column(col)
        for p in sup.procs:
            pid = p.handle.pid if p.handle is not None and p.handle.pid else "-"
            state = p.state if p.rc is None else f"{p.state} ({p.rc})"
            procs.add_row(p.spec.name, state, str(pid), str(sup.restarts.get(p.spec.gang_name, 0)))
        bar = Group(
            Text(f"step {done}/{self.steps}"), ProgressBar(total=self.steps, completed=done, width=50)
        )
        title = f"streamrl · {self.job} · {sup.phase}"
        return Panel(Group(bar, Text(""), metrics, Text(""), procs), title=title, subtitle=str(self.run_dir))


def _short(urls: list[str], keep: int = 4) -> str:
    if len(urls) <= keep:
        return ", ".join(urls) or "-"
    return f"{len(urls)} servers: {', '.join(urls[:2])}, ..., {urls[-1]}"


def print_plan(plan: Plan, console: Console | None = None) -> None:
    """The plan as a readable table: where each process runs, with what, and its command.

    Commands abbreviate the run folder as $RUN and the model folder as $MODEL (plan.json has them
    verbatim)."""
    console = console or Console()
    say = lambda *a: console.print(*a, highlight=False)  # noqa: E731
    say(f"[bold]{plan.job}[/] · launcher {plan.kind} · {plan.nodes} node(s) x {plan.gpus_per_node} GPU(s)")
    say(f"$RUN      {plan.run_dir}")
    say(f"$MODEL    {plan.model_dir}")
    say(f"buffer    {plan.buffer_address}")
    say(f"engines   {_short(plan.engine_urls)}")
    if plan.attach_urls:
        say(f"attached  {_short(plan.attach_urls)} (started elsewhere, waited for)")
    learners = plan.by_role("learner")
    say(f"learner   {len(learners)} rank(s), MASTER {plan.master_addr}:{plan.master_port}")
    say(f"failures  {plan.restart.on_failure}, at most {plan.restart.max_restarts} restarts per role")
    if plan.resume_step is not None:
        say(f"resume    from the checkpoint of step {plan.resume_step}")
    table = Table(header_style="bold")
    for col in ("stage", "name", "node", "GPUs", "CPUs", "ranks, threads", "command"):
        table.add_column(col, overflow="fold")
    for p in plan.processes:
        env = [f"threads {p.env['OMP_NUM_THREADS']}"] if "OMP_NUM_THREADS" in p.env else []
        if p.role == "learner":
            env.insert(0, f"rank {p.rank}/{p.world_size} local {p.local_rank}")
        argv = ["python", *p.argv[1:]] if p.argv and "python" in Path(p.argv[0]).name else list(p.argv)
        if p.resume_args and plan.resume_step is not None:
            argv += p.resume_args
        cmd = shlex.join(argv).replace(plan.run_dir, "$RUN").replace(plan.model_dir, "$MODEL")
        table.add_row(
            str(p.stage),
            p.name,
            str(p.node) if plan.nodes == 1 else f"{p.node} ({plan.hosts[p.node]})",
            ",".join(map(str, p.resources.gpu_ids)) or "-",
            f"{p.resources.cpus:g}",
            ", ".join(env),
            cmd,
        )
    console.print(table)
