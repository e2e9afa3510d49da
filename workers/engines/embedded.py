"""The embedded engine: an HTTP server with SGLang's API around a Hugging Face causal LM (CPU first).

    streamrl engine serve --model DIR --host 127.0.0.1 --port P --threads 1 --max-batch 64 --weight-version 0

Endpoints and JSON are SGLang 0.5's (../shared/reference/platform.md), for the subset streamrl uses:
/generate (input_ids or text, sampling_params, return_logprob, rid; one request or a list),
/init_weights_update_group, /update_weights_from_distributed (per tensor or "flattened_bucket"),
/destroy_weights_update_group, /get_weights_by_name, /pause_generation (abort | in_place; retract acts as in_place),
/continue_generation, /abort_request, /flush_cache, /update_weight_version, /get_weight_version,
/health, /health_generate, /model_info, /server_info. Not implemented: streaming, stop strings,
penalties, input log-probs, top log-probs, prefix caching (every request is prefilled in full).

Threads: the aiohttp event loop parses and answers requests; the `Scheduler`'s model thread does all
model work (scheduler.py, with kv.py and sampling.py). Weight loads (weight_loader.py) and pauses run
on the model thread between forward steps, so a step never mixes two weight versions; a bad update
changes nothing (SGLang may leave weights half-updated). `weight_version` is an integer here, sent as
SGLang's string field; an answer carries the version current when the request ended (as SGLang), so
after an in_place pause across an update its earlier tokens came from the previous version.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

import msgspec
import torch
from aiohttp import web

from streamrl.log import configure, get_logger
from workers.engines.sampling import SamplingSpec
from workers.engines.scheduler import Request, Scheduler
from workers.engines.weight_loader import WeightLoader

log = get_logger(__name__)
_JSON = "application/json"


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type=_JSON)


def _error(message: str, status: int = 400) -> web.Response:
    return _json({"error": {"message": message}}, status)


def _result(success: bool, message: str) -> web.Response:
    """The `{success, message}` answer of SGLang's weight endpoints (200 or 400)."""
    return _json({"success": success, "message": message}, 200 if success else 400)


def _resolve(fut: asyncio.Future[Request], req: Request) -> None:
    if not fut.done():  # cancelled when the client went away
        fut.set_result(req)


