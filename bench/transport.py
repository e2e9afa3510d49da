"""Group streaming through streamrl.transport vs raw pyzmq, between two processes.

What: a generator-like sender streams trajectory groups (2G=32 trajectories of 1,000 tokens: tokens
int32, loss_mask uint8, logprobs float32, versions int32, a short text; about 420 KB encoded) to a
buffer-like receiver in another process. Five variants, each with its own receiver process, all on
DEALER -> ROUTER, every receiver turning each frame into the same decoded Group:

- streamrl: `Client.send(group)` with at most `--window` groups un-acked; the receiver
  (`Server.recv`) decodes every group and answers a GroupAck.
- codec: the same work written directly against pyzmq (encode, zero-copy send, decode from the
  frame, one ack per group), without the transport layer: what streamrl cannot go below.
- raw_acked: the pre-encoded bytes, zero-copy; the receiver decodes and acks as above. What the
  acked protocol costs on bytes that need no encoding.
- raw: the pre-encoded bytes (the very bytes streamrl puts on the wire), zero-copy; the receiver
  receives zero-copy and decodes them exactly as streamrl's does, and does not ack (one sync frame
  per round). The limit in the JSON line: raw pyzmq moving the same data to a receiver that uses it.
- socket: raw without the decode: the socket's own ceiling for this volume, for reference.

Why: the transport is on the hot path between generators and the buffer. value / limit says what
encoding, acks and the transport layer cost together; the rows between say which costs what (streamrl
/ codec: the transport layer; codec / raw_acked: encoding; raw_acked / raw: acks). Rounds of the
variants are interleaved so drift in a shared machine's load hits all of them; the median of the
timed rounds after warm-up is reported, and the JSON line adds the range of the per-round ratio
streamrl / raw (each pair of rounds ran back to back). The CPU column (user + system, both
processes, zmq I/O threads included) is steadier than groups/s when other work shares the cores.

Where the gap is (2-core VM shared with other work; per-group CPU, both processes): raw costs
120-190 us, so a ratio of 0.9 leaves 13-21 us for everything streamrl adds, and its two protocol
costs are each about that much at their very best. Encoding gathers 129 separate arrays into one
frame: 16 us hot and alone, 50 us with 32 frames in flight; in the pipeline codec / raw_acked is
0.45-0.85. The per-group ack, a small message each way through both zmq I/O threads, costs 13-19 us
even for 100-byte messages between two processes (acking cuts their rate to 0.27-0.37); here
raw_acked / raw is 0.65-0.95. The transport layer (streamrl / codec) is lost in the noise: its
receive path measured 1-2 us per group above plain pyzmq. Out-of-band arrays do not help: 129
zero-copy frames of 1-4 KB are about 15x slower than one frame, one gathered out-of-band frame is
the same copy as encoding, and for 110 KB arrays (27k-token trajectories) they move CPU from the
sender to the receiver, the buffer, which serves every generator.

    python -m bench.transport [--quick] [--groups N] [--repeats R] [--window W] [--no-tcp]
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

from bench.common import emit, print_table
from streamrl import messages as m
from streamrl.log import configure as configure_logging
from streamrl.transport import Client, Server, tune_allocator

VARIANTS = ("streamrl", "codec", "raw_acked", "raw", "socket")
# What each plain-pyzmq receiver does with a frame (streamrl's receiver is a Server).
RECEIVER_WORK = {"codec": "decode+ack", "raw_acked": "decode+ack", "raw": "decode", "socket": "none"}
RAW_HWM = 64  # messages; bounds an un-acked sender's run-ahead (about 27 MB in flight)


def make_groups(count: int, size: int, tokens: int) -> list[m.Group]:
    rng = np.random.default_rng(0)
    groups = []
    for uid in range(count):
        trajs = [
            m.Trajectory(
                sample_index=i,
                tokens=m.pack("tokens", rng.integers(0, 150_000, tokens)),
                loss_mask=m.pack("loss_mask", rng.integers(0, 2, tokens)),
                logprobs=m.pack("logprobs", -rng.random(tokens)),
                versions=m.pack("versions", np.full(tokens, 7)),
                reward=float(i % 2),
                finish_reason="stop",
                num_turns=2,
                tool_calls=1,
                text=f"so the answer is \\boxed{{{uid * 31 + i}}}.",
            )
            for i in range(size)
        ]
        groups.append(
            m.Group(
                uid=uid,
                prompt_id=f"prompt-{uid}",
                admitted_version=7,
                generator="gen0",
                prompt_tokens=m.pack("prompt_tokens", rng.integers(0, 150_000, 200)),
                trajectories=trajs,
            )
        )
    return groups


def receiver(variant: str, bind: str, report: Any) -> None:
    """Child process: serve one variant until the sender says it is done (or 60 s of silence).

    Reports its address, then at the end (CPU seconds, groups received) for the CPU column.
    """
    configure_logging(role=f"bench-{variant}", level="warning")  # stdout stays table + JSON
    tune_allocator()  # every variant alike, as the buffer role does
    cpu0, count = _cpu(), 0
    if variant == "streamrl":
        with Server(bind) as server:
            report.put(server.address)
            while (got := server.recv(60.0)) is not None:
                peer, msg = got
                if isinstance(msg, m.Shutdown):
                    break
                if not isinstance(msg, m.Group):
                    sys.exit(f"streamrl receiver: expected a Group, got {msg!r}")
                server.send(peer, m.GroupAck(uid=msg.uid, status="accepted"))
                count += 1
        report.put((_cpu() - cpu0, count))
        return
    work = RECEIVER_WORK[variant]
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.RCVHWM, RAW_HWM)
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
        if work == "none":
            continue
        group = m.decode(payload.buffer)  # zero-copy, as Server.recv: arrays are views into the frame
        if not isinstance(group, m.Group):
            sys.exit(f"{variant} receiver: expected a Group, got {type(group).__name__}")
        if work == "decode+ack":
            sock.send_multipart([ident, m.encode(m.GroupAck(uid=group.uid, status="accepted"))])
    sock.close()
    report.put((_cpu() - cpu0, count))


def _cpu() -> float:
    """User + system seconds of this process, all threads (zmq's I/O thread included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


_ROUND_END, _END = b"round", b"end"


def streamrl_round(client: Client, groups: list[m.Group], n: int, window: int) -> float:
    t0 = time.perf_counter()
    outstanding = 0
    for i in range(n):
        if outstanding >= window:
            outstanding -= _ack(client.recv(30.0))
            while (more := client.recv(0.0)) is not None:  # take every ack already here: one wake-up
                outstanding -= _ack(more)
        group = groups[i % len(groups)]
        group.uid = i  # a distinct id per send, as the buffer's ledger requires
        client.send(group)
        outstanding += 1
    while outstanding:
        outstanding -= _ack(client.recv(30.0))
    return time.perf_counter() - t0


def codec_round(sock: zmq.Socket[Any], groups: list[m.Group], n: int, window: int) -> float:
    """The same work by hand: encode, zero-copy send, decode, one ack per group; no transport layer."""
    return _acked_round(sock, groups, n, window, encode=True)


def raw_acked_round(sock: zmq.Socket[Any], payloads: list[bytes], n: int, window: int) -> float:
    """Pre-encoded bytes under the same ack window as codec: the acks' cost without encoding."""
    return _acked_round(sock, payloads, n, window, encode=False)


def _acked_round(sock: zmq.Socket[Any], items: list[Any], n: int, window: int, *, encode: bool) -> float:
    t0 = time.perf_counter()
    outstanding = 0
    for i in range(n):
        if outstanding >= window:
            outstanding -= _ack(_recv_message(sock))
            while sock.poll(0):  # every ack already here, as streamrl_round does
                outstanding -= _ack(_recv_message(sock))
        item = items[i % len(items)]
        if encode:
            item.uid = i
            item = m.encode(item)
        sock.send(item, copy=False)
        outstanding += 1
    while outstanding:
        outstanding -= _ack(_recv_message(sock))
    return time.perf_counter() - t0


def raw_round(sock: zmq.Socket[Any], payloads: list[bytes], n: int, window: int) -> float:
    """Pre-encoded bytes, zero-copy, no acks; one sync frame ends the round (raw and socket)."""
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
    "codec": codec_round,
    "raw_acked": raw_acked_round,
    "raw": raw_round,
    "socket": raw_round,
}


