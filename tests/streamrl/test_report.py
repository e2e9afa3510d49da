"""`streamrl report` on synthetic run folders written with MetricsWriter: every plot is a real PNG,
the summary numbers are right, missing data and a truncated last line are tolerated."""

from __future__ import annotations

import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from streamrl.metrics import MetricsWriter, read_metrics
from streamrl.report import PLOTS, make_report, time_to_accuracy

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
SYNC = {
    "sync_pause_s": 0.01,
    "sync_gather_s": 0.2,
    "sync_wire_s": 0.3,
    "sync_load_s": 0.1,
    "sync_resume_s": 0.02,
}


def learner_values(step: int) -> dict[str, object]:
    return {
        "policy_version": step,
        "loss": 1.0 / (step + 1),
        "entropy": 2.0 - 0.1 * step,
        "ratio_mean": 1.0,
        "ratio_max": 1.5,
        "clip_frac_low": 0.01,
        "clip_frac_high": 0.02,
        "clip_frac_dual": 0.0,
        "grad_norm": 0.5,
        "lr": 3e-4,
        "tokens": 1000 + step,
        "tokens_per_s": 500.0 + step,
        "idle_s": 0.1,
        "idle_ratio": 0.2 - 0.01 * step,
        "reward_mean": 0.1 + 0.05 * step,
        "accuracy": 0.1 + 0.05 * step,
        "response_len_mean": 20.0 + step,
        "staleness": {"0": 6, "1": 2} if step % 2 else {"0": 8},
        "staleness_mean": 0.25 if step % 2 else 0.0,
        "tool_calls_mean": 1.2,
        "tool_success_rate": 0.9,
        **SYNC,
    }


