"""`streamrl report RUN_DIR`: PNG plots and a summary table from a run's metrics records.

    streamrl report runs/tiny-arith          # -> runs/tiny-arith/report/*.png, a table on stdout
    report = make_report(run_dir)           # the same from Python: files written, plots skipped, summary
    t = time_to_accuracy(read_metrics(run_dir), 0.5)     # wall seconds until greedy eval accuracy >= 0.5

Reads what streamrl.metrics writes: learner records (role "learner", one per step), eval records
(role "eval": greedy_acc, sampled_acc) and generator records (role "generator", one per name every
few seconds). A plot whose data is missing is skipped with a note, never an error, so the report
works on a run that is still going, crashed early, or had no tools or evals.

Plots use matplotlib Figures on the Agg canvas directly, never pyplot: no display, no global state.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl.metrics import read_metrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["Report", "RunData", "Summary", "make_report", "summarize", "time_to_accuracy"]

Record = dict[str, Any]
SYNC_PHASES = ("sync_pause_s", "sync_gather_s", "sync_wire_s", "sync_load_s", "sync_resume_s")
# (key, which value is best: max, min or None) for the summary table, learner then eval
LEARNER_ROWS = (
    ("reward_mean", max),
    ("accuracy", max),
    ("response_len_mean", None),
    ("loss", None),
    ("entropy", None),
    ("grad_norm", None),
    ("staleness_mean", min),
    ("roc_keep_rate", None),
    ("tool_calls_mean", None),
    ("tool_success_rate", max),
    ("tokens_per_s", max),
    ("idle_ratio", min),
)
EVAL_ROWS = (("greedy_acc", max), ("sampled_acc", max))


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _xy(records: Iterable[Record], key: str, x: str) -> tuple[list[float], list[float]]:
    pairs = [(r[x], r[key]) for r in records if _number(r.get(key)) and _number(r.get(x))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


@dataclass
class RunData:
    """A run's records split by role, each list in time order."""

    learner: list[Record] = field(default_factory=list)
    evals: list[Record] = field(default_factory=list)
    generators: dict[str, list[Record]] = field(default_factory=dict)
    buffer: list[Record] = field(default_factory=list)

    @classmethod
    def from_records(cls, records: Iterable[Record]) -> RunData:
        data = cls()
        for r in records:
            role = r.get("role")
            if role == "learner":
                data.learner.append(r)
            elif role == "eval":
                data.evals.append(r)
            elif role == "generator":
                data.generators.setdefault(str(r.get("name")), []).append(r)
            elif role == "buffer":
                data.buffer.append(r)
        return data

    def empty(self) -> bool:
        return not (self.learner or self.evals or self.generators)

    def wall_end(self) -> float:
        walls = [r["wall_s"] for rs in (self.learner, self.evals, *self.generators.values()) for r in rs]
        return max((w for w in walls if _number(w)), default=0.0)


def time_to_accuracy(records: Iterable[Record], target: float, key: str = "greedy_acc") -> float | None:
    """Wall seconds (since the run started) of the first record whose `key` reached `target`, or None."""
    hits = [
        r["wall_s"] for r in records if _number(r.get(key)) and r[key] >= target and _number(r.get("wall_s"))
    ]
    return min(hits, default=None)


# ---------------------------------------------------------------------------- summary


@dataclass(frozen=True)
class Row:
    name: str
    first: float
    last: float
    best: float | None


@dataclass
class Summary:
    rows: list[Row]
    totals: dict[str, float]

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.name == name)


