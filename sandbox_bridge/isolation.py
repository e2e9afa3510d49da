"""What the host lets a sandbox worker use, and the kernel calls that set it up.

Isolation comes in two layers (executor.py applies the per-job one):

* per worker, once at start-up (`setup_worker`): a cgroup of its own (memory, pids, one CPU: it
  bounds the whole job tree, and job processes set oom_score_adj 1000 so the OOM killer takes them
  first); no_new_privs and child-subreaper; a network namespace with only a down loopback; a mount
  namespace in which the whole tree is read-only and nosuid, `/tmp` is a private tmpfs (the jobs'
  working directories), `/run` is masked, and the Python installation stays reachable for the job
  uid even under a 0700 directory such as /root (`_expose`). One network and mount namespace per
  worker, not per job: a network namespace costs milliseconds to create, and one worker's jobs run
  one after another, so each inherits an empty one.
* per job: a PID namespace whose pid 1 is the job (when it ends, the kernel kills everything
  left, setsid daemons included), its own mount and IPC namespace with a fresh /proc and
  /dev/shm, hard rlimits, and an unprivileged uid unique to the worker (UID_BASE + worker pid).

Every step is tried and may fail (no root, no namespaces, cgroup v2 without delegation...); the
worker then runs with what worked, and the label names exactly that, e.g.
"pidns+netns+mntns-ro+ipcns+cgroup+setuid+rlimits", or "rlimits-only". `probe()` starts one
bare worker to read it; LocalSandbox logs it once per process.

Python 3.11 has no os.unshare/os.setns: libc is called through ctypes, a plain syscall rather than
a fork/exec of util-linux's `unshare` binary per job.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
_SYS_MOUNT_SETATTR, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID = 442, 0x8000, 0x1, 0x2
_AT_FDCWD = -100

# Job uids are UID_BASE + the worker's pid: unique among live workers on the machine, so
# RLIMIT_NPROC (counted per uid) covers exactly one job, and no real account is ever used.
UID_BASE = 1_970_000
CGROUP_PREFIX = "streamrl-sbx-"
LABEL_ORDER = ("pidns", "netns", "mntns-ro", "ipcns", "cgroup", "setuid", "rlimits")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _check(ret: int, what: str) -> int:
    if ret == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")


def prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), 0, 0, 0), "prctl")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]  # fmt: skip


def _remount_tree_readonly() -> None:
    """Whole mount tree read-only and nosuid: one mount_setattr (Linux >= 5.12), else mount by mount."""
    attr = _MountAttr(_MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID, 0, 0, 0)
    ret = _libc.syscall(
        ctypes.c_long(_SYS_MOUNT_SETATTR), ctypes.c_int(_AT_FDCWD), b"/",
        ctypes.c_uint(_AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)),
    )  # fmt: skip
    if ret == 0:
        return
    if ctypes.get_errno() != errno.ENOSYS:
        _check(ret, "mount_setattr /")
    keep = {"nodev": MS_NODEV, "noexec": MS_NOEXEC}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        parts = line.split()
        flags = sum(v for k, v in keep.items() if k in parts[5].split(","))
        mount(
            None, parts[4].replace("\\040", " "), None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | flags
        )


# ---------------------------------------------------------------- cgroups (v1 per controller, or v2)


def _cgroup_dirs(pid: int | str = "self") -> dict[str, Path]:
    """controller -> the cgroup directory `pid` lives in, for memory, pids and cpu where mounted."""
    mounts: dict[str, Path] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        fstype, _src, opts = (post.split() + ["", "", ""])[:3]
        if fstype == "cgroup":
            for c in opts.split(","):
                mounts.setdefault(c, Path(pre.split()[4]))
        elif fstype == "cgroup2":
            mounts.setdefault("", Path(pre.split()[4]))
    found: dict[str, Path] = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _hid, ctrls, rel = line.split(":", 2)
        for c in ctrls.split(",") if ctrls else [""]:
            if c in mounts:
                found[c] = mounts[c] / rel.lstrip("/")
    if "" in found:  # v2: one directory serves every controller it has enabled
        avail = (found[""] / "cgroup.controllers").read_text().split() if found[""].exists() else []
        for c in ("memory", "pids", "cpu"):
            if c in avail and c not in found:
                found[c] = found[""]
    return {c: found[c] for c in ("memory", "pids", "cpu") if c in found}


def worker_cgroup_paths(worker_pid: int, parent_pid: int | str = "self") -> list[Path]:
    """The cgroup directories a worker started by `parent_pid` creates for itself (for removal)."""
    return sorted({d / f"{CGROUP_PREFIX}{worker_pid}" for d in _cgroup_dirs(parent_pid).values()})


def remove_cgroups(paths: list[Path]) -> None:
    """rmdir each (fails harmlessly while a process is still inside)."""
    for p in paths:
        with contextlib.suppress(OSError):
            p.rmdir()


def kill_cgroup(paths: list[Path]) -> None:
    """SIGKILL every process still in these cgroups (what escaped a dead worker), until none is left."""
    for _ in range(100):
        pids: set[int] = set()
        for p in paths:
            with contextlib.suppress(OSError, ValueError):
                pids.update(int(x) for x in (p / "cgroup.procs").read_text().split())
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def sweep_stale_cgroups() -> None:
    """Remove cgroups left by workers of a sandbox process that died hard (their pid is gone)."""
    for base in set(_cgroup_dirs().values()):
        for p in base.glob(f"{CGROUP_PREFIX}*"):
            pid = p.name[len(CGROUP_PREFIX) :]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                remove_cgroups([p])


@dataclass
class WorkerIsolation:
    """What one worker achieved; `label` names the active features, `degraded` says why others are off."""

    features: set[str] = field(default_factory=set)
    degraded: dict[str, str] = field(default_factory=dict)
    memory_limit_file: int | None = None  # an fd kept open: the tree is read-only after set-up
    job_uid: int | None = None
    workroot: str = ""

    @property
    def label(self) -> str:
        on = [f for f in LABEL_ORDER if f in self.features]
        return "rlimits-only" if on == ["rlimits"] else "+".join(on)

    def set_memory_limit(self, limit_bytes: int) -> None:
        if self.memory_limit_file is not None:
            with contextlib.suppress(OSError):  # below current usage: keep the old limit, run the job
                os.pwrite(self.memory_limit_file, str(limit_bytes).encode(), 0)


def _join_cgroup(iso: WorkerIsolation, max_tasks: int) -> None:
    """Own cgroup: pids.max bounds the job tree, cpu quota one core, memory limit set after preload."""
    me = os.getpid()
    dirs = {c: base / f"{CGROUP_PREFIX}{me}" for c, base in _cgroup_dirs().items()}
    if "memory" not in dirs or "pids" not in dirs:
        raise OSError(errno.ENOENT, f"need memory and pids cgroup controllers, found {sorted(dirs)}")
    for d in dirs.values():
        d.mkdir(exist_ok=True)
        (d / "cgroup.procs").write_text(str(me))
    mem, pids, cpu = dirs["memory"], dirs["pids"], dirs.get("cpu")
    (pids / "pids.max").write_text(str(max_tasks))
    name = "memory.max" if (mem / "memory.max").exists() else "memory.limit_in_bytes"
    iso.memory_limit_file = os.open(mem / name, os.O_WRONLY | os.O_CLOEXEC)
    if cpu is not None and (cpu / "cpu.max").exists():  # one core per worker, v2 then v1
        (cpu / "cpu.max").write_text("100000 100000")
    elif cpu is not None and (cpu / "cpu.cfs_quota_us").exists():
        (cpu / "cpu.cfs_period_us").write_text("100000")
        (cpu / "cpu.cfs_quota_us").write_text("100000")


def kill_descendants(exclude: int) -> None:
    """SIGKILL and reap every descendant of this process but `exclude`, until none is left.

    For the fallback without PID namespaces: orphans that left the job's session re-parent to
    the worker (a child subreaper), so they are still found here.
    """
    for _ in range(200):
        kids = _descendants(os.getpid()) - {exclude}
        if not kids:
            return
        for k in kids:
            with contextlib.suppress(OSError):
                os.kill(k, signal.SIGKILL)
        for k in kids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(k, os.WNOHANG)
        time.sleep(0.001)


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found: set[int] = set()
    todo = [root]
    while todo:
        for k in children.get(todo.pop(), []):
            if k not in found:
                found.add(k)
                todo.append(k)
    return found


def memory_usage(iso: WorkerIsolation) -> int | None:
    """Bytes charged to the worker's memory cgroup (the baseline the job budget is added to)."""
    for ctrl, base in _cgroup_dirs().items():
        if ctrl == "memory":
            for name in ("memory.current", "memory.usage_in_bytes"):
                if (base / name).exists():
                    return int((base / name).read_text())
    return None


