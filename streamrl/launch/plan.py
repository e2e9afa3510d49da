"""The launch plan: a pure function from a job spec to the processes of a run (processes.py).

    p = plan(job, run_dir, model_dir="/models/qwen", ports=free_ports)
    for proc in p.processes: proc.name, proc.argv, proc.env, proc.resources, proc.node ...

Nothing here starts, binds or reads anything, so a plan (and `streamrl launch --dry-run`) can be made
for a 16-node GPU job on a laptop. The local and Ray launchers run the same plan.

Stages (a stage starts once the one before it is ready):

    0 buffer (+ Redis sandbox workers)   ready: its ipc socket exists / its tcp port accepts
    1 engines                            ready: GET /health answers 200 (attached URLs too)
    2 generators                         (reward pool and embedded sandbox live inside)
    3 learner ranks                      torchrun environment: RANK, WORLD_SIZE, LOCAL_RANK, ...

Placement: learner ranks take the first GPUs, node by node (so a TP group stays on one node and
LOCAL_RANK is the device index), then each engine takes `tp_size` GPUs on one node. Every learner
rank on a node sees the learner's GPUs of that node (CUDA_VISIBLE_DEVICES, in local-rank order).
Generators are spread over nodes round-robin; the buffer runs on node 0. Addresses are ipc:// on one
host and tcp:// across hosts. Thread counts (OMP/MKL/OpenBLAS) come from engine.threads and
learner.threads, 1 for the light roles, so the engine and learner share a small CPU without
oversubscription.

Failure handling per process: `restart_scope` "self" restarts only that process with the same argv
(engines, generators, sandbox workers); "job" restarts every process from the latest checkpoint
(buffer and learner: their state must match, see streamrl/checkpoint.py). `resume_args` are appended
when a process starts from a checkpoint; "{checkpoint}" stands for that checkpoint's folder.
"""

from __future__ import annotations

import hashlib
import itertools
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from streamrl.config import EmbeddedEngine, EmbeddedSandbox, JobSpec, RedisSandbox, SGLangEngine
from streamrl.launch.processes import (
    Plan,
    PlanError,
    Probe,
    ProcessSpec,
    Resources,
    RestartPolicy,
    Role,
    from_json,
    to_json,
)
from workers.engines.sglang import build_command

__all__ = [
    "Plan", "PlanError", "ProcessSpec", "Probe", "Resources", "RestartPolicy", "Role",
    "from_json", "ipc_path", "place_gpus", "plan", "ports_needed", "to_json",
]  # fmt: skip

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
DEFAULT_BASE_PORT = 29500
MAX_IPC_PATH = 100  # AF_UNIX paths are limited to 107 bytes on Linux
LIGHT_ENV = {"PYTHONUNBUFFERED": "1", **dict.fromkeys(THREAD_VARS, "1")}


@dataclass(frozen=True)
class _Ctx:
    """What every process of one plan shares."""

    job: JobSpec
    run: Path
    job_file: str
    model_dir: str
    python: str
    hosts: Sequence[str]
    ports: Iterator[int]

    @property
    def logs(self) -> Path:
        return self.run / "logs"

    def port(self) -> int:
        try:
            return int(next(self.ports))
        except StopIteration:
            raise PlanError("the plan needs more ports than were given (see ports_needed)") from None

    def role_argv(self, module: str, *args: str) -> list[str]:
        return [self.python, "-m", module, "--job", self.job_file, *args]


