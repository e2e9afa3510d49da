"""The shipped recipes plan their GPU jobs as the seed documents describe (dry runs, no GPU needed):

* rlinf-rstar2-qwen2.5-7b: RLinf's rStar2 on one 8xH100 node, disaggregated: a Megatron learner with
  TP 2 x DP 2 on four GPUs and two SGLang servers with TP 2 on the other four; the sandbox is a Code
  Judge server started next to the job (the seed's uvicorn + Redis workers), so nothing to start.
* rstar2-agent-qwen3-14b: rStar2-Agent's released 8-GPU script: learner TP 4, one SGLang server with
  TP 4, and Code Judge-compatible Redis workers with 64 slots on the node (MAX_WORKERS=64,
  MAX_EXECUTION_TIME=4).
* rlinf-math-grpo-r1-distill-1.5b: RLinf's math GRPO on 16 nodes x 8 GPUs through Ray: 64 data-parallel
  learner ranks fill 8 nodes, 64 single-GPU SGLang servers the other 8.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from streamrl.config import SGLangEngine
from streamrl.config_load import load_job
from streamrl.launch.plan import Plan, plan

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
RECIPES = [
    "rlinf-rstar2-qwen2.5-7b.yaml",
    "rstar2-agent-qwen3-14b.yaml",
    "rlinf-math-grpo-r1-distill-1.5b.yaml",
]


def recipe_plan(name: str, tmp_path: Path) -> Plan:
    spec = load_job(CONFIGS / name)
    return plan(spec, tmp_path / "run", model_dir=spec.model.path or "", python="python")


def arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def check_gpus(p: Plan) -> Counter[int]:
    """No GPU is given twice, none beyond the node; returns GPUs used per node."""
    used: set[tuple[int, int]] = set()
    for s in p.processes:
        for g in s.resources.gpu_ids:
            assert 0 <= g < p.gpus_per_node, f"{s.name}: GPU {g} of a {p.gpus_per_node}-GPU node"
            assert (s.node, g) not in used, f"{s.name}: GPU {g} of node {s.node} is taken"
            used.add((s.node, g))
    return Counter(node for node, _ in used)


def test_rlinf_rstar2_on_one_8_gpu_node(tmp_path: Path) -> None:
    p = recipe_plan("rlinf-rstar2-qwen2.5-7b.yaml", tmp_path)
    assert check_gpus(p) == {0: 8}
    learners = p.by_role("learner")
    assert len(learners) == 4 and {s.world_size for s in learners} == {4}  # TP 2 x DP 2
    assert [s.resources.gpu_ids for s in learners] == [[0], [1], [2], [3]]
    assert {s.env["CUDA_VISIBLE_DEVICES"] for s in learners} == {"0,1,2,3"}
    assert [s.env["LOCAL_RANK"] for s in learners] == ["0", "1", "2", "3"]
    assert all(s.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" for s in learners)  # Megatron
    engines = p.by_role("engine")
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in engines] == ["4,5", "6,7"]
    for s in engines:
        assert s.argv[1:3] == ["-m", "sglang.launch_server"]
        assert arg(s.argv, "--tp-size") == "2" and arg(s.argv, "--mem-fraction-static") == "0.5"
        assert arg(s.argv, "--max-running-requests") == "128"
        assert arg(s.argv, "--model-path") == "/models/Qwen2.5-7B-Instruct"
    assert p.by_role("sandbox") == []  # Code Judge at sandbox.url is started next to the job
    assert len(p.by_role("generator")) == 2
    assert p.buffer_address.startswith("ipc://")


def test_rstar2_agent_on_one_8_gpu_node_with_redis_workers(tmp_path: Path) -> None:
    p = recipe_plan("rstar2-agent-qwen3-14b.yaml", tmp_path)
    assert check_gpus(p) == {0: 8}
    learners = p.by_role("learner")
    assert len(learners) == 4 and [s.resources.gpu_ids for s in learners] == [[0], [1], [2], [3]]
    (engine,) = p.by_role("engine")
    assert engine.resources.gpu_ids == [4, 5, 6, 7] and arg(engine.argv, "--tp-size") == "4"
    (sandbox,) = p.by_role("sandbox")
    assert sandbox.argv[1:3] == ["-m", "sandbox_bridge.redis_worker"]
    assert arg(sandbox.argv, "--redis") == "redis://127.0.0.1:6379/0"
    assert arg(sandbox.argv, "--workers") == "64"  # MAX_WORKERS=64
    assert arg(sandbox.argv, "--timeout-s") == "4.0"  # MAX_EXECUTION_TIME=4
    assert sandbox.stage == 0  # up before any rollout needs it


def test_rlinf_math_on_16_nodes_through_ray(tmp_path: Path) -> None:
    p = recipe_plan("rlinf-math-grpo-r1-distill-1.5b.yaml", tmp_path)
    assert (p.kind, p.nodes, p.gpus_per_node) == ("ray", 16, 8)
    assert check_gpus(p) == dict.fromkeys(range(16), 8)  # all 128 GPUs in use
    learners = p.by_role("learner")
    assert len(learners) == 64 and {s.world_size for s in learners} == {64}
    assert Counter(s.node for s in learners) == dict.fromkeys(range(8), 8)
    for s in learners:
        assert s.local_rank == s.rank % 8 and s.env["GROUP_RANK"] == str(s.rank // 8)
        assert s.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
        assert s.env["MASTER_ADDR"] == p.hosts[0]
    engines = p.by_role("engine")
    assert len(engines) == 64 and Counter(s.node for s in engines) == dict.fromkeys(range(8, 16), 8)
    assert all(arg(s.argv, "--tp-size") == "1" for s in engines)
    assert p.engine_urls[0].startswith("http://node-8:") and p.buffer_address.startswith("tcp://node-0:")
    assert Counter(s.node for s in p.by_role("generator")) == dict.fromkeys(range(16), 1)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_engine_and_learner_counts_match_the_spec(name: str, tmp_path: Path) -> None:
    spec = load_job(CONFIGS / name)
    p = recipe_plan(name, tmp_path)
    assert isinstance(spec.engine, SGLangEngine)
    assert sum(s.resources.gpus for s in p.by_role("engine")) == spec.engine.count * spec.engine.tp_size
    assert len(p.by_role("learner")) == spec.learner.tp * spec.learner.pp * spec.learner.dp
    assert len(p.by_role("generator")) == spec.launcher.generators


@pytest.mark.parametrize("name", RECIPES)
def test_dry_run_prints_the_plan_and_writes_nothing(name: str, tmp_path: Path) -> None:
    env = {**os.environ, "COLUMNS": "200"}
    out = subprocess.run(
        [sys.executable, "-m", "streamrl", "launch", str(CONFIGS / name), "--dry-run"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "sglang.launch_server" in out.stdout and "workers.learner" in out.stdout
    assert "learner-0" in out.stdout
    assert list(tmp_path.iterdir()) == [], "a dry run must not create the run folder"
