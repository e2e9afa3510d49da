"""LocalSandbox: the in-process, Code Judge-compatible sandbox API over a pool of warm workers.

    with LocalSandbox(max_workers=4, timeout_s=4.0, memory_mb=256) as sb:
        r = sb.run_sync("print(input())", stdin="hi")      # or: await sb.run(...)
        r.success, r.run_success, r.cost, r.stdout, r.stderr, r.reason, r.isolation

Every call returns a `SubmissionResult` (types.py) and never raises for anything the code does:
failures of the code are results, failures of the sandbox are `internal_error` results (logged
with their cause). `run`/`submit` may be called from many asyncio tasks and threads at once; at
most `max_workers` jobs run, the rest wait their turn. A call is bounded by its own wall timeout
(plus compile time for C++) once it has a worker; waiting for a worker is bounded by the jobs
ahead of it. A worker that dies mid-job gives that job `internal_error` (no retry, see pool.py) and
is replaced. Construction starts the workers and waits for them to be warm (~1 s on 2 cores);
`isolation` is the label of what they could enable on this host (logged once per process).
"""

from __future__ import annotations

import asyncio
import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandbox_bridge import isolation as iso_mod
from sandbox_bridge.executor import Job, Limits
from sandbox_bridge.pool import Pool, WorkerConfig
from sandbox_bridge.types import Submission, SubmissionResult, internal_error, new_id

if TYPE_CHECKING:
    from streamrl.config import EmbeddedSandbox


class LocalSandbox:
    def __init__(
        self,
        max_workers: int = 4,
        timeout_s: float = 4.0,
        memory_mb: int = 256,
        max_output_chars: int = 1000,
        preload: tuple[str, ...] = ("math", "numpy", "sympy"),
        *,
        max_processes: int = 32,
        max_file_mb: int = 64,
        disable: tuple[str, ...] = (),
    ) -> None:
        if max_workers < 1 or timeout_s <= 0 or memory_mb < 1 or max_output_chars < 0:
            raise ValueError(
                f"LocalSandbox: need max_workers >= 1, timeout_s > 0, memory_mb >= 1, max_output_chars >= 0; "
                f"got {max_workers=}, {timeout_s=}, {memory_mb=}, {max_output_chars=}"
            )
        self.limits = Limits(timeout_s=timeout_s, memory_mb=memory_mb, max_output_chars=max_output_chars,
                             max_processes=max_processes, max_file_mb=max_file_mb)  # fmt: skip
        cfg = WorkerConfig(limits=self.limits, preload=tuple(preload), disable=tuple(disable))
        self._pool = Pool(max_workers, cfg)
        self.isolation: str = self._pool.isolation
        self.cpp_available: bool = self._pool.hello.cpp
        self._threads = ThreadPoolExecutor(max_workers, thread_name_prefix="sandbox")
        self._closed = False
        # Also on garbage collection and at interpreter exit: no worker or cgroup outlives us.
        self._finalizer = weakref.finalize(self, _shutdown, self._pool, self._threads)
        iso_mod.log_once(self.isolation, self._pool.hello.degraded)

    @classmethod
    def from_config(cls, cfg: EmbeddedSandbox) -> LocalSandbox:
        return cls(max_workers=cfg.max_workers, timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb,
                   max_output_chars=cfg.max_output_chars)  # fmt: skip

    # ------------------------------------------------------------ blocking API

    def submit_sync(self, sub: Submission) -> SubmissionResult:
        """Code Judge's /run for one submission: python | cpp; math -> internal_error, as in Code Judge."""
        self._check_open()
        return self._execute(sub)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("LocalSandbox is closed")

    def _execute(self, sub: Submission) -> SubmissionResult:
        sub_id = sub.sub_id or new_id()
        if sub.type not in ("python", "cpp"):
            return internal_error(sub_id, self.isolation)
        job = Job(type=sub.type, solution=sub.solution, sub_id=sub_id, input=sub.input,
                  expected_output=sub.expected_output)  # fmt: skip
        reply = self._pool.execute(job)
        if reply.detail:
            from streamrl.log import get_logger

            get_logger(__name__).warning("sandbox_internal_error", sub_id=sub_id, detail=reply.detail)
        return reply.result

    def run_sync(self, code: str, stdin: str | None = None) -> SubmissionResult:
        return self.submit_sync(Submission(type="python", solution=code, input=stdin))

    # ------------------------------------------------------------ asyncio API

    async def submit(self, sub: Submission) -> SubmissionResult:
        # One thread per running job, blocked on its worker's pipe; queued calls wait in the executor
        # (a call still queued when the sandbox closes gets internal_error, not an exception).
        self._check_open()
        return await asyncio.get_running_loop().run_in_executor(self._threads, self._execute, sub)

    async def run(self, code: str, stdin: str | None = None) -> SubmissionResult:
        return await self.submit(Submission(type="python", solution=code, input=stdin))

    # ------------------------------------------------------------ lifecycle

    def worker_pids(self) -> list[int]:
        """The live workers' pids."""
        return self._pool.worker_pids()

    def spawned_pids(self) -> list[int]:
        """Every worker pid this sandbox started, replacements included (for leftover checks)."""
        return self._pool.spawned_pids()

    def close(self) -> None:
        """Kill all workers and jobs (in-flight calls get internal_error); idempotent."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> LocalSandbox:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> LocalSandbox:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.to_thread(self.close)


def _shutdown(pool: Pool, threads: ThreadPoolExecutor) -> None:
    pool.close()
    threads.shutdown(wait=True)  # queued calls run now and return internal_error at once


def leftovers(worker_pids: list[int]) -> list[str]:
    """What is still around of these (ended) workers: processes, job processes, cgroups, temp dirs."""
    found = []
    uids = {str(iso_mod.UID_BASE + p) for p in worker_pids}
    for entry in os.listdir("/proc"):
        try:
            status = Path(f"/proc/{entry}/status").read_text() if entry.isdigit() else ""
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        alive = "Uid" in fields and "State" in fields and not fields["State"].strip().startswith("Z")
        if alive and (int(entry) in worker_pids or fields["Uid"].split()[0] in uids):
            found.append(f"process {entry} ({fields['Name'].strip()}, uid {fields['Uid'].split()[0]})")
    for p in worker_pids:
        found += [f"cgroup {d}" for d in iso_mod.worker_cgroup_paths(p) if d.exists()]
        if os.path.exists(f"/tmp/{iso_mod.CGROUP_PREFIX}{p}"):
            found.append(f"directory /tmp/{iso_mod.CGROUP_PREFIX}{p}")
    return found
