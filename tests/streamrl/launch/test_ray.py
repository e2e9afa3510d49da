"""The Ray launcher: the same plan on a Ray cluster. A local Ray instance on CPU runs a short plan of
fake roles (tests/streamrl/launch/fakes.py) through placement groups and actors, restart included.
GPU mapping is checked as a pure function (no GPUs here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import msgspec
import pytest

from streamrl.config_load import parse_job
from streamrl.launch.plan import plan
from streamrl.launch.ray import bundle, ray_gpu_env
from tests.streamrl.launch.fakes import buffer, events, fake, fake_plan, started_pids, wait_gone

HAS_RAY = importlib.util.find_spec("ray") is not None
GPU_JOB = """
name: g
model: {path: /m}
data: {train: {type: synthetic_arith}}
rollout: {n_samples: 4, concurrency: 8}
engine: {type: sglang, count: 2, tp_size: 2}
learner: {tp: 2, dp: 2}
launcher: {kind: ray, nodes: 2, gpus_per_node: 4}
"""


def test_bundles_carry_each_process_cpus_and_gpus(tmp_path: Path) -> None:
    p = plan(parse_job(GPU_JOB), tmp_path, model_dir="/m")
    by = {s.name: s for s in p.processes}
    assert bundle(by["engine-0"]) == {"CPU": 1.0, "GPU": 2.0}
    assert bundle(by["learner-3"]) == {"CPU": 1.0, "GPU": 1.0}
    assert bundle(by["buffer"]) == {"CPU": 1.0}


def test_gpus_that_ray_assigned_become_cuda_visible_devices(tmp_path: Path) -> None:
    p = plan(parse_job(GPU_JOB), tmp_path, model_dir="/m")
    # Learner ranks 0-3 fill node 0; both engines go to node 1. Ray hands out its own GPU ids.
    assigned = {
        "learner-0": ("nodeA", ["3"]), "learner-1": ("nodeA", ["1"]),
        "learner-2": ("nodeA", ["0"]), "learner-3": ("nodeA", ["2"]),
        "engine-0": ("nodeB", ["6", "7"]), "engine-1": ("nodeB", ["4", "5"]),
    }  # fmt: skip
    env = ray_gpu_env(p, assigned)
    # Every learner rank sees the node's learner GPUs in local-rank order: cuda:LOCAL_RANK is its own.
    assert {env[f"learner-{r}"]["CUDA_VISIBLE_DEVICES"] for r in range(4)} == {"3,1,0,2"}
    assert env["engine-0"] == {"CUDA_VISIBLE_DEVICES": "6,7"} and env["engine-1"] == {
        "CUDA_VISIBLE_DEVICES": "4,5"
    }
    assert "buffer" not in env and "gen-0" not in env


@pytest.mark.slow
@pytest.mark.skipif(
    not HAS_RAY, reason="Ray is an optional extra: pip install 'streamrl[ray]' to run this test"
)
def test_a_plan_runs_on_a_local_ray_cluster_with_a_restart(tmp_path: Path) -> None:
    import ray

    from streamrl.launch.ray import run_ray

    gen = 'if count("gen-0", "crash") == 0:\n    ev("crash"); sys.exit(3)\n' + "time.sleep(60)\n"
    learner = 'wait_for(lambda: len([l for l in (RUN / "events.txt").read_text().splitlines() if l.startswith("gen-0 start")]) == 2, 60)\n'
    procs = [
        buffer(tmp_path, cpus=0.5),
        fake(tmp_path, "gen-0", "generator", 2, gen, cpus=0.5),
        fake(tmp_path, "learner", "learner", 3, learner),
    ]
    p = msgspec.structs.replace(fake_plan(tmp_path, procs), kind="ray")
    written = []
    out = run_ray(
        lambda hosts, ports: p, write_plan=written.append, restart_delay_s=0.1, placement_timeout_s=60
    )
    assert (out.status, out.restarts) == ("completed", {"gen-0": 1})
    assert written == [p]
    log = events(tmp_path)
    assert log.index("learner start ") > log.index("buffer start ")
    assert "buffer term" in log and log.count("gen-0 term") == 1
    assert wait_gone(started_pids(tmp_path)) == []
    assert not ray.is_initialized()  # the launcher shut down the Ray instance it started
