"""What a launch plan is made of: processes with their command, environment, place, resources,
readiness probe and failure handling. Plain msgspec Structs, so a plan is written to and read from
`RUN_DIR/plan.json` as is (plan.py makes them; the launchers run them)."""

from __future__ import annotations

from typing import Literal

import msgspec

from streamrl.errors import ConfigError

Role = Literal["buffer", "sandbox", "engine", "generator", "learner"]


class PlanError(ConfigError):
    """The job cannot be placed as specified (GPUs, nodes); the message says what does not fit."""


class Probe(msgspec.Struct, frozen=True, kw_only=True):
    """How to tell that a started process is ready: an HTTP 200, a socket file, a tcp connect."""

    kind: Literal["none", "http", "path", "tcp"] = "none"
    target: str = ""
    timeout_s: float = 0.0


class Resources(msgspec.Struct, frozen=True, kw_only=True):
    cpus: float
    gpus: int = 0
    gpu_ids: list[int] = []
    """The planned GPUs on the process's node (the Ray launcher maps them to what Ray assigns)."""


class ProcessSpec(msgspec.Struct, kw_only=True):
    name: str
    role: Role
    argv: list[str]
    env: dict[str, str]
    node: int
    stage: int
    resources: Resources
    log_path: str
    """stdout and stderr of the process (appended across restarts)."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    ready: Probe = Probe()
    resume_args: list[str] = []
    restart_scope: Literal["self", "job"] = "self"
    gang: str = ""
    """Restarts are counted per gang (all learner ranks form one); empty means the process name."""
    stop_grace_s: float = 10.0
    """Seconds between SIGTERM and SIGKILL when stopping (the learner checkpoints in this time)."""

    def start_argv(self, checkpoint_dir: str | None) -> list[str]:
        """The command line, continuing from `checkpoint_dir` when given."""
        if checkpoint_dir is None:
            return list(self.argv)
        return self.argv + [a.replace("{checkpoint}", checkpoint_dir) for a in self.resume_args]

    @property
    def gang_name(self) -> str:
        return self.gang or self.name


class RestartPolicy(msgspec.Struct, frozen=True, kw_only=True):
    on_failure: Literal["stop", "restart"] = "restart"
    max_restarts: int = 3


class Plan(msgspec.Struct, kw_only=True):
    job: str
    kind: Literal["local", "ray"]
    run_dir: str
    job_file: str
    model_dir: str
    nodes: int
    gpus_per_node: int
    hosts: list[str]
    buffer_address: str
    engine_urls: list[str]
    attach_urls: list[str]
    """Engine servers started elsewhere (engine.urls): waited for, never started or stopped."""
    master_addr: str
    master_port: int
    restart: RestartPolicy
    processes: list[ProcessSpec]
    resume_step: int | None = None
    """The checkpoint step the run starts from (`streamrl launch --resume`)."""

    def stages(self) -> list[list[ProcessSpec]]:
        """Processes grouped by stage, in start order."""
        keys = sorted({p.stage for p in self.processes})
        return [[p for p in self.processes if p.stage == s] for s in keys]

    def by_role(self, role: Role) -> list[ProcessSpec]:
        return [p for p in self.processes if p.role == role]


def to_json(p: Plan) -> bytes:
    return msgspec.json.format(msgspec.json.encode(p), indent=2)


def from_json(data: bytes | str) -> Plan:
    return msgspec.json.decode(data, type=Plan)