def plan(
    job: JobSpec,
    run_dir: str | Path,
    *,
    model_dir: str,
    job_file: str | Path | None = None,
    hosts: Sequence[str] | None = None,
    ports: Iterable[int] | None = None,
    python: str = sys.executable,
    transport: Literal["auto", "ipc", "tcp"] = "auto",
    resume_step: int | None = None,
) -> Plan:
    """Every process of `job`, placed and addressed. Pure: same inputs, same plan.

    `hosts` are the nodes' addresses (default 127.0.0.1 on one node, node-0, node-1, ... as
    placeholders otherwise); `ports` is where ports are drawn from, in a fixed order (default
    29500, 29501, ...); `transport` "tcp" forces a tcp buffer address on one node (a Ray cluster
    whose driver is not on that node).
    """
    run, lc = Path(run_dir), job.launcher
    if hosts is None:
        hosts = ["127.0.0.1"] if lc.nodes == 1 else [f"node-{i}" for i in range(lc.nodes)]
    if len(hosts) != lc.nodes:
        raise PlanError(
            f"launcher.nodes is {lc.nodes} but {len(hosts)} host addresses were given: {list(hosts)}"
        )
    ctx = _Ctx(
        job=job,
        run=run,
        job_file=str(job_file) if job_file is not None else str(run / "job.yaml"),
        model_dir=model_dir,
        python=python,
        hosts=hosts,
        ports=iter(ports) if ports is not None else itertools.count(DEFAULT_BASE_PORT),
    )
    learner_gpus, engine_gpus = place_gpus(job)
    buffer = _buffer(ctx, tcp=transport == "tcp" or (transport == "auto" and lc.nodes > 1))
    buffer_address = buffer.argv[buffer.argv.index("--address") + 1]
    engines = _engines(ctx, engine_gpus)
    engine_urls = [s.ready.target.removesuffix("/health") for s in engines]
    attach_urls = [u.rstrip("/") for u in job.engine.urls] if isinstance(job.engine, SGLangEngine) else []
    engines_arg = ",".join(engine_urls + attach_urls)
    master_node = learner_gpus[0][0] if learner_gpus else 0
    master = ("127.0.0.1" if lc.nodes == 1 else hosts[master_node], ctx.port())
    return Plan(
        job=job.name,
        kind=lc.kind,
        run_dir=str(run),
        job_file=ctx.job_file,
        model_dir=model_dir,
        nodes=lc.nodes,
        gpus_per_node=lc.gpus_per_node,
        hosts=list(hosts),
        buffer_address=buffer_address,
        engine_urls=engine_urls,
        attach_urls=attach_urls,
        master_addr=master[0],
        master_port=master[1],
        restart=RestartPolicy(on_failure=lc.on_failure, max_restarts=lc.max_restarts),
        processes=[
            buffer,
            *_sandbox_workers(ctx),
            *engines,
            *_generators(ctx, buffer_address, engines_arg),
            *_learner_ranks(ctx, buffer_address, engines_arg, learner_gpus, master),
        ],
        resume_step=resume_step,
    )


def _buffer(ctx: _Ctx, tcp: bool) -> ProcessSpec:
    if tcp:
        address = f"tcp://{ctx.hosts[0]}:{ctx.port()}"
        probe = Probe(kind="tcp", target=address.removeprefix("tcp://"), timeout_s=120.0)
    else:
        address = f"ipc://{ipc_path(ctx.run)}"
        probe = Probe(kind="path", target=ipc_path(ctx.run), timeout_s=120.0)
    return ProcessSpec(
        name="buffer",
        role="buffer",
        argv=ctx.role_argv("workers.buffer", "--address", address)
        + ["--log-file", str(ctx.logs / "buffer.jsonl"), "--metrics-dir", str(ctx.run)],
        env=dict(LIGHT_ENV),
        node=0,
        stage=0,
        resources=Resources(cpus=1),
        log_path=str(ctx.logs / "buffer.log"),
        ready=probe,
        resume_args=["--resume", "{checkpoint}/buffer.snapshot"],
        restart_scope="job",
    )


