"""Message transport between the buffer and its clients: pyzmq ROUTER/DEALER, plus an in-process twin.

    generator --- DEALER (routing id = name) --+
    generator --- DEALER (routing id = name) --+--> ROUTER  Server (the buffer's one poll loop)
    learner   --- DEALER (routing id = name) --+      recv(timeout) -> (peer, Message) | None
                                                      send(peer, Message)

One frame per message: `messages.encode` out, `messages.decode` in, straight from the zmq frame buffer
(recv copy=False). Sends are copy=False; pyzmq still copies frames under zmq.COPY_THRESHOLD (64 KiB),
where zero-copy costs more than it saves. Clients (transport_client.py) send a Group as the
GroupFrame its producer wrote (group_frame.py): that frame goes on the wire as it is, so sending a
group never encodes or copies it. Clients: Client (sync), AsyncClient (asyncio), InprocClient
(transport_inproc.py).

Handshake. A client's first message is `Hello(role, name, protocol)`. The Server answers it itself with
`Ready(protocol, policy_version)` (the owner keeps `server.policy_version` current) and records the peer
in `server.peers` (name -> role); `on_hello` tells the owner about new and restarted peers, which never
see Hello otherwise. Another protocol gets Error("protocol"), a name that is not the routing id
Error("handshake"), and any message from a peer that has not said Hello Error("handshake_required"),
undelivered. A restarted server knows no peers, so an old client gets handshake_required: it reconnects.

Bad input never takes the server down: a frame `messages.decode` refuses is logged with the sender and
the reason, counted in `server.stats`, answered with Error("bad_frame" | "frame_too_large", detail) and
dropped. Frames over MAXMSGSIZE (2 x max_frame_bytes, a memory guard) are cut by libzmq before Python
sees them: that connection is dropped, not answered. A bad frame from the server raises WireError in
the client: the server is ours, so that is a bug to surface, not input to tolerate.

High-water marks (SNDHWM/RCVHWM, in messages) are not reached in normal operation: the buffer's
admission control bounds what is in flight. If they are, a DEALER blocks, so `Client.send` waits at
most `send_timeout_s` and raises TransportTimeout. The ROUTER is ROUTER_MANDATORY: `Server.send` to an
unknown or vanished peer raises PeerGone instead of dropping silently, and to a full peer (EAGAIN) it
retries until `send_timeout_s`, then raises TransportTimeout. Every receive takes a timeout. close()
never blocks; queued frames get LINGER_MS to leave.

Acknowledgements: the buffer gives every Group a GroupAck verdict, so a generator knows what arrived
and after a failure re-sends or releases the rest. `Server.ack` queues a verdict; a peer's queued
verdicts leave as one GroupAcks message once ACK_BATCH are queued or the oldest is ACK_DELAY_S
(50 ms) old, or at once when that peer sends AckRequest: the server then sends every verdict still
queued for what the peer sent before it (nothing if none is: those already left, or the frame was
refused with an Error). So a client that waits on its acks asks for them (`request` does), and one
that does not, a generator, never pays for the wait.
Why not an ack message per group: it wakes both processes and both zmq I/O threads; on
bench/transport.py that held streamrl to 0.6-0.75 of raw pyzmq, against 0.9-1.0 with no acks. Why
not "flush when the server has caught up": a buffer faster than its generators catches up after
almost every group, and a short wake-up timer to detect quiet costs 5-10 us of CPU per message on
this VM (each blocking receive arms it).

`request` is for strictly sequential exchanges; pipelined senders use `send` and `recv`. An Error
answering `request` or `connect` raises RemoteError (a TransportError), since it is never the reply
asked for; `recv` returns Error messages as they are.
"""

from __future__ import annotations

import ctypes
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Self

import zmq
import zmq.asyncio

from streamrl import messages
from streamrl.errors import (
    DecodeError,
    FrameTooLarge,
    PeerGone,
    TransportError,
    TransportTimeout,
)
from streamrl.log import get_logger
from streamrl.messages import (
    DEFAULT_MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    AckRequest,
    Error,
    GroupAck,
    GroupAcks,
    Hello,
    Message,
    Ready,
)

DEFAULT_HWM = 256  # messages; a 2G=32 group of 1k-token trajectories is about 420 KB
LINGER_MS = 200
ACK_BATCH = 128  # a peer's queued GroupAcks that leave at once
ACK_DELAY_S = 0.05  # the longest a GroupAck waits for others to share its message
log = get_logger(__name__)
Buffer = bytes | bytearray | memoryview


