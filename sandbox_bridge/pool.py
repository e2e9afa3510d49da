"""Warm fork-server workers: each imports the common modules once and forks one isolated child per job.

Starting a fresh Python costs ~20 ms and `import sympy` ~0.5 s; a worker pays both once. A worker
is a separate `python -m sandbox_bridge.pool` started with a minimal environment, never a fork of
the caller, so nothing of the caller's memory or environment (tokens, REDIS_URI...) reaches it or
the jobs it forks. It sets up its isolation (isolation.setup_worker), preloads, prepares what all
jobs share (`_prepare`), picks the strongest job isolation that works by running a trial job
(`_trial`), freezes the GC (children then do not dirty the preloaded heap), says hello with its
isolation label, and serves jobs one at a time over a pipe: 4-byte length + msgpack frames.

Parent side: `Pool` hands out idle `WorkerHandle`s from a queue, so at most `size` jobs run at
once and any number of threads may call `execute` (extra callers wait for a worker; each job ahead
of them is bounded by its own timeout). A handle bounds every wait on its worker with a deadline
(job timeout + compile + grace). A worker that dies, hangs or breaks the protocol is killed
(with everything in its cgroup), its job returns `internal_error`, and a fresh worker is started
at once. That job is not retried: a job that took its worker down is the likeliest culprit, and
Code Judge does not retry executions either. A worker found dead before its job was sent (killed
while idle) is replaced and the job goes to the new one: it never ran.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import os
import queue
import select
import shutil
import struct
import subprocess
import sys
import threading
import time
import traceback

import msgspec

from sandbox_bridge import executor, isolation
from sandbox_bridge.types import SubmissionResult, internal_error

_STARTUP_S = 60.0  # a worker's import time (slow on a loaded 2-core machine) counts against this
_SLACK_S = 5.0  # on top of a job's own limits before the parent declares its worker hung
_HEADER = struct.Struct(">I")


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    limits: executor.Limits = executor.Limits()
    preload: tuple[str, ...] = ("math", "numpy", "sympy")
    disable: tuple[str, ...] = ()  # isolation features to leave off (tests of the fallbacks)


class Hello(msgspec.Struct):
    pid: int
    label: str
    degraded: dict[str, str]
    cpp: bool
    ok: bool  # a trial job ran


class Reply(msgspec.Struct):
    result: SubmissionResult
    detail: str | None = None


# ---------------------------------------------------------------- worker process


def _write_frame(fd: int, payload: bytes) -> None:
    view = memoryview(_HEADER.pack(len(payload)) + payload)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def worker_main(cfg: WorkerConfig, job_r: int, res_w: int) -> None:
    for fd in (job_r, res_w):  # inherited through pass_fds; no job may inherit them in turn
        os.set_inheritable(fd, False)
    # glibc reserves 64 MiB of address space per malloc arena, one per thread: under RLIMIT_AS a
    # job could start only a few threads. Two arenas are plenty for a job.
    isolation._libc.mallopt(-8, 2)  # M_ARENA_MAX
    lim = cfg.limits
    iso = isolation.setup_worker(lim.max_processes + 4, lim.memory_mb + lim.max_file_mb + 64, cfg.disable)
    for name in cfg.preload:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - a missing optional module is not fatal
            iso.degraded[f"preload {name}"] = repr(e)
    if "numpy" in sys.modules:  # its first seed() imports `secrets` (10 ms): pay it once, here
        sys.modules["numpy"].random.seed()
    ctx = executor.Context(iso, lim, gxx=shutil.which("g++"), watch_fd=job_r)
    _prepare(ctx)
    if iso.memory_limit_file is not None:
        ctx.memory_base = isolation.memory_usage(iso)
    broken = _trial(ctx, cfg.disable)
    for flag, name in ((ctx.pidns, "pidns"), (ctx.jobns, "ipcns")):
        if flag:
            iso.features.add(name)
        else:
            off = name in cfg.disable or "pidns" in cfg.disable
            iso.degraded[name] = (
                "disabled" if off else ("not root" if os.geteuid() else "refused by the kernel")
            )
    if broken:
        iso.degraded["run"] = broken
    gc.collect()
    gc.freeze()  # children never scan or dirty the preloaded objects' GC headers
    if iso.memory_limit_file is not None:
        ctx.memory_base = isolation.memory_usage(iso)
    hello = Hello(os.getpid(), iso.label, iso.degraded, ctx.gxx is not None, not broken)
    _write_frame(res_w, msgspec.msgpack.encode(hello))
    decoder = msgspec.msgpack.Decoder(executor.Job)
    try:
        while (header := _read_exact(job_r, _HEADER.size)) is not None:
            body = _read_exact(job_r, _HEADER.unpack(header)[0])
            if body is None:
                break
            job = decoder.decode(body)
            try:
                result, detail = executor.judge(job, ctx, iso.label)
            except executor.ParentGone:
                break
            except Exception:  # noqa: BLE001 - one bad job must not take the worker down
                result, detail = internal_error(job.sub_id, iso.label), traceback.format_exc(limit=-4)
            del job, body  # do not keep one job's code around while the next job runs
            _write_frame(res_w, msgspec.msgpack.encode(Reply(result, detail)))
    finally:
        shutil.rmtree(iso.workroot, ignore_errors=True)


def _prepare(ctx: executor.Context) -> None:
    """Once per worker, what every job shares: its environment becomes the jobs' environment."""
    ctx.pidns_fd = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    ctx.workdir = f"{ctx.iso.workroot}/job"
    os.environ.clear()  # the worker itself reads nothing from its environment after start-up
    os.environ.update(isolation.job_env(ctx.workdir))
    sys.stdin = sys.__stdin__ = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = sys.__stderr__ = open(  # noqa: SIM115 - line-buffered, as Python's own stderr
        2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False
    )
    sys.argv = [f"{ctx.workdir}/source.py"]
    atexit._clear()  # the worker's handlers are not the jobs'
    isolation.keep_signals_terminating()


