"""structlog set-up: one JSON line per event, with role, rank, step and policy version bound.

Each role process calls `configure(role=..., rank=...)` once at start; per-step context is bound
with `bind(step=..., policy_version=...)` and is carried by every later record of that process.
Module loggers come from `get_logger(__name__)`. (Named log.py, not logging.py, so it never shadows
the standard library module inside this package.)
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, TextIO

import structlog

_open_file: TextIO | None = None  # the JSON log file of this process, closed on reconfiguration
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure(
    role: str,
    rank: int = 0,
    level: str = "info",
    json_file: str | Path | None = None,
    stream: TextIO | None = None,
) -> None:
    """Route structlog to JSON lines on `stream` (stderr) or appended to `json_file`."""
    global _open_file
    if _open_file is not None:
        _open_file.close()
        _open_file = None
    out: TextIO
    if json_file is not None:
        Path(json_file).parent.mkdir(parents=True, exist_ok=True)
        out = _open_file = open(json_file, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    else:
        out = stream or sys.stderr
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.WriteLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(role=role, rank=rank, pid=os.getpid())


def bind(**values: Any) -> None:
    """Attach values (step, policy_version, ...) to every later record of this process."""
    structlog.contextvars.bind_contextvars(**values)


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)
