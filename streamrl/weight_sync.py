"""SGLang's weight-update protocol, both ends: dtypes, bucket layout, planning, the group, broadcast, receive.

The protocol (SGLang 0.5, see ../shared/reference/platform.md):

1. Group. The trainer is rank 0 of a dedicated process group of `1 + engines * tp_size` ranks; each
   engine rank joins as `rank_offset + tp_rank` (`/init_weights_update_group`). Rendezvous is a TCP
   store hosted by rank 0 at `master_address:master_port`, wrapped in a `PrefixStore(group_name)`;
   the group is built with torch's `_new_process_group_helper` exactly as SGLang builds its side, so
   the store keys match and a streamrl trainer can join a real SGLang server. The group does not
   need (or touch) either side's default process group. Checked with torch 2.13: gloo between two
   local processes with no default group; the group must be destroyed and its last reference
   dropped before exit, or the gloo threads abort the process at interpreter shutdown.
2. Update. For every `/update_weights_from_distributed` call the trainer posts `names`, `dtypes`,
   `shapes` (Hugging Face parameter names) and, at the same time, broadcasts from rank 0 either each
   tensor in the listed order, or with `load_format="flattened_bucket"` one uint8 tensor holding the
   tensors' bytes back to back.

Alignment: SGLang's `FlattenedTensorBucket` concatenates bytes without padding and reads each
tensor back with `view(dtype)`, which needs the byte offset to be a multiple of the item size. So
padding would break compatibility; instead `plan_updates` orders each bucket by decreasing item size
(8, 4, 2, 1 bytes), which makes every offset naturally aligned. `unpack_bucket` still accepts a
misaligned offset (from some other sender) by copying that one slice.

Avoiding copies (`BucketPacker`, `flatten_parameters`) and pulling weights one bucket at a time
(`stream_updates`) live in streamrl.weight_buckets; the receiver can receive straight into its
parameters (`out=`).

Sender (learner):  group = init_update_group(...); broadcast_weights(group, named, bucket_bytes,
                   on_update=post)   # `post` fires the HTTP request for each call, non-blocking
                   (streamrl.weight_push.WeightPusher runs a whole update: pause, stream, verify, resume)
Receiver (engine): group = init_update_group(...); receive_weights(group, names, dtypes, shapes, fmt)
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from streamrl.errors import WeightSyncError

LoadFormat = Literal["flattened_bucket"] | None
Backend = Literal["gloo", "nccl"]


# ---------------------------------------------------------------- dtypes and layout


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's wire name of a dtype: `torch.bfloat16` -> "bfloat16" (it does `getattr(torch, name)`)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """Inverse of `dtype_name`; accepts a "torch." prefix; refuses anything that is not a dtype."""
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return value


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one tensor lies in a flattened bucket (byte offsets)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


def bucket_layout(
    names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
) -> list[Slot]:
    """Byte layout of a flattened bucket: tensors back to back in the listed order, as SGLang reads it."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"names, dtypes, shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}"
        )
    slots, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * dtype.itemsize
        slots.append(Slot(name, dtype, tuple(int(d) for d in shape), offset, nbytes))
        offset += nbytes
    return slots


