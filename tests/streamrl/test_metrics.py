"""Metrics records: JSONL files per process, the run's shared clock, TensorBoard scalars, crash-tolerant
reading, and the generator's meter (rates, idle ratio, tool latency) on a fake clock."""

from __future__ import annotations

import asyncio
import json
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from streamrl import messages as m
from streamrl.agent import RolloutResult
from streamrl.metrics import (
    MetricsWriter,
    RolloutMeter,
    TimedSandbox,
    batch_stats,
    read_metrics,
    run_started_at,
)
from tests.streamrl.agent_fakes import ScriptedSandbox, ok


def tb_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] from the TFRecord-framed Event protos of every event file in `logdir`."""
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack_from("<Q", data, pos)
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4  # length, its crc, the record, its crc
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_learner_and_eval_share_metrics_jsonl_and_other_processes_get_their_own_file(tmp_path: Path) -> None:
    with (
        MetricsWriter(tmp_path, "learner") as learner,
        MetricsWriter(tmp_path, "generator", "gen-0") as gen0,
        MetricsWriter(tmp_path, "generator", "gen-1") as gen1,
    ):
        learner.write({"loss": 0.5, "staleness": {"0": 12, "1": 3}}, step=0)
        learner.write({"greedy_acc": 0.25}, step=0, role="eval")
        gen0.write({"tokens_per_s": 100.0})
        gen1.write({"tokens_per_s": 200.0})
        gen1.write({"tokens_per_s": 300.0})
    files = sorted(p.name for p in tmp_path.glob("*.jsonl"))
    assert files == ["metrics-generator-gen-0.jsonl", "metrics-generator-gen-1.jsonl", "metrics.jsonl"]
    lines = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["role"], r["name"], r["step"]) for r in lines] == [("learner", None, 0), ("eval", None, 0)]
    assert lines[0]["staleness"] == {"0": 12, "1": 3}  # nested dicts kept as-is
    assert set(lines[0]) == {"role", "name", "step", "wall_s", "time", "loss", "staleness"}
    gen = [json.loads(s) for s in (tmp_path / "metrics-generator-gen-1.jsonl").read_text().splitlines()]
    assert [(r["name"], r["step"], r["tokens_per_s"]) for r in gen] == [
        ("gen-1", 0, 200.0),
        ("gen-1", 1, 300.0),
    ]
    assert len(read_metrics(tmp_path)) == 5


def test_wall_s_counts_from_the_runs_started_at_file(tmp_path: Path) -> None:
    (tmp_path / "started_at").write_text(f"{time.time() - 100.0}\n")  # the launcher started 100 s ago
    with MetricsWriter(tmp_path, "learner", tensorboard=False) as w:
        record = w.write({"loss": 1.0}, step=3)
    assert record["wall_s"] == pytest.approx(100.0, abs=5.0)
    assert record["time"] == pytest.approx(time.time(), abs=5.0)


def test_without_started_at_the_first_writer_sets_the_clock_for_every_process(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path, "learner", tensorboard=False) as first:
        assert first.write({"x": 1})["wall_s"] == 0.0
        started = float((tmp_path / "started_at").read_text())
        time.sleep(0.05)
        with MetricsWriter(tmp_path, "generator", "gen-0", tensorboard=False) as later:
            r = later.write({"x": 2})
    assert r["wall_s"] == pytest.approx(r["time"] - started) and r["wall_s"] >= 0.05
    assert run_started_at(tmp_path, now=0.0) == started  # never overwritten
    (tmp_path / "started_at").write_text("yesterday\n")
    with pytest.raises(ValueError, match="started_at: expected unix seconds"):
        run_started_at(tmp_path)


def test_values_are_json_serialised_and_bad_names_are_refused(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path, "learner", tensorboard=False) as w:
        w.write({"a": np.float32(0.5), "b": np.int64(3), "c": None, "d": float("nan")})
        with pytest.raises(ValueError, match="reserved"):
            w.write({"step": 1})
        with pytest.raises(ValueError, match="another file"):
            w.write({"x": 1}, role="generator")
        with pytest.raises(TypeError, match="not JSON-serialisable"):
            w.write({"bad": object()})
    with pytest.raises(ValueError, match="needs a name"):
        MetricsWriter(tmp_path, "generator")
    (r,) = read_metrics(tmp_path)
    assert (r["a"], r["b"], r["c"]) == (0.5, 3, None) and np.isnan(r["d"])


def test_tensorboard_gets_numeric_scalars_per_role_and_skips_dicts_text_and_none(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path, "learner") as w:
        for step in range(3):
            w.write({"loss": 1.0 / (step + 1), "staleness": {"0": 4}, "tag": "x", "ok": None}, step=step)
        w.write({"greedy_acc": 0.5, "eval_prompts": np.int64(200)}, step=2, role="eval")
    with MetricsWriter(tmp_path, "generator", "gen-0") as g:
        g.write({"tokens_per_s": 10.0, "done": True})
    learner = tb_scalars(tmp_path / "tb" / "learner")
    assert learner == {"loss": [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]}
    assert tb_scalars(tmp_path / "tb" / "eval") == {"greedy_acc": [(2, 0.5)], "eval_prompts": [(2, 200.0)]}
    assert tb_scalars(tmp_path / "tb" / "generator" / "gen-0") == {"tokens_per_s": [(0, 10.0)]}


def test_read_metrics_skips_a_truncated_last_line_and_recovers_after_a_crash(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path, "learner", tensorboard=False) as w:
        w.write({"loss": 1.0}, step=0)
        w.write({"loss": 0.9}, step=1)
    path = tmp_path / "metrics.jsonl"
    with path.open("a") as f:
        f.write('{"role":"learner","step":2,"lo')  # the writer died mid-record
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    with MetricsWriter(tmp_path, "learner", tensorboard=False) as w:  # the run resumes
        w.write({"loss": 0.8}, step=2)
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]  # the cut line is skipped
    assert path.read_text().splitlines()[2].endswith('"lo')


def test_read_metrics_orders_records_of_all_files_by_time(tmp_path: Path) -> None:
    with (
        MetricsWriter(tmp_path, "generator", "gen-1", tensorboard=False) as g,
        MetricsWriter(tmp_path, "learner", tensorboard=False) as w,
    ):
        for i in range(3):
            g.write({"i": 2 * i})
            w.write({"i": 2 * i + 1})
    assert [r["i"] for r in read_metrics(tmp_path)] == list(range(6))
    assert read_metrics(tmp_path / "missing") == []


# ---------------------------------------------------------------------------- generator meter


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def rollout(tokens: int, tool_calls: int = 0, failures: int = 0, errors: int = 0) -> RolloutResult:
    return RolloutResult(
        prompt_ids=[1],
        response_ids=list(range(tokens + 3)),
        loss_mask=[1] * tokens + [0] * 3,  # three tool tokens are not generated tokens
        logprobs=[0.0] * (tokens + 3),
        versions=[0] * (tokens + 3),
        text="",
        finish_reason="stop",
        stop_cause="end_of_turn",
        num_turns=1,
        tool_calls=tool_calls,
        tool_errors=errors,
        tool_failures=failures,
    )


def test_meter_rates_idle_ratio_and_totals_over_each_interval() -> None:
    clock = Clock()
    meter = RolloutMeter(clock)
    clock.t = 2.0  # idle 0..2
    with meter.tracking():
        clock.t = 3.0
        with meter.tracking():  # two in flight 3..5
            clock.t = 5.0
        meter.record(rollout(40, tool_calls=2, failures=1, errors=1), reward=1.0)
        meter.tool_latency(0.010)
        meter.tool_latency(0.030)
        clock.t = 6.0
    meter.record(rollout(20), reward=0.0)
    clock.t = 10.0  # idle 6..10
    s = meter.snapshot()
    assert s["interval_s"] == 10.0 and s["idle_ratio"] == pytest.approx(0.6)
    assert (s["tokens_per_s"], s["trajectories_per_s"], s["reward_mean"]) == (6.0, 0.2, 0.5)
    assert s["tool_call_success_rate"] == 0.5 and s["tool_latency_ms_mean"] == pytest.approx(20.0)
    assert (s["trajectories"], s["tokens"], s["tool_calls"], s["tool_errors"], s["tool_failures"]) == (
        2,
        60,
        2,
        1,
        1,
    )

    clock.t = 11.0
    with meter.tracking():  # busy 11..14, across the snapshot at 12
        clock.t = 12.0
        with meter.tracking():
            s = meter.snapshot()
            assert s["interval_s"] == 2.0 and s["idle_ratio"] == pytest.approx(0.5) and s["in_flight"] == 2
            assert s["reward_mean"] is None and s["tool_call_success_rate"] is None
            assert s["tool_latency_ms_mean"] is None and s["tokens_per_s"] == 0.0
            clock.t = 14.0
    clock.t = 16.0
    s = meter.snapshot()
    assert s["interval_s"] == 4.0 and s["idle_ratio"] == pytest.approx(0.5) and s["in_flight"] == 0
    assert s["trajectories"] == 2  # totals carry over; nothing was recorded since


def test_timed_sandbox_times_each_call_and_passes_everything_through() -> None:
    meter = RolloutMeter()
    inner = ScriptedSandbox([ok("1\n"), ok("2\n")], delay_s=0.02)
    sandbox = TimedSandbox(inner, meter)

    async def calls() -> list[str]:
        from sandbox_bridge.client import python_submission

        return [(await sandbox.submit(python_submission(f"print({i})"))).stdout for i in (1, 2)]

    assert asyncio.run(calls()) == ["1\n", "2\n"]
    assert sandbox.submissions is inner.submissions and len(inner.submissions) == 2
    assert meter.snapshot()["tool_latency_ms_mean"] >= 20.0


def traj(
    i: int, reward: float, versions: list[int], mask: list[int], calls: int = 0, errors: int = 0
) -> m.Trajectory:
    return m.Trajectory(
        sample_index=i,
        tokens=m.pack("tokens", [5] * len(mask)),
        loss_mask=m.pack("loss_mask", mask),
        logprobs=m.pack("logprobs", [-0.1] * len(mask)),
        versions=m.pack("versions", versions),
        reward=reward,
        finish_reason="length" if i == 0 else "stop",
        tool_calls=calls,
        tool_errors=errors,
    )


def test_batch_stats_reports_reward_accuracy_staleness_token_lag_and_tools() -> None:
    g1 = m.Group(
        uid=1,
        prompt_id="a",
        admitted_version=3,
        generator="g",
        prompt_tokens=m.pack("prompt_tokens", [1]),
        trajectories=[
            traj(0, 1.0, [3, 3, -1, 4], [1, 1, 0, 1], calls=2, errors=1),
            traj(1, 0.0, [4, 4], [1, 1]),
        ],
    )
    g2 = m.Group(
        uid=2,
        prompt_id="b",
        admitted_version=4,
        generator="g",
        prompt_tokens=m.pack("prompt_tokens", [1]),
        trajectories=[traj(0, -5.0, [4], [1]), traj(1, 5.0, [4, 4, 4], [1, 1, 1], calls=1)],
    )
    batch = m.Batch(step=5, policy_version=5, groups=[g1, g2], advantages=[m.pack("advantages", [0, 0])] * 2)
    s = batch_stats(batch)
    assert s["reward_mean"] == (1.0 + 0.0 - 5.0 + 5.0) / 4
    assert s["accuracy"] == 0.5  # positive rewards: 1.0 and 5.0
    assert s["response_len_mean"] == (4 + 2 + 1 + 3) / 4
    assert s["staleness"] == {"2": 1, "1": 1} and s["staleness_mean"] == 1.5
    # model tokens only: versions 3,3,4 | 4,4 | 4 | 4,4,4 -> lags 2,2,1,1,1,1,1,1,1
    assert abs(s["token_lag_mean"] - 11 / 9) < 1e-12
    assert s["tool_calls_mean"] == 3 / 4 and s["tool_success_rate"] == 2 / 3
    assert s["truncated_frac"] == 0.5
