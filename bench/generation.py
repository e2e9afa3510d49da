"""Embedded-engine generation: throughput against raw transformers `generate`, and per-turn overhead.

    python -m bench.generation [--quick] [--batch 64] [--new-tokens 128] [--repeats 5]

1. Throughput. The same random tiny Qwen2 (streamrl.tiny.random_model_dir: hidden 128, 4 layers),
   the same B prompts of P tokens, N new tokens each (EOS ignored, so every row makes exactly N), one
   torch thread per process (platform.md: fastest for tiny models):
   - limit: `model.generate(ids, do_sample=True, max_new_tokens=N, min_new_tokens=N)` in this process,
     B*N / wall; also shown with `output_scores=True` (the per-token scores RL needs; the engine
     always computes log-probs), but the stricter plain call is the limit;
   - value: B concurrent `EngineClient.generate` calls (each its own /generate request, as agent loops
     make them) to an embedded engine subprocess, B*N / wall from the first send to the last answer.
   Each path warms up once; the timed runs of the three paths are interleaved (the load of a shared
   machine drifts) and the median of `--repeats` runs of each is reported.
2. Per-turn overhead. Sequential one-token calls: the client round trip minus the engine's own time
   for the request (meta_info.e2e_latency, from arrival at its scheduler to the answer) is what HTTP,
   JSON and the client add per turn; compared with the engine's decode step at batch B. If
   streamrl.agent is importable, a `run_math` turn with a one-token budget is timed too (template,
   tokenizer and result bookkeeping on top of the client call).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import emit, print_table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, under 30 s")
    p.add_argument("--batch", type=int, default=None, help="concurrent sequences B (default 64; quick 32)")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=None, help="N (default 128; quick 64)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per path (default 9; quick 5)")
    p.add_argument(
        "--turns", type=int, default=None, help="sequential calls for the overhead (default 100; quick 30)"
    )
    args = p.parse_args(argv)
    args.batch = args.batch or (32 if args.quick else 64)
    args.new_tokens = args.new_tokens or (64 if args.quick else 128)
    args.repeats = args.repeats or (5 if args.quick else 9)
    args.turns = args.turns or (30 if args.quick else 100)
    return args


def hf_generate(model: Any, ids: torch.Tensor, new: int, scores: bool) -> float:
    """Seconds for one `generate` call over the whole batch."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=None,
            top_p=None,
            max_new_tokens=new,
            min_new_tokens=new,
            output_scores=scores,
            return_dict_in_generate=scores,
        )
    return time.perf_counter() - t0


async def throughput(
    url: str, model: Any, ids: torch.Tensor, new: int, repeats: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds per batch for each path, runs interleaved (the machine's load drifts), and the
    engine's own counters over its timed runs."""
    from workers.engines.client import EngineClient, SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True)
    prompts = ids.tolist()
    async with EngineClient(url) as client:

        async def engine_once() -> float:
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(client.generate(p, params) for p in prompts))
            elapsed = time.perf_counter() - t0
            assert all(len(o.output_ids) == new for o in outs)
            return elapsed

        paths = {
            "hf": lambda: asyncio.sleep(0, hf_generate(model, ids, new, scores=False)),
            "hf_scores": lambda: asyncio.sleep(0, hf_generate(model, ids, new, scores=True)),
            "engine": engine_once,
        }
        for run in paths.values():  # warm-up
            await run()
        before = (await client.server_info())["internal_states"][0]
        times: dict[str, list[float]] = {k: [] for k in paths}
        for r in range(repeats):
            for name in list(paths)[r % 3 :] + list(paths)[: r % 3]:
                times[name].append(await paths[name]())
        after = (await client.server_info())["internal_states"][0]
    steps = after["decode_steps"] - before["decode_steps"]
    counters = {
        "decode_steps_per_run": steps / repeats,
        "prefills_per_run": (after["prefill_steps"] - before["prefill_steps"]) / repeats,
        "step_s": (after["decode_seconds"] - before["decode_seconds"]) / max(1, steps),
    }
    return {k: statistics.median(v) for k, v in times.items()}, counters


