"""Helpers for the fault tests of real runs (test_faults.py): start `streamrl launch` as a process,
watch its run folder, find and kill the processes of its roles, and check the final ledger.

A run here is the real system (buffer, embedded engine, generator with its reward pool and
sandbox, hf learner) on a random tiny model, made small enough that a step takes about a second
on 2 busy cores: what dominates is starting processes, so kills are paced by observed progress
(learner steps in metrics.jsonl), never by sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from streamrl import checkpoint
from streamrl.buffer import BufferSnapshot, read_snapshot

ROOT = Path(__file__).resolve().parents[3]
RUN_TIMEOUT_S = 240.0  # one launch, restarts included; every wait below is bounded by this

# Small and fast: random weights (so every reward is 0 and RoC, which rejects equal rewards, is off),
# few tokens, 2 groups of 4 per step, a checkpoint every 4 steps, no evaluation.
SMALL = [
    "model.tiny=null",
    "rollout.n_samples=4",
    "rollout.max_new_tokens=8",
    "rollout.concurrency=16",
    "buffer.groups_per_step=2",
    "roc.enabled=false",
    "learner.checkpoint_every=4",
    "eval.every_steps=0",
    "data.eval=null",
    "launcher.on_failure=restart",
    "launcher.max_restarts=3",
]


class Run:
    """One `streamrl launch` (or `--resume`) process and its run folder."""

    def __init__(self, run_dir: Path, argv: list[str]) -> None:
        self.run_dir = run_dir
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        self.out = run_dir.parent / f"{run_dir.name}-launch-{int(time.time() * 1000)}.out"
        with open(self.out, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "streamrl", "launch", *argv],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**os.environ, "COLUMNS": "120"},
            )
        self.started = time.monotonic()
        self.seen: dict[int, psutil.Process] = {}  # every descendant seen while watching

    @classmethod
    def start(
        cls,
        run_dir: Path,
        model: Path,
        steps: int,
        job: str = "configs/tiny-arith.yaml",
        extra: Sequence[str] = (),
    ) -> Run:
        sets = [f"model.path={model}", f"train.steps={steps}", *SMALL, *extra]
        return cls(run_dir, [job, "--run-dir", str(run_dir), *(a for s in sets for a in ("--set", s))])

    @classmethod
    def resume(cls, run_dir: Path) -> Run:
        return cls(run_dir, ["--resume", str(run_dir)])

    # ------------------------------------------------------------------ watching

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def describe(self) -> str:
        """What a failure message needs: the launcher's output and the tail of every role's log."""
        parts = [f"launcher output:\n{self.output()[-3000:]}"]
        for log in sorted((self.run_dir / "logs").glob("*.log")):
            parts.append(f"--- {log.name}:\n{log.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)

    def wait_for(self, predicate: Callable[[], bool], what: str, timeout_s: float = RUN_TIMEOUT_S) -> None:
        """Poll until `predicate`; fail (with the logs) if the launcher exits first or time runs out."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            self.processes()  # note the descendants, for the leftover check
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the launcher exited ({self.proc.returncode}) before {what}\n{self.describe()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout_s:.0f} s waiting for {what}\n{self.describe()}"
                )
            time.sleep(0.1)

    def learner_steps(self) -> list[int]:
        """Step numbers of the learner's metrics records, in the order they were written."""
        return [r["step"] for r in metrics(self.run_dir) if r.get("role") == "learner"]

    def wait_steps(self, n: int, after: int = 0, timeout_s: float = RUN_TIMEOUT_S) -> None:
        """Until `n` more learner records than `after` were written."""
        self.wait_for(lambda: len(self.learner_steps()) >= after + n, f"{after + n} learner steps", timeout_s)

    def finish(self, timeout_s: float = RUN_TIMEOUT_S) -> int:
        """The launcher's exit status (killing it, with the logs in the failure, if it hangs)."""
        deadline = self.started + timeout_s
        while (rc := self.proc.poll()) is None:
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(
                    f"the launcher did not finish within {timeout_s:.0f} s\n{self.describe()}"
                )
            self.processes()  # note the descendants, for the leftover check
            time.sleep(0.2)
        return rc

    def kill(self) -> None:
        """Stop a launcher that is still running (a failed test): SIGTERM, and a second one (which
        skips the learner's checkpoint wait), then SIGKILL; its roles get SIGTERM when it dies."""
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                return
            self.proc.send_signal(sig)
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue

    def leftovers(self, timeout_s: float = 15.0) -> list[str]:
        """Processes of this run seen while it ran that are still alive after the launcher exited
        (each psutil.Process checks its start time too, so a recycled pid does not count)."""
        deadline = time.monotonic() + timeout_s
        while True:
            alive = []
            for p in self.seen.values():
                try:
                    if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                        alive.append(f"{p.pid} {' '.join(p.cmdline())[:150]}")
                except psutil.NoSuchProcess:
                    continue
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.2)

    def summary(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "summary.json").read_text())

    # ------------------------------------------------------------------ its processes

    def processes(self, *fragments: str, parent: int | None = None) -> list[psutil.Process]:
        """The launcher's live descendants whose command line contains every fragment (only the
        direct children of `parent` when given: a sandbox worker's forked jobs share its command)."""
        found = []
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for p in children:
            self.seen.setdefault(p.pid, p)
            try:
                cmd = " ".join(p.cmdline())
                if parent is not None and p.ppid() != parent:
                    continue
                if all(f in cmd for f in fragments) and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except psutil.NoSuchProcess:
                continue
        return found

    def one(
        self,
        *fragments: str,
        parent: int | None = None,
        besides: Sequence[int] = (),
        timeout_s: float = 120.0,
    ) -> psutil.Process:
        """The single live process matching `fragments` (and not among `besides`), waiting for it."""
        box: list[psutil.Process] = []

        def found() -> bool:
            box[:] = [p for p in self.processes(*fragments, parent=parent) if p.pid not in besides]
            return len(box) >= 1

        self.wait_for(found, f"a process {' '.join(fragments)!r}", timeout_s)
        assert len(box) == 1, f"expected one process {fragments}, found {[p.cmdline() for p in box]}"
        return box[0]

    def kill9(self, *fragments: str, parent: int | None = None) -> int:
        """kill -9 the one process matching `fragments`, wait until it is dead; returns its pid."""
        p = self.one(*fragments, parent=parent)
        kill9(p)
        return p.pid


