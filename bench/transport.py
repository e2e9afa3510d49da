"""Group streaming through streamrl.transport vs raw pyzmq, between two processes.

What: a generator-like sender streams trajectory groups (2G=32 trajectories of 1,000 tokens: tokens
int32, loss_mask uint8, logprobs float32, versions int32, a short text; about 420 KB encoded) to a
buffer-like receiver in another process. Four variants, each with its own receiver process, all on
DEALER -> ROUTER, every receiver turning each frame into the same decoded Group:

- streamrl: what a generator does. `Client.send(frame)` with the GroupFrame the producer wrote
  (group_frame.write_group, straight from the rollouts' token lists), at most `--window` groups
  un-acked; the receiver (`Server.recv`) decodes every group and acks it with `Server.ack` (acks
  leave batched, see transport.py). When the sender has to wait on its acks (window full, round
  over) it asks for them with AckRequest, as `Client.request` does.
- encode_at_send: the same, but sending Group structs that `Client.send` encodes: what producer-
  written frames save (encoding gathers 4 x 32 + 1 separate arrays into one frame, a cold 420 KB copy).
- raw: the very frames streamrl sends, zero-copy on a raw DEALER; the receiver receives zero-copy and
  decodes them exactly as streamrl's does, and does not ack (one sync frame per round). The limit in
  the JSON line: raw pyzmq moving the same bytes to a receiver that uses them.
- socket: raw without the decode: the socket's own ceiling for this volume, for reference.

The 8 frames of a round's cycle are written before timing starts, as raw's payloads are: a generator
writes a group's frame when its last rollout finishes, not at send. What writing costs is measured
apart, in-process, against what it replaces (packing each list, then encoding the Group): the second
table, from the same Python lists an engine returns.

Every variant's sockets have the same high-water marks (HWM). A generator never waits on an ack to
go on (the buffer's admission control bounds what is in flight), so the default window (1024) is
above what the HWMs let into flight and, like raw's, the sender is held back by the HWM alone.

Why: the transport is on the hot path between generators and the buffer. value / limit says what
streamrl's protocol (handshake, acks, validation on receive) costs over moving the same bytes.
Rounds of the variants are interleaved so drift in a shared machine's load hits all of them; the
median of the timed rounds after warm-up is reported, and the JSON line adds the range of the
per-round ratio streamrl / raw (each pair of rounds ran back to back). The sender and every receiver
are pinned to a core of their own (`--no-pin` to let the scheduler place them): on 2 cores, 4-5 busy
threads placed at random swing a round by 2x. The CPU columns (user + system per group, zmq I/O
threads included) are steadier than groups/s when other work shares the machine.

    python -m bench.transport [--quick] [--groups N] [--repeats R] [--window W] [--no-tcp] [--no-pin]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # idle BLAS threads spin; this box has 2 cores

import argparse
import multiprocessing as mp
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from bench.common import emit, median_time, print_table
from streamrl import messages as m
from streamrl.group_frame import GroupFrame, write_group
from streamrl.log import configure as configure_logging
from streamrl.transport import Server, tune_allocator
from streamrl.transport_client import Client, Outgoing

VARIANTS = ("streamrl", "encode_at_send", "raw", "socket")
# What each plain-pyzmq receiver does with a frame (streamrl's receivers are Servers).
RECEIVER_WORK = {"raw": "decode", "socket": "none"}
HWM = 64  # messages, every variant's sockets; bounds a sender's run-ahead (about 27 MB in flight)


def make_rollouts(count: int, size: int, tokens: int) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Groups as a generator holds them: (group fields, one dict of Python lists per rollout)."""
    rng = np.random.default_rng(0)
    groups = []
    for uid in range(count):
        rollouts = [
            {
                "sample_index": i,
                "tokens": rng.integers(0, 150_000, tokens).tolist(),
                "loss_mask": rng.integers(0, 2, tokens).tolist(),
                "logprobs": (-rng.random(tokens)).tolist(),
                "versions": [7] * tokens,
                "reward": float(i % 2),
                "finish_reason": "stop",
                "num_turns": 2,
                "tool_calls": 1,
                "text": f"so the answer is \\boxed{{{uid * 31 + i}}}.",
            }
            for i in range(size)
        ]
        head = {"uid": uid, "prompt_id": f"prompt-{uid}", "admitted_version": 7, "generator": "gen0"}
        groups.append(({**head, "prompt_tokens": rng.integers(0, 150_000, 200).tolist()}, rollouts))
    return groups


