"""Every log record is one JSON line carrying the role, rank, pid and the bound step and version."""

from __future__ import annotations

import io
import json

from streamrl import log


def test_records_are_json_lines_with_role_rank_step_and_policy_version() -> None:
    out = io.StringIO()
    log.configure("learner", rank=3, level="info", stream=out)
    logger = log.get_logger("t")
    logger.info("started")
    log.bind(step=7, policy_version=6)
    logger.info("train_step", loss=0.5)
    logger.debug("hidden")  # below the level
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert (
        first["event"] == "started" and first["role"] == "learner" and first["rank"] == 3 and "pid" in first
    )
    assert "step" not in first
    assert (second["step"], second["policy_version"], second["loss"]) == (7, 6, 0.5)
    assert second["level"] == "info" and second["timestamp"].endswith("Z")


def test_configure_can_append_to_a_file(tmp_path) -> None:
    path = tmp_path / "logs" / "buffer.jsonl"
    log.configure("buffer", json_file=path)
    log.get_logger("t").warning("careful", n=1)
    log.configure("buffer")  # back to stderr: closes the file
    rec = json.loads(path.read_text().splitlines()[-1])
    assert (rec["role"], rec["event"], rec["n"], rec["level"]) == ("buffer", "careful", 1, "warning")
