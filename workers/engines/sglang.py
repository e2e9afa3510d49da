"""Start the rollout-engine servers a job asks for, or attach to running ones, and return their URLs.

    engines = start_engines(spec.engine, model_path, log_dir=run_dir / "logs")
    ... EngineClient(url) for url in engines.urls ...
    engines.stop()

`SGLangEngine` runs `python -m sglang.launch_server --model-path ... --tp-size ... --port ...
--mem-fraction-static ... [--max-running-requests ...] [extra_args]` per server, each on its own
`tp_size` GPUs (CUDA_VISIBLE_DEVICES), or, when `urls` is set, starts nothing and only waits for
those servers to be healthy. `EmbeddedEngine` runs `python -m streamrl engine serve` per server.
This module never imports sglang: SGLang cannot even be installed on the CPU machines CI runs on.

Each server is its own process group (start_new_session) with its log in `log_dir`, so `stop()`
ends SGLang's helper processes too. Waiting for /health is bounded; a server that exits while we
wait fails the start at once, with the tail of its log in the error.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from streamrl.config import EmbeddedEngine, EngineConfig, SGLangEngine
from workers.engines.client import EngineError


def build_command(
    engine: EngineConfig, model_path: str, *, host: str, port: int, python: str = sys.executable
) -> list[str]:
    """The command line of one server."""
    if isinstance(engine, SGLangEngine):
        cmd = [python, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host]
        cmd += ["--port", str(port), "--tp-size", str(engine.tp_size)]
        cmd += ["--mem-fraction-static", str(engine.mem_fraction_static)]
        if engine.max_running_requests is not None:
            cmd += ["--max-running-requests", str(engine.max_running_requests)]
        return cmd + list(engine.extra_args)
    return [
        python, "-m", "streamrl", "engine", "serve", "--model", model_path, "--host", host, "--port", str(port),
        "--threads", str(engine.threads), "--max-batch", str(engine.max_batch),
    ]  # fmt: skip


def gpu_assignment(engine: SGLangEngine, gpu_ids: Sequence[int] | None = None) -> list[list[int]]:
    """GPUs of each server: consecutive runs of `tp_size` from `gpu_ids` (default 0, 1, 2, ...)."""
    need = engine.count * engine.tp_size
    ids = list(range(need)) if gpu_ids is None else list(gpu_ids)
    if len(ids) < need:
        raise ValueError(f"{engine.count} servers x tp_size {engine.tp_size} need {need} GPUs, given {ids}")
    return [ids[i * engine.tp_size : (i + 1) * engine.tp_size] for i in range(engine.count)]


@dataclass
class EngineServer:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path


@dataclass
class EngineSet:
    """The servers' URLs, and the processes this launcher started (none when attached)."""

    urls: list[str]
    servers: list[EngineServer] = field(default_factory=list)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM each started server's process group, wait (bounded), then SIGKILL what is left."""
        for s in self.servers:
            _signal_group(s.process, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for s in self.servers:
            try:
                s.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(s.process, signal.SIGKILL)
                s.process.wait(5.0)
        self.servers = []


def start_engines(
    engine: EngineConfig,
    model_path: str,
    *,
    host: str = "127.0.0.1",
    ports: Sequence[int] | None = None,
    log_dir: Path | None = None,
    health_timeout_s: float = 600.0,
    gpu_ids: Sequence[int] | None = None,
    env: Mapping[str, str] | None = None,
    python: str = sys.executable,
) -> EngineSet:
    """Start `engine.count` servers (or attach to `engine.urls`) and wait until all are healthy."""
    if isinstance(engine, SGLangEngine) and engine.urls:
        urls = [u.rstrip("/") for u in engine.urls]
        deadline = time.monotonic() + health_timeout_s
        for url in urls:
            wait_healthy(url, deadline)
        return EngineSet(urls)
    ports = list(ports) if ports is not None else [free_port(host) for _ in range(engine.count)]
    if len(ports) != engine.count:
        raise ValueError(f"{engine.count} servers need {engine.count} ports, given {ports}")
    gpus = gpu_assignment(engine, gpu_ids) if isinstance(engine, SGLangEngine) else [None] * engine.count
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="streamrl-engines-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    started = EngineSet([])
    try:
        for i, (port, gpu) in enumerate(zip(ports, gpus, strict=True)):
            child_env = {**os.environ, **(env or {})}
            if gpu is not None:
                child_env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu))
            if isinstance(engine, EmbeddedEngine):
                child_env.setdefault("OMP_NUM_THREADS", str(engine.threads))  # one thread per process is best
            log_path = log_dir / f"engine-{i}.log"
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(
                    build_command(engine, model_path, host=host, port=port, python=python),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=child_env,
                    start_new_session=True,  # its own process group: stop() reaches its children
                )
            url = f"http://{host}:{port}"
            started.urls.append(url)
            started.servers.append(EngineServer(url, proc, log_path))
        deadline = time.monotonic() + health_timeout_s
        for s in started.servers:
            wait_healthy(s.url, deadline, s)
    except BaseException:
        started.stop()
        raise
    return started


def wait_healthy(url: str, deadline: float, server: EngineServer | None = None) -> None:
    """Poll GET /health until 200; EngineError at the deadline or as soon as `server` exits."""
    while True:
        if server is not None and server.process.poll() is not None:
            raise EngineError(
                url, "/health", f"server exited with code {server.process.returncode}: {_tail(server)}"
            )
        try:
            with urllib.request.urlopen(url + "/health", timeout=2.0) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() >= deadline:
            detail = f"not healthy in time{': ' + _tail(server) if server is not None else ''}"
            raise EngineError(url, "/health", detail)
        time.sleep(0.2)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _tail(server: EngineServer, chars: int = 2000) -> str:
    try:
        return server.log_path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
            os.killpg(proc.pid, sig)  # the group this launcher created for this server (pgid == pid)
