"""Engine fixtures: a tiny random Qwen2 model folder and engine servers as real processes.

Servers are started through the launcher (`workers.engines.sglang.start_engines`) on free loopback
ports, with a bounded health wait, and stopped (process group: SIGTERM, then SIGKILL) at teardown.

`sglang_engine` goes through the SGLang path of the launcher: `python -m sglang.launch_server ...`
finds a stand-in `sglang` package written to a temporary folder on the child's PYTHONPATH only
(SGLang cannot run here). The stand-in records its arguments and serves the embedded engine.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamrl.config import EmbeddedEngine, SGLangEngine
from streamrl.tiny import random_model_dir
from workers.engines.client import EngineClient
from workers.engines.sglang import EngineSet, start_engines

START_TIMEOUT_S = 90.0  # a loaded 2-core machine needs ~5-10 s to import torch + transformers and load
REPO_ROOT = Path(__file__).resolve().parents[3]

FAKE_LAUNCH_SERVER = '''"""Stand-in for `python -m sglang.launch_server` (streamrl tests): records argv, serves the embedded engine."""
import json, os, sys

from workers.engines.embedded import main

args = sys.argv[1:]
with open(os.environ["FAKE_SGLANG_ARGV"], "w") as f:
    json.dump(args, f)


def opt(name, default=None):
    return args[args.index(name) + 1] if name in args else default


sys.exit(main(["--model", opt("--model-path"), "--host", opt("--host"), "--port", opt("--port"),
               "--max-batch", opt("--max-running-requests", "64")]))
'''


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen2 (hidden 128, 4 layers) with streamrl's tokenizer."""
    return random_model_dir(tmp_path_factory.mktemp("model"), seed=0)


@pytest.fixture(scope="session")
def engine_url(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One embedded engine shared by tests that leave its weights alone; tests that pause it continue it."""
    engines = start_engines(
        EmbeddedEngine(threads=1, max_batch=64),
        str(model_dir),
        log_dir=tmp_path_factory.mktemp("engine-logs"),
        health_timeout_s=START_TIMEOUT_S,
    )
    try:
        yield engines.urls[0]
    finally:
        engines.stop()


SGLANG_SPEC = SGLangEngine(
    tp_size=1, mem_fraction_static=0.5, max_running_requests=16, extra_args=["--random-seed", "3"]
)


@pytest.fixture(scope="session")
def sglang_engine(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[EngineSet, Path]]:
    """A server started by the launcher's SGLang path (stand-in package), and the file with its argv.
    The weight-update tests change its weights; nothing else depends on them."""
    root = tmp_path_factory.mktemp("fake-sglang")
    (root / "sglang").mkdir()
    (root / "sglang" / "__init__.py").write_text("")
    (root / "sglang" / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    argv_file = root / "argv.json"
    path = os.pathsep.join(p for p in (str(root), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    engines = start_engines(
        SGLANG_SPEC,
        str(model_dir),
        log_dir=root / "logs",
        health_timeout_s=START_TIMEOUT_S,
        env={"PYTHONPATH": path, "FAKE_SGLANG_ARGV": str(argv_file)},
    )
    try:
        yield engines, argv_file
    finally:
        engines.stop()


def server_info(url: str) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        async with EngineClient(url, timeout_s=10.0) as c:
            return dict((await c.server_info())["internal_states"][0])

    return asyncio.run(go())
