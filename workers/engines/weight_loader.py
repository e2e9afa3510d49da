"""The embedded engine's side of SGLang's weight-update endpoints: join groups, receive, check, load.

Each method takes the endpoint's JSON body and returns SGLang's (success, message). Joining a group
runs on a worker thread (the rendezvous waits for the trainer; generation goes on meanwhile).
Receiving and loading run on the model thread between two forward steps (`Scheduler.call`), so no
step mixes weight versions. A load receives every tensor first (the sender is blocked until all
ranks take part, so a bad request must still drain the broadcast), then checks names and shapes
against the model, and copies only if all of them fit: a bad call changes nothing. An update sent
as several calls (buckets) is all-or-nothing per call only, as in SGLang; the trainer keeps the
engine paused for the whole update and sends `weight_version` with the last call.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
import torch.distributed as dist

from streamrl import weight_sync
from streamrl.log import get_logger
from workers.engines.scheduler import Scheduler

log = get_logger(__name__)
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name


class WeightLoader:
    def __init__(
        self,
        params: dict[str, torch.Tensor],
        scheduler: Scheduler,
        device: torch.device,
        group_timeout_s: float,
    ) -> None:
        self.params = params  # Hugging Face names -> the model's parameters
        self.scheduler, self.device, self.group_timeout_s = scheduler, device, group_timeout_s
        self.groups: dict[str, dist.ProcessGroup] = {}

    async def init_group(self, b: dict[str, Any]) -> tuple[bool, str]:
        name, backend = str(b.get("group_name") or DEFAULT_GROUP), str(b.get("backend") or "nccl")
        if name in self.groups:
            return False, f"group {name!r} already exists"
        if backend == "nccl" and self.device.type != "cuda":
            return False, f"backend nccl needs a CUDA device; this engine runs on {self.device}: use gloo"

        def join() -> None:  # registers the group even if the HTTP caller has gone away meanwhile
            self.groups[name] = weight_sync.init_update_group(
                str(b["master_address"]),
                int(b["master_port"]),
                int(b.get("rank_offset", 1)),  # tensor-parallel size 1: this engine's only rank
                int(b["world_size"]),
                name,
                backend,  # type: ignore[arg-type]
                self.group_timeout_s,
            )

        try:
            await asyncio.to_thread(join)
        except Exception as e:
            return False, f"Failed to init group: {e!r}"
        log.info("weight_group_joined", group=name, backend=backend, world_size=b["world_size"])
        return True, "Succeeded to initialize custom process group."

    async def destroy_group(self, b: dict[str, Any]) -> tuple[bool, str]:
        name = str(b.get("group_name") or DEFAULT_GROUP)
        group = self.groups.pop(name, None)
        if group is None:
            return False, f"group {name!r} does not exist"
        await asyncio.wrap_future(self.scheduler.call(lambda: weight_sync.destroy_update_group(group)))
        return True, "Succeeded to destroy custom process group."

    def close(self) -> None:
        """Destroy every group and drop the references (a live gloo group aborts the process at exit)."""
        for name in list(self.groups):
            weight_sync.destroy_update_group(self.groups.pop(name))

    async def update(self, b: dict[str, Any]) -> tuple[bool, str]:
        group = self.groups.get(str(b.get("group_name") or DEFAULT_GROUP))
        if group is None:
            return False, f"group {b.get('group_name')!r} not initialized: call init_weights_update_group"
        try:
            names, dtypes, shapes = list(b["names"]), list(b["dtypes"]), [list(s) for s in b["shapes"]]
            load_format = b.get("load_format")
            if not len(names) == len(dtypes) == len(shapes):
                raise ValueError("names, dtypes and shapes differ in length")
        except (KeyError, TypeError, ValueError) as e:
            return False, f"bad request: {e!r}"
        version, abort = b.get("weight_version"), bool(b.get("abort_all_requests"))

        def load() -> str | None:
            """On the model thread. Returns an error message, or None when loaded."""
            if abort:
                self.scheduler.abort(None, "Aborted by update_weights_from_distributed")
                self.scheduler.reap_aborts()  # they end reporting the version that produced them
            tensors = weight_sync.receive_weights(group, names, dtypes, shapes, load_format, self.device)
            bad = [n for n, t in tensors.items() if n not in self.params or self.params[n].shape != t.shape]
            if bad:
                return f"unknown names or wrong shapes, nothing loaded: {bad[:5]}"
            try:
                new_version = None if version is None else int(version)
            except ValueError:
                return f"weight_version must be an integer string, got {version!r}; nothing loaded"
            for n, t in tensors.items():
                self.params[n].copy_(t)
            if new_version is not None:
                self.scheduler.weight_version = new_version
            return None

        try:
            problem = await asyncio.wrap_future(self.scheduler.call(load))
        except Exception as e:  # the broadcast itself failed (timeout, peer gone)
            return False, f"Failed to update parameter online: {e!r}"
        if problem:
            return False, problem
        log.info("weights_updated", tensors=len(names), load_format=load_format, version=version)
        return True, "Succeeded to update parameter online."
