"""One isolated run of model-written code, with Code Judge's result semantics (code_judge.md 7.2).

Runs in a warm worker (pool.py): root, already in its own cgroup, network namespace and read-only
mount namespace (isolation.py). Per run the worker does unshare(CLONE_NEWPID) and forks: the job is
pid 1 of a fresh PID namespace; it takes its own mount and IPC namespace (a /proc of its PID
namespace, its own /dev/shm), hard rlimits (hard = soft), an unprivileged uid and fds 0/1/2 only,
then runs the code with exec() in the preloaded interpreter or execve()s a binary (g++, a compiled
C++ program). When the job's first process ends or is killed, the kernel kills everything left in
its namespace, setsid daemons included. Without PID namespaces the job gets its own session, and the
worker (a child subreaper, so orphans re-parent to it) kills the session and then every descendant.
The worker enforces the wall timeout itself and drains stdout and stderr meanwhile, keeping at most
`capture_bytes` of each, so a 50 MB writer neither blocks nor fills memory.

Speed: the fork of the big preloaded worker dominates, so all that can is prepared once per worker
(`pool._prepare`) or before the fork, and the fork is libc's without CPython's at-fork hooks (the
worker is single-threaded; random and numpy are reseeded before each fork instead).

Differences from Code Judge: tracebacks show `<workdir>/source.py` with the user's own line numbers
(Code Judge's prelude shifts them by +48); `cost` is the run's wall time measured by the worker;
output is decoded with errors="replace" (Code Judge: internal_error). As pid 1 of its namespace the
job's main process cannot be SIGKILLed from inside it, and other signals with default action
terminate it through a handler (pool._prepare) that exits with 128 + signal, between bytecodes.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import math
import os
import random
import resource
import select
import shutil
import signal
import sys
import threading
import time
import traceback
import types
from dataclasses import dataclass, field
from typing import NoReturn

import msgspec

from sandbox_bridge import isolation as iso_mod
from sandbox_bridge.types import SubmissionResult, internal_error

TIMEOUT_STDOUT = "Suicide from timeout.\n"  # what Code Judge's alarm handler prints; its tests check it
_GRACE_S = 2.0  # after a kill or the job's exit: how long pipes may take to reach EOF
_SETUP_FAILED = 121
_fork = ctypes.PyDLL(None, use_errno=True).fork  # PyDLL: holds the GIL across the call, as os.fork
_fork.restype, _fork.argtypes = ctypes.c_int, []


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    timeout_s: float = 4.0
    memory_mb: int = 256
    max_output_chars: int = 1000
    max_processes: int = 32  # tasks (threads count) per job, via RLIMIT_NPROC on the job's own uid
    max_file_mb: int = 64
    max_open_files: int = 256
    capture_bytes: int = 1 << 20  # kept per stream; the rest is read and dropped
    compile_timeout_s: float = 10.0
    compile_memory_mb: int = 1024


class Job(msgspec.Struct, kw_only=True):
    type: str
    solution: str
    sub_id: str
    input: str | None = None
    expected_output: str | None = None


@dataclass
class RawRun:
    exit_code: int | None  # None: killed by a signal, or set-up failed
    timed_out: bool
    cost: float
    stdout: bytes
    stderr: bytes
    stdout_overflow: bool = False
    error: str | None = None  # the sandbox itself failed (internal_error)


class ParentGone(Exception):
    """The sandbox process closed the job pipe: the worker must kill its job and exit."""


@dataclass
class Context:
    """A worker's state for running jobs; `pidns` and `jobns` are chosen at start-up (pool._trial)."""

    iso: iso_mod.WorkerIsolation
    limits: Limits
    gxx: str | None = None
    pidns: bool = False  # a PID namespace per job
    jobns: bool = False  # and a mount + IPC namespace per job, with its own /proc and /dev/shm
    watch_fd: int | None = None  # the worker's job pipe; a hang-up means the sandbox is gone
    memory_base: int | None = None  # bytes in the worker's memory cgroup after preload
    memory_limit: int = 0
    dying: list[int] = field(default_factory=list)  # killed, not yet gone: reaped before the next job
    workdir: str = ""  # the same path for every job, created before and removed after each one
    pidns_fd: int = -1


# ---------------------------------------------------------------- job side (never returns)


@dataclass
class _Spec:
    """One run, computed by the worker before the fork."""

    fds: tuple[int, int, int, int]  # stdin, stdout, stderr, status (set-up errors)
    rlimits: list[tuple[int, int]]
    code: str | None
    argv: list[str] | None
    main: types.ModuleType | None


