"""The embedded engine as a real process: SGLang's JSON field by field, batching, log-probs of the
sampled distribution, greedy determinism, pause/continue, and weight updates sent by another process."""

from __future__ import annotations

import asyncio
import math
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM

from streamrl.tiny import random_model_dir
from tests.conftest import free_port, stop_process
from tests.workers.engines.conftest import REPO_ROOT, server_info
from workers.engines.client import EngineClient, EngineError, GenerateOutput, SamplingParams
from workers.engines.sglang import EngineSet

PROMPTS = [[5, 17, 42], [8, 99, 100, 101, 7, 3, 60, 61, 9], [200, 4], [11, 12, 13, 14, 15, 16]]


def post(url: str, endpoint: str, body: Any) -> tuple[int, Any]:
    async def go() -> tuple[int, Any]:
        async with aiohttp.ClientSession() as s, s.post(url + endpoint, json=body, timeout=30) as r:
            return r.status, await (r.json() if r.content_type == "application/json" else r.text())

    return asyncio.run(go())


def generate_all(url: str, prompts: list[list[int]], params: list[SamplingParams]) -> list[GenerateOutput]:
    """Concurrent /generate calls, one per prompt (as concurrent agent loops make them)."""

    async def go() -> list[GenerateOutput]:
        async with EngineClient(url, timeout_s=60.0) as c:
            return list(
                await asyncio.gather(*(c.generate(p, s) for p, s in zip(prompts, params, strict=True)))
            )

    return asyncio.run(go())


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Iterator[torch.nn.Module]:
    """The engine's model in this process, for references. One torch thread while it is in use:
    tiny ops on a busy 2-core machine are many times slower with two spinning OpenMP threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    finally:
        torch.set_num_threads(threads)


def greedy_reference(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens by full recomputation at every step (no KV cache, no padding)."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def processed_logprob(
    logits: torch.Tensor, token: int, temperature: float, top_k: int, top_p: float
) -> float:
    """Log-probability of `token` under temperature, then top-k, then top-p (renormalised), in float64."""
    z = logits.double()
    if temperature < 1e-6:
        return float(z.log_softmax(-1)[token])
    z = z / temperature
    if top_k > 0:
        z[z < z.sort(descending=True).values[top_k - 1]] = -math.inf
    if top_p < 1.0:
        probs, mass = z.softmax(-1), 0.0
        for i in z.argsort(descending=True).tolist():
            if mass > top_p:
                z[i] = -math.inf
            mass += float(probs[i])
    return float(z.log_softmax(-1)[token])


# ---------------------------------------------------------------- SGLang's JSON, field by field


def test_generate_answer_has_sglang_fields_and_types(engine_url: str) -> None:
    body = {
        "input_ids": PROMPTS[0],
        "sampling_params": {"temperature": 0.9, "max_new_tokens": 4, "ignore_eos": True},
        "return_logprob": True,
        "rid": "shape-1",
    }
    status, ans = post(engine_url, "/generate", body)
    assert status == 200 and set(ans) == {"text", "output_ids", "meta_info"}
    assert isinstance(ans["text"], str) and len(ans["output_ids"]) == 4
    meta = ans["meta_info"]
    assert {
        "id",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "weight_version",
        "output_token_logprobs",
    } <= set(meta)
    assert meta["id"] == "shape-1" and meta["finish_reason"] == {"type": "length", "length": 4}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["weight_version"]) == (3, 4, "0")
    for (lp, tok, text), out_tok in zip(meta["output_token_logprobs"], ans["output_ids"], strict=True):
        assert isinstance(lp, float) and lp <= 0 and tok == out_tok and text is None


def test_a_list_of_prompts_gets_a_list_of_answers_and_logprobs_only_on_request(engine_url: str) -> None:
    body = {"input_ids": PROMPTS[:2], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    status, ans = post(engine_url, "/generate", body)
    assert status == 200 and isinstance(ans, list) and len(ans) == 2
    assert all(len(a["output_ids"]) == 2 and "output_token_logprobs" not in a["meta_info"] for a in ans)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"sampling_params": {}}, "give input_ids"),
        ({"input_ids": [1, 2], "stream": True}, "stream is not supported"),
        ({"input_ids": [1, 10**6]}, "token ids in"),
        ({"input_ids": [1] * 5000}, "exceeds the context length"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, "not supported"),
    ],
)
def test_bad_generate_requests_answer_400_with_an_error_message(
    engine_url: str, body: dict, message: str
) -> None:
    status, ans = post(engine_url, "/generate", body)
    assert status == 400 and message in ans["error"]["message"]


def test_control_endpoints_answer_like_sglang(engine_url: str) -> None:
    assert post(engine_url, "/pause_generation", {"mode": "in_place"}) == (
        200,
        {"message": "Generation paused successfully.", "status": "ok"},
    )
    assert post(engine_url, "/continue_generation", {}) == (
        200,
        {"message": "Generation continued successfully.", "status": "ok"},
    )
    status, ans = post(
        engine_url,
        "/update_weights_from_distributed",
        {"names": [], "dtypes": [], "shapes": [], "group_name": "x"},
    )
    assert status == 400 and ans["success"] is False and "not initialized" in ans["message"]
    status, ans = post(
        engine_url,
        "/init_weights_update_group",
        {
            "master_address": "127.0.0.1",
            "master_port": 1,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "g",
            "backend": "nccl",
        },
    )
    assert status == 400 and ans["success"] is False and "gloo" in ans["message"]
    assert post(engine_url, "/abort_request", {"rid": "nobody", "abort_all": False})[0] == 200
    assert post(engine_url, "/flush_cache", {})[0] == 200


# ---------------------------------------------------------------- scheduling and sampling


def test_concurrent_requests_are_decoded_together(engine_url: str) -> None:
    before = server_info(engine_url)
    n, new = 8, 24
    outs = generate_all(
        engine_url,
        [PROMPTS[i % 4] for i in range(n)],
        [SamplingParams(max_new_tokens=new, ignore_eos=True)] * n,
    )
    after = server_info(engine_url)
    assert all(len(o.output_ids) == new for o in outs)
    steps = after["decode_steps"] - before["decode_steps"]
    assert steps < n * new / 2, f"{steps} decode steps for {n} concurrent requests of {new} tokens"
    assert after["max_batch_seen"] >= 2


def test_a_batched_call_is_one_prefill_and_one_decode_per_token(engine_url: str) -> None:
    before = server_info(engine_url)
    body = {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 10, "ignore_eos": True}}
    assert post(engine_url, "/generate", body)[0] == 200
    after = server_info(engine_url)
    assert after["prefill_steps"] - before["prefill_steps"] == 1
    assert after["decode_steps"] - before["decode_steps"] == 9  # the prefill samples the first token


def test_logprobs_are_those_of_the_processed_distribution_the_token_was_drawn_from(
    engine_url: str, hf_model: torch.nn.Module
) -> None:
    settings = [(0.8, 20, 0.9), (1.3, -1, 1.0), (0.0, -1, 1.0), (0.6, 5, 1.0), (1.0, -1, 0.5)]
    prompts = [PROMPTS[i % 4] for i in range(len(settings))]
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=12, ignore_eos=True)
        for t, k, p in settings
    ]
    outs = generate_all(engine_url, prompts, params)
    with torch.inference_mode():
        for prompt, (t, k, p), out in zip(prompts, settings, outs, strict=True):
            logits = hf_model(torch.tensor([prompt + out.output_ids])).logits[0, len(prompt) - 1 : -1]
            expected = [processed_logprob(logits[i], tok, t, k, p) for i, tok in enumerate(out.output_ids)]
            assert all(math.isfinite(e) for e in expected), "a token outside top-k/top-p was sampled"
            assert out.logprobs == pytest.approx(expected, abs=2e-4), (t, k, p)


def test_greedy_is_deterministic_and_equals_full_recomputation(
    engine_url: str, hf_model: torch.nn.Module
) -> None:
    """Mixed prompt lengths (left padding) and budgets (rows leave the batch at different steps)."""
    budgets = [4 + i for i in range(8)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in budgets]
    together = generate_all(engine_url, PROMPTS + PROMPTS, params)
    alone = generate_all(engine_url, PROMPTS[1:2], params[-1:])
    refs = [greedy_reference(hf_model, p, max(budgets)) for p in PROMPTS]
    for i, (out, n) in enumerate(zip(together, budgets, strict=True)):
        assert out.output_ids == refs[i % 4][:n], i
    assert alone[0].output_ids == refs[1][: budgets[-1]]


def test_in_place_pause_stops_stepping_until_continued(engine_url: str) -> None:
    async def go(c: EngineClient) -> tuple[int, int, GenerateOutput]:
        task = asyncio.create_task(
            c.generate(PROMPTS[0], SamplingParams(max_new_tokens=200, ignore_eos=True))
        )
        await asyncio.sleep(0.2)
        await c.pause("in_place")
        try:
            first = (await c.server_info())["internal_states"][0]["tokens_generated"]
            await asyncio.sleep(0.3)
            second = (await c.server_info())["internal_states"][0]["tokens_generated"]
        finally:
            await c.continue_generation()
        return first, second, await task

    async def main() -> tuple[int, int, GenerateOutput]:
        async with EngineClient(engine_url, timeout_s=30.0) as c:
            return await go(c)

    first, second, out = asyncio.run(main())
    assert first == second and (out.finish_reason, len(out.output_ids)) == ("length", 200)


def test_a_client_that_gives_up_frees_its_request(engine_url: str) -> None:
    async def go() -> None:
        async with EngineClient(engine_url) as c:
            with pytest.raises(EngineError, match="no answer within"):
                await c.generate(
                    PROMPTS[0], SamplingParams(max_new_tokens=5000, ignore_eos=True), timeout_s=0.3
                )

    asyncio.run(go())
    for _ in range(100):
        if server_info(engine_url)["running"] == 0:
            return
        asyncio.run(asyncio.sleep(0.05))
    pytest.fail("the abandoned request is still running")


def test_the_engine_stops_at_the_tokenizer_eos(model_dir: Path) -> None:
    from workers.engines.embedded import EmbeddedEngine

    engine = EmbeddedEngine(str(model_dir))
    assert engine.tokenizer is not None
    assert engine.tokenizer.convert_tokens_to_ids("<|im_end|>") in engine.scheduler.eos_ids


def test_an_eos_token_ends_with_stop_unless_ignore_eos(hf_model: torch.nn.Module) -> None:
    from concurrent.futures import Future

    from workers.engines.sampling import SamplingSpec
    from workers.engines.scheduler import Request, Scheduler

    first = greedy_reference(hf_model, PROMPTS[0], 1)[0]
    scheduler = Scheduler(hf_model, eos_ids=frozenset({first}))
    scheduler.start()
    try:
        done: list[Future[Request]] = [Future(), Future()]
        for fut, ignore in zip(done, (False, True), strict=True):
            spec = SamplingSpec(temperature=0.0, max_new_tokens=3, ignore_eos=ignore)
            scheduler.submit(Request(PROMPTS[0], spec, fut.set_result))
        stopped, ignored = (f.result(timeout=30) for f in done)
    finally:
        scheduler.stop()
    assert (stopped.output_ids, stopped.finish) == ([first], {"type": "stop", "matched": first})
    assert len(ignored.output_ids) == 3 and ignored.finish == {"type": "length", "length": 3}


def test_requests_waiting_through_a_long_pause_end_as_aborted(hf_model: torch.nn.Module) -> None:
    from concurrent.futures import Future

    from workers.engines.sampling import SamplingSpec
    from workers.engines.scheduler import Request, Scheduler

    scheduler = Scheduler(hf_model, eos_ids=frozenset(), max_pause_wait_s=0.2)
    scheduler.start()
    try:
        scheduler.pause("in_place").result(timeout=10)
        done: Future[Request] = Future()
        scheduler.submit(Request(PROMPTS[0], SamplingSpec(max_new_tokens=3), done.set_result))
        req = done.result(timeout=10)
    finally:
        scheduler.stop()
    assert req.output_ids == [] and req.finish is not None and req.finish["type"] == "abort"
    assert "paused for more than 0.2 s" in req.finish["message"]


# ---------------------------------------------------------------- weight updates from another process


def read_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"no answer from the sender within {timeout_s} s"
    assert proc.stdout is not None
    return proc.stdout.readline()


def test_weight_updates_from_another_process_switch_outputs_to_the_new_weights(
    sglang_engine: tuple[EngineSet, Path], tmp_path: Path
) -> None:
    """Per tensor (version 1), then flattened buckets of 64 KB (version 2), then an update naming a
    tensor the model lacks (refused, nothing changes), all from one sender process."""
    url = sglang_engine[0].urls[0]
    dirs = [random_model_dir(tmp_path / f"w{seed}", seed=seed) for seed in (1, 2)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    before = [o.output_ids for o in generate_all(url, PROMPTS, [greedy] * 4)]
    cmd = [
        sys.executable,
        "-m",
        "tests.workers.engines._weight_sender",
        "--url",
        url,
        "--group",
        "test-group",
    ]
    cmd += ["--master-port", str(free_port()), "--bucket-bytes", str(64 << 10)]
    cmd += ["--step", f"{dirs[0]}:per_tensor:1", "--step", f"{dirs[1]}:flattened_bucket:2"]
    cmd += ["--step", f"{dirs[0]}:flattened_bucket:3:bad"]
    with subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT
    ) as sender:
        assert sender.stdin is not None and sender.stderr is not None
        try:
            for step, (expect, weights, version) in enumerate(
                [("updated 1", dirs[0], 1), ("updated 2", dirs[1], 2), ("refused 3", dirs[1], 2)]
            ):
                if step:
                    sender.stdin.write("next\n")
                    sender.stdin.flush()
                line = read_line(sender, 90.0)
                assert line.startswith(expect), line + sender.stderr.read()
                model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32).eval()
                after = generate_all(url, PROMPTS, [greedy] * 4)
                assert (
                    [o.output_ids for o in after]
                    == [greedy_reference(model, p, 8) for p in PROMPTS]
                    != before
                )
                assert {o.weight_version for o in after} == {version} and server_info(url)[
                    "weight_version"
                ] == version
            assert "model.not_a_weight" in line
            assert sender.wait(60.0) == 0, sender.stderr.read()
        finally:
            stop_process(sender)  # type: ignore[arg-type]
