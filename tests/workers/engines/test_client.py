"""The engine client against both servers it must work with: the embedded engine (a real process)
and a scripted SGLang stand-in (tests/_fakes.py). Every test runs against both."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tests._fakes import FakeSGLangServer
from tests.conftest import free_port
from workers.engines.client import EngineClient, EngineError, GenerateOutput, SamplingParams

PROMPT = [5, 17, 42, 8, 99]


@pytest.fixture(params=["embedded", "fake_sglang"])
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "embedded":
        yield request.getfixturevalue("engine_url")
        return
    fake = FakeSGLangServer()
    try:
        yield fake.start()
    finally:
        fake.stop()


def run(coro_fn, url: str, timeout_s: float = 60.0):  # type: ignore[no-untyped-def]
    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient(url, timeout_s=30.0) as client:
            return await asyncio.wait_for(coro_fn(client), timeout_s)

    return asyncio.run(go())


def test_generate_returns_one_logprob_per_token_and_an_integer_weight_version(url: str) -> None:
    async def go(c: EngineClient) -> GenerateOutput:
        return await c.generate(PROMPT, SamplingParams(temperature=1.0, max_new_tokens=12))

    out = run(go, url)
    assert 1 <= len(out.output_ids) <= 12 and len(out.logprobs) == len(out.output_ids)
    assert all(lp <= 0.0 for lp in out.logprobs)
    assert out.finish_reason in ("stop", "length")
    assert out.prompt_tokens == len(PROMPT) and out.weight_version == 0 and out.rid


def test_max_new_tokens_with_ignore_eos_ends_with_length(url: str) -> None:
    async def go(c: EngineClient) -> GenerateOutput:
        return await c.generate(PROMPT, SamplingParams(max_new_tokens=7, ignore_eos=True), rid="len-1")

    out = run(go, url)
    assert (len(out.output_ids), out.finish_reason, out.rid, out.matched_stop) == (7, "length", "len-1", None)


def test_a_stop_token_ends_generation_and_is_kept_as_the_last_token(url: str) -> None:
    async def go(c: EngineClient) -> tuple[GenerateOutput, GenerateOutput]:
        greedy = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
        first = await c.generate(PROMPT, greedy)
        stop_at = first.output_ids[2]
        stops = SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=[stop_at], ignore_eos=True)
        return first, await c.generate(PROMPT, stops)

    first, stopped = run(go, url)
    end = first.output_ids.index(first.output_ids[2]) + 1
    assert stopped.output_ids == first.output_ids[:end] and stopped.logprobs == pytest.approx(
        first.logprobs[:end]
    )
    assert (stopped.finish_reason, stopped.matched_stop) == ("stop", first.output_ids[2])


def test_pause_abort_returns_partial_output_and_holds_new_requests_until_continue(url: str) -> None:
    async def go(c: EngineClient) -> tuple[GenerateOutput, bool, GenerateOutput]:
        long = asyncio.create_task(c.generate(PROMPT, SamplingParams(max_new_tokens=5000, ignore_eos=True)))
        await asyncio.sleep(0.5)
        await c.pause("abort")
        try:
            partial = await asyncio.wait_for(long, 10.0)
            held = asyncio.create_task(c.generate(PROMPT, SamplingParams(max_new_tokens=3, ignore_eos=True)))
            await asyncio.sleep(0.4)
            was_held = not held.done()
        finally:
            await c.continue_generation()
        return partial, was_held, await asyncio.wait_for(held, 10.0)

    partial, was_held, after = run(go, url)
    assert partial.finish_reason == "abort" and 0 < len(partial.output_ids) < 5000
    assert len(partial.logprobs) == len(partial.output_ids)
    assert was_held and (after.finish_reason, len(after.output_ids)) == ("length", 3)


def test_pause_in_place_freezes_a_request_and_continue_finishes_it(url: str) -> None:
    async def go(c: EngineClient) -> tuple[bool, GenerateOutput]:
        task = asyncio.create_task(c.generate(PROMPT, SamplingParams(max_new_tokens=300, ignore_eos=True)))
        await asyncio.sleep(0.2)
        await c.pause("in_place")
        try:
            await asyncio.sleep(0.4)
            frozen = not task.done()
        finally:
            await c.continue_generation()
        return frozen, await asyncio.wait_for(task, 30.0)

    frozen, out = run(go, url)
    assert frozen and (out.finish_reason, len(out.output_ids)) == ("length", 300)


def test_abort_by_rid_ends_only_that_request(url: str) -> None:
    async def go(c: EngineClient) -> tuple[GenerateOutput, bool, GenerateOutput]:
        params = SamplingParams(max_new_tokens=5000, ignore_eos=True)
        a = asyncio.create_task(c.generate(PROMPT, params, rid="victim"))
        b = asyncio.create_task(c.generate(PROMPT, params, rid="bystander"))
        await asyncio.sleep(0.3)
        await c.abort("victim")
        out_a = await asyncio.wait_for(a, 10.0)
        await asyncio.sleep(0.2)
        b_alive = not b.done()
        await c.abort()  # all
        return out_a, b_alive, await asyncio.wait_for(b, 10.0)

    out_a, b_alive, out_b = run(go, url)
    assert (out_a.rid, out_a.finish_reason) == ("victim", "abort") and b_alive
    assert (out_b.rid, out_b.finish_reason) == ("bystander", "abort")


def test_health_model_info_and_flush_cache_when_idle(url: str) -> None:
    async def go(c: EngineClient) -> tuple[bool, dict, int, bool]:
        return await c.health(), await c.model_info(), await c.weight_version(), await c.flush_cache()

    healthy, info, version, flushed = run(go, url)
    assert healthy and flushed and version == 0
    assert info["is_generation"] is True and info["weight_version"] == "0"


def test_a_refused_request_raises_engine_error_with_the_status(url: str) -> None:
    async def go(c: EngineClient) -> None:
        await c.generate(PROMPT, SamplingParams(top_k=0))

    with pytest.raises(EngineError, match=r"/generate: HTTP 400") as e:
        run(go, url)
    assert e.value.status == 400 and e.value.url == url


def test_an_update_for_an_unknown_group_raises_engine_error(url: str) -> None:
    async def go(c: EngineClient) -> None:
        await c.update_weights_from_distributed(["w"], ["float32"], [[2]], group_name="nope")

    with pytest.raises(EngineError, match="/update_weights_from_distributed: .*nope"):
        run(go, url)


def test_a_call_past_its_timeout_raises_engine_error(url: str) -> None:
    async def go(c: EngineClient) -> None:
        try:
            await c.generate(PROMPT, SamplingParams(max_new_tokens=5000, ignore_eos=True), timeout_s=0.3)
        finally:
            await c.abort()  # the fake does not notice a client leaving

    with pytest.raises(EngineError, match=r"/generate: no answer within 0.3 s"):
        run(go, url)


def test_an_unreachable_engine_is_unhealthy_and_calls_raise_naming_url_and_endpoint() -> None:
    dead = f"http://127.0.0.1:{free_port()}"

    async def go(c: EngineClient) -> bool:
        healthy = await c.health(timeout_s=1.0)
        with pytest.raises(EngineError, match=rf"^{dead}/generate: ClientConnectorError"):
            await c.generate(PROMPT, SamplingParams())
        with pytest.raises(EngineError, match=rf"^{dead}/health: not healthy within 0.3 s"):
            await c.wait_healthy(0.3)
        return healthy

    assert run(go, dead) is False


def test_weight_update_requests_carry_sglang_fields() -> None:
    fake = FakeSGLangServer()
    url = fake.start()

    async def go(c: EngineClient) -> None:
        await c.init_weights_update_group("127.0.0.1", 29500, 1, 2, group_name="g", backend="gloo")
        await c.update_weights_from_distributed(
            ["a", "b"],
            ["bfloat16", "float32"],
            [[2, 3], [4]],
            "g",
            load_format="flattened_bucket",
            weight_version="7",
        )

    try:
        run(go, url)
        assert run(lambda c: c.weight_version(), url) == 7
    finally:
        fake.stop()
    (_, init), (_, update) = fake.calls[:2]
    assert init == {
        "master_address": "127.0.0.1",
        "master_port": 29500,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "g",
        "backend": "gloo",
    }
    assert update == {
        "names": ["a", "b"],
        "dtypes": ["bfloat16", "float32"],
        "shapes": [[2, 3], [4]],
        "group_name": "g",
        "load_format": "flattened_bucket",
        "weight_version": "7",
        "flush_cache": True,
        "abort_all_requests": False,
    }


def test_sampling_params_in_sglang_form() -> None:
    assert SamplingParams(temperature=0.7, top_k=20, stop_token_ids=[3]).to_sglang() == {
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": 20,
        "max_new_tokens": 128,
        "stop_token_ids": [3],
    }
    assert SamplingParams(ignore_eos=True).to_sglang()["ignore_eos"] is True