def _engines(ctx: _Ctx, engine_gpus: list[tuple[int, list[int]]]) -> list[ProcessSpec]:
    """The engine servers this job starts (none when it attaches to engine.urls)."""
    engine, nodes = ctx.job.engine, len(ctx.hosts)
    if isinstance(engine, SGLangEngine) and engine.urls:
        return []
    procs = []
    for i in range(engine.count):
        node, gpus = engine_gpus[i] if engine_gpus else (i % nodes, [])
        port = ctx.port()
        url = f"http://{ctx.hosts[node]}:{port}"
        bind = "127.0.0.1" if nodes == 1 else "0.0.0.0"
        argv = build_command(engine, ctx.model_dir, host=bind, port=port, python=ctx.python)
        env = {"PYTHONUNBUFFERED": "1"}
        if isinstance(engine, EmbeddedEngine):
            argv += ["--dtype", ctx.job.model.dtype, "--seed", str(ctx.job.train.seed + i)]
            argv += ["--log-level", ctx.job.logging.level]
            env.update(_threads(engine.threads))
            res, timeout_s = Resources(cpus=engine.threads), 300.0
        else:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
            res, timeout_s = Resources(cpus=1, gpus=len(gpus), gpu_ids=list(gpus)), 1800.0
        procs.append(
            ProcessSpec(
                name=f"engine-{i}",
                role="engine",
                argv=argv,
                env=env,
                node=node,
                stage=1,
                resources=res,
                log_path=str(ctx.logs / f"engine-{i}.log"),
                ready=Probe(kind="http", target=url + "/health", timeout_s=timeout_s),
                stop_grace_s=15.0,
            )
        )
    return procs


def _generators(ctx: _Ctx, buffer_address: str, engines_arg: str) -> list[ProcessSpec]:
    job = ctx.job
    cpus = 1 + job.reward.workers  # the event loop and the reward pool's processes
    if job.rollout.agent == "rstar2_tool" and isinstance(job.sandbox, EmbeddedSandbox):
        cpus += job.sandbox.max_workers  # the embedded sandbox pool lives in the generator too
    procs = []
    for i in range(job.launcher.generators):
        name = f"gen-{i}"
        procs.append(
            ProcessSpec(
                name=name,
                role="generator",
                argv=ctx.role_argv("workers.generator", "--buffer", buffer_address, "--engines", engines_arg)
                + ["--model", ctx.model_dir, "--name", name]
                + ["--log-file", str(ctx.logs / f"{name}.jsonl"), "--metrics-dir", str(ctx.run)],
                env={**LIGHT_ENV, "TOKENIZERS_PARALLELISM": "false"},
                node=i % len(ctx.hosts),
                stage=2,
                resources=Resources(cpus=cpus),
                log_path=str(ctx.logs / f"{name}.log"),
            )
        )
    return procs


def _learner_ranks(
    ctx: _Ctx,
    buffer_address: str,
    engines_arg: str,
    learner_gpus: list[tuple[int, int]],
    master: tuple[str, int],
) -> list[ProcessSpec]:
    job = ctx.job
    world = job.learner.tp * job.learner.pp * job.learner.dp
    nodes_of = [learner_gpus[r][0] if learner_gpus else 0 for r in range(world)]
    on_gpu = bool(learner_gpus)
    # learner.threads unset: torch's default for a single CPU rank, one thread per rank otherwise
    # (as torchrun does), since the GPUs do the work.
    threads = job.learner.threads or (1 if world > 1 or on_gpu else None)
    procs = []
    for rank in range(world):
        node = nodes_of[rank]
        same_node = [r for r in range(world) if nodes_of[r] == node]
        local_rank = same_node.index(rank)
        name = "learner" if world == 1 else f"learner-{rank}"
        env = {
            "PYTHONUNBUFFERED": "1",
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(len(same_node)),
            "GROUP_RANK": str(node),
            "MASTER_ADDR": master[0],
            "MASTER_PORT": str(master[1]),
        }
        if threads is not None:
            env.update(_threads(threads))
        gpu_ids = [learner_gpus[rank][1]] if on_gpu else []
        if on_gpu:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(learner_gpus[r][1]) for r in same_node)
            if job.learner.backend == "megatron":
                env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # Megatron's TP/SP comm ordering needs it
        procs.append(
            ProcessSpec(
                name=name,
                role="learner",
                argv=ctx.role_argv("workers.learner", "--buffer", buffer_address, "--engines", engines_arg)
                + ["--model", ctx.model_dir, "--run-dir", str(ctx.run)]
                + ["--log-file", str(ctx.logs / f"{name}.jsonl")],
                env=env,
                node=node,
                stage=3,
                resources=Resources(cpus=threads or 1, gpus=len(gpu_ids), gpu_ids=gpu_ids),
                log_path=str(ctx.logs / f"{name}.log"),
                rank=rank,
                world_size=world,
                local_rank=local_rank,
                resume_args=["--resume"],
                restart_scope="job",
                gang="learner",
                # SIGTERM asks for a checkpoint: a big sharded model needs minutes to write one.
                stop_grace_s=900.0 if on_gpu else 120.0,
            )
        )
    return procs


