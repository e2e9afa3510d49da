"""WeightPusher against real embedded-engine processes: after a push from this process the engines
compute exactly what transformers computes with the learner's weights, in both pause modes; an engine
killed between updates is skipped, then caught up with full weights once restarted on its URL; an
engine dying during an update fails the push quickly and leaves the other engine serving."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from streamrl import weight_buckets
from streamrl.config import EmbeddedEngine, WeightSyncConfig
from streamrl.errors import WeightSyncError
from streamrl.tiny import random_model_dir
from streamrl.weight_push import WeightPusher
from workers.engines.client import EngineClient, EngineError, GenerateOutput, SamplingParams
from workers.engines.sglang import EngineServer, free_port, start_engines

PROMPTS = [[5, 17, 42], [8, 99, 100, 101, 7, 3, 60, 61, 9], [200, 4]]
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
TIMEOUT_S = 20.0


class Engines:
    """Two engine processes on fixed ports, so one can be killed and restarted on the same URL."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.model_dir, self.log_dir = model_dir, log_dir
        self.ports = [free_port(), free_port()]
        self.servers: list[EngineServer | None] = [None, None]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]

    def start(self, *which: int) -> None:
        spec = EmbeddedEngine(count=len(which), threads=1, max_batch=16)
        ports = [self.ports[i] for i in which]
        started = start_engines(
            spec, str(self.model_dir), ports=ports, log_dir=self.log_dir, health_timeout_s=90.0
        )
        for i, server in zip(which, started.servers, strict=True):
            self.servers[i] = server

    def kill(self, i: int) -> None:
        server = self.servers[i]
        assert server is not None
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(10.0)
        self.servers[i] = None

    def ensure_up(self) -> None:
        down = [i for i, s in enumerate(self.servers) if s is None or s.process.poll() is not None]
        if down:
            self.start(*down)

    def stop(self) -> None:
        from workers.engines.sglang import EngineSet

        EngineSet(self.urls, [s for s in self.servers if s is not None]).stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_model_dir(tmp_path_factory.mktemp("model"), seed=0)


