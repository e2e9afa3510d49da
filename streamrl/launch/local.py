"""The local launcher: every process of a plan as a subprocess of this one, on this host.

    outcome = run_local(plan, on_tick=view.refresh)      # Ctrl-C / SIGTERM stop it cleanly
    python -m streamrl.launch.local RUN_DIR/plan.json    # run a written plan (debugging, tests)

Each process runs in its own session (process group), so a stop reaches the helpers it forked
(reward pool, sandbox workers, SGLang's schedulers) and the terminal's Ctrl-C reaches only the
launcher, which then stops the roles in order (supervisor.py). Each child also gets SIGTERM from the
kernel if the launcher dies without stopping it (PR_SET_PDEATHSIG, set by a small exec shim), so a
`kill -9` of the launcher does not leave a job running. Output goes to the process's log file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from streamrl.errors import WorkerFailed
from streamrl.launch.processes import Plan, ProcessSpec, from_json
from streamrl.launch.supervisor import Outcome, Supervisor

# Runs in the child before the role: ask for SIGTERM when the parent dies, make sure the parent is
# still the one that started us (it may have died before prctl), then become the role (same pid).
_SHIM = (
    "import ctypes,os,sys;"
    "ctypes.CDLL(None,use_errno=True).prctl(1,15);"  # PR_SET_PDEATHSIG, SIGTERM
    "os.getppid()==int(sys.argv[1]) or os._exit(143);"
    "os.execvp(sys.argv[2],sys.argv[2:])"
)


def shim_argv(argv: list[str], parent_pid: int) -> list[str]:
    """`argv` run so that it gets SIGTERM when `parent_pid` (its parent) dies."""
    return [sys.executable, "-S", "-c", _SHIM, str(parent_pid), *argv]


def child_env(env: dict[str, str], parent: dict[str, str] | None = None) -> dict[str, str]:
    """The parent's environment plus the plan's. Planned GPU ids count within the GPUs this launcher
    may use: with CUDA_VISIBLE_DEVICES=4,5,6,7 set for the launcher, a planned "0,1" becomes "4,5"."""
    parent = dict(os.environ if parent is None else parent)
    out = {**parent, **env}
    visible = parent.get("CUDA_VISIBLE_DEVICES", "").strip()
    planned = env.get("CUDA_VISIBLE_DEVICES")
    if visible and planned:
        ids = visible.split(",")
        try:
            out["CUDA_VISIBLE_DEVICES"] = ",".join(ids[int(i)] for i in planned.split(","))
        except (IndexError, ValueError):
            raise WorkerFailed(
                f"the plan uses GPUs {planned} but CUDA_VISIBLE_DEVICES={visible} leaves {len(ids)} visible"
            ) from None
    return out


class LocalHandle:
    """A subprocess in its own session; `signal` reaches its whole process group."""

    def __init__(self, spec: ProcessSpec, argv: list[str], cwd: str | None = None) -> None:
        Path(spec.log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(spec.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                shim_argv(argv, os.getpid()),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env(spec.env),
                cwd=cwd,
                start_new_session=True,  # pgid == pid: the group is ours to signal
            )
        self.pid: int | None = self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # leftovers of an exited leader's group


def run_local(
    plan: Plan,
    *,
    latest_checkpoint: Callable[[], str | None] = lambda: None,
    initial_checkpoint: str | None = None,
    on_tick: Callable[[Supervisor], None] | None = None,
    max_wall_s: float | None = None,
    poll_s: float = 0.2,
    restart_delay_s: float = 1.0,
) -> Outcome:
    """Run `plan` on this host until the learner finishes, a failure stops it, or a signal does."""
    sup = Supervisor(
        plan,
        LocalHandle,
        latest_checkpoint=latest_checkpoint,
        initial_checkpoint=initial_checkpoint,
        on_tick=on_tick,
        max_wall_s=max_wall_s,
        poll_s=poll_s,
        restart_delay_s=restart_delay_s,
    )
    in_main = threading.current_thread() is threading.main_thread()
    restore = sup.install_signal_handlers() if in_main else None
    try:
        return sup.run()
    finally:
        if restore is not None:
            restore()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m streamrl.launch.local", description="run a written launch plan on this host"
    )
    ap.add_argument("plan", type=Path, help="plan.json (from streamrl launch)")
    ap.add_argument("--max-wall-s", type=float, default=None, help="stop as failed after this long")
    ap.add_argument("--checkpoint", help="start from this checkpoint folder (resume arguments)")
    args = ap.parse_args(argv)
    plan = from_json(args.plan.read_bytes())
    outcome = run_local(plan, initial_checkpoint=args.checkpoint, max_wall_s=args.max_wall_s)
    print(json.dumps(outcome.__dict__), flush=True)
    return {"completed": 0, "interrupted": 130}.get(outcome.status, 1)


if __name__ == "__main__":
    sys.exit(main())