def setup_worker(max_tasks: int, tmpfs_mb: int, disable: tuple[str, ...] = ()) -> WorkerIsolation:
    """Apply the per-worker layer to the calling process (once, at start-up); never raises."""
    iso = WorkerIsolation(features={"rlimits"})

    def attempt(name: str, step: Callable[[], object]) -> None:
        if name in disable:
            iso.degraded[name] = "disabled"
            return
        try:
            step()
            iso.features.add(name)
        except OSError as e:
            iso.degraded[name] = str(e)

    with contextlib.suppress(OSError):  # orphans re-parent to the worker: the fallback sweep finds them
        prctl(PR_SET_CHILD_SUBREAPER, 1)
    with contextlib.suppress(OSError):  # inherited by every job: exec can never grant privileges
        prctl(PR_SET_NO_NEW_PRIVS, 1)
    attempt("setuid", _need_root)
    if "setuid" in iso.features:
        iso.job_uid = UID_BASE + os.getpid()
    attempt("cgroup", lambda: _join_cgroup(iso, max_tasks))
    attempt("netns", lambda: unshare(CLONE_NEWNET | CLONE_NEWUTS))
    attempt("mntns-ro", lambda: _mount_view(tmpfs_mb))
    if "setuid" in iso.features and "mntns-ro" not in iso.features:
        hidden = [p for p in _interpreter_paths() if _blocking_ancestor(p)]
        if hidden:
            iso.degraded["setuid"] = (
                f"{hidden[0]} is not reachable by the job uid: imports beyond preload fail"
            )
    iso.workroot = f"/tmp/{CGROUP_PREFIX}{os.getpid()}"
    os.makedirs(iso.workroot, mode=0o711, exist_ok=True)
    os.chmod(iso.workroot, 0o711)  # a job may enter its own directory but not list the root
    return iso