def as_group(head: dict[str, Any], rollouts: list[dict[str, Any]]) -> m.Group:
    """The Group struct of the same data: each list packed, as encode-at-send producers build it."""
    trajectories = [m.pack_trajectory(r) for r in rollouts]
    return m.Group(
        **{**head, "prompt_tokens": m.pack("prompt_tokens", head["prompt_tokens"])}, trajectories=trajectories
    )


def receiver(variant: str, bind: str, report: Any, core: int | None) -> None:
    """Child process: serve one variant until the sender says it is done (or 60 s of silence).

    Reports its address, then at the end (CPU seconds, groups received) for the CPU column.
    """
    configure_logging(role=f"bench-{variant}", level="warning")  # stdout stays table + JSON
    _pin(core)
    tune_allocator()  # every variant alike, as the buffer role does
    cpu0, count = _cpu(), 0
    if variant not in RECEIVER_WORK:
        with Server(bind, hwm=HWM) as server:
            report.put(server.address)
            while (got := server.recv(60.0)) is not None:
                peer, msg = got
                if isinstance(msg, m.Shutdown):
                    break
                if not isinstance(msg, m.Group):
                    sys.exit(f"{variant} receiver: expected a Group, got {msg!r}")
                server.ack(peer, m.GroupAck(uid=msg.uid, status="accepted"))
                count += 1
        report.put((_cpu() - cpu0, count))
        return
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.bind(bind)
    report.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    while sock.poll(60_000):
        ident, payload = sock.recv_multipart(copy=False)
        if len(payload) == len(_END) and payload.bytes == _END:  # .bytes copies: only on tiny frames
            break
        if len(payload) == len(_ROUND_END) and payload.bytes == _ROUND_END:
            sock.send_multipart([ident, _ROUND_END])
            continue
        count += 1
        if RECEIVER_WORK[variant] == "decode":
            group = m.decode(payload.buffer)  # zero-copy, as Server.recv: arrays are views into the frame
            if not isinstance(group, m.Group):
                sys.exit(f"{variant} receiver: expected a Group, got {type(group).__name__}")
    sock.close()
    report.put((_cpu() - cpu0, count))


def _pin(core: int | None) -> None:
    """Sender on core 0, receivers on core 1 (with their zmq I/O threads, started after this), for
    every variant alike: on 2 cores, where the scheduler puts 4-5 busy threads swings a round by 2x."""
    if core is not None and hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > core:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[core]})