def summarize(data: RunData) -> Summary:
    rows: list[Row] = []
    for source, prefix, spec in ((data.learner, "", LEARNER_ROWS), (data.evals, "eval ", EVAL_ROWS)):
        for key, best in spec:
            _, ys = _xy(source, key, "step")
            if ys:
                rows.append(Row(prefix + key, ys[0], ys[-1], None if best is None else best(ys)))
    totals: dict[str, float] = {"wall_s": data.wall_end()}
    if data.learner:
        totals["steps"] = len(data.learner)
        totals["last_step"] = data.learner[-1].get("step", 0)
        totals["learner_tokens"] = sum(_xy(data.learner, "tokens", "step")[1])
        sync = [sum(r.get(k, 0.0) for k in SYNC_PHASES if _number(r.get(k))) for r in data.learner]
        if any(sync):
            totals["sync_s_mean"] = sum(sync) / len(sync)
    if data.generators:
        last = [rs[-1] for rs in data.generators.values()]
        totals["generators"] = len(last)
        for key in ("trajectories", "groups_sent", "tokens", "tool_calls", "tool_errors"):
            if any(_number(r.get(key)) for r in last):
                totals[f"generated_{key}"] = sum(r[key] for r in last if _number(r.get(key)))
    return Summary(rows, totals)


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 1000 or float(v).is_integer() else f"{v:.4g}"


