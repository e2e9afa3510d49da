"""One async client for SGLang's HTTP API, used against SGLang servers and the embedded engine alike.

    async with EngineClient("http://127.0.0.1:30000") as engine:
        out = await engine.generate(prompt_ids, SamplingParams(temperature=1.0, max_new_tokens=256))
        out.output_ids, out.logprobs, out.finish_reason, out.weight_version

Every call is bounded by a timeout (`timeout_s` per client, overridable per call). Connection
failures, timeouts, non-2xx answers and answers of the wrong shape raise `EngineError`, whose message
names the URL and endpoint. `health()` is the one call that answers False instead of raising, so it
can be polled. SGLang's `weight_version` is a string; streamrl sends str(int) and parses it back (a
non-integer, e.g. SGLang's default "default", reads as 0).
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any, Literal

import aiohttp
import msgspec

from streamrl.errors import StreamrlError

FinishReason = Literal["stop", "length", "abort"]


class EngineError(StreamrlError):
    """An engine call failed: unreachable, timed out, refused (non-2xx), or answered nonsense."""

    def __init__(self, url: str, endpoint: str, detail: str, status: int | None = None) -> None:
        super().__init__(f"{url}{endpoint}: {detail}")
        self.url, self.endpoint, self.detail, self.status = url, endpoint, detail, status


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """The sampling parameters streamrl sends. top_k -1 means off (SGLang rejects 0)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: list[int] = []
    ignore_eos: bool = False

    def to_sglang(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "stop_token_ids": list(self.stop_token_ids),
        }
        if self.ignore_eos:
            out["ignore_eos"] = True
        return out


class GenerateOutput(msgspec.Struct, kw_only=True):
    """One completed /generate call. `logprobs[i]` is the log-probability of `output_ids[i]`."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int
    prompt_tokens: int
    rid: str = ""
    matched_stop: int | str | None = None  # the stop token (or string) that ended it, if any
    e2e_latency_s: float | None = None  # the server's own time for the request, when it reports it


# The parts of SGLang's /generate answer the client reads (everything else is ignored).
class _Finish(msgspec.Struct):
    type: str
    matched: int | str | None = None


class _Meta(msgspec.Struct):
    finish_reason: _Finish | None = None
    prompt_tokens: int = 0
    weight_version: str | int | None = None
    output_token_logprobs: list[tuple[float | None, int, str | None]] | None = None
    id: str = ""
    e2e_latency: float | None = None


class _GenerateAnswer(msgspec.Struct):
    output_ids: list[int]
    meta_info: _Meta


_decode_generate = msgspec.json.Decoder(_GenerateAnswer).decode


def parse_weight_version(value: object) -> int:
    """SGLang's string weight version as an int; anything that is not an integer reads as 0."""
    try:
        return int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return 0


