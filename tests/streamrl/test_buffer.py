"""Replay-buffer invariants (see the module docstring of streamrl/buffer.py)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from streamrl import messages as m
from streamrl.buffer import ReplayBuffer, read_snapshot, write_snapshot
from streamrl.config import (
    BufferConfig,
    DataConfig,
    JobSpec,
    ModelConfig,
    RocSection,
    RolloutConfig,
    SyntheticArithData,
)
from streamrl.data import train_source


def make_buffer(
    B: int = 4, eta: int = 0, n: int = 4, roc: RocSection | None = None, size: int = 10_000, **buffer_kw
) -> ReplayBuffer:
    spec = JobSpec(
        name="t",
        model=ModelConfig(tiny="arith"),
        data=DataConfig(train=SyntheticArithData(size=size), shuffle=True),
        rollout=RolloutConfig(n_samples=n),
        roc=roc or RocSection(),
        buffer=BufferConfig(groups_per_step=B, max_staleness=eta, **buffer_kw),
    )
    return ReplayBuffer(spec, *train_source(spec.data))


def make_group(
    prompt: m.Prompt,
    rewards: list[float],
    texts: list[str] | None = None,
    order: list[int] | None = None,
    generator: str = "g0",
) -> m.Group:
    n = len(rewards)
    trajs = [
        m.Trajectory(
            sample_index=i,
            tokens=m.pack("tokens", [5, 6, 7]),
            loss_mask=m.pack("loss_mask", [1, 1, 1]),
            logprobs=m.pack("logprobs", [-0.1] * 3),
            versions=m.pack("versions", [prompt.admitted_version] * 3),
            reward=rewards[i],
            finish_reason="stop",
            text=(texts[i] if texts else ""),
        )
        for i in range(n)
    ]
    if order is not None:
        trajs = [trajs[i] for i in order]
    return m.Group(
        uid=prompt.uid,
        prompt_id=prompt.prompt_id,
        admitted_version=prompt.admitted_version,
        generator=generator,
        prompt_tokens=m.pack("prompt_tokens", [1, 2]),
        trajectories=trajs,
    )


MIXED = [1.0, 0.0, 1.0, 0.0]


def test_synchronous_admission_dispatches_exactly_one_batch_per_version() -> None:
    buf = make_buffer(B=4, eta=0)
    prompts = buf.admit("g0", 100)
    assert len(prompts) == 4 and buf.admit("g0", 100) == []
    for p in prompts:
        assert buf.add_group(make_group(p, MIXED)).status == "accepted"
    assert buf.admit("g0", 100) == []  # accepted groups keep the slots until trained
    batch = buf.next_batch(0)
    assert batch is not None and len(batch.groups) == 4 and buf.admit("g0", 100) == []
    buf.on_weights_published(version=1, step=0)
    assert len(buf.admit("g0", 100)) == 4


def test_a_group_sampled_by_an_engine_behind_its_admission_version_is_generated_again() -> None:
    buf = make_buffer(B=2, eta=1)
    buf.on_weights_published(version=3, step=2)
    p, other = buf.admit("g0", 2)
    g = make_group(p, MIXED)
    # One trajectory's model tokens came from a restarted engine still at version 0; the tool-like
    # token in the middle (mask 0, version -1) never counts.
    g.trajectories[1].versions = m.pack("versions", [3, -1, 0])
    g.trajectories[1].loss_mask = m.pack("loss_mask", [1, 0, 1])
    ack = buf.add_group(g)
    assert ack.status == "filtered" and "version 0" in ack.detail and "admitted at version 3" in ack.detail
    assert buf.counters["released_behind_admission"] == 1 and not buf.ready
    again = buf.admit("g1", 1)
    assert [q.uid for q in again] == [p.uid]  # re-dispatched first, under the same uid
    assert buf.add_group(make_group(again[0], MIXED)).status == "accepted"
    assert buf.add_group(make_group(other, MIXED)).status == "accepted"
    assert buf.ledger_problems() == []


def test_staleness_budget_allows_eta_extra_batches_in_flight() -> None:
    buf = make_buffer(B=4, eta=2)
    assert len(buf.admit("g0", 100)) == 12
    buf.on_weights_published(version=1, step=0)
    assert len(buf.admit("g0", 100)) == 4


def test_filtered_groups_do_not_count_as_accepted_so_their_slots_reopen() -> None:
    buf = make_buffer(
        B=2,
        eta=0,
        roc=RocSection(
            enabled=True, down_sample_to_n=2, min_zero_reward_trace_num=1, min_non_zero_reward_trace_num=1
        ),
    )
    a, b = buf.admit("g0", 10)
    ack = buf.add_group(make_group(a, [1.0, 1.0, 1.0, 1.0]))
    assert (ack.status, ack.detail) == ("filtered", "roc_equal_reward")
    assert [p.uid for p in buf.admit("g0", 10)] == [2]
    assert buf.ledger[a.uid].state == "dropped" and buf.ledger[a.uid].reason == "roc_equal_reward"


def test_roc_sees_submission_order_not_arrival_order() -> None:
    roc = RocSection(
        enabled=True, down_sample_to_n=4, min_zero_reward_trace_num=2, min_non_zero_reward_trace_num=2
    )
    buf = make_buffer(B=1, n=8, roc=roc)
    (p,) = buf.admit("g0", 1)
    rewards = [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    # Arrival order favours the late negatives (as short failures would); selection must not.
    buf.add_group(make_group(p, rewards, order=[6, 4, 7, 5, 3, 2, 1, 0]))
    batch = buf.next_batch(0)
    kept = [t.sample_index for t in batch.groups[0].trajectories]
    assert kept == [0, 1, 2, 3]
    adv = m.unpack("advantages", batch.advantages[0])
    np.testing.assert_allclose(adv, [-0.866, 0.866, -0.866, 0.866], atol=1e-3)


def test_stale_groups_are_swept_and_counted_before_a_batch() -> None:
    buf = make_buffer(B=2, eta=1)
    first = buf.admit("g0", 2)  # version 0
    rest = buf.admit("g0", 10)
    assert len(rest) == 2
    for p in rest:
        buf.add_group(make_group(p, MIXED))
    for p in first:
        buf.add_group(make_group(p, MIXED))
    # A learner that jumped to step 2 may not train version-0 groups with eta=1.
    buf.on_weights_published(version=2, step=1)
    assert buf.next_batch(2) is None
    assert buf.counters["dropped_stale"] == 4
    assert {buf.ledger[p.uid].reason for p in first + rest} == {"stale"}
    assert len(buf.admit("g0", 100)) == 2 * 4  # (eta + v + 1) * B with nothing accepted


def test_asking_twice_for_the_same_step_returns_the_same_batch() -> None:
    buf = make_buffer(B=2, eta=1)
    for p in buf.admit("g0", 4):
        buf.add_group(make_group(p, MIXED))
    b1, b2 = buf.next_batch(0), buf.next_batch(0)
    assert [g.uid for g in b1.groups] == [g.uid for g in b2.groups]
    assert [g.uid for g in buf.next_batch(1).groups] != [g.uid for g in b1.groups]


def test_a_late_group_from_a_presumed_dead_generator_counts_once() -> None:
    buf = make_buffer(B=2, eta=0)
    p, q = buf.admit("dead", 2)
    assert buf.expire("dead") == 2
    again = buf.admit("alive", 2)
    assert {x.uid for x in again} == {p.uid, q.uid} and buf.counters["redispatched"] == 2
    assert buf.add_group(make_group(p, MIXED, generator="dead")).status == "accepted"
    assert buf.add_group(make_group(again[0], MIXED, generator="alive")).status == "duplicate"
    assert buf.ledger[p.uid].dispatches == 2 and not buf.ledger_problems()


def test_a_malformed_group_is_rejected_and_its_prompt_dispatched_again() -> None:
    buf = make_buffer(B=1, eta=0)
    (p,) = buf.admit("g0", 1)
    bad = make_group(p, MIXED)
    bad.trajectories[1].versions = b"\x00"
    ack = buf.add_group(bad)
    assert ack.status == "rejected" and "trajectories[1].versions" in ack.detail
    assert [x.uid for x in buf.admit("g0", 1)] == [p.uid]
    assert buf.add_group(make_group(p, MIXED[:3])).status == "rejected"  # wrong group size
    assert (
        buf.add_group(
            make_group(m.Prompt(uid=999, prompt_id="x", answer="1", admitted_version=0, n_samples=4), MIXED)
        ).status
        == "rejected"
    )


def test_policy_versions_never_go_back() -> None:
    buf = make_buffer()
    assert buf.on_weights_published(3, 2)
    assert not buf.on_weights_published(2, 1)
    assert buf.version == 3 and buf.counters["version_regressions"] == 1


def simulate(
    buf: ReplayBuffer, rng: random.Random, steps: int, generators: int = 6, start_step: int = 0, on_step=None
) -> int:
    """Generators with random speed, deaths and reward patterns against a learner; returns last step."""
    held: dict[str, list[m.Prompt]] = {f"g{i}": [] for i in range(generators)}
    step = start_step
    for _ in range(100_000):
        if step >= start_step + steps:
            return step
        action = rng.random()
        name = rng.choice(sorted(held))
        if action < 0.35:
            held[name].extend(buf.admit(name, rng.randint(1, 6)))
        elif action < 0.75 and held[name]:
            p = held[name].pop(rng.randrange(len(held[name])))
            rewards = [float(rng.random() < rng.choice([0.0, 0.3, 1.0])) for _ in range(p.n_samples)]
            buf.add_group(
                make_group(p, rewards, order=rng.sample(range(p.n_samples), p.n_samples), generator=name)
            )
        elif action < 0.78:
            buf.expire(name)  # it died: what it held is lost with it
            held[name] = []
        else:
            batch = buf.next_batch(step)
            if batch is not None:
                for g in batch.groups:
                    assert step - g.admitted_version <= buf.eta, "trained a group older than eta"
                buf.on_weights_published(step + 1, step)
                if on_step is not None:
                    on_step(step)
                step += 1
    raise AssertionError("simulation made no progress")


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_randomized_run_never_trains_a_group_older_than_eta_and_loses_nothing(eta: int) -> None:
    roc = RocSection(
        enabled=True, down_sample_to_n=4, min_zero_reward_trace_num=1, min_non_zero_reward_trace_num=1
    )
    buf = make_buffer(B=4, eta=eta, n=8, roc=roc)
    simulate(buf, random.Random(eta), steps=60)
    assert not buf.ledger_problems()
    assert buf.accepted + len(buf.in_flight) <= (eta + buf.version + 1) * buf.B
    states = [e.state for e in buf.ledger.values()]
    assert states.count("trained") == 60 * 4 == buf.trained_groups
    assert max(buf.staleness) <= eta
    assert set(buf.ledger) == set(range(buf.position))  # every dispatched uid is in the ledger


def test_a_snapshot_taken_mid_run_restores_without_loss_or_duplication(tmp_path: Path) -> None:
    roc = RocSection(
        enabled=True, down_sample_to_n=4, min_zero_reward_trace_num=1, min_non_zero_reward_trace_num=1
    )
    buf = make_buffer(B=4, eta=2, n=8, roc=roc)
    rng = random.Random(7)
    path = tmp_path / "buffer.snap"
    simulate(buf, rng, steps=10, on_step=lambda s: s == 9 and write_snapshot(buf.snapshot(s), path))
    # Keep going past the snapshot (these steps will be lost with the crashed learner) ...
    simulate(buf, rng, steps=5, start_step=10)
    # ... then restart from the checkpoint at step 9.
    resumed = make_buffer(B=4, eta=2, n=8, roc=roc)
    snap = read_snapshot(path)
    resumed.restore(snap)
    assert resumed.version == 10 and snap.step == 9
    trained_before = {u for u, e in resumed.ledger.items() if e.state == "trained"}
    assert len(trained_before) == 40
    simulate(resumed, rng, steps=10, start_step=10)
    assert not resumed.ledger_problems()
    trained = {u for u, e in resumed.ledger.items() if e.state == "trained"}
    assert trained_before < trained and len(trained) == 80 == resumed.trained_groups
    assert all(e.trained_count <= 1 for e in resumed.ledger.values())
    # Everything ever dispatched is trained, dropped with a reason, ready, or pending re-dispatch.
    pending = {p.uid for p in resumed.redispatch} | set(resumed.in_flight)
    for uid in range(resumed.position):
        e = resumed.ledger[uid]
        assert (
            e.state in ("trained", "ready", "delivered")
            or (e.state == "dropped" and e.reason)
            or uid in pending
        )