def write_run(run_dir: Path, evals: bool = True, generators: bool = True) -> None:
    (run_dir / "started_at").parent.mkdir(parents=True, exist_ok=True)
    (run_dir / "started_at").write_text(f"{time.time() - 60.0}\n")
    with MetricsWriter(run_dir, "learner", tensorboard=False) as w:
        for step in range(STEPS):
            w.write(learner_values(step), step=step)
            if evals and step % 5 == 0:
                w.write(
                    {"greedy_acc": [0.2, 0.3, 0.4][step // 5], "sampled_acc": 0.1 + 0.05 * step},
                    step=step,
                    role="eval",
                )
    with MetricsWriter(run_dir, "buffer", "buffer", tensorboard=False) as b:
        for i in range(3):
            b.write({"roc_keep_rate": 0.5 + 0.1 * i, "roc_trajectory_keep_rate": 0.4}, step=i)
    if generators:
        for name in ("gen-0", "gen-1"):
            with MetricsWriter(run_dir, "generator", name, tensorboard=False) as g:
                for i in range(4):
                    g.write(
                        {
                            "tokens_per_s": 1000.0 + i,
                            "idle_ratio": 0.1,
                            "trajectories": 10 * (i + 1),
                            "groups_sent": i + 1,
                            "tool_calls": 5 * (i + 1),
                            "tool_failures": i,
                            "tool_call_success_rate": 0.8,
                            "tool_latency_ms_mean": 40.0 if i else None,
                        }
                    )


def check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    assert len(data) > 10_000, f"{path.name} is nearly empty ({len(data)} bytes)"
    length, kind = struct.unpack(">I4s", data[8:16])
    width, height = struct.unpack(">II", data[16:24])
    assert kind == b"IHDR" and width >= 400 and height >= 300
    assert zlib.crc32(data[12 : 16 + length]) == struct.unpack(">I", data[16 + length : 20 + length])[0]


def test_report_draws_every_plot_and_summarizes_a_full_run(tmp_path: Path) -> None:
    write_run(tmp_path)
    report = make_report(tmp_path)
    assert report.skipped == {}
    assert sorted(p.name for p in report.written) == sorted(PLOTS)
    for path in report.written:
        assert path.parent == tmp_path / "report"
        check_png(path)
    s = report.summary
    reward = s.row("reward_mean")
    assert (reward.first, reward.last, reward.best) == (0.1, pytest.approx(0.65), pytest.approx(0.65))
    idle = s.row("idle_ratio")
    assert (idle.first, idle.best) == (0.2, pytest.approx(0.09))  # lower is better
    assert s.row("loss").best is None  # no direction: only first and last
    greedy = s.row("eval greedy_acc")  # evals at steps 0, 5, 10
    assert (greedy.first, greedy.last, greedy.best) == (0.2, pytest.approx(0.4), pytest.approx(0.4))
    t = s.totals
    assert (t["steps"], t["last_step"], t["learner_tokens"]) == (
        STEPS,
        STEPS - 1,
        sum(1000 + i for i in range(STEPS)),
    )
    assert t["sync_s_mean"] == pytest.approx(sum(SYNC.values()))
    assert (
        t["generators"],
        t["generated_trajectories"],
        t["generated_groups_sent"],
        t["generated_tool_calls"],
    ) == (
        2,
        80,
        8,
        40,
    )
    assert t["wall_s"] == pytest.approx(60.0, abs=10.0)


def test_missing_data_skips_plots_with_a_note(tmp_path: Path) -> None:
    with MetricsWriter(
        tmp_path, "learner", tensorboard=False
    ) as w:  # a math run: no tools, no sync, no evals
        for step in range(3):
            w.write({"reward_mean": 0.5, "loss": 0.1, "staleness": {"0": 4}}, step=step)
    report = make_report(tmp_path)
    assert sorted(p.name for p in report.written) == ["policy.png", "reward_accuracy.png", "staleness.png"]
    assert set(report.skipped) == set(PLOTS) - {"policy.png", "reward_accuracy.png", "staleness.png"}
    assert "sync" in report.skipped["weight_sync.png"] and "tool" in report.skipped["tools.png"]
    for path in report.written:
        check_png(path)
    assert [r.name for r in report.summary.rows] == ["reward_mean", "loss"]


def test_a_truncated_last_line_is_ignored(tmp_path: Path) -> None:
    write_run(tmp_path, evals=False, generators=False)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"role":"learner","step":12,"reward_mean":0.9')  # still being written
    report = make_report(tmp_path)
    assert report.summary.totals["steps"] == STEPS and report.summary.row(
        "reward_mean"
    ).last == pytest.approx(0.65)
    assert "reward_accuracy.png" in {p.name for p in report.written}


def test_time_to_accuracy_is_the_first_wall_time_at_or_above_the_target(tmp_path: Path) -> None:
    records = [
        {"role": "eval", "wall_s": 10.0, "greedy_acc": 0.2, "accuracy": 0.1},
        {"role": "eval", "wall_s": 20.0, "greedy_acc": 0.5},
        {"role": "eval", "wall_s": 30.0, "greedy_acc": 0.4, "accuracy": 0.6},
        {"role": "learner", "wall_s": 5.0, "greedy_acc": None},
    ]
    assert time_to_accuracy(records, 0.5) == 20.0
    assert time_to_accuracy(records, 0.2) == 10.0
    assert time_to_accuracy(records, 0.9) is None
    assert time_to_accuracy(records, 0.5, key="accuracy") == 30.0
    write_run(tmp_path)  # evals: 0.2 at step 0, 0.3 at step 5, 0.4 at step 10
    hit = time_to_accuracy(read_metrics(tmp_path), 0.3)
    assert hit is not None and hit == next(
        r["wall_s"] for r in read_metrics(tmp_path) if r.get("greedy_acc") == 0.3
    )


def test_cli_prints_the_summary_and_writes_the_pngs(tmp_path: Path) -> None:
    write_run(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "streamrl", "report", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "run summary" in out.stdout and "eval greedy_acc" in out.stdout and "reward_mean" in out.stdout
    assert out.stdout.count("wrote ") == len(PLOTS)
    assert (tmp_path / "report" / "weight_sync.png").exists()
    empty = subprocess.run(
        [sys.executable, "-m", "streamrl", "report", str(tmp_path / "report")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert empty.returncode == 1 and "no metrics records" in empty.stderr