class EngineClient:
    def __init__(self, url: str, *, timeout_s: float = 600.0, max_connections: int = 0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._max_connections = max_connections  # 0: unbounded; concurrency is bounded by the caller
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections), raise_for_status=False
            )
        return self._session

    async def _request(
        self, method: str, endpoint: str, body: dict[str, Any] | None = None, timeout_s: float | None = None
    ) -> tuple[int, bytes]:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s if timeout_s is None else timeout_s)
        data = None if body is None else msgspec.json.encode(body)
        headers = None if body is None else {"Content-Type": "application/json"}
        try:
            async with self._get_session().request(
                method, self.url + endpoint, data=data, headers=headers, timeout=timeout
            ) as resp:
                return resp.status, await resp.read()
        except TimeoutError:
            raise EngineError(self.url, endpoint, f"no answer within {timeout.total} s") from None
        except aiohttp.ClientError as e:
            raise EngineError(self.url, endpoint, f"{type(e).__name__}: {e}") from None

    async def _call(
        self, method: str, endpoint: str, body: dict[str, Any] | None = None, timeout_s: float | None = None
    ) -> bytes:
        """A request that must succeed (2xx)."""
        status, raw = await self._request(method, endpoint, body, timeout_s)
        if not 200 <= status < 300:
            raise EngineError(
                self.url, endpoint, f"HTTP {status}: {raw[:500].decode(errors='replace')}", status
            )
        return raw

    async def _weights_call(self, endpoint: str, body: dict[str, Any], timeout_s: float | None) -> str:
        """SGLang's weight endpoints answer {success, message} with 200 or 400."""
        status, raw = await self._request("POST", endpoint, body, timeout_s)
        try:
            answer = msgspec.json.decode(raw)
            success, message = bool(answer["success"]), str(answer.get("message", ""))
        except (msgspec.DecodeError, KeyError, TypeError):
            raise EngineError(self.url, endpoint, f"HTTP {status}: {raw[:500]!r}", status) from None
        if not success:
            raise EngineError(self.url, endpoint, message, status)
        return message

    # ------------------------------------------------------------ generation

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        rid: str | None = None,
        timeout_s: float | None = None,
    ) -> GenerateOutput:
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": sampling.to_sglang(),
            "return_logprob": True,
        }
        if rid is not None:
            body["rid"] = rid
        raw = await self._call("POST", "/generate", body, timeout_s)
        try:
            answer = _decode_generate(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise EngineError(self.url, "/generate", f"answer not in SGLang's shape: {e}") from None
        meta = answer.meta_info
        finish = meta.finish_reason.type if meta.finish_reason is not None else ""
        if finish not in ("stop", "length", "abort"):
            raise EngineError(self.url, "/generate", f"unknown finish_reason {meta.finish_reason!r}")
        triplets = meta.output_token_logprobs or []
        if [t[1] for t in triplets] != answer.output_ids:
            raise EngineError(self.url, "/generate", "output_token_logprobs do not match output_ids")
        return GenerateOutput(
            output_ids=answer.output_ids,
            # JSON has no -inf: SGLang (orjson) and msgspec write a non-finite log-prob as null
            logprobs=[float("-inf") if t[0] is None else t[0] for t in triplets],
            finish_reason=finish,  # type: ignore[arg-type]
            weight_version=parse_weight_version(meta.weight_version),
            prompt_tokens=meta.prompt_tokens,
            rid=meta.id,
            matched_stop=meta.finish_reason.matched if meta.finish_reason is not None else None,
            e2e_latency_s=meta.e2e_latency,
        )

    # ------------------------------------------------------------ control

    async def health(self, timeout_s: float = 5.0) -> bool:
        """True when the server answers /health with 200; never raises."""
        try:
            status, _ = await self._request("GET", "/health", None, timeout_s)
        except EngineError:
            return False
        return status == 200

    async def wait_healthy(self, timeout_s: float, every_s: float = 0.2) -> None:
        """Poll /health until it answers 200; EngineError after `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not await self.health(timeout_s=max(0.1, min(5.0, deadline - loop.time()))):
            if loop.time() >= deadline:
                raise EngineError(self.url, "/health", f"not healthy within {timeout_s} s")
            await asyncio.sleep(every_s)

    async def model_info(self) -> dict[str, Any]:
        return dict(msgspec.json.decode(await self._call("GET", "/model_info")))

    async def server_info(self) -> dict[str, Any]:
        return dict(msgspec.json.decode(await self._call("GET", "/server_info")))

    async def weight_version(self) -> int:
        return parse_weight_version((await self.model_info()).get("weight_version"))

    async def pause(self, mode: Literal["abort", "in_place", "retract"] = "abort") -> None:
        """abort: end running requests (they return partial output, finish "abort") and wait until
        idle; in_place: stop stepping and keep them. New requests wait until `continue_generation`."""
        await self._call("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._call("POST", "/continue_generation", {})

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request by id, or all of them when `rid` is None."""
        body = {"rid": "", "abort_all": True} if rid is None else {"rid": rid, "abort_all": False}
        await self._call("POST", "/abort_request", body)

    async def flush_cache(self) -> bool:
        """True when flushed; False when the server refused (it does while requests are running)."""
        status, _ = await self._request("POST", "/flush_cache")
        return 200 <= status < 300

    # ------------------------------------------------------------ weight updates

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: Literal["nccl", "gloo"] = "nccl",
        timeout_s: float | None = None,
    ) -> str:
        """Join the engine to the trainer's weight-update group. The answer comes only once every rank
        has joined, so the trainer must join (`weight_sync.init_update_group`) concurrently."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._weights_call("/init_weights_update_group", body, timeout_s)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> str:
        return await self._weights_call("/destroy_weights_update_group", {"group_name": group_name}, None)

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        *,
        load_format: Literal["flattened_bucket"] | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        timeout_s: float | None = None,
    ) -> str:
        """Post one update's metadata; the engine answers after receiving the broadcast (the caller
        broadcasts concurrently, e.g. `weight_sync.broadcast_weights`). EngineError unless success."""
        body = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "load_format": load_format,
            "weight_version": weight_version,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        return await self._weights_call("/update_weights_from_distributed", body, timeout_s)

    async def update_weights(self, request: dict[str, Any], timeout_s: float | None = None) -> str:
        """Post a ready-made `/update_weights_from_distributed` body (`weight_sync.UpdateCall.request`)."""
        return await self._weights_call("/update_weights_from_distributed", request, timeout_s)

    async def get_weights_by_name(
        self, name: str, truncate_size: int = 100, timeout_s: float | None = None
    ) -> list[Any]:
        """SGLang's `/get_weights_by_name`: the parameter's first `truncate_size` rows as float32
        (nested) lists. EngineError for an unknown name."""
        body = {"name": name, "truncate_size": truncate_size}
        answer = msgspec.json.decode(await self._call("POST", "/get_weights_by_name", body, timeout_s))
        if not isinstance(answer, list):
            raise EngineError(
                self.url, "/get_weights_by_name", f"expected a list, got {type(answer).__name__}"
            )
        return answer