def _recv_message(sock: zmq.Socket[Any]) -> m.Message | None:
    return m.decode(sock.recv(copy=False).buffer) if sock.poll(30_000) else None


def _ack(msg: m.Message | None) -> int:
    if not isinstance(msg, m.GroupAck):
        raise RuntimeError(f"expected a GroupAck, got {msg!r}")
    return 1


def measure(
    args: argparse.Namespace,
    transports: list[str],
    groups: list[m.Group],
    payloads: list[bytes],
    n: int,
    repeats: int,
    tmp: str,
) -> tuple[dict[tuple[str, str], list[float]], dict[tuple[str, str], float]]:
    """Round times per (transport, variant), and CPU microseconds per group (both processes)."""
    ctx = mp.get_context("spawn")  # no zmq context or numpy thread pool inherited across fork
    children: list[Any] = []
    senders: dict[tuple[str, str], Any] = {}  # streamrl Client or raw zmq DEALER
    reports: dict[tuple[str, str], Any] = {}
    try:
        for transport in transports:
            for variant in VARIANTS:
                bind = f"ipc://{tmp}/{variant}.sock" if transport == "ipc" else "tcp://127.0.0.1:*"
                report = ctx.Queue()
                child = ctx.Process(target=receiver, args=(variant, bind, report))
                child.start()
                children.append(child)
                address = report.get(timeout=60)
                reports[transport, variant] = report
                if variant == "streamrl":
                    client = Client(address, role="generator", name="gen0")
                    senders[transport, variant] = client
                    client.connect(30.0)
                else:
                    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
                    sock.setsockopt(zmq.LINGER, 1000)  # the last frame (_END) still leaves after close
                    sock.setsockopt(zmq.SNDHWM, RAW_HWM)
                    sock.connect(address)
                    senders[transport, variant] = sock

        times: dict[tuple[str, str], list[float]] = {key: [] for key in senders}
        sender_cpu: dict[tuple[str, str], list[float]] = {key: [] for key in senders}
        for r in range(args.warmup + repeats):
            for (transport, variant), sender in senders.items():
                data = groups if variant in ("streamrl", "codec") else payloads
                cpu0 = _cpu()
                dt = ROUNDS[variant](sender, data, n, args.window)
                if r >= args.warmup:
                    times[transport, variant].append(dt)
                    sender_cpu[transport, variant].append(_cpu() - cpu0)
        cpu_us: dict[tuple[str, str], float] = {}
        for key, sender in senders.items():
            sender.send(m.Shutdown(reason="bench done") if key[1] == "streamrl" else _END)
            receiver_s, received = reports[key].get(timeout=30)
            cpu_us[key] = (statistics.median(sender_cpu[key]) / n + receiver_s / max(received, 1)) * 1e6
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
    p.add_argument("--window", type=int, default=32, help="un-acked groups a sender allows")
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--no-tcp", action="store_true")
    args = p.parse_args(argv)
    configure_logging(role="bench", level="warning")
    tune_allocator()
    n = args.groups or (300 if args.quick else 1000)
    repeats = args.repeats or (7 if args.quick else 15)
    transports = ["ipc"] if args.no_tcp else ["ipc", "tcp"]

    groups = make_groups(8, args.group_size, args.tokens)
    payloads = [m.encode(g) for g in groups]
    frame_bytes = statistics.mean(len(b) for b in payloads)
    with tempfile.TemporaryDirectory(prefix="srl-bench-") as tmp:
        times, cpu_us = measure(args, transports, groups, payloads, n, repeats, tmp)

    rate = {key: n / statistics.median(ts) for key, ts in times.items()}
    rows = [
        [
            t,
            v,
            RECEIVER_WORK.get(v, "decode+ack"),
            rate[t, v],
            rate[t, v] * frame_bytes / 1e6,
            rate[t, v] / rate[t, "raw"],
            cpu_us[t, v],
        ]
        for t in transports
        for v in VARIANTS
    ]
    title = (
        f"group = {args.group_size} x {args.tokens} tokens = {frame_bytes / 1e3:.0f} KB encoded; "
        f"ack window {args.window}; {n} groups a round; median of {repeats} interleaved rounds "
        f"after {args.warmup} warm-up"
    )
    headers = ["transport", "variant", "receiver", "groups/s", "MB/s", "vs raw", "CPU us/group"]
    print_table(headers, rows, title)
    # In each repeat the variants ran back to back, so the ratio of a repeat's two rounds cancels drift.
    paired = sorted(
        raw / ours for raw, ours in zip(times["ipc", "raw"], times["ipc", "streamrl"], strict=True)
    )
    print(
        f"ipc streamrl / raw per round: median {statistics.median(paired):.2f}, "
        f"range {paired[0]:.2f}-{paired[-1]:.2f} over {len(paired)} rounds"
    )
    config = {**vars(args), "groups": n, "repeats": repeats, "frame_bytes": frame_bytes, "raw_hwm": RAW_HWM}
    extra: dict[str, Any] = {f"{t}_{v}_groups_per_s": rate[t, v] for t, v in rate}
    extra |= {f"{t}_{v}_cpu_us_per_group": cpu_us[t, v] for t, v in cpu_us}
    ipc = {v: rate["ipc", v] for v in VARIANTS}
    extra["ratio_vs_codec"] = ipc["streamrl"] / ipc["codec"]  # the transport layer's own cost
    extra["ratio_vs_raw_acked"] = ipc["streamrl"] / ipc["raw_acked"]  # transport + encoding
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
