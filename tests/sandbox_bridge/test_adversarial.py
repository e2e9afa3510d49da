"""Hostile code, one property per test: whatever the job does, it is contained and the caller never hangs.

Each test runs a real attack in a real worker and then checks the host side: wall time, processes,
files, the listener, the next call. At the end of the module, nothing any worker started may be
left: no worker, no job process (they run as uids of their own), no cgroup, no temp directory.
Limits are small (1 s, 128 MB) so the bombs stay cheap for the 2-core machine they run on.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from sandbox_bridge import LocalSandbox
from sandbox_bridge.local import leftovers

TIMEOUT_S = 1.0
SLACK_S = 4.0  # wall-time bounds must hold on a 2-core machine that other jobs load heavily
SECRET = f"streamrl-secret-{uuid.uuid4().hex}"
_spawned: list[int] = []


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """At the end of the session: no worker of this suite, no job process, cgroup or temp dir."""
    yield
    deadline = time.monotonic() + 5.0  # kills are synchronous; this only absorbs a busy machine
    while (left := leftovers(_spawned)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == []


@pytest.fixture(scope="module")
def sb() -> Iterator[LocalSandbox]:
    os.environ["STREAMRL_TEST_SECRET"] = SECRET  # what a careless sandbox would hand down
    try:
        with LocalSandbox(max_workers=2, timeout_s=TIMEOUT_S, memory_mb=128) as box:
            yield box
        _spawned.extend(box.spawned_pids())
        assert leftovers(box.spawned_pids()) == []
    finally:
        del os.environ["STREAMRL_TEST_SECRET"]


def need(sb: LocalSandbox, *any_of: str) -> None:
    """Skip, saying why, when none of these isolation features is active on this host."""
    if not any(f in sb.isolation.split("+") for f in any_of):
        pytest.skip(f"needs one of {any_of} (root with namespaces/cgroups); this host gives {sb.isolation}")


def run_timed(sb: LocalSandbox, code: str) -> tuple[float, str, str, bool, str]:
    t0 = time.monotonic()
    r = sb.run_sync(code)
    assert r.reason != "internal_error", r
    return time.monotonic() - t0, r.stdout or "", r.stderr or "", r.run_success, r.reason


def marked_processes(marker: str) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])]


def test_alarm_cancelled_then_infinite_loop_is_killed_at_the_wall_timeout(sb: LocalSandbox) -> None:
    wall, out, _, ok, reason = run_timed(sb, "import signal\nsignal.alarm(0)\nwhile True:\n    pass")
    assert (ok, reason, out) == (False, "worker_timeout", "Suicide from timeout.\n")
    assert wall < TIMEOUT_S + SLACK_S


def test_sigterm_ignored_then_sleep_is_still_killed(sb: LocalSandbox) -> None:
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)"
    wall, _, _, ok, reason = run_timed(sb, code)
    assert (ok, reason) == (False, "worker_timeout") and wall < TIMEOUT_S + SLACK_S


def test_raising_a_limit_fails_and_a_large_allocation_still_fails(sb: LocalSandbox) -> None:
    code = (
        "import resource\n"
        "try:\n"
        "    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))\n"
        "    print('raised')\n"
        "except (ValueError, OSError):\n"
        "    print('denied')\n"
        "x = bytearray(1 << 30)\n"
    )
    wall, out, err, ok, _ = run_timed(sb, code)
    assert out == "denied\n" and not ok and "MemoryError" in err and wall < SLACK_S


def test_a_setsid_double_fork_daemon_dies_with_the_job(sb: LocalSandbox) -> None:
    need(sb, "pidns")
    marker = f"{time.time() % 1000:.6f}"  # a unique `sleep` argument to find it by on the host
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\n"
        "alive = [p for p in os.listdir('/proc') if p.isdigit()\n"
        f"         and b'{marker}' in open(f'/proc/{{p}}/cmdline', 'rb').read()]\n"
        "print('daemon alive' if alive else 'no daemon')\n"
    )
    _, out, _, ok, _ = run_timed(sb, code)
    assert ok and out == "daemon alive\n"  # it really ran, detached, while the job lived
    assert marked_processes(marker) == []


def test_without_pid_namespaces_a_setsid_daemon_is_still_killed() -> None:
    marker = f"{time.time() % 1000:.6f}"
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\n"
    )
    with LocalSandbox(max_workers=1, timeout_s=TIMEOUT_S, preload=(), disable=("pidns",)) as box:
        _spawned.extend(box.spawned_pids())
        assert "pidns" not in box.isolation
        assert box.run_sync(code).run_success
        assert marked_processes(marker) == []  # swept: it re-parented to the worker (a subreaper)


def test_a_fork_bomb_is_contained_within_the_timeout(sb: LocalSandbox) -> None:
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    wall, _, _, ok, reason = run_timed(sb, code)
    assert (ok, reason) == (False, "worker_timeout") and wall < TIMEOUT_S + SLACK_S
    assert sb.run_sync("print('next')").stdout == "next\n"


def test_a_fork_bomb_cannot_exceed_the_process_limit(sb: LocalSandbox) -> None:
    need(sb, "setuid", "cgroup")
    code = (
        "import os, time\n"
        "n = 0\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30)\n"
        "        n += 1\n"
        "    except OSError:\n"
        "        break\n"
        "print(n, flush=True)\n"
        "os._exit(0)\n"
    )
    _, out, _, _, _ = run_timed(sb, code)
    assert 0 < int(out) < 32  # RLIMIT_NPROC on the job's own uid (and the worker's pids cgroup)


def test_a_memory_bomb_fails_fast(sb: LocalSandbox) -> None:
    wall, _, err, ok, reason = run_timed(sb, "a = []\nwhile True:\n    a.append(bytes(10**7))")
    assert not ok and reason == "" and "MemoryError" in err and wall < 2 * SLACK_S


def test_a_forked_memory_bomb_is_bounded_by_the_cgroup(sb: LocalSandbox) -> None:
    if "cgroup" not in sb.isolation:
        pytest.skip(f"no memory cgroup on this host ({sb.isolation}): per-process RLIMIT_AS only")
    code = (
        "import os, time\n"
        "for i in range(6):\n"
        "    if os.fork() == 0:\n"
        "        a = bytearray(100 << 20)\n"
        "        for j in range(0, len(a), 4096):\n"
        "            a[j] = 1\n"
        "        print('allocated', flush=True)\n"
        "        time.sleep(30)\n"
    )
    wall, out, _, _, _ = run_timed(sb, code)
    assert out.count("allocated") <= 3  # 128 MB budget: the OOM killer takes job processes, not us
    assert wall < TIMEOUT_S + SLACK_S
    assert sb.run_sync("print('next')").stdout == "next\n"


def test_a_threads_bomb_is_capped(sb: LocalSandbox) -> None:
    need(sb, "setuid", "cgroup")
    code = (
        "import threading, time\n"
        "n = 0\n"
        "try:\n"
        "    for _ in range(10000):\n"
        "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "        n += 1\n"
        "except RuntimeError:\n"
        "    pass\n"
        "print(n)\n"
    )
    wall, out, _, ok, _ = run_timed(sb, code)
    assert ok and 0 < int(out) < 32 and wall < SLACK_S


def test_50_mb_of_output_returns_quickly_and_truncated(sb: LocalSandbox) -> None:
    wall, out, _, ok, _ = run_timed(sb, "import sys\nfor _ in range(50):\n    sys.stdout.write('x' * 10**6)")
    assert ok and out == "x" * 1000 and wall < SLACK_S


def test_non_utf8_output_is_replaced_not_an_internal_error(sb: LocalSandbox) -> None:
    _, out, _, ok, reason = run_timed(sb, "import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe end')")
    assert ok and reason == "" and out == "ok \ufffd\ufffd end"


def test_the_parents_secrets_are_not_visible(sb: LocalSandbox) -> None:
    need(sb, "pidns", "setuid")
    code = (
        "import os\n"
        "print(sorted(os.environ))\n"
        "for p in os.listdir('/proc'):\n"
        "    for f in ('environ', 'cmdline'):\n"
        "        try:\n"
        "            print(p, f, open(f'/proc/{p}/{f}', 'rb').read())\n"
        "        except OSError:\n"
        "            pass\n"
    )
    _, out, err, ok, _ = run_timed(sb, code)
    assert ok and "STREAMRL_TEST_SECRET" not in out and SECRET not in out + err
    assert "REDIS" not in out


def test_a_job_sees_only_its_own_processes(sb: LocalSandbox) -> None:
    need(sb, "pidns")
    code = f"import os\nprint(os.getpid(), [p for p in os.listdir('/proc') if p.isdigit()])\nos.kill({os.getpid()}, 0)"
    _, out, err, ok, _ = run_timed(sb, code)
    assert out == "1 ['1']\n"  # pid 1 of its own namespace, alone in its /proc
    assert not ok and "ProcessLookupError" in err  # our pid does not exist there


def test_connecting_to_a_loopback_listener_fails(sb: LocalSandbox) -> None:
    need(sb, "netns")
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        srv.settimeout(0.2)
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {srv.getsockname()[1]}), timeout=1)"
        _, _, err, ok, _ = run_timed(sb, code)
        assert not ok and "Network is unreachable" in err
        with pytest.raises(TimeoutError):
            srv.accept()


def test_writes_outside_the_working_directory_fail(sb: LocalSandbox) -> None:
    need(sb, "mntns-ro")
    name = f"streamrl-outside-{uuid.uuid4().hex}"
    repo = Path(__file__).resolve().parents[2]
    targets = [f"/tmp/{name}", f"{repo}/{name}", f"/var/tmp/{name}", f"/dev/shm/../{name}"]
    code = (
        "import os\n"
        f"for t in {targets!r}:\n"
        "    try:\n"
        "        open(t, 'w').write('x')\n"
        "        print('wrote', t)\n"
        "    except OSError as e:\n"
        "        print('denied', t, e.errno)\n"
    )
    _, out, _, ok, _ = run_timed(sb, code)
    assert ok and "wrote" not in out and out.count("denied") == len(targets)
    assert not any(os.path.exists(t) for t in targets)


def test_a_file_beyond_the_size_limit_cannot_be_written(sb: LocalSandbox) -> None:
    _, _, err, ok, _ = run_timed(sb, "open('big', 'wb').write(b'x' * (100 << 20))")
    assert not ok and "File too large" in err  # RLIMIT_FSIZE (64 MiB by default)


def test_a_user_namespace_does_not_make_the_filesystem_writable(sb: LocalSandbox) -> None:
    need(sb, "mntns-ro")
    name = f"streamrl-userns-{uuid.uuid4().hex}"
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print('unshare', libc.unshare(0x10000000 | 0x00020000))  # CLONE_NEWUSER | CLONE_NEWNS\n"
        "print('remount', libc.mount(None, b'/', None, 0x20 | 0x1000, None), ctypes.get_errno())\n"
        f"open('/tmp/{name}', 'w').write('x')\n"
    )
    _, out, err, ok, _ = run_timed(sb, code)
    assert not ok and "remount -1" in out and ("Read-only" in err or "Permission" in err)
    assert not os.path.exists(f"/tmp/{name}")


def test_killing_the_workers_parent_does_not_take_the_sandbox_down(sb: LocalSandbox) -> None:
    need(sb, "pidns", "setuid")
    workers = sb.worker_pids()
    # getppid() is 0 (the parent is outside the job's PID namespace), so this is kill(0, 9): the job's
    # own process group; then an explicit try at every process it can see.
    run_timed(sb, "import os\nprint(os.getppid())\nos.kill(os.getppid(), 9)")
    run_timed(
        sb,
        "import os, signal\nfor p in range(2, 100):\n    try: os.kill(p, 9)\n    except OSError: pass\nos.kill(-1, 9)",
    )
    assert sb.run_sync("print('next')").stdout == "next\n"
    assert sb.worker_pids() == workers and psutil.Process().is_running()


def test_a_worker_killed_mid_job_gives_internal_error_and_is_replaced() -> None:
    with LocalSandbox(max_workers=1, timeout_s=5.0, preload=()) as box:
        _spawned.extend(box.spawned_pids())
        [worker] = box.worker_pids()
        result: list[object] = []
        t = threading.Thread(target=lambda: result.append(box.run_sync("import time\ntime.sleep(3)")))
        t.start()
        time.sleep(0.5)
        os.kill(worker, 9)
        t.join(timeout=5)
        assert not t.is_alive()
        assert getattr(result[0], "reason", None) == "internal_error"
        assert box.run_sync("print('next')").stdout == "next\n"
        assert box.worker_pids() != [worker]
        _spawned.extend(box.spawned_pids())
