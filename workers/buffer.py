"""The buffer role: a ReplayBuffer behind the transport's ROUTER socket, in one poll loop.

    python -m workers.buffer --job JOB.yaml --address ipc:///tmp/run/buffer.sock [--resume SNAPSHOT]

The loop answers every request (see streamrl/messages.py for the conversation), presumes a generator
dead after `buffer.heartbeat_timeout_s` of silence (or when it says Hello again after a restart) and
re-dispatches what it held, and logs counters every few seconds. A bad message is answered with an
Error naming the problem and never stops the loop; SIGTERM or a Shutdown message stops it cleanly.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from streamrl import log
from streamrl.buffer import ReplayBuffer, read_snapshot, write_snapshot
from streamrl.config import JobSpec
from streamrl.config_load import load_job_or_exit
from streamrl.data import train_source
from streamrl.errors import PeerGone, TransportTimeout
from streamrl.messages import (
    BatchRequest,
    Error,
    Group,
    GroupAck,
    Heartbeat,
    Hello,
    Message,
    NoBatch,
    PromptRelease,
    PromptRequest,
    Prompts,
    Shutdown,
    SnapshotDone,
    SnapshotRequest,
    WeightsPublished,
)
from streamrl.transport import Server, tune_allocator
from streamrl.transport_inproc import InprocServer

logger = log.get_logger("workers.buffer")
STATS_EVERY_S = 10.0


class BufferRole:
    """Dispatches decoded messages to the ReplayBuffer and tracks generator liveness."""

    def __init__(self, buffer: ReplayBuffer, server: Server | InprocServer, metrics: Any = None) -> None:
        self.buffer, self.server, self.metrics = buffer, server, metrics
        self.last_seen: dict[str, float] = {}
        self.stopping = threading.Event()
        server.on_hello = self._on_hello
        server.policy_version = buffer.version

    def _on_hello(self, peer: str, hello: Hello) -> None:
        # A generator that says Hello again has restarted: whatever it held died with it.
        if hello.role == "generator" and (n := self.buffer.expire(peer)):
            logger.warning("generator_restarted", peer=peer, redispatched=n)
        self.last_seen[peer] = time.monotonic()

    def handle(self, peer: str, msg: Message) -> Message | GroupAck | None:
        b = self.buffer
        match msg:
            case PromptRequest(max_prompts=k):
                prompts = b.admit(peer, k)
                return Prompts(
                    prompts=prompts, policy_version=b.version, retry_after_s=0.0 if prompts else 0.05
                )
            case Group():
                ack = b.add_group(msg)
                if ack.status == "rejected":
                    logger.warning("group_rejected", peer=peer, uid=msg.uid, detail=ack.detail)
                return ack
            case PromptRelease(uids=uids, reason=reason):
                logger.info("prompts_released", peer=peer, n=b.release(uids, reason), reason=reason)
                return None
            case BatchRequest(step=step):
                batch = b.next_batch(step)
                if batch is None:
                    return NoBatch(step=step, ready_groups=len(b.ready), retry_after_s=0.05)
                return batch
            case WeightsPublished(version=version, step=step):
                if not b.on_weights_published(version, step):
                    return Error(code="version", detail=f"version {version} is older than {b.version}")
                self.server.policy_version = b.version
                log.bind(policy_version=b.version, step=step)
                return None
            case SnapshotRequest(step=step, path=path):
                write_snapshot(b.snapshot(step), path)
                logger.info("snapshot_written", step=step, path=path)
                return SnapshotDone(step=step, path=path)
            case Heartbeat():
                return None
            case Shutdown(reason=reason):
                logger.info("shutdown_requested", peer=peer, reason=reason)
                self.stopping.set()
                return None
            case _:
                return Error(
                    code="unexpected", detail=f"the buffer does not accept {type(msg).__name__} messages"
                )

    def expire_silent(self, now: float, timeout_s: float) -> None:
        for peer, seen in list(self.last_seen.items()):
            if now - seen > timeout_s and self.server.peers.get(peer) == "generator":
                n = self.buffer.expire(peer)
                del self.last_seen[peer]
                logger.warning(
                    "generator_presumed_dead", peer=peer, silent_s=round(now - seen, 1), redispatched=n
                )

    def serve(
        self, heartbeat_timeout_s: float, poll_s: float = 0.2, on_tick: Callable[[], None] | None = None
    ) -> None:
        next_stats = time.monotonic() + STATS_EVERY_S
        while not self.stopping.is_set():
            item = self.server.recv(poll_s)
            now = time.monotonic()
            if item is not None:
                peer, msg = item
                self.last_seen[peer] = now
                try:
                    reply = self.handle(peer, msg)
                except Exception as e:  # a bug must not take the buffer down: answer and log it
                    logger.exception("handler_failed", peer=peer, message=type(msg).__name__)
                    reply = Error(code="internal", detail=f"{type(e).__name__}: {e}")
                if isinstance(reply, GroupAck):
                    self.server.ack(peer, reply)  # verdicts leave batched (transport.py)
                elif reply is not None:
                    try:
                        self.server.send(peer, reply)
                    except (PeerGone, TransportTimeout) as e:
                        logger.warning("reply_lost", peer=peer, reply=type(reply).__name__, error=str(e))
            self.expire_silent(now, heartbeat_timeout_s)
            if now >= next_stats:
                self.log_stats()
                next_stats = now + STATS_EVERY_S
            if on_tick is not None:
                on_tick()
        self.log_stats()

    def log_stats(self) -> None:
        b = self.buffer
        logger.info(
            "buffer_stats",
            version=b.version,
            ready=len(b.ready),
            in_flight=len(b.in_flight),
            capacity=b.capacity(),
            counters=dict(b.counters),
            staleness=dict(b.staleness),
            transport=dict(self.server.stats),
        )
        if self.metrics is not None:
            self.metrics.write(buffer_metrics(b), step=b.version)


def buffer_metrics(b: ReplayBuffer) -> dict[str, Any]:
    """Counters as a metrics record: totals since start plus the RoC keep rates."""
    c = b.counters
    completed = c["accepted"] + sum(v for k, v in c.items() if k.startswith("dropped_roc"))
    return {
        "ready": len(b.ready),
        "in_flight": len(b.in_flight),
        "capacity": b.capacity(),
        **c,
        "staleness": {str(k): v for k, v in b.staleness.items()},
        # Groups that survived RoC's filters (reject-equal-reward, empty selections) ...
        "roc_keep_rate": c["accepted"] / completed if completed else None,
        # ... and trajectories kept (down-sampling and filtering) among all received.
        "roc_trajectory_keep_rate": c["trajectories_kept"] / c["trajectories_in"]
        if c["trajectories_in"]
        else None,
    }


def build(spec: JobSpec, resume: str | None = None) -> ReplayBuffer:
    buffer = ReplayBuffer(spec, *train_source(spec.data))
    if resume:
        buffer.restore(read_snapshot(resume))
    return buffer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="workers.buffer", description="the replay-buffer role")
    ap.add_argument("--job", required=True, help="job spec YAML")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--address", required=True, help="ipc:// or tcp:// address to bind")
    ap.add_argument("--resume", help="buffer snapshot to restore")
    ap.add_argument("--log-file", help="append JSON log lines here instead of stderr")
    ap.add_argument("--metrics-dir", type=Path, help="run dir for metrics-buffer-buffer.jsonl")
    args = ap.parse_args(argv)
    spec = load_job_or_exit(args.job, args.overrides)
    log.configure("buffer", level=spec.logging.level, json_file=args.log_file)
    tune_allocator()
    buffer = build(spec, args.resume)
    with Server(args.address, max_frame_bytes=spec.buffer.max_frame_mb << 20) as server:
        metrics = None
        if args.metrics_dir is not None:
            from streamrl.metrics import MetricsWriter

            metrics = MetricsWriter(args.metrics_dir, "buffer", "buffer", tensorboard=False)
        role = BufferRole(buffer, server, metrics)
        signal.signal(signal.SIGTERM, lambda *_: role.stopping.set())
        signal.signal(signal.SIGINT, lambda *_: role.stopping.set())
        logger.info(
            "buffer_serving", address=server.address, version=buffer.version, resumed=bool(args.resume)
        )
        if args.resume:
            logger.info(
                "buffer_restored",
                path=str(Path(args.resume)),
                ready=len(buffer.ready),
                redispatch=len(buffer.redispatch),
                cursor=buffer.position,
            )
        role.serve(spec.buffer.heartbeat_timeout_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
