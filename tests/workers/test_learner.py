"""The learner role: how it rides out a dead engine: a weight
push that finds no engine is retried until the restarted one takes the full weights (bounded, and
given up on a stop request), and an evaluation that loses its engine is skipped, not fatal. Real
runs with every role, kills and resumes are in tests/streamrl/launch/test_faults.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from streamrl.config_load import parse_job
from streamrl.errors import WeightSyncError
from tests.conftest import free_port
from workers import learner
from workers.engines.client import EngineError
from workers.learner import LearnerRole

# ---------------------------------------------------------------- engine failures seen by the learner

JOB = """
name: t
model: {path: /m}
data: {train: {type: synthetic_arith}}
rollout: {n_samples: 4, concurrency: 8}
engine: {type: embedded, count: 1}
learner: {backend: hf}
"""


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """torch.distributed with one gloo rank in this process (LearnerRole asks for its rank)."""
    ours = not dist.is_initialized()
    if ours:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    if ours:
        dist.destroy_process_group()


class Backend:
    def __init__(self) -> None:
        self.iterations = 0

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.iterations += 1
        yield "w", torch.zeros(2)


class Pusher:
    """Fails the first `failures` pushes as the real one does when no engine answers."""

    def __init__(self, failures: int, on_failure: Callable[[], None] = lambda: None) -> None:
        self.failures, self.on_failure, self.versions = failures, on_failure, []  # type: list[int]

    def push(self, weights: Iterator[tuple[str, torch.Tensor]], version: int) -> SimpleNamespace:
        list(weights)
        self.versions.append(version)
        if len(self.versions) <= self.failures:
            self.on_failure()
            raise WeightSyncError("no engine answers /model_info: ['http://127.0.0.1:1']")
        return SimpleNamespace(metrics=lambda: {"sync_total_s": 0.5})


def make_role(tmp_path: Path, pusher: Pusher | None = None, evaluator: object = None) -> LearnerRole:
    records: list[tuple[str, int, dict]] = []
    role = LearnerRole(
        parse_job(JOB), Backend(), tmp_path, client=None, pusher=pusher, evaluator=evaluator,
        metrics=lambda r, s, v: records.append((r, s, v)),
    )  # fmt: skip
    role.records = records  # type: ignore[attr-defined]
    return role


def test_a_push_that_finds_no_engine_is_retried_until_a_restarted_one_takes_it(
    world_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(learner, "ENGINE_RETRY_S", 0.01)
    pusher = Pusher(failures=2)
    role = make_role(tmp_path, pusher)
    assert role.push_weights(7) == {"sync_total_s": 0.5}
    assert pusher.versions == [7, 7, 7] and role.backend.iterations == 3  # full weights each time


def test_a_push_that_fails_past_the_deadline_fails_the_learner(
    world_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(learner, "ENGINE_WAIT_S", 0.0)
    role = make_role(tmp_path, Pusher(failures=100))
    with pytest.raises(learner.LearnerError, match="no engine took version 3"):
        role.push_weights(3)


def test_a_stop_request_gives_up_a_failing_push_so_the_step_can_be_checkpointed(
    world_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(learner, "ENGINE_RETRY_S", 0.01)
    role = make_role(tmp_path)

    def signalled() -> None:  # SIGTERM arrives while no engine answers
        role.stopping = True

    role.pusher = pusher = Pusher(failures=100, on_failure=signalled)
    assert role.push_weights(2) == {} and pusher.versions == [2]


def test_an_evaluation_that_loses_its_engine_is_skipped_and_the_next_one_runs(
    world_of_one: None, tmp_path: Path
) -> None:
    results: list[Exception | dict[str, float]] = [
        EngineError("http://127.0.0.1:1", "/generate", "Server disconnected"),
        {"greedy_acc": 0.5},
    ]

    def evaluator() -> dict[str, float]:
        r = results.pop(0)
        if isinstance(r, Exception):
            raise r
        return r

    role = make_role(tmp_path, evaluator=evaluator)
    role.evaluate(4)
    role.evaluate(9)
    assert role.records == [("eval", 9, {"greedy_acc": 0.5})]  # type: ignore[attr-defined]
