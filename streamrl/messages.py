"""The wire schema: every message that crosses a process boundary.

One msgspec tagged union, `Message`, encoded as MessagePack. Per-token arrays travel as raw
little-endian bytes (dtype fixed per field in `ARRAY_DTYPES`) because msgspec decodes a bytes field
about 8x faster than a list of ints. They are typed `memoryview` so that decoding is zero-copy: a
received array is a view into the received frame (which it keeps alive), not a fresh copy. Receivers call `decode(frame)`, which raises a `WireError`
subclass for anything that is not a valid message of this protocol; it never raises anything else.

Conversation of the roles (all over the buffer's ROUTER socket, see transport.py):

    any client  -> Hello            buffer -> Ready          (handshake, protocol check)
    generator   -> PromptRequest    buffer -> Prompts        (admission control may answer none)
    generator   -> Group            buffer -> GroupAcks      (every group is acknowledged, acks batched)
    any         -> AckRequest       buffer -> GroupAcks      (now: every ack owed for what came before)
    generator   -> PromptRelease                             (give prompts back for re-dispatch)
    learner     -> BatchRequest     buffer -> Batch | NoBatch
    learner     -> WeightsPublished                          (new policy version; marks the step trained)
    learner     -> SnapshotRequest  buffer -> SnapshotDone   (written with the learner checkpoint)
    any         -> Heartbeat, Shutdown; buffer -> Error      (a rejected message, with the reason)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec
import numpy as np

from streamrl.errors import DecodeError, FrameTooLarge

PROTOCOL_VERSION = 1
DEFAULT_MAX_FRAME_BYTES = 256 * 1024 * 1024

# dtype of every bytes-array field, little-endian.
ARRAY_DTYPES: dict[str, str] = {
    "prompt_tokens": "<i4",
    "tokens": "<i4",
    "loss_mask": "u1",
    "logprobs": "<f4",
    "versions": "<i4",
    "advantages": "<f4",
}

FinishReason = Literal["stop", "length", "abort", "error"]


Array = memoryview


def pack(field: str, values: object) -> Array:
    """Encode a sequence or array as the bytes of field `field` (dtype from ARRAY_DTYPES)."""
    return memoryview(np.ascontiguousarray(values, dtype=ARRAY_DTYPES[field]).tobytes())


def unpack(field: str, data: Array | bytes) -> np.ndarray:
    """A read-only numpy view of a bytes-array field."""
    return np.frombuffer(data, dtype=ARRAY_DTYPES[field])


def pack_trajectory(fields: Mapping[str, Any]) -> Trajectory:
    """A Trajectory from its fields, per-token arrays given as sequences or numpy arrays."""
    return Trajectory(**{k: pack(k, v) if k in ARRAY_DTYPES else v for k, v in fields.items()})


class ChatMessage(msgspec.Struct, frozen=True, gc=False):
    role: str
    content: str


class Prompt(msgspec.Struct, kw_only=True, gc=False):
    """One dataset item, dispatched for `n_samples` rollouts.

    `uid` identifies this dispatch in the buffer's ledger; a prompt given back or lost with a dead
    generator is dispatched again under the same uid, so a late duplicate group is recognised.
    """

    uid: int
    prompt_id: str
    answer: str
    messages: list[ChatMessage] | None = None
    text: str | None = None
    meta: dict[str, str] = {}
    admitted_version: int
    n_samples: int


class Trajectory(msgspec.Struct, kw_only=True, array_like=True, gc=False):
    """One sampled response. All arrays have one entry per response token (model and tool tokens).

    loss_mask is 1 for model-generated tokens; tool tokens have mask 0, log-prob 0 and version -1.
    versions[t] is the engine's weight version that produced token t (it can change mid-trajectory
    when generation was interrupted by a weight update and resumed from the prefix).
    """

    sample_index: int
    tokens: Array
    loss_mask: Array
    logprobs: Array
    versions: Array
    reward: float
    finish_reason: FinishReason
    num_turns: int = 1
    tool_calls: int = 0
    tool_errors: int = 0
    text: str = ""

    @property
    def num_tokens(self) -> int:
        return len(self.loss_mask)


class Hello(msgspec.Struct, tag="hello", kw_only=True):
    role: str
    name: str
    protocol: int = PROTOCOL_VERSION


class Ready(msgspec.Struct, tag="ready", kw_only=True):
    protocol: int
    policy_version: int


class PromptRequest(msgspec.Struct, tag="prompt_request", kw_only=True):
    max_prompts: int


class Prompts(msgspec.Struct, tag="prompts", kw_only=True):
    prompts: list[Prompt]
    policy_version: int
    retry_after_s: float = 0.0


class PromptRelease(msgspec.Struct, tag="prompt_release", kw_only=True):
    uids: list[int]
    reason: str


class Group(msgspec.Struct, tag="group", kw_only=True, gc=False):
    """All `n_samples` trajectories of one prompt dispatch: the streaming unit."""

    uid: int
    prompt_id: str
    admitted_version: int
    generator: str
    prompt_tokens: Array
    trajectories: list[Trajectory]
    gen_time_s: float = 0.0


GroupStatus = Literal["accepted", "filtered", "duplicate", "rejected"]


class GroupAck(msgspec.Struct, kw_only=True, array_like=True):
    """The buffer's verdict on one Group; travels inside GroupAcks."""

    uid: int
    status: GroupStatus
    detail: str = ""