def _sandbox_workers(ctx: _Ctx) -> list[ProcessSpec]:
    """Redis sandbox workers the job starts itself: one process per node, the slots split evenly
    (Code Judge's run_workers.py with MAX_WORKERS per node)."""
    sb = ctx.job.sandbox
    if not isinstance(sb, RedisSandbox) or sb.workers == 0:
        return []
    nodes = min(len(ctx.hosts), sb.workers)
    procs = []
    for node in range(nodes):
        slots = sb.workers // nodes + (1 if node < sb.workers % nodes else 0)
        name = f"sandbox-{node}"
        procs.append(
            ProcessSpec(
                name=name,
                role="sandbox",
                argv=[
                    ctx.python,
                    "-m",
                    "sandbox_bridge.redis_worker",
                    "--redis",
                    sb.url,
                    "--workers",
                    str(slots),
                ]
                + ["--timeout-s", str(sb.timeout_s), "--memory-mb", str(sb.memory_mb)]
                + ["--log-level", ctx.job.logging.level],
                env=dict(LIGHT_ENV),
                node=node,
                stage=0,
                resources=Resources(cpus=slots),
                log_path=str(ctx.logs / f"{name}.log"),
                stop_grace_s=20.0,  # running jobs finish; their leases make a kill safe anyway
            )
        )
    return procs


def place_gpus(job: JobSpec) -> tuple[list[tuple[int, int]], list[tuple[int, list[int]]]]:
    """(node, gpu) of each learner rank, and (node, gpus) of each started SGLang engine.

    Both empty on CPU. Learner ranks fill GPUs node by node from GPU 0; an engine's `tp_size` GPUs
    are on one node, the first node with that many free.
    """
    lc = job.launcher
    per_node = lc.gpus_per_node
    if per_node == 0:
        return [], []
    free = [list(range(per_node)) for _ in range(lc.nodes)]
    world = job.learner.tp * job.learner.pp * job.learner.dp
    learner: list[tuple[int, int]] = []
    for node in range(lc.nodes):
        while free[node] and len(learner) < world:
            learner.append((node, free[node].pop(0)))
    if len(learner) < world:
        raise PlanError(
            f"learner tp*pp*dp = {world} ranks need {world} GPUs; "
            f"launcher.nodes x gpus_per_node = {lc.nodes} x {per_node}"
        )
    engines: list[tuple[int, list[int]]] = []
    eng = job.engine
    if isinstance(eng, SGLangEngine) and not eng.urls:
        if eng.tp_size > per_node:
            raise PlanError(f"engine.tp_size {eng.tp_size} exceeds launcher.gpus_per_node {per_node}")
        for i in range(eng.count):
            node = next((n for n in range(lc.nodes) if len(free[n]) >= eng.tp_size), None)
            if node is None:
                raise PlanError(
                    f"engine {i} of {eng.count} (tp_size {eng.tp_size}) does not fit: "
                    f"free GPUs per node after the learner's {world}: {[len(f) for f in free]}"
                )
            engines.append((node, free[node][: eng.tp_size]))
            del free[node][: eng.tp_size]
    return learner, engines


def ipc_path(run_dir: Path) -> str:
    """The buffer's socket in the run folder, or in /tmp (named by a hash of the folder) when the
    run folder's path is too long for a Unix socket."""
    path = str(Path(run_dir) / "buffer.sock")
    if len(path) <= MAX_IPC_PATH:
        return path
    digest = hashlib.sha1(str(run_dir).encode()).hexdigest()[:16]
    return f"/tmp/streamrl-{digest}.sock"


def _threads(n: int) -> dict[str, str]:
    return dict.fromkeys(THREAD_VARS, str(n))


def ports_needed(job: JobSpec) -> int:
    """How many ports `plan` draws at most: buffer (tcp only), one per started engine, the learner's master."""
    eng = job.engine
    started = 0 if isinstance(eng, SGLangEngine) and eng.urls else eng.count
    return 1 + started + 1
