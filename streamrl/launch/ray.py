"""The Ray launcher (`launcher.kind: ray`): the same plan, placed onto a Ray cluster.

    outcome = run_ray(lambda hosts: plan(job, run_dir, model_dir=..., hosts=hosts), nodes=4)

One placement group per planned node (STRICT_PACK: a node's processes land together), one bundle
per process with its CPUs and GPUs. Each process runs as a subprocess of a small Ray actor scheduled
into its bundle; the actor reports the exit code, signals the process group, and the subprocess
gets SIGTERM if the actor dies (the same shim as the local launcher). The supervisor (start order,
restarts, clean stop) is the local one, driving handles that talk to the actors.

Hosts are known only once the placement groups are ready, so the plan is made twice: once for the
resources, once with the nodes' addresses (tcp:// buffer, engine URLs, MASTER_ADDR). GPUs are the
ones Ray assigned: each engine sees its bundle's GPUs, and every learner rank on a node sees all the
learner GPUs of that node in local-rank order (so cuda:LOCAL_RANK is its own, as with torchrun).

Assumptions: every node sees the run folder, the model folder and this Python at the same paths
(a shared file system, as RLinf and verl assume). Ray is an optional extra (`pip install
streamrl[ray]`); it is imported only here. A local cluster is started when `launcher.ray_address`
is empty: no dashboard, a small object store, RAY_AUTH_MODE=disabled.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from streamrl import log
from streamrl.config import JobSpec
from streamrl.errors import WorkerFailed
from streamrl.launch.plan import DEFAULT_BASE_PORT, Plan, ProcessSpec, plan, ports_needed
from streamrl.launch.supervisor import Outcome, Supervisor

logger = log.get_logger("streamrl.launch.ray")
PLACEMENT_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 60.0
LOST = -9  # the exit code reported for a process whose actor (or node) is gone


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise WorkerFailed(
            "launcher.kind: ray needs Ray: pip install 'streamrl[ray]' (ray==2.60.0)"
        ) from None
    return ray


def init_ray(ray: Any, address: str | None, cpus: float) -> bool:
    """Connect to `address`, or start a small local cluster. True if this call started Ray."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no token file under ~/.ray
    if address:
        ray.init(address=address, log_to_driver=False)
        return True
    ray.init(
        num_cpus=max(2, math.ceil(cpus)),  # logical CPUs: enough for the plan's bundles on this host
        include_dashboard=False,
        object_store_memory=100 * 1024 * 1024,  # only small control messages travel through Ray
        log_to_driver=False,
    )
    return True


def _actor_class(ray: Any) -> Any:
    from streamrl.launch.local import shim_argv

    class RoleActor:
        """Runs one process of the plan as its subprocess (own session) and reports on it."""

        def __init__(self) -> None:
            self.proc: Any = None

        def info(self) -> dict[str, Any]:
            return {
                "node_id": ray.get_runtime_context().get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            }

        def start(self, argv: list[str], env: dict[str, str], log_path: str, cwd: str) -> int:
            import subprocess

            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "ab") as out:
                self.proc = subprocess.Popen(
                    shim_argv(argv, os.getpid()),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **env},
                    cwd=cwd,
                    start_new_session=True,
                )
            return int(self.proc.pid)

        def poll(self) -> int | None:
            return None if self.proc is None else self.proc.poll()

        def signal(self, sig: int) -> None:
            if self.proc is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, sig)

        def cleanup(self) -> None:
            if self.proc is not None and self.proc.poll() is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, 9)

    return ray.remote(num_cpus=0)(RoleActor)


