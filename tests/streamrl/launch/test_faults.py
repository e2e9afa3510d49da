"""Fault tolerance of real runs: `streamrl launch` of the whole system on a random tiny model, with
roles killed by `kill -9` while it trains.

* A dead reward worker or sandbox worker is replaced inside the generator; a dead engine or generator
  is restarted alone by the launcher. The run finishes every step without a job restart, the
  restarted engine gets the current weights at the next push, and the ledger balances: every group
  trained once, every dispatched prompt trained, dropped with a reason, or still held by the buffer.
* A dead learner restarts the whole job from the latest checkpoint (its steps continue from there);
  Ctrl-C then stops the run with a checkpoint, and `--resume` finishes it, with the same ledger.
* The Ray launcher runs the same tiny job on a local Ray instance.

Each test is one or two launches of every role (about 20 s of start-up on 2 busy cores each), so
the kills are paced by the learner's progress in metrics.jsonl. Helpers: faults.py.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import urllib.request
from pathlib import Path

import pytest

from streamrl import checkpoint, tiny
from streamrl.launch.plan import from_json
from tests.streamrl.launch.faults import Run, final_snapshot, kill9, launcher_events, ledger_problems
from workers.engines.client import parse_weight_version

pytestmark = pytest.mark.slow
B = 2  # buffer.groups_per_step in faults.SMALL
HAS_RAY = importlib.util.find_spec("ray") is not None
# The rStar2 tool loop with the embedded sandbox pool (2 workers) in the generator. RoC is off
# (faults.SMALL): a random model's rewards are all 0, and reject-equal-reward would drop every group.
TOOL_JOB = "configs/tiny-tool.yaml"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.random_model_dir(tmp_path_factory.mktemp("model") / "random", task="tool", seed=0)


def engine_version(run_dir: Path) -> int:
    """The weight version the run's (only) engine serves, or -1 while it does not answer."""
    url = from_json((run_dir / "plan.json").read_bytes()).engine_urls[0]
    try:
        with urllib.request.urlopen(url + "/model_info", timeout=2.0) as resp:
            return parse_weight_version(json.loads(resp.read()).get("weight_version"))
    except OSError:
        return -1


def assert_books_balance(run: Run, steps: int) -> None:
    summary = run.summary()
    assert (summary["status"], summary["steps"], summary["steps_planned"]) == ("completed", steps, steps)
    assert summary["groups"]["trained"] == steps * B and summary["checkpoint"] == steps - 1
    snap = final_snapshot(run.run_dir)
    assert ledger_problems(snap, steps, B) == [], run.describe()


def test_reward_sandbox_engine_and_generator_deaths_are_repaired_without_losing_a_group(
    model: Path, tmp_path: Path
) -> None:
    steps = 20
    run = Run.start(tmp_path / "run", model, steps, job=TOOL_JOB)
    try:
        run.wait_steps(2)
        gen = run.one("workers.generator")

        # A reward worker (a child of the generator): the pool scores that call with the default and
        # starts a replacement; the generator itself carries on.
        dead = run.kill9("workers.reward --worker", parent=gen.pid)
        run.one("workers.reward --worker", parent=gen.pid, besides=[dead])
        run.wait_steps(1, after=len(run.learner_steps()))

        # A warm sandbox worker (the embedded pool, also in the generator). A random model rarely
        # calls the tool, so nothing may notice; the pool replaces the worker at its next job.
        sandbox = run.processes("sandbox_bridge.pool", parent=gen.pid)
        assert len(sandbox) == 2, [p.cmdline() for p in sandbox]
        kill9(sandbox[0])
        run.wait_steps(1, after=len(run.learner_steps()))
        assert run.one("workers.generator").pid == gen.pid  # neither kill cost the generator

        # The engine: the launcher restarts it alone; the learner waits for it at its next push
        # and sends the restarted engine (which starts from the initial weights) the current ones.
        dead = run.kill9("streamrl engine serve")
        run.one("streamrl engine serve", besides=[dead])
        run.wait_for(lambda: engine_version(run.run_dir) > 0, "the restarted engine to get weights")
        run.wait_steps(1, after=len(run.learner_steps()))

        # The generator: restarted alone; the buffer re-dispatches what the dead one held.
        dead = run.kill9("workers.generator")
        run.one("workers.generator", besides=[dead])
        run.wait_steps(2, after=len(run.learner_steps()))
        assert run.finish() == 0, run.describe()
    finally:
        run.kill()
    assert run.leftovers() == []
    assert run.summary()["restarts"] == {"engine-0": 1, "gen-0": 1}
    gen_log = (run.run_dir / "logs" / "gen-0.jsonl").read_text()
    assert '"reward.worker_crashed"' in gen_log  # the call that found it dead got the default score
    assert run.learner_steps() == list(range(steps)), "a job restart: every step must run exactly once"
    assert_books_balance(run, steps)


