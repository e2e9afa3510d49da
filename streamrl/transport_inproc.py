"""The in-process twin of the ZeroMQ transport, for tests of role loops without sockets.

Same interface and rules as `transport.Server`/`transport_client.Client` (handshake, rejection of bad
frames, bounded waits): only the byte-moving methods differ.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from streamrl.errors import PeerGone, TransportTimeout
from streamrl.messages import DEFAULT_MAX_FRAME_BYTES, Hello
from streamrl.transport import DEFAULT_HWM, Buffer, Server
from streamrl.transport_client import Client


class InprocHub:
    """One in-process 'address' for tests of role loops without sockets: a server and its clients.

    InprocServer and InprocClient subclass Server and Client, so role loops typed against those accept
    them; only the byte-moving methods differ. Thread-safe queues carry encoded bytes, so every message
    still goes through encode/decode under the Server's own rules. Queues hold `hwm` messages.
    """

    def __init__(self, *, hwm: int = DEFAULT_HWM) -> None:
        self.hwm, self.address = hwm, f"inproc-hub:{id(self):x}"
        self._inbox: queue.Queue[tuple[bytes, list[Buffer]]] = queue.Queue(hwm)
        self._clients: dict[bytes, queue.Queue[Buffer]] = {}
        self._lock = threading.Lock()

    def server(self, **kwargs: Any) -> InprocServer:
        return InprocServer(self, **kwargs)

    def client(self, *, role: str, name: str, **kwargs: Any) -> InprocClient:
        return InprocClient(self, role=role, name=name, **kwargs)

    def _put(self, q: queue.Queue[Any], item: object, timeout_s: float, where: str) -> None:
        try:
            q.put(item, timeout=timeout_s)
        except queue.Full:
            raise TransportTimeout(f"inproc {where}: {self.hwm} messages queued for {timeout_s}s") from None


class InprocServer(Server):
    def __init__(
        self,
        hub: InprocHub,
        *,
        name: str = "buffer",
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        policy_version: int = 0,
        on_hello: Callable[[str, Hello], None] | None = None,
    ) -> None:
        self._setup(name, max_frame_bytes, policy_version, 1.0, on_hello)
        self.hub, self.address = hub, hub.address

    def close(self) -> None:
        pass  # nothing to release; clients of a closed server time out as with a dead one

    def _recv_raw(self, timeout_s: float) -> tuple[bytes, list[Buffer]] | None:
        try:
            return self.hub._inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def _send_raw(self, ident: bytes, data: Buffer, timeout_s: float) -> None:
        with self.hub._lock:
            q = self.hub._clients.get(ident)
        if q is None:
            raise PeerGone(f"{self.address}: no peer {ident!r}")
        self.hub._put(q, data, timeout_s, f"{self.name} -> {ident!r}")


class InprocClient(Client):
    def __init__(
        self,
        hub: InprocHub,
        *,
        role: str,
        name: str,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        send_timeout_s: float = 5.0,
    ) -> None:
        self._setup(hub.address, role, name, max_frame_bytes, send_timeout_s)
        self.hub, self._ident = hub, name.encode()
        self._inbox: queue.Queue[Buffer] = queue.Queue(hub.hwm)
        with hub._lock:
            hub._clients[self._ident] = self._inbox  # the newest client of a name wins, as ROUTER_HANDOVER

    def close(self) -> None:
        with self.hub._lock:
            if self.hub._clients.get(self._ident) is self._inbox:
                del self.hub._clients[self._ident]

    def _send_frames(self, frames: list[bytes]) -> None:
        """Test hook: put raw frames on the wire, as a raw zmq DEALER would."""
        self.hub._put(self.hub._inbox, (self._ident, frames), self.send_timeout_s, f"{self.name} -> server")

    def _send_raw(self, data: Buffer, timeout_s: float) -> None:
        self.hub._put(self.hub._inbox, (self._ident, [data]), timeout_s, f"{self.name} -> server")

    def _recv_raw(self, timeout_s: float) -> Buffer | None:
        try:
            return self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None