def _job_main(ctx: Context, spec: _Spec) -> NoReturn:
    stdin_fd, out_w, err_w, status_w = spec.fds
    try:
        os.setsid()  # own session: a kill(0, ...) from the job stays in the job
        iso_mod.prctl(iso_mod.PR_SET_PDEATHSIG, signal.SIGKILL)  # the worker is single-threaded
        if ctx.jobns:  # its own mount and IPC namespace: a /proc of its PID namespace, its own /dev/shm
            iso_mod.unshare(iso_mod.CLONE_NEWNS | iso_mod.CLONE_NEWIPC)
            flags = iso_mod.MS_NOSUID | iso_mod.MS_NODEV | iso_mod.MS_NOEXEC
            iso_mod.mount("proc", "/proc", "proc", flags)
            iso_mod.mount("tmpfs", "/dev/shm", "tmpfs", flags, "size=64m,mode=1777")
        with contextlib.suppress(OSError):  # the OOM killer picks job processes first
            fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
            os.write(fd, b"1000")
            os.close(fd)
        for src, dst in ((stdin_fd, 0), (out_w, 1), (err_w, 2)):
            os.dup2(src, dst)
        os.closerange(3, status_w)
        os.closerange(status_w + 1, 1 << 16)
        os.chdir(ctx.workdir)
        for res, val in spec.rlimits:  # hard = soft: the job cannot raise them back
            resource.setrlimit(res, (val, val))
        uid = ctx.iso.job_uid
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)  # drops every capability
            iso_mod.prctl(iso_mod.PR_SET_DUMPABLE, 1)  # the uid change cleared it: /proc/self unreadable
    except BaseException as e:  # noqa: BLE001 - report any set-up failure, never run the code
        os.write(status_w, f"{type(e).__name__}: {e}".encode())
        os._exit(_SETUP_FAILED)
    os.close(status_w)
    if spec.argv is not None:
        try:
            os.execv(spec.argv[0], spec.argv)
        except OSError as e:
            os.write(2, f"exec {spec.argv[0]}: {e}\n".encode())
            os._exit(127)
    assert spec.code is not None and spec.main is not None
    os._exit(_run_python(spec.code, spec.main, ctx.workdir))


def _run_python(code: str, main: types.ModuleType, workdir: str) -> int:
    """Run `code` as `python source.py` would, in this (forked, preloaded) interpreter."""
    sys.modules["__main__"] = main  # so multiprocessing and pickle find the job's functions
    sys.path[0] = workdir
    status = 0
    try:
        exec(compile(code, main.__file__ or "", "exec"), main.__dict__)
    except SystemExit as e:
        status = _exit_status(e)
    except BaseException as e:  # noqa: BLE001 - the interpreter's own top level
        # Show the traceback from the job's first frame on, as `python source.py` would.
        e.__traceback__ = (
            None if isinstance(e, SyntaxError) or not e.__traceback__ else e.__traceback__.tb_next
        )
        sys.excepthook(type(e), e, e.__traceback__)
        status = 1
    try:
        if threading.active_count() > 1:  # join non-daemon threads, as at exit (skipped: 50 us)
            threading._shutdown()  # type: ignore[attr-defined]
        if atexit._ncallbacks():
            atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except SystemExit as e:
        status = _exit_status(e)
    except BaseException:  # noqa: BLE001
        status = status or 1
    return status & 0xFF


def _exit_status(e: SystemExit) -> int:
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


# ---------------------------------------------------------------- worker side