@pytest.fixture(scope="module")
def engines(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    e = Engines(model_dir, tmp_path_factory.mktemp("engine-logs"))
    e.start(0, 1)
    try:
        yield e
    finally:
        e.stop()


@pytest.fixture
def up(engines: Engines) -> Engines:
    engines.ensure_up()
    return engines


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The engines run one torch thread; so do references here (and tiny ops are faster so)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def learner_model(model_dir: Path, seed: int) -> torch.nn.Module:
    """The initial weights plus noise, each tensor on a fresh 64-byte-aligned allocation as a
    learner's trained weights are (CPU kernels round differently for other alignments)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data + 0.05 * torch.randn(p.shape, generator=g)
    return model


def reference(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities from transformers with a KV cache, one sequence."""
    cache = DynamicCache(config=model.config)
    tokens: list[int] = []
    logprobs: list[float] = []
    with torch.inference_mode():
        out = model(
            input_ids=torch.tensor([prompt]),
            position_ids=torch.arange(len(prompt))[None],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        for k in range(NEW_TOKENS):
            logits = out.logits[0, -1].float()
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(logits.log_softmax(-1)[token]))
            out = model(
                input_ids=torch.tensor([[token]]),
                position_ids=torch.tensor([[len(prompt) + k]]),
                past_key_values=cache,
                use_cache=True,
            )
    return tokens, logprobs


def generate(url: str, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[GenerateOutput]:
    """One request at a time: a lone sequence is what the reference computes (no batch, no padding)."""

    async def go() -> list[GenerateOutput]:
        async with EngineClient(url, timeout_s=60.0) as c:
            return [await c.generate(p, params) for p in prompts]

    return asyncio.run(go())


def assert_serves(url: str, model: torch.nn.Module, version: int) -> None:
    for prompt, out in zip(PROMPTS, generate(url, PROMPTS), strict=True):
        assert (out.output_ids, out.logprobs) == reference(model, prompt), (url, prompt)
        assert out.weight_version == version


def config(**kw: object) -> WeightSyncConfig:
    return WeightSyncConfig(backend="gloo", timeout_s=TIMEOUT_S, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------- updates


@pytest.mark.parametrize(("mode", "layout"), [("in_place", "separate"), ("abort", "flat")])
def test_after_a_push_both_engines_compute_exactly_the_learners_outputs(
    up: Engines, model_dir: Path, mode: str, layout: str
) -> None:
    """Buckets of 1 MB (several calls), spot-checked with /get_weights_by_name. A request running
    during the update is paused in place (it finishes, reporting the new version) or aborted. The
    learner's parameters are separate tensors (sent one broadcast each) or one flat buffer (sent
    as flattened buckets, views of it)."""
    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = learner_model(model_dir, seed=11 if mode == "abort" else 12)
    if layout == "flat":
        weight_buckets.flatten_parameters(dict(model.named_parameters()))
    assert reference(model, PROMPTS[0]) != reference(initial, PROMPTS[0])
    long = SamplingParams(temperature=1.0, max_new_tokens=400, ignore_eos=True)

    version = 7 if mode == "abort" else 8

    async def push_during_a_request(pusher: WeightPusher) -> tuple[int, GenerateOutput, int]:
        async with EngineClient(up.urls[0], timeout_s=60.0) as c:
            before = await c.weight_version()
            running = asyncio.create_task(c.generate(PROMPTS[0], long))
            await asyncio.sleep(0.3)
            times = await asyncio.to_thread(pusher.push, model.named_parameters(), version)
            return before, await running, times.calls

    with WeightPusher(up.urls, config(bucket_mb=1, pause_mode=mode, verify_checksum=True)) as pusher:
        pusher.connect()
        before, out, calls = asyncio.run(push_during_a_request(pusher))
    assert calls > 1 and before != version
    if mode == "abort":  # ended by the pause, under the weights that produced it
        assert out.finish_reason == "abort" and out.weight_version == before
    else:  # went on after the update; SGLang reports the version current at the end
        assert out.finish_reason == "length" and len(out.output_ids) == 400
        assert out.weight_version == version
    for url in up.urls:
        assert_serves(url, model, version)


def test_every_push_sends_full_weights_and_reports_its_phases(up: Engines, model_dir: Path) -> None:
    """Then a raw broadcast (the benchmark's limit) is drained and loads nothing."""
    models = [learner_model(model_dir, seed) for seed in (21, 22)]
    with WeightPusher(up.urls, config(bucket_mb=64)) as pusher:
        for version, model in enumerate(models, start=1):
            times = pusher.push(model.named_parameters(), version)
            assert_serves(up.urls[1], model, version)
        assert pusher.raw_broadcast(1 << 20) > 0
    assert_serves(up.urls[0], models[1], version=2)
    size = sum(p.numel() * p.element_size() for p in models[0].parameters())
    assert (times.bytes, times.engines, times.calls, times.skipped) == (size, 2, 1, ())
    metrics = times.metrics()
    phases = ("pause", "gather", "wire", "load", "resume")
    assert all(metrics[f"sync_{p}_s"] >= 0 for p in phases) and metrics["sync_bytes"] == size
    assert sum(metrics[f"sync_{p}_s"] for p in phases) <= metrics["sync_total_s"]


def test_get_weights_by_name_answers_like_sglang(up: Engines, model_dir: Path) -> None:
    """The first `truncate_size` rows as float32 lists; an unknown name is a 400."""
    model = learner_model(model_dir, seed=51)
    with WeightPusher(up.urls, config()) as pusher:
        pusher.push(model.named_parameters(), 9)
    weight = dict(model.named_parameters())["model.layers.1.mlp.down_proj.weight"]

    async def go() -> tuple[list[object], list[object], str]:
        async with EngineClient(up.urls[0], timeout_s=30.0) as c:
            rows = await c.get_weights_by_name("model.layers.1.mlp.down_proj.weight", 3)
            norm = await c.get_weights_by_name("model.norm.weight")
            try:
                await c.get_weights_by_name("model.no_such_weight")
            except EngineError as e:
                return rows, norm, f"{e.status} {e.detail}"
            return rows, norm, ""

    rows, norm, refused = asyncio.run(go())
    assert torch.equal(torch.tensor(rows), weight[:3].detach())
    assert torch.equal(torch.tensor(norm), dict(model.named_parameters())["model.norm.weight"][:100].detach())
    assert refused.startswith("400") and "failed" in refused


# ---------------------------------------------------------------- faults


def test_an_engine_killed_between_updates_is_skipped_then_caught_up_on_its_restart(
    up: Engines, model_dir: Path
) -> None:
    first, second = learner_model(model_dir, 31), learner_model(model_dir, 32)
    with WeightPusher(up.urls, config(bucket_mb=1)) as pusher:
        pusher.push(first.named_parameters(), 1)
        up.kill(1)
        times = pusher.push(second.named_parameters(), 2)
        assert times.skipped == (up.urls[1],) and times.engines == 1
        assert_serves(up.urls[0], second, version=2)
        up.start(1)  # the launcher's restart: the same URL, version 0, the initial weights
        assert generate(up.urls[1], PROMPTS[:1])[0].weight_version == 0
        times = pusher.push(first.named_parameters(), 3)
        assert (times.engines, times.skipped) == (2, ())
    for url in up.urls:
        assert_serves(url, first, version=3)


def test_an_engine_dying_during_an_update_fails_the_push_quickly_and_the_next_push_recovers(
    up: Engines, model_dir: Path
) -> None:
    model = learner_model(model_dir, 41)
    pulled = 0

    def weights_killing_engine_1() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal pulled
        for i, (name, p) in enumerate(model.named_parameters()):
            if i == 20:  # the engines are paused and earlier buckets are loaded
                up.kill(1)
            pulled += 1
            yield name, p

    with WeightPusher(up.urls, config(bucket_mb=1)) as pusher:
        pusher.connect()
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match="version 5 failed") as failure:
            pusher.push(weights_killing_engine_1(), 5)
        assert time.monotonic() - t0 < TIMEOUT_S
        assert up.urls[1] in str(failure.value)  # the error names the engine that died
        assert pulled == len(list(model.named_parameters()))  # drained: other ranks' collectives
        # the surviving engine was continued: it generates (with a mix of weights, version 4 or less)
        assert generate(up.urls[0], PROMPTS[:1])[0].weight_version != 5
        times = pusher.push(model.named_parameters(), 6)
        assert times.skipped == (up.urls[1],)
    assert_serves(up.urls[0], model, version=6)
