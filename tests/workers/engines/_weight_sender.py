"""The learner's side of weight updates, run as its own process by the engine tests:

    python -m tests.workers.engines._weight_sender --url URL --master-port P --group NAME
        --step DIR:per_tensor:1 --step DIR:flattened_bucket:2 [--step DIR:per_tensor:3:bad] [--bucket-bytes N]

Joins the engine to a new gloo group (this process rank 0, the engine rank 1). For each step it sends
every tensor of the Hugging Face model in DIR with SGLang's protocol while posting the metadata, prints
`updated VERSION`, and before the next step waits for a line on stdin (so the test can look at the
engine in between). A step ending in `:bad` is sent as a single call with one tensor renamed to a
name the model does not have, and prints `refused VERSION: message` when the engine refuses it. At the end it destroys the group. Any
other failure exits non-zero, error on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from concurrent.futures import Future

import torch
from transformers import AutoModelForCausalLM

from streamrl.weight_sync import UpdateCall, broadcast_weights, destroy_update_group, init_update_group
from workers.engines.client import EngineClient, EngineError


async def send(args: argparse.Namespace) -> None:
    async with EngineClient(args.url, timeout_s=60.0) as client:
        joined = asyncio.create_task(
            client.init_weights_update_group("127.0.0.1", args.master_port, 1, 2, args.group, "gloo")
        )
        group = await asyncio.to_thread(
            init_update_group, "127.0.0.1", args.master_port, 0, 2, args.group, "gloo", 60.0
        )
        await joined
        loop = asyncio.get_running_loop()
        for i, step in enumerate(args.step):
            weights, fmt, version, *bad = step.split(":")
            if i:
                await asyncio.to_thread(sys.stdin.readline)
            model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
            named = list(model.state_dict().items())
            if bad:
                named[-1] = ("model.not_a_weight", named[-1][1])
            posts: list[Future[str]] = []

            def post(call: UpdateCall, version: str = version, posts: list[Future[str]] = posts) -> None:
                """Runs on the broadcasting thread: fire the request, do not wait for its answer."""
                body = call.request(args.group, weight_version=version if call.last else None)
                posts.append(asyncio.run_coroutine_threadsafe(client.update_weights(body), loop))

            await asyncio.to_thread(
                broadcast_weights,
                group,
                named,
                1 << 40 if bad else args.bucket_bytes,  # all in one call: refused as a whole
                flattened=fmt == "flattened_bucket",
                on_update=post,
            )
            try:
                for p in posts:
                    await asyncio.wrap_future(p)
            except EngineError as e:
                print(f"refused {version}: {e.detail}", flush=True)
                continue
            print(f"updated {version} ({len(posts)} calls)", flush=True)
        await client.destroy_weights_update_group(args.group)
        destroy_update_group(group)
        del group


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--step", action="append", required=True, help="WEIGHTS_DIR:FORMAT:VERSION")
    p.add_argument("--bucket-bytes", type=int, default=1 << 20)
    asyncio.run(send(p.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
