"""The generator's metrics records, from its real run loop, rStar2 tool path and reward pool.

Faked at the process boundaries only: the buffer (a client that hands out a fixed list of prompts
and acknowledges every group), the engine (ScriptedEngine answering a tool call first, then the
boxed answer) and the sandbox (ScriptedSandbox with a fixed delay, so latency has a known floor).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamrl import templates
from streamrl.agent import as_codec
from streamrl.config_load import load_job
from streamrl.group_frame import GroupFrame
from streamrl.messages import (
    Group,
    GroupAck,
    GroupAcks,
    Message,
    Prompt,
    PromptRequest,
    Prompts,
    decode,
    unpack,
)
from streamrl.metrics import MetricsWriter, read_metrics
from streamrl.tiny import VOCAB_SIZE, make_tokenizer
from streamrl.tiny_data import tokenizer_corpus
from tests.streamrl.agent_fakes import ScriptedEngine, ScriptedSandbox, Step, ok
from workers.engines.client import GenerateOutput, SamplingParams
from workers.generator import EnginePool, GeneratorRole
from workers.reward import RewardPool

ROOT = Path(__file__).resolve().parents[2]
PROMPTS, N = 4, 2
SANDBOX_DELAY_S = 0.03
CALL = templates.tool_call_text("print(6*7)")
ANSWER = " The tool says 42. </reason> <answer> \\boxed{42} </answer>"


class ToolEngine(ScriptedEngine):
    """Calls the tool in the first turn and answers after the tool's response, for any interleaving."""

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: str | None = None
    ) -> GenerateOutput:
        seen_tool = "<tool_response>" in self.codec.decode(input_ids)
        self.steps = [Step(ANSWER if seen_tool else CALL)]
        return await super().generate(input_ids, sampling, rid)


class FakeBuffer:
    """The buffer's side of the generator's socket."""

    name = "gen-0"

    def __init__(self, prompts: list[Prompt]) -> None:
        self.todo = list(prompts)
        self.groups: list[Group] = []
        self.replies: asyncio.Queue[Message] = asyncio.Queue()

    async def send(self, msg: Message | GroupFrame) -> None:
        match msg:
            case PromptRequest(max_prompts=k):
                give, self.todo = self.todo[:k], self.todo[k:]
                self.replies.put_nowait(Prompts(prompts=give, policy_version=0, retry_after_s=0.05))
            case GroupFrame(uid=uid, data=data):
                group = decode(data)
                assert isinstance(group, Group)
                self.groups.append(group)
                self.replies.put_nowait(GroupAcks(acks=[GroupAck(uid=uid, status="accepted")]))

    async def recv(self, timeout: float | None = None) -> Message | None:
        try:
            return await asyncio.wait_for(self.replies.get(), timeout)
        except TimeoutError:
            return None


@pytest.fixture(scope="module")
def rewards() -> Iterator[RewardPool]:
    with RewardPool(1, timeout_s=10.0, default_score=0.0, kind="math_verify") as pool:
        yield pool


def test_generator_writes_periodic_metrics_records_with_tool_latency(
    tmp_path: Path, rewards: RewardPool
) -> None:
    spec = load_job(
        ROOT / "configs/tiny-arith.yaml",
        [
            "rollout.agent=rstar2_tool",
            "sandbox.type=embedded",  # never started: the test passes a scripted sandbox
            f"rollout.n_samples={N}",
            "rollout.concurrency=4",
            "rollout.max_new_tokens=200",
        ],
    )
    codec = as_codec(make_tokenizer(tokenizer_corpus(per_task=50), VOCAB_SIZE))
    prompts = [
        Prompt(uid=i, prompt_id=f"p{i}", answer="42", text="What is 6*7?", admitted_version=0, n_samples=N)
        for i in range(PROMPTS)
    ]
    buffer = FakeBuffer(prompts)
    sandbox = ScriptedSandbox([ok("42\n") for _ in range(PROMPTS * N)], delay_s=SANDBOX_DELAY_S)

    async def run() -> None:
        with MetricsWriter(tmp_path, "generator", "gen-0") as writer:
            engines = EnginePool([ToolEngine(codec, [])])  # type: ignore[list-item]
            role = GeneratorRole(
                spec, buffer, engines, codec, rewards, sandbox, metrics=writer, metrics_every_s=0.2
            )  # type: ignore[arg-type]
            task = asyncio.create_task(role.run())
            deadline = time.monotonic() + 30
            while len(buffer.groups) < PROMPTS and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.5)  # nothing left to do: at least two records of an idle generator
            role.stopping.set()
            await task

    asyncio.run(run())
    assert len(buffer.groups) == PROMPTS
    path = tmp_path / "metrics-generator-gen-0.jsonl"
    assert path.exists() and len(path.read_text().splitlines()) == len(records := read_metrics(tmp_path))
    assert all(r["role"] == "generator" and r["name"] == "gen-0" for r in records)
    assert [r["step"] for r in records] == list(range(len(records)))
    assert all(a["wall_s"] <= b["wall_s"] for a, b in zip(records, records[1:], strict=False))

    last = records[-1]  # totals since start; the last record is written on stop
    tokens = sum(int(unpack("loss_mask", t.loss_mask).sum()) for g in buffer.groups for t in g.trajectories)
    assert (last["groups_sent"], last["trajectories"], last["tokens"]) == (PROMPTS, PROMPTS * N, tokens)
    assert (last["tool_calls"], last["tool_errors"], last["tool_failures"], last["in_flight"]) == (8, 0, 0, 0)
    busy = [r for r in records if r["trajectories_per_s"] > 0]
    assert busy and all(r["reward_mean"] == 1.0 and r["tool_call_success_rate"] == 1.0 for r in busy)
    latencies = [r["tool_latency_ms_mean"] for r in records if r["tool_latency_ms_mean"] is not None]
    assert latencies and min(latencies) >= 1000 * SANDBOX_DELAY_S
    assert all(r["idle_ratio"] < 1.0 for r in busy)  # exact ratios: tests/streamrl/test_metrics.py
    after = records[records.index(busy[-1]) + 1 :]  # the idle wait, then the record written on stop
    assert len(after) >= 2 and all(r["idle_ratio"] == pytest.approx(1.0) for r in after)
    assert all(r["tokens_per_s"] == 0.0 and r["tool_latency_ms_mean"] is None for r in after)
    # Rates over their intervals add up to the totals.
    assert sum(r["trajectories_per_s"] * r["interval_s"] for r in records) == pytest.approx(PROMPTS * N)
    assert sum(r["tokens_per_s"] * r["interval_s"] for r in records) == pytest.approx(tokens)
    assert (tmp_path / "tb" / "generator" / "gen-0").is_dir()
    json.loads(path.read_text().splitlines()[0])  # plain JSON lines
