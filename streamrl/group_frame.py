"""Producer-written Group frames: a group encoded once, straight from its rollouts' token lists.

A generator holds each finished rollout as Python lists (token ids, loss mask, log-probs, versions)
returned by the engine. Building `Trajectory` structs would convert every list into a bytes object,
and encoding the `Group` would then gather those 4 x n_samples + 1 separate buffers into one frame:
two copies of every token and, for a 2G=32 group of 1k-token rollouts, a cold 420 KB gather at send
time that costs as much as moving the frame to the buffer process. `write_group` instead sizes the
frame exactly, allocates it once and converts each list straight into its place in the frame; the
transport then sends that frame zero-copy, as often as a resend needs, never encoding it again.
(Sending each array as its own zero-copy frame instead was measured: 129 frames of 1-4 KB move about
15x slower than one frame of the same bytes.)

The frame is the MessagePack that `messages.encode` produces for the same Group, byte for byte
(tests/streamrl/test_group_frame.py checks it), so receivers decode it with `messages.decode` as any
other message: producers choose how to encode, the wire schema stays one. The layout is derived from
the Group and Trajectory structs themselves (field order, defaults, array dtypes), so a schema change
cannot leave this writer behind silently: an unknown or missing field is an error naming it.

    write_group([{"sample_index": 0, "tokens": ids, "loss_mask": mask, ...}, ...],
                uid=..., prompt_id=..., admitted_version=..., generator=..., prompt_tokens=ids)
        -> GroupFrame(uid, data)          # client.send(frame) puts `data` on the wire as it is
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import msgspec
import numpy as np

from streamrl.messages import ARRAY_DTYPES, Group, Trajectory

_encode = msgspec.msgpack.Encoder().encode
_NODEFAULT: Any = msgspec.NODEFAULT


class GroupFrame(NamedTuple):
    """An encoded Group ready for the wire. `data` is never modified after `write_group` returns."""

    uid: int
    data: bytearray


class _Field(NamedTuple):
    name: str
    key: bytes  # the encoded field name (map-encoded structs only)
    dtype: np.dtype[Any] | None  # set for bytes-array fields
    default: Any


def _fields(cls: type[msgspec.Struct]) -> list[_Field]:
    fields = []
    for f in msgspec.structs.fields(cls):
        default = f.default if f.default_factory is _NODEFAULT else f.default_factory()
        dtype = np.dtype(ARRAY_DTYPES[f.name]) if f.name in ARRAY_DTYPES else None
        fields.append(_Field(f.name, _encode(f.encode_name), dtype, default))
    return fields


_GROUP = [f for f in _fields(Group) if f.name != "trajectories"]
_TRAJECTORY = _fields(Trajectory)
_GROUP_CONFIG = Group.__struct_config__
_TRAJECTORY_CONFIG = Trajectory.__struct_config__
# Layout assumptions, checked once at import: a schema change that breaks them fails here, loudly.
if not (
    _GROUP_CONFIG.tag_field is not None
    and not _GROUP_CONFIG.array_like
    and _TRAJECTORY_CONFIG.array_like
    and _TRAJECTORY_CONFIG.tag is None
    and [f.name for f in msgspec.structs.fields(Group)][-2:] == ["trajectories", "gen_time_s"]
):
    raise ImportError(
        "group_frame.py writes Group as a tagged map ending in trajectories, gen_time_s and "
        "Trajectory as an untagged array; messages.py changed that layout: update the writer"
    )
_GROUP_TAG = _encode(_GROUP_CONFIG.tag_field) + _encode(_GROUP_CONFIG.tag)
_TRAJECTORIES_KEY = _encode("trajectories")


def _container_header(n: int, fix: int, code16: int, code32: int) -> bytes:
    if n < 16:
        return bytes([fix | n])
    return struct.pack(">BH", code16, n) if n < 1 << 16 else struct.pack(">BI", code32, n)


def _array_header(n: int) -> bytes:
    return _container_header(n, 0x90, 0xDC, 0xDD)


def _bin_header(nbytes: int) -> bytes:
    if nbytes < 1 << 8:
        return struct.pack(">BB", 0xC4, nbytes)
    return struct.pack(">BH", 0xC5, nbytes) if nbytes < 1 << 16 else struct.pack(">BI", 0xC6, nbytes)


# A plan is the frame as a list of pieces: encoded bytes, or (dtype, values, nbytes) to convert in place.
_Piece = bytes | tuple[np.dtype[Any], Any, int]


def _plan_struct(
    fields: list[_Field], values: Mapping[str, Any], where: str, out: list[_Piece], *, keyed: bool
) -> dict[str, int]:
    """Append the pieces of one struct; return the element count of each of its array fields."""
    unknown = set(values) - {f.name for f in fields}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}")
    counts = {}
    for f in fields:
        value = values.get(f.name, f.default)
        if value is _NODEFAULT:
            raise ValueError(f"{where}: missing required field {f.name!r}")
        if keyed:
            out.append(f.key)
        if f.dtype is None:
            out.append(_encode(value))
            continue
        if isinstance(value, bytes | bytearray | memoryview):  # already packed: copied as it is
            value = memoryview(value).cast("B")
            if len(value) % f.dtype.itemsize:
                raise ValueError(
                    f"{where}.{f.name}: {len(value)} bytes is not a whole number of {f.dtype.str}"
                )
            counts[f.name], nbytes, dtype = len(value) // f.dtype.itemsize, len(value), np.dtype("u1")
        else:
            counts[f.name], nbytes, dtype = len(value), len(value) * f.dtype.itemsize, f.dtype
        out += [_bin_header(nbytes), (dtype, value, nbytes)]
    return counts


def _plan(trajectories: Sequence[Mapping[str, Any]], head: Mapping[str, Any]) -> list[_Piece]:
    *front, last = _GROUP  # gen_time_s follows the trajectories, as in the struct
    pieces: list[_Piece] = [bytes([0x80 | (len(_GROUP) + 2)]), _GROUP_TAG]  # tag + fields: a fixmap
    _plan_struct(front, {k: v for k, v in head.items() if k != last.name}, "group", pieces, keyed=True)
    pieces += [_TRAJECTORIES_KEY, _array_header(len(trajectories))]
    for i, traj in enumerate(trajectories):
        where = f"group.trajectories[{i}]"
        pieces.append(_array_header(len(_TRAJECTORY)))
        counts = _plan_struct(_TRAJECTORY, traj, where, pieces, keyed=False)
        if len(set(counts.values())) > 1:
            raise ValueError(f"{where}: per-token arrays differ in length: {counts}")
    _plan_struct([last], {last.name: head.get(last.name, last.default)}, "group", pieces, keyed=True)
    return pieces


def write_group(trajectories: Sequence[Mapping[str, Any]], **head: Any) -> GroupFrame:
    """Encode a Group from its fields (`head`) and one mapping of Trajectory fields per trajectory.

    Array fields take any sequence or numpy array (converted to the field's dtype in place, as
    `messages.pack` would) or already-packed bytes. Raises ValueError naming the field at fault.
    """
    pieces = _plan(trajectories, head)
    frame = bytearray(sum(len(p) if isinstance(p, bytes) else p[2] for p in pieces))
    offset = 0
    for piece in pieces:
        if isinstance(piece, bytes):
            frame[offset : offset + len(piece)] = piece
            offset += len(piece)
            continue
        dtype, values, nbytes = piece
        if nbytes:
            count = nbytes // dtype.itemsize
            if isinstance(values, list):  # fromiter converts a list of Python numbers fastest
                values = np.fromiter(values, dtype, count)
            np.frombuffer(frame, dtype, count, offset)[:] = values
        offset += nbytes
    return GroupFrame(int(head["uid"]), frame)


def frames_of(groups: Iterable[Group]) -> list[GroupFrame]:
    """GroupFrames of already-built Groups (tests and benchmarks; producers call write_group)."""
    return [
        write_group(
            [msgspec.structs.asdict(t) for t in g.trajectories],
            **{f.name: getattr(g, f.name) for f in _GROUP},
        )
        for g in groups
    ]
