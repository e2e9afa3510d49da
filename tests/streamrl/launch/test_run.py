"""`streamrl launch` around the supervisor: the run folder it writes, summary.json from metrics.jsonl
and the final buffer snapshot, the progress view, and its argument errors."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from streamrl import checkpoint, log
from streamrl.buffer import BufferSnapshot, write_snapshot
from streamrl.config_load import parse_job
from streamrl.launch import run
from streamrl.launch.plan import from_json
from streamrl.launch.supervisor import Outcome, Supervisor
from streamrl.launch.view import MetricsTail, ProgressView
from tests.streamrl.launch.fakes import buffer, fake, fake_plan

JOB = """
name: demo
model: {{path: {model}}}
data: {{train: {{type: synthetic_arith}}}}
rollout: {{n_samples: 4, concurrency: 8}}
engine: {{type: embedded, count: 1}}
learner: {{backend: hf, threads: 1}}
train: {{steps: 5}}
"""


def records(*rs: dict) -> str:
    return "".join(json.dumps(r) + "\n" for r in rs)


LEARNER = [
    {
        "role": "learner",
        "step": s,
        "wall_s": 2.0 * s,
        "reward_mean": 0.1 * s,
        "accuracy": 0.2,
        "tokens_per_s": 900.0,
    }
    for s in range(5)
]
EVALS = [
    {"role": "eval", "step": -1, "wall_s": 0.5, "greedy_acc": 0.25, "sampled_acc": 0.2, "loss": 1.0},
    {"role": "eval", "step": 4, "wall_s": 9.5, "greedy_acc": 0.61, "sampled_acc": 0.5},
]


def final_checkpoint(run_dir: Path, step: int = 4) -> None:
    counters = {
        "dispatched": 52,
        "redispatched": 2,
        "dropped_stale": 3,
        "dropped_roc_equal_reward": 4,
        "accepted": 40,
    }
    snap = BufferSnapshot(
        step=step, version=step + 1, cursor=50, redispatch=[], ready=[], trained_groups=40,
        counters=counters, staleness={0: 30, 1: 10}, ledger={},
    )  # fmt: skip
    write_snapshot(snap, checkpoint.step_dir(run_dir, step) / checkpoint.BUFFER_SNAPSHOT)
    checkpoint.mark_latest(run_dir, step)


def test_summary_comes_from_metrics_and_the_final_buffer_snapshot(tmp_path: Path) -> None:
    spec = parse_job(JOB.format(model="/m"))
    (tmp_path / "metrics.jsonl").write_text(records(EVALS[0], *LEARNER, EVALS[1]))
    final_checkpoint(tmp_path)
    out = Outcome(status="completed", reason="the learner finished", wall_s=11.0, restarts={"gen-0": 1})
    s = run.summarize(tmp_path, spec, out, wall_s=12.345)
    assert (s["status"], s["steps"], s["wall_s"], s["train_wall_s"]) == ("completed", 5, 12.35, 8.0)
    assert s["eval"]["start"] == {"step": -1, "wall_s": 0.5, "greedy_acc": 0.25, "sampled_acc": 0.2}
    assert s["eval"]["end"]["greedy_acc"] == 0.61
    g = s["groups"]
    assert (g["dispatched"], g["trained"], g["dropped"], g["redispatched"]) == (50, 40, 7, 2)
    assert g["dropped_by_reason"] == {"stale": 3, "roc_equal_reward": 4}
    assert s["restarts"] == {"gen-0": 1} and s["checkpoint"] == 4
    json.dumps(s)  # all of it is JSON


def test_summary_of_a_run_without_checkpoint_or_metrics(tmp_path: Path) -> None:
    spec = parse_job(JOB.format(model="/m"))
    s = run.summarize(tmp_path, spec, Outcome(status="failed", reason="x", wall_s=1.0), wall_s=1.0)
    assert s["steps"] == 0 and s["eval"] == {"start": None, "end": None}
    assert s["groups"] == {"dispatched": None, "trained": None, "dropped": None}


def test_launch_writes_the_run_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real `launch` with the job's roles replaced by fakes: the learner writes metrics and the
    final checkpoint's snapshot is there, as the real one would leave them."""
    model = tmp_path / "model"
    model.mkdir()
    spec = parse_job(JOB.format(model=model))
    run_dir = tmp_path / "run"
    write_metrics = f"open(RUN / 'metrics.jsonl', 'a').write({records(EVALS[0], *LEARNER, EVALS[1])!r})\n"
    fakes = [buffer(run_dir), fake(run_dir, "learner", "learner", 3, write_metrics)]
    monkeypatch.setattr(run, "plan", lambda spec, run_dir, **kw: fake_plan(run_dir, fakes))
    final_checkpoint(run_dir)
    console = Console(file=io.StringIO(), force_terminal=False, width=120)
    try:
        outcome, summary = run.launch(spec, run_dir, console=console)
    finally:
        log.configure("test")  # the launcher logged to run/logs/launcher.jsonl: close it
    assert outcome.status == "completed"
    assert (run_dir / "job.yaml").read_text().startswith("name: demo")
    assert from_json((run_dir / "plan.json").read_bytes()).processes == fakes
    assert float((run_dir / "started_at").read_text()) > 0
    events = [
        json.loads(line)["event"] for line in (run_dir / "logs" / "launcher.jsonl").read_text().splitlines()
    ]
    assert "process_started" in events and "job_stopping" in events
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    assert summary["steps"] == 5 and summary["groups"]["trained"] == 40
    printed = console.file.getvalue()  # type: ignore[attr-defined]
    assert "step 5/5  reward 0.400" in printed and "eval at start: greedy 0.250" in printed


def test_metrics_tail_waits_for_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.read() == []  # no file yet
    path.write_text('{"step": 0}\n{"st')
    assert tail.read() == [{"step": 0}]
    with path.open("a") as f:
        f.write('ep": 1}\nnot json\n')
    assert tail.read() == [{"step": 1}]
    path.write_text('{"step": 9}\n')  # replaced by a shorter file: read from the start
    assert tail.read() == [{"step": 9}]


def test_progress_panel_shows_step_metrics_and_processes(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(records(EVALS[0], *LEARNER[:3], EVALS[1]))
    sup = Supervisor(fake_plan(tmp_path, [buffer(tmp_path)]), lambda spec, argv: None)  # type: ignore[arg-type,return-value]
    view = ProgressView(tmp_path, "demo", 60, Console(file=io.StringIO(), force_terminal=False))
    view.refresh(sup)
    console = Console(record=True, width=100, file=io.StringIO())
    console.print(view.render(sup))
    text = console.export_text()
    assert "step 3/60" in text and "0.200" in text and "900" in text
    assert "0.250 -> 0.610" in text and "buffer" in text and "pending" in text


def test_launch_arguments_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(JOB.format(model=tmp_path))
    assert run.main(["--resume", str(tmp_path)]) == 2
    assert "no checkpoint to resume from" in capsys.readouterr().err
    assert run.main([str(job), "--run-dir", str(tmp_path)]) == 2  # job.yaml is there: a run folder
    assert "already holds a run" in capsys.readouterr().err
    job.write_text(JOB.format(model=tmp_path / "missing"))
    assert run.main([str(job), "--run-dir", str(tmp_path / "new")]) == 2
    assert "model.path: " in capsys.readouterr().err and not (tmp_path / "new").exists()
    with pytest.raises(SystemExit):
        run.main([])
    assert "give a job spec, or --resume RUN_DIR" in capsys.readouterr().err
