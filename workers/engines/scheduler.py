"""The embedded engine's model thread: a continuous-batching loop over a Hugging Face causal LM.

One thread owns the model and the running `Batch`. Each loop iteration, at a step boundary:

1. run queued commands (pause, continue, weight loads: anything that must not overlap a forward);
2. finish rows whose request was aborted;
3. unless paused, admit waiting requests up to `max_batch` live rows: one left-padded prefill for
   all of them, which samples their first token, then merge them into the running batch;
4. one decode step for every running row (each row feeds its newest token).

Invariants: a forward step never sees two weight versions (weights change only in step 1, with the
loop stopped); every request ends exactly once, through `on_done`, with finish reason stop, length
or abort. While paused, new requests wait in the queue, at most `max_pause_wait_s`, then end as
aborted. Other threads talk to the loop only through the thread-safe methods below.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from streamrl.log import get_logger
from workers.engines.kv import Batch, new_cache
from workers.engines.sampling import SamplingSpec, sample

log = get_logger(__name__)
PauseMode = Literal["abort", "in_place", "retract"]


@dataclass(eq=False)
class Request:
    """One /generate request from arrival to its single `on_done` call (made on the model thread)."""

    input_ids: list[int]
    spec: SamplingSpec
    on_done: Callable[[Request], None]
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    stop_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict[str, Any] | None = None  # SGLang's finish_reason object
    weight_version: int = 0
    arrived: float = field(default_factory=time.monotonic)
    finished: float = 0.0
    abort_message: str | None = None  # set by other threads; acted on at the next step boundary


@dataclass
class Counters:
    prefill_steps: int = 0
    decode_steps: int = 0
    max_batch_seen: int = 0
    tokens_generated: int = 0
    requests_finished: int = 0
    decode_seconds: float = 0.0


class Scheduler:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_ids: frozenset[int],
        max_batch: int = 64,
        pad_id: int = 0,
        weight_version: int = 0,
        seed: int = 0,
        max_pause_wait_s: float = 600.0,
    ) -> None:
        self.model = model
        self.eos_ids, self.max_batch, self.pad_id = eos_ids, max_batch, pad_id
        self.weight_version = weight_version  # written only on the model thread
        self.max_pause_wait_s = max_pause_wait_s
        self.counters = Counters()
        self.paused = False
        self._num_layers = int(model.config.get_text_config().num_hidden_layers)
        self._device = next(model.parameters()).device
        self._gen = torch.Generator(device=self._device).manual_seed(seed)
        self._cv = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._commands: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._live: dict[str, Request] = {}  # rid -> request, waiting or running
        self._abort_pending = False
        self._stopping = False
        self._batch: Batch | None = None
        self._thread = threading.Thread(target=self._run, name="engine-model", daemon=True)

    # ------------------------------------------------------------ thread-safe API

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout_s)

    def submit(self, *reqs: Request) -> None:
        """Queue requests; all of them become visible to the loop at once (so they prefill together)."""
        queued = []
        for req in reqs:
            req.stop_ids = req.spec.stop_token_ids | (frozenset() if req.spec.ignore_eos else self.eos_ids)
            if req.spec.max_new_tokens == 0:
                self._finish(req, {"type": "length", "length": 0})
            else:
                queued.append(req)
        with self._cv:
            taken = [r.rid for r in queued if r.rid in self._live]
            if taken or len({r.rid for r in queued}) != len(queued):
                raise ValueError(f"request ids already in use: {taken or [r.rid for r in queued]}")
            for req in queued:
                self._live[req.rid] = req
                self._waiting.append(req)
            self._cv.notify_all()

    def abort(self, rid: str | None = None, message: str = "Abort requested") -> int:
        """Abort one request (by id) or all; they end at the next step boundary. Returns how many."""
        with self._cv:
            targets = (
                list(self._live.values()) if rid is None else [self._live[rid]] if rid in self._live else []
            )
            for req in targets:
                req.abort_message = message
            self._abort_pending |= bool(targets)
            self._cv.notify_all()
        return len(targets)

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn` on the model thread at the next step boundary (also while paused)."""
        fut: Future[Any] = Future()
        with self._cv:
            self._commands.append((fn, fut))
            self._cv.notify_all()
        return fut

    def pause(self, mode: PauseMode) -> Future[Any]:
        """abort: end every request (partial output, finish abort), then stay paused until continued.
        in_place / retract: stop stepping and keep running requests and their KV as they are (this
        engine treats retract as in_place: nothing needs to be freed on a CPU)."""

        def go() -> None:
            if mode == "abort":
                self.abort(None, "Aborted by pause_generation")
                self.reap_aborts()
            self.paused = True

        return self.call(go)

    def resume(self) -> Future[Any]:
        def go() -> None:
            self.paused = False

        return self.call(go)

    def stats(self) -> dict[str, Any]:
        return {
            "running": self._running(),
            "waiting": len(self._waiting),
            "paused": self.paused,
            "weight_version": self.weight_version,
            **self.counters.__dict__,
        }

    # ------------------------------------------------------------ model thread

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not self._has_work():
                        self._cv.wait(timeout=0.5 if self._waiting else None)
                        self._expire_paused()
                    if self._stopping:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                for fn, fut in commands:
                    self._run_command(fn, fut)
                newcomers: list[Request] = []
                try:
                    self.reap_aborts()
                    if self.paused:
                        continue
                    with self._cv:
                        room = self.max_batch - self._running()
                        while self._waiting and len(newcomers) < room:
                            newcomers.append(self._waiting.popleft())
                    if newcomers:
                        self._prefill(newcomers)
                    if self._batch is not None:
                        self._decode()
                except Exception as e:  # a broken step must not leave callers waiting forever
                    log.exception("engine_step_failed")
                    self._fail_all(f"engine error: {e!r}", newcomers)
        self._fail_all("engine stopped", [])
        with self._cv:
            for _, fut in self._commands:
                fut.set_exception(RuntimeError("engine stopped"))
            self._commands.clear()

    def _running(self) -> int:
        batch = self._batch
        return 0 if batch is None else batch.size - batch.dead

    def _has_work(self) -> bool:
        if self._stopping or self._commands or self._abort_pending:
            return True
        if self.paused:
            return False
        return self._batch is not None or bool(self._waiting)

    def _expire_paused(self) -> None:
        """Called with the lock held: requests waiting through a long pause end as aborted."""
        if not self.paused:
            return
        deadline = time.monotonic() - self.max_pause_wait_s
        for req in list(self._waiting):
            if req.arrived < deadline:
                req.abort_message = f"engine paused for more than {self.max_pause_wait_s} s"
                self._abort_pending = True

    def _run_command(self, fn: Callable[[], Any], fut: Future[Any]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as e:
            fut.set_exception(e)

    def reap_aborts(self) -> None:
        """End aborted requests now (model thread only: the loop does it at every step boundary)."""
        with self._cv:
            if not self._abort_pending:
                return
            self._abort_pending = False
            gone = [r for r in self._waiting if r.abort_message is not None]
            for r in gone:
                self._waiting.remove(r)
        for r in gone:
            self._finish(r, {"type": "abort", "message": r.abort_message})
        batch = self._batch
        if batch is not None:
            for i, r in enumerate(batch.rows):
                if isinstance(r, Request) and r.abort_message is not None:
                    batch.rows[i] = None
                    self._finish(r, {"type": "abort", "message": r.abort_message})
            self._compact()

    def _prefill(self, reqs: list[Request]) -> None:
        lengths = [len(r.input_ids) for r in reqs]
        width = max(lengths)
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, width - lengths[i] :] = torch.tensor(r.input_ids, dtype=torch.long)
            mask[i, width - lengths[i] :] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = new_cache(self._num_layers)
        padded = min(lengths) != width
        out = self.model(
            input_ids=ids.to(self._device),
            attention_mask=mask.to(self._device) if padded else None,
            position_ids=positions.to(self._device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        params = torch.tensor([r.spec.row() for r in reqs], dtype=torch.float32, device=self._device)
        tokens, logprobs = sample(out.logits[:, -1, :], params, self._gen)
        self.counters.prefill_steps += 1
        batch = Batch(
            cache,
            mask.to(self._device),
            list(reqs),
            tokens,
            torch.tensor(lengths, device=self._device),
            params,
        )
        self._record(batch, tokens, logprobs)
        if batch.dead == batch.size:
            return
        if self._batch is None:
            self._batch = batch
            self._compact()
        else:
            self._batch.merge(batch)  # drops finished rows of both

    def _decode(self) -> None:
        batch = self._batch
        assert batch is not None
        t0 = time.perf_counter()
        out = self.model(
            input_ids=batch.last_tok[:, None],
            attention_mask=batch.step_mask(),
            position_ids=batch.next_pos[:, None],
            past_key_values=batch.cache,
            use_cache=True,
        )
        tokens, logprobs = sample(out.logits[:, -1, :], batch.params, self._gen)
        batch.last_tok = tokens
        batch.next_pos = batch.next_pos + 1
        self.counters.decode_steps += 1
        self.counters.max_batch_seen = max(self.counters.max_batch_seen, batch.size)
        self._record(batch, tokens, logprobs)
        self._compact()
        self.counters.decode_seconds += time.perf_counter() - t0

    def _record(self, batch: Batch, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Append each live row's new token; end rows that hit a stop token or their length limit."""
        toks, lps = tokens.tolist(), logprobs.tolist()
        for i, req in enumerate(batch.rows):
            if not isinstance(req, Request):
                continue
            tok = toks[i]
            req.output_ids.append(tok)
            req.logprobs.append(lps[i])
            self.counters.tokens_generated += 1
            # SGLang checks the length limit before stop tokens
            if len(req.output_ids) >= req.spec.max_new_tokens:
                finish: dict[str, Any] | None = {"type": "length", "length": req.spec.max_new_tokens}
            elif tok in req.stop_ids:
                finish = {"type": "stop", "matched": tok}
            else:
                continue
            batch.rows[i] = None
            self._finish(req, finish)

    def _compact(self) -> None:
        """Drop finished rows once all or half of the rows are finished: a finished row costs a
        little compute per step, a compaction copies the whole cache (merges drop them for free)."""
        batch = self._batch
        if batch is None:
            return
        dead = batch.dead
        if dead == batch.size:
            self._batch = None
        elif dead and 2 * dead >= batch.size:
            batch.drop_finished()

    def _finish(self, req: Request, finish: dict[str, Any]) -> None:
        with self._cv:
            if self._live.get(req.rid) is req:
                del self._live[req.rid]
        req.finish = finish
        req.weight_version = self.weight_version
        req.finished = time.monotonic()
        self.counters.requests_finished += 1
        try:
            req.on_done(req)
        except Exception:  # e.g. the server's event loop is already closed at shutdown
            log.exception("request_callback_failed", rid=req.rid)

    def _fail_all(self, message: str, extra: list[Request]) -> None:
        batch, self._batch = self._batch, None
        rows = [r for r in (batch.rows if batch else []) if isinstance(r, Request)]
        with self._cv:
            rows += list(self._waiting)
            self._waiting.clear()
        for r in rows + extra:
            if r.finish is None:
                self._finish(r, {"type": "abort", "message": message})