def pack_bucket(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One uint8 tensor holding each tensor's bytes in order (the `flattened_bucket` payload)."""
    if not tensors:
        raise ValueError("cannot pack an empty bucket")
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(parts)


def unpack_bucket(
    buffer: torch.Tensor,
    names: Sequence[str],
    dtypes: Sequence[torch.dtype],
    shapes: Sequence[Sequence[int]],
) -> dict[str, torch.Tensor]:
    """Tensors of a flattened bucket, as views into `buffer` where the offset is aligned."""
    slots = bucket_layout(names, dtypes, shapes)
    total = slots[-1].start + slots[-1].nbytes if slots else 0
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != total:
        raise ValueError(f"bucket is {buffer.dtype} {tuple(buffer.shape)}, layout needs uint8 ({total},)")
    out = {}
    for s in slots:
        raw = buffer[s.start : s.start + s.nbytes]
        if s.start % s.dtype.itemsize:
            raw = raw.clone()  # a misaligned slice cannot be viewed as a wider dtype: copy just this one
        out[s.name] = raw.view(s.dtype).reshape(s.shape)
    return out


# ---------------------------------------------------------------- planning updates


@dataclass(frozen=True, slots=True)
class UpdateCall:
    """One `/update_weights_from_distributed` call: the metadata to post and the tensors to broadcast."""

    tensors: list[tuple[str, torch.Tensor]]
    load_format: LoadFormat
    index: int
    count: int

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def request(
        self,
        group_name: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> dict[str, object]:
        """SGLang's JSON body for this call. Pass `weight_version` only with the last call of an update,
        so an engine never reports the new version while holding half of the new weights."""
        return {
            "names": [n for n, _ in self.tensors],
            "dtypes": [dtype_name(t.dtype) for _, t in self.tensors],
            "shapes": [list(t.shape) for _, t in self.tensors],
            "group_name": group_name,
            "load_format": self.load_format,
            "weight_version": weight_version,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }


def plan_updates(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, flattened: bool = True
) -> list[UpdateCall]:
    """Split the weights into calls of at most `bucket_bytes` (a bigger tensor gets a call of its own).

    With `flattened`, each call's tensors are ordered by decreasing item size so the packed bucket is
    aligned without padding (see the module docstring). Without it the listed order is kept and every
    tensor of a call is broadcast on its own (AReaL's style).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in named_tensors:
        n = t.numel() * t.element_size()
        if groups[-1] and size + n > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, t))
        size += n
    groups = [g for g in groups if g]
    if flattened:
        groups = [sorted(g, key=lambda nt: -nt[1].element_size()) for g in groups]  # stable sort
    fmt: LoadFormat = "flattened_bucket" if flattened else None
    return [UpdateCall(g, fmt, i, len(groups)) for i, g in enumerate(groups)]


# ---------------------------------------------------------------- the group


def init_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: Backend = "gloo",
    timeout_s: float = 600.0,
) -> dist.ProcessGroup:
    """Join (rank 0: host) the weight-update group; blocks until all `world_size` ranks have joined.

    Built like SGLang's `init_custom_process_group` so both ends agree on the store keys: TCP
    rendezvous, `PrefixStore(group_name)`, then torch's private `_new_process_group_helper` with an
    empty rank list (the "this is a world of its own" path, which needs no default group). The group
    is registered with identity rank mapping so `dist.broadcast(..., group=g)` works on it.
    """
    from torch.distributed.distributed_c10d import (  # private API, as in SGLang; pinned torch 2.13
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a world of {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        dist.Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,  # part of the backend's store keys too: both sides must use it
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_update_group(group: dist.ProcessGroup) -> None:
    """Tear a group down (its name is free again at once); the caller must drop its own references
    to it afterwards, and only once none of its operations is pending: the backend's destructor
    (gloo's joins its worker threads holding the GIL) runs when the last reference goes, and with
    an operation stuck on a dead peer it freezes the whole process until that operation's timeout.
    See `retire_group`."""
    dist.destroy_process_group(group)


def retire_group(group: dist.ProcessGroup, pending: Sequence[dist.Work]) -> threading.Thread | None:
    """Destroy a group given up while `pending` operations may still run: deregistered now (a new
    group of the same name can form at once), its last reference held by a daemon thread until they
    have ended (at the group's timeout at the latest). Returns that thread, if one was needed."""
    destroy_update_group(group)
    running = [w for w in pending if not w.is_completed()]
    if not running:
        return None

    def hold(group: dist.ProcessGroup, running: list[dist.Work]) -> None:
        for work in running:
            with contextlib.suppress(Exception):  # it fails or times out: expected
                work.wait()  # releases the GIL while it waits
        # returning drops the references here, now that the backend's threads are idle

    thread = threading.Thread(target=hold, args=(group, running), name="retire-weight-group", daemon=True)
    thread.start()
    return thread


# ---------------------------------------------------------------- both ends of an update


def broadcast_weights(
    group: dist.ProcessGroup,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    *,
    flattened: bool = True,
    on_update: Callable[[UpdateCall], None] | None = None,
    src: int = 0,
) -> list[UpdateCall]:
    """Sender side: for each planned call, `on_update(call)` (which must post the HTTP request without
    waiting for its answer: the engine answers only after the broadcast), then broadcast its tensors.

    Tensors are sent from their own device; with NCCL they must be on the GPU. Returns the calls made.
    """
    calls = plan_updates(named_tensors, bucket_bytes, flattened)
    for call in calls:
        if on_update is not None:
            on_update(call)
        if call.load_format == "flattened_bucket":
            dist.broadcast(pack_bucket([t for _, t in call.tensors]), src=src, group=group)
        else:
            for _, t in call.tensors:
                dist.broadcast(t.detach().contiguous(), src=src, group=group)
    return calls


class BroadcastAbandoned(WeightSyncError):
    """`wait_work` gave up (asked to, or its deadline passed); `work` may still be running."""

    def __init__(self, message: str, work: dist.Work) -> None:
        super().__init__(message)
        self.work = work


def wait_work(
    work: dist.Work,
    timeout_s: float,
    should_stop: Callable[[], str | None] | None = None,
    *,
    gloo: bool = True,
    poll_s: float = 0.05,
) -> None:
    """Wait for an async collective, at most `timeout_s`, asking `should_stop` every `poll_s`.

    `should_stop` returns a reason to give up (or None). Giving up raises BroadcastAbandoned and
    leaves the operation running in the backend: the group is broken; `retire_group` it. A failed
    collective raises its own error (e.g. gloo's "Connection closed by peer"). On gloo the wait is
    sliced `wait(timeout)` calls, which return the moment the work completes; on NCCL a timed-out
    wait tears the communicator down, so it polls `is_completed` every millisecond instead.
    """
    deadline = time.monotonic() + timeout_s
    slice_ = datetime.timedelta(seconds=poll_s)
    while not work.is_completed():
        reason = should_stop() if should_stop is not None else None
        if reason:
            raise BroadcastAbandoned(f"gave up waiting for the broadcast: {reason}", work)
        if time.monotonic() >= deadline:
            raise BroadcastAbandoned(f"broadcast did not complete within {timeout_s} s", work)
        if not gloo:
            time.sleep(0.001)
            continue
        with contextlib.suppress(RuntimeError):  # a slice ran out, or it failed: `wait()` below tells
            work.wait(slice_)
    work.wait()  # re-raises the backend's error, if any (and orders the CUDA stream after NCCL)


def receive_weights(
    group: dist.ProcessGroup,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    load_format: LoadFormat = None,
    device: torch.device | str = "cpu",
    src: int = 0,
    *,
    out: torch.Tensor | Sequence[torch.Tensor] | None = None,
    timeout_s: float = 600.0,
    should_stop: Callable[[], str | None] | None = None,
) -> dict[str, torch.Tensor]:
    """Engine side of one call: receive the tensors the sender broadcasts for this metadata.

    `out` receives in place: for "flattened_bucket" one uint8 tensor of the bucket's size (the
    returned tensors are views into it), per tensor a list matching `names`. Otherwise fresh tensors
    are allocated. Each broadcast is waited for with `wait_work(timeout_s, should_stop)`.
    """
    torch_dtypes = [parse_dtype(d) for d in dtypes]
    gloo = dist.get_backend(group) == "gloo"

    def recv(t: torch.Tensor) -> None:
        work = dist.broadcast(t, src=src, group=group, async_op=True)
        wait_work(work, timeout_s, should_stop, gloo=gloo)

    if load_format == "flattened_bucket":
        slots = bucket_layout(names, torch_dtypes, shapes)
        size = slots[-1].start + slots[-1].nbytes if slots else 0
        if out is None:
            buffer = torch.empty(size, dtype=torch.uint8, device=device)
        elif isinstance(out, torch.Tensor) and out.dtype == torch.uint8 and out.shape == (size,):
            buffer = out
        else:
            raise ValueError(f"out must be a uint8 tensor of shape ({size},) for this bucket")
        recv(buffer)
        return unpack_bucket(buffer, names, torch_dtypes, shapes)
    if load_format is not None:
        raise ValueError(f"unsupported load_format {load_format!r}")
    if out is not None and (isinstance(out, torch.Tensor) or len(out) != len(names)):
        raise ValueError(f"out must be a list of {len(names)} tensors for a per-tensor update")
    result = {}
    for i, (name, dtype, shape) in enumerate(zip(names, torch_dtypes, shapes, strict=True)):
        t = torch.empty(tuple(shape), dtype=dtype, device=device) if out is None else out[i]  # type: ignore[index]
        recv(t)
        result[name] = t
    return result
