"""Metrics: one JSON line per record in the run folder, scalars mirrored to TensorBoard event files.

    writer = MetricsWriter(run_dir, "learner")               # -> run_dir/metrics.jsonl, run_dir/tb/learner
    writer.write({"loss": 0.3, "staleness": {"0": 12, "1": 3}}, step=7)
    records = read_metrics(run_dir)                          # every metrics*.jsonl, oldest first

A record is `{"role", "name", "step", "wall_s", "time", **values}`: `time` is unix seconds and
`wall_s` is seconds since the run started, read from `run_dir/started_at` (unix seconds as text; the
first writer of a run creates it), so records of all processes share one time axis. The learner's
records (roles "learner" and "eval") go to `metrics.jsonl`; every other process writes its own
`metrics-<role>-<name>.jsonl`, so no two processes append to one file. Each record is one `write(2)`
on an O_APPEND descriptor: a reader sees whole lines or, at worst, a partial last line, which
`read_metrics` skips. After a crash, the next writer starts on a fresh line, so a record cut short
stays a single bad line, which is skipped with a warning.

Non-finite floats are written as JSON's NaN/Infinity extensions (Python reads them; strict parsers
such as jq do not), because a NaN loss is worth seeing. TensorBoard gets numeric values only
(nested dicts such as the staleness histogram, strings and None are JSONL-only), one TensorBoard run
per role and process: `tb/<role>` or `tb/<role>/<name>`.

The generator side: `RolloutMeter` counts what the generator's records report, and `TimedSandbox`
wraps a sandbox to time each call the tool path makes. The learner side: `batch_stats` says what a
batch reports about the rollouts in it.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from streamrl.log import get_logger
from streamrl.messages import Batch, unpack

if TYPE_CHECKING:
    from streamrl.agent import RolloutResult

__all__ = ["MetricsWriter", "RolloutMeter", "TimedSandbox", "batch_stats", "read_metrics", "run_started_at"]

log = get_logger(__name__)
LEARNER_ROLES = ("learner", "eval")  # written by the learner process into metrics.jsonl
RESERVED = ("role", "name", "step", "wall_s", "time")


def run_started_at(run_dir: Path, now: float | None = None) -> float:
    """The run's start (unix seconds) from `run_dir/started_at`, created with `now` if missing.

    Created by linking a complete temporary file into place, so concurrent first writers agree on
    one value and no reader ever sees a half-written file.
    """
    path = run_dir / "started_at"
    with suppress(FileNotFoundError):
        return _parse_started_at(path)
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".started_at.{os.getpid()}"
    tmp.write_text(f"{time.time() if now is None else now!r}\n")  # repr: exact, so wall_s starts at 0.0
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass  # another process was first: use its value
    finally:
        tmp.unlink()
    return _parse_started_at(path)


def _parse_started_at(path: Path) -> float:
    text = path.read_text().strip()
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{path}: expected unix seconds, e.g. 1795269125.5, got {text[:40]!r}") from None


def metrics_path(run_dir: Path, role: str, name: str | None) -> Path:
    if role in LEARNER_ROLES:
        return run_dir / "metrics.jsonl"
    if not name:
        raise ValueError(f"a {role!r} metrics writer needs a name (its file is metrics-{role}-<name>.jsonl)")
    return run_dir / f"metrics-{role}-{name}.jsonl"


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy and torch scalars
        return value.item()
    raise TypeError(f"metric value of type {type(value).__name__} is not JSON-serialisable: {value!r}")


def _scalar(value: Any) -> float | None:
    """`value` as a TensorBoard scalar, or None for what only JSONL keeps (dicts, text, None, bools)."""
    if isinstance(value, bool) or not (isinstance(value, int | float) or getattr(value, "ndim", None) == 0):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return True
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


class MetricsWriter:
    """Appends records of one process (module docstring). Not thread-safe; one per role and process.

    A distributed learner writes from rank 0 only.
    """

    def __init__(self, run_dir: Path, role: str, name: str | None = None, tensorboard: bool = True) -> None:
        self.run_dir, self.role, self.name = Path(run_dir), role, name
        self.path = metrics_path(self.run_dir, role, name)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if not _ends_with_newline(self.path):
            os.write(self._fd, b"\n")  # a crashed writer left half a line: keep ours separate
        self._started: float | None = None
        self._count = 0
        self.tensorboard = tensorboard
        self._tb: dict[str, Any] = {}  # role -> SummaryWriter, opened on first scalar
        if tensorboard:
            try:  # fail here, not after the first JSONL line; lazy because it imports torch
                import tensorboardX  # noqa: F401
            except ImportError:
                raise ModuleNotFoundError(
                    "MetricsWriter(tensorboard=True) needs tensorboardX (pinned in pyproject.toml)"
                ) from None

    def write(
        self, values: Mapping[str, Any], step: int | None = None, role: str | None = None
    ) -> dict[str, Any]:
        """Append one record; `step` defaults to the number of records this writer wrote before.

        `role` overrides the writer's role for this record, within one file: the learner's writer
        also writes its "eval" records.
        """
        role = role or self.role
        if role != self.role and not (role in LEARNER_ROLES and self.role in LEARNER_ROLES):
            raise ValueError(f"a {self.role!r} writer cannot write {role!r} records: they go to another file")
        clash = [k for k in values if k in RESERVED]
        if clash:
            raise ValueError(f"metric names {clash} are reserved for the record header {RESERVED}")
        now = time.time()
        if self._started is None:
            self._started = run_started_at(self.run_dir, now)
        step = self._count if step is None else int(step)
        record = {"role": role, "name": self.name, "step": step, "wall_s": now - self._started}
        record |= {"time": now, **values}
        line = json.dumps(record, default=_json_default, separators=(",", ":")) + "\n"
        os.write(self._fd, line.encode())
        self._count += 1
        if self.tensorboard:
            for key, value in values.items():
                if (scalar := _scalar(value)) is not None:
                    self._tb_writer(role).add_scalar(key, scalar, global_step=step, walltime=now)
        return record

    def _tb_writer(self, role: str) -> Any:
        if role not in self._tb:
            from tensorboardX import SummaryWriter

            logdir = self.run_dir / "tb" / role / (self.name or "")
            self._tb[role] = SummaryWriter(logdir=str(logdir), flush_secs=10)
        return self._tb[role]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        for tb in self._tb.values():
            tb.close()
        self._tb.clear()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every record in `run_dir/metrics*.jsonl`, ordered by time (stable within a file).

    A last line without its newline is a record being written (or cut by a crash) and is skipped
    silently; any other line that is not a JSON object is skipped with a warning naming it.
    """
    records: list[dict[str, Any]] = []
    for path in sorted(Path(run_dir).glob("metrics*.jsonl")):
        text = path.read_text(errors="replace")
        lines = text.split("\n")
        complete = lines[:-1]  # the last element is "" or a partial record
        for lineno, line in enumerate(complete, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                log.warning("metrics_line_skipped", file=str(path), line=lineno, error=str(e))
                continue
            if isinstance(record, dict):
                records.append(record)
            else:
                log.warning("metrics_line_skipped", file=str(path), line=lineno, error="not an object")
    records.sort(key=lambda r: r.get("time", 0.0))
    return records


# ---------------------------------------------------------------------------- generator side


class RolloutMeter:
    """What a generator's metrics record says, counted as rollouts run.

    `snapshot()` returns rates and means over the `interval_s` seconds since the previous snapshot
    (tokens_per_s, trajectories_per_s, idle_ratio, reward_mean, tool_call_success_rate,
    tool_latency_ms_mean; None where the interval had nothing to average) and totals since start
    (trajectories, tokens, tool_calls, tool_errors, tool_failures). Idle means no trajectory in
    flight (generating, running tools or being scored).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last = clock()
        self._idle_since: float | None = self._last
        self._idle_s = 0.0
        self.in_flight = 0
        self.totals = {"trajectories": 0, "tokens": 0, "tool_calls": 0, "tool_errors": 0, "tool_failures": 0}
        self._window = dict.fromkeys(("tokens", "trajectories", "reward", "calls", "failures"), 0.0)
        self._latency_s: list[float] = []

    @contextmanager
    def tracking(self) -> Iterator[None]:
        """Wrap the life of one trajectory (generation, tools, scoring): the generator is busy."""
        if self.in_flight == 0 and self._idle_since is not None:
            self._idle_s += self._clock() - self._idle_since
            self._idle_since = None
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle_since = self._clock()

    def record(self, result: RolloutResult, reward: float) -> None:
        tokens = sum(result.loss_mask)  # the model's tokens, not the tool's
        self.totals["trajectories"] += 1
        self.totals["tokens"] += tokens
        self.totals["tool_calls"] += result.tool_calls
        self.totals["tool_errors"] += result.tool_errors
        self.totals["tool_failures"] += result.tool_failures
        w = self._window
        w["tokens"] += tokens
        w["trajectories"] += 1
        w["reward"] += reward
        w["calls"] += result.tool_calls
        w["failures"] += result.tool_failures

    def tool_latency(self, seconds: float) -> None:
        self._latency_s.append(seconds)

    def snapshot(self) -> dict[str, Any]:
        now = self._clock()
        span = max(now - self._last, 1e-9)
        idle = self._idle_s
        if self._idle_since is not None:
            idle += now - max(self._idle_since, self._last)
            self._idle_since = now
        w, lat = self._window, self._latency_s
        out: dict[str, Any] = {
            "interval_s": span,
            "tokens_per_s": w["tokens"] / span,
            "trajectories_per_s": w["trajectories"] / span,
            "idle_ratio": min(1.0, idle / span),
            "reward_mean": w["reward"] / w["trajectories"] if w["trajectories"] else None,
            "tool_call_success_rate": 1.0 - w["failures"] / w["calls"] if w["calls"] else None,
            "tool_latency_ms_mean": 1000.0 * math.fsum(lat) / len(lat) if lat else None,
            "in_flight": self.in_flight,
            **self.totals,
        }
        self._last, self._idle_s = now, 0.0
        self._window = dict.fromkeys(w, 0.0)
        self._latency_s = []
        return out


class TimedSandbox:
    """A sandbox whose `submit` and `run` calls report their latency to a RolloutMeter."""

    def __init__(self, inner: Any, meter: RolloutMeter) -> None:
        self.inner, self.meter = inner, meter

    async def submit(self, sub: Any) -> Any:
        t0 = time.monotonic()
        try:
            return await self.inner.submit(sub)
        finally:
            self.meter.tool_latency(time.monotonic() - t0)

    async def run(self, code: str, stdin: str | None = None) -> Any:
        t0 = time.monotonic()
        try:
            return await self.inner.run(code, stdin)
        finally:
            self.meter.tool_latency(time.monotonic() - t0)

    async def close(self) -> None:
        await self.inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def batch_stats(batch: Batch) -> dict[str, Any]:
    """What the batch says about the rollouts that produced it (reward, length, staleness, tools)."""
    trajs = [t for g in batch.groups for t in g.trajectories]
    rewards = np.array([t.reward for t in trajs], dtype=np.float64)
    lengths = np.array([t.num_tokens for t in trajs], dtype=np.float64)
    lags = [batch.step - g.admitted_version for g in batch.groups]
    hist: dict[str, int] = {}
    for lag in lags:
        hist[str(lag)] = hist.get(str(lag), 0) + 1
    # Token-level lag: how many versions behind the policy being trained each model token was sampled.
    token_lags = [
        batch.step - unpack("versions", t.versions)[unpack("loss_mask", t.loss_mask) > 0] for t in trajs
    ]
    flat = np.concatenate(token_lags) if token_lags else np.zeros(0)
    calls = sum(t.tool_calls for t in trajs)
    errors = sum(t.tool_errors for t in trajs)
    return {
        "groups": len(batch.groups),
        "trajectories": len(trajs),
        "reward_mean": float(rewards.mean()) if len(trajs) else 0.0,
        "accuracy": float((rewards > 0).mean()) if len(trajs) else 0.0,
        "response_len_mean": float(lengths.mean()) if len(trajs) else 0.0,
        "staleness": hist,
        "staleness_mean": float(np.mean(lags)) if lags else 0.0,
        "token_lag_mean": float(flat.mean()) if flat.size else 0.0,
        "tool_calls_mean": calls / max(1, len(trajs)),
        "tool_success_rate": (calls - errors) / calls if calls else None,
        "truncated_frac": sum(t.finish_reason == "length" for t in trajs) / max(1, len(trajs)),
    }
