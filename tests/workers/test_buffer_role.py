"""The buffer role as users run it: a real process on a real socket, with real clients."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import pytest
import zmq

from streamrl import messages as m
from streamrl.errors import RemoteError
from streamrl.transport_client import Client
from streamrl.transport_inproc import InprocHub
from tests.streamrl.test_buffer import MIXED, make_buffer, make_group
from workers.buffer import BufferRole

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = ["buffer.groups_per_step=2", "buffer.max_staleness=0", "rollout.n_samples=4"]


def start_buffer(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    address = f"ipc://{tmp_path}/buffer.sock"
    args = [
        sys.executable,
        "-m",
        "workers.buffer",
        "--job",
        str(ROOT / "configs/tiny-arith.yaml"),
        "--address",
        address,
        "--log-file",
        str(tmp_path / "buffer.log"),
    ]
    for o in OVERRIDES:
        args += ["--set", o]
    proc = subprocess.Popen([*args, *extra], cwd=ROOT)
    return proc, address


def stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=10)


def generate(gen: Client, k: int) -> list[m.GroupAck]:
    reply = gen.request(m.PromptRequest(max_prompts=k), timeout_s=5)
    assert isinstance(reply, m.Prompts)
    acks = []
    for p in reply.prompts:
        reply = gen.request(make_group(p, MIXED, generator=gen.name), timeout_s=5)
        assert isinstance(reply, m.GroupAcks) and [a.uid for a in reply.acks] == [p.uid]
        acks += reply.acks
    return acks


def test_buffer_process_streams_groups_to_a_learner_and_resumes_from_its_snapshot(tmp_path: Path) -> None:
    proc, address = start_buffer(tmp_path)
    try:
        with (
            Client(address, role="generator", name="gen-0") as gen,
            Client(address, role="learner", name="learner") as lrn,
        ):
            assert gen.connect(timeout_s=20).policy_version == 0
            lrn.connect(timeout_s=5)
            assert [a.status for a in generate(gen, 8)] == ["accepted", "accepted"]  # admission: B=2, eta=0
            batch = lrn.request(m.BatchRequest(step=0), timeout_s=5)
            assert isinstance(batch, m.Batch) and len(batch.groups) == 2
            assert isinstance(lrn.request(m.BatchRequest(step=1), timeout_s=5), m.NoBatch)
            lrn.send(m.WeightsPublished(version=1, step=0))
            assert [a.status for a in generate(gen, 8)] == ["accepted", "accepted"]
            snap = tmp_path / "snap" / "buffer-step0.msgpack"
            done = lrn.request(m.SnapshotRequest(step=0, path=str(snap)), timeout_s=5)
            assert isinstance(done, m.SnapshotDone) and snap.exists()
        assert stop(proc) == 0
        # A new buffer process from the snapshot: version 1, the two ready groups are still there.
        proc, address = start_buffer(tmp_path, "--resume", str(snap))
        with Client(address, role="learner", name="learner") as lrn:
            assert lrn.connect(timeout_s=20).policy_version == 1
            batch = lrn.request(m.BatchRequest(step=1), timeout_s=5)
            assert isinstance(batch, m.Batch) and [g.uid for g in batch.groups] == [2, 3]
    finally:
        if proc.poll() is None:
            stop(proc)
    lines = [msgspec.json.decode(line) for line in (tmp_path / "buffer.log").read_text().splitlines()]
    assert all(rec["role"] == "buffer" for rec in lines)
    assert any(rec["event"] == "buffer_restored" for rec in lines)


def test_malformed_frames_get_clear_errors_while_the_buffer_keeps_serving(tmp_path: Path) -> None:
    proc, address = start_buffer(tmp_path)
    try:
        with Client(address, role="generator", name="gen-0") as gen:
            gen.connect(timeout_s=20)
            ctx = zmq.Context.instance()
            raw = ctx.socket(zmq.DEALER)
            raw.setsockopt(zmq.IDENTITY, b"rogue")
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(address)
            try:
                raw.send(m.encode(m.Hello(role="generator", name="rogue")))
                assert raw.poll(5000), "no Ready"
                assert isinstance(m.decode(raw.recv()), m.Ready)
                heartbeat = m.encode(m.Heartbeat(sent_at=0.0))
                for frames, code in [
                    ([b"\xc1garbage"], "bad_frame"),
                    ([b""], "bad_frame"),
                    ([msgspec.msgpack.encode({"type": "teleport"})], "bad_frame"),
                    ([m.encode(m.Ready(protocol=1, policy_version=0))], "unexpected"),
                    # A valid message with frames after it is refused whole, not half-read.
                    ([heartbeat, b"extra"], "bad_frame"),
                    ([heartbeat, heartbeat, heartbeat], "bad_frame"),
                ]:
                    raw.send_multipart(frames)
                    assert raw.poll(5000), "no answer to a malformed frame"
                    reply = m.decode(raw.recv())
                    assert isinstance(reply, m.Error) and reply.code == code, reply
                    if len(frames) > 1:
                        assert f"{len(frames)} frames in one message, expected 1" in reply.detail
            finally:
                raw.close()
            # A group with broken arrays is rejected by name, and its prompt is dispatched again.
            prompts = gen.request(m.PromptRequest(max_prompts=1), timeout_s=5).prompts
            bad = make_group(prompts[0], MIXED)
            bad.trajectories[0].logprobs = b"\x00\x01"
            reply = gen.request(bad, timeout_s=5)
            assert isinstance(reply, m.GroupAcks) and len(reply.acks) == 1
            ack = reply.acks[0]
            assert ack.status == "rejected" and "trajectories[0].logprobs" in ack.detail
            again = gen.request(m.PromptRequest(max_prompts=1), timeout_s=5).prompts
            assert [p.uid for p in again] == [prompts[0].uid]
            reply = gen.request(make_group(again[0], MIXED), timeout_s=5)
            assert reply == m.GroupAcks(acks=[m.GroupAck(uid=again[0].uid, status="accepted")])
        assert proc.poll() is None
    finally:
        assert stop(proc) == 0


def test_a_silent_generator_is_presumed_dead_and_its_prompts_go_to_another() -> None:
    buf = make_buffer(B=2, eta=0)
    hub = InprocHub()
    server = hub.server()
    role = BufferRole(buf, server)
    thread = threading.Thread(
        target=role.serve, kwargs={"heartbeat_timeout_s": 0.3, "poll_s": 0.02}, daemon=True
    )
    thread.start()
    try:
        dead = hub.client(role="generator", name="dead")
        dead.connect(timeout_s=2)
        taken = dead.request(m.PromptRequest(max_prompts=2), timeout_s=2).prompts
        alive = hub.client(role="generator", name="alive")
        alive.connect(timeout_s=2)
        got: list[m.Prompt] = []
        for _ in range(100):
            got += alive.request(m.PromptRequest(max_prompts=2), timeout_s=2).prompts
            if len(got) == 2:
                break
            threading.Event().wait(0.05)
        assert sorted(p.uid for p in got) == sorted(p.uid for p in taken)
        with pytest.raises(RemoteError, match="unexpected"):
            alive.request(m.Ready(protocol=1, policy_version=0), timeout_s=2)
    finally:
        role.stopping.set()
        thread.join(timeout=5)
    assert not thread.is_alive()


def test_buffer_metrics_report_roc_keep_rates() -> None:
    from collections import Counter

    from workers.buffer import buffer_metrics

    class Stub:
        counters = Counter(accepted=3, dropped_roc_equal_reward=1, trajectories_in=32, trajectories_kept=12)
        ready, in_flight, staleness = [1], {}, Counter({0: 2, 1: 1})

        def capacity(self) -> int:
            return 5

    out = buffer_metrics(Stub())  # type: ignore[arg-type]
    assert out["roc_keep_rate"] == 0.75
    assert out["roc_trajectory_keep_rate"] == 12 / 32
    assert out["staleness"] == {"0": 2, "1": 1}
    assert out["accepted"] == 3 and out["ready"] == 1 and out["capacity"] == 5
