"""The learner's side of a weight update: one blocking call pushes a version to every engine.

    pusher = WeightPusher(engine_urls, spec.weight_sync)
    times = pusher.push(backend.hf_weights(), version=step + 1)   # connects when needed
    metrics.update(times.metrics())
    pusher.close()

An update follows SGLang's protocol (weight_sync.py): pause every engine (`cfg.pause_mode`), then for
each bucket of `cfg.bucket_mb` post /update_weights_from_distributed and broadcast the bucket's bytes
while the request is in flight, wait for every engine's answer, and continue the engines. Only the
last call carries `weight_version`, so an engine never reports the new version holding half of it.
The weights are pulled one bucket at a time (`stream_updates`), so a learner that gathers TP/PP
shards on the fly holds about two buckets of them, not the model: the next bucket is pulled while
the current one is on the wire. Nothing is copied when it can be helped: a bucket whose bytes are
already one range (a learner whose parameters live in one flat buffer) is broadcast as a view; on
gloo other buckets go one broadcast per tensor, on NCCL they are packed (`_next_bucket`). The
caller's thread pulls, packs and broadcasts (the learner is synchronous torch code); HTTP runs on an
asyncio loop in a thread the pusher owns. Each bucket's answers are awaited before the next call is
posted: two requests on two connections may reach an engine in either order, and a swapped pair
would receive one bucket's bytes with the other's layout.

Phases (`SyncTimes`), each the time the pushing thread spent in it, so they add up to at most the
total: connect (probe the engines, rebuild the group when needed), pause, gather (pulling tensors
from the iterator, where a Megatron backend gathers and renames, plus packing; mostly hidden behind
the previous bucket's broadcast), wire (the broadcast, less what gathering hid), load (end of a
broadcast until every engine answered), verify (optional `/get_weights_by_name` spot check), resume.

Faults. Every wait is bounded by `cfg.timeout_s`. Each push first asks every engine for its
`weight_version`; an engine that does not answer is skipped (`SyncTimes.skipped`), and the group is
rebuilt (torn down here and on the engines, then formed again with fresh ranks) whenever the set of
reachable engines changed, an engine reports another version than the one last pushed to it (it was
restarted with its initial weights), or the previous update failed. Every push sends the full
weights, so a restarted engine catches up at its first push. An engine that dies during an update is
seen at once (its HTTP request fails) while the broadcast is polled, and push() raises
WeightSyncError; the remaining engines' requests are cancelled once the broadcast has ended (the
embedded engine then stops waiting for it), and they are continued: one that took part of the update
serves that mix, still reporting the previous version, until the next push. Leaving them paused
instead would deadlock a learner that needs new rollouts before it pushes again. A broadcast still
stuck on a dead peer (gloo only notices at its timeout) is unwound on a background thread, and the
next push waits for that first.

The `weights` iterator is always consumed to its end, even when the update fails: on a multi-rank
learner every rank iterates it, and its items are collectives they all must join.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
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
VERIFY_ELEMENTS = 16384  # rows fetched per spot-checked tensor: about this many values
VERIFY_TENSORS = 16
RAW_NAME = "streamrl.raw_broadcast"  # a name no model has: `raw_broadcast` is drained, not loaded


@dataclass(frozen=True, slots=True)
class SyncTimes:
    """Seconds per phase of one update; `bytes` broadcast; `engines` updated."""

    pause_s: float
    gather_s: float
    wire_s: float
    load_s: float
    resume_s: float
    total_s: float
    bytes: int
    engines: int
    connect_s: float = 0.0
    verify_s: float = 0.0
    calls: int = 0
    skipped: tuple[str, ...] = ()  # engines that did not answer the probe and were not updated

    def metrics(self) -> dict[str, float]:
        """sync_pause_s, sync_gather_s, sync_wire_s, sync_load_s, sync_resume_s, sync_total_s,
        sync_bytes, sync_connect_s, sync_verify_s."""
        keys = ("pause_s", "gather_s", "wire_s", "load_s", "resume_s", "total_s", "bytes")
        return {f"sync_{k}": float(getattr(self, k)) for k in (*keys, "connect_s", "verify_s")}


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


def _first_error(futures: Iterable[cf.Future[Any]]) -> BaseException | None:
    for f in futures:
        if f.done() and not f.cancelled() and f.exception() is not None:
            return f.exception()
    return None


class WeightPusher:
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
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else "cpu"
        self._packer = weight_sync.BucketPacker(device)
        self._raw: torch.Tensor | None = None
        self.members: list[str] = []  # the engines in the current group, in rank order
        self.version: int | None = None  # the last version pushed
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

    def __enter__(self) -> WeightPusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
            error = joiner.error or _first_error(joins)
            if error is None and time.monotonic() > deadline:
                error = TimeoutError(f"not formed within {self.cfg.timeout_s} s")
            if error is not None:
                joiner.abandon()
                for f in joins:
                    f.cancel()
                raise WeightSyncError(f"could not form the weight-update group with {members}: {error}")
            time.sleep(0.005)
        error = joiner.error or _first_error(joins)
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

    # ------------------------------------------------------------------ an update

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncTimes:
        """Send `weights` (Hugging Face names) to every reachable engine as `version` (blocking)."""
        it = iter(weights)
        try:
            with self._lock:
                self._check_open()
                return self._push(it, version)
        finally:
            for _ in it:  # see the module docstring: other ranks' collectives
                pass

    def _push(self, it: Iterator[tuple[str, torch.Tensor]], version: int) -> SyncTimes:
        t_start = time.monotonic()
        skipped = self._ensure_group()
        members, timeout, gloo = list(self.members), self.cfg.timeout_s, self.backend == "gloo"
        t_paused = time.monotonic()
        connect_s = t_paused - t_start
        pause_mode = self.cfg.pause_mode
        pause_s = gather_s = wire_s = load_s = verify_s = 0.0
        nbytes = calls = 0
        samples: list[tuple[str, torch.Tensor]] = []
        works: list[dist.Work] = []
        answers: list[cf.Future[str]] = []
        try:
            self._all_ok(members, lambda c: c.pause(pause_mode), f"pause_generation ({pause_mode})")
            pause_s = time.monotonic() - t_paused
            stream = weight_sync.stream_updates(it, self.cfg.bucket_mb << 20)
            t0 = time.monotonic()
            call, sends = self._next_bucket(stream, samples)
            gather_s += time.monotonic() - t0
            while call is not None:
                body = call.request(
                    self.group_name,
                    weight_version=str(version) if call.last else None,
                    flush_cache=pause_mode == "abort",  # in place keeps the paused requests' KV
                )
                answers = [self._submit(self._clients[u].update_weights(body)) for u in members]
                t1 = time.monotonic()
                works = [dist.broadcast(t, src=0, group=self._group, async_op=True) for t in sends]
                # the next bucket is pulled (and packed) while this one is on the wire
                t2 = time.monotonic()
                following = self._next_bucket(stream, samples)
                t3 = time.monotonic()
                deadline = t1 + timeout
                for work in works:
                    left = max(0.0, deadline - time.monotonic())
                    weight_sync.wait_work(work, left, lambda a=answers: _reason(_first_error(a)), gloo=gloo)
                t4 = time.monotonic()
                cf.wait(answers, timeout=timeout, return_when=cf.FIRST_EXCEPTION)
                if error := _first_error(answers):
                    raise error
                if not all(f.done() for f in answers):
                    raise WeightSyncError(f"engines did not answer within {timeout} s")
                gather_s += t3 - t2
                wire_s += (t2 - t1) + (t4 - t3)
                load_s += time.monotonic() - t4
                nbytes += sum(t.numel() * t.element_size() for t in sends)
                calls += 1
                works, answers = [], []
                call, sends = following
            t_verify = time.monotonic()
            if samples:
                self._verify(members, samples, version)
            verify_s = time.monotonic() - t_verify
        except BaseException as e:
            failed = _failed_engines(members, answers, min(1.0, timeout))
            self._fail(members, works, answers, calls > 0 or bool(answers))
            works = []  # the traceback keeps this frame: hold no backend objects in it
            detail = "; ".join(f"{u}: {d}" for u, d in failed.items()) or _describe(e)
            raise WeightSyncError(f"weight update to version {version} failed: {detail}") from e
        self.version = version
        self._expected.update(dict.fromkeys(members, version))
        t_resume = time.monotonic()
        try:
            self._all_ok(members, lambda c: c.continue_generation(), "continue_generation")
        except WeightSyncError:
            self._broken = True  # updated, but an engine is gone: the next push rebuilds the group
            raise
        now = time.monotonic()
        times = SyncTimes(
            pause_s=pause_s, gather_s=gather_s, wire_s=wire_s, load_s=load_s, resume_s=now - t_resume,
            total_s=now - t_start, bytes=nbytes, engines=len(members), connect_s=connect_s,
            verify_s=verify_s, calls=calls, skipped=tuple(skipped),
        )  # fmt: skip
        if skipped:
            log.warning("engines_skipped", engines=skipped, version=version)
        log.info("weights_pushed", version=version, engines=len(members), calls=calls, **times.metrics())
        return times

    def _next_bucket(
        self, stream: Iterator[weight_sync.UpdateCall], samples: list[tuple[str, torch.Tensor]]
    ) -> tuple[weight_sync.UpdateCall | None, list[torch.Tensor]]:
        """The next call and what to broadcast for it, chosen to avoid copies: a bucket whose bytes
        are already one range goes as a flattened bucket (a view); otherwise on gloo each tensor is
        broadcast from its own memory (SGLang's per-tensor format; the embedded engine receives
        into its parameters), since on a CPU packing copies cost more than the extra broadcasts
        (242 MB: ~30 ms to pack, ~15 ms for 50 broadcasts); on NCCL the bucket is packed (a GPU
        copy is cheap, a collective's latency is not)."""
        call = next(stream, None)
        if call is None:
            return None, []
        if self.cfg.verify_checksum:
            samples += _samples(call.tensors, len(samples))
        tensors = [t for _, t in call.tensors]
        if (whole := self._packer.view(tensors)) is not None:
            return call, [whole]
        if self.backend == "gloo":
            per_tensor = weight_sync.UpdateCall(call.tensors, None, call.index, call.count)
            return per_tensor, [t.detach().to(self._packer.device).contiguous() for t in tensors]
        return call, [self._packer.pack(tensors)]

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

    def _verify(self, members: list[str], samples: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Every engine reports `version` and holds exactly the sent values of the sampled tensors."""

        async def check(c: EngineClient) -> list[str]:
            problems = []
            if (got := await c.weight_version()) != version:
                problems.append(f"weight_version {got}, expected {version}")
            for name, expected in samples:
                try:
                    rows = torch.tensor(
                        await c.get_weights_by_name(name, expected.shape[0]), dtype=torch.float32
                    )
                except (EngineError, TypeError, ValueError, RuntimeError) as e:
                    problems.append(f"{name}: {e}")
                    continue
                same = rows.shape == expected.shape and torch.equal(
                    rows.view(torch.int32), expected.view(torch.int32)
                )
                if not same:
                    problems.append(f"{name}: values differ from those sent")
            return problems

        results = self._each(members, check)
        bad = {u: r for u, r in results.items() if isinstance(r, BaseException) or r}
        if bad:
            raise WeightSyncError(f"verification failed: {bad}")

    def raw_broadcast(self, nbytes: int) -> float:
        """Seconds for one broadcast of `nbytes` as a single tensor to every engine of the group,
        posted like an update call: the wire's limit for an update of that size. The embedded engine
        drains it into a warm buffer and refuses the unknown name, loading nothing (for benchmarks;
        other servers may not refuse as cleanly)."""
        with self._lock:
            self._check_open()
            self._ensure_group()
            device = self._packer.device
            if self._raw is None or self._raw.numel() != nbytes:
                self._raw = torch.ones(nbytes, dtype=torch.uint8, device=device)  # touched: warm
            body = weight_sync.UpdateCall([(RAW_NAME, self._raw)], "flattened_bucket", 0, 1).request(
                self.group_name, flush_cache=False
            )
            answers = [self._submit(self._clients[u].update_weights(body)) for u in self.members]
            t0 = time.monotonic()
            work = dist.broadcast(self._raw, src=0, group=self._group, async_op=True)
            weight_sync.wait_work(work, self.cfg.timeout_s, gloo=self.backend == "gloo")
            seconds = time.monotonic() - t0
            cf.wait(answers, timeout=self.cfg.timeout_s)
            for f in answers:
                error = f.exception() if f.done() else TimeoutError("no answer")
                if error is not None and RAW_NAME not in str(error):
                    self._broken = True
                    raise WeightSyncError(f"raw broadcast failed: {_describe(error)}")
            return seconds

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
            self._packer.release()
            self._raw = None

            async def close_clients() -> None:
                await asyncio.gather(*(c.close() for c in self._clients.values()))

            self._run(close_clients(), timeout_s=10.0)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10.0)
            self._loop.close()


def _samples(tensors: list[tuple[str, torch.Tensor]], have: int) -> list[tuple[str, torch.Tensor]]:
    """The first and last tensor of a call (at most VERIFY_TENSORS in all): their first rows as float32."""
    picked = {0, len(tensors) - 1}
    out = []
    for i in sorted(picked):
        name, t = tensors[i]
        if have + len(out) >= VERIFY_TENSORS or t.dim() == 0 or t.numel() == 0:
            continue
        rows = max(1, min(100, VERIFY_ELEMENTS // max(1, t.numel() // t.shape[0])))
        out.append((name, t.detach()[:rows].to("cpu", torch.float32).clone()))
    return out


def _failed_engines(members: list[str], answers: list[cf.Future[str]], wait_s: float) -> dict[str, str]:
    """Engines whose request failed. A dead engine's request fails within moments of the broadcast
    error that may have been seen first, so wait that long: the error then names the engine."""
    if not answers:
        return {}
    cf.wait(answers, timeout=wait_s, return_when=cf.FIRST_EXCEPTION)
    return {
        u: _describe(error)
        for u, f in zip(members, answers, strict=True)
        if f.done() and not f.cancelled() and (error := f.exception()) is not None
    }


def _reason(error: BaseException | None) -> str | None:
    return None if error is None else f"an engine failed: {_describe(error)}"


def _describe(e: BaseException) -> str:
    """One line: gloo's messages run to several lines of advice."""
    text = str(e) if isinstance(e, WeightSyncError | EngineError) else f"{type(e).__name__}: {e}"
    line = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return line if len(line) <= 300 else line[:297] + "..."
