"""Sandboxed code execution: LocalSandbox's warm fork-server pool vs a fresh interpreter per call.

What: calls per second and per-call latency (p50, p99: from issuing the call to its result, queueing
included) at 1, 8 and 64 calls in flight, for three programs: a trivial `print`, a program that
imports sympy, and a 0.5 s CPU-bound loop. The sandbox runs with every isolation feature the host
allows (the label is printed and recorded); calls go through the asyncio API, `--workers` warm
workers serve them.

Limit: the naive way, `subprocess.run([python, "-c", code])` per call from a thread pool of the
same width, on the same machine in the same run (no isolation at all). Its interpreter start-up
(~20 ms) and `import sympy` (~0.5 s) are paid by every call; the pool pays them once per worker.
Each cell runs in `--rounds` interleaved sandbox/naive rounds, so load drift on a shared machine
hits both sides. "cpu ms" is user + system time of every process involved, per call, and "x cpu"
the naive/sandbox ratio of it: steadier than calls/s when other work shares the cores. The JSON
line's headline is the trivial program at the concurrency where the sandbox's calls/s advantage is
smallest; every cell is in `cells`.

    python -m bench.sandbox [--quick] [--workers W] [--scale S] [--rounds R]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.common import emit, print_table
from sandbox_bridge import LocalSandbox

PROGRAMS = {
    "trivial": "print(1)",
    "sympy": "import sympy\nprint(sympy.factor('x**2 - 1'))",
    "cpu_0.5s": "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass\nprint('done')",
}
CONCURRENCY = (1, 8, 64)
# Calls per cell at scale 1: (per program) calls at concurrency 1; at higher concurrency,
# max(that, 2 x concurrency) for trivial, max(that, concurrency) for the slow programs.
CALLS = {"trivial": 200, "sympy": 12, "cpu_0.5s": 8}


def _clock_ticks(pid: int) -> float:
    """CPU seconds of `pid` and of its reaped children (a worker reaps its jobs)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class Tally:
    """Calls of one side of one cell, pooled over the interleaved rounds."""

    def __init__(self) -> None:
        self.lat: list[float] = []
        self.elapsed = self.cpu_s = 0.0
        self.failures = 0

    def summary(self) -> dict[str, float]:
        lat = sorted(self.lat)
        return {
            "calls_per_s": len(lat) / self.elapsed,
            "p50_ms": 1000 * statistics.median(lat),
            "p99_ms": 1000 * lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))],
            "cpu_ms_per_call": 1000 * self.cpu_s / len(lat),
            "failures": self.failures,
        }


def run_sandbox(sb: LocalSandbox, code: str, calls: int, concurrency: int, tally: Tally) -> None:
    async def one(gate: asyncio.Semaphore) -> None:
        async with gate:
            t0 = time.perf_counter()
            r = await sb.run(code)
            tally.lat.append(time.perf_counter() - t0)
            tally.failures += not r.run_success

    async def go() -> None:
        gate = asyncio.Semaphore(concurrency)
        await asyncio.gather(*(one(gate) for _ in range(calls)))

    pids = sb.worker_pids()
    cpu0 = _self_cpu() + sum(_clock_ticks(p) for p in pids)
    t0 = time.perf_counter()
    asyncio.run(go())
    tally.elapsed += time.perf_counter() - t0
    tally.cpu_s += _self_cpu() + sum(_clock_ticks(p) for p in pids) - cpu0


def run_naive(code: str, calls: int, concurrency: int, tally: Tally) -> None:
    def one(_: int) -> None:
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=600)
        tally.lat.append(time.perf_counter() - t0)
        tally.failures += p.returncode != 0

    cpu0 = _self_cpu() + _children_cpu()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(one, range(calls)))
    tally.elapsed += time.perf_counter() - t0
    tally.cpu_s += _self_cpu() + _children_cpu() - cpu0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer calls and cells (< 30 s)")
    p.add_argument("--workers", type=int, default=2 * (os.cpu_count() or 1), help="LocalSandbox max_workers")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the number of calls per cell")
    p.add_argument("--timeout-s", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=3, help="interleaved sandbox/naive rounds per cell")
    args = p.parse_args(argv)
    scale = {
        name: args.scale * ((0.3 if name == "trivial" else 0.25) if args.quick else 1.0) for name in CALLS
    }

    cells: list[tuple[str, int, int]] = []
    for name, base in CALLS.items():
        for c in CONCURRENCY:
            if args.quick and (name != "trivial" and c == 64 or name == "cpu_0.5s" and c == 8):
                continue  # 64 sympy imports or 8 x 0.5 s of CPU take 4-15 s per side on 2 cores
            floor = 2 * c if name == "trivial" and not args.quick else c
            cells.append((name, c, max(floor, round(base * scale[name]), 2)))

    t_start = time.perf_counter()
    with LocalSandbox(max_workers=args.workers, timeout_s=args.timeout_s) as sb:
        for _ in range(3 * args.workers):  # warm every worker (first fork, page cache)
            sb.run_sync("print(1)")
        for code in PROGRAMS.values():
            run_naive(code, 1, 1, Tally())
        rows, results = [], []
        for name, c, n in cells:
            code, sbx, naive = PROGRAMS[name], Tally(), Tally()
            rounds = max(1, min(args.rounds, n // max(c, 1)))  # each round keeps c calls in flight
            for i in range(rounds):  # interleaved: load drift on a shared machine hits both sides
                part = n // rounds + (i < n % rounds)
                run_sandbox(sb, code, part, c, sbx)
                run_naive(code, part, c, naive)
            s_, b_ = sbx.summary(), naive.summary()
            results.append({"program": name, "concurrency": c, "calls": n, "sandbox": s_, "naive": b_,
                            "ratio": s_["calls_per_s"] / b_["calls_per_s"],
                            "cpu_ratio": b_["cpu_ms_per_call"] / s_["cpu_ms_per_call"]})  # fmt: skip
            rows.append([name, c, n, s_["calls_per_s"], b_["calls_per_s"], results[-1]["ratio"],
                         s_["p50_ms"], s_["p99_ms"], b_["p50_ms"], b_["p99_ms"], s_["cpu_ms_per_call"],
                         b_["cpu_ms_per_call"], results[-1]["cpu_ratio"], s_["failures"] + b_["failures"]])  # fmt: skip
        isolation_label = sb.isolation
    print_table(
        [
            "program",
            "conc",
            "calls",
            "sbx/s",
            "naive/s",
            "x",
            "sbx p50 ms",
            "sbx p99 ms",
            "naive p50 ms",
            "naive p99 ms",
            "sbx cpu ms",
            "naive cpu ms",
            "x cpu",
            "failed",
        ],  # fmt: skip
        rows,
        title=f"sandbox vs naive subprocess; isolation: {isolation_label}; workers: {args.workers}; "
        f"{time.perf_counter() - t_start:.0f} s",
    )
    trivial = [r for r in results if r["program"] == "trivial"]
    head = min(trivial, key=lambda r: r["ratio"])
    return emit(
        "sandbox",
        f"trivial_calls_per_s_c{head['concurrency']}",
        head["sandbox"]["calls_per_s"],
        "naive_subprocess_calls_per_s",
        head["naive"]["calls_per_s"],
        config={**vars(args), "cells": [list(c) for c in cells]},
        isolation=isolation_label,
        target_ratio=5.0,
        cells=results,
    )


if __name__ == "__main__":
    main()
