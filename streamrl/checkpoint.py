"""Where a run keeps its checkpoints, and which one is the latest.

    RUN_DIR/checkpoints/step_000009/learner/         backend state (every learner rank writes its part)
    RUN_DIR/checkpoints/step_000009/buffer.snapshot  the buffer's state as of the same step
    RUN_DIR/checkpoints/latest                       "9": written last, so it only ever names a
                                                     checkpoint whose two halves are both complete

Steps count from 0; the checkpoint of step k holds the policy after step k (weight version k + 1),
and a resumed run continues with step k + 1. Invariant 6 of ARCHITECTURE.md rests on the pairing:
the buffer snapshot knows which groups were trained up to step k, the learner state matches it.
"""

from __future__ import annotations

import os
from pathlib import Path

from streamrl.errors import ConfigError

LEARNER = "learner"
BUFFER_SNAPSHOT = "buffer.snapshot"


def root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: Path, step: int) -> Path:
    return root(run_dir) / f"step_{step:06d}"


def mark_latest(run_dir: Path, step: int) -> None:
    """Atomically point `latest` at `step` (call only once both halves are on disk)."""
    tmp = root(run_dir) / f".latest.tmp-{os.getpid()}"
    tmp.write_text(f"{step}\n")
    os.replace(tmp, root(run_dir) / "latest")


def latest(run_dir: Path) -> int | None:
    """The step of the newest complete checkpoint, or None when the run has none."""
    path = root(run_dir) / "latest"
    if not path.is_file():
        return None
    text = path.read_text().strip()
    if not text.isdigit():
        raise ConfigError(f"{path}: expected a step number, found {text!r}")
    step = int(text)
    if not (step_dir(run_dir, step) / BUFFER_SNAPSHOT).is_file():
        raise ConfigError(f"{path} names step {step}, but {step_dir(run_dir, step)} is incomplete")
    return step


def require_latest(run_dir: Path) -> int:
    step = latest(run_dir)
    if step is None:
        raise ConfigError(f"{run_dir}: no checkpoint to resume from (no {root(run_dir) / 'latest'})")
    return step
