"""Message transport between the buffer and its clients: pyzmq ROUTER/DEALER, plus an in-process twin.

    generator --- DEALER (routing id = name) --+
    generator --- DEALER (routing id = name) --+--> ROUTER  Server (the buffer's one poll loop)
    learner   --- DEALER (routing id = name) --+      recv(timeout) -> (peer, Message) | None
                                                      send(peer, Message)

One frame per message: `messages.encode` out, `messages.decode` in, straight from the zmq frame buffer
(recv copy=False). Sends are copy=False; pyzmq still copies frames under zmq.COPY_THRESHOLD (64 KiB),
where zero-copy costs more than it saves. Clients: Client (sync), AsyncClient (asyncio), InprocClient.

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

Acknowledgements are the owner's protocol, not the transport's: the buffer answers each Group with a
GroupAck, so a generator knows what arrived, keeps a bounded window of un-acked groups, and after a
failure re-sends or releases the rest. `request` is for strictly sequential exchanges; pipelined
senders use `send` and `recv`. An Error answering `request` or `connect` raises RemoteError (a
TransportError), since it is never the reply asked for; `recv` returns Error messages as they are.
"""

from __future__ import annotations

import ctypes
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Self, cast

import zmq
import zmq.asyncio

from streamrl import messages
from streamrl.errors import (
    DecodeError,
    FrameTooLarge,
    PeerGone,
    RemoteError,
    TransportError,
    TransportTimeout,
)
from streamrl.log import get_logger
from streamrl.messages import DEFAULT_MAX_FRAME_BYTES, PROTOCOL_VERSION, Error, Hello, Message, Ready

DEFAULT_HWM = 256  # messages; a 2G=32 group of 1k-token trajectories is about 420 KB
LINGER_MS = 200
log = get_logger(__name__)
Buffer = bytes | memoryview


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


def _ms(timeout_s: float) -> int:
    return max(0, math.ceil(timeout_s * 1000))


def _socket(ctx: zmq.Context[Any], kind: int, hwm: int, max_frame_bytes: int) -> zmq.Socket[Any]:
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
        self._sock = _socket(zmq.Context.instance(), zmq.ROUTER, hwm, max_frame_bytes)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable -> EHOSTUNREACH, not a silent drop
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted client under the same name takes over
        try:
            self._sock.bind(address)
        except zmq.ZMQError as e:
            self._sock.close()
            raise TransportError(f"cannot bind {address}: {e}") from e
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)  # the resolved port for ':*'

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

    def recv(self, timeout_s: float) -> tuple[str, Message] | None:
        """The next delivered (peer, message), or None after `timeout_s`. Never raises for bad input."""
        deadline = time.monotonic() + timeout_s
        while (raw := self._recv_raw(max(0.0, deadline - time.monotonic()))) is not None:
            if (got := self._admit(*raw)) is not None:
                return got
            if time.monotonic() >= deadline:  # a flood of rejected frames must not hold the loop here
                break
        return None

    def send(self, peer: str, msg: Message) -> None:
        """Send to a peer; PeerGone if it is unknown or gone, TransportTimeout if it stays full."""
        try:
            self._send_raw(peer.encode(), messages.encode(msg), self.send_timeout_s)
        except PeerGone:
            self.peers.pop(peer, None)
            raise
        self.stats["sent"] += 1

    def close(self) -> None:
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
        if not self._sock.poll(_ms(timeout_s), zmq.POLLIN):
            return None
        ident, *frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
        return ident.bytes, [f.buffer for f in frames]  # views into zmq's buffers: decoded without a copy

    def _send_raw(self, ident: bytes, data: bytes, timeout_s: float) -> None:
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


class _ClientBase:
    """What Client, AsyncClient and InprocClient share: identity, socket set-up, reply rules."""

    def _setup(self, address: str, role: str, name: str, max_frame_bytes: int, send_timeout_s: float) -> None:
        self.address, self.role, self.name = address, role, name
        self.max_frame_bytes, self.send_timeout_s = max_frame_bytes, send_timeout_s
        self.ready: Ready | None = None  # the server's Ready from the last connect

    def _dealer(self, ctx: zmq.Context[Any], hwm: int) -> zmq.Socket[Any]:
        sock = _socket(ctx, zmq.DEALER, hwm, self.max_frame_bytes)
        sock.setsockopt(zmq.ROUTING_ID, self.name.encode())
        # IMMEDIATE: while the buffer is unreachable, send waits (bounded) instead of queueing silently.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.connect(self.address)
        return sock

    def _send_blocked(self, timeout_s: float) -> TransportTimeout:
        why = "server unreachable or high-water mark reached"
        return TransportTimeout(f"send to {self.address} blocked for {timeout_s}s ({why})")

    def _hello(self) -> bytes:
        return messages.encode(Hello(role=self.role, name=self.name, protocol=PROTOCOL_VERSION))

    def _no_server(self, timeout_s: float) -> TransportTimeout:
        return TransportTimeout(f"connect to {self.address}: no server reachable within {timeout_s}s")

    def _decode(self, frame: Buffer | None) -> Message | None:
        return None if frame is None else messages.decode(frame, self.max_frame_bytes)

    def _check_reply(self, asked: str, reply: Message | None, timeout_s: float) -> Message:
        if reply is None:
            raise TransportTimeout(f"no reply to {asked} from {self.address} within {timeout_s}s")
        if isinstance(reply, Error):
            raise RemoteError(reply.code, reply.detail, self.address)
        return reply

    def _check_ready(self, reply: Message | None, timeout_s: float) -> Ready:
        reply = self._check_reply("Hello", reply, timeout_s)
        if not isinstance(reply, Ready):
            raise TransportError(f"{self.address} answered Hello with {type(reply).__name__}, not Ready")
        self.ready = reply
        return reply