class EmbeddedEngine:
    def __init__(
        self,
        model_dir: str,
        *,
        max_batch: int = 64,
        weight_version: int = 0,
        seed: int = 0,
        device: str = "cpu",
        dtype: str = "float32",
        max_pause_wait_s: float = 600.0,
        group_timeout_s: float = 600.0,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self.model_dir, self.device = model_dir, torch.device(device)
        self.group_timeout_s = group_timeout_s
        torch_dtype = getattr(torch, dtype) if dtype != "auto" else "auto"
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(self.device).eval()
        self.model.requires_grad_(False)
        params = self.model.state_dict(keep_vars=True)  # HF names -> parameters (tied ones twice)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir) if _has_tokenizer(model_dir) else None
        cfg = self.model.config.get_text_config()
        self.vocab_size = int(cfg.vocab_size)
        self.context_len = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        eos = _ids(cfg.eos_token_id)
        if Path(model_dir, "generation_config.json").exists():
            eos |= _ids(GenerationConfig.from_pretrained(model_dir).eos_token_id)
        if self.tokenizer is not None:
            eos |= _ids(self.tokenizer.eos_token_id)
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else min(eos, default=0)
        self.scheduler = Scheduler(
            self.model,
            eos_ids=frozenset(eos),
            max_batch=max_batch,
            pad_id=int(pad),
            weight_version=weight_version,
            seed=seed,
            max_pause_wait_s=max_pause_wait_s,
        )
        self.weights = WeightLoader(params, self.scheduler, self.device, group_timeout_s)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        post, get = web.post, web.get
        app.add_routes(
            [
                post("/generate", self.generate),
                get("/health", self.health),
                get("/health_generate", self.health),
                get("/model_info", self.model_info),
                get("/get_model_info", self.model_info),
                get("/server_info", self.server_info),
                get("/get_server_info", self.server_info),
                get("/get_weight_version", self.get_weight_version),
                post("/update_weight_version", self.update_weight_version),
                post("/pause_generation", self.pause_generation),
                post("/continue_generation", self.continue_generation),
                post("/abort_request", self.abort_request),
                get("/flush_cache", self.flush_cache),
                post("/flush_cache", self.flush_cache),
                post("/init_weights_update_group", self.init_weights_update_group),
                post("/destroy_weights_update_group", self.destroy_weights_update_group),
                post("/update_weights_from_distributed", self.update_weights_from_distributed),
                get("/get_weights_by_name", self.get_weights_by_name),
                post("/get_weights_by_name", self.get_weights_by_name),
            ]
        )
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self.scheduler.start()
        # warm up: the first forward pays one-off allocation costs that would land on a caller
        warmed: Future[Request] = Future()
        spec = SamplingSpec(temperature=1.0, max_new_tokens=2, ignore_eos=True)
        self.scheduler.submit(Request([0, 1, 2], spec, warmed.set_result, rid="warmup"))
        await asyncio.wrap_future(warmed)

    async def _on_cleanup(self, app: web.Application) -> None:
        await asyncio.to_thread(self.scheduler.stop)
        self.weights.close()

    # ------------------------------------------------------------ generation

    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = msgspec.json.decode(await request.read())
            reqs, batched = self._parse_generate(body)
        except (msgspec.DecodeError, ValueError, TypeError, KeyError) as e:
            return _error(str(e))
        loop = asyncio.get_running_loop()
        futs = []
        for req in reqs:
            fut: asyncio.Future[Request] = loop.create_future()
            req.on_done = lambda r, f=fut: loop.call_soon_threadsafe(_resolve, f, r)
            futs.append(fut)
        try:
            self.scheduler.submit(*reqs)
        except ValueError as e:  # a request id already in use: nothing was queued
            return _error(str(e))
        try:
            done = await asyncio.gather(*futs)
        except asyncio.CancelledError:  # the client hung up: free its rows
            for req in reqs:
                self.scheduler.abort(req.rid, "client disconnected")
            raise
        logprob = bool(body.get("return_logprob"))
        out = [self._answer(r, logprob) for r in done]
        return _json(out if batched else out[0])

    def _parse_generate(self, body: Any) -> tuple[list[Request], bool]:
        if not isinstance(body, dict):
            raise ValueError("expected a JSON object")
        if body.get("stream"):
            raise ValueError("stream is not supported by the embedded engine")
        ids = body.get("input_ids")
        if ids is None:
            text = body.get("text")
            if text is None or self.tokenizer is None:
                raise ValueError("give input_ids (or text, when the model folder has a tokenizer)")
            batched = isinstance(text, list)
            prompts = [self.tokenizer.encode(t) for t in (text if batched else [text])]
        else:
            batched = bool(ids) and isinstance(ids[0], list)
            prompts = ids if batched else [ids]
        n = len(prompts)
        params = body.get("sampling_params")
        params_list = params if isinstance(params, list) else [params] * n
        rids = body.get("rid")
        rid_list = rids if isinstance(rids, list) else [rids] * n if n == 1 else [None] * n
        if len(params_list) != n or len(rid_list) != n:
            raise ValueError("sampling_params and rid lists must match the number of prompts")
        reqs = []
        for prompt, p, rid in zip(prompts, params_list, rid_list, strict=True):
            if not prompt or not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt):
                raise ValueError(f"input_ids must be a non-empty list of token ids in [0, {self.vocab_size})")
            if len(prompt) >= self.context_len:
                raise ValueError(
                    f"prompt of {len(prompt)} tokens exceeds the context length {self.context_len}"
                )
            spec = SamplingSpec.from_sglang(p)
            room = self.context_len - len(prompt)
            if spec.max_new_tokens > room:  # SGLang also clips to the context
                spec = replace(spec, max_new_tokens=room)
            req = Request(list(prompt), spec, lambda r: None)
            if rid is not None:
                req.rid = str(rid)
            reqs.append(req)
        return reqs, batched

    def _answer(self, req: Request, logprob: bool) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            "weight_version": str(req.weight_version),
            "e2e_latency": req.finished - req.arrived,
        }
        if logprob:
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(req.logprobs, req.output_ids, strict=True)
            ]
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True) if self.tokenizer else ""
        return {"text": text, "output_ids": req.output_ids, "meta_info": meta}

    # ------------------------------------------------------------ control

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        cfg = self.model.config
        return _json(
            {
                "model_path": self.model_dir,
                "tokenizer_path": self.model_dir if self.tokenizer is not None else None,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": str(self.scheduler.weight_version),
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": cfg.model_type,
                "architectures": cfg.architectures,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        s = self.scheduler
        return _json(
            {
                "engine": "streamrl-embedded",
                "model_path": self.model_dir,
                "max_running_requests": s.max_batch,
                "context_length": self.context_len,
                "threads": torch.get_num_threads(),
                "weight_version": str(s.weight_version),
                "internal_states": [s.stats()],
            }
        )

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return _json({"weight_version": str(self.scheduler.weight_version)})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _body(request)
        try:
            version = int(body["new_version"])
        except (KeyError, TypeError, ValueError):
            return _result(False, f"new_version must be an integer string, got {body.get('new_version')!r}")
        abort = bool(body.get("abort_all_requests", True))

        def go() -> None:
            if abort:
                self.scheduler.abort(None, "Aborted by update_weight_version")
                self.scheduler.reap_aborts()  # they end reporting the version that produced them
            self.scheduler.weight_version = version

        await asyncio.wrap_future(self.scheduler.call(go))
        return _result(True, "Weight version updated.")

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = (await _body(request)).get("mode") or "abort"
        if mode not in ("abort", "in_place", "retract"):
            return _error(f"mode must be abort, in_place or retract, got {mode!r}")
        await asyncio.wrap_future(self.scheduler.pause(mode))
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await asyncio.wrap_future(self.scheduler.resume())
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _body(request)
        if body.get("abort_all"):
            self.scheduler.abort(None)
        elif body.get("rid"):
            self.scheduler.abort(str(body["rid"]))
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        stats = self.scheduler.stats()  # no prefix cache to flush; refuse like SGLang while busy
        if stats["running"] or stats["waiting"]:
            return web.Response(
                status=400, text="Cache not flushed: there are running or waiting requests.\n"
            )
        return web.Response(status=200, text="Cache flushed.\n")

    # ------------------------------------------------------------ weight updates (weight_loader.py)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        return _result(*await self.weights.init_group(await _body(request)))

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        return _result(*await self.weights.destroy_group(await _body(request)))

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        return _result(*await self.weights.update(await _body(request)))

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang's answer: the parameter's first `truncate_size` rows as a float32 JSON list."""
        body = await _body(request)
        try:
            rows = await self.weights.get_weights(body)
        except (TypeError, ValueError) as e:
            return _error(f"bad request: {e}")
        if rows is None:
            return _error("Get parameter by name failed")
        return _json(rows)


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw:
        return {}
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise web.HTTPBadRequest(text=f"invalid JSON: {e}") from None
    if not isinstance(value, dict):
        raise web.HTTPBadRequest(text="expected a JSON object")
    return value


def _ids(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(v) for v in value}


def _has_tokenizer(model_dir: str) -> bool:
    return any(Path(model_dir, f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="streamrl engine serve", description="SGLang-API server around an HF model"
    )
    p.add_argument("--model", required=True, help="Hugging Face model folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for tiny models)")
    p.add_argument("--max-batch", type=int, default=64, help="most requests decoded together")
    p.add_argument("--weight-version", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
    p.add_argument("--max-pause-wait-s", type=float, default=600.0, help="longest a request waits in a pause")
    p.add_argument("--group-timeout-s", type=float, default=600.0, help="weight-update group timeout")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> NoReturn:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    configure(role="engine", level=args.log_level)
    torch.set_num_threads(args.threads)
    engine = EmbeddedEngine(
        args.model,
        max_batch=args.max_batch,
        weight_version=args.weight_version,
        seed=args.seed,
        device=args.device,
        dtype=args.dtype,
        max_pause_wait_s=args.max_pause_wait_s,
        group_timeout_s=args.group_timeout_s,
    )
    log.info("engine_serving", url=f"http://{args.host}:{args.port}", model=args.model, pid=os.getpid())
    web.run_app(
        engine.app(),
        host=args.host,
        port=args.port,
        print=None,
        access_log=None,
        handler_cancellation=True,
        shutdown_timeout=0.5,  # in-flight requests get this long to finish on SIGTERM
    )
    # Everything of ours is closed by now; skip interpreter finalisation, which takes ~1 s of module
    # teardown once torch and transformers are loaded and would only delay whoever stops us.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
