"""A generator streams scored groups into a running buffer, end to end on CPU, and survives a dead engine.

Every part is real and in its own process: two embedded engines serving a tiny random Qwen2 model,
the buffer role, the generator role with its reward pool; the test plays the learner.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from streamrl import messages as m
from streamrl.tiny import random_model_dir
from streamrl.transport import Client

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "configs/tiny-arith.yaml"
OVERRIDES = [
    "rollout.n_samples=4",
    "rollout.max_new_tokens=6",
    "rollout.concurrency=16",
    "buffer.groups_per_step=2",
    "buffer.max_staleness=0",  # nothing runs ahead: later groups must be made after the kill
    "reward.workers=1",
]
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, object]]:
    model = random_model_dir(tmp_path / "model", seed=1)
    ports = [free_port(), free_port()]
    address = f"ipc://{tmp_path}/buffer.sock"
    sets = [a for o in OVERRIDES for a in ("--set", o)]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for i, port in enumerate(ports):
        procs[f"engine{i}"] = spawn(
            [sys.executable, "-m", "streamrl", "engine", "serve", "--model", str(model), "--port", str(port)],
            tmp_path / f"engine{i}.log",
        )
    procs["buffer"] = spawn(
        [sys.executable, "-m", "workers.buffer", "--job", str(JOB), "--address", address, *sets],
        tmp_path / "buffer.log",
    )
    procs["generator"] = spawn(
        [
            sys.executable,
            "-m",
            "workers.generator",
            "--job",
            str(JOB),
            "--buffer",
            address,
            "--model",
            str(model),
            "--engines",
            ",".join(f"http://127.0.0.1:{p}" for p in ports),
            "--name",
            "gen-0",
            *sets,
        ],
        tmp_path / "generator.log",
    )
    try:
        yield {"procs": procs, "address": address, "tmp": tmp_path}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


def next_batch(learner: Client, step: int, deadline: float) -> m.Batch:
    while time.monotonic() < deadline:
        reply = learner.request(m.BatchRequest(step=step), timeout_s=10)
        if isinstance(reply, m.Batch):
            return reply
        time.sleep(0.2)
    raise AssertionError(f"no batch for step {step} in time")


def check_batch(batch: m.Batch) -> None:
    assert len(batch.groups) == 2
    for group, adv in zip(batch.groups, batch.advantages, strict=True):
        assert group.generator == "gen-0" and len(group.trajectories) == 4
        assert len(m.unpack("advantages", adv)) == 4
        assert len(m.unpack("prompt_tokens", group.prompt_tokens)) > 3
        for t in group.trajectories:
            m.check_trajectory(t)
            assert 1 <= t.num_tokens <= 6 and t.reward in (0.0, 1.0)
            assert set(m.unpack("versions", t.versions)) == {0}  # the engines serve version 0
            assert np.all(m.unpack("logprobs", t.logprobs) <= 0)
            assert np.all(m.unpack("loss_mask", t.loss_mask) == 1)  # single-turn: every token is the model's


def test_generator_streams_groups_into_a_running_buffer_and_survives_a_dead_engine(cluster) -> None:
    procs = cluster["procs"]
    with Client(cluster["address"], role="learner", name="learner") as learner:
        learner.connect(timeout_s=60)
        deadline = time.monotonic() + 120
        check_batch(next_batch(learner, 0, deadline))
        procs["engine0"].kill()  # kill -9 one engine: its samples move to the other
        procs["engine0"].wait(timeout=10)
        learner.send(m.WeightsPublished(version=1, step=0))
        for step in (1, 2):
            check_batch(next_batch(learner, step, deadline))
            learner.send(m.WeightsPublished(version=step + 1, step=step))
        assert procs["generator"].poll() is None and procs["buffer"].poll() is None
    log = (cluster["tmp"] / "generator.log").read_text()
    assert log.count('"event": "engine_failed"') == 1, "the dead engine was never noticed (or noticed twice)"