class Client(_ClientBase):
    """A DEALER connected to the buffer, routing id = `name`. Not thread-safe: one thread uses it."""

    def __init__(
        self,
        address: str,
        *,
        role: str,
        name: str,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        hwm: int = DEFAULT_HWM,
        send_timeout_s: float = 5.0,
    ) -> None:
        self._setup(address, role, name, max_frame_bytes, send_timeout_s)
        self._sock = self._dealer(zmq.Context.instance(), hwm)

    def connect(self, timeout_s: float) -> Ready:
        """Hello/Ready handshake; TransportTimeout if no Ready within `timeout_s`, RemoteError if refused."""
        deadline = time.monotonic() + timeout_s
        try:
            self._send_raw(self._hello(), timeout_s)
        except TransportTimeout:
            raise self._no_server(timeout_s) from None
        return self._check_ready(self.recv(max(0.0, deadline - time.monotonic())), timeout_s)

    def send(self, msg: Message) -> None:
        self._send_raw(messages.encode(msg), self.send_timeout_s)

    def recv(self, timeout_s: float) -> Message | None:
        """The next message from the server (Error included), or None after `timeout_s`."""
        return self._decode(self._recv_raw(timeout_s))

    def request(self, msg: Message, timeout_s: float) -> Message:
        """Send `msg` and return the next reply; TransportTimeout, or RemoteError for an Error reply."""
        self.send(msg)
        return self._check_reply(type(msg).__name__, self.recv(timeout_s), timeout_s)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send_raw(self, data: bytes, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._sock.send(data, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._sock.poll(_ms(remaining), zmq.POLLOUT):
                    raise self._send_blocked(timeout_s) from None

    def _recv_raw(self, timeout_s: float) -> Buffer | None:
        if not self._sock.poll(_ms(timeout_s), zmq.POLLIN):
            return None
        return self._sock.recv(zmq.NOBLOCK, copy=False).buffer


class AsyncClient(_ClientBase):
    """Client for asyncio code (zmq.asyncio): the same methods, awaitable; close() is plain."""

    def __init__(
        self,
        address: str,
        *,
        role: str,
        name: str,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        hwm: int = DEFAULT_HWM,
        send_timeout_s: float = 5.0,
    ) -> None:
        self._setup(address, role, name, max_frame_bytes, send_timeout_s)
        self._sock = cast(zmq.asyncio.Socket, self._dealer(zmq.asyncio.Context.instance(), hwm))

    async def connect(self, timeout_s: float) -> Ready:
        deadline = time.monotonic() + timeout_s
        try:
            await self._send_raw(self._hello(), timeout_s)
        except TransportTimeout:
            raise self._no_server(timeout_s) from None
        return self._check_ready(await self.recv(max(0.0, deadline - time.monotonic())), timeout_s)

    async def send(self, msg: Message) -> None:
        await self._send_raw(messages.encode(msg), self.send_timeout_s)

    async def recv(self, timeout_s: float) -> Message | None:
        return self._decode(await self._recv_raw(timeout_s))

    async def request(self, msg: Message, timeout_s: float) -> Message:
        await self.send(msg)
        return self._check_reply(type(msg).__name__, await self.recv(timeout_s), timeout_s)

    def close(self) -> None:
        self._sock.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    async def _send_raw(self, data: bytes, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await self._sock.send(data, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                remaining = deadline - time.monotonic()
                # pyzmq 27's type hints for the asyncio poll lack `flags`; the method takes it.
                if remaining <= 0 or not await self._sock.poll(_ms(remaining), zmq.POLLOUT):  # type: ignore[call-arg]
                    raise self._send_blocked(timeout_s) from None

    async def _recv_raw(self, timeout_s: float) -> Buffer | None:
        if not await self._sock.poll(_ms(timeout_s), zmq.POLLIN):  # type: ignore[call-arg]
            return None
        return (await self._sock.recv(zmq.NOBLOCK, copy=False)).buffer
