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

Forming, re-forming and unwinding the group is `EngineGroup`'s (streamrl.weight_group), the base
class; the copy avoidance and bucket streaming are in streamrl.weight_buckets.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from streamrl import weight_buckets, weight_sync
from streamrl.errors import WeightSyncError
from streamrl.log import get_logger
from streamrl.weight_group import EngineGroup, describe_error, engine_failure, failed_engines, first_error
from workers.engines.client import EngineClient, EngineError

log = get_logger(__name__)
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


class WeightPusher(EngineGroup):
    """Pushes weight versions to a set of engines (see the module docstring); the group and its
    recovery are `EngineGroup`'s."""

    version: int | None = None  # the last version pushed
    _raw: torch.Tensor | None = None  # raw_broadcast's tensor, kept warm between calls

    @functools.cached_property
    def _packer(self) -> weight_buckets.BucketPacker:
        return weight_buckets.BucketPacker(self.device)

    def __enter__(self) -> WeightPusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
            stream = weight_buckets.stream_updates(it, self.cfg.bucket_mb << 20)
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
                    weight_sync.wait_work(
                        work, left, lambda a=answers: engine_failure(first_error(a)), gloo=gloo
                    )
                t4 = time.monotonic()
                cf.wait(answers, timeout=timeout, return_when=cf.FIRST_EXCEPTION)
                if error := first_error(answers):
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
            failed = failed_engines(members, answers, min(1.0, timeout))
            self._fail(members, works, answers, calls > 0 or bool(answers))
            works = []  # the traceback keeps this frame: hold no backend objects in it
            detail = "; ".join(f"{u}: {d}" for u, d in failed.items()) or describe_error(e)
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
                    raise WeightSyncError(f"raw broadcast failed: {describe_error(error)}")
            return seconds

    # ------------------------------------------------------------------ shutting down

    def close(self) -> None:
        """Leave the group (here and, best effort, on the engines), stop the HTTP thread, and free
        the packing buffers."""
        with self._lock:
            super().close()
            self._packer.release()
            self._raw = None


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