class GroupAcks(msgspec.Struct, tag="group_acks", kw_only=True):
    """Verdicts on every Group the buffer handled since it last answered this peer (see transport.py)."""

    acks: list[GroupAck]


class AckRequest(msgspec.Struct, tag="ack_request", kw_only=True):
    """Asks for the verdicts on every Group this client sent before it, now (see transport.py)."""


class BatchRequest(msgspec.Struct, tag="batch_request", kw_only=True):
    step: int


class Batch(msgspec.Struct, tag="batch", kw_only=True, gc=False):
    """B groups for one train step; advantages[i] holds one float32 per trajectory of groups[i]."""

    step: int
    policy_version: int
    groups: list[Group]
    advantages: list[Array]


class NoBatch(msgspec.Struct, tag="no_batch", kw_only=True):
    step: int
    ready_groups: int
    retry_after_s: float


class WeightsPublished(msgspec.Struct, tag="weights_published", kw_only=True):
    """The policy after train step `step` is on every engine as `version`."""

    version: int
    step: int


class SnapshotRequest(msgspec.Struct, tag="snapshot_request", kw_only=True):
    step: int
    path: str


class SnapshotDone(msgspec.Struct, tag="snapshot_done", kw_only=True):
    step: int
    path: str


class Heartbeat(msgspec.Struct, tag="heartbeat", kw_only=True):
    sent_at: float


class Shutdown(msgspec.Struct, tag="shutdown", kw_only=True):
    reason: str


class Error(msgspec.Struct, tag="error", kw_only=True):
    code: str
    detail: str


Message = (
    Hello
    | Ready
    | PromptRequest
    | Prompts
    | PromptRelease
    | Group
    | GroupAcks
    | AckRequest
    | BatchRequest
    | Batch
    | NoBatch
    | WeightsPublished
    | SnapshotRequest
    | SnapshotDone
    | Heartbeat
    | Shutdown
    | Error
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(frame: bytes | memoryview, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Message:
    """Decode one frame. Raises FrameTooLarge or DecodeError (never anything else)."""
    size = len(frame)
    if size > max_bytes:
        raise FrameTooLarge(f"frame of {size} bytes exceeds the limit of {max_bytes} bytes")
    try:
        return _decoder.decode(frame)
    except msgspec.DecodeError as e:  # ValidationError is a subclass
        raise DecodeError(str(e)) from None


def check_trajectory(traj: Trajectory, where: str = "trajectory") -> None:
    """Raise DecodeError if the per-token arrays of `traj` disagree in length or are misaligned."""
    n = len(traj.loss_mask)
    for name in ("tokens", "logprobs", "versions"):
        data = getattr(traj, name)
        itemsize = np.dtype(ARRAY_DTYPES[name]).itemsize
        if len(data) != n * itemsize:
            raise DecodeError(
                f"{where}.{name}: {len(data)} bytes, expected {n * itemsize} "
                f"({n} tokens of {ARRAY_DTYPES[name]}, from loss_mask)"
            )


def check_group(group: Group, expected_size: int | None = None) -> None:
    """Raise DecodeError naming the first inconsistent field of a group."""
    if len(group.prompt_tokens) % 4:
        raise DecodeError(f"group {group.uid}: prompt_tokens is not a whole number of int32")
    if expected_size is not None and len(group.trajectories) != expected_size:
        raise DecodeError(
            f"group {group.uid}: {len(group.trajectories)} trajectories, expected {expected_size}"
        )
    seen: set[int] = set()
    for i, traj in enumerate(group.trajectories):
        check_trajectory(traj, f"group {group.uid}.trajectories[{i}]")
        if traj.sample_index in seen:
            raise DecodeError(f"group {group.uid}: sample_index {traj.sample_index} appears twice")
        seen.add(traj.sample_index)
