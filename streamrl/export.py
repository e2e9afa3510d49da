"""`streamrl export RUN_DIR --step K --out DIR`: a learner checkpoint as a Hugging Face model folder.

The checkpoint is loaded by the same backend that wrote it, with the same number of ranks (a
Megatron TP=2 checkpoint is two shards), then the backend's `export_hf` writes config.json,
model.safetensors and the tokenizer, which transformers (and SGLang) load directly.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch.multiprocessing as mp

from streamrl import checkpoint
from streamrl.config import JobSpec
from streamrl.config_load import load_job_or_exit
from streamrl.errors import ConfigError


def model_dir(spec: JobSpec) -> Path:
    """The initial model folder of a job (the tiny model is built once and cached)."""
    if spec.model.path is not None:
        return Path(spec.model.path)
    from streamrl.tiny import ensure

    assert spec.model.tiny is not None
    return ensure(spec.model.tiny)


def _export_rank(rank: int, world: int, port: int, job: str, step_dir: Path, out: Path) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    from workers.learner import init_distributed, make_backend

    spec = load_job_or_exit(job)
    init_distributed()
    try:
        backend = make_backend(spec, model_dir(spec))
        backend.load(step_dir / checkpoint.LEARNER)
        backend.export_hf(out)
    finally:
        dist.destroy_process_group()


def export(run_dir: Path, step: int | None, out: Path) -> Path:
    """Export the checkpoint of `step` (default: the latest) of `run_dir` into `out`."""
    from workers.learner import _free_port

    job = run_dir / "job.yaml"
    if not job.is_file():
        raise ConfigError(f"{run_dir}: not a run directory (no job.yaml)")
    spec = load_job_or_exit(str(job))
    step = checkpoint.require_latest(run_dir) if step is None else step
    d = checkpoint.step_dir(run_dir, step)
    if not (d / checkpoint.LEARNER).is_dir():
        raise ConfigError(f"{run_dir}: no learner checkpoint for step {step} ({d / checkpoint.LEARNER})")
    world = spec.learner.tp * spec.learner.pp * spec.learner.dp
    port = _free_port()
    if world == 1:
        _export_rank(0, 1, port, str(job), d, out)
    else:
        mp.start_processes(
            _export_rank, args=(world, port, str(job), d, out), nprocs=world, start_method="spawn"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="streamrl export", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    ap.add_argument("--out", type=Path, required=True, help="folder for the Hugging Face checkpoint")
    args = ap.parse_args(argv)
    try:
        out = export(args.run_dir, args.step, args.out)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported step {args.step if args.step is not None else 'latest'} of {args.run_dir} to {out}")
    return 0
