"""Transport behaviour over real sockets (ipc in a temp dir, tcp on 127.0.0.1) and the in-process twin.

Behavioural tests run over all three kinds; the server runs its poll loop in a thread, as the buffer
runs it in its own process.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from streamrl import messages as m
from streamrl import transport
from streamrl.errors import PeerGone, RemoteError, TransportTimeout
from streamrl.group_frame import frames_of
from streamrl.transport import ACK_BATCH, ACK_DELAY_S, Server
from streamrl.transport_client import AsyncClient, Client
from streamrl.transport_inproc import InprocClient, InprocHub
from tests.streamrl.test_messages import make_group

KINDS = ["ipc", "tcp", "inproc"]


def acked(*uids: int) -> m.GroupAcks:
    return m.GroupAcks(acks=[m.GroupAck(uid=uid, status="accepted") for uid in uids])


class Net:
    """Makes servers, clients and raw senders of one kind, and closes them all at teardown."""

    def __init__(self, kind: str, tmp_dir: str) -> None:
        self.kind, self.tmp_dir = kind, tmp_dir
        self.hub = InprocHub()
        self.closers: list[Callable[[], object]] = []
        self.address = ""

    def server(self, **kwargs: Any) -> Server:
        server: Server
        if self.kind == "inproc":
            server = self.hub.server(**kwargs)
        else:
            bind = f"ipc://{self.tmp_dir}/buffer.sock" if self.kind == "ipc" else "tcp://127.0.0.1:*"
            server = Server(bind, **kwargs)
        self.address = server.address
        self.closers.append(server.close)
        return server

    def client(self, name: str, role: str = "generator", **kwargs: Any) -> Client:
        client: Client
        if self.kind == "inproc":
            client = self.hub.client(role=role, name=name, **kwargs)
        else:
            client = Client(self.address, role=role, name=name, **kwargs)
        self.closers.append(client.close)
        return client

    def absent_address(self) -> str:
        if self.kind == "ipc":
            return f"ipc://{self.tmp_dir}/nobody.sock"
        probe: zmq.Socket[bytes]
        with zmq.Context.instance().socket(zmq.ROUTER) as probe:  # a port that was free a moment ago
            port: int = probe.bind_to_random_port("tcp://127.0.0.1")
        return f"tcp://127.0.0.1:{port}"

    def raw(self, frames: list[bytes], times: int = 1) -> Callable[[float], m.Message | None]:
        """Send frames as an unidentified raw peer would; return a function receiving its replies."""
        if self.kind == "inproc":
            client = self.hub.client(role="raw", name=f"raw{len(self.closers)}")
            self.closers.append(client.close)
            for _ in range(times):
                client._send_frames(frames)
            return client.recv
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        self.closers.append(sock.close)
        sock.connect(self.address)
        for _ in range(times):
            sock.send_multipart(frames)
        return lambda timeout_s: m.decode(sock.recv()) if sock.poll(int(timeout_s * 1000)) else None

    def close(self) -> None:
        for close in reversed(self.closers):
            close()


@pytest.fixture(params=KINDS)
def net(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    # tmp_path_factory, not tmp_path: ipc paths must stay under ~107 characters.
    n = Net(request.param, str(tmp_path_factory.mktemp("ipc")))
    yield n
    n.close()


@contextmanager
def serving(server: Server) -> Iterator[list[tuple[str, m.Message]]]:
    """Run a small buffer-like poll loop in a thread; yield the list of delivered (peer, message)."""
    got: list[tuple[str, m.Message]] = []
    stop = threading.Event()
    failure: list[BaseException] = []

    def loop() -> None:
        try:
            while not stop.is_set():
                item = server.recv(0.02)
                if item is None:
                    continue
                got.append(item)
                peer, msg = item
                if isinstance(msg, m.Group):
                    server.ack(peer, m.GroupAck(uid=msg.uid, status="accepted"))
                elif isinstance(msg, m.BatchRequest):
                    groups = [g for _, g in got if isinstance(g, m.Group)]
                    advantages = [m.pack("advantages", np.ones(len(g.trajectories))) for g in groups]
                    batch = m.Batch(step=msg.step, policy_version=1, groups=groups, advantages=advantages)
                    server.send(peer, batch)
                elif isinstance(msg, m.Heartbeat):
                    server.send(peer, msg)
        except BaseException as e:  # surfaced in the test thread below
            failure.append(e)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield got
    finally:
        stop.set()
        thread.join(5)
    if failure:
        raise failure[0]


def test_handshake_then_a_group_and_a_batch_round_trip_with_every_token_array_intact(net: Net) -> None:
    hellos: list[tuple[str, m.Hello]] = []
    server = net.server(policy_version=7, on_hello=lambda peer, hello: hellos.append((peer, hello)))
    client = net.client("gen0")
    group = make_group(uid=1, n=32, tokens=1000)
    with serving(server) as got:
        ready = client.connect(2.0)
        assert ready == m.Ready(protocol=m.PROTOCOL_VERSION, policy_version=7) == client.ready
        assert client.request(group, 2.0) == acked(1)
        batch = client.request(m.BatchRequest(step=0), 2.0)
    assert got[0] == ("gen0", group)
    assert isinstance(batch, m.Batch) and batch.groups == [group]
    sent, back = group.trajectories[5], batch.groups[0].trajectories[5]
    np.testing.assert_array_equal(m.unpack("tokens", back.tokens), m.unpack("tokens", sent.tokens))
    np.testing.assert_array_equal(m.unpack("logprobs", back.logprobs), m.unpack("logprobs", sent.logprobs))
    m.check_group(batch.groups[0], expected_size=32)
    assert server.peers == {"gen0": "generator"} and hellos == [
        ("gen0", m.Hello(role="generator", name="gen0"))
    ]
    assert server.stats["hello"] == 1 and server.stats["rejected"] == 0


def test_a_restarted_client_under_the_same_name_takes_over_the_route(net: Net) -> None:
    hellos: list[str] = []
    server = net.server(on_hello=lambda peer, hello: hellos.append(peer))
    with serving(server):
        old = net.client("gen0")
        old.connect(2.0)
        new = net.client("gen0")  # old is never closed: a hung predecessor still holds its socket
        new.connect(2.0)
        assert new.request(m.Heartbeat(sent_at=2.0), 2.0) == m.Heartbeat(sent_at=2.0)
    assert hellos == ["gen0", "gen0"] and server.peers == {"gen0": "generator"}


def test_many_messages_arrive_in_the_order_they_were_sent_both_ways(net: Net) -> None:
    server, client = net.server(), net.client("gen0")
    n = 300
    with serving(server) as got:
        client.connect(2.0)
        for i in range(n):
            client.send(m.Heartbeat(sent_at=float(i)))
        echoes = [client.recv(2.0) for _ in range(n)]
    assert [msg for _, msg in got] == [m.Heartbeat(sent_at=float(i)) for i in range(n)]
    assert echoes == [m.Heartbeat(sent_at=float(i)) for i in range(n)]


def test_a_malformed_frame_gets_an_error_and_the_server_keeps_serving_the_next_client(net: Net) -> None:
    server = net.server()
    with serving(server) as got:
        reply = net.raw([b"\xc1 not msgpack"])(2.0)
        assert isinstance(reply, m.Error) and reply.code == "bad_frame"
        assert "cannot decode a 13-byte message" in reply.detail
        multipart = net.raw([b"a", b"b"])(2.0)
        assert isinstance(multipart, m.Error) and "2 frames" in multipart.detail
        client = net.client("gen1")
        client.connect(2.0)
        assert client.request(make_group(uid=9), 2.0) == acked(9)
    assert [peer for peer, _ in got] == ["gen1"]
    assert server.stats["rejected_bad_frame"] == 2


def test_a_valid_message_with_extra_frames_is_refused_whole_and_never_delivered(net: Net) -> None:
    server, client = net.server(), net.client("gen0")
    group = m.encode(make_group(uid=5))
    with serving(server) as got:
        client.connect(2.0)
        for frames in ([group, b"x"], [group, group, group], [b"", group]):
            if isinstance(client, InprocClient):
                client._send_frames(frames)
            else:
                client._sock.send_multipart(frames)
            reply = client.recv(2.0)
            assert isinstance(reply, m.Error) and reply.code == "bad_frame"
            assert f"{len(frames)} frames in one message, expected 1" in reply.detail
        assert client.request(make_group(uid=6), 2.0) == acked(6)
    assert [msg.uid for _, msg in got if isinstance(msg, m.Group)] == [6]
    assert server.stats["rejected_bad_frame"] == 3


def test_an_unknown_message_tag_is_rejected_with_the_tag_named(net: Net) -> None:
    server = net.server()
    with serving(server):
        reply = net.raw([msgspec.msgpack.encode({"type": "launch_missiles", "count": 1})])(2.0)
    assert isinstance(reply, m.Error) and reply.code == "bad_frame" and "launch_missiles" in reply.detail


def test_an_oversized_frame_is_rejected_and_the_sender_can_go_on(net: Net) -> None:
    server = net.server(max_frame_bytes=4000)
    client = net.client("gen0")
    big = make_group(uid=2, n=1, tokens=400)  # about 5.3 KB: over the limit, under MAXMSGSIZE (2x)
    assert 4000 < len(m.encode(big)) < 8000
    with serving(server) as got:
        client.connect(2.0)
        with pytest.raises(RemoteError) as err:
            client.request(big, 2.0)
        assert err.value.code == "frame_too_large" and "exceeds the limit of 4000 bytes" in err.value.detail
        assert client.request(make_group(uid=3, n=1, tokens=10), 2.0) == acked(3)
    assert [msg.uid for _, msg in got if isinstance(msg, m.Group)] == [3]
    assert server.stats["rejected_frame_too_large"] == 1


@pytest.mark.parametrize("net", ["ipc", "tcp"], indirect=True)  # MAXMSGSIZE is libzmq's own guard
def test_a_frame_over_the_zmq_size_guard_drops_that_connection_and_nothing_else(net: Net) -> None:
    server = net.server(max_frame_bytes=1000)  # MAXMSGSIZE = 2000
    big, small = net.client("gen0"), net.client("gen1")
    with serving(server) as got:
        big.connect(2.0)
        big.send(make_group(uid=1, n=1, tokens=400))  # about 5.3 KB
        assert big.recv(0.3) is None  # libzmq cut the connection; there is no reply to give
        small.connect(2.0)
        assert small.request(m.Heartbeat(sent_at=1.0), 2.0) == m.Heartbeat(sent_at=1.0)
    assert [peer for peer, _ in got] == ["gen1"]


def test_a_backlog_of_bad_frames_does_not_hold_recv_past_its_deadline(net: Net) -> None:
    server = net.server()
    replies = net.raw([b"\xc1"], times=20)
    time.sleep(0.1)  # let all 20 arrive
    assert server.recv(0.0) is None and server.stats["rejected"] == 1  # one frame handled, then the deadline
    t0 = time.monotonic()
    assert server.recv(0.2) is None
    assert time.monotonic() - t0 < 0.6 and server.stats["rejected_bad_frame"] == 20
    assert all(isinstance(replies(1.0), m.Error) for _ in range(20))


def test_a_wrong_protocol_version_or_name_in_hello_is_refused(net: Net) -> None:
    server = net.server()
    client = net.client("gen0")
    with serving(server):
        client.send(m.Hello(role="generator", name="gen0", protocol=m.PROTOCOL_VERSION + 1))
        reply = client.recv(2.0)
        assert isinstance(reply, m.Error) and reply.code == "protocol" and "speaks protocol 2" in reply.detail
        client.send(m.Hello(role="generator", name="someone_else"))
        reply = client.recv(2.0)
        assert isinstance(reply, m.Error) and reply.code == "handshake" and "someone_else" in reply.detail
    assert server.peers == {}


def test_a_message_sent_before_hello_is_refused_and_not_delivered(net: Net) -> None:
    server = net.server()
    client = net.client("gen0")
    with serving(server) as got:
        with pytest.raises(RemoteError) as err:
            client.request(make_group(uid=4), 2.0)
        assert err.value.code == "handshake_required" and "Group from 'gen0' before Hello" in str(err.value)
    assert got == [] and server.stats["rejected_handshake_required"] == 1


def test_connect_to_a_server_that_is_not_there_times_out_within_the_bound(net: Net) -> None:
    if net.kind == "inproc":
        client = net.client("gen0")  # a hub whose server never polls
    else:
        client = Client(net.absent_address(), role="generator", name="gen0")
        net.closers.append(client.close)
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout, match=client.address):
        client.connect(0.3)
    assert 0.25 < time.monotonic() - t0 < 1.0


def test_recv_with_nothing_to_read_returns_none_after_about_the_time_asked(net: Net) -> None:
    server, client = net.server(), net.client("gen0")
    with serving(server):
        client.connect(2.0)
        t0 = time.monotonic()
        assert client.recv(0.2) is None
        assert 0.18 < time.monotonic() - t0 < 0.6
    t0 = time.monotonic()
    assert server.recv(0.2) is None
    assert 0.18 < time.monotonic() - t0 < 0.6


def test_sending_to_an_unknown_or_departed_peer_raises_peer_gone(net: Net) -> None:
    server, client = net.server(), net.client("gen0")
    with serving(server):
        client.connect(2.0)
    with pytest.raises(PeerGone):
        server.send("nobody", m.Heartbeat(sent_at=1.0))
    client.close()
    deadline = time.monotonic() + 3.0  # zmq notices the closed connection asynchronously
    with pytest.raises(PeerGone):
        while time.monotonic() < deadline:
            server.send("gen0", m.Heartbeat(sent_at=1.0))
            time.sleep(0.01)
    assert "gen0" not in server.peers


def test_acks_for_a_departed_peer_are_counted_as_lost_not_raised(net: Net) -> None:
    server = net.server()
    server.ack("nobody", m.GroupAck(uid=1, status="accepted"))
    server.ack("nobody", m.GroupAck(uid=2, status="duplicate"))
    assert server.recv(ACK_DELAY_S + 0.05) is None  # they fall due while it waits: must not raise
    assert server.stats["acks_lost"] == 2


def test_acks_wait_for_company_until_due_unless_the_client_asks_for_them(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(transport, "ACK_DELAY_S", 0.5)
    server, client = net.server(), net.client("gen0")
    with serving(server):
        client.connect(2.0)
        t0 = time.monotonic()
        for frame in frames_of(make_group(uid=uid, n=1, tokens=4) for uid in (1, 2, 3)):
            client.send(frame)
        assert client.recv(2.0) == acked(1, 2, 3)  # nobody asked: they left together, once due
        assert time.monotonic() - t0 > 0.4
        for frame in frames_of(make_group(uid=uid, n=1, tokens=4) for uid in (4, 5)):
            client.send(frame)
        client.send(m.AckRequest())
        assert client.recv(0.3) == acked(4, 5)  # asked for: at once
        client.send(m.AckRequest())
        assert client.recv(0.3) is None  # nothing owed, nothing sent


def test_acks_of_a_backlog_are_batched_and_every_group_is_acked_once_in_order(net: Net) -> None:
    server, client = net.server(), net.client("gen0")
    n = ACK_BATCH + 10  # under the high-water marks
    frames = frames_of(make_group(uid=uid, n=2, tokens=50) for uid in range(n))
    with serving(server):
        client.connect(2.0)
    for frame in frames:  # the server is not reading: they queue up
        client.send(frame)
    time.sleep(0.2)
    batches: list[list[int]] = []
    with serving(server) as got:
        while sum(map(len, batches)) < n and (reply := client.recv(2.0)) is not None:
            assert isinstance(reply, m.GroupAcks)
            batches.append([a.uid for a in reply.acks])
        assert client.recv(0.3) is None
    assert [uid for batch in batches for uid in batch] == list(range(n))
    assert max(map(len, batches)) <= ACK_BATCH and len(batches) <= 4  # batched, never over the cap
    assert [msg.uid for _, msg in got if isinstance(msg, m.Group)] == list(range(n))
    assert got[7][1] == make_group(uid=7, n=2, tokens=50)  # a GroupFrame decodes to the Group it encodes


def test_a_client_send_at_the_high_water_mark_times_out_within_the_bound(net: Net) -> None:
    payload: m.Message
    if net.kind == "inproc":
        net.hub = InprocHub(hwm=2)
        net.server()
        client, payload = net.client("gen0", send_timeout_s=0.3), m.Heartbeat(sent_at=0.0)
    else:  # 1.7 MB frames fill the one-message pipes and the kernel's socket buffers quickly
        net.server(hwm=1)
        client, payload = net.client("gen0", send_timeout_s=0.3, hwm=1), make_group(1, n=64, tokens=2000)
    with pytest.raises(TransportTimeout, match="high-water mark|queued"):
        for _ in range(200):  # the server never reads
            t0 = time.monotonic()
            client.send(payload)
    assert 0.25 < time.monotonic() - t0 < 1.5


@pytest.mark.parametrize("kind", ["ipc", "tcp"])
def test_the_async_client_does_the_handshake_requests_and_bounded_receives(
    kind: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    bind = f"ipc://{tmp_path_factory.mktemp('ipc')}/buffer.sock" if kind == "ipc" else "tcp://127.0.0.1:*"
    group = make_group(uid=5, n=8, tokens=200)

    async def main(address: str) -> None:
        async with AsyncClient(address, role="learner", name="learner0") as client:
            assert (await client.connect(2.0)).protocol == m.PROTOCOL_VERSION
            assert await client.request(group, 2.0) == acked(5)
            for i in range(50):
                await client.send(m.Heartbeat(sent_at=float(i)))
            assert [await client.recv(2.0) for _ in range(50)] == [
                m.Heartbeat(sent_at=float(i)) for i in range(50)
            ]
            batch = await client.request(m.BatchRequest(step=1), 2.0)
            assert isinstance(batch, m.Batch) and batch.groups == [group]
            t0 = time.monotonic()
            assert await client.recv(0.2) is None
            assert 0.18 < time.monotonic() - t0 < 0.6

    with Server(bind) as server, serving(server):
        asyncio.run(main(server.address))
    assert server.peers == {"learner0": "learner"}


def test_the_async_client_connect_times_out_when_no_server_is_there(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    address = f"ipc://{tmp_path_factory.mktemp('ipc')}/nobody.sock"

    async def main() -> None:
        async with AsyncClient(address, role="learner", name="learner0") as client:
            await client.connect(0.3)

    with pytest.raises(TransportTimeout, match=address):
        asyncio.run(main())
