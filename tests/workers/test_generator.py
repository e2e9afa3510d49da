"""A generator streams scored groups into a running buffer, end to end on CPU: single-turn math that
survives a dead engine, and the rStar2 tool loop with a real sandbox and RoC.

Every part is real and in its own process: embedded engines serving a tiny Qwen2 model (random for
the math test, the warm-started tool model for the tool test), the buffer role, the generator role
with its reward pool and embedded sandbox; the test plays the learner.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from streamrl import messages as m
from streamrl import tiny
from streamrl.config_load import load_job
from streamrl.rewards import final_answer_text
from streamrl.tiny import random_model_dir
from streamrl.tool_calls import TRUNCATION_MARK
from streamrl.transport_client import Client

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
TOOL_JOB = ROOT / "configs/tiny-tool.yaml"
TOOL_OVERRIDES = ["buffer.groups_per_step=2", "rollout.concurrency=16"]  # two prompts of 2G = 8 at once
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


@contextmanager
def running_cluster(
    tmp_path: Path, job: Path, overrides: list[str], model: Path, engines: int
) -> Iterator[dict[str, Any]]:
    """`engines` embedded engines serving `model`, the buffer role and one generator ("gen-0"), each a
    process logging to tmp_path/<name>.log; every one is stopped on exit."""
    ports = [free_port() for _ in range(engines)]
    address = f"ipc://{tmp_path}/buffer.sock"
    sets = [a for o in overrides for a in ("--set", o)]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for i, port in enumerate(ports):
            procs[f"engine{i}"] = spawn(
                [
                    sys.executable,
                    "-m",
                    "streamrl",
                    "engine",
                    "serve",
                    "--model",
                    str(model),
                    "--port",
                    str(port),
                ],
                tmp_path / f"engine{i}.log",
            )
        procs["buffer"] = spawn(
            [sys.executable, "-m", "workers.buffer", "--job", str(job), "--address", address, *sets],
            tmp_path / "buffer.log",
        )
        procs["generator"] = spawn(
            [
                sys.executable,
                "-m",
                "workers.generator",
                "--job",
                str(job),
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
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        yield {"procs": procs, "address": address, "tmp": tmp_path, "urls": urls}
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


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, Any]]:
    model = random_model_dir(tmp_path / "model", seed=1)
    with running_cluster(tmp_path, JOB, OVERRIDES, model, engines=2) as c:
        yield c


def next_batch(learner: Client, step: int, deadline: float) -> m.Batch:
    while time.monotonic() < deadline:
        reply = learner.request(m.BatchRequest(step=step), timeout_s=10)
        if isinstance(reply, m.Batch):
            return reply
        time.sleep(0.2)
    raise AssertionError(f"no batch for step {step} in time")


def publish(learner: Client, engine_url: str, version: int, step: int) -> None:
    """What the learner does after a step, minus the weights: the engine moves to `version` first
    (the buffer sends back groups sampled behind their admission version), then the buffer learns it."""
    body = json.dumps({"new_version": str(version)}).encode()
    req = urllib.request.Request(
        engine_url + "/update_weight_version", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as answer:
        assert json.load(answer)["success"]
    learner.send(m.WeightsPublished(version=version, step=step))


def check_batch(batch: m.Batch) -> None:
    assert len(batch.groups) == 2
    for group, adv in zip(batch.groups, batch.advantages, strict=True):
        assert group.generator == "gen-0" and len(group.trajectories) == 4
        assert len(m.unpack("advantages", adv)) == 4
        assert len(m.unpack("prompt_tokens", group.prompt_tokens)) > 3
        for t in group.trajectories:
            m.check_trajectory(t)
            assert 1 <= t.num_tokens <= 6 and t.reward in (0.0, 1.0)
            assert set(m.unpack("versions", t.versions)) <= {batch.step - 1, batch.step}
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
        publish(learner, cluster["urls"][1], version=1, step=0)
        for step in (1, 2):
            check_batch(next_batch(learner, step, deadline))
            publish(learner, cluster["urls"][1], version=step + 1, step=step)
        assert procs["generator"].poll() is None and procs["buffer"].poll() is None
    log = (cluster["tmp"] / "generator.log").read_text()
    assert log.count('"event": "engine_failed"') == 1, "the dead engine was never noticed (or noticed twice)"


# ---------------------------------------------------------------- the rStar2 tool loop


# One tool turn exactly as templates.tool_turn renders it: the response as a user turn, then the next
# assistant turn opened inside <reason>. max_parallel_calls is 1, so one <tool_response> per turn.
TOOL_TURN = re.compile(
    r"<\|im_start\|>user\n<tool_response>\n(.*)\n</tool_response><\|im_end\|>\n<\|im_start\|>assistant\n<reason>",
    re.DOTALL,
)
PROBLEM = re.compile(r"This is the problem:\n(\d+)\*(\d+)=")


def runs(mask: np.ndarray) -> list[tuple[int, int, int]]:
    """(value, start, end) of each maximal run of equal values in a 0/1 mask."""
    edges = [0, *(np.flatnonzero(np.diff(mask)) + 1).tolist(), len(mask)]
    return [(int(mask[a]), a, b) for a, b in zip(edges, edges[1:], strict=False)]


def check_tool_trajectory(t: m.Trajectory, product: int, tok: Any, max_chars: int) -> None:
    m.check_trajectory(t)
    ids, mask = m.unpack("tokens", t.tokens), m.unpack("loss_mask", t.loss_mask)
    logprobs, versions = m.unpack("logprobs", t.logprobs), m.unpack("versions", t.versions)
    assert tok.decode(ids.tolist(), skip_special_tokens=False) == t.text  # what RoC and the grader read
    assert mask[-1] == 1, "a trajectory never ends on a tool turn"
    spans = runs(mask)
    tool_spans = [(a, b) for v, a, b in spans if v == 0]
    assert len(tool_spans) == t.tool_calls  # one call per turn, each answered by one tool turn
    assert t.num_turns == len(tool_spans) + 1
    for value, a, b in spans:
        text = tok.decode(ids[a:b].tolist(), skip_special_tokens=False)
        if value == 0:  # tool tokens: context only, out of the loss
            response = TOOL_TURN.fullmatch(text)
            assert response is not None, f"tool tokens are not one <tool_response> user turn: {text!r}"
            assert len(response[1]) <= max_chars + len(TRUNCATION_MARK)
            assert np.all(logprobs[a:b] == 0) and np.all(versions[a:b] == -1)
        else:  # the model's tokens: sampled by weight version 0 with their log-probs
            assert np.all(versions[a:b] == 0) and np.all(logprobs[a:b] <= 0)
            assert np.all(np.isfinite(logprobs[a:b]))
            if b < len(mask):
                assert "<tool_call>" in text, "a tool turn follows only a turn that called the tool"
    # final_answer_only: the last assistant turn's box is graded, never the product in the tool output.
    boxed = final_answer_text(t.text)[len("\\boxed{") : -1].strip()
    assert t.reward == float(boxed.isdigit() and int(boxed) == product), (t.reward, boxed, product)


def test_generator_runs_the_rstar2_tool_loop_with_the_sandbox_and_roc_into_the_buffer(tmp_path: Path) -> None:
    spec = load_job(TOOL_JOB, TOOL_OVERRIDES)
    two_g, g = spec.rollout.n_samples, spec.roc.down_sample_to_n
    assert spec.roc.enabled and two_g == 2 * g
    model = tiny.ensure("tool", progress=False)  # cached; ~20 s to build when missing
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    with (
        running_cluster(tmp_path, TOOL_JOB, TOOL_OVERRIDES, model, engines=1) as cluster,
        Client(cluster["address"], role="learner", name="learner") as learner,
    ):
        learner.connect(timeout_s=60)
        batch = next_batch(learner, 0, time.monotonic() + 50)
    assert len(batch.groups) == spec.buffer.groups_per_step
    trajectories: list[m.Trajectory] = []
    for group, adv in zip(batch.groups, batch.advantages, strict=True):
        problem = PROBLEM.search(tok.decode(m.unpack("prompt_tokens", group.prompt_tokens).tolist()))
        assert problem is not None, "the prompt is rStar2's template around the synthetic problem"
        # RoC in the buffer kept G of the 2G samples, in submission order, with both outcomes present.
        kept = [t.sample_index for t in group.trajectories]
        assert len(kept) == g and kept == sorted(kept) and set(kept) <= set(range(two_g))
        assert len(m.unpack("advantages", adv)) == g
        assert len({t.reward for t in group.trajectories}) == 2  # reject-equal drops uniform groups
        for t in group.trajectories:
            check_tool_trajectory(
                t, int(problem[1]) * int(problem[2]), tok, spec.rollout.max_tool_response_chars
            )
        trajectories += group.trajectories
    assert any(t.tool_calls > 0 for t in trajectories), "the warm-started model calls the tool"
    assert any(t.reward == 1.0 and t.tool_calls > 0 for t in trajectories)