class RayHandle:
    def __init__(self, ray: Any, actor: Any, pid: int) -> None:
        self.ray, self.actor, self.pid = ray, actor, pid
        self._lost = False

    def _call(self, method: str, *args: Any) -> Any:
        return self.ray.get(getattr(self.actor, method).remote(*args), timeout=CALL_TIMEOUT_S)

    def poll(self) -> int | None:
        if self._lost:
            return LOST
        try:
            return self._call("poll")
        except Exception as e:  # RayActorError, GetTimeoutError: the actor or its node is gone
            logger.error("actor_lost", pid=self.pid, error=str(e))
            self._lost = True
            return LOST

    def signal(self, sig: int) -> None:
        if not self._lost:
            with contextlib.suppress(Exception):
                self._call("signal", int(sig))

    def cleanup(self) -> None:
        if not self._lost:
            with contextlib.suppress(Exception):
                self._call("cleanup")


def bundle(spec: ProcessSpec) -> dict[str, float]:
    res: dict[str, float] = {"CPU": float(spec.resources.cpus)}
    if spec.resources.gpus:
        res["GPU"] = float(spec.resources.gpus)
    return res


def ray_gpu_env(p: Plan, assigned: dict[str, tuple[str, list[str]]]) -> dict[str, dict[str, str]]:
    """CUDA_VISIBLE_DEVICES per process from what Ray assigned: name -> (node id, GPU ids).

    Engines see their own GPUs; each learner rank sees the learner GPUs of its node ordered by local
    rank, so device LOCAL_RANK is its own and NCCL sees its peers (as Ray Train does).
    """
    env: dict[str, dict[str, str]] = {}
    learners = sorted(p.by_role("learner"), key=lambda s: s.local_rank)
    for s in p.processes:
        if not s.resources.gpus:
            continue
        node, ids = assigned[s.name]
        if s.role == "learner":
            same = [
                assigned[q.name][1][0] for q in learners if assigned[q.name][0] == node and q.resources.gpus
            ]
            env[s.name] = {"CUDA_VISIBLE_DEVICES": ",".join(same)}
        else:
            env[s.name] = {"CUDA_VISIBLE_DEVICES": ",".join(ids)}
    return env


def run_ray(
    make_plan: Callable[[Sequence[str] | None, Sequence[int] | None], Plan],
    *,
    address: str | None = None,
    write_plan: Callable[[Plan], None] | None = None,
    placement_timeout_s: float = PLACEMENT_TIMEOUT_S,
    **supervisor_args: Any,
) -> Outcome:
    """Place `make_plan(hosts, ports)` on Ray and supervise it (None: the plan's defaults)."""
    ray = import_ray()
    from ray.util.placement_group import remove_placement_group

    draft = make_plan(None, None)
    started_here = init_ray(ray, address, sum(s.resources.cpus for s in draft.processes))
    pgs: list[Any] = []
    actors: _Actors | None = None
    try:
        pgs = _place(ray, draft, placement_timeout_s)
        hosts, ports = _hosts_and_ports(ray, pgs)
        final = make_plan(hosts, ports)
        if [(s.name, s.node, bundle(s)) for s in final.processes] != [
            (s.name, s.node, bundle(s)) for s in draft.processes
        ]:
            raise WorkerFailed(
                "the plan changed between placement and start (make_plan must be deterministic)"
            )
        if write_plan is not None:
            write_plan(final)
        actors = _Actors(ray, final, pgs, placement_timeout_s)
        sup = Supervisor(final, actors.start, poll_s=supervisor_args.pop("poll_s", 0.5), **supervisor_args)
        restore = sup.install_signal_handlers() if _in_main_thread() else None
        try:
            return sup.run()
        finally:
            if restore is not None:
                restore()
    finally:
        if actors is not None:
            actors.kill()
        for pg in pgs:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        if started_here:
            ray.shutdown()