def print_summary(summary: Summary, console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title="run summary")
    for col in ("metric", "first", "last", "best"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for r in summary.rows:
        table.add_row(r.name, _fmt(r.first), _fmt(r.last), _fmt(r.best))
    console.print(table)
    totals = Table(title="totals")
    totals.add_column("total")
    totals.add_column("value", justify="right")
    for k, v in summary.totals.items():
        totals.add_row(k, _fmt(v))
    console.print(totals)


# ---------------------------------------------------------------------------- plots


@dataclass
class Panel:
    title: str
    xlabel: str
    lines: list[tuple[str, list[float], list[float]]] = field(default_factory=list)
    ylabel: str = ""
    points: bool = False  # markers only (sparse data such as evals)

    def add(self, label: str, xy: tuple[list[float], list[float]]) -> None:
        if xy[0]:
            self.lines.append((label, *xy))


def _time_unit(end_s: float) -> tuple[float, str]:
    return (3600.0, "h") if end_s > 3 * 3600 else (60.0, "min") if end_s > 180 else (1.0, "s")


def _figure(n: int, cols: int = 3) -> tuple[Figure, list[Axes]]:
    """`n` panels, at most `cols` a row; unused cells of the grid are hidden."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = min(n, cols)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(6.0 * cols, 4.0 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(rows, cols, squeeze=False).flat)
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def _draw(panels: Sequence[Panel], what: str) -> Figure | str:
    panels = [p for p in panels if p.lines]
    if not panels:
        return f"no {what} in the records"
    fig, axes = _figure(len(panels))
    for ax, p in zip(axes, panels, strict=True):
        for label, xs, ys in p.lines:
            style = {"marker": "o", "linestyle": "none"} if p.points or label.startswith("eval") else {}
            ax.plot(xs, ys, label=label, **({"marker": "." if len(xs) < 50 else None} | style))
        ax.set_title(p.title)
        ax.set_xlabel(p.xlabel)
        ax.set_ylabel(p.ylabel)
        ax.grid(alpha=0.3)
        ax.ticklabel_format(axis="both", useOffset=False)  # "60.5 s", never "0.5 +6e1"
        ax.legend(fontsize="small")
    return fig


def _wall(
    data: RunData,
) -> tuple[Callable[[tuple[list[float], list[float]]], tuple[list[float], list[float]]], str]:
    div, unit = _time_unit(data.wall_end())
    return (lambda xy: ([x / div for x in xy[0]], xy[1])), f"wall time ({unit})"


def plot_reward(data: RunData) -> Figure | str:
    scale, wall = _wall(data)
    by_step, by_time = Panel("reward and accuracy", "step"), Panel("reward and accuracy", wall)
    for key in ("reward_mean", "accuracy"):
        by_step.add(key, _xy(data.learner, key, "step"))
        by_time.add(key, scale(_xy(data.learner, key, "wall_s")))
    for key in ("greedy_acc", "sampled_acc"):
        by_step.add(f"eval {key}", _xy(data.evals, key, "step"))
        by_time.add(f"eval {key}", scale(_xy(data.evals, key, "wall_s")))
    return _draw([by_step, by_time], "reward, accuracy or eval accuracy")


def plot_response_length(data: RunData) -> Figure | str:
    p = Panel("response length", "step", ylabel="tokens")
    p.add("response_len_mean", _xy(data.learner, "response_len_mean", "step"))
    return _draw([p], "response_len_mean")


def plot_staleness(data: RunData) -> Figure | str:
    hist: dict[int, float] = {}
    for r in data.learner:
        for lag, count in (r.get("staleness") or {}).items():
            hist[int(lag)] = hist.get(int(lag), 0) + count
    mean = Panel("mean staleness per step", "step", ylabel="versions behind")
    mean.add("staleness_mean", _xy(data.learner, "staleness_mean", "step"))
    if not hist:
        return _draw([mean], "staleness histogram")
    fig, axes = _figure(2 if mean.lines else 1)
    lags = sorted(hist)
    axes[0].bar(lags, [hist[k] for k in lags], color="tab:blue")
    axes[0].set_xticks(lags)
    axes[0].set(title="staleness of trained groups (all steps)", xlabel="versions behind", ylabel="groups")
    if mean.lines:
        _, xs, ys = mean.lines[0]
        axes[1].plot(xs, ys, marker="." if len(xs) < 50 else None)
        axes[1].set(title=mean.title, xlabel="step", ylabel=mean.ylabel)
        axes[1].grid(alpha=0.3)
    return fig


def plot_throughput(data: RunData) -> Figure | str:
    scale, wall = _wall(data)
    tps = Panel("tokens/s", wall, ylabel="tokens/s")
    idle = Panel("idle ratio", wall)
    tps.add("learner", scale(_xy(data.learner, "tokens_per_s", "wall_s")))
    idle.add("learner", scale(_xy(data.learner, "idle_ratio", "wall_s")))
    for name, rs in sorted(data.generators.items()):
        tps.add(name, scale(_xy(rs, "tokens_per_s", "wall_s")))
        idle.add(name, scale(_xy(rs, "idle_ratio", "wall_s")))
    return _draw([tps, idle], "tokens/s or idle ratio")


def plot_roc(data: RunData) -> Figure | str:
    """The buffer's running totals: groups that survived RoC's filters, trajectories it kept."""
    scale, wall = _wall(data)
    p = Panel("RoC keep rate (since start)", wall, ylabel="kept / received")
    p.add("groups", scale(_xy(data.buffer, "roc_keep_rate", "wall_s")))
    p.add("trajectories", scale(_xy(data.buffer, "roc_trajectory_keep_rate", "wall_s")))
    return _draw([p], "roc_keep_rate")


WINDOW = 6  # generator records (~5 s each) per success-rate point: one interval can hold 2 calls


def _windowed_success(records: list[Record]) -> tuple[list[float], list[float]]:
    """Success rate from the running totals over a sliding window, so a 5-second interval with two
    failed calls does not plot as a drop to zero."""
    rows = [r for r in records if _number(r.get("tool_calls")) and _number(r.get("tool_failures"))]
    xs, ys = [], []
    for i, r in enumerate(rows):
        first = rows[max(0, i - WINDOW)] if i >= WINDOW else None
        calls = r["tool_calls"] - (first["tool_calls"] if first else 0)
        failures = r["tool_failures"] - (first["tool_failures"] if first else 0)
        if calls > 0 and _number(r.get("wall_s")):
            xs.append(r["wall_s"])
            ys.append(1.0 - failures / calls)
    return xs, ys


def plot_tools(data: RunData) -> Figure | str:
    made = [r.get("tool_calls_mean") for r in data.learner] + [
        r.get("tool_calls") for rs in data.generators.values() for r in rs
    ]
    if not any(_number(v) and v > 0 for v in made):
        return "no tool calls in this run"
    scale, wall = _wall(data)
    success = Panel("tool-call success rate", wall)
    latency = Panel("sandbox latency", wall, ylabel="ms per call")
    success.add("learner batches", scale(_xy(data.learner, "tool_success_rate", "wall_s")))
    for name, rs in sorted(data.generators.items()):
        success.add(f"{name} (last {WINDOW} records)", scale(_windowed_success(rs)))
        latency.add(name, scale(_xy(rs, "tool_latency_ms_mean", "wall_s")))
    calls = Panel("tool calls per trajectory", "step")
    calls.add("tool_calls_mean", _xy(data.learner, "tool_calls_mean", "step"))
    return _draw([success, latency, calls], "tool-call metrics")


def plot_weight_sync(data: RunData) -> Figure | str:
    rows = [r for r in data.learner if _number(r.get("step")) and any(_number(r.get(k)) for k in SYNC_PHASES)]
    if not rows:
        return "no weight-sync phase times (sync_*_s) in the records"
    fig, (ax,) = _figure(1)
    steps = [r["step"] for r in rows]
    bottom = [0.0] * len(rows)
    for key in SYNC_PHASES:
        values = [r[key] if _number(r.get(key)) else 0.0 for r in rows]
        ax.bar(steps, values, bottom=bottom, label=key.removeprefix("sync_").removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set(title="weight sync phases per step", xlabel="step", ylabel="seconds")
    handles, labels = ax.get_legend_handles_labels()  # top of the stack first, outside the bars
    ax.legend(handles[::-1], labels[::-1], fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def plot_policy(data: RunData) -> Figure | str:
    keys = [
        ("loss", ["loss"]),
        ("entropy", ["entropy"]),
        ("importance ratio", ["ratio_mean", "ratio_max"]),
        ("clip fractions", ["clip_frac_low", "clip_frac_high", "clip_frac_dual"]),
        ("grad norm", ["grad_norm"]),
        ("learning rate", ["lr"]),
    ]
    panels = []
    for title, names in keys:
        p = Panel(title, "step")
        for key in names:
            p.add(key, _xy(data.learner, key, "step"))
        panels.append(p)
    return _draw(panels, "loss, entropy, ratio, clip or grad-norm values")


PLOTS: dict[str, Callable[[RunData], Figure | str]] = {
    "reward_accuracy.png": plot_reward,
    "response_length.png": plot_response_length,
    "staleness.png": plot_staleness,
    "throughput.png": plot_throughput,
    "roc_keep_rate.png": plot_roc,
    "tools.png": plot_tools,
    "weight_sync.png": plot_weight_sync,
    "policy.png": plot_policy,
}


# ---------------------------------------------------------------------------- entry points


@dataclass
class Report:
    written: list[Path]
    skipped: dict[str, str]  # file name -> why
    summary: Summary
    empty: bool  # no records at all


def make_report(run_dir: Path, out_dir: Path | None = None) -> Report:
    """Write every plot with data into `out_dir` (default RUN_DIR/report); summarize the run."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run folder {run_dir} does not exist")
    data = RunData.from_records(read_metrics(run_dir))
    if data.empty():
        return Report([], dict.fromkeys(PLOTS, "no metrics records"), summarize(data), empty=True)
    out = out_dir or run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    written, skipped = [], {}
    for name, plot in PLOTS.items():
        fig = plot(data)
        if isinstance(fig, str):
            skipped[name] = fig
            continue
        fig.savefig(out / name, dpi=100)
        written.append(out / name)
    return Report(written, skipped, summarize(data), empty=False)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="streamrl report", description="plots and a summary of a run's metrics")
    ap.add_argument("run_dir", type=Path, help="the run folder (holds metrics*.jsonl)")
    ap.add_argument("--out", type=Path, help="where the PNGs go (default RUN_DIR/report)")
    args = ap.parse_args(argv)
    try:
        report = make_report(args.run_dir, args.out)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if report.empty:
        print(f"error: no metrics records in {args.run_dir} (metrics*.jsonl)", file=sys.stderr)
        return 1
    print_summary(report.summary)
    for path in report.written:
        print(f"wrote {path}")
    for name, why in report.skipped.items():
        print(f"skipped {name}: {why}")
    return 0
