"""The launch plan is a pure function of the job spec: processes, addresses, ports, threads, ranks and
restart policy are decided without starting or writing anything."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from streamrl.config_load import parse_job
from streamrl.launch.plan import (
    THREAD_VARS,
    PlanError,
    from_json,
    ipc_path,
    plan,
    ports_needed,
    to_json,
)

TINY = """
name: t
model: {tiny: arith, dtype: float32}
data: {train: {type: synthetic_arith}}
rollout: {n_samples: 4, concurrency: 8}
engine: {type: embedded, count: 3, threads: 1}
learner: {backend: hf, threads: 1}
launcher: {generators: 2, on_failure: restart, max_restarts: 5}
"""


def job(text: str = TINY, *overrides: str):  # noqa: ANN201 - a JobSpec
    return parse_job(text, overrides=overrides)


def test_plan_is_pure_and_round_trips_through_json(tmp_path: Path) -> None:
    run = tmp_path / "run"
    a = plan(job(), run, model_dir="/m", python="py")
    b = plan(job(), run, model_dir="/m", python="py")
    assert a == b
    assert not run.exists(), "planning must not create the run folder"
    assert from_json(to_json(a)) == a


def test_every_role_is_planned_in_dependency_stages(tmp_path: Path) -> None:
    p = plan(job(), tmp_path, model_dir="/m", python="py")
    assert [(s.name, s.stage) for s in p.processes] == [
        ("buffer", 0), ("engine-0", 1), ("engine-1", 1), ("engine-2", 1), ("gen-0", 2), ("gen-1", 2), ("learner", 3),
    ]  # fmt: skip
    assert [[s.name for s in stage] for stage in p.stages()][0] == ["buffer"]
    gen = p.by_role("generator")[1]
    assert gen.argv[:3] == ["py", "-m", "workers.generator"]
    assert gen.argv[gen.argv.index("--name") + 1] == "gen-1"
    assert gen.argv[gen.argv.index("--engines") + 1] == ",".join(p.engine_urls)
    assert gen.argv[gen.argv.index("--job") + 1] == str(tmp_path / "job.yaml")
    learner = p.by_role("learner")[0]
    assert learner.argv[learner.argv.index("--run-dir") + 1] == str(tmp_path)
    assert learner.argv[learner.argv.index("--buffer") + 1] == p.buffer_address
    for s in p.processes:
        assert Path(s.log_path).parent == tmp_path / "logs"


def test_ports_and_addresses_are_distinct(tmp_path: Path) -> None:
    spec = job()
    ports = [40001, 40002, 40003, 40004, 40005]
    assert ports_needed(spec) == 5
    p = plan(spec, tmp_path, model_dir="/m", ports=ports)
    assert p.buffer_address == f"ipc://{tmp_path}/buffer.sock"  # one host: ipc, no port used
    assert p.engine_urls == ["http://127.0.0.1:40001", "http://127.0.0.1:40002", "http://127.0.0.1:40003"]
    assert (p.master_addr, p.master_port) == ("127.0.0.1", 40004)
    for i, s in enumerate(p.by_role("engine")):
        assert s.argv[s.argv.index("--port") + 1] == str(40001 + i)
        assert s.ready.kind == "http" and s.ready.target == p.engine_urls[i] + "/health"
    assert p.by_role("buffer")[0].ready.kind == "path"
    with pytest.raises(PlanError, match="more ports"):
        plan(spec, tmp_path, model_dir="/m", ports=[1, 2])


def test_tcp_addresses_across_nodes(tmp_path: Path) -> None:
    spec = job(TINY, "launcher.kind=ray", "launcher.nodes=2")
    p = plan(spec, tmp_path, model_dir="/m", hosts=["10.0.0.1", "10.0.0.2"], ports=range(50000, 50010))
    assert p.buffer_address == "tcp://10.0.0.1:50000"
    assert p.by_role("buffer")[0].ready.kind == "tcp"
    assert p.engine_urls == ["http://10.0.0.1:50001", "http://10.0.0.2:50002", "http://10.0.0.1:50003"]
    assert all(s.argv[s.argv.index("--host") + 1] == "0.0.0.0" for s in p.by_role("engine"))
    assert [s.node for s in p.by_role("generator")] == [0, 1]
    ports = [int(u.rsplit(":", 1)[1]) for u in p.engine_urls] + [50000, p.master_port]
    assert len(set(ports)) == len(ports)
    with pytest.raises(PlanError, match="2 but 1 host"):
        plan(spec, tmp_path, model_dir="/m", hosts=["10.0.0.1"])
    forced = plan(job(), tmp_path, model_dir="/m", transport="tcp", ports=range(50000, 50010))
    assert forced.buffer_address == "tcp://127.0.0.1:50000"


def test_a_long_run_folder_gets_a_short_socket_path(tmp_path: Path) -> None:
    deep = tmp_path / ("x" * 120)
    path = ipc_path(deep)
    assert path.startswith("/tmp/streamrl-") and len(path) < 100
    assert path == ipc_path(deep) != ipc_path(tmp_path / ("y" * 120))


def test_thread_counts_let_engine_and_learner_share_the_cores(tmp_path: Path) -> None:
    p = plan(job(TINY, "engine.threads=2", "learner.threads=3"), tmp_path, model_dir="/m")
    env = {s.name: s.env for s in p.processes}
    for var in THREAD_VARS:
        assert env["engine-0"][var] == "2"
        assert env["learner"][var] == "3"
        assert env["buffer"][var] == env["gen-0"][var] == "1"
    engine = p.by_role("engine")[0]
    assert engine.argv[engine.argv.index("--threads") + 1] == "2"
    assert engine.resources.cpus == 2 and p.by_role("learner")[0].resources.cpus == 3
    assert env["gen-0"]["TOKENIZERS_PARALLELISM"] == "false"
    assert all(e["PYTHONUNBUFFERED"] == "1" for e in env.values())
    unset = plan(job(TINY, "learner.threads=null"), tmp_path, model_dir="/m")
    assert "OMP_NUM_THREADS" not in unset.by_role("learner")[0].env  # one CPU rank: torch's own default


def test_restart_policy_and_resume_arguments(tmp_path: Path) -> None:
    p = plan(job(), tmp_path, model_dir="/m")
    assert (p.restart.on_failure, p.restart.max_restarts) == ("restart", 5)
    scopes = {s.name: s.restart_scope for s in p.processes}
    assert scopes["buffer"] == scopes["learner"] == "job"  # their state must stay paired
    assert scopes["engine-0"] == scopes["gen-0"] == "self"
    buffer, learner, gen = p.by_role("buffer")[0], p.by_role("learner")[0], p.by_role("generator")[0]
    assert buffer.start_argv(None) == buffer.argv
    ck = str(tmp_path / "checkpoints" / "step_000009")
    assert buffer.start_argv(ck)[-2:] == ["--resume", f"{ck}/buffer.snapshot"]
    assert learner.start_argv(ck)[-1] == "--resume"
    assert gen.start_argv(ck) == gen.argv
    assert plan(job(TINY, "launcher.on_failure=stop"), tmp_path, model_dir="/m").restart.on_failure == "stop"


def test_multi_rank_learner_gets_torchrun_environment(tmp_path: Path) -> None:
    p = plan(job(TINY, "learner.tp=2", "learner.dp=2"), tmp_path, model_dir="/m", ports=range(41000, 41010))
    ranks = p.by_role("learner")
    assert [s.name for s in ranks] == ["learner-0", "learner-1", "learner-2", "learner-3"]
    for r, s in enumerate(ranks):
        assert (s.rank, s.world_size, s.local_rank) == (r, 4, r)
        assert s.env["RANK"] == str(r) and s.env["LOCAL_RANK"] == str(r)
        assert s.env["WORLD_SIZE"] == s.env["LOCAL_WORLD_SIZE"] == "4"
        assert (s.env["MASTER_ADDR"], s.env["MASTER_PORT"]) == ("127.0.0.1", str(p.master_port))
        assert s.env["OMP_NUM_THREADS"] == "1"  # several CPU ranks: one thread each, like torchrun
        assert s.gang_name == "learner"
        assert s.argv[s.argv.index("--log-file") + 1].endswith(f"learner-{r}.jsonl")
    # The same command for every rank but its log file.
    strip = [[a for a in s.argv if not a.endswith(".jsonl")] for s in ranks]
    assert all(a == strip[0] for a in strip)
    assert p.master_port not in [int(u.rsplit(":", 1)[1]) for u in p.engine_urls]


def test_attached_engines_are_waited_for_not_started(tmp_path: Path) -> None:
    spec = job(TINY, "engine={type: sglang, urls: ['http://10.1.1.1:30000/']}")
    p = plan(spec, tmp_path, model_dir="/m")
    assert p.by_role("engine") == [] and p.engine_urls == []
    assert p.attach_urls == ["http://10.1.1.1:30000"]
    gen = p.by_role("generator")[0]
    assert gen.argv[gen.argv.index("--engines") + 1] == "http://10.1.1.1:30000"


def test_a_plan_that_does_not_fit_names_what_is_missing(tmp_path: Path) -> None:
    gpu = "launcher={kind: ray, nodes: 2, gpus_per_node: 4}"
    spec = job(TINY, gpu, "engine={type: sglang, count: 2, tp_size: 3}", "learner.tp=2")
    with pytest.raises(PlanError, match=r"engine 1 of 2 \(tp_size 3\) does not fit"):
        plan(spec, tmp_path, model_dir="/m")
    big = msgspec.structs.replace(spec, engine=msgspec.structs.replace(spec.engine, tp_size=8, count=1))
    with pytest.raises(PlanError, match="exceeds launcher.gpus_per_node 4"):
        plan(big, tmp_path, model_dir="/m")
