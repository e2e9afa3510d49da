"""Producer-written group frames are exactly the wire encoding of the Group they describe."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from streamrl import messages as m
from streamrl.group_frame import frames_of, write_group
from tests.streamrl.test_messages import make_group


def head(group: m.Group) -> dict[str, Any]:
    fields = msgspec.structs.asdict(group)
    del fields["trajectories"]
    return fields


@pytest.mark.parametrize(
    ("n", "tokens"),
    [(0, 0), (1, 0), (4, 16), (20, 300), (2, 70_000)],  # fixarray, array16, bin8/16/32 headers
)
def test_a_written_frame_is_byte_identical_to_encoding_the_group(n: int, tokens: int) -> None:
    group = make_group(uid=2**40 + n, n=n, tokens=tokens)
    group.gen_time_s = 12.5
    if group.trajectories:
        group.trajectories[-1].text = "ünïcode \\boxed{42} " * 40
        group.trajectories[-1].tool_errors = 3
    [frame] = frames_of([group])
    assert frame.uid == group.uid
    assert bytes(frame.data) == m.encode(group)
    assert m.decode(frame.data) == group


def test_token_lists_from_the_engine_become_the_same_frame_as_packed_arrays() -> None:
    rng = np.random.default_rng(3)
    rollouts = [
        {
            "sample_index": i,
            "tokens": rng.integers(0, 150_000, 50).tolist(),
            "loss_mask": [1] * 30 + [0] * 20,
            "logprobs": (-rng.random(50)).tolist(),
            "versions": [4] * 30 + [-1] * 20,
            "reward": 1.0,
            "finish_reason": "length",
            "num_turns": 2,
        }
        for i in range(3)
    ]
    ids = [151644, 872, 198]
    frame = write_group(rollouts, uid=9, prompt_id="p9", admitted_version=4, generator="g", prompt_tokens=ids)
    packed = m.Group(
        uid=9,
        prompt_id="p9",
        admitted_version=4,
        generator="g",
        prompt_tokens=m.pack("prompt_tokens", ids),
        trajectories=[m.pack_trajectory(r) for r in rollouts],
    )
    assert bytes(frame.data) == m.encode(packed)
    back = m.decode(frame.data)
    assert isinstance(back, m.Group)
    np.testing.assert_array_equal(
        m.unpack("logprobs", back.trajectories[2].logprobs), np.float32(rollouts[2]["logprobs"])
    )
    m.check_group(back, expected_size=3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokenz": [1]}, r"group.trajectories\[1\]: unknown field\(s\) \['tokenz'\]"),
        ({"reward": msgspec.NODEFAULT}, r"group.trajectories\[1\]: missing required field 'reward'"),
        ({"logprobs": [0.0]}, r"group.trajectories\[1\]: per-token arrays differ in length"),
        (
            {"versions": b"\x00\x01"},
            r"group.trajectories\[1\].versions: 2 bytes is not a whole number of <i4",
        ),
    ],
)
def test_a_malformed_trajectory_is_refused_naming_the_field(change: dict[str, Any], message: str) -> None:
    group = make_group(n=2, tokens=4)
    trajectories = [msgspec.structs.asdict(t) for t in group.trajectories]
    trajectories[1].update(change)
    trajectories[1] = {k: v for k, v in trajectories[1].items() if v is not msgspec.NODEFAULT}
    with pytest.raises(ValueError, match=message):
        write_group(trajectories, **head(group))


def test_a_missing_group_field_is_refused_naming_it() -> None:
    fields = head(make_group(n=1))
    del fields["prompt_id"]
    with pytest.raises(ValueError, match="group: missing required field 'prompt_id'"):
        write_group([], **fields)