def _need_root() -> None:
    if os.geteuid() != 0:
        raise OSError(errno.EPERM, "not root: jobs run as the worker's uid, without RLIMIT_NPROC")


def _mount_view(tmpfs_mb: int) -> None:
    """Private mount namespace: everything read-only and nosuid but a private /tmp; /run masked."""
    unshare(CLONE_NEWNS)
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing propagates to or from the host
    paths = _interpreter_paths()
    # A venv or checkout under /tmp would vanish under the private tmpfs: hold each by an O_PATH
    # descriptor across the mount, then bind it back at its own place inside the tmpfs.
    under_tmp = [p for p in paths if p == "/tmp" or p.startswith("/tmp/")]
    held = [os.open(p, os.O_PATH | os.O_DIRECTORY) for p in under_tmp]
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmpfs_mb}m,mode=0755")
    for path, fd in zip(under_tmp, held, strict=True):
        os.makedirs(path, mode=0o755, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)
    _expose([p for p in paths if p not in under_tmp])
    if os.path.isdir("/run") and not os.path.islink("/run"):  # hide host unix sockets
        mount("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0755")
    _remount_tree_readonly()
    mount(None, "/tmp", None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV)  # the jobs' dirs: rw


def _interpreter_paths() -> list[str]:
    """What a job's interpreter reads: the Python installation, the venv, the import path."""
    import sys

    paths = {sys.base_prefix, sys.prefix, *(p for p in sys.path if os.path.isabs(p) and os.path.isdir(p))}
    return sorted(p for p in paths if not any(p.startswith(q + "/") for q in paths))


def _blocking_ancestor(path: str) -> str | None:
    """The top-most ancestor others may not traverse (e.g. /root, mode 0700, holding pyenv's Python)."""
    parts = Path(path).parts
    for i in range(2, len(parts)):
        d = os.path.join(*parts[:i])
        if not os.stat(d).st_mode & 0o001:
            return d
    return None


def _expose(paths: list[str]) -> None:
    """Make each path reachable by an unprivileged job without opening what is around it.

    The blocking ancestor is covered by an empty tmpfs (so the rest of, say, /root stays invisible),
    and the path itself is bind-mounted back at its own place inside it.
    """
    covered: set[str] = set()
    for n, path in enumerate(paths):
        top = _blocking_ancestor(path)
        if top is None:
            continue
        stage = f"/tmp/.expose{n}"
        os.mkdir(stage)
        mount(path, stage, None, MS_BIND | MS_REC)
        if top not in covered:
            mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
            covered.add(top)
        os.makedirs(path, mode=0o755, exist_ok=True)
        mount(stage, path, None, MS_BIND | MS_REC)
        _check(_libc.umount2(stage.encode(), ctypes.c_int(2)), "umount")  # MNT_DETACH
        os.rmdir(stage)


def job_env(workdir: str) -> dict[str, str]:
    """Everything a job sees of the environment: nothing is inherited."""
    path = f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin"
    return {"PATH": path, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir,
            "USER": "sandbox", "LOGNAME": "sandbox", "PYTHONIOENCODING": "utf-8",
            "PYTHONDONTWRITEBYTECODE": "1", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1"}  # fmt: skip


def keep_signals_terminating() -> None:
    """Handlers, inherited by every job, that exit with 128 + signal.

    A job is pid 1 of its PID namespace, and pid 1 ignores signals it has no handler for when
    they come from inside the namespace (its own kill(), alarm()): without these, they would no
    longer end it as they end any other program.
    """
    for sig in (signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM,
                signal.SIGTERM, signal.SIGVTALRM, signal.SIGPROF):  # fmt: skip
        signal.signal(sig, _terminate)


def _terminate(signum: int, _frame: object) -> None:
    os._exit(128 + signum)


def probe() -> str:
    """The isolation label a worker gets on this host (starts one bare worker: ~0.1 s)."""
    from sandbox_bridge.pool import Pool, WorkerConfig

    pool = Pool(1, WorkerConfig(preload=()))
    try:
        return pool.isolation
    finally:
        pool.close()


_logged: set[str] = set()


def log_once(label: str, degraded: dict[str, str]) -> None:
    """One structlog record per distinct label per process."""
    if label in _logged:
        return
    _logged.add(label)
    from streamrl.log import get_logger

    get_logger(__name__).info("sandbox_isolation", level=label, degraded=degraded or None)
