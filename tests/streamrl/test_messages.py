"""The wire schema: round trips keep per-token arrays exact; bad frames raise typed errors only."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from streamrl import messages as m
from streamrl.errors import DecodeError, FrameTooLarge


def make_group(uid: int = 7, n: int = 4, tokens: int = 16, seed: int = 0) -> m.Group:
    rng = np.random.default_rng(seed + uid)
    trajs = [
        m.Trajectory(
            sample_index=i,
            tokens=m.pack("tokens", rng.integers(0, 50_000, tokens)),
            loss_mask=m.pack("loss_mask", rng.integers(0, 2, tokens)),
            logprobs=m.pack("logprobs", -rng.random(tokens)),
            versions=m.pack("versions", np.full(tokens, 3)),
            reward=float(i % 2),
            finish_reason="stop",
            text=f"answer {i}",
        )
        for i in range(n)
    ]
    return m.Group(
        uid=uid,
        prompt_id=f"p{uid}",
        admitted_version=2,
        generator="gen-0",
        prompt_tokens=m.pack("prompt_tokens", [1, 2, 3]),
        trajectories=trajs,
    )


def test_a_group_round_trips_with_identical_per_token_arrays() -> None:
    group = make_group()
    back = m.decode(m.encode(group))
    assert isinstance(back, m.Group) and back == group
    np.testing.assert_array_equal(
        m.unpack("logprobs", back.trajectories[1].logprobs),
        m.unpack("logprobs", group.trajectories[1].logprobs),
    )
    assert m.unpack("tokens", back.trajectories[0].tokens).dtype == np.int32


def test_every_message_type_round_trips() -> None:
    group = make_group()
    prompt = m.Prompt(
        uid=1,
        prompt_id="a",
        answer="3",
        text="1+2=",
        admitted_version=0,
        n_samples=4,
        messages=[m.ChatMessage("user", "hi")],
    )
    msgs = [
        m.Hello(role="generator", name="g"),
        m.Ready(protocol=1, policy_version=3),
        m.PromptRequest(max_prompts=4),
        m.Prompts(prompts=[prompt], policy_version=0),
        m.PromptRelease(uids=[1], reason="engine_died"),
        group,
        m.GroupAcks(
            acks=[m.GroupAck(uid=1, status="accepted"), m.GroupAck(uid=2, status="filtered", detail="x")]
        ),
        m.AckRequest(),
        m.BatchRequest(step=2),
        m.Batch(step=2, policy_version=2, groups=[group], advantages=[b"\0" * 16]),
        m.NoBatch(step=2, ready_groups=1, retry_after_s=0.1),
        m.WeightsPublished(version=3, step=2),
        m.SnapshotRequest(step=2, path="/x"),
        m.SnapshotDone(step=2, path="/x"),
        m.Heartbeat(sent_at=1.0),
        m.Shutdown(reason="done"),
        m.Error(code="bad", detail="why"),
    ]
    assert len({type(x) for x in msgs}) == len(m.Message.__args__)
    for msg in msgs:
        assert m.decode(m.encode(msg)) == msg


def test_an_unknown_message_type_is_a_decode_error_naming_the_tag() -> None:
    frame = msgspec.msgpack.encode({"type": "teleport", "x": 1})
    with pytest.raises(DecodeError, match="teleport"):
        m.decode(frame)


def test_a_wrong_field_type_is_a_decode_error_naming_the_field() -> None:
    frame = msgspec.msgpack.encode({"type": "batch_request", "step": "three"})
    with pytest.raises(DecodeError, match=r"\$\.step"):
        m.decode(frame)


@pytest.mark.parametrize("frame", [b"", b"\xc1", b"garbage that is not msgpack", b"\x92\x01"])
def test_garbage_frames_raise_decode_error_only(frame: bytes) -> None:
    with pytest.raises(DecodeError):
        m.decode(frame)


def test_a_frame_over_the_limit_is_refused_before_decoding() -> None:
    frame = m.encode(make_group(tokens=1000))
    with pytest.raises(FrameTooLarge, match=f"{len(frame)} bytes exceeds the limit of 1000"):
        m.decode(frame, max_bytes=1000)


def test_check_group_names_the_inconsistent_field() -> None:
    group = make_group()
    group.trajectories[2].logprobs = group.trajectories[2].logprobs[:-4]
    with pytest.raises(DecodeError, match=r"trajectories\[2\]\.logprobs: 60 bytes, expected 64"):
        m.check_group(group)
    with pytest.raises(DecodeError, match="4 trajectories, expected 8"):
        m.check_group(make_group(), expected_size=8)
    dup = make_group()
    dup.trajectories[1].sample_index = 0
    with pytest.raises(DecodeError, match="sample_index 0 appears twice"):
        m.check_group(dup)