@pytest.mark.timeout(450)  # two launches and a job restart: well under, unless the machine is swamped
def test_a_dead_learner_restarts_the_job_from_its_checkpoint_and_ctrl_c_then_resume_finishes(
    model: Path, tmp_path: Path
) -> None:
    steps = 40
    run_dir = tmp_path / "run"
    run = Run.start(run_dir, model, steps)
    try:
        # kill -9 the learner a step or more past a checkpoint: the steps since are trained again.
        run.wait_for(
            lambda: (k := checkpoint.latest(run_dir)) is not None and max(run.learner_steps()) > k,
            "a step past the first checkpoint",
        )
        run.kill9("workers.learner")
        before = run.learner_steps()
        k = checkpoint.latest(run_dir)  # read after the kill: what the restart starts from
        assert k is not None
        run.wait_steps(2, after=len(before))
        after = run.learner_steps()[len(before) :]
        assert after[:2] == [k + 1, k + 2], f"steps after the restart from checkpoint {k}: {after}"

        # Ctrl-C: the learner finishes its step and checkpoints it, the launcher exits 130.
        run.proc.send_signal(signal.SIGINT)
        assert run.finish() == 130, run.describe()
    finally:
        run.kill()
    assert run.leftovers() == []
    interrupted = run.summary()
    assert interrupted["status"] == "interrupted" and interrupted["restarts"] == {"learner": 1}
    seen = run.learner_steps()
    stopped_at = checkpoint.latest(run_dir)
    assert stopped_at == seen[-1] < steps - 1, f"checkpoint {stopped_at}, steps {seen}"
    assert ledger_problems(final_snapshot(run_dir), stopped_at + 1, B) == []

    resumed = Run.resume(run_dir)
    try:
        assert resumed.finish() == 0, resumed.describe()
    finally:
        resumed.kill()
    assert resumed.leftovers() == []
    assert resumed.learner_steps()[len(seen) :] == list(range(stopped_at + 1, steps))
    assert_books_balance(resumed, steps)
    restarts = [e for e in launcher_events(run_dir) if e["event"] == "restarting_job"]
    assert [e["cause"] for e in restarts] == ["learner"]


@pytest.mark.skipif(
    not HAS_RAY, reason="Ray is an optional extra: pip install 'streamrl[ray]' to run this test"
)
def test_the_ray_launcher_runs_a_real_job_to_the_end(model: Path, tmp_path: Path) -> None:
    steps = 6
    run = Run.start(tmp_path / "run", model, steps, extra=["launcher.kind=ray"])
    try:
        run.wait_steps(1)
        assert run.processes("raylet"), "no raylet under the launcher: is this a Ray run?"
        assert run.finish() == 0, run.describe()
    finally:
        run.kill()
    assert run.learner_steps() == list(range(steps))
    assert_books_balance(run, steps)
    assert run.leftovers() == []  # the roles, their actors and the Ray instance the launcher started
