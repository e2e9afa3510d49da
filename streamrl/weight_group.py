"""The engines a learner pushes weights to: HTTP to each, probing, forming and re-forming the
process group with them, and unwinding a failed update.

`EngineGroup` holds that state and is the base of streamrl.weight_push.WeightPusher, which runs the
updates themselves; the fault handling it implements is described there ("Faults"). The group is
formed with SGLang's protocol (streamrl.weight_sync): rank 0 here, on a daemon thread (`_Joiner`),
while every engine is asked to join with its ranks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from streamrl import weight_sync
from streamrl.config import WeightSyncConfig
from streamrl.errors import WeightSyncError
from streamrl.log import get_logger
from workers.engines.client import EngineClient, EngineError

log = get_logger(__name__)
T = TypeVar("T")
PROBE_TIMEOUT_S = 10.0  # an engine that does not answer /model_info within this is skipped


class _Joiner(threading.Thread):
    """Rank 0's side of forming the group, on a daemon thread so a failed formation can be given up
    at once (the rendezvous only notices at its timeout); a group formed after that is destroyed."""

    def __init__(
        self, address: str, port: int, world: int, name: str, backend: str, timeout_s: float
    ) -> None:
        super().__init__(name="weight-group-join", daemon=True)
        self.args = (address, port, 0, world, name, backend, timeout_s)
        self.group: dist.ProcessGroup | None = None
        self.error: BaseException | None = None
        self._lock, self._abandoned = threading.Lock(), False

    def run(self) -> None:
        try:
            group = weight_sync.init_update_group(*self.args)  # type: ignore[arg-type]
        except BaseException as e:
            self.error = e
            return
        with self._lock:
            if self._abandoned:
                weight_sync.destroy_update_group(group)
            else:
                self.group = group

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            if self.group is not None:
                weight_sync.destroy_update_group(self.group)
                self.group = None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def first_error(futures: Iterable[cf.Future[Any]]) -> BaseException | None:
    """The exception of the first finished future that raised one, if any."""
    for f in futures:
        if f.done() and not f.cancelled() and f.exception() is not None:
            return f.exception()
    return None


class EngineGroup:
    """The engines to update and the weight-update group with them (see the module docstring).

    All of it runs under `_lock`; HTTP requests run on an asyncio loop in a thread this object owns.
    """

    def __init__(
        self,
        engine_urls: list[str],
        cfg: WeightSyncConfig,
        *,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        tp_size: int = 1,
        group_name: str = "streamrl_weights",
    ) -> None:
        urls = [u.rstrip("/") for u in engine_urls]
        if not urls or len(set(urls)) != len(urls):
            raise ValueError(f"engine_urls must be non-empty and distinct, got {engine_urls}")
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.urls, self.cfg, self.tp_size, self.group_name = urls, cfg, tp_size, group_name
        self.master_address, self.master_port = master_address, master_port
        self.backend = (
            cfg.backend if cfg.backend != "auto" else "nccl" if torch.cuda.is_available() else "gloo"
        )
        # where the group's tensors are sent from: NCCL needs them on the GPU
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )
        self.members: list[str] = []  # the engines in the current group, in rank order
        self._expected: dict[str, int] = {}  # engine -> the version it got from us last
        self._group: dist.ProcessGroup | None = None
        self._broken = False
        self._unwinding: threading.Thread | None = None  # a failed update's background clean-up
        self._retiring: list[threading.Thread] = []  # groups destroyed once their broadcast ends
        self._lock = threading.RLock()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="weight-push-http", daemon=True)
        self._thread.start()
        self._clients = {u: EngineClient(u, timeout_s=cfg.timeout_s) for u in urls}

    # ------------------------------------------------------------------ HTTP on the pusher's loop

    def _submit(self, coro: Coroutine[Any, Any, T]) -> cf.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        fut = self._submit(coro)
        try:
            return fut.result(self.cfg.timeout_s + 5.0 if timeout_s is None else timeout_s)
        except cf.TimeoutError:
            fut.cancel()
            raise WeightSyncError(f"no answer within {timeout_s or self.cfg.timeout_s} s") from None

    def _each(
        self, urls: list[str], call: Callable[[EngineClient], Awaitable[T]], timeout_s: float | None = None
    ) -> dict[str, T | BaseException]:
        """`call` on every engine concurrently; each engine's result or exception."""

        async def go() -> list[T | BaseException]:
            return await asyncio.gather(*(call(self._clients[u]) for u in urls), return_exceptions=True)

        return dict(zip(urls, self._run(go(), timeout_s), strict=True))

    def _all_ok(self, urls: list[str], call: Callable[[EngineClient], Awaitable[Any]], what: str) -> None:
        failed = {u: r for u, r in self._each(urls, call).items() if isinstance(r, BaseException)}
        if failed:
            raise WeightSyncError(f"{what} failed: " + "; ".join(f"{u}: {e}" for u, e in failed.items()))

    # ------------------------------------------------------------------ the group

    def _probe(self) -> dict[str, int | None]:
        """Each engine's weight_version, or None when it does not answer in time."""

        async def version(c: EngineClient) -> int:
            return await asyncio.wait_for(c.weight_version(), min(PROBE_TIMEOUT_S, self.cfg.timeout_s))

        return {
            u: None if isinstance(v, BaseException) else v for u, v in self._each(self.urls, version).items()
        }

    def connect(self) -> None:
        """Form the group with every engine (blocking). WeightSyncError when one is unreachable."""
        with self._lock:
            self._check_open()
            down = [u for u, v in self._probe().items() if v is None]
            if down:
                raise WeightSyncError(f"engines not reachable: {down}")
            self._connect(list(self.urls))

    def reconnect(self) -> list[str]:
        """Tear the group down and form it again with the engines that answer; returns them."""
        with self._lock:
            self._check_open()
            self._finish_unwinding()
            alive = [u for u, v in self._probe().items() if v is not None]
            if not alive:
                raise WeightSyncError(f"no engine answers: {self.urls}")
            self._connect(alive)
            return alive

    def _ensure_group(self) -> list[str]:
        """Before an update: (re)form the group when needed; returns the engines that were skipped."""
        self._finish_unwinding()
        versions = self._probe()
        alive = [u for u in self.urls if versions[u] is not None]
        if not alive:
            raise WeightSyncError(f"no engine answers /model_info: {self.urls}")
        restarted = [u for u in alive if u in self._expected and versions[u] != self._expected[u]]
        if self._group is None or self._broken or alive != self.members or restarted:
            if restarted:
                log.warning("engines_restarted", engines=restarted, versions=[versions[u] for u in restarted])
            self._connect(alive)
        return [u for u in self.urls if u not in alive]

    def _connect(self, members: list[str]) -> None:
        self._destroy_local()
        # Engines may still hold a group of this name: ours from before, or a previous learner's.
        name = self.group_name
        self._each(members, lambda c: c.destroy_weights_update_group(name))
        port = self.master_port or free_port(self.master_address)
        world = 1 + len(members) * self.tp_size
        joiner = _Joiner(self.master_address, port, world, name, self.backend, self.cfg.timeout_s)
        joiner.start()
        joins = [
            self._submit(
                self._clients[u].init_weights_update_group(
                    self.master_address,
                    port,
                    1 + i * self.tp_size,
                    world,
                    name,
                    self.backend,  # type: ignore[arg-type]
                )
            )
            for i, u in enumerate(members)
        ]
        deadline = time.monotonic() + self.cfg.timeout_s
        while joiner.is_alive() or not all(f.done() for f in joins):
            error = joiner.error or first_error(joins)
            if error is None and time.monotonic() > deadline:
                error = TimeoutError(f"not formed within {self.cfg.timeout_s} s")
            if error is not None:
                joiner.abandon()
                for f in joins:
                    f.cancel()
                raise WeightSyncError(f"could not form the weight-update group with {members}: {error}")
            time.sleep(0.005)
        error = joiner.error or first_error(joins)
        if error is not None or joiner.group is None:
            joiner.abandon()
            raise WeightSyncError(f"could not form the weight-update group with {members}: {error}")
        self._group, self.members, self._broken = joiner.group, list(members), False
        log.info("weight_group_formed", engines=members, world_size=world, port=port, backend=self.backend)

    def _destroy_local(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            weight_sync.destroy_update_group(group)
        self.members = []

    def _finish_unwinding(self) -> None:
        thread, self._unwinding = self._unwinding, None
        if thread is not None:
            thread.join(self.cfg.timeout_s + 10.0)
            if thread.is_alive():
                self._unwinding = thread
                raise WeightSyncError("the previous failed update is still unwinding its broadcast")

    def _check_open(self) -> None:
        if self._closed:
            raise WeightSyncError("the weight pusher is closed")

    # ------------------------------------------------------------------ after a failed update

    def _fail(
        self, members: list[str], works: list[dist.Work], answers: list[cf.Future[str]], sent: bool
    ) -> None:
        """After a failed update: the group is done for; cancel what is in flight and continue the
        engines. An engine whose request for the bucket on the wire is still open is receiving it;
        it is cancelled (the embedded engine then stops receiving) only once the broadcast has
        ended, or bytes could still land after it gave up, and continued after that. If the
        broadcast is still running (a peer died mid-transfer: gloo notices only at its timeout),
        that happens on a background thread, which the next push waits for; with no engine left
        receiving, only the group's teardown waits (the next push forms a new one meanwhile)."""
        group, self._group, self._broken = self._group, None, True
        self.members = []
        open_ = [u for u, f in zip(members, answers, strict=True) if not f.done()] if answers else []
        self._continue([u for u in members if u not in open_])
        running = [w for w in works if not w.is_completed()]

        def unwind() -> None:
            for work in running:
                with contextlib.suppress(Exception):  # expected: the broadcast failed
                    weight_sync.wait_work(work, self.cfg.timeout_s + 5.0, gloo=self.backend == "gloo")
            for f in answers:
                f.cancel()
            # a broadcast past even gloo's own timeout keeps its group from being destroyed
            self._retire(group, [w for w in running if not w.is_completed()])
            self._continue(open_)
            log.warning("weight_update_unwound", engines=members, partial=sent)

        if not running:
            unwind()
        elif not open_:  # no engine is left receiving: only our side waits for the broadcast's end
            self._retire(group, running)
            log.warning("weight_update_unwound", engines=members, partial=sent)
        else:
            self._unwinding = threading.Thread(target=unwind, name="weight-push-unwind", daemon=True)
            self._unwinding.start()

    def _retire(self, group: dist.ProcessGroup | None, pending: list[dist.Work]) -> None:
        if group is not None and (thread := weight_sync.retire_group(group, pending)) is not None:
            self._retiring.append(thread)

    def _continue(self, urls: list[str]) -> None:
        """Best effort: engines that are gone do not answer, and that is fine here."""
        if urls:
            with contextlib.suppress(WeightSyncError):
                self._each(urls, lambda c: c.continue_generation(), timeout_s=min(30.0, self.cfg.timeout_s))

    # ------------------------------------------------------------------ shutting down

    def close(self) -> None:
        """Leave the group (here and, best effort, on the engines) and stop the HTTP thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._finish_unwinding()
            except WeightSyncError:
                log.warning("weight_push_close_unwinding")
            if self._group is not None:
                name, members = self.group_name, list(self.members)
                try:
                    self._each(members, lambda c: c.destroy_weights_update_group(name), timeout_s=10.0)
                except WeightSyncError:
                    log.warning("weight_group_destroy_unanswered", engines=members)
                self._destroy_local()
            for thread in self._retiring:  # a live gloo group would abort the interpreter's exit
                thread.join(self.cfg.timeout_s + 10.0)

            async def close_clients() -> None:
                await asyncio.gather(*(c.close() for c in self._clients.values()))

            self._run(close_clients(), timeout_s=10.0)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10.0)
            self._loop.close()


def failed_engines(members: list[str], answers: list[cf.Future[str]], wait_s: float) -> dict[str, str]:
    """Engines whose request failed. A dead engine's request fails within moments of the broadcast
    error that may have been seen first, so wait that long: the error then names the engine."""
    if not answers:
        return {}
    cf.wait(answers, timeout=wait_s, return_when=cf.FIRST_EXCEPTION)
    return {
        u: describe_error(error)
        for u, f in zip(members, answers, strict=True)
        if f.done() and not f.cancelled() and (error := f.exception()) is not None
    }


def engine_failure(error: BaseException | None) -> str | None:
    """A reason to stop waiting for a broadcast (`weight_sync.wait_work`) when an engine failed."""
    return None if error is None else f"an engine failed: {describe_error(error)}"


def describe_error(e: BaseException) -> str:
    """One line: gloo's messages run to several lines of advice."""
    text = str(e) if isinstance(e, WeightSyncError | EngineError) else f"{type(e).__name__}: {e}"
    line = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return line if len(line) <= 300 else line[:297] + "..."