def _cpu() -> float:
    """User + system seconds of this process, all threads (zmq's I/O thread included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


_ROUND_END, _END = b"round", b"end"


def streamrl_round(client: Client, groups: list[Outgoing], n: int, window: int) -> float:
    t0 = time.perf_counter()
    outstanding = 0
    for i in range(n):
        if outstanding >= window:
            outstanding -= _wait_for_acks(client)
        client.send(groups[i % len(groups)])
        outstanding += 1
    while outstanding:
        outstanding -= _wait_for_acks(client)
    return time.perf_counter() - t0


def _wait_for_acks(client: Client) -> int:
    """A sender that must wait on its acks asks for them (AckRequest), then takes all that came."""
    client.send(m.AckRequest())
    acked = _acks(client.recv(30.0))
    while (more := client.recv(0.0)) is not None:  # every ack already here: one wake-up
        acked += _acks(more)
    return acked


def raw_round(sock: zmq.Socket[Any], payloads: list[bytearray], n: int, window: int) -> float:
    """The frames, zero-copy, no acks; one sync frame ends the round (raw and socket)."""
    t0 = time.perf_counter()
    for i in range(n):
        sock.send(payloads[i % len(payloads)], copy=False)
    sock.send(_ROUND_END)
    if not sock.poll(30_000):
        raise RuntimeError("raw receiver did not finish a round within 30 s")
    sock.recv()
    return time.perf_counter() - t0


ROUNDS: dict[str, Callable[[Any, Any, int, int], float]] = {
    "streamrl": streamrl_round,
    "encode_at_send": streamrl_round,
    "raw": raw_round,
    "socket": raw_round,
}


def _acks(msg: m.Message | None) -> int:
    if not isinstance(msg, m.GroupAcks):
        raise RuntimeError(f"expected GroupAcks, got {msg!r}")
    return len(msg.acks)


def producer_costs(
    rollouts: list[tuple[dict[str, Any], list[dict[str, Any]]]], repeats: int
) -> dict[str, float]:
    """Microseconds to turn one group of engine lists into its frame: written in place vs pack + encode."""
    ways: dict[str, Callable[[dict[str, Any], list[dict[str, Any]]], object]] = {
        "write_group": lambda head, rs: write_group(rs, **head),
        "pack_then_encode": lambda head, rs: m.encode(as_group(head, rs)),
    }
    return {
        name: 1e6 * median_time(lambda way=way: [way(h, rs) for h, rs in rollouts], repeats) / len(rollouts)
        for name, way in ways.items()
    }


def measure(
    args: argparse.Namespace,
    transports: list[str],
    groups: list[m.Group],
    frames: list[GroupFrame],
    payloads: list[bytearray],
    n: int,
    repeats: int,
    tmp: str,
) -> tuple[dict[tuple[str, str], list[float]], dict[tuple[str, str], float]]:
    """Round times per (transport, variant), and CPU microseconds per group (sender, receiver)."""
    ctx = mp.get_context("spawn")  # no zmq context or numpy thread pool inherited across fork
    children: list[Any] = []
    senders: dict[tuple[str, str], Any] = {}  # streamrl Client or raw zmq DEALER
    reports: dict[tuple[str, str], Any] = {}
    try:
        for transport in transports:
            for variant in VARIANTS:
                bind = f"ipc://{tmp}/{variant}.sock" if transport == "ipc" else "tcp://127.0.0.1:*"
                report = ctx.Queue()
                core = None if args.no_pin else 1
                child = ctx.Process(target=receiver, args=(variant, bind, report, core))
                child.start()
                children.append(child)
                address = report.get(timeout=60)
                reports[transport, variant] = report
                if variant not in RECEIVER_WORK:
                    client = Client(address, role="generator", name="gen0", hwm=HWM)
                    senders[transport, variant] = client
                    client.connect(30.0)
                else:
                    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
                    sock.setsockopt(zmq.LINGER, 1000)  # the last frame (_END) still leaves after close
                    sock.setsockopt(zmq.SNDHWM, HWM)
                    sock.connect(address)
                    senders[transport, variant] = sock

        times: dict[tuple[str, str], list[float]] = {key: [] for key in senders}
        sender_cpu: dict[tuple[str, str], list[float]] = {key: [] for key in senders}
        for r in range(args.warmup + repeats):
            for (transport, variant), sender in senders.items():
                data = (
                    groups if variant == "encode_at_send" else frames if variant == "streamrl" else payloads
                )
                cpu0 = _cpu()
                dt = ROUNDS[variant](sender, data, n, args.window)
                if r >= args.warmup:
                    times[transport, variant].append(dt)
                    sender_cpu[transport, variant].append(_cpu() - cpu0)
        cpu_us: dict[tuple[str, str], tuple[float, float]] = {}
        for key, sender in senders.items():
            sender.send(_END if key[1] in RECEIVER_WORK else m.Shutdown(reason="bench done"))
            receiver_s, received = reports[key].get(timeout=30)
            cpu_us[key] = (statistics.median(sender_cpu[key]) / n * 1e6, receiver_s / max(received, 1) * 1e6)
        for child in children:
            child.join(30)
            if child.exitcode != 0:
                raise RuntimeError(f"a receiver exited with {child.exitcode}")
        return times, cpu_us
    finally:
        for sender in senders.values():
            sender.close()
        for child in children:  # only after a failure is one still running
            if child.is_alive():
                child.terminate()
                child.join(10)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer and shorter rounds (under 30 s)")
    p.add_argument("--groups", type=int, default=None, help="groups per timed round")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds per variant")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--window", type=int, default=1024, help="un-acked groups a sender allows")
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--no-tcp", action="store_true")
    p.add_argument("--no-pin", action="store_true", help="let the scheduler place sender and receivers")
    args = p.parse_args(argv)
    configure_logging(role="bench", level="warning")
    _pin(None if args.no_pin else 0)
    tune_allocator()
    n = args.groups or (300 if args.quick else 1000)
    repeats = args.repeats or (7 if args.quick else 15)
    transports = ["ipc"] if args.no_tcp else ["ipc", "tcp"]

    rollouts = make_rollouts(8, args.group_size, args.tokens)
    frames = [write_group(rs, **head) for head, rs in rollouts]
    groups = [as_group(head, rs) for head, rs in rollouts]
    payloads = [f.data for f in frames]
    frame_bytes = statistics.mean(len(b) for b in payloads)
    with tempfile.TemporaryDirectory(prefix="srl-bench-") as tmp:
        times, cpu_us = measure(args, transports, groups, frames, payloads, n, repeats, tmp)
    produce_us = producer_costs(rollouts, 3 if args.quick else 7)

    rate = {key: n / statistics.median(ts) for key, ts in times.items()}
    rows = [
        [
            t,
            v,
            RECEIVER_WORK.get(v, "decode+ack"),
            rate[t, v],
            rate[t, v] * frame_bytes / 1e6,
            rate[t, v] / rate[t, "raw"],
            *cpu_us[t, v],
        ]
        for t in transports
        for v in VARIANTS
    ]
    title = (
        f"group = {args.group_size} x {args.tokens} tokens = {frame_bytes / 1e3:.0f} KB encoded; "
        f"ack window {args.window}; {n} groups a round; median of {repeats} interleaved rounds "
        f"after {args.warmup} warm-up"
    )
    headers = [
        "transport",
        "variant",
        "receiver",
        "groups/s",
        "MB/s",
        "vs raw",
        "sender CPU us",
        "receiver CPU us",
    ]
    print_table(headers, rows, title)
    # In each repeat the variants ran back to back, so the ratio of a repeat's two rounds cancels drift.
    paired = sorted(
        raw / ours for raw, ours in zip(times["ipc", "raw"], times["ipc", "streamrl"], strict=True)
    )
    print(
        f"ipc streamrl / raw per round: median {statistics.median(paired):.2f}, "
        f"range {paired[0]:.2f}-{paired[-1]:.2f} over {len(paired)} rounds\n"
    )
    print_table(
        ["producer", "us/group"],
        [[name, us] for name, us in produce_us.items()],
        "turning one group of engine token lists into its frame (in-process, median)",
    )
    config = {**vars(args), "groups": n, "repeats": repeats, "frame_bytes": frame_bytes, "raw_hwm": HWM}
    extra: dict[str, Any] = {f"{t}_{v}_groups_per_s": rate[t, v] for t, v in rate}
    extra |= {f"{t}_{v}_sender_cpu_us_per_group": cpu_us[t, v][0] for t, v in cpu_us}
    extra |= {f"{t}_{v}_receiver_cpu_us_per_group": cpu_us[t, v][1] for t, v in cpu_us}
    ipc = {v: rate["ipc", v] for v in VARIANTS}
    extra["ratio_vs_encode_at_send"] = ipc["streamrl"] / ipc["encode_at_send"]
    extra |= {f"produce_{name}_us_per_group": us for name, us in produce_us.items()}
    extra["ratio_vs_socket"] = ipc["streamrl"] / ipc["socket"]  # everything, decode included
    extra["ratio_rounds_median"] = statistics.median(paired)
    extra["ratio_rounds_min"], extra["ratio_rounds_max"] = paired[0], paired[-1]
    return emit(
        bench="transport",
        metric="groups_per_s",
        value=ipc["streamrl"],
        limit_name="raw_pyzmq_decoded_groups_per_s",
        limit_value=ipc["raw"],
        config=config,
        **extra,
    )


if __name__ == "__main__":
    main()