def _trial(ctx: executor.Context, disable: tuple[str, ...]) -> str | None:
    """Pick the strongest job isolation that runs a job here (PID+mount+IPC ns, PID ns, none).

    Returns None, or why even the weakest failed. Tried with a real job, so the label never
    promises what does not work.
    """
    why = None
    modes = [(True, True), (True, False), (False, False)] if os.geteuid() == 0 else [(False, False)]
    modes = [(p, j) for p, j in modes if not (p and "pidns" in disable or j and "ipcns" in disable)]
    for ctx.pidns, ctx.jobns in modes:
        result, detail = executor.judge(
            executor.Job(type="python", solution="print(6 * 7)", sub_id="trial"), ctx, ""
        )
        if result.stdout == "42\n":
            return None
        why = detail or f"{result.stderr!r}"
    return why


# ---------------------------------------------------------------- parent side


class WorkerLost(Exception):
    pass


def _ready(fd: int, events: int, deadline: float) -> bool:
    """poll, not select: a big caller (a trainer) may hold file descriptors beyond select's 1024."""
    p = select.poll()
    p.register(fd, events)
    return bool(p.poll(max(0.0, deadline - time.monotonic()) * 1000))


def _worker_env() -> dict[str, str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONPATH": root,
            "PYTHONDONTWRITEBYTECODE": "1", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1"}  # fmt: skip


class WorkerHandle:
    """One worker process seen from the sandbox; used by one thread at a time (the pool's queue)."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.proc: subprocess.Popen[bytes] | None = None
        self.hello: Hello | None = None
        self.label = ""  # the last hello's, kept across restarts for internal_error results
        self.closed = False
        self.busy = False
        self._lock = threading.Lock()  # start/stop may race with close() from another thread
        self._job_w = self._res_r = -1
        self.spawned: list[int] = []  # every worker pid this handle started (leftover checks)

    def start(self) -> None:
        with self._lock:
            if self.closed or self.proc is not None:
                return
            job_r, self._job_w = os.pipe()
            self._res_r, res_w = os.pipe()
            cmd = [sys.executable, "-s", "-B", "-m", "sandbox_bridge.pool",
                   msgspec.json.encode(self.cfg).decode(), str(job_r), str(res_w)]  # fmt: skip
            try:
                self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                             env=_worker_env(), pass_fds=(job_r, res_w),
                                             start_new_session=True)  # fmt: skip
            finally:
                os.close(job_r)
                os.close(res_w)
            os.set_blocking(self._job_w, False)
            self.spawned.append(self.proc.pid)
            self.hello = None

    def _read(self, n: int, deadline: float) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            if not _ready(self._res_r, select.POLLIN, deadline):
                raise TimeoutError("no reply from worker before the deadline")
            chunk = os.read(self._res_r, n - len(buf))
            if not chunk:
                raise WorkerLost("worker exited")
            buf += chunk
        return bytes(buf)

    def _frame(self, deadline: float) -> bytes:
        return self._read(_HEADER.unpack(self._read(_HEADER.size, deadline))[0], deadline)

    def ready(self, deadline: float) -> Hello:
        if self.proc is None:
            self.start()
        if self.hello is None:
            if self.proc is None:
                raise WorkerLost("sandbox closed")
            self.hello = msgspec.msgpack.decode(self._frame(deadline), type=Hello)
            self.label = self.hello.label
        return self.hello

    def execute(self, job: executor.Job) -> Reply:
        with self._lock:
            if self.closed:
                return Reply(internal_error(job.sub_id, self.label), "sandbox closed")
            self.busy = True
        try:
            return self._execute(job)
        finally:
            with self._lock:
                self.busy, closed = False, self.closed
            if closed:  # close() only killed the worker; clean up here, where nothing else reads it
                self.stop()

    def _execute(self, job: executor.Job) -> Reply:
        lim = self.cfg.limits
        budget = lim.timeout_s + (lim.compile_timeout_s if job.type == "cpp" else 0.0)
        payload = msgspec.msgpack.encode(job)
        pid = None
        try:
            if self.proc is not None and self.proc.poll() is not None:
                self.stop(kill=True)  # died while idle (OOM killer, an operator): the job is not lost
            for attempt in (0, 1):
                pid = self.ready(time.monotonic() + _STARTUP_S).pid
                deadline = time.monotonic() + budget + 2 * executor._GRACE_S + _SLACK_S
                try:
                    self._send(payload, deadline)
                    break
                except BrokenPipeError:  # it died before reading the job: one fresh worker, once
                    if attempt:
                        raise
                    self.stop(kill=True)
            return msgspec.msgpack.decode(self._frame(deadline), type=Reply)
        except (WorkerLost, TimeoutError, OSError, msgspec.DecodeError) as e:
            self.stop(kill=True)
            self.start()  # replace it now: it warms up while the caller handles this result
            return Reply(internal_error(job.sub_id, self.label), f"worker {pid}: {type(e).__name__}: {e}")

    def _send(self, payload: bytes, deadline: float) -> None:
        view = memoryview(_HEADER.pack(len(payload)) + payload)
        while view:  # non-blocking: a stuck worker must not block us on a full pipe
            if not _ready(self._job_w, select.POLLOUT, deadline):
                raise TimeoutError("worker does not read its job")
            view = view[os.write(self._job_w, view) :]

    def stop(self, kill: bool = False) -> None:
        """End the worker (EOF on its job pipe, then SIGKILL) and everything left in its cgroup."""
        with self._lock:
            proc, self.proc = self.proc, None
            if proc is None:
                return
            for fd in (self._job_w, self._res_r):
                os.close(fd)
            if kill:
                proc.kill()
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            cgroups = isolation.worker_cgroup_paths(proc.pid)
            isolation.kill_cgroup(cgroups)
            isolation.remove_cgroups(cgroups)
            shutil.rmtree(f"/tmp/{isolation.CGROUP_PREFIX}{proc.pid}", ignore_errors=True)

    def close(self) -> None:
        with self._lock:
            self.closed, busy, proc = True, self.busy, self.proc
        if not busy:
            self.stop()
        elif proc is not None:
            proc.kill()  # the thread running a job on it sees EOF and cleans up (execute's finally)


class Pool:
    """`size` warm workers; `execute` is blocking and thread-safe."""

    def __init__(self, size: int, cfg: WorkerConfig) -> None:
        isolation.sweep_stale_cgroups()
        self.cfg = cfg
        self._handles = [WorkerHandle(cfg) for _ in range(size)]
        self._idle: queue.LifoQueue[WorkerHandle] = queue.LifoQueue()  # LIFO: reuse the warmest
        self._closed = False
        for h in self._handles:
            h.start()
        deadline = time.monotonic() + _STARTUP_S
        hellos = []
        for h in self._handles:
            try:
                hellos.append(h.ready(deadline))
            except (WorkerLost, TimeoutError, OSError, msgspec.DecodeError):
                h.stop(kill=True)
            self._idle.put(h)
        if not hellos or not hellos[0].ok:
            self.close()
            why = hellos[0].degraded if hellos else "run `python -m sandbox_bridge.pool` to see why"
            raise RuntimeError(f"sandbox workers cannot run code: {why}")
        self.hello = hellos[0]
        self.isolation = hellos[0].label

    def execute(self, job: executor.Job) -> Reply:
        h = self._idle.get()
        try:
            if self._closed:
                return Reply(internal_error(job.sub_id, self.isolation), "sandbox closed")
            return h.execute(job)
        finally:
            self._idle.put(h)

    def worker_pids(self) -> list[int]:
        return [h.proc.pid for h in self._handles if h.proc is not None]

    def spawned_pids(self) -> list[int]:
        return [pid for h in self._handles for pid in h.spawned]

    def close(self) -> None:
        """Kill every worker and its jobs; returns once in-flight calls have cleaned up (bounded)."""
        self._closed = True
        for h in self._handles:
            h.close()
        deadline = time.monotonic() + 10.0
        while any(h.busy or h.proc is not None for h in self._handles) and time.monotonic() < deadline:
            time.sleep(0.01)


def _main() -> None:
    if len(sys.argv) != 4:  # run by hand: start one worker and print its hello
        pool = Pool(1, WorkerConfig())
        print(msgspec.json.encode(pool.hello).decode())
        pool.close()
        return
    worker_main(msgspec.json.decode(sys.argv[1], type=WorkerConfig), int(sys.argv[2]), int(sys.argv[3]))


if __name__ == "__main__":
    _main()
