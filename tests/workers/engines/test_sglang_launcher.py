"""The engine launcher: SGLang command lines from the job spec, attaching to running servers, starting
`python -m sglang.launch_server` (a stand-in package here, see conftest) and stopping what it started."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streamrl.config import EmbeddedEngine, SGLangEngine
from tests.conftest import free_port
from tests.workers.engines.conftest import SGLANG_SPEC
from workers.engines.client import EngineClient, EngineError, SamplingParams
from workers.engines.sglang import EngineServer, EngineSet, build_command, gpu_assignment, start_engines


def test_sglang_command_line_comes_from_the_job_spec() -> None:
    spec = SGLangEngine(
        tp_size=2, mem_fraction_static=0.7, max_running_requests=128, extra_args=["--dtype", "bfloat16"]
    )
    assert build_command(spec, "/m", host="0.0.0.0", port=30001, python="py") == [
        "py", "-m", "sglang.launch_server", "--model-path", "/m", "--host", "0.0.0.0", "--port", "30001",
        "--tp-size", "2", "--mem-fraction-static", "0.7", "--max-running-requests", "128", "--dtype", "bfloat16",
    ]  # fmt: skip
    assert "--max-running-requests" not in build_command(SGLangEngine(), "/m", host="h", port=1)


def test_embedded_command_line_serves_the_embedded_engine() -> None:
    assert build_command(EmbeddedEngine(threads=2, max_batch=32), "/m", host="127.0.0.1", port=7, python="py") == [
        "py", "-m", "streamrl", "engine", "serve", "--model", "/m", "--host", "127.0.0.1", "--port", "7",
        "--threads", "2", "--max-batch", "32",
    ]  # fmt: skip


def test_each_server_gets_its_own_tp_size_gpus() -> None:
    assert gpu_assignment(SGLangEngine(count=2, tp_size=2)) == [[0, 1], [2, 3]]
    assert gpu_assignment(SGLangEngine(count=2, tp_size=1), gpu_ids=[6, 7]) == [[6], [7]]
    with pytest.raises(ValueError, match="need 4 GPUs"):
        gpu_assignment(SGLangEngine(count=2, tp_size=2), gpu_ids=[0, 1, 2])


def test_attaching_waits_for_health_and_starts_nothing(engine_url: str) -> None:
    engines = start_engines(SGLangEngine(urls=[engine_url + "/"]), "/unused", health_timeout_s=10.0)
    assert engines.urls == [engine_url] and engines.servers == []


def test_attaching_to_a_dead_server_fails_within_the_bound() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=rf"^{dead}/health: not healthy in time"):
        start_engines(SGLangEngine(urls=[dead]), "/unused", health_timeout_s=0.5)
    assert time.monotonic() - t0 < 5.0


def test_starting_runs_python_m_sglang_launch_server_and_returns_a_working_url(
    sglang_engine: tuple[EngineSet, Path], model_dir: Path
) -> None:
    engines, argv_file = sglang_engine
    (server,) = engines.servers
    assert engines.urls == [server.url] and server.process.poll() is None
    port = int(server.url.rsplit(":", 1)[1])
    assert (
        json.loads(argv_file.read_text())
        == build_command(SGLANG_SPEC, str(model_dir), host="127.0.0.1", port=port)[3:]
    )

    async def go() -> int:
        async with EngineClient(server.url) as c:
            return len(
                (await c.generate([1, 2, 3], SamplingParams(max_new_tokens=3, ignore_eos=True))).output_ids
            )

    assert asyncio.run(go()) == 3


def test_a_server_that_dies_while_starting_fails_at_once_with_its_log(tmp_path: Path) -> None:
    t0 = time.monotonic()
    env = {"PYTHONPATH": str(tmp_path)}  # no sglang anywhere: the child exits at import
    with pytest.raises(EngineError, match="exited with code 1.*No module named 'sglang'"):
        start_engines(SGLangEngine(), "/m", log_dir=tmp_path, env=env, health_timeout_s=60.0)
    assert time.monotonic() - t0 < 20.0


def test_stop_ends_the_whole_process_group_of_a_server(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    script = f"import subprocess, time; p = subprocess.Popen(['sleep', '60']); open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    engines = EngineSet(["http://x"], [EngineServer("http://x", proc, tmp_path / "log")])
    deadline = time.monotonic() + 20
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "helper did not start"
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    engines.stop(grace_s=5.0)
    assert proc.poll() is not None and engines.servers == []
    deadline = time.monotonic() + 5
    while alive(grandchild):
        assert time.monotonic() < deadline, "the server's child survived stop()"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for a reaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
