"""The local launcher's supervisor with fake roles (tests/streamrl/launch/fakes.py): real processes,
real signals, bounded times. What a user relies on: roles start in dependency order, a dead role is
restarted or the job stops as the spec says, the learner gets to checkpoint before the buffer goes
away, and nothing hangs or outlives the launcher."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streamrl.errors import WorkerFailed
from streamrl.launch.local import child_env, run_local
from streamrl.launch.plan import Probe, to_json
from tests.conftest import free_port, wait_until
from tests.streamrl.launch.fakes import buffer, engine, events, fake, fake_plan, started_pids, wait_gone

CHECKPOINT_ON_TERM = """\
def checkpoint(*_):
    ev("checkpoint"); sys.exit(0)
signal.signal(signal.SIGTERM, checkpoint)
ev("ready")
"""
FAIL_AFTER_LEARNER = 'wait_for(lambda: count("learner", "ready") == 1)\nsys.exit(1)\n'


def starts(run: Path, name: str) -> list[str]:
    return [line for line in events(run) if line.startswith(f"{name} start")]


def test_roles_start_in_order_and_the_job_ends_when_the_learner_exits_zero(tmp_path: Path) -> None:
    procs = [
        buffer(tmp_path),
        engine(tmp_path, free_port()),
        fake(tmp_path, "gen-0", "generator", 2),
        fake(tmp_path, "learner", "learner", 3, "time.sleep(0.5)\n"),
    ]
    out = run_local(fake_plan(tmp_path, procs))
    assert (out.status, out.reason) == ("completed", "the learner finished")
    log = events(tmp_path)
    order = [line.split()[0] for line in log if " start" in line]
    # Each stage started once the one before was ready (generators have no probe: no wait after them).
    assert order[:2] == ["buffer", "engine-0"] and sorted(order[2:]) == ["gen-0", "learner"]
    # Stopped in reverse dependency order once the learner is done.
    terms = [line.split()[0] for line in log if line.endswith(" term")]
    assert terms == ["gen-0", "engine-0", "buffer"]
    assert out.exit_codes["learner"] == 0 and out.restarts == {}
    assert wait_gone(started_pids(tmp_path)) == []


def test_a_dead_generator_is_restarted_with_the_same_command(tmp_path: Path) -> None:
    gen = 'if count("gen-0", "crash") == 0:\n    ev("crash"); sys.exit(3)\n' + "time.sleep(60)\n"
    learner = 'wait_for(lambda: len([l for l in (RUN / "events.txt").read_text().splitlines() if l.startswith("gen-0 start")]) == 2)\n'
    procs = [
        buffer(tmp_path),
        fake(tmp_path, "gen-0", "generator", 2, gen),
        fake(tmp_path, "learner", "learner", 3, learner),
    ]
    out = run_local(fake_plan(tmp_path, procs), restart_delay_s=0.1)
    assert out.status == "completed"
    assert out.restarts == {"gen-0": 1}
    first, second = starts(tmp_path, "gen-0")
    assert first == second  # same argv
    assert len(starts(tmp_path, "buffer")) == 1  # nothing else was touched
    assert wait_gone(started_pids(tmp_path)) == []


def test_restarts_run_out_then_the_learner_checkpoints_before_the_buffer_stops(tmp_path: Path) -> None:
    procs = [
        buffer(tmp_path),
        fake(tmp_path, "gen-0", "generator", 2, FAIL_AFTER_LEARNER),
        fake(tmp_path, "learner", "learner", 3, CHECKPOINT_ON_TERM + "time.sleep(60)\n"),
    ]
    out = run_local(fake_plan(tmp_path, procs, max_restarts=2), restart_delay_s=0.1)
    assert out.status == "failed"
    assert "gen-0 exited with code 1 after 2 restarts" in out.reason
    assert out.restarts == {"gen-0": 2} and len(starts(tmp_path, "gen-0")) == 3
    log = events(tmp_path)
    assert log.index("learner checkpoint") < log.index("buffer term")
    assert wait_gone(started_pids(tmp_path)) == []


def test_stop_policy_stops_at_the_first_failure(tmp_path: Path) -> None:
    procs = [
        buffer(tmp_path),
        fake(tmp_path, "gen-0", "generator", 2, FAIL_AFTER_LEARNER),
        fake(tmp_path, "learner", "learner", 3, CHECKPOINT_ON_TERM + "time.sleep(60)\n"),
    ]
    out = run_local(fake_plan(tmp_path, procs, on_failure="stop"))
    assert out.status == "failed" and "launcher.on_failure: stop" in out.reason
    assert out.restarts == {} and len(starts(tmp_path, "gen-0")) == 1
    assert "learner checkpoint" in events(tmp_path)


def test_a_dead_buffer_restarts_the_job_from_the_latest_checkpoint(tmp_path: Path) -> None:
    ck = tmp_path / "checkpoints" / "step_000004"
    ck.mkdir(parents=True)
    crash = 'if count("buffer", "crash") == 0:\n    wait_for(lambda: count("learner", "training") == 1)\n    ev("crash"); sys.exit(5)\n'
    learner = 'ev("training")\nif count("buffer", "crash") == 0:\n    time.sleep(60)\n'
    procs = [
        buffer(
            tmp_path, crash, resume_args=["--resume", "{checkpoint}/buffer.snapshot"], restart_scope="job"
        ),
        fake(tmp_path, "gen-0", "generator", 2),
        fake(tmp_path, "learner", "learner", 3, learner, resume_args=["--resume"], restart_scope="job"),
    ]
    out = run_local(fake_plan(tmp_path, procs), latest_checkpoint=lambda: str(ck), restart_delay_s=0.1)
    assert out.status == "completed" and out.restarts == {"buffer": 1}
    assert starts(tmp_path, "buffer") == ["buffer start ", f"buffer start --resume {ck}/buffer.snapshot"]
    assert starts(tmp_path, "learner") == ["learner start ", "learner start --resume"]
    assert len(starts(tmp_path, "gen-0")) == 2  # everything restarted, in order
    assert wait_gone(started_pids(tmp_path)) == []


def test_a_role_that_dies_while_starting_fails_the_start_at_once_with_its_log(tmp_path: Path) -> None:
    port = free_port()
    procs = [
        buffer(tmp_path),
        engine(tmp_path, port, body='print("boom: no model here", flush=True); sys.exit(2)\n'),
        fake(tmp_path, "gen-0", "generator", 2),
    ]
    t0 = time.monotonic()
    out = run_local(fake_plan(tmp_path, procs))
    assert time.monotonic() - t0 < 15
    assert out.status == "failed"
    assert "engine-0 exited with code 2 while starting" in out.reason and "boom: no model here" in out.reason
    assert starts(tmp_path, "gen-0") == [] and "buffer term" in events(tmp_path)


def test_a_role_that_never_gets_ready_fails_after_its_probe_timeout(tmp_path: Path) -> None:
    never = Probe(kind="http", target=f"http://127.0.0.1:{free_port()}/health", timeout_s=2.0)
    procs = [buffer(tmp_path), fake(tmp_path, "engine-0", "engine", 1, ready=never)]
    t0 = time.monotonic()
    out = run_local(fake_plan(tmp_path, procs))
    assert 2.0 <= time.monotonic() - t0 < 15
    assert out.status == "failed" and "engine-0 was not ready within 2 s" in out.reason
    assert wait_gone(started_pids(tmp_path)) == []


def test_a_role_that_ignores_sigterm_is_killed_after_its_grace(tmp_path: Path) -> None:
    stubborn = "signal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n"
    procs = [
        buffer(tmp_path),
        fake(tmp_path, "gen-0", "generator", 2, stubborn, stop_grace_s=1.0),
        fake(tmp_path, "learner", "learner", 3, "time.sleep(0.3)\n"),
    ]
    t0 = time.monotonic()
    out = run_local(fake_plan(tmp_path, procs))
    assert time.monotonic() - t0 < 15
    assert out.status == "completed" and out.exit_codes["gen-0"] == -signal.SIGKILL
    assert wait_gone(started_pids(tmp_path)) == []


def test_a_run_past_max_wall_s_stops_with_a_checkpoint(tmp_path: Path) -> None:
    procs = [
        buffer(tmp_path),
        fake(tmp_path, "learner", "learner", 3, CHECKPOINT_ON_TERM + "time.sleep(60)\n"),
    ]
    out = run_local(fake_plan(tmp_path, procs), max_wall_s=1.5)
    assert out.status == "failed" and "max_wall_s" in out.reason
    assert "learner checkpoint" in events(tmp_path)


# ---------------------------------------------------------------- the launcher as its own process


def launcher(tmp_path: Path, procs: list) -> subprocess.Popen[bytes]:  # type: ignore[type-arg]
    plan_file = tmp_path / "plan.json"
    plan_file.write_bytes(to_json(fake_plan(tmp_path, procs)))
    with open(tmp_path / "launcher.out", "wb") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "streamrl.launch.local", str(plan_file)], stdout=out, stderr=out
        )


def test_ctrl_c_checkpoints_then_stops_everything(tmp_path: Path) -> None:
    procs = [
        buffer(tmp_path),
        fake(tmp_path, "gen-0", "generator", 2),
        fake(tmp_path, "learner", "learner", 3, CHECKPOINT_ON_TERM + "time.sleep(60)\n"),
    ]
    proc = launcher(tmp_path, procs)
    try:
        wait_until(lambda: bool(starts(tmp_path, "learner")), 30, "the learner to start")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
    finally:
        proc.kill()
    log = events(tmp_path)
    assert log.index("learner checkpoint") < log.index("gen-0 term") < log.index("buffer term")
    assert '"status": "interrupted"' in (tmp_path / "launcher.out").read_text()
    assert wait_gone(started_pids(tmp_path)) == []


def test_a_second_ctrl_c_skips_the_grace_period(tmp_path: Path) -> None:
    deaf = 'signal.signal(signal.SIGTERM, lambda *_: ev("busy"))\ntime.sleep(60)\n'
    procs = [buffer(tmp_path), fake(tmp_path, "learner", "learner", 3, deaf, stop_grace_s=120.0)]
    proc = launcher(tmp_path, procs)
    try:
        wait_until(lambda: bool(starts(tmp_path, "learner")), 30, "the learner to start")
        proc.send_signal(signal.SIGINT)
        wait_until(lambda: "learner busy" in events(tmp_path), 10, "the learner to get SIGTERM")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 130
        assert time.monotonic() - t0 < 15
    finally:
        proc.kill()
    assert wait_gone(started_pids(tmp_path)) == []


def test_killing_the_launcher_takes_its_roles_down(tmp_path: Path) -> None:
    procs = [
        buffer(tmp_path),
        fake(tmp_path, "gen-0", "generator", 2),
        fake(tmp_path, "learner", "learner", 3),
    ]
    proc = launcher(tmp_path, procs)
    try:
        wait_until(lambda: bool(starts(tmp_path, "learner")), 30, "the learner to start")
        proc.kill()  # no chance to stop anything itself
        proc.wait(10)
    finally:
        proc.kill()
    assert wait_gone(started_pids(tmp_path)) == []
    assert {"buffer term", "gen-0 term", "learner term"} <= set(events(tmp_path))


def test_planned_gpus_count_within_the_launchers_visible_gpus() -> None:
    assert (
        child_env({"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})[
            "CUDA_VISIBLE_DEVICES"
        ]
        == "4,5"
    )
    assert child_env({"CUDA_VISIBLE_DEVICES": "2"}, {})["CUDA_VISIBLE_DEVICES"] == "2"
    assert child_env({"OMP_NUM_THREADS": "1"}, {"PATH": "/bin"}) == {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    with pytest.raises(WorkerFailed, match="leaves 2 visible"):
        child_env({"CUDA_VISIBLE_DEVICES": "2,3"}, {"CUDA_VISIBLE_DEVICES": "0,1"})
