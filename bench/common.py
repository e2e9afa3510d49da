"""Shared benchmark plumbing: timing, a fixed-width table, and the last-line JSON record.

Every bench script prints a human table and then exactly one JSON line last, with at least
{"bench", "metric", "value", "limit_name", "limit_value", "ratio"} where ratio = value / limit and
the limit was measured in the same run, plus the environment (git sha, machine, library versions)
and the script's resolved arguments.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

_PACKAGES = ("torch", "pyzmq", "msgspec", "numpy", "transformers", "megatron-core", "redis", "aiohttp")


def environment() -> dict[str, Any]:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    versions = {}
    for name in _PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return {
        "git_sha": sha,
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "cpu": _cpu_model(),
        "python": platform.python_version(),
        "versions": versions,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall seconds of `fn()` over `repeats` runs after `warmup` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str = "") -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    if title:
        print(title)
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    sys.stdout.flush()


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def emit(
    bench: str,
    metric: str,
    value: float,
    limit_name: str,
    limit_value: float,
    config: dict[str, Any],
    **extra: Any,
) -> dict[str, Any]:
    """Print the last-line JSON record and return it."""
    record = {
        "bench": bench,
        "metric": metric,
        "value": value,
        "limit_name": limit_name,
        "limit_value": limit_value,
        "ratio": value / limit_value if limit_value else float("nan"),
        **extra,
        "config": config,
        "env": environment(),
    }
    print(json.dumps(record), flush=True)
    return record
