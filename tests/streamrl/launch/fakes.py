"""Tiny stand-ins for the roles, so the supervisor is tested with real processes and signals but
without models: each is a Python script that appends what happens to it to RUN/events.txt
("<name> <event>" per line) and behaves as its body says.

Every fake stops on SIGTERM (writing "term") unless its body installs another handler, and none
runs longer than a minute even if nobody stops it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from streamrl.launch.plan import Plan, Probe, ProcessSpec, Resources, RestartPolicy

HEADER = """\
import os, pathlib, signal, sys, time
RUN = pathlib.Path(sys.argv[1]); NAME = sys.argv[2]
def ev(what):
    with open(RUN / "events.txt", "a") as f:
        f.write(f"{NAME} {what}\\n")
def count(name, what):
    p = RUN / "events.txt"
    return sum(1 for l in p.read_text().splitlines() if l == f"{name} {what}") if p.exists() else 0
def wait_for(pred, timeout=30):
    t = time.monotonic()
    while not pred():
        if time.monotonic() - t > timeout:
            ev("gave-up"); sys.exit(9)
        time.sleep(0.05)
def on_term(*_):
    ev("term"); sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
ev("start " + " ".join(sys.argv[3:]))
ev(f"pid {os.getpid()}")
"""
SLEEP = "time.sleep(60)\n"


def fake(run: Path, name: str, role: str, stage: int, body: str = SLEEP, **kw: Any) -> ProcessSpec:
    script = run / "roles" / f"{name}.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(HEADER + body)
    return ProcessSpec(
        name=name,
        role=role,  # type: ignore[arg-type]
        argv=[sys.executable, str(script), str(run), name, *kw.pop("args", [])],
        env={"PYTHONUNBUFFERED": "1"},
        node=0,
        stage=stage,
        resources=Resources(cpus=kw.pop("cpus", 1)),
        log_path=str(run / "logs" / f"{name}.log"),
        **kw,
    )


def fake_plan(
    run: Path, procs: list[ProcessSpec], on_failure: str = "restart", max_restarts: int = 3
) -> Plan:
    return Plan(
        job="fake",
        kind="local",
        run_dir=str(run),
        job_file=str(run / "job.yaml"),
        model_dir="/m",
        nodes=1,
        gpus_per_node=0,
        hosts=["127.0.0.1"],
        buffer_address=f"ipc://{run}/buffer.sock",
        engine_urls=[],
        attach_urls=[],
        master_addr="127.0.0.1",
        master_port=0,
        restart=RestartPolicy(on_failure=on_failure, max_restarts=max_restarts),  # type: ignore[arg-type]
        processes=procs,
    )


def buffer(run: Path, body: str = "", **kw: Any) -> ProcessSpec:
    """Creates its 'socket' (ready probe: path) and serves until SIGTERM."""
    sock = run / "buffer.sock"
    code = f"pathlib.Path({str(sock)!r}).touch()\n" + body + SLEEP
    kw.setdefault("ready", Probe(kind="path", target=str(sock), timeout_s=20.0))
    return fake(run, "buffer", "buffer", 0, code, **kw)


def engine(run: Path, port: int, name: str = "engine-0", body: str = "", **kw: Any) -> ProcessSpec:
    """Answers GET /health with 200 (ready probe: http)."""
    code = body + (
        "import http.server\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
        "    def log_message(self, *a): pass\n"
        f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n"
    )
    kw.setdefault("ready", Probe(kind="http", target=f"http://127.0.0.1:{port}/health", timeout_s=20.0))
    return fake(run, name, "engine", 1, code, **kw)


def events(run: Path) -> list[str]:
    path = run / "events.txt"
    return path.read_text().splitlines() if path.exists() else []


def pids_alive(pids: list[int]) -> list[int]:
    """Those of `pids` still running (zombies of other parents count as gone)."""
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
        except FileNotFoundError:
            pass
    return alive


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := pids_alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def started_pids(run: Path) -> list[int]:
    """Pids of every fake started so far (each writes 'pid N' first)."""
    return [int(line.split()[-1]) for line in events(run) if " pid " in line]