async def time_turns(url: str, model_dir: Path, prompt: list[int], turns: int) -> dict[str, float]:
    """Per-call medians: client round trip, the engine's own time, their difference, and (with
    streamrl.agent) an agent turn minus a bare client call for the same prompt, paired call by call."""
    from workers.engines.client import EngineClient, SamplingParams

    one = SamplingParams(temperature=1.0, max_new_tokens=1, ignore_eos=True)
    out: dict[str, float] = {}
    async with EngineClient(url) as client:
        await client.generate(prompt, one)
        rtt, server = [], []
        for _ in range(turns):
            t0 = time.perf_counter()
            res = await client.generate(prompt, one)
            rtt.append(time.perf_counter() - t0)
            server.append(res.e2e_latency_s or 0.0)
        out["round_trip_s"], out["engine_s"] = statistics.median(rtt), statistics.median(server)
        out["overhead_s"] = statistics.median(r - s for r, s in zip(rtt, server, strict=True))
        try:
            from streamrl import agent, templates
            from streamrl.config import RolloutConfig
            from streamrl.messages import Prompt
        except ImportError:
            return out
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        item = Prompt(uid=0, prompt_id="p0", answer="3", text="What is 1+2?", admitted_version=0, n_samples=1)
        cfg = RolloutConfig(max_new_tokens=1)
        ids = tokenizer.encode(templates.math_prompt(None, item.text), add_special_tokens=False)
        direct = SamplingParams(max_new_tokens=1, stop_token_ids=list(agent.as_codec(tokenizer).stop_ids))
        await agent.run_math(item, client, tokenizer, cfg)
        agent_t, diffs = [], []
        for _ in range(turns):
            t0 = time.perf_counter()
            await agent.run_math(item, client, tokenizer, cfg)
            t1 = time.perf_counter()
            await client.generate(ids, direct)
            t2 = time.perf_counter()
            agent_t.append(t1 - t0)
            diffs.append((t1 - t0) - (t2 - t1))
        out["agent_turn_s"], out["agent_overhead_s"] = statistics.median(agent_t), statistics.median(diffs)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from streamrl.config import EmbeddedEngine
    from streamrl.tiny import random_model_dir
    from workers.engines.sglang import start_engines

    b, n = args.batch, args.new_tokens
    with tempfile.TemporaryDirectory(prefix="bench-generation-") as tmp:
        model_dir = random_model_dir(Path(tmp) / "model", seed=0)
        engines = start_engines(
            EmbeddedEngine(threads=1, max_batch=max(64, b)),
            str(model_dir),
            log_dir=Path(tmp),
            health_timeout_s=120,
        )
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            vocab = model.config.vocab_size
            ids = torch.randint(
                0, vocab - 8, (b, args.prompt_tokens), generator=torch.Generator().manual_seed(0)
            )
            url = engines.urls[0]
            medians, counters = asyncio.run(throughput(url, model, ids, n, args.repeats))
            turns = asyncio.run(time_turns(url, model_dir, ids[0].tolist(), args.turns))
        finally:
            engines.stop()

    tokens = b * n
    hf_s, hf_scores_s, engine_s = medians["hf"], medians["hf_scores"], medians["engine"]
    rows = [
        ["transformers generate", b, n, tokens / hf_s, hf_s / n * 1e3],
        ["transformers generate + scores", b, n, tokens / hf_scores_s, hf_scores_s / n * 1e3],
        ["embedded engine, concurrent /generate", b, n, tokens / engine_s, engine_s / n * 1e3],
    ]
    print_table(["path", "batch", "new tokens", "tokens/s", "ms/token step"], rows, "Generation throughput")
    us = 1e6
    turn_rows = [
        ["client round trip (1 new token)", turns["round_trip_s"] * us],
        ["engine's own time for it (e2e_latency)", turns["engine_s"] * us],
        ["client + HTTP + JSON overhead", turns["overhead_s"] * us],
        [f"engine decode step at batch {b}", counters["step_s"] * us],
    ]
    if "agent_turn_s" in turns:
        turn_rows += [
            ["agent run_math turn (1 new token)", turns["agent_turn_s"] * us],
            ["agent loop over a bare client call", turns["agent_overhead_s"] * us],
        ]
    print()
    print_table(["per turn", "median us"], turn_rows, "Per-turn overhead")
    emit(
        "generation",
        "embedded_engine_tokens_per_s",
        tokens / engine_s,
        "transformers_generate_tokens_per_s",
        tokens / hf_s,
        vars(args),
        transformers_generate_with_scores_tokens_per_s=tokens / hf_scores_s,
        overhead_us_per_turn=turns["overhead_s"] * us,
        engine_step_us=counters["step_s"] * us,
        overhead_per_step=turns["overhead_s"] / counters["step_s"],
        agent_overhead_us_per_turn=turns["agent_overhead_s"] * us if "agent_overhead_s" in turns else None,
        engine_prefills_per_run=counters["prefills_per_run"],
        engine_decode_steps_per_run=counters["decode_steps_per_run"],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
