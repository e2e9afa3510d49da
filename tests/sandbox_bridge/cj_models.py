"""Code Judge 0.0.5's pydantic models (app/model.py, as code_judge.md 2.2-2.3 and 3.2 give them).

Used only as a conformance oracle: our msgspec encodings must be byte-identical to what these
models dump, and our 422 bodies must match what FastAPI derives from their validation errors.
pydantic is not a streamrl dependency; tests that need it skip without it.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

import pytest

pydantic = pytest.importorskip("pydantic")
BaseModel, Field = pydantic.BaseModel, pydantic.Field


class CJSubmission(BaseModel):
    sub_id: str | None = None
    type: Literal["python", "cpp", "math"]
    options: dict[str, str] | None = None
    solution: str
    input: str | None = None
    expected_output: str | None = None


class CJResultReason(Enum):
    UNSPECIFIED = ""
    INTERNAL_ERROR = "internal_error"
    WORKER_TIMEOUT = "worker_timeout"
    QUEUE_TIMEOUT = "queue_timeout"
    INVALID_INPUT = "invalid_input"


class CJSubmissionResult(BaseModel):
    sub_id: str
    success: bool
    run_success: bool
    cost: float
    stdout: str | None = None
    stderr: str | None = None
    reason: CJResultReason = CJResultReason.UNSPECIFIED


class CJBatchSubmission(BaseModel):
    sub_id: str | None = None
    type: Literal["batch"] = "batch"
    submissions: list[CJSubmission] = Field(..., min_length=1)


class CJWorkPayload(BaseModel):
    work_id: str | None = None
    timestamp: float | None = None
    long_running: bool = False
    submission: CJSubmission | CJBatchSubmission = Field(..., discriminator="type")


def fastapi_422(model: type[Any], body: Any) -> list[dict[str, Any]]:
    """The `detail` list FastAPI returns for `body` posted to an endpoint taking `model`.

    FastAPI validates bodies with `validate_python(value, from_attributes=True)` and treats a `null`
    body as missing (fastapi/_compat.py, fastapi/routing.py).
    """
    if body is None:
        return [{"type": "missing", "loc": ["body"], "msg": "Field required", "input": None}]
    try:
        model.model_validate(body, from_attributes=True)
    except pydantic.ValidationError as exc:
        return [
            {k: v for k, v in {**e, "loc": ["body", *e["loc"]]}.items() if k != "url"}
            for e in exc.errors(include_url=False)
        ]
    return []