def run_once(ctx: Context, *, code: str | None = None, argv: list[str] | None = None,
             stdin: str | None = None, timeout_s: float, memory_mb: int) -> RawRun:  # fmt: skip
    """Fork one isolated run, enforce its wall timeout, drain its output, kill what is left."""
    ctx.dying = [p for p in ctx.dying if not _reap(p, _GRACE_S)]  # slow to die after SIGKILL
    limit = ctx.memory_base and ctx.memory_base + ((memory_mb + 128) << 20)
    if limit and limit != ctx.memory_limit:  # the cgroup bounds the job tree: budget + runtime, tmpfs
        ctx.iso.set_memory_limit(limit)
        ctx.memory_limit = limit
    lim = ctx.limits
    # Address space: a binary starts afresh at execve and gets the budget; Python code runs in
    # this interpreter and gets what it already maps (~180 MB with numpy and sympy) on top.
    with open("/proc/self/statm", "rb") as f:
        mapped = 0 if argv else int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    rlimits = [(resource.RLIMIT_CPU, math.ceil(timeout_s) + 1), (resource.RLIMIT_FSIZE, lim.max_file_mb << 20),
               (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, lim.max_open_files),
               (resource.RLIMIT_MEMLOCK, 0), (resource.RLIMIT_AS, mapped + ((memory_mb + 64) << 20))]  # fmt: skip
    if ctx.iso.job_uid is not None:  # NPROC counts per uid and root is exempt: only a uid of its own works
        rlimits.append((resource.RLIMIT_NPROC, lim.max_processes))
    main = None
    if code is not None:
        main = types.ModuleType("__main__")
        main.__file__ = f"{ctx.workdir}/source.py"
        main.__builtins__ = __builtins__  # type: ignore[attr-defined]
    random.seed()  # forked without CPython's at-fork hooks: reseed here, where it is cheap
    np = sys.modules.get("numpy")
    if np is not None:  # (seeding numpy from the OS costs 90 us, from `random` 2 us)
        np.random.seed(random.getrandbits(32))
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    st_r, st_w = os.pipe()
    spec = _Spec((_stdin_fd(ctx.workdir, stdin), out_w, err_w, st_w), rlimits, code, argv, main)
    sys.stderr.flush()  # nothing of ours may reach the job's stderr
    start = time.monotonic()
    try:
        if ctx.pidns:  # the next child is pid 1 of a new PID namespace
            iso_mod.unshare(iso_mod.CLONE_NEWPID)
        pid = _fork()
        if pid == 0:
            try:
                _job_main(ctx, spec)
            except BaseException:  # noqa: BLE001 - a bug of ours: show it in the job's stderr
                traceback.print_exc()
            finally:  # never let a child fall back into the worker's loop
                os._exit(_SETUP_FAILED)
        if ctx.pidns:  # back to our own namespace for later forks
            iso_mod.setns(ctx.pidns_fd, iso_mod.CLONE_NEWPID)
        if pid < 0:
            raise OSError(ctypes.get_errno(), "fork failed")
    except OSError as e:
        for fd in (out_r, err_r, st_r):
            os.close(fd)
        return RawRun(None, False, 0.0, b"", b"", error=f"spawn: {e}")
    finally:
        for fd in spec.fds:
            os.close(fd)
    return _collect(ctx, pid, out_r, err_r, st_r, start, timeout_s)


def _kill_job(ctx: Context, pid: int) -> None:
    """SIGKILL everything the job started: with a PID namespace, its init (the job) is enough."""
    if ctx.pidns:
        with contextlib.suppress(OSError):  # the kernel then kills every process in the namespace
            os.kill(pid, signal.SIGKILL)
        return
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)
    iso_mod.kill_descendants(exclude=pid)


