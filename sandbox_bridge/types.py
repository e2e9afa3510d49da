"""Code Judge 0.0.5 request and result schemas (see ../shared/reference/code_judge.md section 2).

These are the shapes on Code Judge's HTTP API and in its Redis payloads; field names and the
`reason` strings must stay byte-compatible. `isolation` is streamrl's addition: which isolation
level ran the job. It is left out of Code Judge-compatible encodings (`to_codejudge`).
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

import msgspec

Reason = Literal["", "internal_error", "worker_timeout", "queue_timeout", "invalid_input"]
SubmissionType = Literal["python", "cpp", "math"]


def new_id() -> str:
    return str(uuid.uuid4())


class Submission(msgspec.Struct, kw_only=True):
    type: SubmissionType
    solution: str
    input: str | None = None
    expected_output: str | None = None
    sub_id: str | None = None
    options: dict[str, str] | None = None


class BatchSubmission(msgspec.Struct, kw_only=True):
    submissions: list[Submission]
    type: Literal["batch"] = "batch"
    sub_id: str | None = None


class SubmissionResult(msgspec.Struct, kw_only=True):
    """The six fields every caller relies on, plus sub_id and streamrl's isolation label."""

    sub_id: str
    success: bool
    run_success: bool
    cost: float
    stdout: str | None = None
    stderr: str | None = None
    reason: Reason = ""
    isolation: str = ""

    def to_codejudge(self, with_output: bool = True) -> dict[str, Any]:
        """Code Judge's SubmissionResult (with_output) or JudgeResult (without) as a dict."""
        d: dict[str, Any] = {
            "sub_id": self.sub_id,
            "success": self.success,
            "run_success": self.run_success,
            "cost": self.cost,
        }
        if with_output:
            d["stdout"] = self.stdout
            d["stderr"] = self.stderr
        d["reason"] = self.reason
        return d


def internal_error(sub_id: str, isolation: str = "") -> SubmissionResult:
    return SubmissionResult(
        sub_id=sub_id,
        success=False,
        run_success=False,
        cost=0.0,
        reason="internal_error",
        isolation=isolation,
    )


def queue_timeout(sub_id: str, waited_s: float) -> SubmissionResult:
    return SubmissionResult(
        sub_id=sub_id, success=False, run_success=False, cost=waited_s, reason="queue_timeout"
    )
