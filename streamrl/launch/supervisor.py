"""Start a plan's processes in stage order, watch them, restart or stop per policy, stop cleanly.

The supervisor does not know how a process is started: a `Starter` turns (ProcessSpec, argv) into a
`Handle` (a local subprocess in its own process group, or one run by a Ray actor). Everything else is
here, shared by both launchers:

* Start: stage by stage (plan.py); a stage's ready probes must pass before the next starts. A process
  that exits while we wait fails the start at once, naming it and the tail of its log.
* Run: poll every process. All learner ranks exiting 0 completes the job. Any other exit is a failure:
  with `on_failure: restart` and restarts left for its gang, a "self"-scope process is started again
  with the same argv; a "job"-scope one (buffer, learner) restarts every process from the latest
  checkpoint, so learner and buffer state stay paired. Otherwise the job stops as failed.
* Stop (job done, failure, Ctrl-C/SIGTERM): learner ranks first get SIGTERM, which means "checkpoint,
  then exit 0", and up to their `stop_grace_s` while the buffer is still up to take the snapshot;
  then the other stages in reverse order: SIGTERM to the process group, bounded wait, SIGKILL. A
  second stop request skips the waits.

Every wait is bounded: probes by their timeout, stops by the grace periods, the whole run by
`max_wall_s` when given. Nothing here blocks on a child without a deadline.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from streamrl import log
from streamrl.errors import WorkerFailed
from streamrl.launch.processes import Plan, Probe, ProcessSpec

logger = log.get_logger("streamrl.launch")
KILL_WAIT_S = 5.0
ATTACH_TIMEOUT_S = 600.0
Status = Literal["completed", "failed", "interrupted"]


class Handle(Protocol):
    """One started process. `signal` and `cleanup` address its whole process group."""

    pid: int | None

    def poll(self) -> int | None: ...

    def signal(self, sig: int) -> None: ...

    def cleanup(self) -> None:
        """After the process exited: SIGKILL whatever is left of its group, release resources."""


Starter = Callable[[ProcessSpec, list[str]], Handle]


@dataclass
class Proc:
    spec: ProcessSpec
    handle: Handle | None = None
    state: Literal["pending", "starting", "running", "exited", "stopped"] = "pending"
    rc: int | None = None
    ready_deadline: float | None = None
    """Set while a (re)started process has not passed its probe yet."""

    @property
    def alive(self) -> bool:
        return self.state in ("starting", "running")


@dataclass
class Outcome:
    status: Status
    reason: str
    wall_s: float
    restarts: dict[str, int] = field(default_factory=dict)
    exit_codes: dict[str, int | None] = field(default_factory=dict)


def probe_ok(p: Probe) -> bool:
    """One non-blocking-ish check (at most ~2 s) of a readiness probe."""
    if p.kind == "none":
        return True
    if p.kind == "path":
        return Path(p.target).exists()
    if p.kind == "tcp":
        host, _, port = p.target.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return True
        except OSError:
            return False
    try:
        with urllib.request.urlopen(p.target, timeout=2.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def log_tail(path: str, chars: int = 1500) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - chars))
            return f.read().decode(errors="replace")
    except OSError:
        return "(no log)"


class Supervisor:
    def __init__(
        self,
        plan: Plan,
        start: Starter,
        *,
        latest_checkpoint: Callable[[], str | None] = lambda: None,
        initial_checkpoint: str | None = None,
        poll_s: float = 0.2,
        max_wall_s: float | None = None,
        restart_delay_s: float = 1.0,
        on_tick: Callable[[Supervisor], None] | None = None,
    ) -> None:
        self.plan, self._start = plan, start
        self.latest_checkpoint, self.initial_checkpoint = latest_checkpoint, initial_checkpoint
        self.poll_s, self.max_wall_s, self.restart_delay_s = poll_s, max_wall_s, restart_delay_s
        self.on_tick = on_tick
        self.procs = [Proc(spec) for spec in plan.processes]
        self.restarts: Counter[str] = Counter()
        self.stop_reason: str | None = None
        self.force = False
        self.started = time.monotonic()
        self.phase = "starting"

    # ------------------------------------------------------------------ control from outside

    def request_stop(self, reason: str = "interrupted") -> None:
        """First call: stop gracefully (learner checkpoints). Second call: skip the waits. Signal-safe."""
        if self.stop_reason is None:
            self.stop_reason = reason
        else:
            self.force = True

    def install_signal_handlers(self) -> Callable[[], None]:
        """SIGINT/SIGTERM -> request_stop; returns a function that restores the previous handlers."""
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in previous:
            signal.signal(s, lambda signum, _f: self.request_stop(f"signal {signal.Signals(signum).name}"))

        def restore() -> None:
            for s, h in previous.items():
                signal.signal(s, h)

        return restore

    # ------------------------------------------------------------------ the run

    def run(self) -> Outcome:
        try:
            self._start_all(self.initial_checkpoint)
            self.phase = "running"
            status, reason = self._watch()
        except WorkerFailed as e:
            status, reason = "failed", str(e)
        except BaseException:
            self._stop_all(checkpoint=False, quick=True)
            raise
        if status == "failed" and self.stop_reason is not None:
            status = "interrupted"  # a start aborted by Ctrl-C is not a failure of the job
            reason = self.stop_reason
        self.phase = "stopping"
        logger.info("job_stopping", status=status, reason=reason)
        self._stop_all(checkpoint=status != "completed" and self._buffer_alive(), quick=False)
        self.phase = status
        return Outcome(
            status=status,
            reason=reason,
            wall_s=time.monotonic() - self.started,
            restarts=dict(self.restarts),
            exit_codes={p.spec.name: p.rc for p in self.procs},
        )

    def _watch(self) -> tuple[Status, str]:
        while True:
            if self.stop_reason is not None:
                return "interrupted", self.stop_reason
            if self.max_wall_s is not None and time.monotonic() - self.started > self.max_wall_s:
                return "failed", f"the run exceeded max_wall_s={self.max_wall_s:.0f}"
            for p in self.procs:
                if not p.alive:
                    continue
                assert p.handle is not None
                rc = p.handle.poll()
                if rc is None:
                    self._check_ready(p)
                    continue
                self._exited(p, rc)
                if p.spec.role == "learner" and rc == 0:
                    learners = [q for q in self.procs if q.spec.role == "learner"]
                    if all(q.state == "exited" and q.rc == 0 for q in learners):
                        return "completed", "the learner finished"
                    continue
                failure = self._on_failure(p, rc)
                if failure is not None:
                    return "failed", failure
                break  # the process list may have been restarted: poll afresh
            self._tick()
            time.sleep(self.poll_s)

    def _on_failure(self, p: Proc, rc: int) -> str | None:
        """Restart per policy; the reason the job must stop when it cannot."""
        spec, policy = p.spec, self.plan.restart
        gang = spec.gang_name
        what = f"{spec.name} exited with code {rc}"
        logger.warning(
            "process_failed", name=spec.name, rc=rc, log=spec.log_path, tail=log_tail(spec.log_path, 400)
        )
        if policy.on_failure != "restart":
            return f"{what} (launcher.on_failure: stop); log: {spec.log_path}"
        if self.restarts[gang] >= policy.max_restarts:
            return (
                f"{what} after {self.restarts[gang]} restarts (launcher.max_restarts); log: {spec.log_path}"
            )
        self.restarts[gang] += 1
        self._sleep(self.restart_delay_s)
        if spec.restart_scope == "self":
            logger.info("restarting", name=spec.name, restart=self.restarts[gang])
            self._launch(p, list(spec.argv))
            return None
        try:
            checkpoint = self.latest_checkpoint()
        except Exception as e:  # e.g. a `latest` that names an incomplete checkpoint
            raise WorkerFailed(f"cannot restart after {what}: {e}") from e
        logger.warning("restarting_job", cause=spec.name, restart=self.restarts[gang], checkpoint=checkpoint)
        self._stop_all(checkpoint=False, quick=True)
        self._start_all(checkpoint)
        return None

    # ------------------------------------------------------------------ starting

    def _launch(self, p: Proc, argv: list[str]) -> None:
        if p.spec.ready.kind == "path":
            # The socket of an earlier run (or of the process we are restarting) would pass the probe.
            Path(p.spec.ready.target).unlink(missing_ok=True)
        p.handle = self._start(p.spec, argv)
        p.state, p.rc = "starting", None
        p.ready_deadline = time.monotonic() + p.spec.ready.timeout_s if p.spec.ready.kind != "none" else None
        if p.ready_deadline is None:
            p.state = "running"
        logger.info("process_started", name=p.spec.name, pid=p.handle.pid, argv=argv)

    def _start_all(self, checkpoint: str | None) -> None:
        self.phase = "starting"
        attached = not self.plan.attach_urls
        for stage in self.plan.stages():
            if self.stop_reason is not None:
                raise WorkerFailed(f"start aborted: {self.stop_reason}")
            if not attached and stage[0].stage >= 2:  # generators and learner need every engine
                self._wait_attached()
                attached = True
            names = {s.name for s in stage}
            procs = [p for p in self.procs if p.spec.name in names]
            for p in procs:
                self._launch(p, p.spec.start_argv(checkpoint))
            self._wait_ready(procs)
        self.phase = "running"

    def _wait_ready(self, procs: list[Proc]) -> None:
        while True:
            waiting = [p for p in procs if p.ready_deadline is not None]
            if not waiting:
                return
            for p in waiting:
                self._check_ready(p)
            self._raise_if_exited(procs)
            if self.stop_reason is not None:
                raise WorkerFailed(f"start aborted: {self.stop_reason}")
            self._tick()
            time.sleep(min(self.poll_s, 0.5))

    def _check_ready(self, p: Proc) -> None:
        if p.ready_deadline is None:
            return
        if probe_ok(p.spec.ready):
            p.state, p.ready_deadline = "running", None
            logger.info("process_ready", name=p.spec.name, probe=p.spec.ready.target)
        elif time.monotonic() > p.ready_deadline:
            raise WorkerFailed(
                f"{p.spec.name} was not ready within {p.spec.ready.timeout_s:.0f} s "
                f"({p.spec.ready.kind} {p.spec.ready.target}); log {p.spec.log_path}:\n{log_tail(p.spec.log_path)}"
            )

    def _raise_if_exited(self, procs: list[Proc]) -> None:
        for p in procs:
            assert p.handle is not None
            rc = p.handle.poll()
            if rc is not None:
                self._exited(p, rc)
                raise WorkerFailed(
                    f"{p.spec.name} exited with code {rc} while starting; "
                    f"log {p.spec.log_path}:\n{log_tail(p.spec.log_path)}"
                )

    def _wait_attached(self) -> None:
        """Engines started elsewhere (engine.urls) must answer /health before generators start."""
        deadline = time.monotonic() + ATTACH_TIMEOUT_S
        for url in self.plan.attach_urls:
            while not probe_ok(Probe(kind="http", target=url + "/health")):
                if time.monotonic() > deadline or self.stop_reason is not None:
                    raise WorkerFailed(
                        f"attached engine {url} did not answer /health within {ATTACH_TIMEOUT_S:.0f} s"
                    )
                time.sleep(0.5)

    # ------------------------------------------------------------------ stopping

    def _exited(self, p: Proc, rc: int) -> None:
        p.state, p.rc, p.ready_deadline = "exited", rc, None
        assert p.handle is not None
        p.handle.cleanup()  # what the process left behind in its group (pool workers, ...)
        logger.info("process_exited", name=p.spec.name, rc=rc)

    def _buffer_alive(self) -> bool:
        return all(p.alive for p in self.procs if p.spec.role == "buffer")

    def _stop_all(self, checkpoint: bool, quick: bool) -> None:
        """Learner ranks first (given time to checkpoint when `checkpoint`), then the stages in reverse
        order, each with its grace period (a short one when `quick`: a restart or a crash)."""
        learners = [p for p in self.procs if p.alive and p.spec.role == "learner"]
        if checkpoint and learners:
            logger.info("asking_learner_to_checkpoint", ranks=len(learners))
            self._stop(learners, grace_s=max(p.spec.stop_grace_s for p in learners))
        stages = sorted({p.spec.stage for p in self.procs}, reverse=True)
        for s in stages:
            procs = [p for p in self.procs if p.alive and p.spec.stage == s]
            if procs:
                self._stop(procs, grace_s=3.0 if quick else max(p.spec.stop_grace_s for p in procs))
        for p in self.procs:
            if p.handle is not None:
                p.handle.cleanup()

    def _stop(self, procs: list[Proc], grace_s: float) -> None:
        for p in procs:
            assert p.handle is not None
            p.handle.signal(signal.SIGTERM)
        self._wait_exit(procs, grace_s)
        left = [p for p in procs if p.alive]
        for p in left:
            assert p.handle is not None
            logger.warning("killing", name=p.spec.name, grace_s=grace_s)
            p.handle.signal(signal.SIGKILL)
        self._wait_exit(left, KILL_WAIT_S, forceable=False)
        for p in procs:
            if p.state == "exited":
                p.state = "stopped"  # by us: shown apart from exits of its own
            elif p.alive:  # unkillable (e.g. a lost Ray actor): give up on it rather than hang
                p.state = "stopped"
                logger.error("process_did_not_exit", name=p.spec.name)

    def _wait_exit(self, procs: list[Proc], timeout_s: float, forceable: bool = True) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            for p in procs:
                if p.alive:
                    assert p.handle is not None
                    rc = p.handle.poll()
                    if rc is not None:
                        self._exited(p, rc)
            if not any(p.alive for p in procs) or time.monotonic() > deadline or (forceable and self.force):
                return
            self._tick()
            time.sleep(0.1)

    # ------------------------------------------------------------------ helpers

    def _tick(self) -> None:
        if self.on_tick is not None:
            with contextlib.suppress(Exception):  # the view must never take the supervisor down
                self.on_tick(self)

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.stop_reason is None:
            time.sleep(min(0.1, seconds))