def _place(ray: Any, draft: Plan, timeout_s: float) -> list[Any]:
    """One STRICT_PACK placement group per planned node, ready within `timeout_s`."""
    from ray.util.placement_group import placement_group

    pgs = []
    for node in range(draft.nodes):
        bundles = [bundle(s) for s in draft.processes if s.node == node]
        pgs.append(placement_group(bundles, strategy="STRICT_PACK", name=f"{draft.job}-node{node}"))
    try:
        ray.get([pg.ready() for pg in pgs], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        need = [
            {k: sum(bundle(s).get(k, 0) for s in draft.processes if s.node == n) for k in ("CPU", "GPU")}
            for n in range(draft.nodes)
        ]
        raise WorkerFailed(
            f"Ray could not place the job within {timeout_s:.0f} s: it needs per node {need}, "
            f"the cluster has {ray.available_resources()} available"
        ) from None
    return pgs


def _hosts_and_ports(ray: Any, pgs: list[Any]) -> tuple[list[str] | None, range | None]:
    """The nodes' addresses and a port range, or (None, None) when the whole cluster is this host
    (loopback addresses and this host's free ports then, as in a local run)."""
    from ray.util.placement_group import placement_group_table

    node_ip = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    here = ray.util.get_node_ip_address()
    if all(ip == here for ip in node_ip.values()):
        return None, None
    hosts = [node_ip[placement_group_table(pg)["bundles_to_node_id"][0]] for pg in pgs]
    return hosts, range(DEFAULT_BASE_PORT, DEFAULT_BASE_PORT + 1000)


class _Actors:
    """One RoleActor per process, in its bundle; `start` is the supervisor's Starter."""

    def __init__(self, ray: Any, p: Plan, pgs: list[Any], timeout_s: float) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.ray, self.cls, self.cwd = ray, _actor_class(ray), os.getcwd()
        self.options: dict[str, dict[str, Any]] = {}
        for node, pg in enumerate(pgs):
            for i, s in enumerate(q for q in p.processes if q.node == node):
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=i
                )
                self.options[s.name] = dict(
                    num_cpus=s.resources.cpus, num_gpus=s.resources.gpus, scheduling_strategy=strategy
                )
        self.actors = {name: self.cls.options(**opts).remote() for name, opts in self.options.items()}
        infos = ray.get([a.info.remote() for a in self.actors.values()], timeout=timeout_s)
        assigned = {n: (i["node_id"], i["gpu_ids"]) for n, i in zip(self.actors, infos, strict=True)}
        self.gpu_env = ray_gpu_env(p, assigned)

    def start(self, spec: ProcessSpec, argv: list[str]) -> RayHandle:
        env = {**spec.env, **self.gpu_env.get(spec.name, {})}
        for attempt in range(2):
            actor = self.actors[spec.name]
            try:
                pid = self.ray.get(
                    actor.start.remote(argv, env, spec.log_path, self.cwd), timeout=CALL_TIMEOUT_S
                )
                return RayHandle(self.ray, actor, pid)
            except Exception as e:  # the actor died (its process or node): a new one in the same bundle
                logger.warning("actor_replaced", name=spec.name, error=str(e))
                if attempt:
                    raise WorkerFailed(f"{spec.name}: cannot start it on Ray: {e}") from e
                self.actors[spec.name] = self.cls.options(**self.options[spec.name]).remote()
        raise AssertionError("unreachable")

    def kill(self) -> None:
        for a in self.actors.values():
            with contextlib.suppress(Exception):
                self.ray.kill(a)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def launch_ray(
    spec: JobSpec, run_dir: Path, *, model_dir: str, resume_step: int | None = None, **supervisor_args: Any
) -> Outcome:
    """`streamrl launch` for `launcher.kind: ray`: the job's plan on the cluster at `ray_address`."""
    from streamrl.launch.run import free_ports, write_plan

    address = spec.launcher.ray_address
    local_ports = None if address else free_ports(ports_needed(spec))

    def make(hosts: Sequence[str] | None, ports: Sequence[int] | None) -> Plan:
        return plan(
            spec,
            run_dir,
            model_dir=model_dir,
            hosts=hosts,
            ports=ports if ports is not None else local_ports,
            transport="tcp" if address else "auto",
            resume_step=resume_step,
        )

    return run_ray(make, address=address, write_plan=write_plan, **supervisor_args)