def tune_allocator() -> bool:
    """Keep glibc from unmapping and re-faulting the heap on every large frame; True if applied.

    Streaming 400 KB frames allocates and frees a fresh buffer per message (encode on one side, libzmq's
    receive buffer on the other). With glibc's defaults the freed top of the heap is trimmed and then
    page-faulted back in for the next message, which measured ~1.5x slower group streaming here. Roles
    that move groups call this once at start; it changes only this process's allocator thresholds.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False  # not glibc: nothing to tune
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    return bool(
        libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum; frames stay on the heap
        and libc.mallopt(m_trim_threshold, 512 << 20)
        and libc.mallopt(m_top_pad, 64 << 20)
    )


def timeout_ms(timeout_s: float) -> int:
    return max(0, math.ceil(timeout_s * 1000))


class Timeouts:
    """Blocking sends and zero-copy receives bounded by SNDTIMEO/RCVTIMEO, for one socket.

    Why not poll, then a non-blocking call: that builds a Poller and makes a poll system call per
    message, and a sender ahead of its receiver raises zmq.Again at the high-water mark on every
    send; measured, 10-20 us of CPU per 420 KB group on each side, a tenth of moving the group. The
    option is set only when the timeout asked for changes.
    """

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self.sock, self._recv_ms, self._send_ms = sock, -2, -2

    def recv(self, timeout_s: float) -> list[zmq.Frame] | None:
        """The next message's frames, or None after `timeout_s`."""
        if (ms := timeout_ms(timeout_s)) != self._recv_ms:
            self.sock.setsockopt(zmq.RCVTIMEO, ms)
            self._recv_ms = ms
        try:
            return self.sock.recv_multipart(copy=False)
        except zmq.Again:
            return None

    def send(self, frame: Buffer, timeout_s: float) -> bool:
        """Send a one-frame message; False if the socket could not take it within `timeout_s`."""
        if (ms := timeout_ms(timeout_s)) != self._send_ms:
            self.sock.setsockopt(zmq.SNDTIMEO, ms)
            self._send_ms = ms
        try:
            self.sock.send(frame, copy=False)
        except zmq.Again:
            return False
        return True


def make_socket(ctx: zmq.Context[Any], kind: int, hwm: int, max_frame_bytes: int) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = ctx.socket(kind)
    # close() returns at once; zmq keeps flushing what was queued (a last GroupAck) for LINGER_MS.
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, 2 * max_frame_bytes)
    return sock


