"""Copy avoidance and streaming for weight updates: the sender's bucket packer, flat parameter
buffers (both ends), and calls planned one bucket at a time.

Copies cost as much as the wire here (a fresh 256 MB buffer fills at about 2 GB/s because of page
faults, about gloo's loopback speed; a copy into a warm buffer runs at about 10 GB/s), so the sender
packs into a reused buffer and skips packing when a bucket's tensors already lie back to back in one
storage (`BucketPacker`), and the receiver can receive straight into its parameters (`out=` of
`weight_sync.receive_weights`), which `flatten_parameters` arranges. The protocol itself (layout,
`UpdateCall`, the group, broadcast and receive) is in streamrl.weight_sync.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from streamrl.weight_sync import LoadFormat, UpdateCall


def _adjacent(views: Sequence[torch.Tensor]) -> bool:
    """True when the uint8 views lie back to back, in order, in one storage."""
    storage = views[0].untyped_storage().data_ptr()
    end = views[0].data_ptr() + views[0].numel()
    for v in views[1:]:
        if v.untyped_storage().data_ptr() != storage or v.data_ptr() != end:
            return False
        end += v.numel()
    return True


class BucketPacker:
    """Sender side: a bucket's bytes as one uint8 tensor, copying only when it must.

    A single tensor, or tensors already back to back in one storage (a flat parameter buffer, see
    `flatten_parameters`), are sent as a view with no copy. Otherwise the bytes are copied into one
    of two scratch buffers, alternately, so the next bucket can be packed while the previous one is
    still on the wire. They are kept across buckets and updates (each grows to the largest bucket):
    a fresh buffer per bucket would pay a page fault per 4 KB, which on a CPU costs about as much as
    the broadcast itself.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._scratch: list[torch.Tensor | None] = [None, None]
        self._turn = 0
        self.copied_bytes = 0  # bytes that needed a copy, for benchmarks and tests

    def view(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The bucket's bytes without a copy (one tensor, or tensors back to back), else None."""
        if not tensors:
            raise ValueError("cannot pack an empty bucket")
        views = [self._bytes(t) for t in tensors]
        if len(views) == 1:
            return views[0]
        if not _adjacent(views):
            return None
        first, total = views[0], sum(v.numel() for v in views)
        return torch.empty(0, dtype=torch.uint8, device=first.device).set_(
            first.untyped_storage(), first.storage_offset(), (total,), (1,)
        )

    def pack(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The bucket's bytes: a view when possible, else a copy in a buffer that is reused two
        copies later (the caller must be done sending it by then)."""
        if (whole := self.view(tensors)) is not None:
            return whole
        views = [self._bytes(t) for t in tensors]
        total = sum(v.numel() for v in views)
        self._turn ^= 1
        scratch = self._scratch[self._turn]
        if scratch is None or scratch.numel() < total:
            self._scratch[self._turn] = None  # free the old one first
            scratch = self._scratch[self._turn] = torch.empty(total, dtype=torch.uint8, device=self.device)
        out = scratch[:total]
        torch.cat(views, out=out)
        self.copied_bytes += total
        return out

    def _bytes(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.device != self.device:
            t = t.to(self.device)
        return t.contiguous().reshape(-1).view(torch.uint8)

    def release(self) -> None:
        self._scratch = [None, None]


ALIGN = 64  # bytes: where torch's CPU allocator starts every tensor


def flatten_parameters(params: dict[str, torch.Tensor], align: int = ALIGN) -> list[torch.Tensor]:
    """Move every tensor of `params` into one flat buffer per (device, dtype), in `params` order
    (tied tensors once), each starting on an `align`-byte boundary, rebinding `.data`; returns the
    buffers as uint8 views.

    Both ends use it. An engine receives a bucket straight into its parameters when the bucket's
    bytes are one range of such a buffer; a learner whose parameters live in one sends its buckets
    without packing them. Tensors whose sizes are multiples of `align` (all of a usual LLM's) lie
    back to back, so a bucket of consecutive ones is one range.

    The alignment is what torch's allocator gives a tensor of its own, and it matters: CPU kernels
    take other code paths for other alignments, so weights that start at 8 mod 64 (as
    from_pretrained can leave them) give logits that differ in the last bits from the same weights
    on 64-byte boundaries. Aligned, an engine computes exactly what the learner's copy computes.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    seen: set[int] = set()
    for t in params.values():
        if id(t) not in seen:
            seen.add(id(t))
            groups.setdefault((t.device, t.dtype), []).append(t)
    flats = []
    for (device, dtype), tensors in groups.items():
        step = max(1, align // dtype.itemsize)
        starts, end = [], 0
        for t in tensors:
            starts.append(end)
            end += -(-t.numel() // step) * step
        flat = torch.zeros(end, dtype=dtype, device=device)
        for t, start in zip(tensors, starts, strict=True):
            view = flat[start : start + t.numel()].view(t.shape)
            view.copy_(t.detach())
            t.data = view
        flats.append(flat.view(torch.uint8))
    return flats


def stream_updates(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, flattened: bool = True
) -> Iterator[UpdateCall]:
    """`plan_updates` one call at a time, pulling tensors only as each call fills up, so a learner
    that gathers (TP/PP) or converts weights on the fly holds at most one bucket of them.

    The count of calls is not known until the end: every call but the last has `count` 0, the last
    has `count == index + 1`, so `call.last` is right (it needs one tensor of look-ahead).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    fmt: LoadFormat = "flattened_bucket" if flattened else None
    it = iter(named_tensors)
    pending = next(it, None)
    index = 0
    while pending is not None:
        group, size = [pending], pending[1].numel() * pending[1].element_size()
        pending = None
        for name, t in it:
            n = t.numel() * t.element_size()
            if size + n > bucket_bytes:
                pending = (name, t)
                break
            group.append((name, t))
            size += n
        if flattened:
            group.sort(key=lambda nt: -nt[1].element_size())  # stable: aligned without padding
        yield UpdateCall(group, fmt, index, index + 1 if pending is None else 0)
        index += 1
