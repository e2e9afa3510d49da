"""Fakes for what crosses a process or service boundary, and why each one exists.

* `FakeSGLangServer`: a real aiohttp server on 127.0.0.1 that answers SGLang's HTTP API with
  SGLang's JSON shapes and scripted content. It exists because SGLang cannot be installed or run on
  the CPU machines CI uses (../shared/reference/platform.md), yet the engine client must be shown to
  work against SGLang's answers, not only against streamrl's own embedded engine. Scripted behaviour:
  - /generate: the token after a prefix is `(31 * sum(prefix) + len(prefix)) % vocab`, one every
    `token_delay_s`; the k-th token of an answer has log-prob -0.01 * (k + 1); stop_token_ids,
    ignore_eos and max_new_tokens behave as in SGLang, including finish_reason objects; sampling
    parameters are validated like SGLang (top_k 0 is refused with 400);
  - /pause_generation abort | in_place, /continue_generation, /abort_request: like SGLang, aborted
    requests answer 200 with what they have and finish_reason {"type": "abort"}; requests that
    arrive while paused wait for /continue_generation;
  - /init_weights_update_group and /update_weights_from_distributed check the request body and
    answer {success, message}, bumping weight_version; they do NOT join a process group or receive
    tensors (the embedded engine's tests cover the real broadcast);
  - /health, /model_info, /server_info, /flush_cache.
  Every request body is recorded in `calls` as (endpoint, body).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from aiohttp import web


class _Gen:
    def __init__(self, rid: str, ids: list[int], params: dict[str, Any]) -> None:
        self.rid, self.ids, self.params = rid, ids, params
        self.aborted = False


class FakeSGLangServer:
    def __init__(self, vocab: int = 300, eos_id: int = 299, token_delay_s: float = 0.002) -> None:
        self.vocab, self.eos_id, self.token_delay_s = vocab, eos_id, token_delay_s
        self.weight_version = "0"
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.groups: set[str] = set()
        self._running: dict[str, _Gen] = {}
        self._counter = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""

    # ------------------------------------------------------------ lifecycle (server runs in a thread)

    def start(self) -> str:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self._serve())
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup() if self._runner else asyncio.sleep(0))
            self._loop.close()

        self._thread = threading.Thread(target=run, name="fake-sglang", daemon=True)
        self._thread.start()
        if not ready.wait(10.0):
            raise RuntimeError("fake SGLang server did not start")
        return self.url

    async def _serve(self) -> None:
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        app = web.Application()
        app.add_routes(
            [web.post("/generate", self._generate), web.get("/health", self._health)]
            + [web.get("/model_info", self._model_info), web.get("/server_info", self._server_info)]
            + [web.post("/pause_generation", self._pause), web.post("/continue_generation", self._continue)]
            + [web.post("/abort_request", self._abort), web.post("/flush_cache", self._flush)]
            + [web.post("/init_weights_update_group", self._init_group)]
            + [web.post("/update_weights_from_distributed", self._update)]
            + [web.post("/destroy_weights_update_group", self._destroy_group)]
        )
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10.0)

    # ------------------------------------------------------------ endpoints

    async def _body(self, request: web.Request, endpoint: str) -> dict[str, Any]:
        body = await request.json() if request.can_read_body else {}
        self.calls.append((endpoint, body))
        return body

    async def _generate(self, request: web.Request) -> web.Response:
        body = await self._body(request, "/generate")
        p = body.get("sampling_params") or {}
        if p.get("top_k", -1) == 0 or not 0 < p.get("top_p", 1.0) <= 1 or p.get("temperature", 1.0) < 0:
            return web.json_response({"error": {"message": f"bad sampling_params {p}"}}, status=400)
        await self._unpaused.wait()
        self._counter += 1
        gen = _Gen(str(body.get("rid") or f"fake-{self._counter}"), list(body["input_ids"]), p)
        self._running[gen.rid] = gen
        try:
            out, finish = await self._decode(gen)
        finally:
            self._running.pop(gen.rid, None)
        meta: dict[str, Any] = {
            "id": gen.rid,
            "finish_reason": finish,
            "prompt_tokens": len(gen.ids),
            "completion_tokens": len(out),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-0.01 * (k + 1), t, None] for k, t in enumerate(out)]
        return web.json_response({"text": "", "output_ids": out, "meta_info": meta})

    async def _decode(self, gen: _Gen) -> tuple[list[int], dict[str, Any]]:
        p = gen.params
        stops = set(p.get("stop_token_ids") or []) | (set() if p.get("ignore_eos") else {self.eos_id})
        limit = int(p.get("max_new_tokens", 128))
        out: list[int] = []
        while True:
            if len(out) >= limit:
                return out, {"type": "length", "length": limit}
            await self._unpaused.wait()  # in_place pause: frozen, not aborted
            if gen.aborted:
                return out, {"type": "abort", "message": "Abort in waiting queue"}
            await asyncio.sleep(self.token_delay_s)
            prefix = gen.ids + out
            tok = (31 * sum(prefix) + len(prefix)) % self.vocab
            out.append(tok)
            if tok in stops:
                return out, {"type": "stop", "matched": tok}

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"model_path": "fake", "is_generation": True, "weight_version": self.weight_version}
        )

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version, "internal_states": [{}]})

    async def _pause(self, request: web.Request) -> web.Response:
        body = await self._body(request, "/pause_generation")
        if body.get("mode", "abort") == "abort":
            for g in list(self._running.values()):
                g.aborted = True
            while self._running:  # SGLang's abort mode waits until idle
                await asyncio.sleep(0.001)
        self._unpaused.clear()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: web.Request) -> web.Response:
        await self._body(request, "/continue_generation")
        self._unpaused.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _abort(self, request: web.Request) -> web.Response:
        body = await self._body(request, "/abort_request")
        for g in list(self._running.values()):
            if body.get("abort_all") or g.rid == body.get("rid"):
                g.aborted = True
        return web.Response(status=200)

    async def _flush(self, request: web.Request) -> web.Response:
        await self._body(request, "/flush_cache")
        if self._running:
            return web.Response(status=400, text="Cache not flushed.")
        return web.Response(status=200, text="Cache flushed.")

    async def _init_group(self, request: web.Request) -> web.Response:
        b = await self._body(request, "/init_weights_update_group")
        missing = {
            "master_address",
            "master_port",
            "rank_offset",
            "world_size",
            "group_name",
            "backend",
        } - set(b)
        if missing:
            return web.json_response({"success": False, "message": f"missing {sorted(missing)}"}, status=400)
        self.groups.add(b["group_name"])
        return web.json_response(
            {"success": True, "message": "Succeeded to initialize custom process group."}
        )

    async def _update(self, request: web.Request) -> web.Response:
        b = await self._body(request, "/update_weights_from_distributed")
        if b.get("group_name") not in self.groups:
            return web.json_response(
                {"success": False, "message": f"group {b.get('group_name')} unknown"}, status=400
            )
        if not len(b["names"]) == len(b["dtypes"]) == len(b["shapes"]):
            return web.json_response({"success": False, "message": "length mismatch"}, status=400)
        if b.get("weight_version") is not None:
            self.weight_version = str(b["weight_version"])
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def _destroy_group(self, request: web.Request) -> web.Response:
        b = await self._body(request, "/destroy_weights_update_group")
        self.groups.discard(b.get("group_name", ""))
        return web.json_response({"success": True, "message": "destroyed"})
