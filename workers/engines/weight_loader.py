"""The embedded engine's side of SGLang's weight-update endpoints: join groups, receive, check, load.

Each method takes the endpoint's JSON body and returns SGLang's (success, message). Joining a group
runs on a worker thread (the rendezvous waits for the trainer; generation goes on meanwhile).
Receiving and loading run on the model thread between two forward steps (`Scheduler.call`), so no
step mixes weight versions. An update sent as several calls (buckets) is all-or-nothing per call
only, as in SGLang; the trainer keeps the engine paused for the whole update and sends
`weight_version` with the last call.

Zero copies. At start the parameters are moved into one flat buffer per dtype, in the model's
state-dict order, 64-byte aligned (`weight_buckets.flatten_parameters`, which also keeps the engine's
numerics equal to those of a learner's copy of the same weights). A sender that sends the same
names in the same order (any Hugging Face-named learner of this architecture) produces buckets whose
bytes are exactly a range of that buffer, so they are received straight into the parameters: no
receive buffer and no copy. Per-tensor updates receive into each parameter. Anything else (another
order, tied duplicates, another dtype, which is cast) is received into a warm scratch buffer and
copied: a fresh buffer per call would pay a page fault per 4 KB, about as slow as the wire.

Checks come before the broadcast, from the metadata: a call naming an unknown tensor or a wrong
shape still drains the broadcast (the sender is blocked until every rank takes part) and changes
nothing. What the metadata cannot rule out is a broadcast that fails half-way (the trainer or a peer
died): then part of that bucket's range holds new bytes, the version is not bumped, the call answers
failure, and the group is dropped. streamrl's trainer (`streamrl.weight_push`) sends full weights at
its next push.

A receive also gives up when the trainer gives up on the call (it closes the HTTP request): gloo
does not fail a receive whose sender is gone until the group's timeout, and the engine would
otherwise stay stuck in it, unable to generate or join a new group, for that long.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import torch
import torch.distributed as dist

from streamrl import weight_buckets, weight_sync
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
        self._flats = weight_buckets.flatten_parameters(params)
        self._scratch: torch.Tensor | None = None  # reused receive buffer for buckets not in place

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

    def _drop_broken(self, name: str, group: dist.ProcessGroup, pending: dist.Work | None) -> None:
        """A receive failed or gave up: the group's collectives are out of step; forget it. Its name
        is free at once; its last reference is held until an abandoned receive has ended (dropping
        it earlier would freeze the process: `weight_sync.retire_group`)."""
        if self.groups.get(name) is group:
            del self.groups[name]
        self._scratch = None  # the abandoned receive may still write into it
        weight_sync.retire_group(group, [] if pending is None else [pending])

    def _targets(
        self, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]], load_format: str | None
    ) -> torch.Tensor | list[torch.Tensor] | None:
        """Where to receive in place: the parameters themselves, or None (receive, then copy)."""
        params = [self.params[n] for n in names]
        if not all(p.is_contiguous() and p.dtype == d for p, d in zip(params, dtypes, strict=True)):
            return None  # another dtype is cast on copy, as SGLang's loader does
        if load_format != "flattened_bucket":
            return [p.data for p in params]
        slots = weight_sync.bucket_layout(names, dtypes, shapes)
        start = params[0].data_ptr()
        if any(p.data_ptr() != start + s.start for p, s in zip(params, slots, strict=True)):
            return None
        end = start + slots[-1].start + slots[-1].nbytes
        for flat in self._flats:
            base = flat.data_ptr()
            if base <= start and end <= base + flat.numel():
                return flat[start - base : end - base]
        return None

    async def update(self, b: dict[str, Any]) -> tuple[bool, str]:
        group_name = str(b.get("group_name") or DEFAULT_GROUP)
        group = self.groups.get(group_name)
        if group is None:
            return False, f"group {b.get('group_name')!r} not initialized: call init_weights_update_group"
        try:
            names, dtypes, shapes = list(b["names"]), list(b["dtypes"]), [list(s) for s in b["shapes"]]
            load_format = b.get("load_format")
            if not len(names) == len(dtypes) == len(shapes):
                raise ValueError("names, dtypes and shapes differ in length")
            torch_dtypes = [weight_sync.parse_dtype(d) for d in dtypes]
        except (KeyError, TypeError, ValueError) as e:
            return False, f"bad request: {e!r}"
        version, abort = b.get("weight_version"), bool(b.get("abort_all_requests"))
        problem = self._check(names, shapes, version)
        given_up = threading.Event()

        def stop_reason() -> str | None:
            return "the trainer closed the request" if given_up.is_set() else None

        def load() -> str | None:
            """On the model thread. Returns an error message, or None when loaded."""
            if abort:
                self.scheduler.abort(None, "Aborted by update_weights_from_distributed")
                self.scheduler.reap_aborts()  # they end reporting the version that produced them
            in_place = None if problem else self._targets(names, torch_dtypes, shapes, load_format)
            out = in_place
            if out is None and load_format == "flattened_bucket":
                out = self._scratch_for(weight_sync.bucket_layout(names, torch_dtypes, shapes))
            try:
                tensors = weight_sync.receive_weights(
                    group, names, dtypes, shapes, load_format, self.device,
                    out=out, timeout_s=self.group_timeout_s, should_stop=stop_reason,
                )  # fmt: skip
            except Exception as e:
                pending = e.work if isinstance(e, weight_sync.BroadcastAbandoned) else None
                self._drop_broken(group_name, group, pending)
                return f"Failed to update parameter online: {e!r}"
            if problem:
                return problem
            if in_place is None:
                for n, t in tensors.items():
                    self.params[n].copy_(t)
            if version is not None:
                self.scheduler.weight_version = int(version)
            return None

        try:
            problem = await asyncio.wrap_future(self.scheduler.call(load))
        except asyncio.CancelledError:
            given_up.set()  # the client closed the request: stop waiting for its broadcast
            log.warning("weights_update_given_up", group=group_name, tensors=len(names))
            raise
        if problem:
            log.warning("weights_update_failed", group=group_name, tensors=len(names), error=problem)
            return False, problem
        log.info("weights_updated", tensors=len(names), load_format=load_format, version=version)
        return True, "Succeeded to update parameter online."

    def _scratch_for(self, slots: list[weight_sync.Slot]) -> torch.Tensor:
        """A warm receive buffer of the bucket's size: a fresh one per call would pay a page fault
        per 4 KB, as slow as the wire. It grows to the largest such bucket and is kept."""
        size = slots[-1].start + slots[-1].nbytes if slots else 0
        if self._scratch is None or self._scratch.numel() < size:
            self._scratch = None
            self._scratch = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self._scratch[:size]

    def _check(self, names: list[str], shapes: list[list[int]], version: object) -> str | None:
        """What is wrong with a call's metadata (then nothing is loaded), or None."""
        bad = [
            n
            for n, s in zip(names, shapes, strict=True)
            if n not in self.params or list(self.params[n].shape) != s
        ]
        if bad:
            return f"unknown names or wrong shapes, nothing loaded: {bad[:5]}"
        try:
            int(version) if version is not None else None  # type: ignore[call-overload]
        except ValueError:
            return f"weight_version must be an integer string, got {version!r}; nothing loaded"
        return None

    async def get_weights(self, b: dict[str, Any]) -> list[Any] | None:
        """SGLang's /get_weights_by_name: the first `truncate_size` rows as float32 nested lists
        (exact for fp32, bf16 and fp16); None for an unknown name or a 0-d tensor."""
        name, rows = str(b.get("name", "")), int(b.get("truncate_size", 100))
        param = self.params.get(name)
        if param is None or param.dim() == 0:
            return None
        # on the model thread, so it never reads a half-loaded bucket
        return await asyncio.wrap_future(
            self.scheduler.call(lambda: param.detach()[:rows].to("cpu", torch.float32).tolist())
        )
