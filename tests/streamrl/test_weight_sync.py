"""SGLang's weight-update protocol pieces: bucket layout and packing (mixed dtypes, alignment), update
planning, and a real gloo broadcast between two processes in both formats."""

from __future__ import annotations

import multiprocessing as mp
import queue
from typing import Any

import pytest
import torch

from streamrl.weight_buckets import BucketPacker, flatten_parameters, stream_updates
from streamrl.weight_sync import (
    bucket_layout,
    dtype_name,
    pack_bucket,
    parse_dtype,
    plan_updates,
    unpack_bucket,
)
from tests.conftest import free_port


def mixed_tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Odd sizes on purpose: in listed order a bf16 tensor of 3 elements leaves the next offset at 6."""
    g = torch.Generator().manual_seed(seed)
    return [
        ("a.bf16", torch.randn(3, generator=g).to(torch.bfloat16)),
        ("b.f32", torch.randn(2, 5, generator=g)),
        ("c.u8", torch.randint(0, 255, (7,), generator=g, dtype=torch.uint8)),
        ("d.i64", torch.randint(-(2**40), 2**40, (3,), generator=g)),
        ("e.f16", torch.randn(1, 3, generator=g).to(torch.float16)),
        ("f.bool", torch.tensor([True, False, True])),
        ("g.empty", torch.zeros(0, 4)),
    ]


def test_layout_is_back_to_back_bytes_in_listed_order() -> None:
    slots = bucket_layout(["x", "y", "z"], [torch.float32, torch.bfloat16, torch.int64], [[2, 3], [5], []])
    assert [(s.start, s.nbytes) for s in slots] == [(0, 24), (24, 10), (34, 8)]
    with pytest.raises(ValueError, match="differ in length"):
        bucket_layout(["x"], [], [])


def test_pack_then_unpack_is_bit_exact_for_mixed_dtypes_even_when_misaligned() -> None:
    named = mixed_tensors()
    names, tensors = [n for n, _ in named], [t for _, t in named]
    buf = pack_bucket(tensors)
    assert buf.dtype == torch.uint8 and buf.numel() == sum(t.numel() * t.element_size() for t in tensors)
    out = unpack_bucket(buf, names, [t.dtype for t in tensors], [list(t.shape) for t in tensors])
    for name, t in named:
        assert out[name].dtype == t.dtype and out[name].shape == t.shape and torch.equal(out[name], t)
    with pytest.raises(ValueError, match="layout needs uint8"):
        unpack_bucket(buf[:-1], names, [t.dtype for t in tensors], [list(t.shape) for t in tensors])


def test_planned_buckets_are_aligned_so_unpacking_needs_no_copies() -> None:
    (call,) = plan_updates(mixed_tensors(), bucket_bytes=1 << 20)
    req = call.request("g", weight_version="3")
    dtypes = [parse_dtype(d) for d in req["dtypes"]]  # type: ignore[union-attr]
    assert [d.itemsize for d in dtypes] == sorted((d.itemsize for d in dtypes), reverse=True)
    for s in bucket_layout(req["names"], dtypes, req["shapes"]):  # type: ignore[arg-type]
        assert s.start % s.dtype.itemsize == 0, s
    buf = pack_bucket([t for _, t in call.tensors])
    out = unpack_bucket(buf, req["names"], dtypes, req["shapes"])  # type: ignore[arg-type]
    assert all(
        o.numel() == 0 or o.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        for o in out.values()
    )


def test_updates_are_split_at_the_bucket_size_and_only_the_last_call_is_last() -> None:
    named = [(f"w{i}", torch.zeros(250)) for i in range(10)]  # 1000 bytes each
    calls = plan_updates(named, bucket_bytes=2500)
    assert [len(c.tensors) for c in calls] == [2, 2, 2, 2, 2] and [c.last for c in calls] == [False] * 4 + [
        True
    ]
    big = plan_updates(
        [("small", torch.zeros(1)), ("big", torch.zeros(1000)), ("s2", torch.zeros(1))], 100, flattened=False
    )
    assert [[n for n, _ in c.tensors] for c in big] == [["small"], ["big"], ["s2"]]
    assert big[0].load_format is None and calls[0].load_format == "flattened_bucket"
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_updates(named, 0)


def test_streamed_updates_match_the_plan_and_pull_one_bucket_ahead_at_most() -> None:
    named = [(f"w{i}", torch.zeros(250)) for i in range(10)]  # 1000 bytes each
    pulled: list[int] = []

    def source():  # type: ignore[no-untyped-def]
        for i, nt in enumerate(named):
            pulled.append(i)
            yield nt

    stream = stream_updates(source(), bucket_bytes=2500)
    first = next(stream)
    assert [n for n, _ in first.tensors] == ["w0", "w1"] and pulled == [0, 1, 2] and not first.last
    rest = list(stream)
    planned = plan_updates(named, bucket_bytes=2500)
    assert [[n for n, _ in c.tensors] for c in [first, *rest]] == [[n for n, _ in c.tensors] for c in planned]
    assert [c.last for c in rest] == [False, False, False, True]


def test_the_packer_sends_contiguous_buckets_as_views_and_copies_others_into_two_buffers() -> None:
    flat = torch.arange(12, dtype=torch.float32)
    packer = BucketPacker()
    whole = packer.pack([flat[:4], flat[4:10]])
    assert whole.data_ptr() == flat.data_ptr() and torch.equal(whole, flat[:10].view(torch.uint8))
    assert packer.copied_bytes == 0 and packer.view([flat[:4], flat[6:]]) is None
    a, b = torch.ones(3), torch.full((2,), 2.0)
    first = packer.pack([a, b])
    second = packer.pack([b, a])  # while `first` may still be on the wire: another buffer
    assert torch.equal(first.view(torch.float32), torch.tensor([1.0, 1, 1, 2, 2]))
    assert torch.equal(second.view(torch.float32), torch.tensor([2.0, 2, 1, 1, 1]))
    third = packer.pack([a, b])  # `first` is done by now: its buffer is reused
    assert first.data_ptr() != second.data_ptr() and third.data_ptr() == first.data_ptr()
    assert packer.copied_bytes == 3 * 20


def test_flattened_parameters_keep_values_lie_back_to_back_and_start_64_byte_aligned() -> None:
    g = torch.Generator().manual_seed(0)
    tied = torch.nn.Parameter(torch.randn(4, 16, generator=g))
    params = {"emb": tied, "b": torch.nn.Parameter(torch.randn(3, generator=g)), "head": tied}
    params["w"] = torch.nn.Parameter(torch.randn(16, generator=g).to(torch.bfloat16))
    before = {n: p.detach().clone() for n, p in params.items()}
    flats = flatten_parameters(params)
    assert len(flats) == 2  # float32 and bfloat16
    for name, p in params.items():
        assert torch.equal(p, before[name]) and p.data_ptr() % 64 == 0
    assert params["head"].data_ptr() == params["emb"].data_ptr()  # tied: stored once
    assert params["b"].data_ptr() == params["emb"].data_ptr() + 4 * 16 * 4  # 256 bytes: no padding
    assert flats[0].numel() == (64 + 16) * 4  # 3 floats padded to 64 bytes


def test_dtype_names_are_sglangs() -> None:
    assert dtype_name(torch.bfloat16) == "bfloat16" and parse_dtype("torch.float16") is torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_dtype("Tensor")


# ---------------------------------------------------------------- two processes


def _sender(port: int, meta: mp.Queue, flattened_modes: list[bool]) -> None:
    from streamrl.weight_sync import broadcast_weights, destroy_update_group, init_update_group

    group = init_update_group("127.0.0.1", port, 0, 2, "test-wsync", "gloo", 60.0)
    for flattened in flattened_modes:
        broadcast_weights(
            group,
            mixed_tensors(),
            40,
            flattened=flattened,
            on_update=lambda c: meta.put(c.request("test-wsync")),
        )
    meta.put(None)
    destroy_update_group(group)
    del group


def _receiver(port: int, meta: mp.Queue, result: mp.Queue) -> None:
    from streamrl.weight_sync import destroy_update_group, init_update_group, receive_weights

    group = init_update_group("127.0.0.1", port, 1, 2, "test-wsync", "gloo", 60.0)
    received: list[dict[str, Any]] = []
    while (req := meta.get(timeout=60)) is not None:
        got = receive_weights(group, req["names"], req["dtypes"], req["shapes"], req["load_format"])
        received.append({"format": req["load_format"], "tensors": got})
    result.put(received)
    meta.get(timeout=60)  # the parent has unpickled the tensors: their shared storage may go now
    destroy_update_group(group)
    del group


def test_a_gloo_broadcast_between_two_processes_delivers_every_tensor_bit_exact() -> None:
    ctx = mp.get_context("spawn")
    meta, result = ctx.Queue(), ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_sender, args=(port, meta, [True, False])),
        ctx.Process(target=_receiver, args=(port, meta, result)),
    ]
    for p in procs:
        p.start()
    try:
        received = result.get(timeout=120)
        meta.put("done")
    except queue.Empty:
        pytest.fail("the receiver gave no result within 120 s")
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
    assert [p.exitcode for p in procs] == [0, 0]
    expected = dict(mixed_tensors())
    for fmt in ("flattened_bucket", None):
        got = {n: t for r in received if r["format"] == fmt for n, t in r["tensors"].items()}
        assert set(got) == set(expected)
        for name, t in expected.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), (fmt, name)
    assert sum(r["format"] == "flattened_bucket" for r in received) > 1  # 40-byte buckets: several calls