class Server:
    """The buffer's ROUTER socket, for one thread's poll loop; `address` may end in ':*' (tcp, any port).

    `peers` (name -> role) holds every peer that completed the handshake, `stats` counts frames
    (received, delivered, sent, hello, rejected, rejected_<code>, reply_failed).
    """

    def __init__(
        self,
        address: str,
        *,
        name: str = "buffer",
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        hwm: int = DEFAULT_HWM,
        policy_version: int = 0,
        send_timeout_s: float = 1.0,
        on_hello: Callable[[str, Hello], None] | None = None,
    ) -> None:
        self._setup(name, max_frame_bytes, policy_version, send_timeout_s, on_hello)
        self._sock = make_socket(zmq.Context.instance(), zmq.ROUTER, hwm, max_frame_bytes)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable -> EHOSTUNREACH, not a silent drop
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted client under the same name takes over
        try:
            self._sock.bind(address)
        except zmq.ZMQError as e:
            self._sock.close()
            raise TransportError(f"cannot bind {address}: {e}") from e
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)  # the resolved port for ':*'
        self._io = Timeouts(self._sock)

    def _setup(
        self,
        name: str,
        max_frame_bytes: int,
        policy_version: int,
        send_timeout_s: float,
        on_hello: Callable[[str, Hello], None] | None,
    ) -> None:
        self.name, self.max_frame_bytes, self.send_timeout_s = name, max_frame_bytes, send_timeout_s
        self.policy_version = policy_version  # the owner keeps it current; every Ready carries it
        self.on_hello = on_hello
        self.peers: dict[str, str] = {}
        self.stats: Counter[str] = Counter()
        self._acks: dict[str, list[GroupAck]] = {}  # queued verdicts per peer, oldest first
        self._acks_due = 0.0  # when the oldest queued verdict must leave

    def recv(self, timeout_s: float) -> tuple[str, Message] | None:
        """The next delivered (peer, message), or None after `timeout_s`. Never raises for bad input.

        Sends queued acks when due (see the module docstring), waking up for that if need be.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            if self._acks and now >= self._acks_due:
                self.flush_acks()
            wake = min(deadline, self._acks_due) if self._acks else deadline
            raw = self._recv_raw(max(0.0, wake - now))
            if raw is not None and (got := self._admit(*raw)) is not None:
                return got
            if time.monotonic() >= deadline:  # a flood of rejected frames must not hold the loop here
                return None

    def ack(self, peer: str, ack: GroupAck) -> None:
        """Queue a Group's verdict for `peer`; see the module docstring for when it leaves."""
        if not self._acks:
            self._acks_due = time.monotonic() + ACK_DELAY_S
        queued = self._acks.setdefault(peer, [])
        queued.append(ack)
        if len(queued) >= ACK_BATCH:
            self._flush_acks(peer, self.send_timeout_s)

    def flush_acks(self, timeout_s: float | None = None) -> None:
        """Send every queued ack now. Acks a peer cannot take are logged and counted, not raised:
        the peer resends those groups and gets them acknowledged as duplicates."""
        for peer in list(self._acks):
            self._flush_acks(peer, self.send_timeout_s if timeout_s is None else timeout_s)

    def _flush_acks(self, peer: str, timeout_s: float) -> None:
        acks = self._acks.pop(peer)
        try:
            self._send_raw(peer.encode(), messages.encode(GroupAcks(acks=acks)), timeout_s)
            self.stats["sent"] += 1
        except TransportError as e:
            if isinstance(e, PeerGone):
                self.peers.pop(peer, None)
            self.stats["acks_lost"] += len(acks)
            uids = [a.uid for a in acks]
            log.warning("acks_lost", server=self.name, peer=peer, uids=uids, error=str(e))

    def send(self, peer: str, msg: Message) -> None:
        """Send to a peer; PeerGone if it is unknown or gone, TransportTimeout if it stays full."""
        try:
            self._send_raw(peer.encode(), messages.encode(msg), self.send_timeout_s)
        except PeerGone:
            self.peers.pop(peer, None)
            raise
        self.stats["sent"] += 1

    def close(self) -> None:
        self.flush_acks(0.0)  # best effort, never blocking: close() returns at once
        self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _admit(self, ident: bytes, frames: list[Buffer]) -> tuple[str, Message] | None:
        peer = ident.decode("utf-8", "backslashreplace")
        self.stats["received"] += 1
        try:
            if len(frames) != 1:
                raise DecodeError(f"{len(frames)} frames in one message, expected 1")
            msg = messages.decode(frames[0], self.max_frame_bytes)
        except FrameTooLarge as e:
            self._reject(ident, peer, "frame_too_large", str(e))
            return None
        except DecodeError as e:
            self._reject(
                ident, peer, "bad_frame", f"cannot decode a {sum(map(len, frames))}-byte message: {e}"
            )
            return None
        if isinstance(msg, Hello):
            self._hello(ident, peer, msg)
        elif isinstance(msg, AckRequest):  # nothing queued: the acks left, or the frame was refused
            if peer in self._acks:
                self._flush_acks(peer, self.send_timeout_s)
        elif peer not in self.peers:
            self._reject(
                ident, peer, "handshake_required", f"{type(msg).__name__} from {peer!r} before Hello"
            )
        else:
            self.stats["delivered"] += 1
            return peer, msg
        return None

    def _hello(self, ident: bytes, peer: str, hello: Hello) -> None:
        if hello.protocol != PROTOCOL_VERSION:
            detail = f"{peer!r} speaks protocol {hello.protocol}, {self.name} speaks {PROTOCOL_VERSION}"
            self._reject(ident, peer, "protocol", detail)
        elif hello.name != peer:
            self._reject(ident, peer, "handshake", f"Hello name {hello.name!r} is not routing id {peer!r}")
        else:
            rejoined = peer in self.peers
            self.peers[peer] = hello.role
            self.stats["hello"] += 1
            log.info("peer_ready", server=self.name, peer=peer, peer_role=hello.role, rejoined=rejoined)
            self._reply(ident, peer, Ready(protocol=PROTOCOL_VERSION, policy_version=self.policy_version))
            if self.on_hello is not None:
                self.on_hello(peer, hello)

    def _reject(self, ident: bytes, peer: str, code: str, detail: str) -> None:
        self.stats["rejected"] += 1
        self.stats[f"rejected_{code}"] += 1
        log.warning("frame_rejected", server=self.name, peer=peer, code=code, error=detail)
        self._reply(ident, peer, Error(code=code, detail=detail))

    def _reply(self, ident: bytes, peer: str, msg: Message) -> None:
        # Best effort and non-blocking: a misbehaving peer must not stall or crash the poll loop.
        try:
            self._send_raw(ident, messages.encode(msg), 0.0)
            self.stats["sent"] += 1
        except TransportError as e:
            self.stats["reply_failed"] += 1
            log.warning("reply_failed", server=self.name, peer=peer, reply=type(msg).__name__, error=str(e))

    def _recv_raw(self, timeout_s: float) -> tuple[bytes, list[Buffer]] | None:
        if (got := self._io.recv(timeout_s)) is None:
            return None
        ident, *frames = got
        return ident.bytes, [f.buffer for f in frames]  # views into zmq's buffers: decoded without a copy

    def _send_raw(self, ident: bytes, data: Buffer, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._sock.send_multipart([ident, data], zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                # ROUTER POLLOUT is not per peer, so back off briefly and retry until the deadline.
                if time.monotonic() >= deadline:
                    raise TransportTimeout(f"{self.address}: peer {ident!r} full for {timeout_s}s") from None
                time.sleep(0.001)
            except zmq.ZMQError as e:
                if e.errno == zmq.EHOSTUNREACH:
                    raise PeerGone(f"{self.address}: no peer {ident!r}") from None
                raise TransportError(f"{self.address}: send to {ident!r}: {e}") from e
