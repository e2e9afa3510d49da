"""The clients of the buffer's Server (transport.py, which states the protocol's rules).

    client = Client(address, role="generator", name="gen-0")     # a DEALER, routing id = name
    client.connect(timeout_s)                                      # Hello -> Ready
    client.send(msg_or_group_frame); client.recv(timeout_s) -> Message | None
    client.request(msg, timeout_s) -> Message                      # send, then the next reply

AsyncClient has the same methods for asyncio code (zmq.asyncio), awaitable.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Self

import zmq
import zmq.asyncio

from streamrl import messages
from streamrl.errors import RemoteError, TransportError, TransportTimeout
from streamrl.group_frame import GroupFrame
from streamrl.messages import (
    DEFAULT_MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    AckRequest,
    Error,
    Group,
    Hello,
    Message,
    Ready,
)
from streamrl.transport import DEFAULT_HWM, Buffer, Timeouts, make_socket, timeout_ms

Outgoing = Message | GroupFrame  # what clients send: a message, or a group already on its wire form


def _frame(msg: Outgoing) -> Buffer:
    return msg.data if isinstance(msg, GroupFrame) else messages.encode(msg)


def _name(msg: Outgoing) -> str:
    return "Group" if isinstance(msg, GroupFrame) else type(msg).__name__


def _is_group(msg: Outgoing) -> bool:
    return isinstance(msg, GroupFrame | Group)


class _ClientBase:
    """What Client, AsyncClient and InprocClient share: identity, socket set-up, reply rules."""

    _context: type[zmq.Context[Any]] = zmq.Context  # whose instance() makes the DEALER

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
        self._sock: Any = self._dealer(self._context.instance(), hwm)

    def _setup(self, address: str, role: str, name: str, max_frame_bytes: int, send_timeout_s: float) -> None:
        self.address, self.role, self.name = address, role, name
        self.max_frame_bytes, self.send_timeout_s = max_frame_bytes, send_timeout_s
        self.ready: Ready | None = None  # the server's Ready from the last connect

    def _dealer(self, ctx: zmq.Context[Any], hwm: int) -> zmq.Socket[Any]:
        sock = make_socket(ctx, zmq.DEALER, hwm, self.max_frame_bytes)
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

    @functools.cached_property
    def _io(self) -> Timeouts:
        return Timeouts(self._sock)

    def connect(self, timeout_s: float) -> Ready:
        """Hello/Ready handshake; TransportTimeout if no Ready within `timeout_s`, RemoteError if refused."""
        deadline = time.monotonic() + timeout_s
        try:
            self._send_raw(self._hello(), timeout_s)
        except TransportTimeout:
            raise self._no_server(timeout_s) from None
        return self._check_ready(self.recv(max(0.0, deadline - time.monotonic())), timeout_s)

    def send(self, msg: Outgoing) -> None:
        self._send_raw(_frame(msg), self.send_timeout_s)

    def recv(self, timeout_s: float) -> Message | None:
        """The next message from the server (Error included), or None after `timeout_s`."""
        return self._decode(self._recv_raw(timeout_s))

    def request(self, msg: Outgoing, timeout_s: float) -> Message:
        """Send `msg` and return the next reply; TransportTimeout, or RemoteError for an Error reply.

        A Group's reply is its GroupAcks: the request asks for it at once (AckRequest).
        """
        self.send(msg)
        if _is_group(msg):
            self.send(AckRequest())
        return self._check_reply(_name(msg), self.recv(timeout_s), timeout_s)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send_raw(self, data: Buffer, timeout_s: float) -> None:
        if not self._io.send(data, timeout_s):
            raise self._send_blocked(timeout_s)

    def _recv_raw(self, timeout_s: float) -> Buffer | None:
        got = self._io.recv(timeout_s)
        return None if got is None else got[0].buffer


class AsyncClient(_ClientBase):
    """Client for asyncio code (zmq.asyncio): the same methods, awaitable; close() is plain."""

    _context = zmq.asyncio.Context

    async def connect(self, timeout_s: float) -> Ready:
        deadline = time.monotonic() + timeout_s
        try:
            await self._send_raw(self._hello(), timeout_s)
        except TransportTimeout:
            raise self._no_server(timeout_s) from None
        return self._check_ready(await self.recv(max(0.0, deadline - time.monotonic())), timeout_s)

    async def send(self, msg: Outgoing) -> None:
        await self._send_raw(_frame(msg), self.send_timeout_s)

    async def recv(self, timeout_s: float) -> Message | None:
        return self._decode(await self._recv_raw(timeout_s))

    async def request(self, msg: Outgoing, timeout_s: float) -> Message:
        await self.send(msg)
        if _is_group(msg):
            await self.send(AckRequest())
        return self._check_reply(_name(msg), await self.recv(timeout_s), timeout_s)

    def close(self) -> None:
        self._sock.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    async def _send_raw(self, data: Buffer, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await self._sock.send(data, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                remaining = deadline - time.monotonic()
                # pyzmq 27's type hints for the asyncio poll lack `flags`; the method takes it.
                if remaining <= 0 or not await self._sock.poll(timeout_ms(remaining), zmq.POLLOUT):  # type: ignore[call-arg]
                    raise self._send_blocked(timeout_s) from None

    async def _recv_raw(self, timeout_s: float) -> Buffer | None:
        if not await self._sock.poll(timeout_ms(timeout_s), zmq.POLLIN):  # type: ignore[call-arg]
            return None
        return (await self._sock.recv(zmq.NOBLOCK, copy=False)).buffer