def kill9(p: psutil.Process) -> None:
    """SIGKILL and wait until `p` is dead: gone, or a zombie its parent has not reaped yet (a
    sandbox pool reaps an idle worker only when it next hands it a job)."""
    p.kill()
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)
    raise AssertionError(f"pid {p.pid} survived SIGKILL for 10 s")


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # the last line, being written
            continue
    return out


def launcher_events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "logs" / "launcher.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def final_snapshot(run_dir: Path) -> BufferSnapshot:
    step = checkpoint.require_latest(run_dir)
    return read_snapshot(checkpoint.step_dir(run_dir, step) / checkpoint.BUFFER_SNAPSHOT)


def ledger_problems(snap: BufferSnapshot, steps: int, groups_per_step: int) -> list[str]:
    """Everything wrong with the books of a finished run (empty when no group was lost or trained twice).

    Every prompt ever dispatched has a ledger entry; at the end each is trained exactly once, dropped
    with a reason, or still held by the buffer: queued for re-dispatch or ready (a snapshot has no
    in-flight set: what was in flight is in `redispatch`). Nothing is left delivered-but-untrained.
    """
    problems = []
    held_ready = {rg.group.uid for rg in snap.ready}
    held_queued = {p.uid for p in snap.redispatch}
    by_state: dict[str, int] = {}
    for uid, e in snap.ledger.items():
        by_state[e.state] = by_state.get(e.state, 0) + 1
        if e.trained_count > 1:
            problems.append(f"uid {uid} trained {e.trained_count} times")
        if e.state == "trained" and e.trained_count != 1:
            problems.append(f"uid {uid} is trained with trained_count {e.trained_count}")
        if e.state != "trained" and e.trained_count:
            problems.append(f"uid {uid} is {e.state} but was counted trained {e.trained_count} times")
        if e.state == "dropped" and not e.reason:
            problems.append(f"uid {uid} was dropped without a reason")
        if e.state == "ready" and uid not in held_ready:
            problems.append(f"uid {uid} is ready but not in the ready queue")
        if e.state == "dispatched" and uid not in held_queued:
            problems.append(f"uid {uid} is dispatched but neither in flight nor queued: lost")
        if e.state == "delivered":
            problems.append(f"uid {uid} was delivered at step {e.step} and never trained")
        if e.dispatches < 1:
            problems.append(f"uid {uid} has a ledger entry but was never dispatched")
    for uid in held_ready | held_queued:
        if uid not in snap.ledger:
            problems.append(f"uid {uid} is held by the buffer but has no ledger entry")
    if ready_and_queued := held_ready & held_queued:
        problems.append(f"uids both ready and queued for re-dispatch: {sorted(ready_and_queued)}")
    trained = by_state.get("trained", 0)
    if trained != steps * groups_per_step or snap.trained_groups != trained:
        problems.append(
            f"{trained} ledger entries trained, snapshot counts {snap.trained_groups}, "
            f"expected {steps} steps x {groups_per_step} groups = {steps * groups_per_step}"
        )
    if sorted(snap.ledger) != list(range(snap.cursor)):
        problems.append(f"ledger uids are not 0..{snap.cursor - 1}: a dispatched prompt has no entry")
    if snap.step != steps - 1:
        problems.append(f"the final snapshot is of step {snap.step}, expected {steps - 1}")
    return problems