def _reap(pid: int, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for our child `pid` to exit, and reap it."""
    fd, poller = os.pidfd_open(pid), select.poll()
    try:
        poller.register(fd, select.POLLIN)
        poller.poll(timeout_s * 1000)
    finally:
        os.close(fd)
    return os.waitpid(pid, os.WNOHANG)[0] == pid


def _collect(ctx: Context, pid: int, out_r: int, err_r: int, st_r: int,
             start: float, timeout_s: float) -> RawRun:  # fmt: skip
    cap, pidfd, poller = ctx.limits.capture_bytes, os.pidfd_open(pid), select.poll()
    bufs = {out_r: bytearray(), err_r: bytearray(), st_r: bytearray()}
    overflow = {out_r: False, err_r: False, st_r: False}
    for fd in bufs:
        poller.register(fd, select.POLLIN)
    poller.register(pidfd, select.POLLIN)
    if ctx.watch_fd is not None:
        poller.register(ctx.watch_fd, 0)  # hang-up only
    open_fds, deadline = set(bufs), start + timeout_s
    timed_out = exited = killed = False
    end: float | None = None
    wait_status, cpu = None, 0.0
    try:
        while open_fds or not exited:
            now = time.monotonic()
            if now >= deadline:
                if killed:
                    break  # a process that does not die within the grace period: give up on it
                timed_out, end = True, now
                _kill_job(ctx, pid)
                killed, deadline = True, now + _GRACE_S
                continue
            for fd, _ev in poller.poll(max(1, int((deadline - now) * 1000))):
                if fd == pidfd:
                    exited, end = True, end or time.monotonic()
                    poller.unregister(pidfd)
                    _, wait_status, ru = os.wait4(pid, 0)
                    cpu = ru.ru_utime + ru.ru_stime
                    if not killed and not ctx.pidns:  # (a PID namespace died with its init)
                        _kill_job(ctx, pid)  # something may outlive the job: kill it, then drain
                        killed, deadline = True, time.monotonic() + _GRACE_S
                elif fd == ctx.watch_fd:
                    _kill_job(ctx, pid)
                    raise ParentGone
                else:
                    data = os.read(fd, 1 << 16)
                    if not data:
                        poller.unregister(fd)
                        open_fds.discard(fd)
                        continue
                    room = cap - len(bufs[fd])
                    bufs[fd] += data[: max(room, 0)]
                    overflow[fd] |= len(data) > room
    finally:
        for fd in (out_r, err_r, st_r, pidfd):
            os.close(fd)
        if not exited:
            ctx.dying.append(pid)  # SIGKILLed but not gone within the grace period (stuck in the kernel)
    exit_code = None if wait_status is None else os.waitstatus_to_exitcode(wait_status)
    error = bufs[st_r].decode(errors="replace") if exit_code == _SETUP_FAILED and bufs[st_r] else None
    if exit_code in (-signal.SIGKILL, -signal.SIGXCPU) and cpu >= math.ceil(timeout_s) + 0.9:
        timed_out = True  # RLIMIT_CPU fired first (threads can burn CPU faster than wall time)
    cost = (end or time.monotonic()) - start
    return RawRun(exit_code, timed_out, cost, bytes(bufs[out_r]), bytes(bufs[err_r]), overflow[out_r], error)


def _stdin_fd(workdir: str, stdin: str | None) -> int:
    """A falsy input is EOF (Code Judge); else an unlinked file, so a large input never blocks us."""
    if not stdin:
        return os.open(os.devnull, os.O_RDONLY)
    path = os.path.join(workdir, ".stdin")  # (O_EXCL|O_NOFOLLOW: never through a job's symlink)
    with open(
        os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "w", encoding="utf-8"
    ) as f:
        f.write(stdin)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    os.unlink(path)
    return fd


def judge(job: Job, ctx: Context, label: str) -> tuple[SubmissionResult, str | None]:
    """Code Judge's judge(): one submission -> its result, plus a detail for internal errors."""
    lim, workdir = ctx.limits, ctx.workdir
    if job.type not in ("python", "cpp") or (job.type == "cpp" and ctx.gxx is None):
        return internal_error(job.sub_id, label), f"cannot run {job.type!r} here (g++: {ctx.gxx})"
    if os.path.lexists(workdir):  # a removal that failed after the last job
        shutil.rmtree(workdir, ignore_errors=True)
    os.mkdir(workdir, 0o700)
    try:
        if ctx.iso.job_uid is not None:
            os.chown(workdir, ctx.iso.job_uid, ctx.iso.job_uid)
        with open(f"{workdir}/source.{'py' if job.type == 'python' else 'cpp'}", "w", encoding="utf-8") as f:
            f.write(job.solution)  # (Python runs via exec(); the file serves tracebacks)
        if job.type == "python":
            raw = run_once(
                ctx, code=job.solution, stdin=job.input, timeout_s=lim.timeout_s, memory_mb=lim.memory_mb
            )
        else:
            comp = run_once(ctx, argv=[ctx.gxx or "g++", "-O2", "-o", "program", "source.cpp"],
                            timeout_s=lim.compile_timeout_s, memory_mb=lim.compile_memory_mb)  # fmt: skip
            if comp.error:
                return internal_error(job.sub_id, label), comp.error
            if comp.exit_code != 0 or comp.timed_out:  # Code Judge: compile error -> cost 0, reason ""
                err = comp.stderr.decode(errors="replace") or f"compile timeout ({lim.compile_timeout_s:g} s)"
                result = SubmissionResult(sub_id=job.sub_id, success=False, run_success=False, cost=0.0,
                                          stdout="", stderr=err[: lim.max_output_chars], isolation=label)  # fmt: skip
                return result, None
            raw = run_once(ctx, argv=[f"{workdir}/program"], stdin=job.input, timeout_s=lim.timeout_s,
                           memory_mb=lim.memory_mb)  # fmt: skip
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if raw.error:
        return internal_error(job.sub_id, label), raw.error
    out = raw.stdout.decode("utf-8", errors="replace") + (TIMEOUT_STDOUT if raw.timed_out else "")
    err = raw.stderr.decode("utf-8", errors="replace")
    ok = raw.exit_code == 0 and not raw.timed_out
    # Code Judge compares the untruncated stdout; ours is the first capture_bytes: beyond that, no match.
    same = job.expected_output is None or (
        not raw.stdout_overflow and out.strip() == job.expected_output.strip()
    )
    reason = "worker_timeout" if raw.timed_out or (not ok and raw.cost >= lim.timeout_s) else ""
    return SubmissionResult(sub_id=job.sub_id, success=ok and same, run_success=ok, cost=round(raw.cost, 6),
                            stdout=out[: lim.max_output_chars], stderr=err[: lim.max_output_chars],
                            reason=reason, isolation=label), None  # fmt: skip
