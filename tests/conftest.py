"""Shared fixtures and helpers: a real redis-server on loopback, free ports, serving an aiohttp app,
bounded waits, and stopping processes by PID.

Redis tests use the Debian `redis-server` binary (CI installs it with apt-get; it does not start
by itself). It is started once per session on 127.0.0.1 with a free port, no persistence, and its
pidfile and dir in a temporary folder, and stopped by PID. Without the binary those tests skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, every_s: float = 0.05) -> None:
    """Poll `predicate` until true; fail the test (never hang) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM, bounded wait, then SIGKILL: tests never leave a process behind."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5.0)


@asynccontextmanager
async def serve_app(app: web.Application) -> AsyncIterator[str]:
    """Serve an aiohttp app on a free loopback port for the duration of the block."""
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _start_redis(exe: str, workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    last_error = ""
    for _ in range(3):  # a free port can be taken between our probe and redis' bind
        port = free_port()
        log = open(workdir / f"redis-{port}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
            + ["--dir", str(workdir), "--pidfile", str(workdir / "redis.pid"), "--daemonize", "no"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and proc.poll() is None:
            if _ping(port):
                return proc, port
            time.sleep(0.05)
        stop_process(proc)
        last_error = (workdir / f"redis-{port}.log").read_text(errors="replace")[-500:]
    raise RuntimeError(f"redis-server did not answer PING: {last_error}")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real redis-server for the whole session."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server not found: install it with `apt-get install -y redis-server` (CI does)")
    proc, port = _start_redis(exe, tmp_path_factory.mktemp("redis"))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)  # by PID: only the server this fixture started
        try:
            proc.wait(10.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5.0)


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """The session's redis-server, emptied for this test."""
    port = int(redis_server.rsplit(":", 1)[1].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as s:
        s.sendall(b"FLUSHALL\r\n")
        assert s.recv(16).startswith(b"+OK")
    return redis_server
