"""The replay buffer's state machine: admission, RoC, GRPO advantages, batches, ledger, snapshots.

Pure bookkeeping, no sockets and no clocks of its own (callers pass `now`); workers/buffer.py puts
it behind the transport.

    dataset ──cursor──▶ admit() ──Prompts──▶ generators ──Group──▶ add_group()
                          ▲  (capacity rule)                         │ sort by sample_index,
                          │                                          │ RoC select, GRPO advantages
          release()/expire() (re-dispatch)                           ▼
                                                        ready queue (FIFO of accepted groups)
                                                                     │ sweep (staleness), take B
                                  on_weights_published() ◀── learner ◀── next_batch(step)
                                  (version v, batch -> trained)

Invariants (tests/streamrl/test_buffer.py checks each):
1. The unit is a completed group. RoC sees trajectories ordered by `sample_index` (submission
   order), never by arrival order.
2. Admission: a prompt is dispatched only while accepted + running < (eta + v + 1) * B, where
   accepted = groups accepted and not dropped (ready + delivered + trained). Groups filtered by RoC
   never count; groups dropped by the staleness sweep stop counting, so their slots reopen.
3. No trained group is older than eta: before each batch the ready queue is swept and every group
   with step - admitted_version > eta is dropped, counted and logged. A group with a model token
   older than its admission version (a restarted engine) is sent back for re-dispatch.
4. No silent loss: every dispatch has a uid with a ledger entry that ends as `trained` (once) or
   `dropped` with a reason. A prompt whose generator died or gave it back is dispatched again under
   the same uid; the first complete group for a uid wins, later ones are acknowledged as duplicates.
5. Snapshots are self-contained: cursor, prompts to re-dispatch (in flight + queued), ready groups,
   batches delivered after the snapshot's step (returned to the head of the queue), counters, ledger.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import msgspec
import numpy as np

from streamrl.advantages import grpo_advantages, whiten
from streamrl.config import JobSpec
from streamrl.data import Cursor, PromptSource
from streamrl.errors import DecodeError
from streamrl.messages import Array, Batch, Group, GroupAck, Prompt, check_group, pack, unpack
from streamrl.roc import RocConfig, select_with_stats

LedgerState = Literal["dispatched", "ready", "delivered", "trained", "dropped"]


class LedgerEntry(msgspec.Struct, array_like=True, gc=False):
    prompt_id: str
    state: LedgerState = "dispatched"
    dispatches: int = 0
    reason: str = ""
    step: int = -1
    trained_count: int = 0


class ReadyGroup(msgspec.Struct, gc=False):
    group: Group  # only the kept trajectories, in sample_index order
    advantages: Array  # float32, one per kept trajectory


class BufferSnapshot(msgspec.Struct):
    step: int
    version: int
    cursor: int
    redispatch: list[Prompt]
    ready: list[ReadyGroup]
    trained_groups: int
    counters: dict[str, int]
    staleness: dict[int, int]
    ledger: dict[int, LedgerEntry]


class ReplayBuffer:
    def __init__(self, spec: JobSpec, source: PromptSource, cursor: Cursor) -> None:
        self.spec = spec
        self.source, self.cursor = source, cursor
        self.B = spec.buffer.groups_per_step
        self.eta = spec.buffer.max_staleness
        self.roc = RocConfig.from_section(spec.roc) if spec.roc.enabled else None
        self.version = 0
        self.position = 0  # next cursor position = next new uid
        self.redispatch: collections.deque[Prompt] = collections.deque()
        self.in_flight: dict[int, tuple[Prompt, str]] = {}
        self.ready: collections.deque[ReadyGroup] = collections.deque()
        self.delivered: dict[int, list[ReadyGroup]] = {}
        self.trained_groups = 0
        self.ledger: dict[int, LedgerEntry] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        self.staleness: collections.Counter[int] = collections.Counter()  # at delivery, in versions

    # ------------------------------------------------------------------ admission

    @property
    def accepted(self) -> int:
        return self.trained_groups + sum(map(len, self.delivered.values())) + len(self.ready)

    def capacity(self) -> int:
        cap = (self.eta + self.version + 1) * self.B - (self.accepted + len(self.in_flight))
        limit = self.spec.buffer.max_inflight_prompts
        if limit is not None:
            cap = min(cap, limit - len(self.in_flight))
        return max(cap, 0)

    def admit(self, generator: str, max_prompts: int) -> list[Prompt]:
        """Dispatch up to `max_prompts` prompts to `generator`, as far as the capacity rule allows."""
        out: list[Prompt] = []
        for _ in range(min(max_prompts, self.capacity())):
            if self.redispatch:
                prompt = self.redispatch.popleft()
                prompt.admitted_version = self.version
                self.counters["redispatched"] += 1
            else:
                prompt = self._new_prompt()
            self.ledger[prompt.uid].dispatches += 1
            self.in_flight[prompt.uid] = (prompt, generator)
            out.append(prompt)
        self.counters["dispatched"] += len(out)
        return out

    def _new_prompt(self) -> Prompt:
        uid = self.position
        self.position += 1
        item = self.source[self.cursor.index(uid)]
        self.ledger[uid] = LedgerEntry(prompt_id=item.prompt_id)
        return Prompt(
            uid=uid,
            prompt_id=item.prompt_id,
            answer=item.answer,
            messages=item.messages,
            text=item.text,
            meta=item.meta,
            admitted_version=self.version,
            n_samples=self.spec.rollout.n_samples,
        )

    def release(self, uids: Iterable[int], reason: str) -> int:
        """Put in-flight prompts back for re-dispatch (generator gave up or died). Returns how many."""
        n = 0
        for uid in uids:
            entry = self.in_flight.pop(uid, None)
            if entry is not None:
                self.redispatch.append(entry[0])
                self.counters[f"released_{reason}"] += 1
                n += 1
        return n

    def expire(self, generator: str) -> int:
        """Re-dispatch everything `generator` holds (it is presumed dead)."""
        return self.release([u for u, (_, g) in self.in_flight.items() if g == generator], "expired")

    # ------------------------------------------------------------------ groups in

    def add_group(self, group: Group) -> GroupAck:
        entry = self.ledger.get(group.uid)
        if entry is None:
            self.counters["rejected"] += 1
            return GroupAck(uid=group.uid, status="rejected", detail=f"unknown uid {group.uid}")
        if entry.state != "dispatched":
            self.counters["duplicates"] += 1
            return GroupAck(uid=group.uid, status="duplicate", detail=f"uid {group.uid} is {entry.state}")
        try:
            check_group(group, expected_size=self.spec.rollout.n_samples)
        except DecodeError as e:
            # The prompt is not lost: it goes back to be generated again.
            self.release([group.uid], "malformed")
            self.counters["rejected"] += 1
            return GroupAck(uid=group.uid, status="rejected", detail=str(e))
        if (oldest := _oldest_model_token_version(group)) < group.admitted_version:
            # An engine behind the policy the prompt was admitted under (one restarted with its
            # initial weights, or skipped by a failed push) sampled it: training it would break the
            # staleness bound, so the prompt is generated again.
            self.release([group.uid], "behind_admission")
            detail = f"tokens of version {oldest} for a prompt admitted at version {group.admitted_version}"
            return GroupAck(uid=group.uid, status="filtered", detail=detail)
        self._forget_dispatch(group.uid)
        self.counters["groups_in"] += 1
        self.counters["trajectories_in"] += len(group.trajectories)
        group.trajectories.sort(key=lambda t: t.sample_index)
        rewards = [t.reward for t in group.trajectories]
        if self.roc is not None:
            texts = [t.text for t in group.trajectories]
            try:
                roc = select_with_stats(rewards, texts, self.roc, group_key=group.uid)
            except ValueError as e:  # the reference's size assert (odd n); never take the buffer down
                return self._drop(group.uid, entry, "roc_invalid", detail=str(e))
            kept = roc.kept
            if not kept:
                return self._drop(group.uid, entry, f"roc_{roc.dropped}")
            if len(kept) != len(rewards):
                group.trajectories = [group.trajectories[i] for i in kept]
                rewards = [rewards[i] for i in kept]
        self.counters["trajectories_kept"] += len(rewards)
        adv = grpo_advantages(np.asarray(rewards, dtype=np.float64), eps=self.spec.algorithm.grpo_eps)
        self.ready.append(ReadyGroup(group=group, advantages=pack("advantages", adv)))
        entry.state = "ready"
        self.counters["accepted"] += 1
        return GroupAck(uid=group.uid, status="accepted")

    def _forget_dispatch(self, uid: int) -> None:
        if self.in_flight.pop(uid, None) is None:
            # The generator was presumed dead but delivered after all: cancel the re-dispatch.
            self.redispatch = collections.deque(p for p in self.redispatch if p.uid != uid)

    def _drop(self, uid: int, entry: LedgerEntry, reason: str, detail: str = "") -> GroupAck:
        entry.state, entry.reason = "dropped", reason
        self.counters[f"dropped_{reason}"] += 1
        return GroupAck(uid=uid, status="filtered", detail=detail or reason)

    # ------------------------------------------------------------------ batches out

    def sweep(self, step: int) -> int:
        """Drop ready groups that would be trained at `step` more than eta versions after admission."""
        keep: collections.deque[ReadyGroup] = collections.deque()
        dropped = 0
        for rg in self.ready:
            if step - rg.group.admitted_version > self.eta:
                self._drop(rg.group.uid, self.ledger[rg.group.uid], "stale")
                dropped += 1
            else:
                keep.append(rg)
        self.ready = keep
        return dropped

    def next_batch(self, step: int) -> Batch | None:
        """The batch for train step `step`, or None while fewer than B fresh groups are ready.

        Asking again for a step already delivered (a learner that restarted) returns the same groups.
        """
        groups = self.delivered.get(step)
        if groups is None:
            self.sweep(step)
            if len(self.ready) < self.B:
                return None
            groups = [self.ready.popleft() for _ in range(self.B)]
            self.delivered[step] = groups
            for rg in groups:
                entry = self.ledger[rg.group.uid]
                entry.state, entry.step = "delivered", step
                self.staleness[step - rg.group.admitted_version] += 1
            self.counters["batches"] += 1
        advantages = [rg.advantages for rg in groups]
        if self.spec.algorithm.normalize_advantages:
            counts = [
                np.array([int(unpack("loss_mask", t.loss_mask).sum()) for t in rg.group.trajectories])
                for rg in groups
            ]
            advantages = [
                pack("advantages", a) for a in whiten([unpack("advantages", a) for a in advantages], counts)
            ]
        return Batch(
            step=step, policy_version=self.version, groups=[rg.group for rg in groups], advantages=advantages
        )

    def on_weights_published(self, version: int, step: int) -> bool:
        """The learner finished `step` and engines serve `version`. False if the version went back."""
        if version < self.version:
            self.counters["version_regressions"] += 1
            return False
        self.version = version
        for s in sorted(s for s in self.delivered if s <= step):
            for rg in self.delivered.pop(s):
                entry = self.ledger[rg.group.uid]
                entry.state, entry.trained_count = "trained", entry.trained_count + 1
                self.trained_groups += 1
        return True

    # ------------------------------------------------------------------ snapshots

    def snapshot(self, step: int) -> BufferSnapshot:
        """State as of a learner checkpoint after `step`: later deliveries go back to the queue head."""
        requeue = [rg for s in sorted(self.delivered) if s > step for rg in self.delivered[s]]
        ledger = {uid: msgspec.structs.replace(e) for uid, e in self.ledger.items()}
        for rg in requeue:
            ledger[rg.group.uid].state, ledger[rg.group.uid].step = "ready", -1
        trained = self.trained_groups
        for s in (s for s in self.delivered if s <= step):  # trained, though not yet acknowledged
            for rg in self.delivered[s]:
                e = ledger[rg.group.uid]
                e.state, e.trained_count = "trained", e.trained_count + 1
                trained += 1
        redispatch = [p for p, _ in self.in_flight.values()] + list(self.redispatch)
        return BufferSnapshot(
            step=step,
            version=self.version,
            cursor=self.position,
            redispatch=redispatch,
            ready=requeue + list(self.ready),
            trained_groups=trained,
            counters=dict(self.counters),
            staleness=dict(self.staleness),
            ledger=ledger,
        )

    def restore(self, snap: BufferSnapshot) -> None:
        self.version, self.position = snap.version, snap.cursor
        self.redispatch = collections.deque(snap.redispatch)
        self.in_flight, self.delivered = {}, {}
        self.ready = collections.deque(snap.ready)
        self.trained_groups = snap.trained_groups
        self.counters = collections.Counter(snap.counters)
        self.staleness = collections.Counter(snap.staleness)
        self.ledger = snap.ledger

    def ledger_problems(self) -> list[str]:
        """Violations of invariant 4 (empty when the books balance)."""
        problems = [
            f"uid {u} trained {e.trained_count} times" for u, e in self.ledger.items() if e.trained_count > 1
        ]
        holding = {p.uid for p in self.redispatch} | set(self.in_flight)
        for uid, e in self.ledger.items():
            if e.state == "dispatched" and uid not in holding:
                problems.append(f"uid {uid} is dispatched but neither in flight nor queued")
        return problems


def _oldest_model_token_version(group: Group) -> int:
    """The lowest weight version among the group's model tokens (tool tokens carry -1 and are skipped)."""
    oldest = group.admitted_version
    for t in group.trajectories:
        versions = unpack("versions", t.versions)[unpack("loss_mask", t.loss_mask) > 0]
        if versions.size:
            oldest = min(oldest, int(versions.min()))
    return oldest


def write_snapshot(snap: BufferSnapshot, path: str | Path) -> None:
    """Write atomically: a crash leaves the old snapshot or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(msgspec.msgpack.encode(snap))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_snapshot(path: str | Path) -> BufferSnapshot:
    return msgspec.msgpack.decode(Path(path).read_bytes(), type=BufferSnapshot)
